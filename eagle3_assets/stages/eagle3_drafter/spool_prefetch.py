"""Reads off the training thread (issue 42): a rank's share of the steps planned ahead, read and packed by threads of
their own, several steps before the trainer asks for them.

`SpoolWindows` (spool_data.py) plans steps ahead of the one it hands out (rank 0 decides them without reading a byte
and tells the other ranks) and `submit`s each, in order, with this rank's share of its windows and the shards they lie
in. The prefetcher reads those rows (chunk-verified: spool.py's `ShardRows`) and packs them (`load`: the trainer's
`pack_windows`, pinned on CUDA). The reads of the `depth` steps submitted ahead run at once, each on a thread of its
own: a read's latency is then paid once per `depth` steps, not once a step, so training does not wait on a slow
file system as long as its bandwidth keeps up (benchmarks/throttled_reader.py). `take` gives the steps back in the
order submitted, waiting if one is not ready yet. An error of a read (a damaged chunk, a file gone) is raised by
`take` on the training thread, at the step that needed it. `close` (the steps' end, a stop, a failure) cancels the
reads not started and waits for those under way.

The queue is bounded by the planner: it submits at most `depth` steps ahead of the one trained, so at most `depth`
packed steps are held. `depth` 0: no thread; `take` reads and packs the step on the caller's thread, when asked (what
the trainer did before, and the benchmark's "off").
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from eagle3_assets.stages.eagle3_drafter.data import PackedBatch
from eagle3_resources.hidden_states.spool import ShardRows, SpoolWindow, Step

# Steps read ahead by default: a read's latency is hidden behind this many steps of training; the packed steps held
# (pinned on CUDA) stay small beside the shards themselves.
PREFETCH_STEPS = 4


@dataclass(frozen=True)
class StepRead:
    """One step as this rank reads it: the step, this rank's share of its windows, and {shard index: (lane, rows)} of
    the shards they lie in (held by the request, so the planner may drop its own reference meanwhile)."""

    step: Step
    share: list[SpoolWindow]
    shards: dict[int, tuple[str, ShardRows]]


class Prefetcher:
    """Reads and packs the submitted steps ahead, `depth` at once (see the module's docstring)."""

    def __init__(self, load: Callable[[StepRead], PackedBatch], depth: int):
        self.load, self.depth = load, depth
        self._pool = ThreadPoolExecutor(depth, thread_name_prefix="spool-prefetch") if depth > 0 else None
        self._pending: deque[tuple[StepRead, Future[tuple[PackedBatch | None, BaseException | None]] | None]] = (
            deque()
        )  # submitted, not taken, in order

    def submit(self, request: StepRead) -> None:
        """Start reading `request` now (depth 0: when it is taken)."""
        self._pending.append((request, self._pool.submit(self._load, request) if self._pool is not None else None))

    def _load(self, request: StepRead) -> tuple[PackedBatch | None, BaseException | None]:
        """A prefetch thread's read of `request`: its batch, or the error that `take` raises on the training thread."""
        try:
            return self.load(request), None
        except BaseException as e:  # noqa: BLE001 - not lost with the thread: take() raises it
            e.add_note(f"read ahead by the spool's prefetcher for the step at {request.step.position}")
            return None, e

    def take(self, step: Step) -> PackedBatch:
        """The packed share of `step`, the oldest submitted and not yet taken; raises its read's error."""
        request, future = self._pending.popleft()
        if request.step.position != step.position:
            raise RuntimeError(f"the prefetcher read the step at {request.step.position}, the trainer asks for {step}")
        if future is None:
            return self.load(request)
        batch, error = future.result()
        if error is not None:
            raise error  # the read's own error (a damaged chunk names its file and chunk), on the training thread
        assert batch is not None
        return batch

    def close(self) -> None:
        """Cancel the reads not started, wait for those under way; nothing is read after this returns."""
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
