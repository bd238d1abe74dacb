"""Benchmark: the three drafter kinds trained on the same captured states with the same budget, side by side, and vLLM
speculators' EAGLE-3 trained on the same states as a peer, in one run (issue 41, item 4).

    .venv/bin/python benchmarks/drafter_kinds.py --seeds 3 --json /tmp/kinds.json     # the docs' table
    .venv/bin/python benchmarks/drafter_kinds.py --kinds eagle3_llama --quick --no-peer  # seconds, the test's

The data: a data store (`--data`, default the project's `var/data`, after the first command): its merged dataset, its
hidden-state store and its stand-in target. For each seed (0, 1, ...) and each kind (`model.DRAFTER_KINDS`) the drafter
is trained exactly as the `eagle3_drafter` asset trains it in one process (`pipeline.run_drafter_job`): the same
windows of the training split, the same draft vocabulary (its loss tokens), initial weights and data order from the
seed, the asset's defaults for the budget (3 epochs of 1,024-token steps, TTT 7 steps with decay 0.8, AdamW at the
width's default rate, 2e-3 on the stand-in, 20 warmup steps then cosine, windows of at most 4,096 tokens), on
`--threads` torch threads (1). It is exported, re-read from disk and decoded as the asset decodes it
(`quality.measure_speculative`: the lossless greedy loop with the target, SGLang's accept length, chains of 3 draft
tokens, ceiling 4, checked equal to greedy decoding), on `--eval-prompts` eval-split prompts of `--new-tokens` tokens
each; beside it the untrained drafter of the same seed (the floor). Per drafter: training tokens/s (the trainer's,
evaluation excluded), the last epoch's mean loss, real accept length overall and per prompt kind (`by_kind`: the
dataset registry's kinds of the eval prompts), and the draft's KV cache per token (bf16) at the stand-in's shape and
at Kimi-K2.5's (hidden 7168; `DrafterConfig.kv_bytes_per_token`).

The peer, `speculators_eagle3`: vLLM speculators 0.9.0 (`pip install speculators==0.9.0`) in a virtual environment of
its own, made so (its pins: transformers <= 5.19, torch <= 2.14.1; the CPU torch from /opt/wheels, and PyPI's
torchvision / torchaudio removed: they are CUDA builds whose operators fail to register against a CPU torch, and its
EAGLE-3 path does not import them):

    python3 -m venv .venv-speculators
    .venv-speculators/bin/pip install /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
    echo 'torch==2.13.0+cpu' > /tmp/torch-pin.txt
    .venv-speculators/bin/pip install speculators==0.9.0 'transformers<=5.19' -c /tmp/torch-pin.txt
    .venv-speculators/bin/pip uninstall -y torchvision torchaudio

Per seed, the `eagle3_llama` job's training windows (their stored aux states, final states, ids and loss masks), its
draft vocabulary and its optimizer steps are written to a folder and `benchmarks/speculators_worker.py` trains
speculators' `Eagle3DraftModel` on them in that environment, with speculators' own data shift, collate, TTT forward
and loss (KL to the target's distribution), and `Trainer` step, at the `eagle3_llama` drafter's width (hidden,
heads, head dim, intermediate, draft vocabulary, the target's embedding) and the same budget (the worker's docstring
says what is adapted, and why). Back here its weights are mapped by name onto an `eagle3_llama` `Eagle3Drafter`, the
mapping proved (the two models' logits at every TTT step on a held-out window agree within `LOGITS_TOLERANCE`, or the
run fails), exported and decoded in the same loop as ours. Without `.venv-speculators` the peer is skipped, saying so.

Prints one JSON object (every run, the means and ranges over seeds) and a Markdown table; `--json` writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3_assets.stages.eagle3_drafter.data import plan_steps  # noqa: E402
from eagle3_assets.stages.eagle3_drafter.export import export_checkpoint, trained_layer_ids  # noqa: E402
from eagle3_assets.stages.eagle3_drafter.mla import MLAShape  # noqa: E402
from eagle3_assets.stages.eagle3_drafter.model import DRAFTER_KINDS, Eagle3Drafter  # noqa: E402
from eagle3_assets.stages.eagle3_drafter.pipeline import (  # noqa: E402
    DrafterJob,
    build_drafter,
    data_source,
    drafter_config,
    run_drafter_job,
    split_windows,
)
from eagle3_assets.stages.eagle3_drafter.quality import (  # noqa: E402
    DecodeEval,
    SpeculativeQuality,
    measure_speculative,
)
from eagle3_assets.stages.eagle3_drafter.train import TrainSettings  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PEER = "speculators_eagle3"
PEER_PYTHON = REPO / ".venv-speculators" / "bin" / "python"
WORKER = REPO / "benchmarks" / "speculators_worker.py"
LOGITS_TOLERANCE = 1e-3  # fp32 both; the attention kernels and rope positions (theirs start at 1) differ in rounding
PROBE_TOKENS = 64  # the held-out window the mapping is proved on
KIMI_HIDDEN = 7168
# Kimi-K2.5's text config, the fields a drafter is built from (as tests/test_drafter_kinds.py's KIMI_TEXT)
KIMI_TEXT: dict[str, Any] = {
    "hidden_size": KIMI_HIDDEN,
    "intermediate_size": 18432,
    "num_hidden_layers": 61,
    "vocab_size": 163840,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 262144,
    **MLAShape.kimi_k25().to_config(),
    "num_attention_heads": 64,
}


@dataclass(frozen=True)
class Budget:
    """What every drafter is trained with: the `eagle3_drafter` asset's defaults (DrafterTrainConfig)."""

    epochs: int = 3
    batch_tokens: int = 1024
    ttt_steps: int = 7
    step_decay: float = 0.8
    max_len: int = 4096
    warmup_steps: int = 20
    draft_vocab: int = 32000  # capped at the training split's distinct loss tokens
    lr: float | None = None  # None: the width's default (2e-3 on the stand-in)
    checkpoint_every: int = 50
    train_samples: int | None = None  # None: the whole training split

    def settings(self, kind: str, seed: int) -> TrainSettings:
        return TrainSettings(
            ttt_steps=self.ttt_steps,
            step_decay=self.step_decay,
            epochs=self.epochs,
            lr=self.lr,
            warmup_steps=self.warmup_steps,
            batch_tokens=self.batch_tokens,
            max_len=self.max_len,
            seed=seed,
            checkpoint_every=self.checkpoint_every,
            drafter_kind=kind,
        )


@dataclass(frozen=True)
class Decode:
    """How every drafter is decoded: `prompts` eval-split prompts, `new_tokens` each, chains of `draft_steps`."""

    prompts: int = 10
    new_tokens: int = 96
    draft_steps: int = 3


QUICK_BUDGET = Budget(epochs=1, batch_tokens=512, ttt_steps=3, warmup_steps=2, draft_vocab=512, train_samples=8)
QUICK_DECODE = Decode(prompts=2, new_tokens=8, draft_steps=3)


@dataclass
class Store:
    """A data store's merged set, hidden states and stand-in target, loaded once."""

    root: Path
    merged: pl.DataFrame
    target_folder: Path
    target_model: Any

    @property
    def hidden_root(self) -> Path:
        return self.root / "hidden_states"


def open_store(root: Path, log: Callable[[str], None]) -> Store:
    from eagle3_resources.target.resource import TargetModelResource
    from eagle3_resources.tokenizer.resource import TokenizerResource

    tokenizer = TokenizerResource(standin_dir=str(root / "standin"))
    target = TargetModelResource(standin_dir=str(root / "standin"))
    merged = pl.read_parquet(root / "merged_dataset" / "merged.parquet")
    return Store(root, merged, target.folder(tokenizer, log), target.load_model(tokenizer, log))


def training_subset(merged: pl.DataFrame, train_samples: int | None) -> pl.DataFrame:
    """The merged set with its training split cut to the first `train_samples` (quick mode); the eval split whole."""
    if train_samples is None:
        return merged
    train = merged.filter(pl.col("split") == "train").head(train_samples)
    return pl.concat([train, merged.filter(pl.col("split") != "train")])


@dataclass
class Run:
    """One trained drafter's figures."""

    drafter: str  # a kind, or PEER
    seed: int
    train_tokens: int
    train_seconds: float
    tokens_per_s: float
    final_loss: float | None  # the last epoch's mean step loss (ours: soft cross-entropy; the peer's: its KL)
    accept_length: float
    accept_length_untrained: float
    by_kind: dict[str, float]  # prompt kind -> the trained drafter's accept length on that kind's prompts
    by_kind_untrained: dict[str, float]
    prompts_by_kind: dict[str, int]
    lossless: bool
    kv_bytes_standin: int
    kv_bytes_kimi: int
    extra: dict[str, Any] = field(default_factory=dict)


def job_for(store: Store, kind: str, seed: int, budget: Budget, out: Path, log: Callable[[str], None]) -> DrafterJob:
    """The job the asset would run for this kind and seed, its output in `out` (cleared: a checkpoint left there would
    resume instead of training)."""
    for old in (out, Path(str(out) + ".training")):
        shutil.rmtree(old, ignore_errors=True)
    merged = training_subset(store.merged, budget.train_samples)
    return DrafterJob(
        store.hidden_root,
        merged,
        store.target_folder,
        out,
        budget.settings(kind, seed),
        budget.draft_vocab,
        log,
        device="cpu",
    )


def decode(store: Store, checkpoint: Path, seed: int, how: Decode, log: Callable[[str], None]) -> SpeculativeQuality:
    """The exported drafter, re-read from disk, and the untrained one of `seed`, decoded as the asset does."""
    config = json.loads((checkpoint / "config.json").read_text())
    spec = DecodeEval(how.prompts, how.new_tokens, how.draft_steps, seed, trained_layer_ids(config), proxy=True)
    return measure_speculative(store.target_model, checkpoint, store.merged, spec, log)


def kv_bytes(kind: str, checkpoint: Path) -> tuple[int, int]:
    """The draft's KV bytes per token (bf16): of the exported drafter (the stand-in's shape), and of the same kind
    at Kimi-K2.5's."""
    from eagle3_assets.stages.eagle3_drafter.export import read_checkpoint

    standin = read_checkpoint(checkpoint).drafter_config.kv_bytes_per_token()
    kimi = drafter_config(KIMI_TEXT, KIMI_HIDDEN, 32000, int(KIMI_TEXT["vocab_size"]), kind).kv_bytes_per_token()
    return standin, kimi


def last_epoch_loss(step_loss: Sequence[float], epochs: int) -> float | None:
    if not step_loss:
        return None
    per_epoch = max(1, len(step_loss) // max(1, epochs))
    return round(statistics.fmean(step_loss[-per_epoch:]), 4)


def figures_of(
    drafter: str, seed: int, quality: SpeculativeQuality, kv: tuple[int, int], training: dict[str, Any]
) -> Run:
    f = quality.figures()
    by_kind = quality.by_kind()
    return Run(
        drafter=drafter,
        seed=seed,
        train_tokens=int(training["tokens"]),
        train_seconds=float(training["seconds"]),
        tokens_per_s=float(training["tokens_per_s"]),
        final_loss=training["final_loss"],
        accept_length=float(f["accept_length_real"]),
        accept_length_untrained=float(f["accept_length_real_untrained"]),
        by_kind={k: float(v["trained"]) for k, v in by_kind.items()},
        by_kind_untrained={k: float(v["untrained"]) for k, v in by_kind.items()},
        prompts_by_kind={k: int(v["prompts"]) for k, v in by_kind.items()},
        lossless=bool(f["lossless"]),
        kv_bytes_standin=kv[0],
        kv_bytes_kimi=kv[1],
        extra=training.get("extra", {}),
    )


def train_kind(
    store: Store, kind: str, seed: int, budget: Budget, how: Decode, work: Path, log: Callable[[str], None]
) -> Run:
    """One kind trained as the asset trains it, exported, re-read and decoded."""
    report = run_drafter_job(job_for(store, kind, seed, budget, work / f"{kind}-seed{seed}", log))
    if report is None:
        raise RuntimeError(f"{kind} seed {seed}: the training stopped before its last epoch")
    if report.config["eagle3_pipeline"]["drafter_kind"] != kind:
        raise RuntimeError(f"asked for {kind}, exported {report.config['eagle3_pipeline']['drafter_kind']}")
    h = report.history
    training = {
        "tokens": h.tokens,
        "seconds": round(h.seconds, 2),
        "tokens_per_s": round(h.tokens_per_s, 1),
        "final_loss": last_epoch_loss(h.step_loss, budget.epochs),
        "extra": {"steps": len(h.step_loss), "architecture": report.config["architectures"][0]},
    }
    return figures_of(
        kind, seed, decode(store, report.checkpoint, seed, how, log), kv_bytes(kind, report.checkpoint), training
    )


# speculators' Eagle3DraftModel parameter -> this project's Eagle3Drafter (eagle3_llama) parameter
PEER_NAMES = {
    "fc.weight": "fc.weight",
    "norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    **{f"layers.0.{n}.weight": f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm")},
    "layers.0.post_attention_layernorm.weight": "midlayer.post_attention_layernorm.weight",
    **{f"layers.0.self_attn.{p}.weight": f"midlayer.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj")},
    "layers.0.self_attn.o_proj.weight": "midlayer.self_attn.o_proj.weight",
    **{f"layers.0.mlp.{p}.weight": f"midlayer.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")},
}
PEER_FROZEN = ("embed_tokens.weight",)  # the target's embedding: ours holds it as a buffer from the target folder


def peer_samples(store: Store, job: DrafterJob, built_draft_ids: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict]:
    """The job's training windows as the worker reads them (concatenated, with offsets), its draft vocabulary, a probe
    window from the eval split; and its steps per epoch (the trainer's own `plan_steps`)."""
    source, lengths, manifest = data_source(job.hidden_root, job.merged, None)
    splits = split_windows(job, lengths)
    parts: dict[str, list[torch.Tensor]] = {"aux": [], "final": [], "input_ids": [], "loss_mask": []}
    offsets = [0]
    for w in splits.train.windows:
        data = source[w.sample_id]
        parts["aux"].append(data["aux_hidden_states"][w.start : w.end])
        parts["final"].append(data["final_hidden_state"][w.start : w.end])
        parts["input_ids"].append(data["input_ids"][w.start : w.end].long())
        parts["loss_mask"].append(data["loss_mask"][w.start : w.end].to(torch.int8))
        offsets.append(offsets[-1] + w.tokens)
    probe = source[splits.eval.windows[0].sample_id]
    n = min(PROBE_TOKENS, splits.eval.windows[0].tokens)
    vocab = int(store.target_model.config.vocab_size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[built_draft_ids] = True
    tensors = {k: torch.cat(v).contiguous() for k, v in parts.items()} | {
        "offsets": torch.tensor(offsets, dtype=torch.long),
        "t2d": t2d,
        "d2t": built_draft_ids - torch.arange(len(built_draft_ids)),
        "probe_aux": probe["aux_hidden_states"][:n].contiguous(),
        "probe_final": probe["final_hidden_state"][:n].contiguous(),
        "probe_ids": probe["input_ids"][:n].long().contiguous(),
    }
    s = job.settings
    plans = [plan_steps(splits.train.windows, s.batch_tokens, s.seed, e) for e in range(s.epochs)]
    meta = {
        "plans": plans,
        "window_lengths": [w.tokens for w in splits.train.windows],
        "aux_layer_ids": manifest["aux_layer_ids"],
    }
    return tensors, meta


def map_peer_weights(weights: dict[str, torch.Tensor], model: Eagle3Drafter) -> None:
    """speculators' weights into `model` by name (PEER_NAMES); every one of ours filled once, every one of theirs
    used or known to be frozen and shared, the vocabulary maps equal: anything else fails."""
    own = model.state_dict()
    unknown = sorted(set(weights) - set(PEER_NAMES) - set(PEER_FROZEN) - {"d2t", "t2d"})
    if unknown:
        raise RuntimeError(f"speculators' draft has weights this mapping does not know: {unknown}")
    for theirs, mine in PEER_NAMES.items():
        if tuple(weights[theirs].shape) != tuple(own[mine].shape):
            raise RuntimeError(f"{theirs} is {tuple(weights[theirs].shape)}, our {mine} {tuple(own[mine].shape)}")
        own[mine].copy_(weights[theirs])
    unfilled = sorted(set(own) - set(PEER_NAMES.values()) - {"d2t", "t2d", "embed_weight"})
    if unfilled:
        raise RuntimeError(f"our drafter's weights speculators' draft does not fill: {unfilled}")
    for name in ("d2t", "t2d"):
        if not torch.equal(weights[name].to(own[name].dtype), own[name]):
            raise RuntimeError(f"speculators' {name} differs from our draft vocabulary's")
    if not torch.equal(weights["embed_tokens.weight"].float(), model.embed_weight.float()):
        raise RuntimeError("speculators' embedding is not the target's")


def prove_mapping(model: Eagle3Drafter, tensors: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    """Our model with the mapped weights against the worker's own logits on the probe window, every TTT step; returns
    the largest difference, raises over LOGITS_TOLERANCE. Their step k at index i reads the token i+1+k and the aux
    state at i (their `shift_batch`): our position i; their sequence is one shorter."""
    n = tensors["probe_ids"].shape[0]
    with torch.no_grad():
        ours = model.eval().unroll(tensors["probe_aux"].float(), tensors["probe_ids"], torch.arange(n), len(theirs))
    worst = 0.0
    for k in range(len(theirs)):
        t = theirs[f"step_{k}"]
        diff = (ours[k][: t.shape[0]] - t).abs().max().item()
        worst = max(worst, diff)
        if not diff <= LOGITS_TOLERANCE * max(1.0, t.abs().max().item()):
            raise RuntimeError(
                f"speculators' weights mapped onto eagle3_llama do not reproduce its logits: TTT step {k} differs by "
                f"{diff:.3g} (tolerance {LOGITS_TOLERANCE} x max |logit|): the mapping or the architectures disagree"
            )
    return worst


def peer_shape(model: Eagle3Drafter) -> dict[str, Any]:
    c = model.cfg
    return {
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
    }


def train_peer(
    store: Store, seed: int, budget: Budget, how: Decode, work: Path, python: Path, log: Callable[[str], None]
) -> Run:
    """speculators' EAGLE-3 trained by the worker on the eagle3_llama job's windows and steps, mapped onto our
    eagle3_llama drafter (proved by logits), exported and decoded as ours are."""
    out = work / f"{PEER}-seed{seed}"
    job = job_for(store, "eagle3_llama", seed, budget, out, log)
    _, lengths, _ = data_source(job.hidden_root, job.merged, None)
    built = build_drafter(
        job, int(store.target_model.config.hidden_size), split_windows(job, lengths).train_ids, torch.device("cpu")
    )
    tensors, meta = peer_samples(store, job, built.model.draft_ids)
    job_dir = work / f"{PEER}-job-seed{seed}"
    shutil.rmtree(job_dir, ignore_errors=True)
    job_dir.mkdir(parents=True)
    save_file(tensors, str(job_dir / "samples.safetensors"))
    s = job.settings
    spec = meta | {
        "seed": seed,
        "shape": peer_shape(built.model),
        "target_folder": str(store.target_folder),
        "epochs": s.epochs,
        "ttt_steps": s.ttt_steps,
        "step_decay": s.step_decay,
        "lr": s.lr if s.lr is not None else built_lr(built.model),
        "warmup_steps": s.warmup_steps,
        "probe_steps": how.draft_steps,
    }
    (job_dir / "job.json").write_text(json.dumps(spec))
    log(f"{PEER} seed {seed}: training in {python} ({len(meta['window_lengths'])} windows, {s.epochs} epochs)")
    started = time.monotonic()
    done = subprocess.run([str(python), str(WORKER), str(job_dir)], capture_output=True, text=True)
    (job_dir / "worker.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"the speculators worker failed ({done.returncode}); its log:\n{done.stderr[-4000:]}")
    result = json.loads((job_dir / "result.json").read_text())
    map_peer_weights(load_file(str(job_dir / "weights.safetensors")), built.model)
    worst = prove_mapping(built.model, tensors, load_file(str(job_dir / "probe_logits.safetensors")))
    log(f"{PEER} seed {seed}: mapped onto eagle3_llama, logits agree within {worst:.2g} over {how.draft_steps} steps")
    checkpoint = export_checkpoint(
        built.model.cpu(),
        out,
        meta["aux_layer_ids"],
        extra={
            "eagle3_pipeline": {"drafter_kind": "eagle3_llama", "trained_by": f"speculators {result['speculators']}"}
        },
    )
    steps_per_epoch = max(1, result["steps"] // max(1, s.epochs))
    training = {
        "tokens": result["tokens"],
        "seconds": result["seconds"],
        "tokens_per_s": result["tokens_per_s"],
        "final_loss": round(statistics.fmean(result["losses"][-steps_per_epoch:]), 4) if result["losses"] else None,
        "extra": {
            "steps": result["steps"],
            "worker_wall_s": round(time.monotonic() - started, 1),
            "logits_max_difference": worst,
            "trainable_parameters": result["trainable_parameters"],
            "speculators": result["speculators"],
        },
    }
    quality = decode(store, checkpoint, seed, how, log)
    return figures_of(PEER, seed, quality, kv_bytes("eagle3_llama", checkpoint), training)


def built_lr(model: Eagle3Drafter) -> float:
    from eagle3_assets.stages.eagle3_drafter.model import default_learning_rate

    return default_learning_rate(model.cfg.hidden_size)


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"mean": round(statistics.fmean(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def summary(runs: Sequence[Run]) -> dict[str, dict[str, Any]]:
    """Per drafter: each figure's mean and range over the seeds (per prompt kind too)."""
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r.drafter for r in runs):
        mine = [r for r in runs if r.drafter == name]
        kinds = sorted({k for r in mine for k in r.by_kind})
        out[name] = {
            "seeds": [r.seed for r in mine],
            "accept_length": spread([r.accept_length for r in mine]),
            "accept_length_untrained": spread([r.accept_length_untrained for r in mine]),
            "by_kind": {k: spread([r.by_kind[k] for r in mine if k in r.by_kind]) for k in kinds},
            "prompts_by_kind": mine[0].prompts_by_kind,
            "tokens_per_s": spread([r.tokens_per_s for r in mine]),
            "train_seconds": spread([r.train_seconds for r in mine]),
            "final_loss": spread([r.final_loss for r in mine if r.final_loss is not None] or [float("nan")]),
            "lossless": all(r.lossless for r in mine),
            "kv_bytes_standin": mine[0].kv_bytes_standin,
            "kv_bytes_kimi": mine[0].kv_bytes_kimi,
        }
    return out


def cell(s: dict[str, float], digits: int = 2) -> str:
    """mean (min-max), or the value alone for one seed."""
    if s["min"] == s["max"]:
        return f"{s['mean']:.{digits}f}"
    return f"{s['mean']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def table(sums: dict[str, dict[str, Any]]) -> str:
    """The Markdown table: one row per drafter."""
    kinds = sorted({k for s in sums.values() for k in s["by_kind"]})
    counts = next(iter(sums.values()))["prompts_by_kind"] if sums else {}
    head = ["drafter", "seeds", "real accept length", *[f"{k} ({counts.get(k, 0)})" for k in kinds], "untrained"]
    head += ["training tokens/s", "last-epoch loss", "KV B/token stand-in", "KV B/token Kimi"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, s in sums.items():
        row = [
            f"`{name}`",
            str(len(s["seeds"])),
            cell(s["accept_length"]),
            *[cell(s["by_kind"][k]) if k in s["by_kind"] else "-" for k in kinds],
        ]
        row += [cell(s["accept_length_untrained"]), cell(s["tokens_per_s"], 0), cell(s["final_loss"], 3)]
        row += [f"{s['kv_bytes_standin']:,}", f"{s['kv_bytes_kimi']:,}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def machine() -> str:
    try:
        model = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        model = platform.processor() or "unknown CPU"
    return f"{model}, {os.cpu_count()} CPUs"


def compare(
    store: Store,
    kinds: Sequence[str],
    seeds: Sequence[int],
    budget: Budget,
    how: Decode,
    work: Path,
    peer_python: Path | None,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Every kind (and the peer, unless `peer_python` is None) for every seed; the runs and their summary."""
    started = time.monotonic()
    runs: list[Run] = []
    for seed in seeds:
        for kind in kinds:
            runs.append(train_kind(store, kind, seed, budget, how, work, log))
            log(f"{kind} seed {seed}: {json.dumps(asdict(runs[-1]))}")
        if peer_python is not None:
            runs.append(train_peer(store, seed, budget, how, work, peer_python, log))
            log(f"{PEER} seed {seed}: {json.dumps(asdict(runs[-1]))}")
    return {
        "budget": asdict(budget),
        "decode": asdict(how),
        "threads": torch.get_num_threads(),
        "machine": machine(),
        "peer": "speculators 0.9.0" if peer_python is not None else None,
        "runs": [asdict(r) for r in runs],
        "summary": summary(runs),
        "wall_s": round(time.monotonic() - started, 1),
    }


def runs_from_log(text: str) -> list[Run]:
    """The runs a run's log (its stderr) recorded, one `<drafter> seed <s>: {json}` line each: the table of a run
    stopped before its end (`--from-log`)."""
    runs = []
    for line in text.splitlines():
        head, sep, body = line.partition(": {")
        if sep and " seed " in head and body.endswith("}"):
            runs.append(Run(**json.loads("{" + body)))
    return runs


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--data", type=Path, default=REPO / "var" / "data", help="the data store (default: the project's)")
    p.add_argument("--kinds", default=",".join(DRAFTER_KINDS), help="comma-separated drafter kinds")
    p.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1, each a run of every kind (and of the peer)")
    p.add_argument("--epochs", type=int, default=None, help="default: the asset's (3)")
    p.add_argument("--eval-prompts", type=int, default=None, help=f"default: {Decode.prompts} (all of the stand-in's)")
    p.add_argument("--new-tokens", type=int, default=None, help=f"default: {Decode.new_tokens}")
    p.add_argument("--quick", action="store_true", help="a tiny budget and decode, to check the script runs")
    p.add_argument("--no-peer", action="store_true", help="skip speculators' EAGLE-3")
    p.add_argument("--peer-python", type=Path, default=PEER_PYTHON, help="the speculators environment's python")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--work", type=Path, default=None, help="checkpoints and the peer's files (default: temporary)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--from-log", type=Path, default=None, help="print the summary and table of a run's stderr log")
    return p.parse_args(argv)


def peer_python_or_reason(a: argparse.Namespace) -> tuple[Path | None, str | None]:
    if a.no_peer:
        return None, "speculators peer skipped: --no-peer"
    if not Path(a.peer_python).is_file():
        return None, (
            f"speculators peer skipped: {a.peer_python} not found (make .venv-speculators as this script's docstring "
            "says)"
        )
    return Path(a.peer_python), None


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    if a.from_log is not None:
        sums = summary(runs_from_log(a.from_log.read_text()))
        print(json.dumps({"summary": sums}))
        print(table(sums))
        return {"summary": sums, "table": table(sums)}
    os.environ["EAGLE3_TORCH_THREADS"] = str(a.threads)  # the trainer's own thread choice reads it
    torch.set_num_threads(a.threads)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    budget, how = (QUICK_BUDGET, QUICK_DECODE) if a.quick else (Budget(), Decode())
    if a.epochs is not None:
        budget = Budget(**(asdict(budget) | {"epochs": a.epochs}))
    if a.eval_prompts is not None or a.new_tokens is not None:
        how = Decode(a.eval_prompts or how.prompts, a.new_tokens or how.new_tokens, how.draft_steps)
    kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in DRAFTER_KINDS]
    if unknown:
        raise SystemExit(f"unknown drafter kinds {unknown}: one of {list(DRAFTER_KINDS)}")
    peer_python, skipped = peer_python_or_reason(a)
    if skipped:
        log(skipped)
    store = open_store(a.data, log)
    with tempfile.TemporaryDirectory() as tmp:
        figures = compare(store, kinds, range(a.seeds), budget, how, a.work or Path(tmp), peer_python, log)
    figures["peer_skipped"] = skipped
    figures["command"] = " ".join(["benchmarks/drafter_kinds.py", *(argv if argv is not None else sys.argv[1:])])
    figures["table"] = table(figures["summary"])
    print(json.dumps(figures))
    print(figures["table"])
    if skipped:
        print(skipped)
    if a.json:
        a.json.write_text(json.dumps(figures, indent=2) + "\n")
    return figures


if __name__ == "__main__":
    main()
