"""From stored hidden states to a verified SGLang drafter checkpoint, in one call."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl
import torch

from eagle3_assets.drafter.export import export_checkpoint
from eagle3_assets.drafter.model import DrafterConfig, Eagle3Drafter, default_shape
from eagle3_assets.drafter.target_weights import load_embed_and_head
from eagle3_assets.drafter.train import (
    TrainHistory,
    TrainSettings,
    evaluate,
    prepare_sample,
    train,
)
from eagle3_assets.drafter.vocab import (
    build_draft_vocab,
    count_loss_tokens,
    effective_draft_vocab_size,
)
from eagle3_assets.hidden_states import split_ids
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


def drafter_config(target_config: dict[str, Any], hidden_size: int, draft_vocab_size: int, vocab_size: int) -> DrafterConfig:
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
        rope_theta=float(target_config.get("rope_theta") or (target_config.get("rope_parameters") or {}).get("rope_theta") or 10000.0),
        max_position_embeddings=int(target_config.get("max_position_embeddings") or 4096),
    )


def train_drafter(
    hidden_root: Path,
    merged: pl.DataFrame,
    target_folder: Path,
    out_dir: Path,
    settings: TrainSettings,
    requested_draft_vocab: int,
    log: Callable[[str], None],
) -> DrafterReport:
    store = HiddenStateStore(hidden_root)
    manifest = store.manifest
    target_config = json.loads((Path(target_folder) / "config.json").read_text())
    target_config = target_config.get("text_config", target_config)
    embed, head = load_embed_and_head(Path(target_folder))
    vocab_size = embed.shape[0]

    train_ids = split_ids(store, merged, "train")
    eval_ids = split_ids(store, merged, "eval")
    eval_split = "eval"
    if not eval_ids:
        log("the eval split is empty: metrics are measured on the training split")
        eval_ids, eval_split = train_ids, "train"

    counts = count_loss_tokens((d["input_ids"], d["loss_mask"]) for d in (store[s] for s in train_ids))
    size = effective_draft_vocab_size(requested_draft_vocab, len(counts))
    draft_ids = build_draft_vocab(counts, size, vocab_size)
    covered = sum(c for t, c in counts.items() if t in set(draft_ids.tolist())) / max(1, sum(counts.values()))
    log(f"draft vocabulary: {size} ids ({len(counts)} distinct loss tokens, {covered:.1%} of loss tokens covered)")

    cfg = drafter_config(target_config, manifest["hidden_size"], size, vocab_size)
    train_samples = [prepare_sample(store[s], head, draft_ids, settings.max_len) for s in train_ids]
    eval_samples = [prepare_sample(store[s], head, draft_ids, settings.max_len) for s in eval_ids]

    torch.manual_seed(settings.seed)
    model = Eagle3Drafter(cfg, embed, draft_ids)
    untrained = evaluate(model, eval_samples, settings.ttt_steps)
    log(f"untrained drafter on {eval_split}: accept length {untrained['accept_length']}, acc {untrained['acc']}")
    history = train(model, train_samples, eval_samples, settings, log)
    trained = evaluate(model, eval_samples, settings.ttt_steps)
    log(f"trained drafter on {eval_split}: accept length {trained['accept_length']}, acc {trained['acc']}")

    checkpoint = export_checkpoint(
        model, out_dir, manifest["aux_layer_ids"],
        extra={"eagle3_pipeline": {"ttt_steps": settings.ttt_steps, "train_samples": len(train_samples),
                                   "eval_accept_length": trained["accept_length"],
                                   "target": Path(target_folder).name}},  # a name, not this machine's path
    )
    return DrafterReport(
        checkpoint=checkpoint,
        config=json.loads((checkpoint / "config.json").read_text()),
        draft_vocab_size=size,
        distinct_loss_tokens=len(counts),
        train_samples=len(train_samples),
        eval_samples=len(eval_samples),
        eval_split=eval_split,
        untrained=untrained,
        trained=trained,
        history=history,
    )
