"""Start drafter training under torchrun (several processes), follow it, stop it with the step.

torchrun is torch's own launcher: it starts one process per rank and sets the environment
`train_cli` joins the process group from. It runs in a process group of its own, so a stop of
the Dagster step (terminate, Ctrl-C) ends every rank, and the training checkpoint lets the next
run resume.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path


def torchrun_command(spec_path: Path, processes: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={processes}",
        "-m",
        "eagle3_assets.stages.eagle3_drafter.train_cli",
        "--spec",
        str(spec_path),
    ]


def run_torchrun(spec_path: Path, processes: int, log: Callable[[str], None]) -> dict:
    """Run training in `processes` ranks; every line they print goes to `log`; returns rank 0's report."""
    spec = json.loads(Path(spec_path).read_text())
    report_path = Path(spec["report_path"])
    report_path.unlink(missing_ok=True)
    cmd = torchrun_command(spec_path, processes)
    log("drafter: " + " ".join(cmd))
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
    )
    tail: list[str] = []
    assert proc.stdout is not None  # stdout=PIPE above
    try:
        for line in proc.stdout:
            line = line.rstrip()
            tail = (tail + [line])[-40:]
            log(line)
        rc = proc.wait()
    except BaseException:
        stop_group(proc)
        raise
    if rc != 0 or not report_path.exists():
        raise RuntimeError(f"drafter training under torchrun ended with exit code {rc}:\n" + "\n".join(tail))
    return json.loads(report_path.read_text())


def stop_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM the launcher's process group (torchrun forwards it to the ranks), SIGKILL what remains."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass
