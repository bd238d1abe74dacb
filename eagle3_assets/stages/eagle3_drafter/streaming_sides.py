"""The two sides of a streaming drafter run, as the orchestrating step starts and watches them (issue 27).

The step that materializes `eagle3_drafter` in streaming mode runs neither side itself: it plans, creates the spool,
writes each side's spec into the run's folder, starts the capture side and the training side through a
`SidesLauncher`, and then watches them only through that shared folder (their progress files, the spool's own
files) and their handles. So where a side runs is the launcher's business alone:

- `LocalSides`: each side a process group on this machine (training under torchrun when it has several ranks);
- `KubernetesSides` (streaming_k8s.py): each side a Kubernetes Job built with dagster-k8s, the capture on one GPU
  node, the training an Indexed Job over `nodes` GPU nodes, the spool on a ReadWriteMany volume all of them mount.

The sides' entry points are modules, run as `python -m <module> SPEC` (the training one under torchrun when it has
several ranks); their spec is a JSON file in the shared folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from eagle3_assets.stages.eagle3_drafter.launch import stop_group
from eagle3_resources.hidden_states.shared_fs import ReportingThread, read_json, read_text, retrying

CAPTURE_MODULE = "eagle3_assets.stages.eagle3_drafter.streaming_capture"
TRAINING_MODULE = "eagle3_assets.stages.eagle3_drafter.streaming_train"


class SideHandle(Protocol):
    """One started side, wherever it runs."""

    name: str  # "capture" or "training"

    def poll(self) -> int | None:
        """None while the side runs; its exit code once it ended (0: it finished its work)."""
        ...

    def stop(self, grace_s: float = 30.0) -> None:
        """Ask it to stop (SIGTERM or its equivalent), then end it for good after `grace_s`; idempotent."""
        ...

    def describe(self) -> str:
        """Where it runs, for the log: a process group, or a Job and its pods."""
        ...

    def tail(self) -> str:
        """The last lines of its output, for an error message."""
        ...


class SidesLauncher(Protocol):
    """Starts the sides of one streaming run; `log_path` is where a launcher that can keep a side's output keeps it."""

    def start_capture(self, spec_path: Path, log_path: Path) -> SideHandle: ...

    def start_training(self, spec_path: Path, log_path: Path, *, nodes: int, processes_per_node: int) -> SideHandle: ...


# -- the orchestrator's heartbeat, and the sides' watch of it ---------------------------------------------------------

HEARTBEAT_FILE = "orchestrator.json"  # in the run's shared folder
HEARTBEAT_EVERY_S = 2.0
ORPHAN_AFTER_S = 60.0  # a side's default `orphan_after_s`
EXIT_ORPHANED = 75  # a side's exit code when its orchestrator is gone (or another took over)
EXIT_STOPPED = 143  # a side's exit code when asked to stop (SIGTERM), as a shell reports a SIGTERM'd process
EXIT_WATCH_FAILED = 76  # a side's exit code when its watch of the heartbeat failed (the error is in its log)


class Heartbeat:
    """The orchestrator's sign of life: `<folder>/orchestrator.json` = {"run_id", "beat"}, the beat a counter rewritten
    (atomically) every `every_s` from a thread of its own. The sides compare the counter with itself over time on
    their own clock, never a clock of this host with one of theirs. A write failing with ESTALE or EIO is tried again
    (shared_fs.py); one that keeps failing ends the thread, and the orchestrator raises it (`raise_if_failed`) rather
    than let the sides find the beat stopped and leave as orphans."""

    def __init__(self, folder: Path, run_id: str, every_s: float = HEARTBEAT_EVERY_S):
        self.path, self.run_id, self.every_s = Path(folder) / HEARTBEAT_FILE, run_id, every_s
        self.beat = 0
        self._stop = threading.Event()
        self.write()
        self._thread = ReportingThread("heartbeat", self._run)
        self._thread.start()

    def write(self) -> None:
        self.beat += 1
        retrying(self.path, self._write_once)

    def _write_once(self, path: Path) -> None:
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"run_id": self.run_id, "beat": self.beat, "host": socket.gethostname()}))
        os.replace(tmp, path)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.write()

    def raise_if_failed(self) -> None:
        """Raise the error that ended the heartbeat's thread, if one did."""
        self._thread.raise_if_failed()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def read_heartbeat(folder: Path) -> dict[str, Any] | None:
    """The orchestrator's heartbeat, None before it is written. ESTALE and EIO are retried (shared_fs.py); text that
    does not parse counts as no beat: not a read mid-replace (a rename never shows one), but a file cut by a crash of
    the orchestrator's host (its heartbeat is not fsynced), which a retry would not mend."""
    try:
        return dict(read_json(Path(folder) / HEARTBEAT_FILE))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def last_line(path: Path) -> dict[str, Any]:
    """The last complete JSON line of a progress file ({} when it has none yet); ESTALE and EIO retried."""
    try:
        lines = read_text(path).splitlines()
    except FileNotFoundError:
        return {}
    for line in reversed(lines):
        if line.endswith("}"):
            try:
                return dict(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a kill, or read while it was being written
                continue
    return {}


class OrphanWatch:
    """A side's watch of its orchestrator (`Heartbeat`): it stops the side (the main thread gets SIGTERM, whose
    handler raises `SystemExit(EXIT_ORPHANED)`; the process is ended for good `grace_s` later if it has not exited)
    when the beat has not changed for `orphan_after_s` on this process's monotonic clock, or when the heartbeat is
    another run's (a new orchestrator took over the folder). `install()` also turns a SIGTERM from outside (the
    launcher's stop) into `SystemExit(EXIT_STOPPED)`, so the side's `finally` blocks run.

    Its reads retry ESTALE and EIO (`read_heartbeat`); a read that fails for good, or any other error of the watch,
    stops the side the same way with `EXIT_WATCH_FAILED`, the error in its log: a side that ran on unwatched would
    never notice its orchestrator gone."""

    def __init__(
        self, folder: Path, run_id: str, orphan_after_s: float, log: Callable[[str], None], grace_s: float = 30.0
    ):
        self.folder, self.run_id, self.orphan_after_s, self.log = Path(folder), run_id, orphan_after_s, log
        self.grace_s = grace_s
        self.reason: str | None = None  # why the side leaves on its own: orphaned, or its watch failed
        self.exit_code = EXIT_ORPHANED
        self._stop = threading.Event()
        self._thread = ReportingThread("orphan-watch", self._run, on_error=self._failed)

    def install(self) -> OrphanWatch:
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self._thread.start()
        return self

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self.reason is None:
            self.log("stopped (SIGTERM): leaving; what is committed stays, and a next run resumes from it")
            raise SystemExit(EXIT_STOPPED)
        self.log(f"{self.reason}; leaving (exit {self.exit_code})")
        raise SystemExit(self.exit_code)

    def check(self, beat: dict[str, Any] | None, last: tuple[Any, float], now: float) -> tuple[tuple[Any, float], str]:
        """(the last beat seen and when it changed, why this side is orphaned or "")."""
        if beat is not None and beat.get("run_id") != self.run_id:
            return (
                last,
                f"the folder's heartbeat is another orchestrator's (run {beat.get('run_id')}), not {self.run_id}",
            )
        value = beat.get("beat") if beat is not None else None
        if value != last[0]:
            return (value, now), ""
        if now - last[1] > self.orphan_after_s:
            return (
                last,
                f"the orchestrator's heartbeat ({self.folder / HEARTBEAT_FILE}) has not changed for "
                f"{now - last[1]:.0f} s",
            )
        return last, ""

    def _run(self) -> None:
        last: tuple[Any, float] = (None, time.monotonic())
        poll = min(1.0, self.orphan_after_s / 10)
        while not self._stop.wait(poll):
            last, why = self.check(read_heartbeat(self.folder), last, time.monotonic())
            if why:
                self._leave(f"orphaned: {why}", EXIT_ORPHANED)
                return

    def _failed(self, error: Exception) -> None:
        """The watch's thread ended by `error` (a read of the heartbeat failing for good, as shared_fs gives up)."""
        self.log("".join(traceback.format_exception(error)).rstrip())
        why = f"the watch of the orchestrator's heartbeat failed: {type(error).__name__}: {error}"
        self._leave(why, EXIT_WATCH_FAILED)

    def _leave(self, reason: str, exit_code: int) -> None:
        """Stop the side: SIGTERM to this process, whose handler raises `SystemExit(exit_code)` in the main thread;
        ended for good `grace_s` later if it has not left by then."""
        self.reason, self.exit_code = reason, exit_code
        os.kill(os.getpid(), signal.SIGTERM)
        if not self._stop.wait(self.grace_s):
            self.log(f"{reason}; the main thread did not leave within {self.grace_s:.0f} s: ending now")
            os._exit(exit_code)

    def close(self) -> None:
        self._stop.set()


# -- the sides on this machine ----------------------------------------------------------------------------------------


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (children, theirs, ...), from /proc (empty where there is none)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):  # gone meanwhile
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        found.extend(kids)
        todo.extend(kids)
    return found


class LocalSide:
    """A side started as a process group of its own on this machine, its output in its log file."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.name, self.cmd, self.log_path = name, cmd, Path(log_path)
        with open(self.log_path, "ab") as log:
            log.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env or dict(os.environ)
            )
        self.pgid = self.proc.pid  # a session of its own: its leader's pid is the group's id

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to the whole group (the capture and its rank processes; torchrun, which stops its ranks), SIGKILL
        to what remains after `grace_s`, and to the side's descendants in sessions of their own (torchrun starts each
        rank in a new session); idempotent."""
        below = descendants(self.proc.pid)
        stop_group(self.proc, grace_s)
        with contextlib.suppress(ProcessLookupError):  # the leader gone, its children may linger in the group
            os.killpg(self.pgid, signal.SIGKILL)
        for pid in below:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def describe(self) -> str:
        return f"{self.name}: process group {self.pgid} on {socket.gethostname()} ({' '.join(self.cmd[2:])})"

    def tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except FileNotFoundError:
            return ""


@dataclass(frozen=True)
class LocalSides:
    """Both sides on this machine, each a process group of its own (`start_new_session`): the capture as
    `python -m CAPTURE_MODULE SPEC`, the training as `python -m TRAINING_MODULE SPEC`, under
    `python -m torch.distributed.run --standalone --nproc-per-node=P` when it has P > 1 ranks (OMP_NUM_THREADS=1
    unless set, as `launch.run_torchrun` does; torchrun starts each rank in a session of its own, which `stop` ends
    too). Several nodes need a cluster launcher (`KubernetesSides`)."""

    python: str = sys.executable

    def start_capture(self, spec_path: Path, log_path: Path) -> SideHandle:
        return LocalSide("capture", [self.python, "-m", CAPTURE_MODULE, str(spec_path)], log_path)

    def start_training(self, spec_path: Path, log_path: Path, *, nodes: int, processes_per_node: int) -> SideHandle:
        if nodes != 1:
            raise ValueError(
                f"the local launcher runs the training side on this machine: {nodes} nodes need a cluster launcher "
                "(streaming_sides: kubernetes)"
            )
        if processes_per_node < 1:
            raise ValueError(f"the training side needs at least one process, not {processes_per_node}")
        module = [self.python, "-m", TRAINING_MODULE, str(spec_path)]
        if processes_per_node == 1:
            return LocalSide("training", module, log_path)
        torchrun = [
            self.python,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={processes_per_node}",
        ]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        return LocalSide("training", torchrun + module[1:], log_path, env)
