"""The Python of a bare GPU host, for running benchmarks/device_check.py as such a host runs it: torch, transformers,
safetensors and numpy and what those four require, and nothing else (no Dagster, no polars, no sglang; no xxhash,
which the lent H200 image has but a bare host may not, so the store's sha256 fallback is what runs).

A virtual environment whose site-packages holds the four distributions and the closure of their requirements
(Requires-Dist, markers evaluated here, no extras), linked from this project's environment.
"""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import venv
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

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


def build_gpu_host_python(root: Path) -> Path:
    """A Python at `root` with only GPU_HOST's closure installed (linked, not copied); checked to import each of
    GPU_HOST and none of ABSENT. Returns its interpreter."""
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
