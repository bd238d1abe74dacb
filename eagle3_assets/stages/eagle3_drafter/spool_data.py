"""Training from the spool (issue 27, streaming mode): the trainer's windows come from capture as it runs.

`SpoolWindows` is a `TrainingData` over a `SpoolReader` (eagle3_resources/hidden_states/spool.py). Its steps are
the reader's (`next_step`): every row of every planned shard in `passes` passes, shuffled and packed by the spool's
own settings (seed, window length, step tokens), so a step is a function of the adopted order, the same after any
restart. The trainer sees them as ONE epoch; `passes` replaces epochs (the run's `TrainSettings.epochs` must be 1,
and its `max_len`, `batch_tokens` and `seed` the spool's).

Exactly once. The reader's `Position` after the last step trained goes into the trainer's atomic checkpoint (its
"data" entry; an offline checkpoint has none), and `reader.commit(position)` is called only once that checkpoint is
durable (`durable`), which deletes the shards whose passes are all done and lets capture go on. A resumed trainer
opens the reader at its checkpoint's position (the reader catches the spool's ledger up if the kill fell between
the checkpoint and the commit); a fresh start opens it at the beginning, and the reader refuses that if the spool
has recorded progress (its shards may be gone: the weights that saw them are the only record of them).

Waiting. While the spool has no committed shard for the next step, the reader waits; before it does, it calls
`on_wait`, which must be the trainer's `checkpoint`: the checkpoint commits the position, the finished shards are
deleted, and capture, which may be waiting for that room, goes on. Without it both sides would wait for each other
(`train_from_spool` wires it).

The step count for the learning-rate schedule is an estimate from the capture plan (the plan records each shard's
tokens and windows, not its samples' lengths, and the adoption order across lanes is the order of their commits):
`estimate_steps`. The run may take a few steps more or fewer (packing); past the estimate the schedule holds its
last factor (`warmup_cosine`). An estimate of tokens / `batch_tokens` alone would be far too long where a step
holds one window (`batch_tokens` below a window's length): the schedule would then never decay as offline
training's does. The mean window length (for the FLOPs per token) is the plan's tokens per window.

Several ranks (torchrun DDP: gloo on CPU, NCCL on GPUs; `dist` is the trainer's `Distributed`). The spool has one
reader: rank 0's `SpoolReader` adopts, commits and deletes (one writer per file); the other ranks are `SpoolFollower`s,
which write nothing under the spool. Rank 0 plans steps ahead of the one trained, up to `prefetch_steps`, without
waiting (`try_next_step`: from the manifests, no shard bytes read) and broadcasts each new plan to every rank (over a
gloo group, whatever the training backend): the steps (their windows), with the references of shards not named before
(lane, name, key, the manifest entry with its chunk digests and index); "wait" when none can be planned and none is
left; or the end. The broadcast is the plan only: no rank waits for bytes to send or receive it. Every rank submits its
share of each planned step (`windows[rank::world_size]`, as `FixedWindows`) to its prefetcher (spool_prefetch.py), whose
threads read those rows (the chunks they lie in, each verified: spool.py's `ShardRows`) and pack them while the trainer
trains the steps before; the trainer takes them in order, and a read's error is raised on the training thread at the
step that needed it. On "wait" (nothing planned is left: the trainer's position is the reader's) every rank calls
`on_wait` (the trainer's checkpoint is collective: a barrier), then rank 0 waits for the step while the others wait in
the next broadcast; a long wait is broken by "still waiting" broadcasts every `heartbeat_s`, so no rank sits in one
collective past the process group's timeout (rank 0's word, its heartbeat and its errors: `rank_zero.RankZeroWord`,
which the best-checkpoint keeper's evaluation uses too). The decision to wait is rank 0's alone: ranks deciding for
themselves would reach the checkpoint's barrier on different steps. Deleting is safe with followers: rank 0 commits a
position only from the trainer's checkpoint at it, and every rank has trained every step before it (each step's gradient
all-reduce needs every rank's share, read from its shards), so the shards a commit deletes are needed by no rank again.
An error of rank 0's reader is broadcast too, so the followers raise it rather than wait. The figures are per rank:
`waited_s` (rank 0 waiting for capture, a follower waiting for rank 0's word after "wait") and `bytes_read` (the bytes
of the shard chunks this rank read); the streaming training side gathers every rank's at the end for its report
(`streaming_train.gather_figures`). Each rank also keeps its own record of the shards it read (`reads`: each at most
once, with the first step whose share needed it). `stop()` ends the steps while rank 0 waits (a watch of the capture
side raises there instead).

Steps are planned on the training thread, between steps (the reader's `on_wait` must run there, where the trainer's
state is a step's end), and read and packed ahead on the prefetcher's threads (`prefetch_steps` 0: on the training
thread when the trainer asks for the step, as before issue 42).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from eagle3_assets.stages.eagle3_drafter.data import PackedBatch, Sample, Teacher, Window, pack_windows
from eagle3_assets.stages.eagle3_drafter.model import Eagle3Drafter
from eagle3_assets.stages.eagle3_drafter.rank_zero import Message, RankZeroWord
from eagle3_assets.stages.eagle3_drafter.spool_prefetch import PREFETCH_STEPS, Prefetcher, StepRead
from eagle3_assets.stages.eagle3_drafter.train import (
    Distributed,
    Every,
    RunOptions,
    Trainer,
    TrainSettings,
)
from eagle3_resources.errors import SpoolStateError
from eagle3_resources.hidden_states.lease import Lease
from eagle3_resources.hidden_states.shared_fs import read_json
from eagle3_resources.hidden_states.spool import (
    LANES,
    PLAN,
    SETTINGS,
    Position,
    ShardRead,
    ShardRef,
    ShardRows,
    SpoolFollower,
    SpoolReader,
    SpoolWindow,
    Step,
    open_settings,
    read_step,
)

# What rank 0 broadcasts (a `Message`): ("steps", [Step, ...], {shard index: ShardRef of the shards not told before}),
# ("wait",), ("end",), and the word's own "still waiting" and "error". A plan, never data: no rank reads for it.


def read_plans(root: Path, lanes: Iterable[str]) -> dict[str, dict[str, Any]] | None:
    """Every lane's capture plan (plan.json), or None while a lane has not written its plan yet."""
    plans = {}
    for lane in sorted(lanes):
        try:
            plans[lane] = dict(read_json(Path(root) / LANES / lane / PLAN))  # ESTALE and EIO retried (shared_fs.py)
        except FileNotFoundError:
            return None
    return plans


def estimate_steps(plans: dict[str, dict[str, Any]], passes: int, batch_tokens: int, mix_shards: int = 1) -> int:
    """The run's optimizer steps, estimated from the capture plans: the shards in the order the reader adopts them
    when every lane keeps up (one from each lane in turn, each lane's in its plan's order), cut into mixes of
    `mix_shards`, slot i holding pass p of mix i - p, each slot's steps as `slot_steps` packs its windows."""
    queues = [
        [(int(shard["tokens"]), int(shard.get("windows", 0))) for shard in plans[lane]["shards"]]
        for lane in sorted(plans)
    ]
    order: list[tuple[int, int]] = []
    for k in range(max((len(q) for q in queues), default=0)):
        order.extend(q[k] for q in queues if k < len(q))
    mixes = [order[a : a + mix_shards] for a in range(0, len(order), mix_shards)]
    sizes = [(sum(t for t, _ in m), sum(w for _, w in m)) for m in mixes]
    n = len(sizes)
    steps = 0
    for i in range(n + passes - 1):
        parts = [sizes[i - p] for p in range(passes) if 0 <= i - p < n]
        steps += slot_steps(sum(t for t, _ in parts), sum(w for _, w in parts), batch_tokens)
    return steps


def slot_steps(tokens: int, windows: int, batch_tokens: int) -> int:
    """A slot's steps, estimated: as many of its mean windows a step as `batch_tokens` holds, at least one (a window
    longer than a step is a step of its own: with `batch_tokens` 1, a step per window). A plan that does not count
    windows (format 1): `ceil(tokens / batch_tokens)`, which is that when windows are short."""
    if windows <= 0 or tokens <= 0:
        return math.ceil(tokens / batch_tokens)
    per_step = max(1, batch_tokens * windows // tokens)
    return math.ceil(windows / per_step)


class SpoolWindows:
    """The trainer's steps from a spool, as one epoch (see the module's docstring)."""

    def __init__(
        self,
        root: Path,
        settings: TrainSettings,
        device: torch.device,
        log: Callable[[str], None],
        *,
        poll_s: float = 0.2,
        dist: Distributed | None = None,
        stop: Callable[[], bool] | None = None,
        heartbeat_s: float | None = None,
        lease: Lease | None = None,
        prefetch_steps: int = PREFETCH_STEPS,
    ):
        """`dist`: this rank under torchrun (None: one process); `stop()`: ends the steps while waiting for capture;
        `heartbeat_s`: rank 0's "still waiting" while it waits (None: `rank_zero.heartbeat_interval()`); `lease`: rank
        0's trainer lease, taken with the trainer lock (its reader's commits check it; None: the reader takes one);
        `prefetch_steps`: steps planned and read ahead of the one trained, on a thread of its own (0: each step read on
        the training thread when the trainer asks for it)."""
        self.root, self.device, self.poll_s, self.lease = Path(root), device, poll_s, lease
        self.prefetch_steps = prefetch_steps
        self.dist = dist or Distributed()
        self.stop = stop or (lambda: False)
        self.spool = open_settings(self.root)
        s = self.spool
        wrong = {
            name: (ours, theirs)
            for name, ours, theirs in (
                ("epochs", settings.epochs, 1),
                ("max_len", settings.max_len, s.max_len),
                ("batch_tokens", settings.batch_tokens, s.batch_tokens),
                ("seed", settings.seed, s.seed),
            )
            if ours != theirs
        }
        if wrong:
            raise ValueError(
                f"training from the spool {self.root}: these settings must be the spool's (passes replace epochs): "
                + ", ".join(f"{k} {a} (the spool's: {b})" for k, (a, b) in wrong.items())
            )
        self.settings = settings
        plans = read_plans(self.root, s.lanes)
        if plans is None:
            log(f"drafter: waiting for every capture lane's plan in {self.root / LANES}")
            while (plans := read_plans(self.root, s.lanes)) is None:
                time.sleep(poll_s)
        self.plans = plans
        shards = [shard for plan in plans.values() for shard in plan["shards"]]
        self.planned_tokens = sum(int(shard["tokens"]) for shard in shards)
        if not self.planned_tokens:
            raise ValueError(f"the spool {self.root}: its capture plans hold no token")
        self.estimated_steps = estimate_steps(plans, s.passes, s.batch_tokens, s.mix_shards)
        windows = sum(int(shard.get("windows", 0)) for shard in shards)
        # a plan of format 1 counts no windows: a shard's samples are at most max_len-token windows each
        self.mean_window = float(
            self.planned_tokens / windows if windows else min(s.max_len, self.planned_tokens / len(shards))
        )
        self.position = Position()  # after the last step handed out (= trained, when the trainer asks)
        self.steps_done = 0  # steps handed out, with the position
        self.reader: SpoolReader | None = None
        self.current: Step | None = None  # the step handed out last
        self.on_wait: Callable[[], None] | None = None  # the trainer's checkpoint (`train_from_spool` sets it)
        self.follower: SpoolFollower | None = None  # a rank other than 0: its shards
        self.word = RankZeroWord(self.dist, heartbeat_s)  # rank 0's word to the others (several ranks)
        self.follower_waited_s = 0.0
        self.planned: deque[Step] = deque()  # told (to every rank), submitted to the prefetcher, not handed out yet
        self.told: set[int] = set()  # rank 0: the shards whose references it has told the other ranks
        self.rows: dict[int, tuple[str, ShardRows]] = {}  # rank 0: the shards of the steps just decided, to plan
        self.prefetcher: Prefetcher | None = None

    # -- TrainingData

    def steps_in_epoch(self, epoch: int) -> int:
        return self.estimated_steps if epoch == 0 else 0

    def mean_window_tokens(self) -> float:
        return self.mean_window

    def fingerprint(self, draft_ids: torch.Tensor) -> str:
        """The training settings, the spool's settings (spool.json), every lane's capture plan, the draft vocabulary."""
        h = hashlib.sha256(
            json.dumps(
                {
                    "train": {k: v for k, v in asdict(self.settings).items() if k != "checkpoint_every"},
                    "spool": read_json(self.root / SETTINGS),
                    "plans": self.plans,
                },
                sort_keys=True,
            ).encode()
        )
        h.update(draft_ids.cpu().numpy().tobytes())
        return h.hexdigest()

    def checkpoint_state(self) -> dict[str, Any]:
        return {"spool_position": self.position.to_json(), "spool_steps": self.steps_done}

    def restore(self, state: dict[str, Any] | None) -> None:
        if state is None:
            raise ValueError("the resumed checkpoint holds no spool position: it is not of a run from this spool")
        self.position = Position.from_json(state["spool_position"])
        self.steps_done = int(state["spool_steps"])

    def durable(self) -> None:
        """The checkpoint at `position` is durable: record it in the spool, which deletes the shards it finished."""
        if self.reader is not None:
            self.reader.commit(self.position)

    def steps(self, epoch: int, start: int) -> Generator[tuple[list[Window], PackedBatch], None, None]:
        if epoch != 0 or start != self.steps_done:
            raise ValueError(
                f"the spool's steps are one epoch, resumed where the checkpoint's position is ({self.steps_done} "
                f"steps); asked for epoch {epoch} from step {start}"
            )
        self.prefetcher = Prefetcher(self._read, self.prefetch_steps)
        try:
            while self._plan_next():
                step = self.planned.popleft()
                yield self._handed_out(step, self.prefetcher.take(step))
        finally:
            self.close()

    def close(self) -> None:
        """Stop the prefetcher (the steps' end, a stop, a failure): its thread is joined."""
        if self.prefetcher is not None:
            self.prefetcher.close()

    @property
    def depth(self) -> int:
        """Steps planned ahead of the one handed out: the prefetcher's depth, at least the next step."""
        return max(1, self.prefetch_steps)

    def _plan_next(self) -> bool:
        """Plan steps until the next one is planned (False: the end), topping the plan up to `depth` steps."""
        if self.dist.world_size > 1:
            return self._lead() if self.dist.main else self._follow()
        reader = self._open_reader()
        self._plan(self._top_up(reader), {})
        if not self.planned:
            step = reader.next_step(self.stop, on_wait=self.on_wait)  # waits for capture; checkpoints first
            if step is None:
                return False
            self._plan([step], {})
        return True

    def _top_up(self, reader: SpoolReader) -> list[Step]:
        """Rank 0: the steps that can be decided now (their shards committed), up to `depth` planned: no data read."""
        new: list[Step] = []
        while len(self.planned) + len(new) < self.depth and (step := reader.try_next_step()) is not None:
            new.append(step)
            # its shards' rows now: deciding a later slot's steps drops a finished shard from the reader's index,
            # and a shard indexed again would be read again
            self.rows.update({k: reader.rows_of(k) for k in {w.shard for w in step.windows}})
        return new

    def _plan(self, steps: list[Step], refs: dict[int, ShardRef]) -> None:
        """Every rank: the steps rank 0 decided, each submitted to the prefetcher with this rank's share (`refs`: the
        shards rank 0 named with them, which a follower has not been told before)."""
        assert self.prefetcher is not None
        rank, world = self.dist.rank, self.dist.world_size
        for step in steps:
            # a rank left without a window joins with the step's first at weight 0, as `FixedWindows.pack` does
            share = step.windows[rank::world] or step.windows[:1]
            needed = sorted({w.shard for w in share})
            source: SpoolReader | SpoolFollower
            if self.dist.main:
                source = self._open_reader()
                rows = {k: self.rows.get(k) or source.rows_of(k) for k in needed}
            else:
                source = self.follower = self.follower or SpoolFollower(self.root, pin=self.device.type == "cuda")
                source.take(step.position, [refs[k] for k in sorted({w.shard for w in step.windows}) if k in refs])
                rows = {k: source.rows_of(k) for k in needed}
            self.planned.append(step)
            self.prefetcher.submit(StepRead(step, share, rows))
        self.rows.clear()  # the requests hold what they need

    def _read(self, request: StepRead) -> PackedBatch:
        """A step's share read and packed (the prefetcher's thread, or the training thread with `prefetch_steps` 0)."""
        cuda = self.device.type == "cuda"
        record = self._open_reader().record if self.dist.main else self._follower().record
        source = read_step(request.step.position, request.share, request.shards, record)
        aux_dtype = torch.bfloat16 if cuda else torch.float32
        share = [Window(w.sample_id, w.start, w.end) for w in request.share]
        return pack_windows(source, share, aux_dtype, cuda, 2.0 if cuda else 1.1, self.settings.ttt_steps)

    def _follower(self) -> SpoolFollower:
        assert self.follower is not None  # made by `_plan` before any step is submitted
        return self.follower

    def trained_out(self) -> bool:
        """Rank 0: every pass over every planned shard has been trained (the reader at its end). A run resumed from
        a checkpoint past its last step asks for no step, so the reader is opened here, at that checkpoint's
        position (which also records it in the spool if the run died before its commit)."""
        return self._open_reader().at_end()

    def _open_reader(self) -> SpoolReader:
        if self.reader is None:
            # at the checkpoint's position, or at the start (refused if the spool has recorded progress)
            self.reader = SpoolReader(
                self.root,
                position=self.position,
                poll_s=self.poll_s,
                lease=self.lease,
                pin=self.device.type == "cuda",  # rows copied to the GPU from pinned memory
            )
        return self.reader

    def _handed_out(self, step: Step, batch: PackedBatch) -> tuple[list[Window], PackedBatch]:
        """The step's windows (all ranks') and this rank's share packed; the step is the current one from here on."""
        windows = [Window(w.sample_id, w.start, w.end) for w in step.windows]
        # The trainer trains this step before it asks for the next one or checkpoints: the position is the step's end
        # from here on.
        self.current, self.position, self.steps_done = step, step.after, self.steps_done + 1
        return windows, batch

    @property
    def mine(self) -> list[SpoolWindow]:
        """This rank's windows of the current step (the ones it trains; none for a rank that joins it with weight 0)."""
        if self.current is None:
            return []
        return self.current.windows[self.dist.rank :: self.dist.world_size]

    # -- several ranks (see the module's docstring)

    def _lead(self) -> bool:
        """Rank 0: the steps it can decide now, told to every rank with the references of shards not told before (the
        plan only: nothing is read for it); with none planned, "wait" (the collective `on_wait` first) and the step
        capture gives, or the end (False)."""
        reader = self.word.told(self._open_reader)
        new = self.word.told(lambda: self._top_up(reader))
        if not new and not self.planned and not reader.finished:
            self.word.send(("wait",))
            if self.on_wait is not None:
                started = time.monotonic()
                self.on_wait()
                reader.waited_s += time.monotonic() - started  # as `next_step` counts it: the checkpoint included
            step = self.word.told(lambda: self._wait_for_capture(reader))
            new = [step] if step is not None else []
        if not new and not self.planned:
            self.word.send(("end",))
            return False
        shards = sorted({w.shard for step in new for w in step.windows} - self.told)
        refs = self.word.told(lambda: {k: reader.shard_ref(k) for k in shards})
        self.told.update(shards)
        self.word.send(("steps", new, refs))
        self._plan(new, refs)
        return True

    def _wait_for_capture(self, reader: SpoolReader) -> Step | None:
        """Rank 0: the reader's wait for the next step (None: the end, or `stop()`), with a "still waiting" to the
        other ranks every `heartbeat_s` (`RankZeroWord.beating`)."""
        with self.word.beating():
            return reader.next_step(self.stop)

    def _follow(self) -> bool:
        """A rank other than 0: rank 0's steps, planned as rank 0 planned them (False: the end), calling `on_wait` when
        rank 0 says "wait"."""
        waiting_since: float | None = None

        def failed(reason: str) -> Exception:
            return SpoolStateError(f"rank 0 of the trainer failed reading the spool {self.root}: {reason}")

        try:
            while True:
                message: Message = self.word.next_word(failed)  # "still waiting" skipped: this rank waits on
                kind, *rest = message
                if kind == "steps":
                    self._plan(rest[0], rest[1])
                    return True  # rank 0 tells steps only when it has one planned: so does this rank
                if kind == "end":
                    return False
                if kind == "wait":
                    waiting_since = time.monotonic()
                    if self.on_wait is not None:
                        self.on_wait()
        finally:
            if waiting_since is not None:
                self.follower_waited_s += time.monotonic() - waiting_since

    # -- figures

    @property
    def waited_s(self) -> float:
        """Seconds this rank waited for capture: rank 0 in the reader, another rank for rank 0's word."""
        return self.reader.waited_s if self.reader is not None else self.follower_waited_s

    @property
    def bytes_read(self) -> int:
        """Bytes of shard files this rank read."""
        if self.reader is not None:
            return self.reader.bytes_read
        return self.follower.bytes_read if self.follower is not None else 0

    @property
    def reads(self) -> list[ShardRead]:
        """The shard files this rank read, in order, each with the step that read it (its own record: rank 0 reads
        every shard at its first slot's first step, another rank each shard its share needs, at its first such step)."""
        if self.reader is not None:
            return self.reader.reads
        return self.follower.reads if self.follower is not None else []


# 11 parameters: the one-call form; its last four only reach `SpoolWindows`
def train_from_spool(
    model: Eagle3Drafter,
    root: Path,
    settings: TrainSettings,
    options: RunOptions,
    teacher: Teacher,
    held_out: Callable[[], Iterable[Sample]] | None = None,
    hooks: Sequence[Every] | Callable[[SpoolWindows], Sequence[Every]] = (),
    poll_s: float = 0.2,
    *,
    stop: Callable[[], bool] | None = None,
    heartbeat_s: float | None = None,
    lease: Lease | None = None,
    prefetch_steps: int = PREFETCH_STEPS,
) -> tuple[Trainer, SpoolWindows]:
    """Train in place from the spool at `root`, resuming from `options.checkpoint_dir` when it holds a checkpoint
    of this run; the trainer checkpoints whenever it has to wait for capture. `hooks` may be a function of the data
    (to read `SpoolWindows.current`, the step just trained). Under torchrun (`options.dist`, the process group
    joined) every rank calls it alike; rank 0 reads the spool, the others follow (the module's docstring). `stop()`
    ends the run while it waits for capture; `heartbeat_s`, `lease`, `prefetch_steps`: see `SpoolWindows`. Returns
    the trainer once it is done (its record: `trainer.history`; its position: `global_step`, also where a resume found
    every step trained) and the data (its figures, this rank's)."""
    if options.checkpoint_dir is None:
        raise ValueError("training from a spool needs a checkpoint folder: a shard is deleted only once checkpointed")
    data = SpoolWindows(
        root,
        settings,
        options.device,
        options.log,
        poll_s=poll_s,
        dist=options.dist,
        stop=stop,
        heartbeat_s=heartbeat_s,
        lease=lease,
        prefetch_steps=prefetch_steps,
    )
    trainer = Trainer(model, data, settings, options, teacher, held_out, hooks(data) if callable(hooks) else hooks)
    data.on_wait = trainer.checkpoint
    try:
        trainer.fit()
    finally:
        data.close()  # the prefetcher's thread ends with the run, whatever ended it
    return trainer, data
