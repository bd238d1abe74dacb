"""A side's lease on what it writes in the spool: a generation number in a file of the lane (fencing, issue 42).

    <spool>/lanes/<lane>/writer.lease   the lane's capture side (its `SpoolWriter`)
    <spool>/trainer.lease               the trainer (its main rank's `SpoolReader`)

The POSIX lock a side takes first (lane_lock.py) is not enough on every shared file system: on `nolock`,
`local_lock` and Lustre `localflock` mounts it is node-local, on Lustre `noflock` there is none, and after an NFSv4
lease expires (a holder stalled past it) the server gives the lock to the next side while the stalled one still
thinks it holds it. So taking the lock also takes the lease (`take_lease`): the file's generation read, generation + 1
written with a token of the taker's own (under a name of its own, fsynced, renamed over the file, so the file is one
taker's whole record or another's), and that (generation, token) is the side's. Before every commit (a capture side's
shard renamed into its name, its lane's manifest written; the trainer's order.log append, consumer.json and its
deletions) the side reads the file again (`Lease.check`) and refuses with `SpoolFenced` when it is no longer its own.

Where the lock lies, two sides may take the lease at once and read the same generation: both write n + 1, the last
rename stands, and the token tells the other it lost. The later taker wins; the earlier's next commit is refused.

What a check cannot do: it is a read before a write, so a side that stalls between its check and its write
(microseconds, where before any stall of any length went unnoticed) can still commit once after losing the lease.
Closing that needs the storage to compare the generation at the write itself, which no shared file system offers a
rename.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_resources.atomic_files import fsync_dir
from eagle3_resources.errors import SpoolFenced
from eagle3_resources.hidden_states.shared_fs import read_json

WRITER_LEASE = "writer.lease"  # in a lane's folder
TRAINER_LEASE = "trainer.lease"  # in the spool's root


def read_lease(path: Path) -> dict[str, Any] | None:
    """The lease file's record (generation, token, what, host, pid, since), None before anyone took it."""
    try:
        return dict(read_json(path))
    except FileNotFoundError:
        return None


def describe(record: dict[str, Any] | None) -> str:
    if record is None:
        return "no lease at all (the file is gone)"
    return (
        f"generation {record.get('generation')}, taken by {record.get('what')} "
        f"(host {record.get('host')}, pid {record.get('pid')})"
    )


@dataclass(frozen=True)
class Lease:
    """A side's lease: the generation it wrote to `path`, and its token (which tells two takers of one number apart)."""

    path: Path
    generation: int
    token: str
    what: str

    def check(self) -> None:
        """Raise `SpoolFenced` unless `path` still records this lease: call it before each commit."""
        current = read_lease(self.path)
        if current is None or (current.get("generation"), current.get("token")) != (self.generation, self.token):
            raise SpoolFenced(
                f"{self.what} holds generation {self.generation} of {self.path}, which now records "
                f"{describe(current)}: a later side took the lease (this one stalled past its lock, or the lock was "
                "not exclusive on this file system), so this one refuses to write"
            )


def take_lease(path: Path, what: str) -> Lease:
    """Take the lease at `path` (see the module's docstring): the next generation, with a token of this taker's own."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    last = read_lease(path)
    generation = int(last["generation"]) + 1 if last is not None else 1
    token = secrets.token_hex(8)
    record = {
        "generation": generation,
        "token": token,
        "what": what,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": time.time(),
    }
    # A name of this taker's own (not a shared `.tmp`, which two takers would write at once), and not ending in `.tmp`,
    # which a lane's writer removes as its own leftovers.
    tmp = path.with_name(f".{path.name}.{token}")
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return Lease(path, generation, token, what)
