"""From stored hidden states to a verified SGLang drafter checkpoint, in one call."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import polars as pl
import torch

from eagle3_assets.stages.eagle3_drafter.best_checkpoint import (
    BestCheckpointKeeper,
    BestCheckpointPlan,
    prompts_by_kind,
)
from eagle3_assets.stages.eagle3_drafter.data import (
    OnlineSource,
    SampleSource,
    Teacher,
    WindowPlan,
    plan_windows,
)
from eagle3_assets.stages.eagle3_drafter.export import DrafterCheckpoint, export_checkpoint, read_checkpoint
from eagle3_assets.stages.eagle3_drafter.mla import MLAShape
from eagle3_assets.stages.eagle3_drafter.model import MLA_KINDS, DrafterConfig, Eagle3Drafter
from eagle3_assets.stages.eagle3_drafter.rank_zero import RankZeroWord
from eagle3_assets.stages.eagle3_drafter.target_weights import load_embed_and_head
from eagle3_assets.stages.eagle3_drafter.train import (
    Distributed,
    Every,
    FixedWindows,
    RunOptions,
    Trainer,
    TrainHistory,
    TrainSettings,
    eval_samples,
    evaluate,
    training_device,
)
from eagle3_assets.stages.eagle3_drafter.vocab import (
    build_draft_vocab,
    count_loss_tokens,
    effective_draft_vocab_size,
)
from eagle3_resources.cpu import apply_torch_threads
from eagle3_resources.errors import DrafterError
from eagle3_resources.hidden_states.store import HiddenStateStore

# What the checkpoint's `eval_accept_length_simulated` is (config.json, section `eagle3_pipeline`)
SIMULATED_ABOUT = (
    "simulated accept length: the trainer's eval pass on the eval split, teacher-forced (each draft step scored "
    "against the target's own next token), no decoding; {steps} draft steps (the training-time-test unroll), "
    "ceiling {ceiling}. The real one, decoded with the target (chains of spec_draft_steps), is the eagle3_drafter "
    "materialization's accept_length_real"
)


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
    best_checkpoint: dict[str, Any] | None = None  # the keeper's curve and best (None: the last step is exported)
    # the target ids of the draft vocabulary the trainer built (empty: not recorded): the release gate checks the
    # exported d2t against them
    draft_ids: list[int] = field(default_factory=list)


def has_mla(target_config: dict[str, Any]) -> bool:
    """A DeepSeek-V3-family target with multi-latent attention (DeepSeek-V3, Kimi-K2.x's text config, the stand-in)."""
    return target_config.get("kv_lora_rank") is not None


def default_drafter_kind(target_config: dict[str, Any]) -> str:
    """The kind `auto` trains: SGLang's MLA draft for an MLA target (what Kimi-K2.5 is served with), the Llama draft
    for every other."""
    return "eagle3_mla" if has_mla(target_config) else "eagle3_llama"


def drafter_mla_shape(target_config: dict[str, Any], hidden_size: int) -> MLAShape:
    """An MLA drafter's attention: the target's own (ranks, head dims, rope and its scaling), its heads raised to a
    multiple of 8 so that the drafter loads at every TP size (`mla_loads_at_tp`; Kimi's 64 stay 64, the stand-in's 4
    become 8) and a q_lora_rank where the target has none (SGLang's draft requires one); for a target without MLA,
    `MLAShape.of_width`'s Kimi proportions at the target's rope theta."""
    if not has_mla(target_config):
        theta = target_config.get("rope_theta") or (target_config.get("rope_parameters") or {}).get("rope_theta")
        return MLAShape.of_width(hidden_size, rope_theta=float(theta or 10000.0))
    own = MLAShape.from_config(
        {**target_config, "q_lora_rank": target_config.get("q_lora_rank") or MLAShape.of_width(hidden_size).q_lora_rank}
    )
    return dataclasses.replace(own, num_attention_heads=8 * math.ceil(own.num_attention_heads / 8))


def drafter_config(
    target_config: dict[str, Any], hidden_size: int, draft_vocab_size: int, vocab_size: int, kind: str = "auto"
) -> DrafterConfig:
    """The drafter of `kind` (`model.DRAFTER_KINDS`; "auto": `default_drafter_kind`) for a target of this (text)
    config, `hidden_size` wide."""
    kind = default_drafter_kind(target_config) if kind == "auto" else kind
    common: dict[str, Any] = {
        "intermediate_size": int(target_config.get("intermediate_size") or 4 * hidden_size),
        "vocab_size": vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "rms_norm_eps": float(target_config.get("rms_norm_eps") or 1e-6),
        "max_position_embeddings": int(target_config.get("max_position_embeddings") or 4096),
    }
    if kind in MLA_KINDS:
        return DrafterConfig.mla_of(kind, hidden_size, drafter_mla_shape(target_config, hidden_size), **common)
    return DrafterConfig.of_width(
        hidden_size,
        rope_theta=float(
            target_config.get("rope_theta") or (target_config.get("rope_parameters") or {}).get("rope_theta") or 10000.0
        ),
        drafter_kind=kind,
        **common,
    )


@dataclass(frozen=True)
class DrafterJob:
    """What one drafter training is given. Offline (`hidden_root`): samples stream from the hidden-state store.
    Online (`online_backend`, a transformers hidden-states backend of the target): the target computes them
    inside the loop. `init_from`: warm start from an exported drafter. `stop_after_steps`: end early (tests).
    `best`: every N steps, real speculative decoding on the held-out prompts per kind, and the best drafter by accept
    length exported instead of the last (`best_checkpoint.py`; None: the last). `hooks`: more `Every` hooks, run
    after the keeper's (tests and benchmarks)."""

    hidden_root: Path | None
    merged: pl.DataFrame
    target_folder: Path
    out_dir: Path
    settings: TrainSettings
    requested_draft_vocab: int
    log: Callable[[str], None]
    device: str = "auto"
    online_backend: Any = None
    init_from: Path | None = None
    dist: Distributed = field(default_factory=Distributed)
    stop_after_steps: int | None = None
    best: BestCheckpointPlan | None = None
    hooks: tuple[Every, ...] = ()

    @property
    def checkpoint_dir(self) -> Path:
        return Path(str(self.out_dir) + ".training")


# 12 parameters: the keyword form of `DrafterJob` that tests and scripts call
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
    online_backend: Any = None,
    init_from: Path | None = None,
    dist: Distributed | None = None,
    stop_after_steps: int | None = None,
) -> DrafterReport | None:
    """`run_drafter_job` of these options."""
    job = DrafterJob(
        hidden_root,
        merged,
        target_folder,
        out_dir,
        settings,
        requested_draft_vocab,
        log,
        device,
        online_backend,
        init_from,
        dist or Distributed(),
        stop_after_steps,
    )
    return run_drafter_job(job)


def run_drafter_job(job: DrafterJob) -> DrafterReport | None:
    """Train, evaluate and export; returns the report on the main process (None on the other ranks, or when
    `stop_after_steps` ended the run early). The training checkpoint lives in `<out_dir>.training/`."""
    settings, log, dist = job.settings, job.log, job.dist
    dev = training_device(job.device)
    if dev.type == "cpu":
        apply_torch_threads("drafter training", log)
    source, lengths, manifest = data_source(job.hidden_root, job.merged, job.online_backend)
    splits = split_windows(job, lengths)
    built = build_drafter(job, manifest["hidden_size"], splits.train_ids, dev)
    model, teacher = built.model, built.teacher
    held_out = partial(eval_samples, source, splits.eval.windows, teacher, dev)

    untrained = score_untrained(model, held_out, settings.ttt_steps, dist, log, splits.eval_split)
    data = FixedWindows(source, splits.train.windows, settings, dev, dist)
    options = RunOptions(dev, log, job.checkpoint_dir, dist, job.stop_after_steps)
    keeper = best_checkpoint_keeper(job, manifest["aux_layer_ids"], data.fingerprint(model.draft_ids))
    hooks = ([keeper.hook()] if keeper is not None else []) + list(job.hooks)
    trainer = Trainer(model, data, settings, options, teacher, held_out if splits.eval.windows else None, hooks)
    history = trainer.fit()
    if len(history.epochs) < settings.epochs:  # stopped early
        return None
    best = keeper.finish(trainer) if keeper is not None else None  # the best drafter's weights now in `model`
    if not dist.main:
        return None
    trained = evaluate(model, held_out(), settings.ttt_steps)
    log(f"trained drafter on {splits.eval_split}: accept length {trained['accept_length']}, acc {trained['acc']}")
    best_keys = (
        {"best_step": best["best"]["step"], "best_accept_length_real": best["best"]["accept_length"]}
        if best is not None
        else {}
    )
    return export_report(
        job, built, manifest["aux_layer_ids"], splits, Outcome(untrained, trained, history, best, best_keys)
    )


def score_untrained(
    model: Eagle3Drafter,
    held_out: Callable[[], Any],
    steps: int,
    dist: Distributed,
    log: Callable[[str], None],
    split: str,
) -> dict[str, Any]:
    """The untrained drafter's scores on the held-out split, logged, from the main process; {} on the others, which
    wait for its word (`RankZeroWord`), not in the trainer's first collective, whose timeout a long evaluation
    could pass."""

    def score() -> dict[str, Any]:
        scores = evaluate(model, held_out(), steps)
        log(f"untrained drafter on {split}: accept length {scores['accept_length']}, acc {scores['acc']}")
        return scores

    def failed(reason: str) -> Exception:
        return DrafterError(f"rank 0 of the trainer failed scoring the untrained drafter: {reason}")

    return RankZeroWord(dist).alone(score, failed) or {}


@dataclass(frozen=True)
class BuiltDrafter:
    model: Eagle3Drafter
    teacher: Teacher  # the target's LM head on the draft ids, shared by evaluation and training (each argmax once)
    vocab: DraftVocabulary


def build_drafter(job: DrafterJob, hidden_size: int, train_ids: list[str], dev: torch.device) -> BuiltDrafter:
    """The model a job trains: the draft vocabulary of its training split, the shape of the target's config, the
    target's frozen embedding, warm-started when asked; and its teacher."""
    target_config = json.loads((Path(job.target_folder) / "config.json").read_text())
    target_config = target_config.get("text_config", target_config)
    embed, head = load_embed_and_head(Path(job.target_folder))
    vocab = draft_vocabulary(job, train_ids, embed.shape[0])
    kind = job.settings.drafter_kind
    if kind == "auto" and vocab.warm is not None:
        kind = vocab.warm.drafter_kind  # a warm start goes on with its own kind
    cfg = drafter_config(target_config, hidden_size, vocab.size, embed.shape[0], kind)
    job.log(
        f"drafter kind {cfg.drafter_kind} ({'chosen' if job.settings.drafter_kind != 'auto' else 'auto'}): "
        f"{cfg.num_attention_heads} heads, draft KV cache {cfg.kv_bytes_per_token()} bytes per token (bf16)"
    )
    torch.manual_seed(job.settings.seed)
    model = Eagle3Drafter(cfg, embed, vocab.draft_ids)
    if vocab.warm is not None:
        vocab.warm.load_into(model)
    model.to(dev)
    return BuiltDrafter(model, Teacher(head, model.draft_ids, dev), vocab)


@dataclass(frozen=True)
class Outcome:
    """What a training ends with: the scores before and after, its history, the best checkpoint's curve (None:
    the last step is exported) and more `eagle3_pipeline` keys for the exported config."""

    untrained: dict[str, Any]
    trained: dict[str, Any]
    history: TrainHistory
    best: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def export_report(
    job: DrafterJob, built: BuiltDrafter, aux_layer_ids: list[int], splits: Splits, outcome: Outcome
) -> DrafterReport:
    """The trained drafter exported as SGLang and vLLM load it, and the report of its training."""
    checkpoint = export_checkpoint(
        built.model.cpu(),
        job.out_dir,
        aux_layer_ids,
        extra={
            "eagle3_pipeline": {
                "ttt_steps": job.settings.ttt_steps,
                "train_samples": splits.train.samples,
                # teacher-forced over the whole TTT unroll, not decoded: named so, with its scale
                "eval_accept_length_simulated": outcome.trained["accept_length"],
                "eval_accept_length_simulated_about": SIMULATED_ABOUT.format(
                    steps=job.settings.ttt_steps, ceiling=job.settings.ttt_steps + 1
                ),
                "target": Path(job.target_folder).name,  # a name, not this machine's path
                "drafter_kind": built.model.cfg.drafter_kind,
            }
            | outcome.extra
        },
    )
    return DrafterReport(
        checkpoint=checkpoint,
        config=json.loads((checkpoint / "config.json").read_text()),
        draft_vocab_size=built.vocab.size,
        distinct_loss_tokens=built.vocab.distinct_loss_tokens,
        train_samples=splits.train.samples,
        eval_samples=splits.eval.samples,
        eval_split=splits.eval_split,
        untrained=outcome.untrained,
        trained=outcome.trained,
        history=outcome.history,
        train_tokens=splits.train.tokens,
        split_samples=splits.train.split_samples,
        windows=len(splits.train.windows),
        best_checkpoint=outcome.best,
        draft_ids=built.model.draft_ids.cpu().tolist(),
    )


def best_checkpoint_keeper(job: DrafterJob, aux_layer_ids: list[int], fingerprint: str) -> BestCheckpointKeeper | None:
    """The keeper of the job's `best` plan, its state in `<out_dir>.training/best/` (None: no plan)."""
    if job.best is None:
        return None
    prompts = prompts_by_kind(job.merged, job.best.prompts_per_kind)
    counts = ", ".join(f"{len(v)} {k}" for k, v in prompts.items())
    job.log(
        f"best checkpoint: real speculative decoding every {job.best.every} steps on {counts} held-out prompts, "
        f"{job.best.max_new_tokens} tokens each; the drafter with the highest accept length is exported"
    )
    return BestCheckpointKeeper(
        job.checkpoint_dir / "best", job.best, prompts, aux_layer_ids, fingerprint, job.log, job.dist.main
    )


@dataclass(frozen=True)
class Splits:
    train_ids: list[str]
    train: WindowPlan
    eval: WindowPlan
    eval_split: str  # "eval", or "train" when the eval split is empty


def split_windows(job: DrafterJob, lengths: dict[str, int]) -> Splits:
    """The train and eval splits' samples that have states, cut into windows (logged)."""
    merged, settings = job.merged, job.settings
    train_ids = [s for s in merged.filter(pl.col("split") == "train")["sample_id"].to_list() if s in lengths]
    eval_ids = [s for s in merged.filter(pl.col("split") == "eval")["sample_id"].to_list() if s in lengths]
    eval_split = "eval"
    if not eval_ids:
        job.log("the eval split is empty: metrics are measured on the training split")
        eval_ids, eval_split = train_ids, "train"
    train_plan = plan_windows([(s, lengths[s]) for s in train_ids], settings.max_len)
    eval_plan = plan_windows([(s, lengths[s]) for s in eval_ids], settings.max_len)
    where = "online (target in the loop)" if job.online_backend else "streamed from the store"
    job.log(
        f"drafter data: {train_plan.samples} training samples, {train_plan.tokens:,} tokens in "
        f"{len(train_plan.windows)} windows of at most {settings.max_len} ({train_plan.split_samples} longer samples "
        f"cut into windows, no token dropped); {eval_plan.samples} {eval_split} samples; {where}"
    )
    return Splits(train_ids, train_plan, eval_plan, eval_split)


@dataclass(frozen=True)
class DraftVocabulary:
    draft_ids: torch.Tensor
    size: int
    distinct_loss_tokens: int
    warm: DrafterCheckpoint | None  # the drafter warm-started from, whose draft ids are kept


def draft_vocabulary(job: DrafterJob, train_ids: list[str], vocab_size: int) -> DraftVocabulary:
    """The training split's most frequent loss tokens (or a warm start's draft ids), logged with their coverage."""
    wanted = set(train_ids)
    rows = job.merged.filter(pl.col("sample_id").is_in(list(wanted))).select("input_ids", "loss_mask").iter_rows()
    counts = count_loss_tokens((torch.as_tensor(ids), torch.as_tensor(mask)) for ids, mask in rows)
    warm = read_checkpoint(Path(job.init_from)) if job.init_from is not None else None
    if warm is not None:
        draft_ids = warm.draft_ids
        size = len(draft_ids)
        job.log(f"drafter: warm start from {job.init_from} ({size} draft ids kept)")
    else:
        size = effective_draft_vocab_size(job.requested_draft_vocab, len(counts))
        draft_ids = build_draft_vocab(counts, size, vocab_size)
    covered = sum(c for t, c in counts.items() if t in set(draft_ids.tolist())) / max(1, sum(counts.values()))
    job.log(f"draft vocabulary: {size} ids ({len(counts)} distinct loss tokens, {covered:.1%} of loss tokens covered)")
    return DraftVocabulary(draft_ids, size, len(counts), warm)


def data_source(
    hidden_root: Path | None, merged: pl.DataFrame, online_backend: Any
) -> tuple[SampleSource, dict[str, int], dict[str, Any]]:
    """(source, sample id -> tokens, {hidden_size, aux_layer_ids}) of the store, or of the target run online."""
    if online_backend is not None:
        rows = {sid: (ids, mask) for sid, ids, mask in merged.select("sample_id", "input_ids", "loss_mask").iter_rows()}
        return (
            OnlineSource(online_backend, rows),
            {s: len(r[0]) for s, r in rows.items()},
            {"hidden_size": online_backend.hidden_size, "aux_layer_ids": list(online_backend.layer_ids)},
        )
    if hidden_root is None:
        raise ValueError("the drafter reads the hidden-state store (hidden_root) or runs the target (online_backend)")
    store = HiddenStateStore(Path(hidden_root))
    lengths = {sid: end - start for sid, (_, start, end, _) in store.index.items()}
    return store, lengths, store.manifest
