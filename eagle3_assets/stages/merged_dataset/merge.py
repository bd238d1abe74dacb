"""Merge every dataset's token ids into one training set: the logic behind `merged_dataset`.

Keeps only complete responses (status ok and a natural end: `stop` or `tool_calls`), so failed
and `length`-truncated samples are dropped; removes exact duplicate sequences; assigns a
deterministic train/eval split from a hash of the sample id, so a sample stays on its side of
the split when datasets are added or re-run.
"""

from __future__ import annotations

import hashlib

import polars as pl

COMPLETE_FINISH = ("stop", "tool_calls")


def eval_bucket(sample_id: str) -> float:
    """A stable number in [0, 1) for a sample id (same on every machine and Python)."""
    digest = hashlib.blake2b(sample_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def merge_token_ids(frames: dict[str, pl.DataFrame], eval_fraction: float) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(merged samples, per-dataset accounting of what was kept and why the rest was dropped)."""
    cols = ["prompt_id", "dataset", "status", "finish_reason", "input_ids", "loss_mask", "prompt_len", "completion_len"]
    parts = [df.select(cols) for _, df in sorted(frames.items()) if df.height]
    if not parts:
        empty = pl.DataFrame(
            schema={
                "sample_id": pl.String,
                "dataset": pl.String,
                "prompt_id": pl.String,
                "split": pl.String,
                "input_ids": pl.List(pl.Int32),
                "loss_mask": pl.List(pl.Int8),
                "prompt_len": pl.Int64,
                "completion_len": pl.Int64,
                "n_tokens": pl.Int64,
            }
        )
        return empty, pl.DataFrame()
    all_rows = pl.concat(parts).with_columns(
        sample_id=pl.col("dataset") + "/" + pl.col("prompt_id"),
        complete=(pl.col("status") == "ok") & pl.col("finish_reason").is_in(COMPLETE_FINISH),
    )
    complete = all_rows.filter(pl.col("complete")).sort("dataset", "prompt_id")
    # Exact duplicate sequences (same prompt and same completion) train nothing new.
    complete = complete.with_columns(seq_hash=pl.col("input_ids").hash(seed=0))
    deduped = complete.unique(subset=["seq_hash"], keep="first", maintain_order=True)
    merged = deduped.with_columns(
        split=pl.when(pl.col("sample_id").map_elements(eval_bucket, return_dtype=pl.Float64) < eval_fraction)
        .then(pl.lit("eval"))
        .otherwise(pl.lit("train")),
        n_tokens=pl.col("prompt_len") + pl.col("completion_len"),
    ).select(
        "sample_id",
        "dataset",
        "prompt_id",
        "split",
        "input_ids",
        "loss_mask",
        "prompt_len",
        "completion_len",
        "n_tokens",
    )

    dropped_dupes = (
        complete.join(deduped.select("sample_id"), on="sample_id", how="anti").group_by("dataset").len("duplicates")
    )
    accounting = (
        all_rows.group_by("dataset")
        .agg(
            rows=pl.len(),
            incomplete=(~pl.col("complete")).sum(),
        )
        .join(dropped_dupes, on="dataset", how="left")
        .join(
            merged.group_by("dataset").agg(
                kept=pl.len(),
                train=(pl.col("split") == "train").sum(),
                eval=(pl.col("split") == "eval").sum(),
                tokens=pl.col("n_tokens").sum(),
                loss_tokens=pl.col("completion_len").sum(),
            ),
            on="dataset",
            how="left",
        )
        .fill_null(0)
        .sort("dataset")
    )
    return merged, accounting
