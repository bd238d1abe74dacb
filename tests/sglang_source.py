"""The pinned SGLang release's own source, for reading by `ast` on a host without a GPU (never imported).

CI reaches PyPI (a package registry), so the wheel is fetched with `pip download --no-deps` for the
platform SGLang ships (x86_64 Linux) and unpacked once into a cache shared by test sessions:
`$EAGLE3_SGLANG_WHEEL_CACHE`, else `~/.cache/eagle3-tests`. The version is the one the `sglang` extra
pins in pyproject.toml, so bumping the pin moves the tests with it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def pinned_sglang_version() -> str:
    """The exact release the `sglang` extra admits (its lower bound, `sglang>=X,<Y` or `sglang==X`)."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for req in extras["sglang"]:
        m = re.match(r"\s*sglang\s*(?:==|>=)\s*([0-9][0-9a-z.]*)", req)
        if m:
            return m.group(1)
    raise AssertionError(f"no sglang requirement with a version in the sglang extra: {extras['sglang']}")


def cache_dir() -> Path:
    return Path(os.environ.get("EAGLE3_SGLANG_WHEEL_CACHE") or Path.home() / ".cache" / "eagle3-tests")


def sglang_source(version: str | None = None) -> Path:
    """A folder holding the release's `sglang/` package (Python files only); downloaded on first use."""
    version = version or pinned_sglang_version()
    root = cache_dir() / f"sglang-{version}"
    done = root / ".unpacked"
    if done.exists():
        return root
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    wheel = next(iter(sorted(wheels.glob(f"sglang-{version}-*.whl"))), None)
    if wheel is None:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            f"sglang=={version}",
            "--no-deps",
            "--only-binary=:all:",
            "--platform",
            "manylinux_2_34_x86_64",
            "--python-version",
            "3.11",
            "-d",
            str(wheels),
            "-q",
        ]
        subprocess.run(cmd, check=True, timeout=600)
        wheel = next(iter(sorted(wheels.glob(f"sglang-{version}-*.whl"))))
    partial = root.with_name(root.name + ".partial")
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.startswith("sglang/") and name.endswith(".py"):
                zf.extract(name, partial)
    os.replace(partial, root) if not root.exists() else None
    done.write_text(wheel.name + "\n")
    return root
