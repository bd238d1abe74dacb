"""Settings that fall back to the environment when a resource's config leaves them unset.

Dagster replaces a resource's whole configuration when a launchpad sets any part of it: a run
config of `{concurrency: 2000}` for `completions_backend` used to drop the environment-derived
backend and silently fall back to the local model. Fields that come from the environment are
therefore `None` by default and resolved here at use time: an explicit config value wins, then
the environment variable, then the documented default. Secrets read this way never enter config.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def setting(value: T | None, env: str, default: Any = None, cast: Callable[[str], Any] = str) -> Any:
    """The configured value, else `$env` (cast), else `default`."""
    if value is not None:
        return value
    raw = os.environ.get(env)
    if raw is None or raw == "":
        return default
    try:
        return cast(raw)
    except ValueError:
        raise ValueError(
            f"environment variable {env}={raw!r} is not a valid {getattr(cast, '__name__', 'value')}"
        ) from None


def source(value: Any, env: str) -> str:
    """Where a setting came from, for metadata: 'config', '$ENV' or 'default'."""
    if value is not None:
        return "config"
    return f"${env}" if os.environ.get(env) else "default"
