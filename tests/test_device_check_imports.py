"""benchmarks/device_check.py runs once, on a GPU host that has torch, transformers, safetensors and numpy and what
those four require: no Dagster, no polars, no sglang. Every section must run there. (The lent H200 image also has
xxhash; a bare host may not, so it is left out here too and the store's sha256 fallback is what runs.)

The test builds that host's Python: a virtual environment whose site-packages holds the four distributions and the
closure of their requirements (Requires-Dist, markers evaluated here, no extras), linked from this project's
environment, and nothing else. Every section of the device check then runs in it as the GPU host runs it
(`device_check.py --only <section>`, here in its CPU quick mode: the same scripts and the same imports, lazy ones
included), and must give its figures. An import of anything outside those packages anywhere in a section's chain
fails its section, with the ModuleNotFoundError in the section's output tail.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from device_check import GOALS, SECTIONS, acceptance, acceptance_table  # noqa: E402  (the script's own sections)

GPU_HOST = ("torch", "transformers", "safetensors", "numpy")
ABSENT = ("dagster", "polars", "sglang", "xxhash")  # what a bare GPU host lacks and the project has


def requirement_closure(names: tuple[str, ...]) -> list[md.Distribution]:
    """The distributions `names` need, installed here: each one's unconditional requirements, recursively."""
    todo, seen, found = list(names), set(), []
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:  # a requirement not installed here is not installed there either
            continue
        found.append(dist)
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return found


@pytest.fixture(scope="module")
def gpu_host_python(tmp_path_factory) -> Path:
    """A Python with only GPU_HOST's closure installed (linked, not copied)."""
    root = tmp_path_factory.mktemp("gpu-host-venv")
    venv.create(root, symlinks=True, with_pip=False)
    python = root / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    for dist in requirement_closure(GPU_HOST):
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            link, target = site / top, Path(str(dist.locate_file(top)))
            if target.exists() and not link.exists():
                link.symlink_to(target)
    for name in GPU_HOST:
        check = subprocess.run([str(python), "-c", f"import {name}"], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
    for name in ABSENT:
        check = subprocess.run([str(python), "-c", f"import {name}"], capture_output=True, text=True)
        assert "ModuleNotFoundError" in check.stderr, f"{name} is importable in the GPU host's Python"
    return python


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("section", list(SECTIONS))
def test_every_device_check_section_runs_with_the_gpu_hosts_packages_only(gpu_host_python, section, tmp_path):
    p = subprocess.run(
        [str(gpu_host_python), str(REPO / "benchmarks" / "device_check.py"), "--device", "cpu"]
        + ["--only", section, "--out", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    result = json.loads((tmp_path / "device_check.json").read_text())["sections"][section]
    assert "figures" in result, f"{section}: {result.get('error')}\n{result.get('output_tail')}"
    report = json.loads((tmp_path / "device_check.json").read_text())
    for row in report["acceptance"]:  # a goal's figure is one its section writes (MFU is None on a CPU, yet present)
        if row["section"] == section:
            assert row["figure"] in result["figures"], (row, sorted(result["figures"]))
    if section == "extraction":  # the section's own process had no xxhash: the store hashed with sha256, and said so
        assert result["figures"]["checksum"] == "sha256", result["figures"]["checksum"]


def test_the_verdict_says_which_goal_holds_which_fails_and_which_was_not_measured():
    figures = {
        "extraction": {"figures": {"ratio_extraction_to_limit": 0.93, "ratio_null_sink_to_bare": 0.9}},
        "train_kimi": {"error": "timed out after 90 s"},
        "train_2048": {"figures": {"tokens_per_s": 41_600.0}},
    }
    every = {name: figures.get(name, {"figures": {}}) for name in SECTIONS}
    rows = acceptance({"sections": every, "seconds": 300.5})
    assert [r["section"] for r in rows] == [g[1] for g in GOALS]
    assert [r["met"] for r in rows] == [True, False, None, True, False]
    assert [r["measured"] for r in rows] == [0.93, 0.9, None, 41_600.0, 300.5]
    table = acceptance_table(rows).splitlines()
    assert table[1:] == [
        "|---|---|---|---|",
        "| extraction / min(bare forward, disk bound) | >= 0.9 | 0.93 | yes |",
        "| extraction, null sink / bare forward | >= 0.95 | 0.9 | **no** |",
        "| training MFU at Kimi width (4,096-token step) | >= 0.4 | - | not measured |",
        "| training tokens/s at width 2048 (10x 4,160) | >= 41600 | 41,600 | yes |",
        "| the whole device check, every section done, seconds | <= 300 | 300.5 | **no** |",
    ]
    # In time, yet a section failed (train_kimi): not a check done in 5 minutes; all done: it holds.
    assert acceptance({"sections": every, "seconds": 280})[-1]["met"] is False
    done: dict[str, dict] = {name: {"figures": {}} for name in SECTIONS}
    assert acceptance({"sections": done, "seconds": 280})[-1]["met"] is True
    assert acceptance({"sections": figures, "seconds": 280})[-1]["met"] is None  # `--only` some sections
