"""The one place where the project's errors become Dagster failures, each ending with the operator's next step.

Every error of the project derives from `eagle3_resources.errors.Eagle3Error` and carries `what_to_do`. An
asset wraps its body with `@failure_for_operator` (under `@dg.asset`): an `Eagle3Error` that escapes becomes a
`dagster.Failure` whose description is the error's message followed by "What to do: ..." and whose metadata
names the error class and what to do. Where an asset knows more than the error (the dataset, the journal that
keeps the finished responses), it raises `operator_failure(e, before=..., after=...)` itself; the same text
results. The error stays the failure's cause (`raise ... from e`), so the event log keeps its class and traceback.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import dagster as dg

from eagle3_resources.errors import Eagle3Error

F = TypeVar("F", bound=Callable[..., Any])


def operator_failure(error: Eagle3Error, before: str = "", after: str = "") -> dg.Failure:
    """The Dagster failure for a project error: `before` + its message + `after`, then what to do next."""
    return dg.Failure(
        description=f"{before}{error}{after}\n\nWhat to do: {error.what_to_do}",
        metadata={"error": type(error).__name__, "what_to_do": error.what_to_do},
    )


def failure_for_operator(fn: F) -> F:
    """An asset's body, with any project error that escapes it raised as `operator_failure(error)`.

    Works for a body that returns and for one that yields its results (a generator is wrapped as one, so an error
    raised while it is iterated is mapped too). Put it under `@dg.asset`: functools.wraps keeps the signature
    Dagster reads for the context, config and resources.
    """
    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def generator(*args, **kwargs):
            try:
                yield from fn(*args, **kwargs)
            except Eagle3Error as e:
                raise operator_failure(e) from e

        return generator  # type: ignore[return-value]

    @functools.wraps(fn)
    def function(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Eagle3Error as e:
            raise operator_failure(e) from e

    return function  # type: ignore[return-value]
