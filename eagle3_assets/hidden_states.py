"""Extract and store the target's hidden states: the logic behind the `hidden_states` asset.

One safetensors file per sample, `<root>/hidden_states/<split>/<sample_id>.safetensors`:
    input_ids [L] int32, loss_mask [L] int8,
    aux_hidden_states [L, 3H] bf16   (the EAGLE-3 layers, low -> high),
    final_hidden_state [L, H] bf16   (after the final norm: the LM-head input).
A sample whose file exists is skipped, so an interrupted extraction resumes where it stopped.
`manifest.json` records the layer ids and their convention, H, the dtype and the counts.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3_resources.hidden_states.layers import FINAL_CONVENTION, LAYER_CONVENTION

MANIFEST = "manifest.json"
KEYS = ("input_ids", "loss_mask", "aux_hidden_states", "final_hidden_state")


def sample_path(root: Path, split: str, sample_id: str) -> Path:
    return root / split / (sample_id.replace("/", "__") + ".safetensors")


def write_sample(path: Path, input_ids: list[int], loss_mask: list[int], aux: torch.Tensor, final: torch.Tensor) -> int:
    """Write one sample atomically (a crash never leaves a half file that resume would trust)."""
    tensors = {
        "input_ids": torch.tensor(input_ids, dtype=torch.int32),
        "loss_mask": torch.tensor(loss_mask, dtype=torch.int8),
        "aux_hidden_states": aux.to(torch.bfloat16).contiguous(),
        "final_hidden_state": final.to(torch.bfloat16).contiguous(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)
    return path.stat().st_size


def read_sample(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@dataclass
class ExtractionReport:
    written: int
    skipped: int
    tokens: int
    bytes_written: int
    seconds: float
    nan_samples: list[str]


def extract_hidden_states(
    merged: pl.DataFrame,
    backend,
    out_root: Path,
    *,
    log: Callable[[str], None],
    progress_every_s: float = 10.0,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
) -> ExtractionReport:
    """Every sample without a file gets one; `on_progress` gets the figures logged every `progress_every_s`."""
    rows = merged.select("sample_id", "split", "input_ids", "loss_mask").rows()
    written = skipped = tokens = nbytes = 0
    nan_samples = []
    started = last = time.monotonic()
    all_tokens, seen_tokens = sum(len(r[2]) for r in rows), 0

    def report(i: int) -> None:
        elapsed = max(1e-9, time.monotonic() - started)
        rate = tokens / elapsed
        left = all_tokens - seen_tokens
        figures = {"samples_done": i, "samples": len(rows), "tokens_written": tokens, "tokens_per_s": round(rate, 1),
                   "bytes_written": nbytes, "eta_s": round(left / rate, 1) if rate > 0 else None}
        log(f"hidden states {i}/{len(rows)} samples, {tokens:,} tokens, {rate:,.0f} tok/s, {nbytes / 2**20:.1f} MiB written")
        if on_progress is not None:
            on_progress(figures)

    for i, (sample_id, split, ids, mask) in enumerate(rows, start=1):
        path = sample_path(out_root, split, sample_id)
        seen_tokens += len(ids)
        if path.exists():
            skipped += 1
            continue
        aux, final = backend.extract(list(ids))
        if not (torch.isfinite(aux).all() and torch.isfinite(final).all()):
            nan_samples.append(sample_id)
        nbytes += write_sample(path, list(ids), list(mask), aux, final)
        written += 1
        tokens += len(ids)
        if time.monotonic() - last >= progress_every_s:
            last = time.monotonic()
            report(i)
    return ExtractionReport(written, skipped, tokens, nbytes, time.monotonic() - started, nan_samples)


def write_manifest(out_root: Path, merged: pl.DataFrame, backend, target: str) -> dict[str, Any]:
    manifest = {
        "aux_layer_ids": list(backend.layer_ids),
        "layer_convention": LAYER_CONVENTION,
        "final_hidden_state": FINAL_CONVENTION,
        "num_target_layers": backend.num_layers,
        "hidden_size": backend.hidden_size,
        "dtype": "bfloat16",
        "keys": list(KEYS),
        "target": target,
        "backend": backend.describe(),
        "samples": {s: int((merged["split"] == s).sum()) for s in ("train", "eval")},
        "tokens": int(merged["n_tokens"].sum()) if merged.height else 0,
        "bytes_per_token": (3 + 1) * backend.hidden_size * 2,
    }
    out_root.mkdir(parents=True, exist_ok=True)
    (out_root / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_manifest(root: Path) -> dict[str, Any]:
    return json.loads((root / MANIFEST).read_text())


def stored_samples(root: Path, merged: pl.DataFrame, split: str) -> list[Path]:
    """The files of the merged set's samples of one split, in merged order."""
    ids = merged.filter(pl.col("split") == split)["sample_id"].to_list()
    return [sample_path(root, split, s) for s in ids]
