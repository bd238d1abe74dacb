"""One writer per spool lane, one trainer per spool: an exclusive POSIX lock held for a side's whole life.

The spool's rules assume one capture process writes a lane and one trainer reads the spool. A side that outlives its
orchestrator (kill -9 of the step) and a new run's side would otherwise both write (or both read) for a while. Each
side therefore takes an exclusive `fcntl.lockf` lock on a file of its own in the spool before it touches anything:

    <spool>/lanes/<lane>/writer.lock   the capture side of that lane
    <spool>/trainer.lock               the training side (its main rank)

POSIX record locks are the host's kernel's on a local disk and the server's on NFSv4 (its lock state; NFSv3 needs
lockd), so they hold across hosts sharing the spool; the kernel (or the server's lease) releases them when the
holder dies, however it dies. A second side waits for the lock (`wait_s`), saying who holds it (the holder writes
its host, pid and what it is into the file), and fails with `SpoolBusy` rather than working beside the first.

Beware POSIX semantics: a process loses its lock when it closes ANY descriptor of the file, so the holder keeps its
one descriptor and reads nothing else of it; a waiter reads the holder's line through its own descriptor.

The lock is the first line of defence only: shared file systems do not all give one that holds (lease.py). Taking it
also takes the side's lease, a generation number in the lane (`<name>.lease` beside `<name>.lock`), which `exclusive`
yields and every commit checks, so a side whose lock lied is refused at its next commit. Where the file system gives
no locks at all (`lockf` answers ENOSYS on a Lustre `noflock` mount, ENOLCK on NFS without a lock manager) that is
said in the log and the lease alone fences; only EACCES and EAGAIN mean "held by another".
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from eagle3_resources.errors import SpoolBusy
from eagle3_resources.hidden_states.lease import Lease, take_lease
from eagle3_resources.hidden_states.shared_fs import read_text
from eagle3_resources.hidden_states.spool import LANES

WRITER_LOCK = "writer.lock"
TRAINER_LOCK = "trainer.lock"
HELD = (errno.EACCES, errno.EAGAIN)  # lockf's answer when another process holds the lock
NO_LOCKS = (errno.ENOSYS, errno.ENOLCK)  # the file system gives none: Lustre `noflock`, NFS without a lock manager


def lane_lock_path(spool: Path, lane: str) -> Path:
    return Path(spool) / LANES / lane / WRITER_LOCK


def trainer_lock_path(spool: Path) -> Path:
    return Path(spool) / TRAINER_LOCK


def lease_path(lock: Path) -> Path:
    """The lease that goes with a lock: `writer.lock` -> `writer.lease` (lease.WRITER_LEASE), `trainer.lock` ->
    `trainer.lease`."""
    return Path(lock).with_suffix(".lease")


def holder(path: Path) -> str:
    """Who holds (or last held) the lock, as the holder wrote it."""
    try:
        text = read_text(path).strip()
    except FileNotFoundError:
        return "nobody yet"
    return text or "a process that has not written its name yet"


def try_lock(fd: int, path: Path, what: str, log: Callable[[str], None]) -> bool:
    """Take the lock on `fd` without waiting: False when another process holds it. A file system that gives no locks
    counts as taken (said in the log): the lease fences the side alone there."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in HELD:
            return False
        if e.errno not in NO_LOCKS:
            raise
        log(
            f"{what}: the file system of {path} gives no locks ({errno.errorcode[e.errno]}): relying on the lease "
            f"({lease_path(path).name}'s generation) alone to keep a second side from writing beside this one"
        )
    return True


@contextmanager
def exclusive(
    path: Path, what: str, *, wait_s: float, log: Callable[[str], None], poll_s: float = 0.5
) -> Iterator[Lease]:
    """Hold the exclusive lock on `path` (created if missing) for the block, and the lease that goes with it (taken
    once the lock is, yielded: the side's commits check it); wait for the lock at most `wait_s`, logging who holds it
    (at once, then every 30 s), then raise `SpoolBusy`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:  # wait for it
        started, said = time.monotonic(), -1e9
        while not try_lock(fd, path, what, log):
            waited = time.monotonic() - started
            if waited >= wait_s:
                raise SpoolBusy(
                    f"{path} is held by {holder(path)}: waited {waited:.0f} s for it; {what} refused to run beside it"
                )
            if time.monotonic() - said >= 30:
                said = time.monotonic()
                log(f"{what}: waiting for {path}, held by {holder(path)} (at most {wait_s:.0f} s)")
            time.sleep(poll_s)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "what": what, "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        os.fsync(fd)
        lease = take_lease(lease_path(path), what)
    except BaseException:
        os.close(fd)
        raise
    try:
        yield lease
    except Exception:
        os.close(fd)
        raise
    except BaseException:
        # SystemExit, KeyboardInterrupt: the process is leaving, maybe with threads still writing (a capture's
        # shard writers); the lock stays held until the process is gone, when the kernel releases it.
        raise
    os.close(fd)
