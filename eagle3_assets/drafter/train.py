"""Train an EAGLE-3 drafter with training-time test (TTT), on the device it runs on.

Teacher: the target's own next-token distribution, `lm_head(final hidden)`, restricted to the
draft vocabulary and renormalised; positions whose target argmax is outside the draft vocabulary
carry no loss. Loss: soft cross-entropy per TTT step, step k weighted `decay**k` (0.8 as in
SpecForge/EAGLE). Only positions predicting a completion token (loss mask) count.

Device: CUDA when present, with bf16 autocast over fp32 master weights (the optimizer and its
state stay fp32); the CPU otherwise, in fp32. Data: windows streamed from a source (see
`data.py`), packed into optimizer steps by a token budget. Checkpoints: every
`checkpoint_every` steps and at the end, the trainable weights, the optimizer, the scheduler,
the position in the data and the RNG, written atomically; a run that finds one resumes from it
and ends where an uninterrupted run ends. Data parallel: under `torchrun`, DDP (gloo on CPU,
NCCL on GPUs) with each step's windows spread over the ranks and gradients averaged so a step
equals the one-process step over the same windows.

Metrics, on the eval split (simulated: teacher-forced, no target in the loop):
- `acc_k`: share of completion positions where draft step k's argmax equals the target's argmax
  (out-of-vocabulary targets count as misses);
- `accept_length`: simulated accept length of greedy chain drafting, 1 + the number of leading
  draft steps that match, averaged over positions; it counts the bonus token, as SGLang does.
  SpecForge's `sum_k prod_j acc_j` is reported as `accept_length_product` (also with the 1 added).
  The real figure comes from `speculative.py`, with the target in the loop.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from eagle3_assets.drafter.data import (
    Sample,
    SampleSource,
    Teacher,
    Window,
    load_window,
    plan_steps,
)
from eagle3_assets.drafter.model import Eagle3Drafter, default_learning_rate

CHECKPOINT_FILE = "training_state.pt"


@dataclass
class TrainSettings:
    ttt_steps: int = 7
    step_decay: float = 0.8
    epochs: int = 6
    lr: float | None = None  # None: default_learning_rate(drafter width)
    warmup_steps: int = 20
    batch_tokens: int = 2048  # tokens per optimizer step (whole windows; at least one)
    max_len: int = 4096  # longer samples are cut into windows of this many tokens
    seed: int = 0
    checkpoint_every: int = 50  # optimizer steps between training checkpoints (and one at the end)


@dataclass
class TrainHistory:
    step_loss: list[float] = field(default_factory=list)
    step_loss_by_ttt: list[list[float]] = field(default_factory=list)
    epochs: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    resumed_from_step: int | None = None
    lr: float = 0.0
    device: str = "cpu"
    world_size: int = 1

    def to_dict(self) -> dict:
        return asdict(self)


def step_weights(model: Eagle3Drafter, s: Sample, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights [L], teacher index [L], in-range [L]) for TTT step k.

    Step k at position t predicts token t+2+k against the target distribution at t+1+k.
    """
    L = s.tokens.shape[0]
    t = torch.arange(L, device=s.tokens.device)
    in_range = t + 2 + k <= L - 1
    j = (t + 1 + k).clamp(max=L - 1)
    target_tok = (t + 2 + k).clamp(max=L - 1)
    weights = in_range & (s.mask[target_tok] == 1) & model.t2d[s.teacher_argmax[j]]
    return weights.float(), j, in_range & (s.mask[target_tok] == 1)


def sample_loss(model: Eagle3Drafter, run, s: Sample, settings: TrainSettings) -> tuple[torch.Tensor, list[float]]:
    """`run` is the module to call (the drafter, or its DDP wrapper, whose call syncs gradients)."""
    logits = run(s.aux, s.tokens, s.positions, settings.ttt_steps)
    denom = max(1.0, float(s.mask.sum()))
    total = torch.zeros((), device=s.tokens.device)
    per_step = []
    for k, lg in enumerate(logits):
        w, j, _ = step_weights(model, s, k)
        ce = -(s.teacher_p[j] * F.log_softmax(lg.float(), -1)).sum(-1)
        loss_k = (w * ce).sum() / denom
        per_step.append(loss_k.item())
        total = total + settings.step_decay**k * loss_k
    return total, per_step


@torch.no_grad()
def evaluate(model: Eagle3Drafter, samples: Iterable[Sample], steps: int) -> dict:
    was_training = model.training
    model.eval()
    correct = torch.zeros(steps)
    counted = torch.zeros(steps)
    accept_sum, accept_n = 0.0, 0
    draft_ids = model.draft_ids
    for s in samples:
        logits = model.unroll(s.aux, s.tokens, s.positions, steps)
        L = s.tokens.shape[0]
        chain_ok = torch.ones(L, dtype=torch.bool, device=s.tokens.device)
        accepted = torch.zeros(L, device=s.tokens.device)
        _, _, roots = step_weights(model, s, 0)
        for k, lg in enumerate(logits):
            w, j, valid = step_weights(model, s, k)
            hit = (draft_ids[lg.argmax(-1)] == s.teacher_argmax[j]) & (w > 0)
            correct[k] += float((hit & valid).sum())
            counted[k] += float(valid.sum())
            chain_ok &= hit
            accepted += chain_ok.float()
        accept_sum += float((1 + accepted)[roots].sum())
        accept_n += int(roots.sum())
    acc = (correct / counted.clamp(min=1)).tolist()
    product = 1 + sum(math.prod(acc[: k + 1]) for k in range(steps))
    model.train(was_training)
    return {
        "acc": [round(a, 4) for a in acc],
        "accept_length": round(accept_sum / max(1, accept_n), 4),
        "accept_length_product": round(product, 4),
        "positions": accept_n,
    }


def training_device(requested: str = "auto") -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def autocast(device: torch.device):
    """bf16 matmuls over fp32 master weights on CUDA; plain fp32 on the CPU (bf16 there is slower, not faster)."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


# ---------------------------------------------------------------- checkpoints


def data_fingerprint(windows: Sequence[Window], settings: TrainSettings, draft_ids: torch.Tensor) -> str:
    """What a checkpoint must have been trained on to be resumed: the windows, the settings, the draft vocabulary."""
    h = hashlib.sha256(json.dumps({k: v for k, v in asdict(settings).items() if k != "checkpoint_every"},
                                  sort_keys=True).encode())
    for w in windows:
        h.update(f"{w.sample_id}\0{w.start}\0{w.end}\n".encode())
    h.update(draft_ids.cpu().numpy().tobytes())
    return h.hexdigest()


def save_training_state(path: Path, state: dict) -> None:
    """Atomic: a kill mid-write leaves the previous checkpoint, never half of a new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def trainable_state(model: Eagle3Drafter) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------- the loop


@dataclass
class Distributed:
    """This process's place under torchrun (world_size 1: no torch.distributed at all)."""

    rank: int = 0
    world_size: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_sum(self, values: list[float], device: torch.device) -> list[float]:
        if self.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=device)
        torch.distributed.all_reduce(t)
        return t.tolist()

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()


def train(
    model: Eagle3Drafter,
    source: SampleSource,
    train_windows: Sequence[Window],
    eval_windows: Sequence[Window],
    settings: TrainSettings,
    *,
    head: torch.Tensor,
    device: torch.device,
    log: Callable[[str], None],
    checkpoint_dir: Path | None = None,
    dist: Distributed | None = None,
    stop_after_steps: int | None = None,
    teacher: Teacher | None = None,
) -> TrainHistory:
    """Train in place; resume from `checkpoint_dir` when it holds a checkpoint of this very run.

    `stop_after_steps` ends the loop early (after saving a checkpoint), as a kill would, for tests.
    """
    if not train_windows:
        raise ValueError("no training samples: every sample was dropped before the drafter stage")
    dist = dist or Distributed()
    model.to(device)
    draft_ids = model.draft_ids
    teacher = teacher or Teacher(head, draft_ids, device)
    params = [p for p in model.parameters() if p.requires_grad]
    lr = settings.lr if settings.lr is not None else default_learning_rate(model.cfg.hidden_size)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    plans = [plan_steps(train_windows, settings.batch_tokens, settings.seed, e) for e in range(settings.epochs)]
    total_steps = sum(len(p) for p in plans)

    def lr_at(step: int) -> float:
        if step < settings.warmup_steps:
            return (step + 1) / settings.warmup_steps
        progress = (step - settings.warmup_steps) / max(1, total_steps - settings.warmup_steps)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    history = TrainHistory(lr=lr, device=str(device), world_size=dist.world_size)
    fingerprint = data_fingerprint(train_windows, settings, draft_ids)
    ckpt = checkpoint_dir / CHECKPOINT_FILE if checkpoint_dir is not None else None
    epoch, step_in_epoch, global_step = 0, 0, 0
    if ckpt is not None and ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        if state["fingerprint"] == fingerprint:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            sched.load_state_dict(state["scheduler"])
            set_rng_state(state["rng"])
            epoch, step_in_epoch, global_step = state["epoch"], state["step_in_epoch"], state["global_step"]
            history = TrainHistory(**{**state["history"], "resumed_from_step": global_step})
            log(f"drafter: resumed from the checkpoint at step {global_step}/{total_steps} (epoch {epoch + 1})")
        else:
            log("drafter: the training checkpoint is of other data or settings; starting afresh")
    log(f"drafter: {total_steps} optimizer steps over {settings.epochs} epochs on {device}"
        f"{f' x {dist.world_size} processes' if dist.world_size > 1 else ''}, peak learning rate {lr:g}"
        + ("" if settings.lr is not None else f" (default for width {model.cfg.hidden_size})"))

    run = model
    if dist.world_size > 1:
        run = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)

    def checkpoint() -> None:
        if ckpt is not None and dist.main:
            save_training_state(ckpt, {
                "fingerprint": fingerprint, "model": trainable_state(model), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "rng": rng_state(), "epoch": epoch, "step_in_epoch": step_in_epoch,
                "global_step": global_step, "history": history.to_dict() | {"resumed_from_step": None},
            })
        dist.barrier()

    started = time.monotonic() - history.seconds
    run_started = last_log = time.monotonic()
    first_step, tokens_done = global_step, 0
    model.train()
    while epoch < settings.epochs:
        steps = plans[epoch]
        while step_in_epoch < len(steps):
            windows = [train_windows[i] for i in steps[step_in_epoch]]
            mine = windows[dist.rank :: dist.world_size]
            n = len(windows)
            tokens_done += sum(w.tokens for w in windows)
            opt.zero_grad(set_to_none=True)
            local_loss, local_steps = 0.0, [0.0] * settings.ttt_steps
            # Each window's loss / n, times world_size since DDP averages over ranks: the one-process step's gradient.
            work = mine or windows[:1]  # a rank without a window still joins the gradient all-reduce, with weight 0
            scale = (dist.world_size / n) if mine else 0.0
            for i, w in enumerate(work):
                s = load_window(source, w, teacher, device)
                sync = nullcontext() if (i == len(work) - 1 or dist.world_size == 1) else run.no_sync()
                with sync, autocast(device):
                    loss, per_step = sample_loss(model, run, s, settings)
                    (loss * scale).backward()
                if mine:
                    local_loss += loss.item() / n
                    local_steps = [a + b / n for a, b in zip(local_steps, per_step)]
            summed = dist.all_sum([local_loss, *local_steps], device)
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            sched.step()
            step_in_epoch += 1
            global_step += 1
            history.step_loss.append(round(summed[0], 6))
            history.step_loss_by_ttt.append([round(x, 6) for x in summed[1:]])
            if time.monotonic() - last_log >= 10 and dist.main:
                last_log = time.monotonic()
                elapsed = max(1e-9, time.monotonic() - run_started)
                rate = (global_step - first_step) / elapsed
                eta = (total_steps - global_step) / rate if rate > 0 else float("nan")
                log(f"drafter step {global_step}/{total_steps}: loss {summed[0]:.4f}, {tokens_done / elapsed:,.0f} tokens/s "
                    f"({dist.world_size} process(es)), ETA {eta:,.0f} s")
            if settings.checkpoint_every and global_step % settings.checkpoint_every == 0:
                history.seconds = time.monotonic() - started
                checkpoint()
            if stop_after_steps is not None and global_step >= stop_after_steps:
                history.seconds = time.monotonic() - started
                checkpoint()
                return history
        metrics = {}
        if eval_windows and dist.main:
            metrics = evaluate(model, (load_window(source, w, teacher, device) for w in eval_windows), settings.ttt_steps)
        metrics.update(epoch=epoch + 1, train_loss=history.step_loss[-1], seconds=round(time.monotonic() - started, 1))
        history.epochs.append(metrics)
        if dist.main:
            log(f"drafter epoch {epoch + 1}/{settings.epochs}: loss {metrics['train_loss']:.4f}, "
                f"eval acc {metrics.get('acc')}, accept length {metrics.get('accept_length')} ({metrics['seconds']}s)")
        epoch, step_in_epoch = epoch + 1, 0
    history.seconds = time.monotonic() - started
    checkpoint()
    return history
