"""Published folders (an exported drafter, the stand-ins) after kill -9 at their worst moments, and beside live
writers: a reader finds the previous folder or the new one, whole; what a dead writer left is swept by the next
publish; a live writer's staging folder and the resumable state beside a drafter are never touched."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors import safe_open
from support import stop_group
from test_drafter import tiny_drafter

from eagle3_assets.operations.gpu_check import disk_write_row
from eagle3_assets.stages.eagle3_drafter.export import check_checkpoint, export_checkpoint
from eagle3_resources import atomic_files
from eagle3_resources.atomic_files import STALE_AFTER_S, exchange, process_origin, published_folder

HERE = Path(__file__).resolve().parent


def worker(mode: str, out: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(HERE / "atomic_files_worker.py"), mode, str(out)],
        cwd=HERE,
        start_new_session=True,
        **kw,
    )


@pytest.fixture
def two_renames(monkeypatch):
    """Swaps as on a file system without RENAME_EXCHANGE (NFS): the previous folder moved aside, the new renamed in."""
    monkeypatch.setattr(atomic_files, "exchange", lambda staging, out: False)


def beside(out: Path) -> list[str]:
    """What is in `out`'s folder besides `out`, by name."""
    return sorted(p.name for p in out.parent.iterdir() if p != out)


def test_an_export_killed_mid_write_leaves_the_previous_drafter_and_the_next_export_sweeps_up(tmp_path):
    out = tmp_path / "eagle3_drafter"
    export_checkpoint(tiny_drafter(), out, [1, 29, 57])
    first = (out / "config.json").read_text()
    state = [out.with_name("eagle3_drafter.training"), out.with_name("eagle3_drafter.streaming")]
    for folder in state:  # the resumable state a drafter's training keeps beside it
        folder.mkdir()
        (folder / "checkpoint.pt").write_bytes(b"state")

    p = worker("export-killed-mid-write", out)
    assert p.wait(timeout=120) == -signal.SIGKILL
    assert (out / "config.json").read_text() == first  # the previous drafter, whole
    assert check_checkpoint(out) == []
    left = [n for n in beside(out) if n.startswith(".eagle3_drafter.staging~")]
    assert len(left) == 1, beside(out)  # the killed export's half-written folder

    export_checkpoint(tiny_drafter(), out, [2, 4, 6])
    assert (out / "config.json").read_text() != first
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert "fc.weight" in set(f.keys())
    assert beside(out) == ["eagle3_drafter.streaming", "eagle3_drafter.training"]  # swept, the state untouched
    assert all((folder / "checkpoint.pt").read_bytes() == b"state" for folder in state)


def test_a_dead_writers_folder_is_swept_by_the_next_publish_of_any_name_beside_it(tmp_path):
    """A best checkpoint's step folders are each exported once: a step's export killed mid-write is swept up by the
    next step's."""
    p = worker("export-killed-mid-write", tmp_path / "step-000100")
    assert p.wait(timeout=120) == -signal.SIGKILL
    assert [n.split("~")[0] for n in os.listdir(tmp_path)] == [".step-000100.staging"]
    export_checkpoint(tiny_drafter(), tmp_path / "step-000200", [1, 2, 3])
    assert os.listdir(tmp_path) == ["step-000200"]


def test_a_writer_killed_between_the_swaps_renames_gets_the_previous_folder_put_back(tmp_path, two_renames):
    out = tmp_path / "drafter"
    with published_folder(out) as tmp:
        (tmp / "version").write_text("old")
    p = worker("killed-between-renames", out)
    assert p.wait(timeout=60) == -signal.SIGKILL
    assert not out.exists()  # the one moment a reader finds nothing: the next publisher repairs it
    assert sorted(n.split("~")[0] for n in beside(out)) == [".drafter.replaced", ".drafter.staging"]

    with pytest.raises(ValueError, match="refused"), published_folder(out) as tmp:
        raise ValueError("refused")  # a publish that fails its check still puts the previous folder back
    assert (out / "version").read_text() == "old"
    assert beside(out) == []


def test_a_live_writers_staging_folder_is_left_alone(tmp_path):
    out = tmp_path / "drafter"
    held = worker("hold", out, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert held.stdout is not None and held.stdout.readline().strip() == "staged"
        (theirs,) = beside(out)
        with published_folder(out) as tmp:
            (tmp / "version").write_text("mine")
        assert (out / "version").read_text() == "mine"
        assert beside(out) == [theirs] and (out.parent / theirs / "version").read_text() == "held"
        assert held.stdin is not None
        held.stdin.close()
        assert held.wait(timeout=60) == 0
    finally:
        stop_group(held)
    assert (out / "version").read_text() == "held" and beside(out) == []  # it published in its turn


def leftover(out: Path, host: str, origin: str, pid: int, made: float) -> Path:
    """A staging folder as a writer elsewhere would name it (`<who>~<when>~<token>`, the module docstring's form)."""
    folder = out.with_name(f".{out.name}.staging~{host}~{origin}~{pid}~{int(made)}~0a0b0c0d")
    folder.mkdir()
    return folder


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_another_hosts_leftover_is_swept_only_once_it_is_older_than_any_export(tmp_path):
    out = tmp_path / "drafter"
    now = time.time()
    fresh = leftover(out, "another-host", "00000000", 1, now)
    leftover(out, "another-host", "00000000", 2, now - STALE_AFTER_S - 60)
    with published_folder(out) as tmp:
        (tmp / "version").write_text("mine")
    assert beside(out) == [fresh.name]
    assert socket.gethostname() != "another-host"


def test_a_dead_pid_counts_only_where_this_process_pids_mean_the_same(tmp_path):
    """A container sharing the host's name (host networking) has pids of its own: its writer's pid, dead here, may
    be alive there. Only a pid from this boot and pid namespace is judged by its liveness; others wait out the age."""
    out = tmp_path / "drafter"
    pid = dead_pid()
    elsewhere = leftover(out, socket.gethostname(), "deadbeef", pid, time.time())
    with published_folder(out) as tmp:
        (tmp / "version").write_text("mine")
    assert beside(out) == [elsewhere.name]
    ours = out.with_name(elsewhere.name.replace("~deadbeef~", f"~{process_origin()}~"))
    os.rename(elsewhere, ours)
    with published_folder(out) as tmp:
        (tmp / "version").write_text("again")
    assert beside(out) == []


def test_a_live_writers_folder_moved_aside_is_not_put_back_however_old_its_content(tmp_path):
    """A rename keeps a folder's mtime: a drafter exported days ago, moved aside by a live export, must not look
    abandoned to another publisher's sweep (which would put it back and fail the live export)."""
    out = tmp_path / "drafter"
    with published_folder(out) as tmp:
        (tmp / "version").write_text("old")
    days_ago = time.time() - 3 * STALE_AFTER_S
    os.utime(out, (days_ago, days_ago))
    held = worker("held-between-renames", out, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert held.stdout is not None and held.stdout.readline().strip() == "between"
        with published_folder(tmp_path / "other") as tmp:  # a publish beside it sweeps the folder
            (tmp / "version").write_text("other")
        assert not out.exists() and [n.split("~")[0] for n in beside(out)] == [
            ".drafter.replaced",
            ".drafter.staging",
            "other",
        ]
        assert held.stdin is not None
        held.stdin.close()
        assert held.wait(timeout=60) == 0
    finally:
        stop_group(held)
    assert (out / "version").read_text() == "new" and beside(out) == ["other"]


def test_a_failed_swap_puts_the_previous_folder_back_before_it_raises(tmp_path, monkeypatch, two_renames):
    out = tmp_path / "drafter"
    with published_folder(out) as tmp:
        (tmp / "version").write_text("old")
    real_rename = os.rename

    def rename(src, dst):
        if Path(src).name.startswith(".drafter.staging~"):
            raise OSError(errno.EIO, "the volume failed")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="the volume failed"), published_folder(out) as tmp:
        (tmp / "version").write_text("new")
    assert (out / "version").read_text() == "old" and beside(out) == []


def test_the_swap_is_one_step_where_the_file_system_can_so_a_reader_always_finds_a_folder(tmp_path, monkeypatch):
    """After every rename the publisher makes, `out` is there (with RENAME_EXCHANGE it makes none: the kernel swaps
    the two names at once); the previous folder is gone after, and nothing is left beside it."""
    out = tmp_path / "drafter"
    with published_folder(out) as tmp:
        (tmp / "version").write_text("old")
    real_rename, missing = os.rename, []

    def rename(src, dst):
        real_rename(src, dst)
        if not out.exists():
            missing.append((Path(src).name, Path(dst).name))

    monkeypatch.setattr(os, "rename", rename)
    with published_folder(out) as tmp:
        (tmp / "version").write_text("new")
        os.mkdir(tmp / "weights")
        (tmp / "weights" / "w.bin").write_bytes(b"x" * 4096)
    assert missing == [], f"a reader found no {out.name} after these renames: {missing}"
    assert (out / "version").read_text() == "new" and (out / "weights" / "w.bin").stat().st_size == 4096
    assert beside(out) == []


def test_exchange_swaps_two_folders_whole_and_declines_when_one_is_missing(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    (a / "from_a").write_text("a")
    assert not exchange(a, b) and (a / "from_a").exists() and not b.exists()  # nothing to swap with: rename instead
    b.mkdir()
    (b / "from_b").write_text("b")
    assert exchange(a, b)
    assert [p.name for p in a.iterdir()] == ["from_b"] and [p.name for p in b.iterdir()] == ["from_a"]
    with pytest.raises(NotADirectoryError):
        exchange(a / "from_b" / "x", b)  # any other error is the caller's to see


def test_a_concurrent_builders_folder_wins_when_replacing_is_not_asked(tmp_path):
    """The stand-ins are built by whoever needs them first: two builders of the same content may race, and the
    second to finish keeps the first's folder."""
    out = tmp_path / "tokenizer-abc"
    with published_folder(out, replace=False, marker="version") as tmp:
        (tmp / "version").write_text("second")
        out.mkdir()
        (out / "version").write_text("first")  # the other builder published meanwhile
    assert (out / "version").read_text() == "first" and beside(out) == []


def test_a_folder_without_the_finished_builds_marker_is_not_taken_for_one(tmp_path):
    out = tmp_path / "tokenizer-abc"
    (out / "partial").mkdir(parents=True)  # an older, non-atomic build cut short
    with (
        pytest.raises(FileExistsError, match="without version"),
        published_folder(out, replace=False, marker="version") as tmp,
    ):
        (tmp / "version").write_text("mine")
    assert sorted(p.name for p in out.iterdir()) == ["partial"] and beside(out) == []


def test_a_disk_measurement_killed_mid_write_leaves_files_the_next_one_removes(tmp_path):
    """`eagle3 gpu-check` writes 256 MiB into the data root to time the disk: a kill left them there for good."""
    p = worker("scratch-killed", tmp_path / "eagle3-gpu-check")
    assert p.wait(timeout=60) == -signal.SIGKILL
    (left,) = os.listdir(tmp_path)
    assert left.startswith(".eagle3-gpu-check.scratch~") and os.listdir(tmp_path / left) == ["w0.bin"]
    row = disk_write_row(tmp_path, 16, None, 7168, required=True)
    assert row.status == "ok" and os.listdir(tmp_path) == []
