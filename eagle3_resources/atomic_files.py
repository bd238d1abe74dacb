"""Files and folders that appear whole or not at all: written under another name, made durable, renamed into place.

A file: `write_text_atomic` / `write_json_atomic` write `<name>.tmp`, fsync it, rename it over `<name>` and fsync
the folder, so `<name>` is the old text or the new after any crash.

A folder (an exported drafter, a stand-in model or tokenizer): `published_folder(out)` hands out a staging folder
beside `out`, and when the block ends without an error, fsyncs what was written and swaps it in:

    <parent>/.<out>.staging~<who>~<when>~<token>/    what is being written; removed if the block raises
    <parent>/.<out>.replaced~<who>~<when>~<token>/   the previous `out`, between the two renames of the swap

`<who>` is the writer's host, its boot and pid namespace (hashed) and its pid; `<when>` the folder's making, in
seconds. A scratch folder (`scratch_folder`: `eagle3 gpu-check`'s disk measurement) is named the same way,
`.scratch~`. So a folder left by a killed writer is told from one a live writer is filling: before staging, the
publisher removes the leftovers in `out`'s folder whose writer is dead (its pid gone, where this process's pids
mean the same) or that are older than STALE_AFTER_S (a writer elsewhere: another host or container sharing the
folder), and where a writer died between the two renames (no `out`, a `.replaced` folder), puts the previous `out`
back. Only names of this exact form match: `eagle3_drafter.training/` and `eagle3_drafter.streaming/` (resumable
state beside the drafter) never do.

Where the file system can (Linux's `renameat2(RENAME_EXCHANGE)`: ext4, xfs, btrfs, tmpfs), the swap is one step
(`exchange`): `out` is the old folder or the new at every moment, and two exports of the same folder at once both
succeed, the later one standing. Elsewhere (NFS, other systems) it is the two renames above: a reader may find `out`
missing for the moment between them (a kill there is repaired by the next publish), and of two concurrent exports
one may fail, with nothing lost. Either way a reader that opens one file of `out` before a swap and another after
it reads a mix: a loader should be pointed at a drafter that is not being exported.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
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
def published_folder(out_dir: Path, *, replace: bool = True, marker: str | None = None) -> Iterator[Path]:
    """A staging folder to fill; published as `out_dir` when the block ends, removed when it raises.

    `replace=False`: an `out_dir` that exists by then, holding `marker` (a concurrent builder of the same content
    won), is kept and the staging folder dropped; one without it is an error, not a folder to trust."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    recover_leftovers(out_dir.parent)
    token = secrets.token_hex(4)
    staging = out_dir.with_name(leftover_name(out_dir, STAGING, token))
    staging.mkdir()
    try:
        yield staging
        fsync_tree(staging)
        if replace:
            swap_in(staging, out_dir, out_dir.with_name(leftover_name(out_dir, REPLACED, token)))
        else:
            publish_once(staging, out_dir, marker)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def scratch_folder(parent: Path, purpose: str) -> Iterator[Path]:
    """A folder in `parent` for throwaway files (`.<purpose>.scratch~...`), removed when the block ends; one a
    killed process left is removed by the next scratch or published folder made in `parent`."""
    parent = Path(parent)
    recover_leftovers(parent)
    folder = parent / leftover_name(parent / purpose, SCRATCH, secrets.token_hex(4))
    folder.mkdir()
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def swap_in(staging: Path, out_dir: Path, replaced: Path) -> None:
    """`staging` becomes `out_dir`, in one step where the file system can (`staging` then holds the previous folder,
    removed with it); otherwise the previous `out_dir` is moved aside first (to `replaced`) and removed after, and if
    the second rename fails, it is put back before the error goes on."""
    if exchange(staging, out_dir):
        fsync_dir(out_dir.parent)
        return
    try:
        os.rename(out_dir, replaced)
    except FileNotFoundError:
        pass  # nothing published yet (or a concurrent publisher has it aside: its swap or ours fails, nothing lost)
    try:
        os.rename(staging, out_dir)
    except OSError:
        put_back(replaced, out_dir)
        raise
    fsync_dir(out_dir.parent)
    shutil.rmtree(replaced, ignore_errors=True)


RENAME_EXCHANGE = 2  # <linux/fs.h>
AT_FDCWD = -100


@functools.cache
def renameat2() -> Any:
    """glibc's renameat2 (2.28 and later), or None (another C library, another system)."""
    try:
        call = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


def exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step; False where that cannot be done here (no renameat2, a file
    system without RENAME_EXCHANGE, `b` not there yet): the caller renames instead. Other errors are raised."""
    call = renameat2()
    if call is None:
        return False
    if call(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOENT, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def publish_once(staging: Path, out_dir: Path, marker: str | None) -> None:
    """`staging` becomes `out_dir` unless a complete `out_dir` is there already (a concurrent builder won)."""
    try:
        os.rename(staging, out_dir)
    except OSError as e:
        if not out_dir.is_dir() or (marker is not None and not (out_dir / marker).exists()):
            raise FileExistsError(f"{out_dir} exists without {marker}: not a finished build; remove it") from e
        return
    fsync_dir(out_dir.parent)


def put_back(replaced: Path, out_dir: Path) -> bool:
    """Rename a folder moved aside back to `out_dir`, where nothing took its place; whether it was put back."""
    if out_dir.exists():
        return False
    try:
        os.rename(replaced, out_dir)
    except OSError:  # never moved aside, another sweeper put it back first, or a publisher filled `out_dir` meanwhile
        return False
    fsync_dir(out_dir.parent)
    return True


def recover_leftovers(folder: Path) -> list[Path]:
    """In `folder`: put back a published folder a dead writer had moved aside, and remove dead writers' staging
    folders and replaced copies, whatever they publish (a best-checkpoint's step folder is never published twice, so
    its own next publish would never come); returns what was removed. A live writer's folders are left alone."""
    removed = []
    for left in leftovers(folder):  # a scratch folder's is removed like a staging folder's
        if not left.abandoned():
            continue
        if left.kind == REPLACED and put_back(left.path, folder / left.target):
            continue  # killed between the swap's renames: the previous folder is still the latest
        shutil.rmtree(left.path, ignore_errors=True)
        removed.append(left.path)
    return removed


def leftover_name(out_dir: Path, kind: str, token: str) -> str:
    """Who made it (host, pid namespace and boot, pid), when (for the age rule; a rename keeps a folder's mtime, so
    the name carries it), and a token."""
    return f".{out_dir.name}.{kind}~{socket.gethostname()}~{process_origin()}~{os.getpid()}~{int(time.time())}~{token}"


LEFTOVER = re.compile(
    rf"\.(?P<target>.+)\.(?P<kind>{STAGING}|{REPLACED}|{SCRATCH})"
    r"~(?P<host>[^~]+)~(?P<origin>[0-9a-f]+)~(?P<pid>\d+)~(?P<made>\d+)~[0-9a-f]+"
)


@functools.cache
def process_origin() -> str:
    """Where this process's pid means something: its boot and pid namespace, hashed. Two containers may share a
    hostname (host networking) yet not their pids, and a pid from before a reboot names no process now."""
    parts = []
    for read in (lambda: Path("/proc/sys/kernel/random/boot_id").read_text().strip(), lambda: os.readlink(PID_NS)):
        try:
            parts.append(read())
        except OSError:
            parts.append("")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:8]


PID_NS = "/proc/self/ns/pid"


@dataclass(frozen=True)
class Leftover:
    """A staging folder, a replaced copy or a scratch folder, by its name: what it publishes and who made it."""

    path: Path
    target: str
    kind: str
    host: str
    origin: str
    pid: int
    made: int

    def abandoned(self) -> bool:
        """Whether its writer is gone: a dead pid where this process's pids mean the same, or too old to be anyone's
        (a writer elsewhere: another host, another pid namespace)."""
        if time.time() - self.made > STALE_AFTER_S:
            return True
        here = self.host == socket.gethostname() and self.origin == process_origin()
        return here and not pid_alive(self.pid)


def leftovers(folder: Path) -> list[Leftover]:
    """The staging folders, replaced copies and scratch folders in `folder`, newest first."""
    found = []
    for path in folder.glob(".*~*"):
        m = LEFTOVER.fullmatch(path.name)
        if m and path.is_dir():
            found.append(Leftover(path, m["target"], m["kind"], m["host"], m["origin"], int(m["pid"]), int(m["made"])))
    return sorted(found, key=lambda left: left.made, reverse=True)


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
