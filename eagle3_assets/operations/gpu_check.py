"""`eagle3 gpu-check`: what this host can do for the hidden-states stage, proven by short captures.

The first command on a new host. One screen: a row per check, then for each row that is not ok the exact
command that fixes it. Rows, in order:

- `torch/cuda`: torch version, CUDA, the GPUs (name, memory).
- `sglang`: installed? its version against the pinned range; torch and transformers against sglang's own
  pins (its wheel pins exact versions; `sglang_api.INSTALL_HINT` is the install that resolves them).
- `nvidia driver`: the driver's version (nvidia-smi) against CUDA 13's minimum (sglang 0.5.23's kernels are
  CUDA 13 builds).
- `cuda toolchain`: the nvcc SGLang and FlashInfer compile their JIT kernels with, found as they find it
  ($CUDA_HOME/bin/nvcc, else nvcc on PATH, else /usr/local/cuda/bin/nvcc; pip's nvcc inside the venv is named
  but not used), its CUDA major against torch's (a CPU torch: against sglang's torch, CUDA 13.0), and the C++
  compiler nvcc hands host code to ($CXX, else c++).
- `gpus`: the CUDA devices against `--tp`.
- `gpu memory`: the target's weights (its safetensors index or headers; Kimi-K2.5's known size when no folder is
  given) / the planned TP plus the KV pool of one forward, against sglang_mem_fraction x the smallest GPU's
  memory (nvidia-smi); when it does not fit, the fraction to set, a TP that fits, or the GPU kinds that do.
  Asked for with `--model`.
- `/dev/shm`: its size against the rank hand-off: rank 0 returns each forward's states through a ring of
  `--handoff-slabs` shared slabs the backend reserves in /dev/shm at start, each `--max-forward-tokens` x
  (3 + 1) x hidden x 2 bytes plus the token ids (the backend's own `SlabLayout`).
- `disk write`: `--disk-mib` MiB written into the data root the way the store writes shards (its writer count,
  `StoreSettings.writers` files at once, each in 16 MiB sequential writes, O_DIRECT where the file system takes it,
  hashed meanwhile, fsync'd: `store.write_files`), removed afterwards: GB/s and the capture rate it bounds.
- `disk space`: the data root's free space against the planned capture (`--tokens`, else the merged
  dataset's tokens) x the store's bytes per token, with the hidden_states asset's margin (extract.check_disk).
- `sglang contract`: every SGLang name the backend uses (eagle3_resources/hidden_states/sglang_api.py)
  still exists, checked on the imported package when it imports, else on its source.
- `transformers capture`: a tiny random DeepseekV3 (8 layers, MLA + MoE, built in a temp dir, on
  the CPU in fp32) through the transformers backend, against `output_hidden_states=True` ground
  truth: aux = hidden_states[i + 1] for each layer id, final = last_hidden_state (after the norm).
- `sglang capture (tiny)`: the same model and sequences through the SGLang backend at `--tp`
  (default 1), against that ground truth within a bf16 tolerance (per-token cosine similarity).
  Its layer ids do not start at 1, so it exercises the id translation that SGLang #25454 changed.
- `sglang capture (target)`, only with `--model`: the real target at `--tp` (default 8) with the
  default EAGLE-3 layers: shapes, finiteness, tokens/s over one timed batch.

Exit code: 1 when a row failed, or when a row that was asked for is not ok; 0 otherwise.
Asked for: the transformers row always (unless `--no-capture`); the SGLang, CUDA, driver, toolchain, GPU and
/dev/shm rows when `--tp` or `--model` is given, the GPU memory row with `--model`; the disk rows then too, or
with `--tokens`. A row that was not asked for and finds a shortfall says `warn`, which does not fail the
command. A CPU host without sglang therefore passes `eagle3 gpu-check` (SGLang rows "unavailable", with the
reason and the fix) and fails `eagle3 gpu-check --tp 1`. An installed sglang whose contract check finds
problems is a failure either way.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

OK, FAIL, UNAVAILABLE, WARN = "ok", "fail", "unavailable", "warn"  # warn: a shortfall in a row not asked for
TINY_LAYER_IDS = [2, 4, 6]  # outputs of layers 2, 4, 6 of 8; 6 is the last one SGLang can capture
TINY_LENGTHS = [17, 64, 33]
COSINE_MEAN_MIN, COSINE_LOW_MIN = 0.99, 0.95  # bf16 SGLang vs fp32 transformers, per token
# CUDA 13.0 GA's minimum Linux driver (NVIDIA's CUDA 13.0 release notes, table 3); sglang 0.5.23 ships cu13
# kernels (flashinfer-python[cu13], nvidia-cutlass-dsl[cu13], cuda-python>=13).
CUDA13_MIN_DRIVER = "580.65.06"
DRIVER_FIX = (
    f"install the NVIDIA driver >= {CUDA13_MIN_DRIVER} (CUDA 13), e.g. on Ubuntu: "
    "sudo apt-get install -y nvidia-driver-580 && sudo reboot"
)
KIMI_K25_HIDDEN = 7168  # the hidden size planned for when neither --model nor EAGLE3_TARGET_DIR names a target
N_AUX = 3  # EAGLE-3 captures three layers


def install_command() -> str:
    """The one GPU-host install command (sglang_api.INSTALL_HINT without its explanation)."""
    from eagle3_resources.hidden_states import sglang_api

    return sglang_api.INSTALL_HINT.split("  (")[0]


@dataclass
class Check:
    name: str
    status: str
    detail: str
    required: bool
    data: dict[str, Any] = field(default_factory=dict)
    fix: str = ""  # the exact command (or step) that makes this row ok; empty when it is ok


def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.status == FAIL or (c.required and c.status != OK) for c in checks) else 0


def _guard(name: str, required: bool, fn: Callable[[], Check]) -> Check:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - any failure of a check is that row's result
        return Check(name, FAIL, f"{type(e).__name__}: {e}", required, {"traceback": traceback.format_exc()})


# ---------------------------------------------------------------- rows


def torch_row(required: bool) -> Check:
    import torch

    data: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpus": [],
    }
    if not torch.cuda.is_available():
        why = "a CPU-only torch build" if torch.version.cuda is None else f"CUDA {torch.version.cuda} build, no device"
        return Check(
            "torch/cuda",
            UNAVAILABLE,
            f"torch {torch.__version__}: {why}: no GPU on this host",
            required,
            data,
            fix=f"on a host with NVIDIA GPUs and driver >= {CUDA13_MIN_DRIVER}: {install_command()}",
        )
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        data["gpus"].append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1)})
    names = ", ".join(f"{g['name']} {g['memory_gib']} GiB" for g in data["gpus"])
    return Check(
        "torch/cuda",
        OK,
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, {len(data['gpus'])} GPU(s): {names}",
        required,
        data,
    )


def pin_problems() -> list[str]:
    """Installed torch/transformers against the exact versions the installed sglang requires."""
    from importlib.metadata import PackageNotFoundError, requires, version

    from packaging.requirements import Requirement

    problems = []
    for line in requires("sglang") or []:
        req = Requirement(line)
        if req.name not in ("torch", "transformers") or (req.marker is not None and not req.marker.evaluate()):
            continue
        try:
            have = version(req.name)
        except PackageNotFoundError:
            have = None
        if have is None or not req.specifier.contains(have, prereleases=True):
            problems.append(f"{req.name} {have or 'missing'} (sglang needs {req.specifier})")
    return problems


def sglang_row(required: bool) -> Check:
    from eagle3_resources.hidden_states import sglang_api

    version = sglang_api.installed_version()
    if version is None:
        return Check(
            "sglang",
            UNAVAILABLE,
            f"not installed ({sglang_api.SGLANG_REQUIREMENT}, GPU hosts only)",
            required,
            fix=install_command(),
        )
    problems = (
        [] if sglang_api.version_in_range(version) else [f"outside {sglang_api.SGLANG_REQUIREMENT}"]
    ) + pin_problems()
    detail = f"sglang {version}" + (f": {'; '.join(problems)}" if problems else ", torch and transformers as it pins")
    return Check(
        "sglang",
        (FAIL if required else WARN) if problems else OK,
        detail,
        required,
        {"version": version, "problems": problems},
        fix=install_command() if problems else "",
    )


def nvidia_smi(query: str) -> list[str] | None:
    """`nvidia-smi --query-gpu=QUERY --format=csv,noheader,nounits`: one line per GPU, or None when there is no
    NVIDIA driver (no nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = [x.strip() for x in out.stdout.splitlines() if x.strip()]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"nvidia-smi failed (exit {out.returncode}): {(out.stderr or out.stdout).strip()[:200]}")
    return lines


def nvidia_driver() -> str | None:
    """The driver's version from nvidia-smi, or None when there is no NVIDIA driver."""
    lines = nvidia_smi("driver_version")
    return None if lines is None else lines[0]


def driver_row(required: bool) -> Check:
    name = "nvidia driver"
    driver = nvidia_driver()
    if driver is None:
        return Check(name, UNAVAILABLE, "no NVIDIA driver (nvidia-smi not found)", required, fix=DRIVER_FIX)
    have = tuple(int(x) for x in re.findall(r"\d+", driver))
    ok = have >= tuple(int(x) for x in CUDA13_MIN_DRIVER.split("."))
    detail = f"{driver}, " + ("CUDA 13 capable" if ok else f"below CUDA 13's minimum {CUDA13_MIN_DRIVER}")
    return Check(
        name,
        OK if ok else (FAIL if required else WARN),
        detail,
        required,
        {"driver": driver},
        fix="" if ok else DRIVER_FIX,
    )


# ---------------------------------------------------------------- the CUDA toolchain SGLang compiles with

# SGLang 0.5.23 compiles its JIT kernels (and FlashInfer 0.7.2, which ships no prebuilt kernels, its own) on the
# host at first use. sglang's torch 2.14.1 is a CUDA 13.0 build (cuda-toolkit 13.0.3, nvidia-*-cu13): the
# version an nvcc is held against when the torch here is a CPU build.
SGLANG_TORCH_CUDA = "13.0"
DEFAULT_CUDA_HOME = Path("/usr/local/cuda")  # SGLang's and FlashInfer's last resort
CUDA_DEVEL_IMAGE = "nvidia/cuda:13.0.1-cudnn-devel-ubuntu24.04"  # deploy/Dockerfile's cuda stage
CUDA_TOOLKIT_FIX = (
    "install CUDA 13.0's compiler and headers: sudo apt-get install -y cuda-nvcc-13-0 cuda-cudart-dev-13-0 "
    "(NVIDIA's CUDA apt repository) && export CUDA_HOME=/usr/local/cuda; in a container, build from "
    f"{CUDA_DEVEL_IMAGE} (deploy/Dockerfile's cuda stage)"
)
CXX_FIX = "sudo apt-get install -y g++"


@dataclass(frozen=True)
class NvccLookup:
    """Where SGLang and FlashInfer look for nvcc (sglang/kernels/jit/utils/compile/toolchain.py `cuda_home`,
    flashinfer/jit/cpp_ext.py): $CUDA_HOME (else $CUDA_PATH)/bin/nvcc and nothing else when that is set, else
    nvcc on PATH, else /usr/local/cuda/bin/nvcc."""

    path: str | None  # the nvcc they would run; None: not found
    via: str  # "$CUDA_HOME", "$CUDA_PATH", "PATH" or "/usr/local/cuda"
    looked_at: str  # the file looked for (the last one when nothing was found)


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def find_nvcc(env: dict[str, str], default_home: Path = DEFAULT_CUDA_HOME) -> NvccLookup:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(var):  # SGLang: os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"), no fallback after
            nvcc = Path(env[var]) / "bin" / "nvcc"
            return NvccLookup(str(nvcc) if _executable(nvcc) else None, f"${var}", str(nvcc))
    on_path = shutil.which("nvcc", path=env.get("PATH", ""))
    if on_path is not None:
        return NvccLookup(on_path, "PATH", on_path)
    nvcc = default_home / "bin" / "nvcc"
    return NvccLookup(str(nvcc) if _executable(nvcc) else None, str(default_home), str(nvcc))


def wheel_nvccs(paths: list[str]) -> list[str]:
    """nvcc binaries of pip's NVIDIA wheels (nvidia-cuda-nvcc: site-packages/nvidia/cu13/bin/nvcc, or
    nvidia/cuda_nvcc/bin/nvcc for CUDA 12) on the import path, which neither SGLang nor FlashInfer looks in."""
    found = []
    for entry in paths:
        root = Path(entry or ".") / "nvidia"
        if root.is_dir():
            found += [str(p) for p in sorted(root.glob("*/bin/nvcc")) if _executable(p)]
    return found


def nvcc_version(nvcc: str) -> tuple[int, int]:
    """(major, minor) from `nvcc --version` ("Cuda compilation tools, release 13.0, V13.0.88")."""
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    m = re.search(r"release (\d+)\.(\d+)", out.stdout)
    if out.returncode != 0 or m is None:
        said = (out.stdout + out.stderr).strip()[-200:]
        raise RuntimeError(f"`{nvcc} --version` gave no CUDA release (exit {out.returncode}): {said}")
    return int(m.group(1)), int(m.group(2))


def find_cxx(env: dict[str, str]) -> tuple[str | None, str, str]:
    """(the C++ compiler nvcc hands host code to, how it was chosen, the fix when there is none): $CXX, else
    `c++` (SGLang's toolchain.py `host_compiler_path`; torch's cpp_extension the same)."""
    path = env.get("PATH", "")
    gxx = shutil.which("g++", path=path)
    if env.get("CXX"):
        found = shutil.which(env["CXX"], path=path)
        if found is not None:
            return found, "$CXX", ""
        if shutil.which("c++", path=path) is not None:
            return None, f"$CXX={env['CXX']} not found", "unset CXX"
        return None, f"$CXX={env['CXX']} not found", f"export CXX={gxx}" if gxx else f"{CXX_FIX} && unset CXX"
    found = shutil.which("c++", path=path)
    if found is not None:
        return found, "c++ on PATH", ""
    if gxx is not None:
        return None, f"no c++ on PATH (g++ is {gxx})", f"export CXX={gxx}"
    return None, "no C++ compiler (c++, g++) on PATH", CXX_FIX


def toolchain_row(required: bool, env: dict[str, str] | None = None) -> Check:
    import torch

    name = "cuda toolchain"
    env = dict(os.environ) if env is None else env
    torch_cuda = torch.version.cuda
    want = torch_cuda or SGLANG_TORCH_CUDA
    want_from = f"torch's CUDA {torch_cuda}" if torch_cuda else f"CUDA {want} (sglang's torch; torch here: CPU build)"
    lookup = find_nvcc(env)
    cxx, cxx_via, cxx_fix = find_cxx(env)
    data: dict[str, Any] = {
        "nvcc": lookup.path,
        "nvcc_via": lookup.via,
        "nvcc_looked_at": lookup.looked_at,
        "torch_cuda": torch_cuda,
        "cxx": cxx,
        "cxx_via": cxx_via,
    }
    parts, fixes = [], []
    if lookup.path is None:
        in_wheels = wheel_nvccs(sys.path)
        data["wheel_nvcc"] = in_wheels
        parts.append(
            f"no nvcc where SGLang and FlashInfer look ({lookup.looked_at}, via {lookup.via})"
            + (f"; only pip's, inside the venv: {in_wheels[0]}, which they do not look in" if in_wheels else "")
        )
        elsewhere = find_nvcc({k: v for k, v in env.items() if k not in ("CUDA_HOME", "CUDA_PATH")})
        if lookup.via.startswith("$") and elsewhere.path is not None:  # a CUDA_HOME without nvcc hides a good one
            fixes.append(f"export CUDA_HOME={Path(elsewhere.path).parent.parent}")
        else:
            fixes.append(CUDA_TOOLKIT_FIX)
        major_ok = False
    else:
        major, minor = nvcc_version(lookup.path)
        data["nvcc_version"] = f"{major}.{minor}"
        major_ok = major == int(want.split(".")[0])
        in_wheel = any(p and lookup.path.startswith(str(Path(p) / "nvidia") + os.sep) for p in sys.path)
        stubs = Path(lookup.path).parent.parent / "lib64" / "stubs"  # SGLang links -lcuda against these
        parts.append(
            f"nvcc {major}.{minor} at {lookup.path} (via {lookup.via})"
            + (" (pip's nvidia wheel" + ("" if stubs.is_dir() else ", without lib64/stubs") + ")" if in_wheel else "")
            + (f", {want_from}: majors match" if major_ok else f", {want_from}: majors differ")
        )
        if not major_ok:
            fixes.append(f"{CUDA_TOOLKIT_FIX}; or point CUDA_HOME at a CUDA {want.split('.')[0]} toolkit")
    parts.append(f"C++ compiler {cxx} ({cxx_via})" if cxx else cxx_via)
    if cxx is None:
        fixes.append(cxx_fix)
    detail = "; ".join(parts)
    if lookup.path is None:
        status = UNAVAILABLE
    elif major_ok and cxx is not None:
        status = OK
    else:
        status = FAIL if required else WARN
    return Check(name, status, detail, required, data, fix="; ".join(fixes))


def gpus_row(tp: int | None, model: str | None, required: bool) -> Check:
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    need = tp or (8 if model else 1)
    detail = f"{have} CUDA device(s), " + (
        f"--tp {tp} needs {need}" if tp else f"{need} needed" + (" (--model: tp 8)" if model else "")
    )
    data = {"gpus": have, "needed": need}
    if have >= need:
        return Check("gpus", OK, detail, required, data)
    if have == 0:
        return Check("gpus", UNAVAILABLE, detail, required, data, fix="see torch/cuda and nvidia driver above")
    fix = (
        f"eagle3 gpu-check --tp {have}, and capture with EAGLE3_SGLANG_TP_SIZE={have} "
        "(Kimi-K2.5 needs 8 GPUs of 141 GB)"
    )
    return Check("gpus", FAIL if required else WARN, detail, required, data, fix=fix)


# ---------------------------------------------------------------- the target's weights against GPU memory

GIB, MIB = 2**30, 2**20
# SGLang 0.5.23 keeps at least 10 GiB outside mem_fraction_static on GPUs over 60 GiB when it picks the fraction
# itself (arg_groups/memory_hook.py): activations, CUDA graphs, NCCL. A fraction that leaves less is not offered.
SGLANG_RESERVE_BYTES = 10 * GIB
# Kimi-K2.5 when no folder is at hand: the INT4 checkpoint's size (60 MoE layers x 384 experts x 3 x 7168 x 2048
# at 4.5 bits ~ 571 GB, plus ~23 GB of bf16 attention, shared experts, embedding and head) and its MLA cache
# (61 layers x (kv_lora_rank 512 + qk_rope_head_dim 64) per token, bf16, the same on every TP rank).
KIMI_K25_HUB_ID = "moonshotai/Kimi-K2.5"
KIMI_K25_WEIGHT_BYTES = 594 * 10**9


@dataclass(frozen=True)
class GpuKind:
    name: str
    memory_bytes: int  # what nvidia-smi reports as memory.total


# 8-GPU NVLink servers of the GPUs SGLang's Kimi path runs on (sm90, sm100), smallest first; nvidia-smi's totals.
GPU_KINDS = (
    GpuKind("H100 80GB", 81559 * MIB),
    GpuKind("H200 141GB", 143771 * MIB),
    GpuKind("B200 180GB", 183359 * MIB),
)
TP_CHOICES = (1, 2, 4, 8)  # one node


@dataclass(frozen=True)
class KvShape:
    """One token's KV cache on one TP rank: layers x width x (heads split over ranks) x bytes."""

    layers: int
    width: int  # MLA: kv_lora_rank + qk_rope_head_dim (one latent, on every rank); else 2 x head_dim per head
    heads: int = 1  # KV heads split over the TP ranks (MLA: 1)
    dtype_bytes: int = 2

    def bytes_per_token(self, tp: int) -> int:
        return self.layers * self.width * -(-self.heads // tp) * self.dtype_bytes

    @staticmethod
    def of_config(config: dict[str, Any]) -> KvShape:
        text = config.get("text_config") or config
        if text.get("kv_lora_rank"):
            return KvShape(int(text["num_hidden_layers"]), int(text["kv_lora_rank"]) + int(text["qk_rope_head_dim"]))
        heads = int(text.get("num_key_value_heads") or text["num_attention_heads"])
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // int(text["num_attention_heads"]))
        return KvShape(int(text["num_hidden_layers"]), 2 * head_dim, heads)


KIMI_K25_KV = KvShape(layers=61, width=512 + 64)


@dataclass(frozen=True)
class MemoryFit:
    """A target on one GPU at a TP size: weights / tp plus the KV pool, against mem_fraction_static x memory.
    Tensors SGLang replicates on every rank (MLA's a-projections, the router, norms: ~2 GB on Kimi-K2.5) are
    counted once, so the real figure is a little higher."""

    tp: int
    weights_per_gpu: int
    kv_pool: int
    gpu_bytes: int
    fraction: float

    @property
    def need(self) -> int:
        return self.weights_per_gpu + self.kv_pool

    @property
    def budget(self) -> int:
        return int(self.fraction * self.gpu_bytes)

    @property
    def fits(self) -> bool:
        return self.need <= self.budget

    @property
    def fraction_needed(self) -> float:
        """The smallest mem_fraction_static, in hundredths, that holds the weights and the pool."""
        return math.ceil(round(self.need / self.gpu_bytes * 100, 6)) / 100

    @property
    def fraction_max(self) -> float:
        """The largest mem_fraction_static, in hundredths, that leaves SGLang its reserve."""
        return math.floor((self.gpu_bytes - SGLANG_RESERVE_BYTES) / self.gpu_bytes * 100) / 100

    @property
    def fraction_to_set(self) -> float | None:
        """The fraction as configured when it fits, else the one it needs when that leaves the reserve, else None."""
        if self.fits:
            return self.fraction
        return self.fraction_needed if self.fraction_needed <= self.fraction_max else None


def memory_fit(weight_bytes: int, tp: int, fraction: float, gpu_bytes: int, kv_pool_bytes: int) -> MemoryFit:
    return MemoryFit(tp, -(-weight_bytes // tp), kv_pool_bytes, gpu_bytes, fraction)


def fitting_kinds(
    weight_bytes: int, tp: int, fraction: float, kv_pool_bytes: int, kinds: tuple[GpuKind, ...] = GPU_KINDS
) -> list[tuple[GpuKind, float]]:
    """The GPU kinds the target fits at `tp`, smallest first, each with the mem fraction to set."""
    out = []
    for kind in kinds:
        fit = memory_fit(weight_bytes, tp, fraction, kind.memory_bytes, kv_pool_bytes)
        if fit.fraction_to_set is not None:
            out.append((kind, fit.fraction_to_set))
    return out


def smallest_tp(
    weight_bytes: int, fraction: float, gpu_bytes: int, kv: KvShape, tokens: int, tps: tuple[int, ...] = TP_CHOICES
) -> MemoryFit | None:
    """The smallest TP size that fits this GPU (at the configured fraction or a raised one), or None."""
    for tp in tps:
        fit = memory_fit(weight_bytes, tp, fraction, gpu_bytes, tokens * kv.bytes_per_token(tp))
        if fit.fraction_to_set is not None:
            return fit
    return None


@dataclass(frozen=True)
class TargetSize:
    name: str
    weight_bytes: int
    source: str  # where the figure comes from
    kv: KvShape | None  # None: no config.json, the KV pool is not counted


def safetensors_bytes(folder: Path) -> tuple[int, str] | None:
    """The checkpoint's tensor bytes: model.safetensors.index.json's metadata.total_size, else the sum of the
    safetensors files' headers (each tensor's data_offsets); None when the folder has neither."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        total = (json.loads(index.read_text()).get("metadata") or {}).get("total_size")
        if total:
            return int(total), f"{index.name} total_size"
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    size = 0
    for f in files:
        with f.open("rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        size += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    return size, f"{len(files)} safetensors header(s)"


def is_kimi_hub_id(path: str) -> bool:
    return path.rstrip("/").lower().endswith(KIMI_K25_HUB_ID.lower())


def target_size(model: str | None) -> TargetSize | str:
    """The planned target's size: --model's folder, else EAGLE3_TARGET_DIR's, else Kimi-K2.5's known figures
    (also for Kimi's hub id where no folder is); or why there is none."""
    for path, label in ((model, "--model"), (os.environ.get("EAGLE3_TARGET_DIR"), "EAGLE3_TARGET_DIR")):
        if not path:
            continue
        folder = Path(path)
        if not folder.is_dir():
            if is_kimi_hub_id(path):
                break
            return f"{label} {path} is not a folder"
        found = safetensors_bytes(folder)
        if found is None:
            return f"no safetensors (nor model.safetensors.index.json) in {label} {folder}"
        config = folder / "config.json"
        kv = KvShape.of_config(json.loads(config.read_text())) if config.is_file() else None
        return TargetSize(f"{folder.name} ({label})", found[0], found[1], kv)
    return TargetSize("Kimi-K2.5", KIMI_K25_WEIGHT_BYTES, "its INT4 checkpoint's known size", KIMI_K25_KV)


def planned_tp(model: str | None, tp: int | None) -> tuple[int, str]:
    """The target's TP size: --tp with --model (default 8, as the target capture), else EAGLE3_SGLANG_TP_SIZE,
    else the hidden_states_backend's sglang_tp_size default. Without --model, --tp is the tiny model's."""
    from eagle3_resources.hidden_states.resource import HiddenStatesResource

    if model is not None:
        return (tp, "--tp") if tp else (8, "--model's default")
    if os.environ.get("EAGLE3_SGLANG_TP_SIZE"):
        return int(os.environ["EAGLE3_SGLANG_TP_SIZE"]), "EAGLE3_SGLANG_TP_SIZE"
    return int(HiddenStatesResource.model_fields["sglang_tp_size"].default), "sglang_tp_size's default"


def planned_mem_fraction() -> tuple[float, str]:
    """EAGLE3_SGLANG_MEM_FRACTION, else the hidden_states_backend's sglang_mem_fraction default."""
    from eagle3_resources.hidden_states.resource import HiddenStatesResource

    if os.environ.get("EAGLE3_SGLANG_MEM_FRACTION"):
        return float(os.environ["EAGLE3_SGLANG_MEM_FRACTION"]), "EAGLE3_SGLANG_MEM_FRACTION"
    return float(HiddenStatesResource.model_fields["sglang_mem_fraction"].default), "sglang_mem_fraction's default"


def gpu_memory() -> list[tuple[str, int]] | None:
    """(name, memory.total in bytes) per GPU from nvidia-smi, or None when there is no NVIDIA driver."""
    lines = nvidia_smi("name,memory.total")
    if lines is None:
        return None
    out = []
    for line in lines:
        name, _, mib = line.rpartition(",")
        if not name or not mib.strip().isdigit():
            raise RuntimeError(f"nvidia-smi gave {line!r} for name,memory.total")
        out.append((name.strip(), int(mib) * MIB))
    return out


def kinds_text(fitting: list[tuple[GpuKind, float]], tp: int) -> str:
    """The kinds in one phrase, "8 x H200 141GB or 8 x B200 180GB at sglang_mem_fraction 0.8" (each with its own
    fraction where they differ); empty when none fits."""
    if len({f for _, f in fitting}) == 1:
        return " or ".join(f"{tp} x {k.name}" for k, _ in fitting) + f" at sglang_mem_fraction {fitting[0][1]:g}"
    return " or ".join(f"{tp} x {k.name} at sglang_mem_fraction {f:g}" for k, f in fitting)


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def memory_row(model: str | None, tp: int | None, forward_tokens: int, required: bool) -> Check:
    name = "gpu memory"
    target = target_size(model)
    if isinstance(target, str):
        return Check(name, FAIL if required else WARN, target, required, fix="eagle3 gpu-check --model <target folder>")
    tp_size, tp_from = planned_tp(model, tp)
    fraction, fraction_from = planned_mem_fraction()
    pool = forward_tokens * target.kv.bytes_per_token(tp_size) if target.kv else 0
    weights = -(-target.weight_bytes // tp_size)
    plan = (
        f"{target.name}, {target.weight_bytes / 1e9:,.0f} GB ({target.source}) at TP {tp_size} ({tp_from}): "
        f"{gib(weights)} weights + "
        + (f"{gib(pool)} KV pool ({forward_tokens:,} tokens)" if target.kv else "no KV pool (no config.json)")
        + f" = {gib(weights + pool)} a GPU"
    )
    fitting = fitting_kinds(target.weight_bytes, tp_size, fraction, pool)
    kinds = kinds_text(fitting, tp_size)
    too_small = [f"{tp_size} x {k.name}" for k in GPU_KINDS if k not in dict(fitting)]
    data: dict[str, Any] = {
        "target": target.name,
        "weight_bytes": target.weight_bytes,
        "weights_from": target.source,
        "tp": tp_size,
        "mem_fraction": fraction,
        "kv_pool_bytes": pool,
        "fits_kinds": [k.name for k, _ in fitting],
    }
    gpus = gpu_memory()
    if gpus is None:
        return Check(
            name,
            UNAVAILABLE,
            f"no GPU to measure (nvidia-smi not found); {plan}: fits {kinds or 'none of ' + ', '.join(too_small)}"
            + (f"; not {', '.join(too_small)}" if fitting and too_small else ""),
            required,
            data,
            fix=f"a host with {kinds}" if fitting else f"{target.name} fits no node of {', '.join(too_small)}",
        )
    gpu_name, gpu_bytes = min(gpus, key=lambda g: g[1])
    fit = memory_fit(target.weight_bytes, tp_size, fraction, gpu_bytes, pool)
    data.update(gpu=gpu_name, gpu_bytes=gpu_bytes, need_bytes=fit.need, budget_bytes=fit.budget, fits=fit.fits)
    detail = (
        f"{plan}; {gpu_name} {gib(gpu_bytes)} x sglang_mem_fraction {fraction:g} ({fraction_from}) "
        f"= {gib(fit.budget)}: " + ("fits" if fit.fits else "does not fit")
    )
    if fit.fits:
        return Check(name, OK, detail, required, data)
    fixes = []
    if fit.fraction_to_set is not None:
        fixes.append(
            f"export EAGLE3_SGLANG_MEM_FRACTION={fit.fraction_to_set:g}  (the hidden_states_backend's "
            "sglang_mem_fraction)"
        )
        detail += f" (needs sglang_mem_fraction {fit.fraction_needed:.2f})"
    else:
        detail += (
            f" (needs sglang_mem_fraction {fit.fraction_needed:.2f}, above the {fit.fraction_max:.2f} that "
            f"leaves SGLang its {SGLANG_RESERVE_BYTES // GIB} GiB)"
        )
        bigger = smallest_tp(target.weight_bytes, fraction, gpu_bytes, target.kv or KvShape(0, 0), forward_tokens)
        if bigger is not None and bigger.tp > tp_size:
            env = f"EAGLE3_SGLANG_TP_SIZE={bigger.tp}" + (
                "" if bigger.fits else f" EAGLE3_SGLANG_MEM_FRACTION={bigger.fraction_to_set:g}"
            )
            fixes.append(f"TP {bigger.tp}: export {env}  (and eagle3 gpu-check --tp {bigger.tp})")
        fixes.append(
            f"{tp_size} x {gpu_name} is too small for {target.name}: run it on {kinds}"
            if fitting
            else f"{target.name} fits no node of {tp_size} x {', '.join(k.name for k in GPU_KINDS)}"
        )
    return Check(name, FAIL if required else WARN, detail, required, data, fix="; or ".join(fixes))


def human(n: float) -> str:
    from eagle3_resources.hidden_states.extract import human_bytes

    return human_bytes(n)


def shm_row(shm_dir: Path, forward_tokens: int, slabs: int, hidden: int, hidden_from: str, required: bool) -> Check:
    from eagle3_resources.hidden_states.sglang_backend import SlabLayout

    slab = SlabLayout(tokens=forward_tokens, aux_width=N_AUX * hidden, final_width=hidden).nbytes
    need = slab * slabs
    if not shm_dir.is_dir():
        return Check(
            "/dev/shm",
            FAIL if required else WARN,
            f"{shm_dir} does not exist",
            required,
            fix=f"sudo mkdir -p {shm_dir} && sudo mount -t tmpfs -o size={-(-need // 2**30)}G tmpfs {shm_dir}",
        )
    st = os.statvfs(shm_dir)
    size = st.f_blocks * st.f_frsize
    data = {
        "path": str(shm_dir),
        "size_bytes": size,
        "needed_bytes": need,
        "max_forward_tokens": forward_tokens,
        "handoff_slabs": slabs,
        "slab_bytes": slab,
        "hidden": hidden,
    }
    detail = (
        f"{shm_dir} {human(size)}; hand-off {slabs} slabs x ({forward_tokens:,} tokens x {N_AUX + 1} x {hidden} "
        f"({hidden_from}) x 2 B + ids) = {human(need)}"
    )
    if size >= need:
        return Check("/dev/shm", OK, detail, required, data)
    gib = -(-need // 2**30)
    fits = size // (slabs * (N_AUX + 1) * hidden * 2 + slabs * 8)
    fix = (
        f"sudo mount -o remount,size={gib}G {shm_dir}  (a container: docker run --shm-size={gib}g; or lower "
        f"EAGLE3_SGLANG_MAX_FORWARD_TOKENS below {fits:,}, or the hidden_states_backend's sglang_handoff_slabs)"
    )
    return Check("/dev/shm", FAIL if required else WARN, detail + ": too small", required, data, fix=fix)


def disk_write_row(root: Path, mib: int, min_gbps: float | None, hidden: int, required: bool) -> Check:
    """`mib` MiB written into `root` in 64 MiB files as the store writes shards (`store.write_files`: the store's
    default writer count at once, 16 MiB sequential writes, O_DIRECT where the file system takes it, the store's
    checksum taken meanwhile, fsync per file), timed, then removed."""
    import torch

    from eagle3_resources.atomic_files import scratch_folder
    from eagle3_resources.hidden_states.extract import StoreSettings
    from eagle3_resources.hidden_states.store import CHECKSUM, host_buffer, token_bytes, write_files

    name = "disk write"
    if not root.is_dir():
        return Check(
            name,
            FAIL if required else WARN,
            f"data root {root} does not exist",
            required,
            fix=f"mkdir -p {root}  (or eagle3 gpu-check --data-dir DIR; the pipeline writes to EAGLE3_DATA_DIR)",
        )
    file_bytes = min(mib, 64) * 2**20
    files = -(-mib * 2**20 // file_bytes)
    buffer = host_buffer(file_bytes, pin=False)
    buffer.copy_(torch.randint(0, 256, (file_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    memory = buffer.numpy().data  # the memoryview of the array (numpy types its buffer protocol from Python 3.12)
    with scratch_folder(root, "eagle3-gpu-check") as work:  # a killed check's files are removed by the next one
        start = time.perf_counter()
        items = [(work / f"w{i}.bin", file_bytes) for i in range(files)]
        written = write_files(items, memory, writers=StoreSettings.writers, direct=True, checksum=CHECKSUM)
        direct = [used for _, used in written]
        seconds = time.perf_counter() - start
    gbps = files * file_bytes / seconds / 1e9
    rate = gbps * 1e9 / token_bytes(hidden)
    data = {
        "path": str(root),
        "bytes": files * file_bytes,
        "seconds": round(seconds, 3),
        "gb_per_s": round(gbps, 3),
        "o_direct": all(direct),
        "writers": StoreSettings.writers,
        "checksum": CHECKSUM,
        "tokens_per_s_bound": round(rate),
    }
    detail = (
        f"{root}: {files * file_bytes / 2**20:,.0f} MiB fsync'd {'O_DIRECT' if all(direct) else 'buffered'} "
        f"by {StoreSettings.writers} writers as the store writes ({CHECKSUM} taken meanwhile) in {seconds:.2f} s = "
        f"{gbps:.2f} GB/s: capture at most {rate:,.0f} tokens/s at hidden {hidden}"
    )
    if min_gbps is None or gbps >= min_gbps:
        return Check(name, OK, detail, required, data)
    return Check(
        name,
        FAIL if required else WARN,
        detail + f", below --min-disk-gbps {min_gbps:g}",
        required,
        data,
        fix="put the data root on a faster (local NVMe) volume: export EAGLE3_DATA_DIR=/nvme/eagle3, then "
        "eagle3 gpu-check --data-dir /nvme/eagle3",
    )


def planned_tokens(root: Path, tokens: int | None) -> tuple[int | None, str]:
    if tokens is not None:
        return tokens, "--tokens"
    from eagle3_resources.storage import DataLayout

    merged = DataLayout(str(root)).merged_dataset()
    if not merged.exists():
        return None, ""
    import pyarrow.parquet as pq

    column = pq.read_table(merged, columns=["n_tokens"]).column("n_tokens")
    return int(sum(v.as_py() or 0 for v in column)), f"the merged dataset ({merged})"


def disk_space_row(root: Path, tokens: int | None, hidden: int, hidden_from: str, required: bool) -> Check:
    from eagle3_resources.errors import DiskSpaceError
    from eagle3_resources.hidden_states.extract import StoreSettings, check_disk
    from eagle3_resources.hidden_states.store import token_bytes

    name = "disk space"
    planned, source = planned_tokens(root, tokens)
    if planned is None:
        return Check(
            name,
            UNAVAILABLE,
            f"no planned capture: no --tokens and no merged dataset under {root}",
            required,
            fix="eagle3 gpu-check --tokens N  (the tokens you plan to capture, e.g. 50000000)",
        )
    settings = StoreSettings()
    needed = planned * token_bytes(hidden)
    data: dict[str, Any] = {
        "path": str(root),
        "tokens": planned,
        "tokens_from": source,
        "bytes_per_token": token_bytes(hidden),
    }
    detail = f"{planned:,} tokens ({source}) x {token_bytes(hidden):,} B ({hidden_from}) = {human(needed)}"
    try:
        data.update(
            check_disk(root, needed, settings, tokens_pending=planned, total_tokens=planned, hidden_size=hidden)
        )
    except DiskSpaceError:
        probe = root
        while not probe.exists():
            probe = probe.parent
        free = shutil.disk_usage(probe).free
        fits = int(max(0, (free - settings.reserve_bytes) / (1 + settings.margin_pct / 100)) // token_bytes(hidden))
        config = json.dumps({"ops": {"hidden_states": {"config": {"max_tokens": fits}}}})
        wanted = needed * (1 + settings.margin_pct / 100) + settings.reserve_bytes
        fix = (
            f"export EAGLE3_DATA_DIR=<a volume with {human(wanted)}"
            f" free> (check: eagle3 gpu-check --data-dir DIR --tokens {planned}), or capture what fits: "
            "eagle3 dagster asset materialize -m eagle3_assets.definitions --select hidden_states "
            f"--config-json '{config}'"
        )
        data.update(free_bytes=free, fits_tokens=fits)
        return Check(
            name,
            FAIL if required else WARN,
            detail + f"; {probe} has {human(free)} free: about {fits:,} fit",
            required,
            data,
            fix=fix,
        )
    return Check(name, OK, detail + f"; {human(data['free_bytes'])} free", required, data)


def contract_row(required: bool) -> Check:
    from eagle3_resources.hidden_states import sglang_api

    if sglang_api.package_dir() is None:
        return Check("sglang contract", UNAVAILABLE, "sglang is not installed", required)
    try:
        import sglang  # noqa: F401  (the package only; submodules are imported by the check)

        mode = "import"
    except Exception as e:  # noqa: BLE001 - a broken install still has its source to check
        mode, why = "source", f"{type(e).__name__}: {e}"
    problems = sglang_api.check_contract(mode=mode)
    rule = sglang_api.capture_rule()
    data = {
        "mode": mode,
        "problems": problems,
        "capture_rule": rule.value if rule else None,
        "names": len(sglang_api.CONTRACT),
    }
    how = f"{len(sglang_api.CONTRACT)} names checked by {mode}" + ("" if mode == "import" else f" ({why})")
    if problems:
        return Check(
            "sglang contract", FAIL, f"{how}; {len(problems)} problem(s): " + "; ".join(problems), required, data
        )
    return Check("sglang contract", OK, f"{how}; capture rule: {rule.value if rule else '?'}", required, data)


# SGLang 0.5.23's models/deepseek_v2.py reads these without a default (MoEGate, DeepseekV2MoE, the decoder
# layer's sparse rule); transformers 5's DeepseekV3Config has none of them, so a config.json it saves lacks
# them. The values are what transformers' DeepseekV3TopkRouter computes: sigmoid scores, top-k chosen on the
# scores plus e_score_correction_bias ("noaux_tc"), and every layer from first_k_dense_replace on an MoE layer.
SGLANG_DEEPSEEK_KEYS = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1}
FUSED_EXPERTS = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def per_expert_tensors(tensors: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint layout DeepSeek and Kimi ship and SGLang's expert mapping reads
    (`mlp.experts.{e}.gate_proj.weight`, `.up_proj`, `.down_proj`): transformers 5 holds a layer's experts
    fused (`experts.gate_up_proj` [E, 2I, H], gate rows first; `experts.down_proj` [E, H, I]) and, depending
    on its version, may save them so."""
    out: dict[str, Any] = {}
    for key, t in tensors.items():
        m = FUSED_EXPERTS.match(key)
        if m is None:
            out[key] = t
            continue
        for e in range(t.shape[0]):
            base = f"{m['prefix']}.{e}"
            if m["kind"] == "gate_up_proj":
                gate, up = t[e].chunk(2, dim=0)
                out[f"{base}.gate_proj.weight"], out[f"{base}.up_proj.weight"] = gate.contiguous(), up.contiguous()
            else:
                out[f"{base}.down_proj.weight"] = t[e].contiguous()
    return out


def tiny_deepseek_v3(folder: Path, seed: int = 0) -> Path:
    """A random 8-layer DeepseekV3 (MLA dims as Kimi's, 8 experts) saved in bf16, in the layout of a DeepSeek
    checkpoint: per-expert weight names and the MoE keys SGLang reads (SGLANG_DEEPSEEK_KEYS). transformers
    loads it back with nothing missing or left over (checked here)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=16,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=256,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    # transformers wraps PreTrainedModel.to with functools.wraps, which mypy reads as an unbound function
    DeepseekV3ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)  # type: ignore[arg-type]
    files = sorted(folder.glob("*.safetensors"))
    tensors: dict[str, Any] = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            tensors.update({k: st.get_tensor(k) for k in st.keys()})
    if any(FUSED_EXPERTS.match(k) for k in tensors):
        for f in files + list(folder.glob("*.safetensors.index.json")):
            f.unlink()
        save_file(per_expert_tensors(tensors), str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg_file = folder / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.update(SGLANG_DEEPSEEK_KEYS)
    cfg.setdefault("torch_dtype", "bfloat16")  # older readers (transformers 4.x in an SGLang env) need this key
    cfg_file.write_text(json.dumps(cfg, indent=2))
    # with output_loading_info=True from_pretrained returns (model, info); its annotation names the model only
    loaded: Any = DeepseekV3ForCausalLM.from_pretrained(folder, output_loading_info=True)
    _, info = loaded
    problems = {k: v for k, v in info.items() if v}
    if problems:
        raise RuntimeError(f"the tiny DeepseekV3 written to {folder} does not load back in transformers: {problems}")
    return folder


def tiny_sequences(vocab_size: int, lengths: list[int] = TINY_LENGTHS, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


def ground_truth(model, sequences: list[list[int]], layer_ids: list[int]):
    """Per sequence (aux, final) from `output_hidden_states=True`, one unpadded sequence at a time."""
    import torch

    out = []
    with torch.inference_mode():
        for s in sequences:
            r = model.model(input_ids=torch.tensor([s]), output_hidden_states=True)
            aux = torch.cat([r.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
            out.append((aux.float(), r.last_hidden_state[0].float()))
    return out


def cosine_stats(got, truth, hidden: int, n_aux: int) -> dict[str, float]:
    """Per-token cosine similarity of each aux layer and of the final state: the mean and the minimum."""
    import torch

    parts: dict[str, list[torch.Tensor]] = {}
    for (ga, gf), (ta, tf) in zip(got, truth, strict=True):  # both: one per tiny sequence
        for k in range(n_aux):
            sl = slice(k * hidden, (k + 1) * hidden)
            parts.setdefault(f"aux{k}", []).append(torch.cosine_similarity(ga[:, sl].float(), ta[:, sl], dim=-1))
        parts.setdefault("final", []).append(torch.cosine_similarity(gf.float(), tf, dim=-1))
    stats: dict[str, float] = {}
    for part, values in parts.items():
        c = torch.cat(values)
        stats[f"{part}_mean"] = round(float(c.mean()), 5)
        stats[f"{part}_min"] = round(float(c.min()), 5)
    return stats


def transformers_row(folder: Path, sequences, truth) -> Check:
    import torch
    from transformers import AutoModelForCausalLM

    from eagle3_resources.hidden_states.transformers_backend import (
        TransformersHiddenStates,
    )

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    backend = TransformersHiddenStates(model, layer_ids=TINY_LAYER_IDS)
    got = [(a.float().cpu(), f.float().cpu()) for a, f in backend.extract_batch(sequences)]
    hidden = model.config.hidden_size
    shapes_ok = all(
        a.shape == (len(s), 3 * hidden) and f.shape == (len(s), hidden)
        for (a, f), s in zip(got, sequences, strict=True)  # one capture per sequence
    )
    err = max(
        max(float((a - ta).abs().max()), float((f - tf).abs().max()))
        for (a, f), (ta, tf) in zip(got, truth, strict=True)
    )
    data = {"layer_ids": TINY_LAYER_IDS, "lengths": [len(s) for s in sequences], "max_abs_err": err}
    ok = shapes_ok and err <= 1e-3
    detail = (
        f"tiny DeepseekV3 (8 layers, CPU fp32), layers {TINY_LAYER_IDS}, batch of {len(sequences)}: "
        f"max |diff| vs output_hidden_states {err:.2e}" + ("" if shapes_ok else ", WRONG SHAPES")
    )
    return Check("transformers capture", OK if ok else FAIL, detail, True, data)


def sglang_tiny_row(folder: Path, sequences, truth, tp: int, required: bool) -> Check:
    from eagle3_resources.errors import SGLangUnavailable
    from eagle3_resources.hidden_states.sglang_backend import SGLangHiddenStates

    name = f"sglang capture (tiny, tp={tp})"
    try:
        backend = SGLangHiddenStates(
            str(folder),
            tp_size=tp,
            layer_ids=TINY_LAYER_IDS,
            max_length=1024,
            mem_fraction_static=0.3,
            start_timeout_s=900,
            batch_timeout_s=300,
        )
    except SGLangUnavailable as e:
        return Check(name, UNAVAILABLE, str(e).splitlines()[0].split("  (")[0], required, fix="see sglang above")
    with backend:
        got = backend.extract_batch(sequences)
        described = backend.describe()
    hidden = described["hidden_size"]
    stats = cosine_stats(got, truth, hidden, len(TINY_LAYER_IDS))
    ok = all(v >= COSINE_MEAN_MIN for k, v in stats.items() if k.endswith("_mean")) and all(
        v >= COSINE_LOW_MIN for k, v in stats.items() if k.endswith("_min")
    )
    worst = min(stats.items(), key=lambda kv: kv[1])
    detail = (
        f"vs fp32 ground truth: per-token cosine mean >= {min(v for k, v in stats.items() if k.endswith('_mean'))}, "
        f"worst token {worst[1]} ({worst[0]}); capture argument {described['sglang_capture_argument']}"
    )
    return Check(name, OK if ok else FAIL, detail, required, {"cosine": stats, "backend": described})


def sglang_target_row(model_path: str, tp: int) -> Check:
    import torch

    from eagle3_resources.errors import SGLangUnavailable
    from eagle3_resources.hidden_states.sglang_backend import SGLangHiddenStates, read_text_shape

    name = f"sglang capture (target, tp={tp})"
    shape = read_text_shape(model_path)
    config = json.loads((Path(model_path) / "config.json").read_text())
    vocab = int((config.get("text_config") or config)["vocab_size"])
    started = time.monotonic()
    try:
        backend = SGLangHiddenStates(
            model_path, tp_size=tp, max_length=8192, mem_fraction_static=planned_mem_fraction()[0]
        )
    except SGLangUnavailable as e:
        return Check(name, UNAVAILABLE, str(e).splitlines()[0], True)
    load_s = time.monotonic() - started
    with backend:
        g = torch.Generator().manual_seed(1)
        backend.extract_batch([torch.randint(1000, vocab - 1000, (256,), generator=g).tolist()])  # warm-up
        batch = [torch.randint(1000, vocab - 1000, (n,), generator=g).tolist() for n in (2048, 1024, 4096, 512, 2048)]
        t0 = time.monotonic()
        got = backend.extract_batch(batch)
        seconds = time.monotonic() - t0
        described = backend.describe()
    n_aux = len(described["layer_ids"])
    problems = []
    for (a, f), s in zip(got, batch, strict=True):  # one capture per sequence of the batch
        if a.shape != (len(s), n_aux * shape.hidden_size) or f.shape != (len(s), shape.hidden_size):
            problems.append(f"shape aux {tuple(a.shape)} final {tuple(f.shape)} for {len(s)} tokens")
        if not (torch.isfinite(a).all() and torch.isfinite(f).all()):
            problems.append(f"non-finite values in a {len(s)}-token sequence")
    tokens = sum(len(s) for s in batch)
    data = {
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "load_s": round(load_s, 1),
        "backend": described,
        "problems": problems,
    }
    detail = (
        f"layers {described['layer_ids']} (SGLang argument {described['sglang_capture_argument']}), "
        f"{tokens} tokens in {seconds:.2f} s = {tokens / seconds:,.0f} tokens/s; load {load_s:.0f} s"
        + (f"; {'; '.join(problems)}" if problems else "")
    )
    return Check(name, FAIL if problems else OK, detail, True, data)


# ---------------------------------------------------------------- the command


def target_hidden(model: str | None) -> tuple[int, str]:
    """The hidden size the capture is planned for: --model's, else EAGLE3_TARGET_DIR's, else Kimi-K2.5's."""
    from eagle3_resources.hidden_states.sglang_backend import read_text_shape

    for path, label in ((model, "--model"), (os.environ.get("EAGLE3_TARGET_DIR"), "EAGLE3_TARGET_DIR")):
        if path and (Path(path) / "config.json").exists():
            return read_text_shape(path).hidden_size, f"hidden of {label}"
    return KIMI_K25_HIDDEN, "hidden of Kimi-K2.5"


@dataclass(frozen=True)
class HostPlan:
    """What the host rows measure against (the `gpu-check` flags)."""

    data_dir: Path
    tokens: int | None = None  # planned capture; None: the merged dataset's
    max_forward_tokens: int | None = (
        None  # rows of one hand-off slab; None: EAGLE3_SGLANG_MAX_FORWARD_TOKENS or the default
    )
    handoff_slabs: int | None = None  # slabs in the hand-off ring; None: the backend's default
    shm_dir: Path = Path("/dev/shm")
    disk_mib: int = 256
    min_disk_gbps: float | None = None


def run_checks(
    model: str | None = None, tp: int | None = None, host: HostPlan | None = None, capture: bool = True
) -> list[Check]:
    sglang_asked = tp is not None or model is not None
    if host is None:
        from eagle3_resources.storage import default_data_dir

        host = HostPlan(data_dir=default_data_dir())
    disk_asked = sglang_asked or host.tokens is not None
    from eagle3_resources.hidden_states.sglang_sizes import DEFAULT_HANDOFF_SLABS, DEFAULT_MAX_FORWARD_TOKENS

    forward_tokens = host.max_forward_tokens or int(
        os.environ.get("EAGLE3_SGLANG_MAX_FORWARD_TOKENS") or DEFAULT_MAX_FORWARD_TOKENS
    )
    slabs = host.handoff_slabs or DEFAULT_HANDOFF_SLABS
    hidden, hidden_from = target_hidden(model)
    checks = [
        _guard("torch/cuda", sglang_asked, lambda: torch_row(sglang_asked)),
        _guard("sglang", sglang_asked, lambda: sglang_row(sglang_asked)),
        _guard("nvidia driver", sglang_asked, lambda: driver_row(sglang_asked)),
        _guard("cuda toolchain", sglang_asked, lambda: toolchain_row(sglang_asked)),
        _guard("gpus", sglang_asked, lambda: gpus_row(tp, model, sglang_asked)),
        _guard("gpu memory", model is not None, lambda: memory_row(model, tp, forward_tokens, model is not None)),
        _guard(
            "/dev/shm",
            sglang_asked,
            lambda: shm_row(host.shm_dir, forward_tokens, slabs, hidden, hidden_from, sglang_asked),
        ),
        _guard(
            "disk write",
            disk_asked,
            lambda: disk_write_row(host.data_dir, host.disk_mib, host.min_disk_gbps, hidden, disk_asked),
        ),
        _guard(
            "disk space",
            disk_asked,
            lambda: disk_space_row(host.data_dir, host.tokens, hidden, hidden_from, disk_asked),
        ),
        _guard("sglang contract", sglang_asked, lambda: contract_row(sglang_asked)),
    ]
    if not capture:
        return checks
    with tempfile.TemporaryDirectory(prefix="eagle3-gpu-check-") as tmp:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()

        folder = tiny_deepseek_v3(Path(tmp) / "tiny-deepseek-v3")
        truth_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        sequences = tiny_sequences(truth_model.config.vocab_size)
        truth = ground_truth(truth_model, sequences, TINY_LAYER_IDS)
        del truth_model
        checks.append(_guard("transformers capture", True, lambda: transformers_row(folder, sequences, truth)))
        tiny_tp = tp or 1
        checks.append(
            _guard(
                f"sglang capture (tiny, tp={tiny_tp})",
                sglang_asked,
                lambda: sglang_tiny_row(folder, sequences, truth, tiny_tp, sglang_asked),
            )
        )
    if model is not None:
        target_tp = tp or 8
        checks.append(
            _guard(f"sglang capture (target, tp={target_tp})", True, lambda: sglang_target_row(model, target_tp))
        )
    return checks


def render(checks: list[Check]) -> str:
    marks = [c.status + ("" if c.required or c.status == OK else " (not asked)") for c in checks]
    width, sw = max(len(c.name) for c in checks), max(len(m) for m in marks)
    lines = [f"{'check':<{width}}  {'status':<{sw}}  detail", f"{'-' * width}  {'-' * sw}  {'-' * 40}"]
    for c, mark in zip(checks, marks, strict=True):  # marks: one per check
        lines.append(f"{c.name:<{width}}  {mark:<{sw}}  {c.detail}")
    fixes = [c for c in checks if c.status != OK and c.fix]
    if fixes:
        lines += ["", "to fix:"] + [f"  {c.name}: {c.fix}" for c in fixes]
    code = exit_code(checks)
    gpu = next((c for c in checks if c.name == "torch/cuda"), None)
    lines.append("")
    if gpu is not None and gpu.status != OK:
        lines.append(
            "no GPU on this host: the SGLang capture needs a CUDA host; the transformers backend runs here on "
            "the CPU. On a GPU host: the install above, then `eagle3 gpu-check --tp 8`."
        )
    lines.append(
        "result: "
        + ("everything asked for works" if code == 0 else "something asked for does not work")
        + f" (exit {code})"
    )
    return "\n".join(lines)


def gpu_check(
    model: str | None = None,
    tp: int | None = None,
    as_json: bool = False,
    host: HostPlan | None = None,
    capture: bool = True,
) -> int:
    checks = run_checks(model, tp, host, capture)
    code = exit_code(checks)
    if as_json:
        print(json.dumps({"exit_code": code, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        print(render(checks))
    return code
