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
from device_check import SECTIONS  # noqa: E402  (the script's own list of sections)

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
    if section == "extraction":  # the section's own process had no xxhash: the store hashed with sha256, and said so
        assert result["figures"]["checksum"] == "sha256", result["figures"]["checksum"]
