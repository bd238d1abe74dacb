"""Train an EAGLE-3 drafter with training-time test (TTT), on the device it runs on.

Teacher: the target's own next-token distribution, `lm_head(final hidden)`, restricted to the
draft vocabulary and renormalised; positions whose target argmax is outside the draft vocabulary
carry no loss. Loss: soft cross-entropy per TTT step, step k weighted `decay**k` (0.8 as in
SpecForge/EAGLE). Only positions predicting a completion token (loss mask) count.

Device: CUDA when present, with bf16 autocast over fp32 master weights (the optimizer and its
state stay fp32; norms run in the activations' dtype, the frozen embedding is bf16); the CPU
otherwise, in fp32. Data: windows streamed from a source (see `data.py`), grouped into optimizer
steps by a token budget; a step's windows are packed into one sequence (attention stays inside each
window) and trained by ONE forward and backward per rank, read and packed ahead on a background
thread (pinned, copied without blocking on CUDA). Nothing in a step reads a device value on the host:
losses and the gradient norm stay on the device and are read every `LOG_EVERY` steps with one
`tolist()`. Fused AdamW. The loss never holds fp32 [tokens, vocab] tensors for backward (`loss.py`). Checkpoints: every
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
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from eagle3_assets.stages.eagle3_drafter.data import (
    PackedBatch,
    Sample,
    SampleSource,
    Teacher,
    Window,
    load_window,
    pack_windows,
    plan_steps,
)
from eagle3_assets.stages.eagle3_drafter.loss import soft_cross_entropy
from eagle3_assets.stages.eagle3_drafter.model import Eagle3Drafter, default_learning_rate, train_flops_per_token

CHECKPOINT_FILE = "training_state.pt"
LOG_EVERY = 32  # optimizer steps between reads of the device-side metrics (each read waits for the device)
PREFETCH_STEPS = 2  # steps packed ahead by the data thread


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
    compile: bool | None = None  # torch.compile the MLP block; None: on CUDA only (never needed for correctness)


@dataclass
class TrainHistory:
    step_loss: list[float] = field(default_factory=list)
    step_loss_by_ttt: list[list[float]] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)  # per step, before clipping
    epochs: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    resumed_from_step: int | None = None
    lr: float = 0.0
    device: str = "cpu"
    world_size: int = 1
    tokens: int = 0  # trained tokens (all ranks)
    tokens_per_s: float = 0.0  # all ranks' tokens over this process's training time (evaluation excluded)
    flops_per_token: float = 0.0  # `model.train_flops_per_token` at the mean window length
    compiled: bool = False  # the MLP ran under torch.compile
    mfu: float | None = (
        None  # per device: tokens_per_s / world_size x flops_per_token / the device's bf16 peak (known CUDA devices)
    )

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


def packed_loss(
    model: Eagle3Drafter,
    run,
    batch: PackedBatch,
    teacher_p: torch.Tensor,
    teacher_argmax: torch.Tensor,
    settings: TrainSettings,
    windows_in_step: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, per-TTT-step losses [steps]) of a packed batch: each window's TTT-weighted soft cross-entropy over
    its completion tokens, divided by its completion tokens (at least 1) and by the step's window count, summed.
    `run` is the module to call (the drafter, or its DDP wrapper, whose call syncs gradients). Device tensors only.
    """
    logits = run(batch.aux, batch.tokens, batch.positions, settings.ttt_steps, batch.layout)
    T = batch.tokens.shape[0]
    layout, mask = batch.layout, batch.mask
    t = torch.arange(T, device=mask.device)
    per_doc = torch.zeros(len(layout.lengths), device=mask.device).index_add_(0, layout.doc_id, mask.float())
    per_token = 1.0 / (per_doc.clamp(min=1)[layout.doc_id] * windows_in_step)
    total = torch.zeros((), device=mask.device)
    per_step = []
    for k, lg in enumerate(logits):
        target_tok = t + 2 + k  # step k at t predicts token t+2+k against the target's distribution at t+1+k
        j = (t + 1 + k).clamp(max=T - 1)
        w = (target_tok < layout.end) & (mask[target_tok.clamp(max=T - 1)] == 1) & model.t2d[teacher_argmax[j]]
        loss_k = soft_cross_entropy(lg, teacher_p, j, w * per_token)
        per_step.append(loss_k)
        total = total + settings.step_decay**k * loss_k
    return total, torch.stack(per_step).detach()


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
    h = hashlib.sha256(
        json.dumps({k: v for k, v in asdict(settings).items() if k != "checkpoint_every"}, sort_keys=True).encode()
    )
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
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


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

    def all_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Summed over the ranks, on the device (NCCL queues it on the stream: no host wait)."""
        if self.world_size > 1:
            torch.distributed.all_reduce(values)
        return values

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()


def prefetched(
    make: Callable[[list[int]], PackedBatch], steps: Sequence[list[int]], depth: int
) -> Iterator[PackedBatch]:
    """`make(step)` for each step in order, computed `depth` steps ahead on one background thread."""
    with ThreadPoolExecutor(1, thread_name_prefix="drafter-data") as pool:
        pending = deque(pool.submit(make, s) for s in steps[:depth])
        nxt = depth
        try:
            while pending:
                batch = pending.popleft().result()
                if nxt < len(steps):
                    pending.append(pool.submit(make, steps[nxt]))
                    nxt += 1
                yield batch
        finally:
            for f in pending:
                f.cancel()


PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H20": 148.0, "A100": 312.0, "L40S": 362.0, "B200": 2250.0}


def peak_tflops(device: torch.device) -> float | None:
    """Dense bf16 peak of a known CUDA device (spec sheets), for MFU; None elsewhere."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def compile_mlp(model: Eagle3Drafter, device: torch.device, log: Callable[[str], None]) -> bool:
    """torch.compile the decoder layer's MLP (fuses silu * up over [tokens, intermediate]); a compile that fails
    on a small input leaves the eager module (the trainer must never depend on it)."""
    mlp = model.midlayer.mlp
    try:
        mlp.compile(dynamic=True)
        # the dtype it will see in training (bf16 activations under CUDA autocast): no recompile at the first step
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        x = torch.randn(16, model.cfg.hidden_size, device=device, dtype=dtype, requires_grad=True)
        with autocast(device):
            mlp(x).float().sum().backward()
        mlp.zero_grad(set_to_none=True)
        return True
    except Exception as e:  # noqa: BLE001 - any compiler failure means: run eager
        mlp._compiled_call_impl = None
        mlp.zero_grad(set_to_none=True)
        log(f"drafter: torch.compile of the MLP failed ({type(e).__name__}: {e}); training eager")
        return False


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
    on_step: Callable[[int, int], None] | None = None,
) -> TrainHistory:
    """Train in place; resume from `checkpoint_dir` when it holds a checkpoint of this very run.

    `stop_after_steps` ends the loop early (after saving a checkpoint), as a kill would, for tests.
    `on_step(global_step, tokens so far)` is called after each optimizer step (benchmarks time steps with it).
    """
    if not train_windows:
        raise ValueError("no training samples: every sample was dropped before the drafter stage")
    dist = dist or Distributed()
    model.to(device)
    cuda = device.type == "cuda"
    if cuda:  # frozen: bf16 halves it (4.7 -> 2.3 GB at Kimi size) and feeds the bf16 norms directly
        model.embed_weight = model.embed_weight.to(torch.bfloat16)
    draft_ids = model.draft_ids
    teacher = teacher or Teacher(head, draft_ids, device)
    params = [p for p in model.parameters() if p.requires_grad]
    lr = settings.lr if settings.lr is not None else default_learning_rate(model.cfg.hidden_size)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95), fused=True)
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
    log(
        f"drafter: {total_steps} optimizer steps over {settings.epochs} epochs on {device}"
        f"{f' x {dist.world_size} processes' if dist.world_size > 1 else ''}, peak learning rate {lr:g}"
        + ("" if settings.lr is not None else f" (default for width {model.cfg.hidden_size})")
    )
    if settings.compile if settings.compile is not None else cuda:
        history.compiled = compile_mlp(model, device, log)

    run = model
    if dist.world_size > 1:
        run = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)

    mean_window = sum(w.tokens for w in train_windows) / len(train_windows)
    flops_per_token = train_flops_per_token(model.cfg, settings.ttt_steps, mean_window)["total"]
    peak = peak_tflops(device)
    pending: list[torch.Tensor] = []  # per step [loss, loss_0..loss_{k-1}, grad norm], on the device
    train_seconds = 0.0  # this process's time in the step loop (evaluation excluded)
    tokens_done = 0  # this process's run (a resumed run counts from its resume)
    tokens_counted = 0  # of tokens_done, those already added to history.tokens (which a resume carries over)

    def flush() -> None:
        """One read of the device for the steps since the last one."""
        nonlocal tokens_counted
        if pending:
            for row in torch.stack(pending).tolist():
                history.step_loss.append(round(row[0], 6))
                history.step_loss_by_ttt.append([round(x, 6) for x in row[1:-1]])
                history.grad_norm.append(float(f"{row[-1]:.7g}"))  # 7 significant digits, whatever its size
            pending.clear()
        history.tokens += tokens_done - tokens_counted
        tokens_counted = tokens_done
        if train_seconds > 0:
            rate = tokens_done / train_seconds
            history.tokens_per_s = round(rate, 1)
            history.flops_per_token = flops_per_token
            history.mfu = round(rate / dist.world_size * flops_per_token / (peak * 1e12), 4) if peak else None

    def checkpoint() -> None:
        flush()
        if ckpt is not None and dist.main:
            save_training_state(
                ckpt,
                {
                    "fingerprint": fingerprint,
                    "model": trainable_state(model),
                    "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(),
                    "rng": rng_state(),
                    "epoch": epoch,
                    "step_in_epoch": step_in_epoch,
                    "global_step": global_step,
                    "history": history.to_dict() | {"resumed_from_step": None},
                },
            )
        dist.barrier()

    aux_dtype = torch.bfloat16 if cuda else torch.float32

    def make(step: list[int]) -> PackedBatch:
        windows = [train_windows[i] for i in step]
        mine = windows[dist.rank :: dist.world_size]
        return pack_windows(source, mine or windows[:1], aux_dtype, pin=cuda, waste=2.0 if cuda else 1.1)

    started = time.monotonic() - history.seconds
    last_log = time.monotonic()
    first_step = global_step
    model.train()
    while epoch < settings.epochs:
        steps = plans[epoch]
        batches = prefetched(make, steps[step_in_epoch:], PREFETCH_STEPS)
        loop_started = time.monotonic()
        try:
            while step_in_epoch < len(steps):
                windows = [train_windows[i] for i in steps[step_in_epoch]]
                mine = bool(windows[dist.rank :: dist.world_size])  # a rank without a window joins with weight 0
                n = len(windows)
                tokens_done += sum(w.tokens for w in windows)
                batch = next(batches).to(device)
                opt.zero_grad(set_to_none=True)
                with autocast(device):
                    teacher_p, teacher_argmax = teacher.packed(batch)
                    loss, per_step = packed_loss(model, run, batch, teacher_p, teacher_argmax, settings, n)
                    # DDP averages over the ranks: times world_size, the one-process step's gradient
                    (loss * (dist.world_size if mine else 0.0)).backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(params, 0.5)
                opt.step()
                sched.step()
                metrics = torch.cat([loss.detach()[None], per_step]).float() * (1.0 if mine else 0.0)
                pending.append(torch.cat([dist.all_sum(metrics), grad_norm.detach().float()[None]]))
                step_in_epoch += 1
                global_step += 1
                if on_step is not None:
                    on_step(global_step, tokens_done)
                if len(pending) >= LOG_EVERY:
                    train_seconds += time.monotonic() - loop_started
                    loop_started = time.monotonic()
                    flush()
                    if time.monotonic() - last_log >= 10 and dist.main:
                        last_log = time.monotonic()
                        rate = (global_step - first_step) / max(1e-9, train_seconds)
                        eta = (total_steps - global_step) / rate if rate > 0 else float("nan")
                        log(
                            f"drafter step {global_step}/{total_steps}: loss {history.step_loss[-1]:.4f}, "
                            f"{history.tokens_per_s:,.0f} tokens/s ({dist.world_size} process(es))"
                            + (f", MFU {history.mfu:.1%}" if history.mfu is not None else "")
                            + f", ETA {eta:,.0f} s"
                        )
                stop = stop_after_steps is not None and global_step >= stop_after_steps
                if (settings.checkpoint_every and global_step % settings.checkpoint_every == 0) or stop:
                    if cuda:
                        torch.cuda.synchronize(device)
                    train_seconds += time.monotonic() - loop_started
                    history.seconds = time.monotonic() - started
                    checkpoint()
                    loop_started = time.monotonic()
                if stop:
                    return history
        finally:
            batches.close()
        if cuda:
            torch.cuda.synchronize(device)
        train_seconds += time.monotonic() - loop_started
        flush()
        metrics = {}
        if eval_windows and dist.main:
            metrics = evaluate(
                model, (load_window(source, w, teacher, device) for w in eval_windows), settings.ttt_steps
            )
        metrics.update(
            epoch=epoch + 1,
            train_loss=history.step_loss[-1],
            seconds=round(time.monotonic() - started, 1),
            tokens_per_s=history.tokens_per_s,
        )
        history.epochs.append(metrics)
        if dist.main:
            log(
                f"drafter epoch {epoch + 1}/{settings.epochs}: loss {metrics['train_loss']:.4f}, "
                f"eval acc {metrics.get('acc')}, accept length {metrics.get('accept_length')} ({metrics['seconds']}s, "
                f"{history.tokens_per_s:,.0f} training tokens/s"
                + (f", MFU {history.mfu:.1%}" if history.mfu is not None else "")
                + ")"
            )
        epoch, step_in_epoch = epoch + 1, 0
    history.seconds = time.monotonic() - started
    checkpoint()
    return history
