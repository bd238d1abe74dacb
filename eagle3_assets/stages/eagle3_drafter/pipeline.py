"""From stored hidden states to a verified SGLang drafter checkpoint, in one call."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl
import torch

from eagle3_assets.stages.eagle3_drafter.data import (
    OnlineSource,
    SampleSource,
    Teacher,
    load_window,
    plan_windows,
)
from eagle3_assets.stages.eagle3_drafter.export import export_checkpoint, read_checkpoint
from eagle3_assets.stages.eagle3_drafter.model import DrafterConfig, Eagle3Drafter, default_shape
from eagle3_assets.stages.eagle3_drafter.target_weights import load_embed_and_head
from eagle3_assets.stages.eagle3_drafter.train import (
    Distributed,
    TrainHistory,
    TrainSettings,
    evaluate,
    train,
    training_device,
)
from eagle3_assets.stages.eagle3_drafter.vocab import (
    build_draft_vocab,
    count_loss_tokens,
    effective_draft_vocab_size,
)
from eagle3_resources.cpu import apply_torch_threads
from eagle3_resources.hidden_states.store import HiddenStateStore


@dataclass
class DrafterReport:
    checkpoint: Path
    config: dict[str, Any]
    draft_vocab_size: int
    distinct_loss_tokens: int
    train_samples: int
    eval_samples: int
    eval_split: str
    untrained: dict[str, Any]
    trained: dict[str, Any]
    history: TrainHistory
    train_tokens: int = 0
    split_samples: int = 0  # samples longer than max_len, trained as several windows
    windows: int = 0


def drafter_config(
    target_config: dict[str, Any], hidden_size: int, draft_vocab_size: int, vocab_size: int
) -> DrafterConfig:
    heads, kv_heads, head_dim = default_shape(hidden_size)
    return DrafterConfig(
        hidden_size=hidden_size,
        target_hidden_size=hidden_size,
        intermediate_size=int(target_config.get("intermediate_size") or 4 * hidden_size),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        draft_vocab_size=draft_vocab_size,
        rms_norm_eps=float(target_config.get("rms_norm_eps") or 1e-6),
        rope_theta=float(
            target_config.get("rope_theta") or (target_config.get("rope_parameters") or {}).get("rope_theta") or 10000.0
        ),
        max_position_embeddings=int(target_config.get("max_position_embeddings") or 4096),
    )


def train_drafter(
    hidden_root: Path | None,
    merged: pl.DataFrame,
    target_folder: Path,
    out_dir: Path,
    settings: TrainSettings,
    requested_draft_vocab: int,
    log: Callable[[str], None],
    *,
    device: str = "auto",
    online_backend=None,
    init_from: Path | None = None,
    dist: Distributed | None = None,
    stop_after_steps: int | None = None,
) -> DrafterReport | None:
    """Train, evaluate and export; returns the report on the main process (None on the other ranks, or when
    `stop_after_steps` ended the run early). The training checkpoint lives in `<out_dir>.training/`.

    Offline (`hidden_root`): samples stream from the hidden-state store. Online (`online_backend`, a
    transformers hidden-states backend of the target): the target computes them inside the loop.
    """
    dist = dist or Distributed()
    dev = training_device(device)
    if dev.type == "cpu":
        apply_torch_threads("drafter training", log)
    target_config = json.loads((Path(target_folder) / "config.json").read_text())
    target_config = target_config.get("text_config", target_config)
    embed, head = load_embed_and_head(Path(target_folder))
    vocab_size = embed.shape[0]

    source, lengths, manifest = data_source(hidden_root, merged, online_backend)
    train_ids = [s for s in merged.filter(pl.col("split") == "train")["sample_id"].to_list() if s in lengths]
    eval_ids = [s for s in merged.filter(pl.col("split") == "eval")["sample_id"].to_list() if s in lengths]
    eval_split = "eval"
    if not eval_ids:
        log("the eval split is empty: metrics are measured on the training split")
        eval_ids, eval_split = train_ids, "train"
    train_plan = plan_windows([(s, lengths[s]) for s in train_ids], settings.max_len)
    eval_plan = plan_windows([(s, lengths[s]) for s in eval_ids], settings.max_len)
    log(
        f"drafter data: {train_plan.samples} training samples, {train_plan.tokens:,} tokens in {len(train_plan.windows)} "
        f"windows of at most {settings.max_len} ({train_plan.split_samples} longer samples cut into windows, no token "
        f"dropped); {eval_plan.samples} {eval_split} samples; {'online (target in the loop)' if online_backend else 'streamed from the store'}"
    )

    wanted = set(train_ids)
    rows = merged.filter(pl.col("sample_id").is_in(list(wanted))).select("input_ids", "loss_mask").iter_rows()
    counts = count_loss_tokens((torch.as_tensor(ids), torch.as_tensor(mask)) for ids, mask in rows)
    warm = read_checkpoint(Path(init_from)) if init_from is not None else None
    if warm is not None:
        draft_ids = warm.draft_ids
        size = len(draft_ids)
        log(f"drafter: warm start from {init_from} ({size} draft ids kept)")
    else:
        size = effective_draft_vocab_size(requested_draft_vocab, len(counts))
        draft_ids = build_draft_vocab(counts, size, vocab_size)
    covered = sum(c for t, c in counts.items() if t in set(draft_ids.tolist())) / max(1, sum(counts.values()))
    log(f"draft vocabulary: {size} ids ({len(counts)} distinct loss tokens, {covered:.1%} of loss tokens covered)")

    cfg = drafter_config(target_config, manifest["hidden_size"], size, vocab_size)
    torch.manual_seed(settings.seed)
    model = Eagle3Drafter(cfg, embed, draft_ids)
    if warm is not None:
        warm.load_into(model)
    model.to(dev)
    teacher = Teacher(head, model.draft_ids, dev)  # shared by evaluation and training: each argmax computed once

    def eval_samples():
        return (load_window(source, w, teacher, dev) for w in eval_plan.windows)

    untrained = evaluate(model, eval_samples(), settings.ttt_steps) if dist.main else {}
    if dist.main:
        log(f"untrained drafter on {eval_split}: accept length {untrained['accept_length']}, acc {untrained['acc']}")
    history = train(
        model,
        source,
        train_plan.windows,
        eval_plan.windows,
        settings,
        head=head,
        device=dev,
        log=log,
        checkpoint_dir=Path(str(out_dir) + ".training"),
        dist=dist,
        stop_after_steps=stop_after_steps,
        teacher=teacher,
    )
    if not dist.main or len(history.epochs) < settings.epochs:  # another rank, or stopped early
        return None
    trained = evaluate(model, eval_samples(), settings.ttt_steps)
    log(f"trained drafter on {eval_split}: accept length {trained['accept_length']}, acc {trained['acc']}")
    checkpoint = export_checkpoint(
        model.cpu(),
        out_dir,
        manifest["aux_layer_ids"],
        extra={
            "eagle3_pipeline": {
                "ttt_steps": settings.ttt_steps,
                "train_samples": train_plan.samples,
                "eval_accept_length": trained["accept_length"],
                "target": Path(target_folder).name,
            }
        },  # a name, not this machine's path
    )
    return DrafterReport(
        checkpoint=checkpoint,
        config=json.loads((checkpoint / "config.json").read_text()),
        draft_vocab_size=size,
        distinct_loss_tokens=len(counts),
        train_samples=train_plan.samples,
        eval_samples=eval_plan.samples,
        eval_split=eval_split,
        untrained=untrained,
        trained=trained,
        history=history,
        train_tokens=train_plan.tokens,
        split_samples=train_plan.split_samples,
        windows=len(train_plan.windows),
    )


def data_source(
    hidden_root: Path | None, merged: pl.DataFrame, online_backend
) -> tuple[SampleSource, dict[str, int], dict[str, Any]]:
    """(source, sample id -> tokens, {hidden_size, aux_layer_ids}) of the store, or of the target run online."""
    if online_backend is not None:
        rows = {sid: (ids, mask) for sid, ids, mask in merged.select("sample_id", "input_ids", "loss_mask").iter_rows()}
        return (
            OnlineSource(online_backend, rows),
            {s: len(r[0]) for s, r in rows.items()},
            {"hidden_size": online_backend.hidden_size, "aux_layer_ids": list(online_backend.layer_ids)},
        )
    store = HiddenStateStore(Path(hidden_root))
    lengths = {sid: end - start for sid, (_, start, end, _) in store.index.items()}
    return store, lengths, store.manifest
