"""Files and folders that appear whole or not at all: written under another name, made durable, renamed into place.

A file: `write_text_atomic` / `write_json_atomic` write `<name>.tmp`, fsync it, rename it over `<name>` and fsync
the folder, so `<name>` is the old text or the new after any crash.

A folder (an exported drafter, a stand-in model or tokenizer): `published_folder(out)` hands out a staging folder
beside `out`, and when the block ends without an error, fsyncs what was written and swaps it in:

    <parent>/.<out>.staging~<host>~<pid>~<token>/    what is being written; removed if the block raises
    <parent>/.<out>.replaced~<host>~<pid>~<token>/   the previous `out`, between the two renames of the swap

A scratch folder (`scratch_folder`: `eagle3 gpu-check`'s disk measurement) is named the same way, `.scratch~`.

Each name says who made it, so a folder left by a killed writer is told from one a live writer is filling: before
staging, the publisher removes the leftovers in `out`'s folder whose writer is dead (its pid gone, on this host)
or that are older than STALE_AFTER_S (a writer on another host sharing the folder), and where a writer died
between the two renames (no `out`, a `.replaced` folder), puts the previous `out` back. Only names of this exact
form match: `eagle3_drafter.training/` and `eagle3_drafter.streaming/` (resumable state beside the drafter) never
do.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STAGING, REPLACED, SCRATCH = "staging", "replaced", "scratch"
STALE_AFTER_S = 24 * 3600.0  # a leftover of another host's writer: no export takes a day


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: Any, *, indent: int | None = 2) -> None:
    write_text_atomic(path, json.dumps(obj, indent=indent) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """Write, fsync, rename over `path`, fsync the directory: `path` is the old text or the new, never a mix."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


@contextmanager
def published_folder(out_dir: Path, *, replace: bool = True) -> Iterator[Path]:
    """A staging folder to fill; published as `out_dir` when the block ends, removed when it raises.

    `replace=False`: an `out_dir` that exists by then (a concurrent builder of the same content won) is kept and
    the staging folder dropped."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    recover_leftovers(out_dir.parent)
    staging = out_dir.with_name(leftover_name(out_dir, STAGING))
    staging.mkdir()
    try:
        yield staging
        fsync_tree(staging)
        swap_in(staging, out_dir, replace=replace)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def scratch_folder(parent: Path, purpose: str) -> Iterator[Path]:
    """A folder in `parent` for throwaway files (`.<purpose>.scratch~<host>~<pid>~<token>`), removed when the block
    ends; one a killed process left is removed by the next scratch or published folder made in `parent`."""
    parent = Path(parent)
    recover_leftovers(parent)
    folder = parent / leftover_name(parent / purpose, SCRATCH)
    folder.mkdir()
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def swap_in(staging: Path, out_dir: Path, *, replace: bool) -> None:
    """`staging` becomes `out_dir`; the previous `out_dir` is moved aside first and removed after."""
    replaced = out_dir.with_name(leftover_name(out_dir, REPLACED))
    if out_dir.exists() and replace:
        os.rename(out_dir, replaced)
    try:
        os.rename(staging, out_dir)
    except OSError:
        if replace or not out_dir.is_dir():
            raise
        return  # a concurrent builder published first: its folder is as good as ours
    fsync_dir(out_dir.parent)
    shutil.rmtree(replaced, ignore_errors=True)


def recover_leftovers(folder: Path) -> list[Path]:
    """In `folder`: put back a published folder a dead writer had moved aside, and remove dead writers' staging
    folders and replaced copies, whatever they publish (a best-checkpoint's step folder is never published twice, so
    its own next publish would never come); returns what was removed. A live writer's folders are left alone."""
    removed = []
    for left in leftovers(folder):  # a scratch folder's is removed like a staging folder's
        if not left.abandoned():
            continue
        target = folder / left.target
        if left.kind == REPLACED and not target.exists():
            os.rename(left.path, target)  # killed between the swap's renames: the previous folder is still the latest
            continue
        shutil.rmtree(left.path, ignore_errors=True)
        removed.append(left.path)
    return removed


def leftover_name(out_dir: Path, kind: str) -> str:
    return f".{out_dir.name}.{kind}~{socket.gethostname()}~{os.getpid()}~{secrets.token_hex(4)}"


LEFTOVER = re.compile(
    rf"\.(?P<target>.+)\.(?P<kind>{STAGING}|{REPLACED}|{SCRATCH})~(?P<host>[^~]+)~(?P<pid>\d+)~[0-9a-f]+"
)


@dataclass(frozen=True)
class Leftover:
    """A staging folder or a replaced copy, by its name: what it publishes and who made it."""

    path: Path
    target: str
    kind: str
    host: str
    pid: int

    def abandoned(self) -> bool:
        """Whether its writer is gone: a dead pid on this host, or too old to be anyone's."""
        try:
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:  # removed meanwhile by another publisher
            return False
        return age > STALE_AFTER_S or (self.host == socket.gethostname() and not pid_alive(self.pid))


def leftovers(folder: Path) -> list[Leftover]:
    """The staging folders and replaced copies in `folder`, newest first."""
    found = []
    for path in folder.glob(".*~*"):
        m = LEFTOVER.fullmatch(path.name)
        if m and path.is_dir():
            found.append(Leftover(path, m["target"], m["kind"], m["host"], int(m["pid"])))
    return sorted(found, key=lambda left: mtime(left.path), reverse=True)


def mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:  # another publisher removed it meanwhile
        return 0.0


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def fsync_tree(folder: Path) -> None:
    """Every file under `folder`, then each folder: the rename that publishes it must not outrun its bytes."""
    for path in sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        elif path.is_dir():
            fsync_dir(path)
    fsync_dir(folder)
