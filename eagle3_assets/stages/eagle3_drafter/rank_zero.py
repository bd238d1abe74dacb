"""Rank 0's word to the other ranks of a torchrun job, while rank 0 alone does something that takes long (waits for
capture in the spool, `spool_data.py`; exports and decodes the best-checkpoint candidate, `best_checkpoint.py`).

The other ranks wait for rank 0's word in a broadcast over a gloo group (the world's under gloo; a gloo group of its
own under NCCL, which never sees these waits), never in the next step's gradient all-reduce: a collective waits at
most the process group's timeout (NCCL's default 10 min), and what rank 0 does may take longer. So rank 0 sends
"still waiting" every `heartbeat_s` (from a thread of its own, while its main thread works: `beating`), and each
round ends within the timeout. Its outcome goes to every rank: a message of the caller's (the spool's step, "wait",
"end"), "done" (`alone`), or "error" with rank 0's reason (`told`), which every other rank raises as its own error,
so a failure of rank 0's ends every rank with rank 0's reason rather than with a timeout.

The process group's timeout is torch's default unless `EAGLE3_COLLECTIVE_TIMEOUT_S` sets it (`collective_timeout`,
read by `train_cli.join_process_group` and by the gloo group made here); the heartbeat is then at most a quarter of
it (`heartbeat_interval`).
"""

from __future__ import annotations

import datetime
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

import torch

HEARTBEAT_S = 30.0  # at most this long between two words of rank 0's to the ranks that wait for it
TIMEOUT_ENV = "EAGLE3_COLLECTIVE_TIMEOUT_S"  # the process group's collective timeout, in seconds (unset: torch's)
STILL_WAITING = "still waiting"
T = TypeVar("T")
Message = tuple[Any, ...]  # (kind, *rest): ("still waiting",), ("done",), ("error", reason), or the caller's own


class Ranks(Protocol):
    """What this module reads of a process's place under torchrun (the trainer's `Distributed`, which imports this
    module: named here by shape, not imported)."""

    @property
    def world_size(self) -> int: ...

    @property
    def main(self) -> bool: ...


def collective_timeout() -> datetime.timedelta | None:
    """The process group's collective timeout `EAGLE3_COLLECTIVE_TIMEOUT_S` asks for (None: torch's default)."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return None
    seconds = float(raw)
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}: a collective timeout is a number of seconds above 0")
    return datetime.timedelta(seconds=seconds)


def heartbeat_interval() -> float:
    """`HEARTBEAT_S`, or a quarter of the collective timeout when that is shorter than four heartbeats."""
    timeout = collective_timeout()
    return HEARTBEAT_S if timeout is None else min(HEARTBEAT_S, timeout.total_seconds() / 4)


class RankZeroWord:
    """Rank 0's word to the other ranks (see the module's docstring). Every rank makes one at the same point of the
    run and uses it at the same points: its gloo group, made at the first word, is a collective of every rank."""

    def __init__(self, dist: Ranks, heartbeat_s: float | None = None):
        self.dist = dist
        self.heartbeat_s = heartbeat_s if heartbeat_s is not None else heartbeat_interval()
        if not self.heartbeat_s > 0:
            raise ValueError(f"a heartbeat every {self.heartbeat_s} s: it must be above 0")
        self._group: Any = None

    @property
    def group(self) -> Any:
        if self._group is None:
            if torch.distributed.get_backend() == "gloo":
                self._group = torch.distributed.group.WORLD
            else:
                self._group = torch.distributed.new_group(backend="gloo", timeout=collective_timeout())
        return self._group

    def send(self, message: Message) -> None:
        """Rank 0: `message` to every other rank."""
        torch.distributed.broadcast_object_list([message], src=0, group=self.group)

    def receive(self) -> Message:
        """Another rank: rank 0's next message, heartbeats included."""
        box: list[Any] = [None]
        torch.distributed.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def next_word(self, failed: Callable[[str], Exception]) -> Message:
        """Another rank: rank 0's next message that is not a heartbeat; its "error" raised as `failed(reason)`."""
        while True:
            message = self.receive()
            if message[0] == "error":
                raise failed(message[1])
            if message[0] != STILL_WAITING:
                return message

    def told(self, call: Callable[[], T]) -> T:
        """Rank 0: `call()`, made while the other ranks wait for its word; an error is told to them, then raised."""
        try:
            return call()
        except Exception as e:
            self.send(("error", f"{type(e).__name__}: {e}"))
            raise

    @contextmanager
    def beating(self) -> Iterator[None]:
        """Rank 0: "still waiting" to the other ranks every `heartbeat_s` while the block runs (on this thread, as
        any other work: a CUDA device stays this thread's); the heartbeat stopped, and its last word delivered,
        before the block's end is known to the caller. A heartbeat that cannot be sent (a rank gone) is raised here."""
        group = self.group  # made here, on the thread every rank makes it on, not on the heartbeat's
        done = threading.Event()
        failures: list[BaseException] = []

        def beat() -> None:
            while not done.wait(self.heartbeat_s):
                try:
                    torch.distributed.broadcast_object_list([(STILL_WAITING,)], src=0, group=group)
                except Exception as e:  # noqa: BLE001 - handed to the main thread, which raises it
                    failures.append(e)
                    return

        thread = threading.Thread(target=beat, name="rank0-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()
        if failures:
            raise failures[0]

    def alone(self, call: Callable[[], T], failed: Callable[[str], Exception]) -> T | None:
        """Every rank calls this at the same point: rank 0 runs `call()` (its result returned there) while the
        others wait for its word in heartbeat rounds, then return None; an error of rank 0's call is raised on
        rank 0 and, as `failed(reason)`, on every other rank. One process: `call()`."""
        if self.dist.world_size == 1:
            return call()
        if not self.dist.main:
            word = self.next_word(failed)
            if word[0] != "done":
                raise RuntimeError(f"rank 0's word out of turn: {word!r} (every rank must wait at the same point)")
            return None

        def beating_call() -> T:
            with self.beating():
                return call()

        result = self.told(beating_call)
        self.send(("done",))
        return result
