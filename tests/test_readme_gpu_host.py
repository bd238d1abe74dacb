"""The GPU host guide (docs/gpu-host.md, once the README's "GPU host" section), run as a reader would run it on a
host without GPUs.

Every command in the guide's `bash` blocks either says it needs GPUs (a trailing comment that starts with `GPU`) or
is run here, as written, and must succeed. A command added to the guide that no test runs, or one this file runs
that the guide no longer shows, fails the first test.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_host_python import build_gpu_host_python

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "docs" / "gpu-host.md"
BIN = Path(sys.executable).parent
sys.path.insert(0, str(REPO / "benchmarks"))
from device_check import SECTIONS  # noqa: E402  (the script's own sections)


def gpu_host_section() -> str:
    """The whole guide: its five numbered steps are the section."""
    text = GUIDE.read_text()
    assert text.startswith("# GPU host"), f"{GUIDE} no longer starts with its GPU host title"
    return text


def section_commands() -> list[tuple[str, str]]:
    """(command, trailing comment) for every command line of the guide's bash blocks."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", gpu_host_section(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if not line.strip():
                continue
            command, _, comment = line.partition("  # ")
            out.append((" ".join(command.split()), comment.strip()))
    return out


def needs_gpu(comment: str) -> bool:
    return comment.startswith("GPU")


def run(command: str, tmp_path: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    """The command as written, with this interpreter's venv standing in for `.venv/bin/`; the device check's in a bare
    GPU host's Python (torch, transformers, safetensors, numpy: tests/gpu_host_python.py), as the guide says it runs
    on a host with no Dagster, polars or sglang: an import of anything else anywhere in a section's chain, lazy ones
    included, fails that section with the ModuleNotFoundError in its output tail."""
    if "benchmarks/device_check.py" in command:
        command = command.replace(".venv/bin/python", str(build_gpu_host_python(tmp_path / "gpu-host-venv")))
    command = command.replace(".venv/bin/", f"{BIN}/").replace("/tmp/device-check", str(tmp_path / "device-check"))
    (tmp_path / "data").mkdir(exist_ok=True)
    env = {**os.environ, "EAGLE3_DATA_DIR": str(tmp_path / "data"), "OUT": str(tmp_path / "out")}
    return subprocess.run(command, shell=True, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def check_gpu_check_screen(p: subprocess.CompletedProcess, tmp_path: Path) -> None:
    assert p.returncode == 0, p.stdout + p.stderr
    assert "to fix:" in p.stdout and "result:" in p.stdout, p.stdout
    assert not list((tmp_path / "data").glob(".eagle3-gpu-check-*")), "the disk probe left its files behind"


def check_gpu_check_json(p: subprocess.CompletedProcess, tmp_path: Path) -> None:
    assert p.returncode == 0, p.stdout + p.stderr
    rows = {r["name"]: r for r in json.loads(p.stdout)["checks"]}
    assert rows["disk write"]["status"] == "ok", rows["disk write"]
    assert rows["torch/cuda"]["fix"], "a host without a GPU is told how to install for one"


def check_device_check(p: subprocess.CompletedProcess, tmp_path: Path) -> None:
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads((tmp_path / "device-check" / "device_check.json").read_text())
    sections = report["sections"]
    failed = {name: (s.get("error"), s.get("output_tail")) for name, s in sections.items() if "figures" not in s}
    assert set(sections) == set(SECTIONS), sorted(sections)  # every section ran, none skipped
    assert not failed, failed
    for row in report["acceptance"]:  # a goal's figure is one its section writes (MFU is None on a CPU, yet present)
        if row["section"] is not None:
            assert row["figure"] in sections[row["section"]]["figures"], (row, sorted(sections[row["section"]]))
    # the sections' processes had no xxhash: the store hashed with sha256, and said so
    assert sections["extraction"]["figures"]["checksum"] == "sha256", sections["extraction"]["figures"]["checksum"]


def check_engine_dry_run(p: subprocess.CompletedProcess, tmp_path: Path) -> None:
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("sglang.Engine(") == 2 and '"speculative_algorithm": "EAGLE3"' in p.stdout, p.stdout


def check_server_dry_run(p: subprocess.CompletedProcess, tmp_path: Path) -> None:
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("-m sglang.launch_server") == 2 and "--speculative-algorithm EAGLE3" in p.stdout, p.stdout


RUNNERS = {
    ".venv/bin/eagle3 gpu-check": check_gpu_check_screen,
    ".venv/bin/eagle3 gpu-check --no-capture --json": check_gpu_check_json,
    ".venv/bin/python benchmarks/device_check.py --device cpu --out /tmp/device-check": check_device_check,
    ".venv/bin/python benchmarks/sglang_engine_speculative.py --target /models/Kimi-K2.5 "
    "--drafter /data/eagle3/eagle3_drafter --dry-run": check_engine_dry_run,
    ".venv/bin/python benchmarks/serving_speculative.py --model-path /models/Kimi-K2.5 --tp-size 8 "
    "--draft-model-path /data/eagle3/eagle3_drafter --dry-run": check_server_dry_run,
}


def test_every_command_without_a_gpu_is_run_here():
    commands = section_commands()
    assert len(commands) >= 10, "the GPU host guide's commands were not found"
    runnable = {c for c, comment in commands if not needs_gpu(comment)}
    assert runnable == set(RUNNERS), (
        f"in docs/gpu-host.md but run by no test: {sorted(runnable - set(RUNNERS))}; "
        f"run here but no longer in docs/gpu-host.md: {sorted(set(RUNNERS) - runnable)}"
    )
    # Each GPU command is a real command, not prose: it starts with a program this project ships or installs.
    for command, comment in commands:
        if needs_gpu(comment):
            assert shlex.split(command)[0] in {
                "export",
                "python",
                "python3.12",
                ".venv/bin/eagle3",
                ".venv/bin/python",
            }, command


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("command", list(RUNNERS))
def test_readme_command_runs(command, tmp_path):
    RUNNERS[command](run(command, tmp_path), tmp_path)
