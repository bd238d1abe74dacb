"""The logic behind the `hidden_states` asset: which samples, into which store, with which figures.

The store itself (shards, manifest, reading back) is `eagle3_resources.hidden_states.store`; the
extraction loop is `eagle3_resources.hidden_states.extract`. Here the merged set is narrowed to
what the user chose to extract (a token budget, a dataset mix), and turned into the asset's figures.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import polars as pl

if TYPE_CHECKING:
    from eagle3_resources.hidden_states.store import HiddenStateStore, StoredSample


def select_samples(
    merged: pl.DataFrame, max_tokens: int | None = None, dataset_weights: Mapping[str, float] | None = None
) -> pl.DataFrame:
    """The merged rows to extract, in merged order.

    `dataset_weights` keeps only the datasets named with a weight above 0; with `max_tokens` each
    kept dataset gets `max_tokens x weight / sum(weights)` tokens (its own token count as weight
    when no weights are given) and contributes its samples in merged order while they fit.
    Neither set: everything.
    """
    if dataset_weights is not None:
        unknown = sorted(set(dataset_weights) - set(merged["dataset"].unique().to_list()))
        if unknown:
            raise ValueError(f"dataset_weights names datasets the merged set does not hold: {', '.join(unknown)}")
        if any(w < 0 for w in dataset_weights.values()):
            raise ValueError("dataset_weights must not be negative")
        merged = merged.filter(pl.col("dataset").is_in([d for d, w in dataset_weights.items() if w > 0]))
    if max_tokens is None:
        return merged
    totals = dict(merged.group_by("dataset").agg(pl.col("n_tokens").sum()).rows())
    weights = {
        d: float((dataset_weights or {}).get(d, 0.0)) if dataset_weights else float(t) for d, t in totals.items()
    }
    scale = sum(weights.values()) or 1.0
    share = {d: max_tokens * w / scale for d, w in weights.items()}
    used: dict[str, int] = dict.fromkeys(totals, 0)
    keep = []
    for dataset, n in merged.select("dataset", "n_tokens").rows():
        fits = used[dataset] + n <= share[dataset]
        keep.append(fits)
        used[dataset] += n if fits else 0
    return merged.filter(pl.Series(keep, dtype=pl.Boolean))


def stored_samples(selected: pl.DataFrame) -> list[StoredSample]:
    """The rows as the store takes them, each dataset its own shard group."""
    # torch-using: imported when the asset runs, so loading the definitions stays torch-free
    from eagle3_resources.hidden_states.store import StoredSample

    return [
        StoredSample(sid, split, ids, mask, dataset)
        for sid, split, ids, mask, dataset in selected.select(
            "sample_id", "split", "input_ids", "loss_mask", "dataset"
        ).iter_rows()
    ]


def tokens_by_dataset(selected: pl.DataFrame, merged: pl.DataFrame) -> pl.DataFrame:
    """Per dataset: tokens in the merged set and tokens extracted (the picture's data)."""
    whole = merged.group_by("dataset").agg(
        pl.col("n_tokens").sum().alias("merged_tokens"), pl.len().alias("merged_samples")
    )
    chosen = selected.group_by("dataset").agg(
        pl.col("n_tokens").sum().alias("stored_tokens"), pl.len().alias("stored_samples")
    )
    return whole.join(chosen, on="dataset", how="left").fill_null(0).sort("dataset")


def tokens_picture(by_dataset: pl.DataFrame, bytes_per_token: float):
    """Bars of tokens per dataset: the merged set's, and what the store holds (with its size on disk)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = by_dataset["dataset"].to_list()
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], by_dataset["merged_tokens"].to_list(), width=0.4, label="merged set", color="#c8d3e6")
    ax.bar([i + 0.2 for i in x], by_dataset["stored_tokens"].to_list(), width=0.4, label="stored", color="#3b6fb6")
    for i, t in zip(x, by_dataset["stored_tokens"].to_list(), strict=True):  # one row per dataset
        ax.annotate(
            f"{t * bytes_per_token / 1e9:.2f} GB"
            if t * bytes_per_token >= 1e8
            else f"{t * bytes_per_token / 1e6:.1f} MB",
            (i + 0.2, t),
            ha="center",
            va="bottom",
            fontsize=7,
        )
    ax.set_xticks(list(x), names)
    ax.set_ylabel("tokens")
    ax.set_title("hidden states: tokens per dataset")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def sample_preview(store: HiddenStateStore, sample_ids: list[str], n: int = 5) -> pl.DataFrame:
    rows = []
    for sample_id in sample_ids[:n]:
        t = store[sample_id]
        rows.append(
            {
                "sample_id": sample_id,
                "split": store.index[sample_id][3],
                "shard": store.index[sample_id][0],
                "tokens": t["input_ids"].shape[0],
                "loss_tokens": int(t["loss_mask"].sum()),
                "aux_shape": str(tuple(t["aux_hidden_states"].shape)),
                "aux_rms": round(float(t["aux_hidden_states"].float().pow(2).mean().sqrt()), 4),
                "final_rms": round(float(t["final_hidden_state"].float().pow(2).mean().sqrt()), 4),
            }
        )
    return pl.DataFrame(rows)


def split_ids(store: HiddenStateStore, merged: pl.DataFrame, split: str) -> list[str]:
    """The stored samples of one split, in merged order."""
    return [s for s in merged.filter(pl.col("split") == split)["sample_id"].to_list() if s in store]


def target_identity(folder: Path) -> dict[str, Any]:
    """What names the target in every shard key: its config and its weight files' names and sizes.

    Not its path: the same model mounted elsewhere (another host, another volume) keeps its shards.
    """
    import hashlib

    folder = Path(folder)
    config = folder / "config.json"
    weights = sorted((p.name, p.stat().st_size) for p in folder.glob("*.safetensors"))
    return {
        "target_config_sha256": hashlib.sha256(config.read_bytes()).hexdigest()[:16] if config.exists() else None,
        "target_weights_sha256": hashlib.sha256(repr(weights).encode()).hexdigest()[:16],
    }
