"""Append-only JSON Lines journal: every paid (or expensive) result is on disk within a second.

One record per line. Writes go through the OS at once and are fsynced at most `sync_every_s`
apart, so a crash loses at most the last second; `kill -9` can leave a torn last line, which
`read_journal` detects, reports and skips (and `Journal` truncates before appending again).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class JournalContents:
    records: list[dict[str, Any]]
    torn_tail: bool  # the last line was cut short (crash mid-write) and was skipped
    bad_lines: list[int]  # complete lines that are not JSON objects (should never happen)
    valid_bytes: int  # length of the file up to the end of the last good record


def read_journal(path: Path) -> JournalContents:
    path = Path(path)
    if not path.exists():
        return JournalContents([], False, [], 0)
    data = path.read_bytes()
    records, bad = [], []
    torn = False
    valid = 0
    pos = 0
    lineno = 0
    while pos < len(data):
        end = data.find(b"\n", pos)
        lineno += 1
        if end < 0:  # no newline: the write was cut short
            torn = True
            break
        line = data[pos:end]
        pos = end + 1
        if not line.strip():
            valid = pos
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise ValueError("not an object")
        except ValueError:
            if pos >= len(data):  # a torn final line that happens to end in a newline byte
                torn = True
                break
            bad.append(lineno)
            valid = pos
            continue
        records.append(rec)
        valid = pos
    return JournalContents(records, torn, bad, valid)


class Journal:
    """Thread-safe appender. Use as a context manager; `close` fsyncs."""

    def __init__(self, path: Path, sync_every_s: float = 1.0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        existing = read_journal(self.path)
        self.recovered_torn_tail = existing.torn_tail
        if existing.torn_tail:
            with open(self.path, "r+b") as f:
                f.truncate(existing.valid_bytes)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()
        self._sync_every = sync_every_s
        self._last_sync = time.monotonic()
        self._dirty = False
        # Durable within about `sync_every_s` even when no further record arrives.
        self._stop = threading.Event()
        self._flusher = threading.Thread(target=self._flush_loop, name=f"journal-sync:{self.path.name}", daemon=True)
        self._flusher.start()

    def _flush_loop(self) -> None:
        while not self._stop.wait(self._sync_every):
            self.sync()

    def append(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
        with self._lock:
            os.write(self._fd, line)  # one write per record: O_APPEND keeps records whole
            self._dirty = True
            now = time.monotonic()
            if now - self._last_sync >= self._sync_every:
                os.fsync(self._fd)
                self._last_sync, self._dirty = now, False

    def stamped(self, run_id: str) -> Callable[[dict[str, Any]], None]:
        """An appender of one run's records: each stamped with the run's id and the time it is written, ahead of its
        own fields."""

        def note(record: dict[str, Any]) -> None:
            self.append({"run_id": run_id, "t": time.time(), **record})

        return note

    def sync(self) -> None:
        with self._lock:
            if self._dirty and self._fd >= 0:
                os.fsync(self._fd)
                self._last_sync, self._dirty = time.monotonic(), False

    def close(self) -> None:
        self._stop.set()
        if self._fd >= 0:
            self.sync()
            with self._lock:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
