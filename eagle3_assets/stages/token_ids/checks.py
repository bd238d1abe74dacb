"""Checks that prove the token ids right, sample by sample (wired as asset checks on `token_ids`)."""

from __future__ import annotations

import polars as pl

from eagle3_assets.common.outcome import CheckOutcome, Checks
from eagle3_assets.common.outcome import sample_ids as _ids

BILLED_DIFF_LIMIT = 0.0004  # 0.04% of billed completion tokens, in aggregate (the history's figure)
INVARIANT_SHARE = 0.99


def billed_completion_match(df: pl.DataFrame, limit: float = BILLED_DIFF_LIMIT) -> CheckOutcome:
    """Reconstructed completion lengths agree with the billed `completion_tokens` (aggregate <= 0.04%). When it
    fails: the tokenizer or `billed_includes_im_end` is wrong; do not train on the dataset until it passes."""
    billed = df.filter(pl.col("billed_completion_tokens").is_not_null())
    if billed.height == 0:
        return CheckOutcome(True, "no billed counts to compare (the backend reported none)", {"rows": 0})
    total = int(billed["billed_completion_tokens"].sum())
    diff = int(billed["completion_len_diff"].sum())
    outliers = billed.filter(pl.col("completion_len_diff") != 0)
    share = abs(diff) / total if total else 0.0
    return CheckOutcome(
        share <= limit,
        f"reconstructed vs billed completion tokens: {diff:+,} of {total:,} "
        f"({100 * share:.4f}%, limit {100 * limit:.2f}%)",
        {
            "aggregate_diff_pct": round(100 * share, 6),
            "billed_tokens": total,
            "diff_tokens": diff,
            "samples_with_diff": outliers.height,
            "outliers": _ids(outliers),
        },
    )


def prompt_tokens_match(df: pl.DataFrame) -> CheckOutcome:
    """Rendered prompt lengths agree with the billed `prompt_tokens` (a cheap detector of altered templates). When it
    fails: the provider renders the chat template differently; compare a failing prompt's rendering with its bill."""
    billed = df.filter(pl.col("billed_prompt_tokens").is_not_null())
    if billed.height == 0:
        return CheckOutcome(True, "no billed prompt counts to compare", {"rows": 0})
    off = billed.filter(pl.col("prompt_len_diff") != 0)
    return CheckOutcome(
        off.height == 0,
        f"{off.height} of {billed.height} prompts differ in length from what the provider counted "
        "(an altered template?)",
        {"samples_with_diff": off.height, "outliers": _ids(off), "diff_tokens": int(billed["prompt_len_diff"].sum())},
    )


def separator_and_end(df: pl.DataFrame, share: float = INVARIANT_SHARE) -> CheckOutcome:
    """Complete responses have exactly one `</think>` (or end reasoning with a tool call) and end in `<|im_end|>`.
    When it fails: the answers are not in the target's format (a wrong model or template); look at the listed
    samples."""
    normal = df.filter(pl.col("finish_reason").is_in(["stop", "tool_calls"]))
    if normal.height == 0:
        return CheckOutcome(True, "no complete responses", {"rows": 0})
    implicit = (pl.col("tool_call_think_end") == "implicit").fill_null(False)
    ok = ((pl.col("n_separators") == 1) | ((pl.col("n_separators") == 0) & implicit)) & pl.col("has_end").fill_null(
        False
    )
    bad = normal.filter(~ok)
    good_share = 1 - bad.height / normal.height
    return CheckOutcome(
        good_share >= share,
        f"{100 * good_share:.2f}% of complete responses have exactly one `</think>` and end in `<|im_end|>` "
        f"(need {100 * share:.0f}%)",
        {
            "violations": bad.height,
            "rows": normal.height,
            "no_separator": int((bad["n_separators"] == 0).sum()),
            "several_separators": int((bad["n_separators"] > 1).sum()),
            "no_end": int((~bad["has_end"]).sum()),
            "examples": _ids(bad),
        },
    )


def no_leaked_specials(df: pl.DataFrame) -> CheckOutcome:
    """No completion holds special tokens other than `</think>`, a final `<|im_end|>` and tool-call markers. When it
    fails: the listed answers ran past their turn; they are kept but worth a look before training."""
    leaked = df.filter(pl.col("n_leaked_specials") > 0)
    return CheckOutcome(
        leaked.height == 0,
        f"{leaked.height} completions contain special tokens a completion must not "
        "(a new turn, a stray `<|im_end|>`, ...)",
        {
            "samples": leaked.height,
            "tokens": int(leaked["n_leaked_specials"].sum()) if leaked.height else 0,
            "examples": _ids(leaked),
        },
    )


def backend_ids_agree(df: pl.DataFrame, share: float = INVARIANT_SHARE) -> CheckOutcome:
    """Where the backend returned ids, the reconstruction from text gives the same ids. When it fails: the sampled ids
    are not the canonical encoding of their text (usual for a tiny stand-in); the backend's ids are used."""
    with_ids = df.filter(pl.col("ids_source") == "backend")
    if with_ids.height == 0:
        return CheckOutcome(True, "the backend returned no ids (ids were reconstructed from text)", {"rows": 0})
    agree = int(with_ids["ids_match"].sum())
    return CheckOutcome(
        agree / with_ids.height >= share,
        f"text reconstruction equals the backend's ids for {agree} of {with_ids.height} samples "
        "(the backend's ids are kept)",
        {"agree": agree, "rows": with_ids.height, "disagree_examples": _ids(with_ids.filter(~pl.col("ids_match")))},
    )


TOKEN_CHECKS: Checks = {
    "billed_completion_tokens_match": (billed_completion_match, "ERROR"),
    "prompt_tokens_match": (prompt_tokens_match, "WARN"),
    "separator_and_end_token": (separator_and_end, "WARN"),
    "no_leaked_special_tokens": (no_leaked_specials, "WARN"),
    "backend_ids_agree_with_text": (backend_ids_agree, "WARN"),
}
