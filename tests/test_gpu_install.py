"""The GPU hosts' installs resolve: real dependency resolutions from PyPI, run on a CPU machine.

pyproject.toml caps torch below 2.14 (CPU machines keep the CPU wheel), while sglang 0.5.23 pins torch==2.14.1.
pip has no way to lift a requirement (a constraint only narrows), so `pip install -e '.[sglang]'` cannot
resolve. uv's `--override` replaces every requirement on a package, so a GPU host with SGLang installs with

    pip install uv==<UV_VERSION> && uv pip install --override deploy/sglang-host.overrides.txt -e '.[sglang,gpu]'

and deploy/Dockerfile's cuda image runs the same with the k8s and postgres extras too. Here `uv pip compile`
resolves that install for the GPU platform: x86_64 Linux with glibc 2.34 (SGLang's wheels are manylinux_2_34) and
the cuda image's CPython 3.12. It fetches only PyPI's index pages and the wheels' METADATA files (PEP 658): no
wheel is downloaded and nothing is built (`--no-build`). The result is a PEP 751 lock (pylock.toml), read back here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser
from packaging.requirements import Requirement
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version
from sglang_source import cache_dir, pinned_sglang_version

from eagle3_resources.hidden_states import sglang_api

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "deploy" / "Dockerfile"
OVERRIDES = "deploy/sglang-host.overrides.txt"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PYPI = "https://pypi.org/simple"
GLIBC = (2, 34)  # SGLang 0.5.23's wheels are manylinux_2_34_x86_64
PLATFORM = f"x86_64-manylinux_{GLIBC[0]}_{GLIBC[1]}"
UBUNTU_PYTHON = {"ubuntu24.04": "3.12"}  # python3 of the cuda image's base, which the image installs into


def requirement(name: str, reqs: list[str]) -> Requirement:
    [req] = [r for r in map(Requirement, reqs) if canonicalize_name(r.name) == name]
    return req


def cuda_stage() -> tuple[dict[str, str], list[str], list[str]]:
    """The cuda stage's ARG defaults (with the global ARGs), its COPY sources and its RUN lines."""
    args, copies, runs, stage = {}, [], [], None
    for item in DockerfileParser(path=str(DOCKERFILE)).structure:
        value = " ".join(item["value"].split())
        if item["instruction"] == "FROM":
            stage = value.split()[-1]
        elif item["instruction"] == "ARG" and "=" in value and stage in (None, "cuda"):
            key, default = value.split("=", 1)
            args[key] = default
        elif stage == "cuda" and item["instruction"] == "COPY":
            copies.append(value.split()[0])
        elif stage == "cuda" and item["instruction"] == "RUN":
            runs.append(value)
    return args, copies, runs


def image_install() -> dict:
    """What the cuda image runs: the uv version, the overrides file, the extras; and the Python it installs for."""
    args, copies, runs = cuda_stage()
    [run] = [r for r in runs if "uv pip install" in r]
    m = re.search(r'pip install "uv==\$\{UV_VERSION\}" && uv pip install --override (\S+) -e "\.\[([^\]]+)\]"', run)
    assert m, run
    [python] = [v for k, v in UBUNTU_PYTHON.items() if k in args["CUDA_IMAGE"]]
    return {
        "uv": args["UV_VERSION"],
        "overrides": m.group(1),
        "extras": m.group(2).split(","),
        "copies": copies,
        "python": python,
    }


def uv_binary() -> str:
    from uv import find_uv_bin  # the test extra's uv, the version the image installs

    return find_uv_bin()


def resolve(
    out_dir: Path,
    *inputs: str,
    extras: Sequence[str] = (),
    overrides: str | None = None,
    python: str = "3.12",
    offline: bool = False,
) -> tuple[subprocess.CompletedProcess, dict[str, dict]]:
    """`uv pip compile` for the GPU platform from PyPI alone; (the process, {name: package} of the lock or {}).

    Online, one resolution of the SGLang host fetches about 100 MB of index pages and METADATA files (PyPI's
    index pages come back modified on every revalidation, so a warm cache saves little); `offline` resolves
    from what an earlier resolution left in the cache.
    """
    out = out_dir / "pylock.toml"
    cmd = [
        uv_binary(),
        "pip",
        "compile",
        *inputs,
        *[a for e in extras for a in ("--extra", e)],
        *(["--override", overrides] if overrides else []),
        # The target Python is a marker value: no 3.12 interpreter is looked for or downloaded.
        "--python",
        sys.executable,
        "--no-python-downloads",
        "--python-platform",
        PLATFORM,
        "--python-version",
        python,
        "--no-build",
        "--index-url",
        PYPI,
        "--no-config",
        "--cache-dir",
        str(cache_dir() / "uv"),
        "--format",
        "pylock.toml",
        "--quiet",
        "-o",
        str(out),
        *(["--offline"] if offline else []),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("UV_")}  # no index or setting from outside
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    lock = tomllib.loads(out.read_text()) if proc.returncode == 0 else {"packages": []}
    return proc, {canonicalize_name(p["name"]): p for p in lock["packages"]}


def installable_tags(python: str) -> set:
    major, minor = map(int, python.split("."))
    platforms = [f"manylinux_2_{m}_x86_64" for m in range(GLIBC[1], 4, -1)]
    platforms += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
    return set(cpython_tags((major, minor), platforms=platforms)) | set(
        compatible_tags((major, minor), interpreter=f"cp{major}{minor}", platforms=platforms)
    )


@pytest.fixture(scope="module")
def sglang_host_lock(tmp_path_factory):
    """The cuda image's install, resolved: `uv pip compile pyproject.toml --extra ... --override <file>`."""
    image = image_install()
    proc, lock = resolve(
        tmp_path_factory.mktemp("gpu-lock"),
        "pyproject.toml",
        extras=image["extras"],
        overrides=image["overrides"],
        python=image["python"],
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return lock


def test_image_hint_and_test_extra_run_one_install_command():
    image = image_install()
    assert image["overrides"] == OVERRIDES and (REPO / OVERRIDES).is_file()
    assert OVERRIDES in image["copies"], "the cuda stage copies the overrides file before installing with it"
    assert {"sglang", "gpu"} <= set(image["extras"])
    # The command every GPU host is told (gpu-check, the backend's error, the contract checker).
    command = r"pip install uv==(\S+) && uv pip install --override (\S+) -e '\.\[([^\]]+)\]'"
    m = re.match(command, sglang_api.INSTALL_HINT)
    assert m, sglang_api.INSTALL_HINT
    assert m.group(1) == image["uv"] and m.group(2) == OVERRIDES
    assert {"sglang", "gpu"} <= set(m.group(3).split(",")) <= set(image["extras"])  # resolved below as part of it
    # CI resolves with the uv the image installs.
    assert requirement("uv", PYPROJECT["project"]["optional-dependencies"]["test"]) == Requirement(f"uv=={image['uv']}")
    version = subprocess.run([uv_binary(), "--version"], capture_output=True, text=True, check=True).stdout.split()[1]
    assert version == image["uv"]


def test_sglang_host_install_resolves_for_the_gpu_platform(sglang_host_lock):
    lock = sglang_host_lock
    versions = {name: p["version"] for name, p in lock.items()}
    deps = PYPROJECT["project"]["dependencies"]
    overrides = [
        Requirement(line)
        for line in (REPO / OVERRIDES).read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert [str(r) for r in overrides] == ["torch==2.14.1"]
    assert versions["torch"] == "2.14.1" and versions["sglang"] == pinned_sglang_version() == "0.5.23"
    assert Version(versions["torch"]) not in requirement("torch", deps).specifier  # what the override lifted
    assert versions["transformers"] in requirement("transformers", deps).specifier  # sglang's pin, inside our range
    # Every dagster package on one version: the core at pyproject's pin, the libraries at theirs.
    core = str(requirement("dagster", deps).specifier).removeprefix("==")
    assert core == "1.13.27"
    extras = PYPROJECT["project"]["optional-dependencies"]
    libraries = {
        canonicalize_name(r.name): str(r.specifier).removeprefix("==")
        for extra in ("k8s", "postgres")
        for r in map(Requirement, extras[extra])
        if r.name.startswith("dagster")
    }
    assert libraries == {"dagster-k8s": "0.29.27", "dagster-postgres": "0.29.27"}
    dagster = {n: v for n, v in versions.items() if n.startswith("dagster")}
    assert {"dagster", "dagster-webserver", "dagster-graphql", "dagster-pipes", "dagster-shared"} <= set(dagster)
    assert dagster == {n: libraries.get(n, core) for n in dagster}
    # Installable there: every package has a wheel for CPython 3.12 on x86_64 glibc 2.34 (no sdist to build).
    tags = installable_tags(image_install()["python"])
    unfit = [
        n
        for n, p in lock.items()
        if not any(set(parse_wheel_filename(w["url"].rsplit("/", 1)[1])[3]) & tags for w in p.get("wheels", []))
    ]
    assert unfit == []
    size = sum(max(w["size"] for w in p["wheels"]) for p in lock.values())
    print(f"{len(lock)} packages, about {size / 1e9:.1f} GB of wheels to install")


def test_image_toolkit_is_the_cuda_of_the_locked_torch(sglang_host_lock):
    """SGLang compiles its kernels with the image's nvcc against the locked torch's CUDA (cuda-toolkit, which torch
    requires): the same major.minor, which is also the CUDA gpu-check holds an nvcc to on a CPU torch."""
    from eagle3_assets.operations.gpu_check import SGLANG_TORCH_CUDA

    args, _, runs = cuda_stage()
    m = re.match(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-(?:cudnn-)?devel-ubuntu", args["CUDA_IMAGE"])
    assert m, f"the cuda stage is not on a CUDA devel image (nvcc, headers): {args['CUDA_IMAGE']}"
    toolkit = Version(sglang_host_lock["cuda-toolkit"]["version"])
    assert (int(m.group(1)), int(m.group(2))) == (toolkit.major, toolkit.minor) == Version(SGLANG_TORCH_CUDA).release
    assert any(re.search(r"apt-get install .*\bg\+\+ ", r) for r in runs), runs


def test_the_override_lifts_only_the_projects_cpu_cap(sglang_host_lock, tmp_path):
    """The locked versions resolve as they are without any override: the file hides no other conflict
    (a torch that some other package excludes, or a line that overrules sglang's own pins)."""
    pins = tmp_path / "pins.txt"
    pins.write_text("".join(f"{name}=={p['version']}\n" for name, p in sglang_host_lock.items()))
    proc, again = resolve(tmp_path, str(pins), python=image_install()["python"], offline=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert {n: p["version"] for n, p in again.items()} == {n: p["version"] for n, p in sglang_host_lock.items()}


def test_without_the_override_the_sglang_extra_cannot_resolve(sglang_host_lock, tmp_path):
    """What `pip install -e '.[sglang]'` meets: pip has no override, so the override file is needed."""
    proc, _ = resolve(tmp_path, "pyproject.toml", extras=["sglang"], python=image_install()["python"])
    assert proc.returncode != 0
    said = " ".join(proc.stderr.split())  # uv wraps its explanation to the terminal's width, which differs by runner
    assert "depends on torch==2.14.1" in said and "eagle3-pipeline depends on torch>=2.6,<2.14" in said, proc.stderr


def test_transformers_gpu_host_resolves_a_cuda_torch_without_override(tmp_path):
    """A GPU host with the transformers backend only: `pip install -e '.[gpu]'`, a CUDA torch from PyPI."""
    proc, lock = resolve(tmp_path, "pyproject.toml", extras=["gpu"], python=image_install()["python"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    torch_version = Version(lock["torch"]["version"])
    assert torch_version in requirement("torch", PYPROJECT["project"]["dependencies"]).specifier
    assert "accelerate" in lock and "sglang" not in lock
    assert any(n.startswith("nvidia-cuda-runtime") for n in lock), "PyPI's Linux torch is the CUDA build"
