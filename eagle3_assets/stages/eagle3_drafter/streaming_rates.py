"""The streaming plan's rates from measurement files (issue 42, item 6): each a value and its label, "measured: <the
file> <the figure> ..." with what it is and is not, so a plan says which of its inputs were measured.

- Training: `benchmarks/device_check.py`'s JSON (`sections` -> name -> `figures`), its `train_kimi` section's
  `tokens_per_s`: one GPU training the drafter at Kimi-K2.5 width (`drafter_training_speed.py`, 4,096-token steps).
  A host of G GPUs trains G x that (assumed: DDP ranks train disjoint windows and scale linearly; the gradients'
  all-reduce across ranks and hosts is not in the figure).
- The spool: `eagle3 gpu-check --json`'s `disk write` row (`checks` -> the row named "disk write" -> `data`): the
  bytes written into the data root as the store writes shards, fsync'd, over their seconds. Taken as the spool's
  file system's bandwidth for writes and reads together (assumed: reads are no faster than these writes, and this
  one host's rate is what the file system gives all hosts together).
- Capture: `eagle3 gpu-check --model <target> --tp N --json`'s `sglang capture (target, tp=N)` row's `tokens_per_s`:
  the real target's capture through the SGLang backend over one timed batch (five sequences, 9,728 tokens; no
  shard written: the spool's write is the spool's rate). A run's own figure is the `hidden_states` asset's
  `tokens_per_s`, which the asset takes when no rate is given.

A file that lacks the figure is refused with `RateUnreadable`: the file, the key and what is wrong.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from eagle3_resources.errors import RateUnreadable

TRAIN_SECTION = "train_kimi"
DISK_ROW = "disk write"
TARGET_ROW = "sglang capture (target"  # the row's name goes on with ", tp=N)"


def _load(path: Path | str) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise RateUnreadable(path, "(the file)", "no such file") from None
    except json.JSONDecodeError as e:
        raise RateUnreadable(path, "(the file)", f"not JSON ({e})") from None


def _positive(path: Path | str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise RateUnreadable(path, key, f"{value!r} is not a positive number")
    return float(value)


def training_rate(path: Path | str, gpus_per_host: int, hidden: int | None = None) -> tuple[float, str]:
    """(token-passes/s of one training host of `gpus_per_host` GPUs, its label) from device_check.py's JSON; refused
    when the `train_kimi` section has no figures (failed, skipped) or was measured at another width than `hidden`
    (the CPU quick run's 512)."""
    report = _load(path)
    key = f"sections.{TRAIN_SECTION}"
    sections = report.get("sections") if isinstance(report, dict) else None
    if not isinstance(sections, dict):
        raise RateUnreadable(path, "sections", "missing: not a benchmarks/device_check.py JSON")
    section = sections.get(TRAIN_SECTION)
    if not isinstance(section, dict):
        raise RateUnreadable(path, key, f"missing: the run had no {TRAIN_SECTION} section (its --only?)")
    figures = section.get("figures")
    if not isinstance(figures, dict):
        why = section.get("error", "no figures")
        raise RateUnreadable(path, f"{key}.figures", f"missing: the section gave none ({why})")
    per_gpu = _positive(path, f"{key}.figures.tokens_per_s", figures.get("tokens_per_s"))
    width = figures.get("hidden")
    if hidden is not None and width != hidden:
        raise RateUnreadable(
            path,
            f"{key}.figures.hidden",
            f"measured at width {width}, the plan's target is {hidden} wide (a --device cpu run measures a small "
            "width: not a Kimi rate)",
        )
    device = figures.get("device", "?")
    label = (
        f"measured: {path} {key}.figures.tokens_per_s = {per_gpu:,.1f} tok/s on one GPU ({device}, hidden {width}, "
        f"{figures.get('batch_tokens', '?')}-token steps) x {gpus_per_host} GPUs (assumed: ranks scale linearly, "
        "the all-reduce not measured)"
    )
    return per_gpu * gpus_per_host, label


def _row(path: Path | str, name: str, exact: bool) -> dict[str, Any]:
    report = _load(path)
    checks = report.get("checks") if isinstance(report, dict) else None
    if not isinstance(checks, list):
        raise RateUnreadable(path, "checks", "missing: not an `eagle3 gpu-check --json` output")
    names = [str(c.get("name", "")) if isinstance(c, dict) else "" for c in checks]
    rows = [c for c, n in zip(checks, names, strict=True) if (n == name if exact else n.startswith(name))]
    if not rows:
        asked = "--tokens, --tp or --model" if exact else "--model <target> --tp N"
        raise RateUnreadable(path, f"checks[{name!r}]", f"no such row (gpu-check measures it with {asked})")
    return rows[0]


def spool_rate(path: Path | str) -> tuple[float, str]:
    """(bytes/s of the spool's file system, its label) from `eagle3 gpu-check --json`'s disk write row."""
    row = _row(path, DISK_ROW, exact=True)
    key = f"checks[{DISK_ROW!r}].data"
    data = row.get("data") or {}
    if "bytes" not in data or "seconds" not in data:
        raise RateUnreadable(path, key, f"no bytes and seconds: the row is {row.get('status')!r}: {row.get('detail')}")
    written = _positive(path, f"{key}.bytes", data["bytes"])
    seconds = _positive(path, f"{key}.seconds", data["seconds"])
    rate = written / seconds
    label = (
        f"measured: {path} {key}: {written:,.0f} B / {seconds:g} s = {rate / 1e9:,.2f} GB/s written into "
        f"{data.get('path', '?')} (one host's fsync'd writes; assumed: reads as fast, the file system gives all hosts "
        "this together)"
    )
    return rate, label


def capture_rate(path: Path | str) -> tuple[float, str]:
    """(tokens/s of one capture host, its label) from `eagle3 gpu-check --model ... --json`'s target capture row."""
    row = _row(path, TARGET_ROW, exact=False)
    key = f"checks[{row.get('name')!r}].data.tokens_per_s"
    data = row.get("data") or {}
    if row.get("status") != "ok" or data.get("problems"):
        raise RateUnreadable(path, key, f"the row is {row.get('status')!r}: {row.get('detail')}")
    rate = _positive(path, key, data.get("tokens_per_s"))
    label = (
        f"measured: {path} {key} = {rate:,.1f} tok/s ({data.get('tokens', '?')} tokens in one timed batch; the "
        "forward and the hand-off, no shard written)"
    )
    return rate, label


def drafter_checkpoint_bytes(
    hidden: int, intermediate: int, target_vocab: int, draft_vocab: int, kind: str = "eagle3_mla"
) -> int:
    """The bytes of one trainer checkpoint at this width: the trainable weights (fp32) and AdamW's two moments of each
    (the frozen embedding is not saved), counted on the meta device (nothing allocated). Kimi-K2.5's MLA drafter:
    11.6 GB."""
    from eagle3_assets.stages.eagle3_drafter.mla import MLAShape
    from eagle3_assets.stages.eagle3_drafter.model import MLA_KINDS, DrafterConfig

    common: dict[str, Any] = {
        "intermediate_size": intermediate,
        "vocab_size": target_vocab,
        "draft_vocab_size": draft_vocab,
    }
    if kind in MLA_KINDS:
        cfg = DrafterConfig.mla_of(kind, hidden, MLAShape.of_width(hidden), **common)
    else:
        cfg = DrafterConfig.of_width(hidden, drafter_kind=kind, **common)
    return drafter_config_checkpoint_bytes(cfg)


def drafter_config_checkpoint_bytes(cfg: Any) -> int:
    """`drafter_checkpoint_bytes` of a built `DrafterConfig` (the asset's, from the target's config)."""
    import torch

    from eagle3_assets.stages.eagle3_drafter.model import Eagle3Drafter

    with torch.device("meta"):
        model = Eagle3Drafter(
            cfg,
            torch.empty(cfg.vocab_size, cfg.target_hidden_size, dtype=torch.bfloat16),
            torch.arange(cfg.draft_vocab_size),
        )
    saved = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return int(saved + 2 * trained)
