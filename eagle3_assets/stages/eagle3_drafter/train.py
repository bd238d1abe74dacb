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

The loop is `Trainer.fit`, read top to bottom: `set_up` (resume or start), then per epoch the steps (`step`,
then `after_step`: hooks, metrics read every `LOG_EVERY` steps, a checkpoint when due), then `end_epoch`
(evaluation), and a last checkpoint. What it trains is `TrainSettings` (frozen; the checkpoint's fingerprint
covers it), how it runs `RunOptions` (device, log, checkpoint folder, rank, early stop). Its windows come from
a `TrainingData` (`FixedWindows`: the store's or the online target's windows, shuffled per epoch; `SpoolWindows`
in spool_data.py: a spool filled by capture as training runs, its position kept in the checkpoint's "data" entry);
an `Every(n, call)` hook runs `call(trainer)` every n steps. `train()` is the one-call form.

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
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol, TypeVar

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
from eagle3_assets.stages.eagle3_drafter.model import (
    DRAFTER_KINDS,
    Eagle3Drafter,
    default_learning_rate,
    train_flops_per_token,
)
from eagle3_assets.stages.eagle3_drafter.rank_zero import RankZeroWord
from eagle3_resources.atomic_files import fsync_dir
from eagle3_resources.errors import DrafterError
from eagle3_resources.kill_points import kill_point

CHECKPOINT_FILE = "training_state.pt"
LOG_EVERY = 32  # optimizer steps between reads of the device-side metrics (each read waits for the device)
PREFETCH_STEPS = 2  # steps packed ahead by the data thread
T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
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
    # `model.DRAFTER_KINDS`, or "auto": by the target (`pipeline.default_drafter_kind`; a warm start's own kind)
    drafter_kind: str = "auto"

    def __post_init__(self) -> None:
        if self.drafter_kind != "auto" and self.drafter_kind not in DRAFTER_KINDS:
            raise ValueError(f"drafter_kind {self.drafter_kind!r} is not 'auto' or one of {list(DRAFTER_KINDS)}")


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
    flops_per_token: float = 0.0  # `model.train_flops_per_token` at the mean window length and `later_steps_share`
    later_steps_share: float = 1.0  # of this process's positions, those TTT steps >= 1 ran over (`model.loss_rows`)
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
    logits = run(batch.aux, batch.tokens, batch.positions, settings.ttt_steps, batch.layout, batch.rows)
    T = batch.tokens.shape[0]
    layout, mask = batch.layout, batch.mask
    every = torch.arange(T, device=mask.device)
    per_doc = torch.zeros(len(layout.lengths), device=mask.device).index_add_(0, layout.doc_id, mask.float())
    per_token = 1.0 / (per_doc.clamp(min=1)[layout.doc_id] * windows_in_step)
    total = torch.zeros((), device=mask.device)
    per_step = []
    for k, lg in enumerate(logits):
        t = batch.rows.index if k >= 1 and batch.rows is not None else every  # the rows step k ran over
        target_tok = t + 2 + k  # step k at t predicts token t+2+k against the target's distribution at t+1+k
        j = (t + 1 + k).clamp(max=T - 1)
        w = (target_tok < layout.end[t]) & (mask[target_tok.clamp(max=T - 1)] == 1) & model.t2d[teacher_argmax[j]]
        loss_k = soft_cross_entropy(lg, teacher_p, j, w * per_token[t])
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


def eval_samples(
    source: SampleSource, windows: Sequence[Window], teacher: Teacher, device: torch.device
) -> Iterator[Sample]:
    """The windows' samples on `device`, each read when `evaluate` reaches it."""
    return (load_window(source, w, teacher, device) for w in windows)


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
    kill_point("checkpoint.tmp_written")  # fault injection for tests (eagle3_resources/kill_points.py)
    os.replace(tmp, path)
    kill_point("checkpoint.renamed")
    fsync_dir(path.parent)  # the rename itself durable (a data source acts on it: `durable`)
    kill_point("checkpoint.durable")


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


# ---------------------------------------------------------------- what a run is given


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


@dataclass(frozen=True)
class RunOptions:
    """How a run is driven, beside what it trains (`TrainSettings`): on which device, logging where, checkpointing
    where (None: no checkpoint), as which rank, and where to stop early (after a checkpoint, as a kill would; for
    tests)."""

    device: torch.device
    log: Callable[[str], None]
    checkpoint_dir: Path | None = None
    dist: Distributed = field(default_factory=Distributed)
    stop_after_steps: int | None = None


@dataclass(frozen=True)
class Every:
    """A hook: `call(trainer)` after every `steps`-th optimizer step (the global step, so a resumed run keeps the
    cadence), on every rank, before that step's metrics are read and its checkpoint written. Its time counts as
    training time unless it runs inside `trainer.clock.paused()`, as an evaluation should. Work of the main process
    alone goes through `RankZeroWord.alone` (as the best-checkpoint keeper's and the epoch's evaluations do), so
    the other ranks wait for its word in heartbeat rounds, not in the next step's gradient all-reduce, which waits
    at most the collective timeout."""

    steps: int
    call: Callable[[Trainer], None]

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"a hook runs every 1 or more steps, not {self.steps}")


# ---------------------------------------------------------------- the data the loop reads


class TrainingData(Protocol):
    """Where the trainer's windows come from: the windows of each optimizer step, all ranks' (for the token count
    and each rank's share of the loss), with this rank's share packed on the host. The trainer keeps its
    position as (epoch, step in epoch) in its checkpoint and asks for the steps from there."""

    def steps_in_epoch(self, epoch: int) -> int: ...

    def mean_window_tokens(self) -> float: ...

    def fingerprint(self, draft_ids: torch.Tensor) -> str:
        """What a checkpoint must have been trained on to be resumed."""
        ...

    def steps(self, epoch: int, start: int) -> Generator[tuple[list[Window], PackedBatch], None, None]:
        """The epoch's steps from step `start` on; closed when the loop leaves them."""
        ...

    def checkpoint_state(self) -> dict[str, Any] | None:
        """What the data source keeps in the trainer's checkpoint beside (epoch, step), as of the last step handed
        out (the trainer asks only after training it); None: nothing (the checkpoint holds no "data" key)."""
        ...

    def restore(self, state: dict[str, Any] | None) -> None:
        """Given the resumed checkpoint's `checkpoint_state`, before `steps` is asked for."""
        ...

    def durable(self) -> None:
        """Called once a checkpoint is durable (written, fsynced, renamed, its folder fsynced)."""
        ...


class FixedWindows:
    """Windows known before training (the hidden-state store, or the target run online): shuffled by (seed,
    epoch), packed into steps by the token budget (`plan_steps`); this rank's share of each step read and packed
    on one background thread, `PREFETCH_STEPS` ahead (pinned on CUDA, for a copy that does not block)."""

    def __init__(
        self,
        source: SampleSource,
        windows: Sequence[Window],
        settings: TrainSettings,
        device: torch.device,
        dist: Distributed,
    ):
        if not windows:
            raise ValueError("no training samples: every sample was dropped before the drafter stage")
        self.source, self.windows, self.settings, self.device, self.dist = source, windows, settings, device, dist
        self.plans = [plan_steps(windows, settings.batch_tokens, settings.seed, e) for e in range(settings.epochs)]

    def steps_in_epoch(self, epoch: int) -> int:
        return len(self.plans[epoch])

    def mean_window_tokens(self) -> float:
        return sum(w.tokens for w in self.windows) / len(self.windows)

    def fingerprint(self, draft_ids: torch.Tensor) -> str:
        return data_fingerprint(self.windows, self.settings, draft_ids)

    def steps(self, epoch: int, start: int) -> Generator[tuple[list[Window], PackedBatch], None, None]:
        plan = [[self.windows[i] for i in step] for step in self.plans[epoch][start:]]
        batches = prefetched(self.pack, plan, PREFETCH_STEPS)
        try:
            for windows in plan:
                yield windows, next(batches)
        finally:
            batches.close()

    def checkpoint_state(self) -> None:
        return None  # the position is (epoch, step): the trainer's own

    def restore(self, state: dict[str, Any] | None) -> None:
        pass

    def durable(self) -> None:
        pass

    def pack(self, windows: list[Window]) -> PackedBatch:
        """This rank's windows of a step (the first window for a rank left without one: it joins with weight 0)."""
        cuda = self.device.type == "cuda"
        mine = windows[self.dist.rank :: self.dist.world_size]
        aux_dtype = torch.bfloat16 if cuda else torch.float32
        waste = 2.0 if cuda else 1.1
        return pack_windows(self.source, mine or windows[:1], aux_dtype, cuda, waste, self.settings.ttt_steps)


def prefetched(make: Callable[[T], R], items: Sequence[T], depth: int) -> Generator[R, None, None]:
    """`make(item)` for each item in order, computed `depth` items ahead on one background thread."""
    with ThreadPoolExecutor(1, thread_name_prefix="drafter-data") as pool:
        pending = deque(pool.submit(make, s) for s in items[:depth])
        nxt = depth
        try:
            while pending:
                batch = pending.popleft().result()
                if nxt < len(items):
                    pending.append(pool.submit(make, items[nxt]))
                    nxt += 1
                yield batch
        finally:
            for f in pending:
                f.cancel()


# ---------------------------------------------------------------- the trainer


class Clock:
    """The run's wall time (`elapsed`: evaluations and checkpoints included, carried over a resume) and this
    process's training time (`training`: the step loop's laps; what runs `paused()` is not counted)."""

    def __init__(self, device: torch.device, carried: float = 0.0):
        self.device = device
        self.started = time.monotonic() - carried
        self.since = time.monotonic()
        self.training = 0.0

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def lap(self) -> None:
        now = time.monotonic()
        self.training += now - self.since
        self.since = now

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Waits for the device's queued steps (they are training time), then leaves the block out."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.lap()
        yield
        self.since = time.monotonic()


# Dense bf16 tensor-core peaks from NVIDIA's spec sheets (half their "with sparsity" figures), by a fragment of the
# name `torch.cuda.get_device_name` reports. The first fragment found wins, so a variant comes before its family:
# the PCIe and NVL boards run at lower clocks and power than the SXM module ("NVIDIA H100 80GB HBM3"), and
# "H200" before "H20" (a different, much slower chip). GH200's Hopper is the SXM's.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200 NVL", 835.0),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H800 PCIe", 756.0),
    ("H200", 989.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("H20", 148.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("B200", 2250.0),
)


def peak_tflops_of(name: str) -> float | None:
    """Dense bf16 peak of a GPU by the name it reports; None for one not in the table."""
    return next((peak for fragment, peak in PEAK_BF16_TFLOPS if fragment in name), None)


def peak_tflops(device: torch.device) -> float | None:
    """Dense bf16 peak of a known CUDA device, for MFU; None elsewhere."""
    if device.type != "cuda":
        return None
    return peak_tflops_of(torch.cuda.get_device_name(device))


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


def warmup_cosine(warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """The learning rate's factor at a step: linear warmup, then a cosine down to 5%. A plain function, so the
    scheduler's checkpoint holds no state of it (as LambdaLR saves lambdas)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        # at most 1: a data source whose step count is an estimate (the spool's) may run past it; no effect otherwise
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class Trainer:
    """One training run, read top to bottom in `fit`: set up or resume, then each epoch's steps (`step`; after
    each, `after_step`: hooks, the metrics read every `LOG_EVERY` steps, a checkpoint when due), then the epoch's
    evaluation (`end_epoch`), and a last checkpoint. Its state is its attributes: the position (`epoch`,
    `step_in_epoch`, `global_step`), the optimizer and scheduler, the record (`history`), the device-side metrics
    not yet read (`pending`), and the clock."""

    def __init__(
        self,
        model: Eagle3Drafter,
        data: TrainingData,
        settings: TrainSettings,
        options: RunOptions,
        teacher: Teacher,
        held_out: Callable[[], Iterable[Sample]] | None = None,
        hooks: Sequence[Every] = (),
    ):
        """`held_out()`: the eval split's samples, scored at each epoch's end on the main process (None: none)."""
        self.model, self.data, self.settings, self.options = model, data, settings, options
        self.teacher, self.held_out, self.hooks = teacher, held_out, hooks
        self.dist, self.device, self.log = options.dist, options.device, options.log
        self.cuda = self.device.type == "cuda"
        model.to(self.device)
        if self.cuda:  # frozen: bf16 halves it (4.7 -> 2.3 GB at Kimi size) and feeds the bf16 norms directly
            model.embed_weight = model.embed_weight.to(torch.bfloat16)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.lr = settings.lr if settings.lr is not None else default_learning_rate(model.cfg.hidden_size)
        self.opt = torch.optim.AdamW(self.params, lr=self.lr, weight_decay=0.0, betas=(0.9, 0.95), fused=True)
        self.total_steps = sum(data.steps_in_epoch(e) for e in range(settings.epochs))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, warmup_cosine(settings.warmup_steps, self.total_steps))
        self.history = TrainHistory(lr=self.lr, device=str(self.device), world_size=self.dist.world_size)
        self.fingerprint = data.fingerprint(model.draft_ids)
        ckpt_dir = options.checkpoint_dir
        self.checkpoint_path = ckpt_dir / CHECKPOINT_FILE if ckpt_dir is not None else None
        self.epoch, self.step_in_epoch, self.global_step = 0, 0, 0
        self.module: torch.nn.Module = model  # what a step calls: the drafter, or its DDP wrapper
        self.pending: list[torch.Tensor] = []  # per step [loss, loss_0..loss_{k-1}, grad norm], on the device
        self.tokens_done = 0  # this process's run (a resumed run counts from its resume)
        self.tokens_counted = 0  # of tokens_done, those already added to history.tokens (which a resume carries over)
        self.flops_per_token = 0.0
        self.rows = [
            0,
            0,
        ]  # this process's (positions, of them those TTT steps >= 1 ran over), from the batches' shapes
        self.peak = peak_tflops(self.device)
        self.clock = Clock(self.device)
        self.first_step, self.last_log = 0, 0.0  # for the progress log's rate
        self.word = RankZeroWord(self.dist)  # the main process's word to the others while it evaluates alone
        self.stop_asked = False  # a hook's word to end the run after this step (`train`'s `on_step`)

    def fit(self) -> TrainHistory:
        """Train in place and return the record (also when `stop_after_steps` ends the run early)."""
        self.set_up()
        self.clock = Clock(self.device, carried=self.history.seconds)
        self.first_step, self.last_log = self.global_step, time.monotonic()
        self.model.train()
        while self.epoch < self.settings.epochs:
            with closing(self.data.steps(self.epoch, self.step_in_epoch)) as steps:
                for windows, batch in steps:
                    self.step(windows, batch)
                    if self.after_step():
                        return self.history  # stopped early, after a checkpoint
            self.end_epoch()
        self.history.seconds = self.clock.elapsed()
        self.save_checkpoint()
        return self.history

    # -------------------------------------------------------- the phases, in the order `fit` runs them

    def set_up(self) -> None:
        """Resume from a checkpoint of this very run if there is one; say what will run; compile the MLP where
        asked; wrap the drafter in DDP under several processes."""
        self.resume()
        self.log(
            f"drafter: {self.total_steps} optimizer steps over {self.settings.epochs} epochs on {self.device}"
            f"{f' x {self.dist.world_size} processes' if self.dist.world_size > 1 else ''}, peak learning rate "
            f"{self.lr:g}"
            + ("" if self.settings.lr is not None else f" (default for width {self.model.cfg.hidden_size})")
        )
        if self.settings.compile if self.settings.compile is not None else self.cuda:
            self.history.compiled = compile_mlp(self.model, self.device, self.log)
        if self.dist.world_size > 1:
            self.module = torch.nn.parallel.DistributedDataParallel(self.model, broadcast_buffers=False)
        self.flops_per_token = self.flops_at(1.0)

    def flops_at(self, later_share: float) -> float:
        mean_window = self.data.mean_window_tokens()
        return train_flops_per_token(self.model.cfg, self.settings.ttt_steps, mean_window, later_share)["total"]

    def resume(self) -> None:
        """Weights, optimizer, scheduler, RNG, position and record from the checkpoint, when it is of this data
        and these settings (its fingerprint); otherwise a fresh start."""
        if self.checkpoint_path is None or not self.checkpoint_path.exists():
            return
        state = torch.load(self.checkpoint_path, map_location="cpu", weights_only=False)
        if state["fingerprint"] != self.fingerprint:
            self.log("drafter: the training checkpoint is of other data or settings; starting afresh")
            return
        if set(state["model"]) != set(self.model.state_dict()):  # `auto` resolved to another kind since
            self.log("drafter: the training checkpoint is of another drafter kind or shape; starting afresh")
            return
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        self.epoch, self.step_in_epoch, self.global_step = state["epoch"], state["step_in_epoch"], state["global_step"]
        self.history = TrainHistory(**{**state["history"], "resumed_from_step": self.global_step})
        self.data.restore(state.get("data"))
        self.log(
            f"drafter: resumed from the checkpoint at step {self.global_step}/{self.total_steps} "
            f"(epoch {self.epoch + 1})"
        )

    def step(self, windows: list[Window], batch: PackedBatch) -> None:
        """One optimizer step: ONE forward and backward of this rank's packed share; the metrics stay on the
        device, in `pending` (nothing here reads a device value on the host)."""
        mine = bool(windows[self.dist.rank :: self.dist.world_size])  # a rank without a window joins with weight 0
        self.tokens_done += sum(w.tokens for w in windows)
        positions = batch.tokens.shape[0]
        self.rows[0] += positions
        self.rows[1] += len(batch.rows) if batch.rows is not None else positions
        batch = batch.to(self.device)
        self.opt.zero_grad(set_to_none=True)
        with autocast(self.device):
            teacher_p, teacher_argmax = self.teacher.packed(batch)
            loss, per_step = packed_loss(
                self.model, self.module, batch, teacher_p, teacher_argmax, self.settings, len(windows)
            )
            # DDP averages over the ranks: times world_size, the one-process step's gradient
            (loss * (self.dist.world_size if mine else 0.0)).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, 0.5)
        self.opt.step()
        self.sched.step()
        metrics = torch.cat([loss.detach()[None], per_step]).float() * (1.0 if mine else 0.0)
        self.pending.append(torch.cat([self.dist.all_sum(metrics), grad_norm.detach().float()[None]]))
        self.step_in_epoch += 1
        self.global_step += 1

    def after_step(self) -> bool:
        """The hooks due; the metrics read every `LOG_EVERY` steps (and progress logged every 10 s or more); a
        checkpoint every `checkpoint_every` steps. True when the run stops here (`stop_after_steps`, or a hook set
        `stop_asked`)."""
        for hook in self.hooks:
            if self.global_step % hook.steps == 0:
                hook.call(self)
        if len(self.pending) >= LOG_EVERY:
            self.clock.lap()
            self.flush()
            self.log_progress()
        stop = self.stop_asked or (
            self.options.stop_after_steps is not None and self.global_step >= self.options.stop_after_steps
        )
        every = self.settings.checkpoint_every
        if (every and self.global_step % every == 0) or stop:
            self.checkpoint()
        return stop

    def checkpoint(self) -> None:
        """A checkpoint now, its time left out of the training time (also what a data source calls while it waits)."""
        with self.clock.paused():
            self.history.seconds = self.clock.elapsed()
            self.save_checkpoint()

    def flush(self) -> None:
        """One read of the device for the steps since the last one: losses and gradient norms into the record,
        and the tokens, the rate and the MFU so far."""
        history = self.history
        if self.pending:
            for row in torch.stack(self.pending).tolist():
                history.step_loss.append(round(row[0], 6))
                history.step_loss_by_ttt.append([round(x, 6) for x in row[1:-1]])
                history.grad_norm.append(float(f"{row[-1]:.7g}"))  # 7 significant digits, whatever its size
            self.pending.clear()
        history.tokens += self.tokens_done - self.tokens_counted
        self.tokens_counted = self.tokens_done
        if self.clock.training > 0:
            rate = self.tokens_done / self.clock.training
            history.tokens_per_s = round(rate, 1)
            if self.rows[0]:
                history.later_steps_share = round(self.rows[1] / self.rows[0], 4)
                self.flops_per_token = self.flops_at(history.later_steps_share)
            history.flops_per_token = self.flops_per_token
            peak, world = self.peak, self.dist.world_size
            history.mfu = round(rate / world * self.flops_per_token / (peak * 1e12), 4) if peak else None

    def log_progress(self) -> None:
        if time.monotonic() - self.last_log < 10 or not self.dist.main:
            return
        self.last_log = time.monotonic()
        rate = (self.global_step - self.first_step) / max(1e-9, self.clock.training)
        eta = (self.total_steps - self.global_step) / rate if rate > 0 else float("nan")
        h = self.history
        self.log(
            f"drafter step {self.global_step}/{self.total_steps}: loss {h.step_loss[-1]:.4f}, "
            f"{h.tokens_per_s:,.0f} tokens/s ({self.dist.world_size} process(es))"
            + (f", MFU {h.mfu:.1%}" if h.mfu is not None else "")
            + f", ETA {eta:,.0f} s"
        )

    def save_checkpoint(self) -> None:
        """The metrics read, then (main process) the weights, optimizer, scheduler, RNG, position and record,
        written atomically; every rank waits for it."""
        self.flush()
        if self.checkpoint_path is not None and self.dist.main:
            data_state = self.data.checkpoint_state()
            save_training_state(
                self.checkpoint_path,
                {
                    "fingerprint": self.fingerprint,
                    "model": trainable_state(self.model),
                    "optimizer": self.opt.state_dict(),
                    "scheduler": self.sched.state_dict(),
                    "rng": rng_state(),
                    "epoch": self.epoch,
                    "step_in_epoch": self.step_in_epoch,
                    "global_step": self.global_step,
                    "history": self.history.to_dict() | {"resumed_from_step": None},
                }
                | ({"data": data_state} if data_state is not None else {}),
            )
            self.data.durable()
        self.dist.barrier()

    def epoch_eval_failed(self, reason: str) -> Exception:
        return DrafterError(f"rank 0 of the trainer failed evaluating epoch {self.epoch + 1}: {reason}")

    def end_epoch(self) -> None:
        """The epoch's metrics read; the eval split scored (main process; not training time); the epoch recorded,
        logged, and the position moved to the next epoch's first step."""
        with self.clock.paused():
            self.flush()
            metrics: dict[str, Any] = {}
            if self.held_out is not None:
                held_out, steps = self.held_out, self.settings.ttt_steps
                scored = self.word.alone(lambda: evaluate(self.model, held_out(), steps), self.epoch_eval_failed)
                metrics = scored or {}  # the others' record of the epoch has no evaluation figures
            h = self.history
            seconds = round(self.clock.elapsed(), 1)
            metrics.update(
                epoch=self.epoch + 1, train_loss=h.step_loss[-1], seconds=seconds, tokens_per_s=h.tokens_per_s
            )
            h.epochs.append(metrics)
            if self.dist.main:
                self.log(
                    f"drafter epoch {self.epoch + 1}/{self.settings.epochs}: loss {metrics['train_loss']:.4f}, "
                    f"eval acc {metrics.get('acc')}, accept length {metrics.get('accept_length')} ({seconds}s, "
                    f"{h.tokens_per_s:,.0f} training tokens/s"
                    + (f", MFU {h.mfu:.1%}" if h.mfu is not None else "")
                    + ")"
                )
        self.epoch, self.step_in_epoch = self.epoch + 1, 0


def ask_on_step(on_step: Callable[[int, int], bool | None], trainer: Trainer) -> None:
    """`train`'s `on_step` as a hook: told the step and the tokens so far, it may ask the run to end here."""
    trainer.stop_asked = bool(on_step(trainer.global_step, trainer.tokens_done))


# 13 parameters: the one-call form tests and benchmarks use; it only sorts them into `Trainer`'s objects
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
    on_step: Callable[[int, int], bool | None] | None = None,
) -> TrainHistory:
    """Train in place on `train_windows` of `source`, evaluating `eval_windows` at each epoch's end; resume from
    `checkpoint_dir` when it holds a checkpoint of this very run.

    `stop_after_steps` ends the loop early (after saving a checkpoint), as a kill would, for tests.
    `on_step(global_step, tokens so far)` is called after each optimizer step (benchmarks time steps with it); when
    it returns True the run ends after that step as at `stop_after_steps` (a benchmark's time budget; under several
    processes every rank must return the same, as they all reach the same step count).
    """
    dist = dist or Distributed()
    data = FixedWindows(source, train_windows, settings, device, dist)
    teacher = teacher or Teacher(head, model.draft_ids, device)
    options = RunOptions(device, log, checkpoint_dir, dist, stop_after_steps)
    held_out = partial(eval_samples, source, eval_windows, teacher, device) if eval_windows else None
    hooks = [Every(1, partial(ask_on_step, on_step))] if on_step is not None else []
    return Trainer(model, data, settings, options, teacher, held_out, hooks).fit()
