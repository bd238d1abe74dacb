"""Checks on a dataset's completions: is it complete, and is the data worth what it cost."""

from __future__ import annotations

import polars as pl

from eagle3_assets.common.outcome import CheckOutcome, Checks, sample_ids

MAX_ERROR_SHARE = 0.05
MAX_TRUNCATED_SHARE = 0.10


def complete(df: pl.DataFrame) -> CheckOutcome:
    """Every prompt has a final outcome (ok, truncated, filtered or failed). When it fails: a cap, a hold or a stop
    ended the run early; re-materialize the dataset to resume (nothing is paid twice)."""
    pending = df.filter(pl.col("status") == "pending")
    return CheckOutcome(
        pending.height == 0,
        f"{df.height - pending.height} of {df.height} prompts have a final outcome"
        + (
            ""
            if pending.height == 0
            else f"; {pending.height} still to send (a cap or a stop; re-materialize to resume)"
        ),
        {"rows": df.height, "pending": pending.height, "examples": sample_ids(pending)},
    )


def error_rate(df: pl.DataFrame, limit: float = MAX_ERROR_SHARE) -> CheckOutcome:
    """At most 5% of the prompts sent ended as failed. When it fails: `by_code_and_provider` says which errors from
    which provider; exclude that provider in `provider` settings or retry later (failed prompts are not resent)."""
    final = df.filter(pl.col("status") != "pending")
    failed = final.filter(pl.col("status") == "failed")
    share = failed.height / final.height if final.height else 0.0
    by_code = failed.group_by(pl.col("error_code").fill_null("unknown"), pl.col("provider").fill_null("-")).len().rows()
    return CheckOutcome(
        share <= limit,
        f"{failed.height} of {final.height} completions failed ({100 * share:.1f}%, limit {100 * limit:.0f}%)",
        {
            "failed": failed.height,
            "share_pct": round(100 * share, 2),
            "by_code_and_provider": {f"{c}@{p}": n for c, p, n in by_code},
            "examples": sample_ids(failed),
        },
    )


def truncated_share(df: pl.DataFrame, limit: float = MAX_TRUNCATED_SHARE) -> CheckOutcome:
    """At most 10% of the completions were cut by `max_tokens` (truncated samples are dropped from training). When it
    fails: raise `max_tokens` for this dataset; the cut answers were paid for and are not used."""
    final = df.filter(pl.col("status") != "pending")
    cut = final.filter(pl.col("status") == "truncated")
    share = cut.height / final.height if final.height else 0.0
    return CheckOutcome(
        share <= limit,
        f"{cut.height} of {final.height} completions hit max_tokens ({100 * share:.1f}%, limit {100 * limit:.0f}%): "
        "raise max_tokens if this is high",
        {"truncated": cut.height, "share_pct": round(100 * share, 2), "examples": sample_ids(cut)},
    )


def no_duplicates(df: pl.DataFrame) -> CheckOutcome:
    """No prompt is in the dataset twice, and no two completions are identical. When it fails: the prompt file has
    duplicates, or the backend answers deterministically (check temperature and seed)."""
    dup_prompts = df.filter(pl.col("messages_json").is_duplicated())
    answered = df.filter(pl.col("content").is_not_null() | pl.col("reasoning").is_not_null())
    dup_answers = answered.filter(pl.struct("reasoning", "content").is_duplicated())
    return CheckOutcome(
        dup_prompts.height == 0 and dup_answers.height == 0,
        f"{dup_prompts.height} prompts and {dup_answers.height} completions are duplicates",
        {
            "duplicate_prompts": dup_prompts.height,
            "duplicate_completions": dup_answers.height,
            "examples": sample_ids(dup_prompts) + sample_ids(dup_answers),
        },
    )


COMPLETION_CHECKS: Checks = {
    "complete": (complete, "ERROR"),
    "error_rate": (error_rate, "WARN"),
    "truncated_share": (truncated_share, "WARN"),
    "no_duplicates": (no_duplicates, "WARN"),
}
