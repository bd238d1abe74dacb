"""Reading the files a streaming run's two sides share, as shared file systems give them (issue 42).

Both sides poll files the other replaces by rename (spool.json, consumer.json, a lane's plan.json and manifest.json,
the lease files, the orchestrator's heartbeat, the training report) or appends to (order.log, the progress files).
On NFS a read of a file another client has just replaced can fail with ESTALE: the open file's handle names the
inode the rename removed on the server (the Linux client retries a stale handle itself on a lookup by name, not on a
read of a file already open). NFS during a server's failover or grace period and Lustre during a target's recovery
answer EIO for a moment. Both are retried here, the read started again by name (which finds the new file): `TRIES`
reads, `FIRST_WAIT_S` doubling between them (0.01 + 0.02 + 0.04 + 0.08 = 0.15 s in all), then `SharedFileUnreadable`
names the file and the errno. Any other error is raised at once: FileNotFoundError above all, whose meaning each
caller knows (not written yet, or deleted).

A JSON decode error is not retried: a file replaced by rename is read as the old version or the new, never a mix
(`write_text_atomic` writes and fsyncs the new text under another name first), so text that does not parse would
not parse on a retry either.

A thread that polls these files in the background (the sides' orphan watch, the orchestrator's heartbeat and its
spool sampler) is a `ReportingThread`: its exception is kept for its owner, not printed to stderr as the thread dies.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from eagle3_resources.errors import SharedFileUnreadable

RETRIED = frozenset({errno.ESTALE, errno.EIO})  # a replaced file's stale handle; a server or target recovering
TRIES = 5
FIRST_WAIT_S = 0.01

T = TypeVar("T")


def retrying(path: Path, operation: Callable[[Path], T]) -> T:
    """`operation(path)`, started again after an ESTALE or EIO (see the module's docstring); `SharedFileUnreadable`
    once every try failed so."""
    wait, spent = FIRST_WAIT_S, 0.0
    for attempt in range(1, TRIES + 1):
        try:
            return operation(path)
        except OSError as e:
            # an inner retry's verdict is final: retrying it again would only multiply the waits
            if isinstance(e, SharedFileUnreadable) or e.errno not in RETRIED:
                raise
            if attempt == TRIES:
                name = errno.errorcode.get(e.errno, str(e.errno))
                raise SharedFileUnreadable(
                    e.errno, f"{name} ({os.strerror(e.errno)}) on each of {TRIES} tries over {spent:.2f} s", str(path)
                ) from e
        time.sleep(wait)
        spent += wait
        wait *= 2
    raise AssertionError("unreachable: the last try returns or raises")


def _read_from(path: Path, offset: int) -> bytes:
    with open(path, "rb") as f:
        if offset:
            f.seek(offset)
        return f.read()


def read_bytes(path: Path, offset: int = 0) -> bytes:
    """The file's bytes from `offset` on, retried as the module's docstring says."""
    return retrying(Path(path), lambda p: _read_from(p, offset))


def read_text(path: Path) -> str:
    return read_bytes(path).decode()


def read_json(path: Path) -> Any:
    return json.loads(read_bytes(path))


class ReportingThread(threading.Thread):
    """A daemon thread running `body` whose exception is not lost with it: kept in `error` (noted with the thread's
    name), handed to `on_error` at once (the owner's way to act on it from the thread: log it, stop the process),
    and raised in the owner's thread by `raise_if_failed`."""

    def __init__(self, name: str, body: Callable[[], None], on_error: Callable[[Exception], None] | None = None):
        super().__init__(name=name, daemon=True)
        self._body, self._on_error = body, on_error
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            self._body()
        except Exception as e:  # noqa: BLE001 - kept for the owner: a dying thread's exception only reaches stderr
            e.add_note(f"raised in the background thread {self.name!r}")
            self.error = e
            if self._on_error is not None:
                self._on_error(e)

    def raise_if_failed(self) -> None:
        """Raise the thread's exception here, if it ended by one."""
        if self.error is not None:
            raise self.error
