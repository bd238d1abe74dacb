"""Check failures that are the tiny stand-in target's, said so where they are read.

On a CPU the embedded defaults generate completions with the stand-in target (8 layers, hidden 64, fitted for a
couple of minutes): it writes `</think>` more than once, or not at all, in many answers, samples ids that are not
the canonical encoding of their text and now and then repeats itself until `max_tokens`. Three WARN checks fail on
its data (`token_ids`' two on every dataset, `truncated_share` now and then) with thresholds right for a real target.
Here, and only here, is each of those failures explained: a failing check's description gets its note, and its
metadata `standin: true`, when the data came from the stand-in; a passing check, and every check on a real target's
data (a target `path`, the OpenRouter or SGLang backends), keeps its text. The check functions stay plain: the asset
says whether its data is the stand-in's (`is_standin_target`) and applies `explained` to their outcomes.
`eagle3 status` tags such failures `(stand-in)`, read from the metadata entry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from eagle3_assets.common.outcome import CheckOutcome
from eagle3_resources.completions.resource import BackendKind

if TYPE_CHECKING:  # the target resource imports torch: `eagle3 status` reads this module and needs no torch
    from eagle3_resources.completions.resource import CompletionsResource
    from eagle3_resources.target.resource import TargetModelResource

STANDIN_TARGET = "the tiny stand-in target (8 layers, hidden 64)"  # eagle3_resources/target/standin.py
STANDIN_KEY = "standin"  # the metadata entry (true) of a failure the stand-in explains
STANDIN_TAG = "(stand-in)"  # how `eagle3 status` marks it

# check name -> why the stand-in fails it, and when it fails on a real target (one sentence, special tokens as code)
STANDIN_NOTES: dict[str, str] = {
    "backend_ids_agree_with_text": (
        f"Expected of {STANDIN_TARGET}, which samples ids that are not the canonical encoding of their text (the "
        "backend's ids are kept, so training sees what it sampled); on a real target this fails only if the "
        "tokenizer is not the target's or the backend returns ids other than those it sampled"
    ),
    "separator_and_end_token": (
        f"Expected of {STANDIN_TARGET}, which writes `</think>` more than once, or not at all, in many answers; on "
        "a real target this fails only if its answers are not in its own format (a wrong model, template or "
        "`thinking` setting)"
    ),
    "truncated_share": (
        f"Expected of {STANDIN_TARGET}, which now and then repeats itself until `max_tokens` (its cut answers are "
        "dropped from training); on a real target this fails only if `max_tokens` is too low for the dataset's "
        "answers"
    ),
}


def is_standin_target(backend: CompletionsResource, target: TargetModelResource) -> bool:
    """The completions come from the stand-in: the local backend with no target `path`."""
    return backend.backend_kind() is BackendKind.LOCAL and target.is_standin


def standin_note(check: str) -> str | None:
    """What a failure of `check` means on the stand-in's data; None for a check the stand-in does not explain."""
    return STANDIN_NOTES.get(check)


def explain(check: str, outcome: CheckOutcome, standin: bool) -> CheckOutcome:
    """`outcome` with the stand-in's note appended and `standin: true` in its metadata, where the data is the
    stand-in's, the check failed and the stand-in explains it; else `outcome` itself."""
    note = standin_note(check)
    if not standin or outcome.passed or note is None:
        return outcome
    return replace(
        outcome, description=f"{outcome.description}. {note}", metadata={**outcome.metadata, STANDIN_KEY: True}
    )


def explained(outcomes: Mapping[str, Mapping[str, CheckOutcome]], standin: bool) -> dict[str, dict[str, CheckOutcome]]:
    """`explain` on each outcome of `per_dataset`'s `{dataset: {check: outcome}}`."""
    return {ds: {name: explain(name, o, standin) for name, o in by_check.items()} for ds, by_check in outcomes.items()}
