"""Fault injection for tests: named moments inside a durable write of several steps (the trainer's checkpoint and
the spool commit it hands its position to) at which a test makes the process SIGKILL itself, on purpose.

A kill test that picks a random moment almost never lands inside a checkpoint's write, so a wrong order of its steps
(the spool told of a position before the checkpoint holding it is durable) would pass it. With these, a test kills
the process at each step boundary in turn and proves that a resume from every one of them is exact
(tests/test_spool_checkpoint_kills.py).

    EAGLE3_KILL_AT=NAME      SIGKILL at the first time this process reaches the point NAME
    EAGLE3_KILL_AT=NAME@N    ... at the Nth time

Unset (always, outside tests) a point costs one environment lookup; points are reached once per checkpoint, never
per step. Every point is listed in `KILL_POINTS`, in the order a checkpoint reaches them, with what is durable there.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

ENV = "EAGLE3_KILL_AT"

KILL_POINTS: dict[str, str] = {
    "checkpoint.tmp_written": "the new checkpoint written and fsynced as <name>.tmp; the previous one still in place",
    "checkpoint.renamed": "the new checkpoint renamed over the previous one; its folder not yet fsynced",
    "checkpoint.durable": "the new checkpoint durable (folder fsynced); the spool not yet told of its position",
    "spool.position_committed": "consumer.json records the new position; no finished shard deleted yet",
    "spool.shard_deleted": "a finished shard's file unlinked (each one); consumer.json not yet counting it deleted",
    "spool.deletions_recorded": "the finished shards deleted and consumer.json counting them",
}

_reached: Counter[str] = Counter()


def kill_point(name: str) -> None:
    """The fault-injection point `name` (one of `KILL_POINTS`): SIGKILL this process here if `EAGLE3_KILL_AT` names
    it (and this is the Nth time it is reached, for `NAME@N`)."""
    assert name in KILL_POINTS, name
    spec = os.environ.get(ENV)
    if not spec:
        return
    target, _, nth = spec.partition("@")
    if target not in KILL_POINTS:
        raise ValueError(f"{ENV}={spec!r}: no such kill point (they are {', '.join(KILL_POINTS)})")
    if target != name:
        return
    _reached[name] += 1
    if _reached[name] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
