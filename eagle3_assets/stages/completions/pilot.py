"""The pilot: a partition spends on a few prompts first, and goes on only if their data has the right shape.

The history's costliest mistake was money spent on data of the wrong shape (tools sent with the
wrong semantics), found only after the run. The pilot's blocking checks look at the first
`pilot_size` completions: did they succeed, do they carry an answer, does the provider's prompt
count equal our rendering (it does not when tools reach the model differently than we render
them), do the reconstructed ids match what was billed, and were the answers billed at the listed
prices (every cap is priced with them). Malformed data or a wrong price list costs a pilot.
"""

from __future__ import annotations

import polars as pl

from eagle3_assets.common.outcome import CheckOutcome, sample_ids
from eagle3_assets.money.prices import PriceCheck
from eagle3_assets.stages.token_ids.checks import BILLED_DIFF_LIMIT
from eagle3_resources.journal import read_journal

MIN_OK_SHARE = 0.5
MIN_ANSWER_SHARE = 0.25  # real Kimi answers nearly always; the stand-in forgets </think> often


def pilot_passed(journal) -> bool:
    return any(r.get("type") == "pilot" and r.get("passed") for r in read_journal(journal).records)


def pilot_outcome(completions: pl.DataFrame, token_ids: pl.DataFrame, prices: PriceCheck | None = None) -> CheckOutcome:
    """The pilot's completions have the shape training needs and agree with what was billed (tokens and dollars). When
    it fails: nothing more of the dataset is sent; read the failing figure, fix the settings (template, `max_tokens`,
    prices) and re-materialize: a new pilot runs."""
    problems: list[str] = list(prices.problems) if prices is not None else []
    final = completions.filter(pl.col("status") != "pending")
    ok = final.filter(pl.col("status") == "ok")
    n = max(1, final.height)
    if ok.height / n < MIN_OK_SHARE:
        statuses = dict(final.group_by("status").len().rows())
        problems.append(f"only {ok.height} of {final.height} pilot requests succeeded ({statuses})")
    answered = ok.filter((pl.col("content").fill_null("") != "") | pl.col("tool_calls_json").is_not_null())
    if ok.height and answered.height / ok.height < MIN_ANSWER_SHARE:
        problems.append(f"only {answered.height} of {ok.height} successful pilot completions carry an answer")
    billed_prompt = token_ids.filter(pl.col("billed_prompt_tokens").is_not_null())
    off = billed_prompt.filter(pl.col("prompt_len_diff") != 0)
    tools_off = off.filter(pl.col("tools_in_request") == "tools_field")
    if off.height:
        problems.append(
            f"the provider counted a different prompt than we render for {off.height} of {billed_prompt.height} prompts"
            + (
                f" ({tools_off.height} with tools: they reach the model differently than we declare them)"
                if tools_off.height
                else ""
            )
        )
    billed = token_ids.filter(pl.col("billed_completion_tokens").is_not_null())
    total = int(billed["billed_completion_tokens"].sum() or 0)
    diff = int(billed["completion_len_diff"].sum() or 0)
    if total and abs(diff) / total > BILLED_DIFF_LIMIT:
        problems.append(f"reconstructed completions differ from the billed counts by {diff:+,} of {total:,} tokens")
    return CheckOutcome(
        not problems,
        "pilot passed: the data has the expected shape" if not problems else "pilot failed: " + "; ".join(problems),
        {
            "pilot_requests": final.height,
            "ok": ok.height,
            "ok_with_final_answer": answered.height,  # an answer after `</think>`, or a tool call (needed: MIN_ANSWER_SHARE)
            "min_share_with_final_answer": MIN_ANSWER_SHARE,
            "prompt_count_mismatches": off.height,
            "completion_token_diff": diff,
            "counted_completion_tokens": total,  # billed, or reported by a free backend
            "problems": problems,
            **({"prices": prices.figures()} if prices is not None else {}),
            "examples": sample_ids(off) if off.height else sample_ids(final.filter(pl.col("status") != "ok")),
        },
    )
