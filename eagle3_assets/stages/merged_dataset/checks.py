"""Checks on the merged set: every dataset contributes, the token counts add up."""

from __future__ import annotations

import polars as pl

from eagle3_assets.common.outcome import CheckOutcome, Checks


def dataset_mix(merged: pl.DataFrame, datasets: list[str]) -> CheckOutcome:
    """Every registered dataset contributes samples to the merged set. When it fails: materialize `token_ids` for the
    datasets it names (a range run, or the backfill dialog), then `merged_dataset` again."""
    counts = dict(merged.group_by("dataset").len().rows())
    missing = [d for d in datasets if counts.get(d, 0) == 0]
    total = max(1, merged.height)
    return CheckOutcome(
        not missing,
        f"{len(datasets) - len(missing)} of {len(datasets)} datasets present"
        + (f"; missing: {', '.join(missing)}" if missing else ""),
        {"share_pct": {d: round(100 * counts.get(d, 0) / total, 2) for d in datasets}, "missing": missing},
    )


def token_totals(merged: pl.DataFrame, *_) -> CheckOutcome:
    """Token counts add up: ids and masks have equal lengths, every sample trains on some tokens. When it fails: the
    named samples' `token_ids` rows are malformed; look at their `token_ids` checks and re-materialize that dataset."""
    lengths_ok = (
        merged.select((pl.col("input_ids").list.len() == pl.col("n_tokens")).all()).item() if merged.height else True
    )
    masks_ok = (
        merged.select((pl.col("loss_mask").list.len() == pl.col("input_ids").list.len()).all()).item()
        if merged.height
        else True
    )
    no_loss = merged.filter(pl.col("loss_mask").list.sum() == 0).height
    tokens, loss = int(merged["n_tokens"].sum() or 0), int(merged["completion_len"].sum() or 0)
    return CheckOutcome(
        merged.height > 0 and lengths_ok and masks_ok and no_loss == 0,
        f"{merged.height} samples, {tokens:,} tokens, {loss:,} under the loss mask",
        {
            "samples": merged.height,
            "tokens": tokens,
            "loss_tokens": loss,
            "lengths_consistent": lengths_ok,
            "masks_consistent": masks_ok,
            "samples_without_loss_tokens": no_loss,
        },
    )


MERGED_CHECKS: Checks = {"dataset_mix": (dataset_mix, "WARN"), "token_totals": (token_totals, "ERROR")}
