"""The GPU half's device check: ONE script a GPU host runs (at most ~5 minutes with its defaults), ONE JSON.

    python benchmarks/device_check.py                   # a GPU host: writes $OUT/device_check.json
    .venv/bin/python benchmarks/device_check.py --device cpu --out /tmp/dc   # the same code paths, tiny, on a laptop

Sections, each a subprocess of its own with a time cap (a section that fails or runs out of time is
recorded with its error and output tail; the others still run, and the JSON is rewritten after each). In
this order: the issue's acceptance figures first, so a run short of time skips the others:
- `train_2048`: drafter training tokens/s and MFU at width 2048 (16 heads, intermediate 4096, draft
  vocabulary 8192), on steps of 16,384 tokens (`drafter_training_speed.py`);
- `train_kimi`: at Kimi-K2.5 width (hidden 7168, 56 / 8 heads, intermediate 18432, draft vocabulary 32000,
  the 163,840-row embedding frozen), one 4,096-token step, with the peak GPU memory;
- `extraction`: `hidden_states_throughput.py` (hidden-state capture against a bare forward and the disk);
- `train_2048_today`: the same width on the step the issue measured (2,048 tokens of 256-token windows),
  without torch.compile (beside `train_2048`, which has it: what compiling pays);
- `ttt_attention`: the fused TTT attention against the written-out one at Kimi's head shape;
- `speculative`: `drafter_device_check.py`, a drafter trained (without torch.compile) on a fitted target's
  text, then real speculative decoding (bf16, after a warm-up): accept length, and an `eager_proxy` speed that
  is NOT a deployment figure (under its budget: fit, training and prompts cut to fit, and counted);
- `handoff`: `sglang_handoff.py`, the SGLang backend's rank-0 hand-off at Kimi size (the slab ring against
  the queue paths it replaced) and rank 0's device-to-host copy, pinned slab against pageable (no sglang).
Each training section also reports `phases`: where its wall time went before the clock started (data,
model, teacher, and the set-up with torch.compile and the warm-up steps).
Needs torch, transformers and safetensors only (plus this project's modules that need neither Dagster nor
polars). MFU is against the GPU's dense bf16 peak from the trainer's table by the name it reports (989 TFLOP/s
on an H200 or an H100 SXM; `peak_source` says whether it was found); `mfu_at_790` against the issue's 790.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

KIMI = ["--hidden", "7168", "--intermediate", "18432", "--draft-vocab", "32000", "--target-vocab", "163840"]

# name -> (script, GPU arguments, CPU quick arguments, cap in seconds on a GPU)
SECTIONS: dict[str, tuple[str, list[str], list[str], int]] = {
    "train_2048": (
        "drafter_training_speed.py",
        [
            "--hidden",
            "2048",
            "--intermediate",
            "4096",
            "--draft-vocab",
            "8192",
            "--target-vocab",
            "32000",
            "--batch-tokens",
            "16384",
            "--steps",
            "8",
            "--warmup",
            "3",
            "--min-len",
            "256",
            "--max-len",
            "2048",
        ],
        [
            "--hidden",
            "256",
            "--draft-vocab",
            "1024",
            "--target-vocab",
            "4096",
            "--batch-tokens",
            "1024",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--min-len",
            "64",
            "--max-len",
            "256",
        ],
        75,
    ),
    "train_kimi": (
        "drafter_training_speed.py",
        [*KIMI, "--batch-tokens", "4096", "--steps", "5", "--warmup", "2", "--min-len", "512", "--max-len", "2048"],
        [
            "--hidden",
            "512",
            "--intermediate",
            "1024",
            "--draft-vocab",
            "2048",
            "--target-vocab",
            "8192",
            "--batch-tokens",
            "1024",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--min-len",
            "128",
            "--max-len",
            "512",
        ],
        90,
    ),
    "extraction": (
        "hidden_states_throughput.py",
        ["--hidden", "2048", "--layers", "8"],  # `--budget-s`: rounds that fit in the section's limit (BUDGETED)
        ["--hidden", "64", "--layers", "8", "--samples", "8", "--rounds", "1"],
        75,
    ),
    "train_2048_today": (
        "drafter_training_speed.py",
        [
            "--hidden",
            "2048",
            "--intermediate",
            "4096",
            "--draft-vocab",
            "8192",
            "--target-vocab",
            "32000",
            "--batch-tokens",
            "2048",
            "--steps",
            "20",
            "--warmup",
            "5",
            "--min-len",
            "256",
            "--max-len",
            "256",
            "--compile",
            "off",
        ],
        [
            "--hidden",
            "256",
            "--draft-vocab",
            "1024",
            "--target-vocab",
            "4096",
            "--batch-tokens",
            "512",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--min-len",
            "128",
            "--max-len",
            "128",
        ],
        30,
    ),
    "ttt_attention": (
        "ttt_attention.py",
        ["--shape", "kimi", "--lengths", "1024,4096", "--repeats", "2"],
        ["--shape", "standin", "--lengths", "128", "--repeats", "1"],
        25,
    ),
    "speculative": (
        "drafter_device_check.py",
        # its trainer eager: torch.compile's set-up, and the compiled MLP's recompiles for the bf16 decode (a path
        # no other section runs), would come out of the last but one section of a 290 s budget; training speed is
        # train_2048's figure, this section's the accept length
        ["--compile", "off"],
        [
            "--hidden",
            "64",
            "--layers",
            "8",
            "--vocab",
            "2048",
            "--fit-steps",
            "3",
            "--train-samples",
            "8",
            "--prompt-len",
            "16",
            "--completion-len",
            "16",
            "--prompts",
            "1",
            "--new-tokens",
            "6",
            "--epochs",
            "1",
        ],
        120,
    ),
    # Last, so a run short of time skips it first: the SGLang backend's rank-0 hand-off (slab ring against the
    # queue paths it replaced) and rank 0's D2H, pinned slab against pageable, at Kimi size.
    "handoff": ("sglang_handoff.py", ["--batches", "3"], ["--tokens", "512", "--hidden", "1024", "--batches", "2"], 60),
}


# The goals on an H200, each (what, section, figure, comparison, target): checked at the end of every run
# and written into the JSON and as a table, so a run's report says at once which hold. The last is the run's own
# wall time.
GOALS: list[tuple[str, str | None, str, str, float]] = [
    ("extraction / min(bare forward, disk bound)", "extraction", "ratio_extraction_to_limit", ">=", 0.9),
    ("extraction, null sink / bare forward", "extraction", "ratio_null_sink_to_bare", ">=", 0.95),
    ("training MFU at Kimi width (4,096-token step)", "train_kimi", "mfu", ">=", 0.40),
    ("training tokens/s at width 2048 (10x 4,160)", "train_2048", "tokens_per_s", ">=", 41_600),
    ("the whole device check, every section done, seconds", None, "seconds", "<=", 300),
]


def acceptance(report: dict) -> list[dict]:
    """Each goal with its measured figure and whether it holds (None: not measured, e.g. a failed section, or MFU
    on a CPU). The run's time holds only if every section gave its figures in it (a section skipped or cut short
    by the budget is not a check done in 5 minutes), and is not judged for a run of some sections (`--only`)."""
    sections = report["sections"]
    rows = []
    for what, section, key, op, target in GOALS:
        source = report if section is None else sections.get(section, {}).get("figures", {})
        value = source.get(key)
        met = None if value is None else (value >= target if op == ">=" else value <= target)
        if section is None and met is not None:  # the run's time
            if set(sections) != set(SECTIONS):
                met = None
            elif not all("figures" in r for r in sections.values()):
                met = False
        rows.append(
            {
                "goal": what,
                "section": section,
                "figure": key,
                "target": f"{op} {target:g}",
                "measured": value,
                "met": met,
            }
        )
    return rows


def acceptance_table(rows: list[dict]) -> str:
    """The goals as a markdown table, for docs/gpu-host.md, step 5."""
    verdict = {True: "yes", False: "**no**", None: "not measured"}
    lines = ["| goal | target | measured | met |", "|---|---|---|---|"]
    for r in rows:
        value = r["measured"]
        shown = "-" if value is None else f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
        lines.append(f"| {r['goal']} | {r['target']} | {shown} | {verdict[r['met']]} |")
    return "\n".join(lines)


# Sections whose script keeps to a `--budget-s` (no round, step or prompt starts that would end past it): given their
# limit less this margin (start-up, the JSON), so a section that runs short of time (a slow torch.compile, slow eager
# decoding) still returns the figures of the rounds, steps or prompts it finished, rather than none.
BUDGETED = {"extraction", "train_2048", "train_kimi", "train_2048_today", "speculative"}
BUDGET_MARGIN_S = 15.0


def run_section(name: str, script: str, args: list[str], device: str, cap: float, workdir: Path) -> dict:
    path = workdir / f"{name}.json"
    if name in BUDGETED and device == "cuda":
        args = [*args, "--budget-s", f"{max(10.0, cap - BUDGET_MARGIN_S):.0f}"]
    cmd = [sys.executable, str(HERE / script), "--device", device, *args, "--json", str(path)]
    started = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "OUT": ""},
    )
    try:
        out, _ = proc.communicate(timeout=cap)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        timed_out = True
    seconds = round(time.monotonic() - started, 1)
    result: dict = {"seconds": seconds, "command": " ".join(cmd[1:])}
    if path.exists() and not timed_out and proc.returncode == 0:
        result["figures"] = json.loads(path.read_text())
    else:
        result["error"] = f"timed out after {cap:.0f} s" if timed_out else f"exit status {proc.returncode}"
        result["output_tail"] = (out or "")[-3000:]
    return result


def environment() -> dict:
    info: dict = {"python": sys.version.split()[0]}
    try:
        import torch

        info.update(
            torch=torch.__version__,
            cuda=torch.version.cuda,
            gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        )
        import transformers

        info["transformers"] = transformers.__version__
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        info["error"] = repr(e)
    return info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (the defaults) or cpu (a quick run of the same code paths)")
    p.add_argument("--out", default=os.environ.get("OUT") or ".", help="folder for device_check.json (default $OUT)")
    p.add_argument("--only", default=None, help="comma-separated section names (default: all)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="the whole run's wall-clock budget (default 290 s on cuda; none on cpu, whose quick mode checks the code "
        "paths, not the time: on a slow or shared CPU a budget would skip the last sections)",
    )
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    names = a.only.split(",") if a.only else list(SECTIONS)
    report: dict = {"device": a.device, "environment": environment(), "sections": {}}
    budget_s = a.budget_s if a.budget_s is not None else 290.0 if a.device == "cuda" else float("inf")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="device-check-") as tmp:
        for name in names:
            script, gpu_args, cpu_args, cap = SECTIONS[name]
            left = budget_s - (time.monotonic() - started)
            if left < 10:
                report["sections"][name] = {"error": "skipped: the run's time budget was spent"}
                continue
            limit = min(cap, left) if a.device == "cuda" else max(cap, 600)  # the CPU quick mode is slow, not capped
            print(f"[device_check] {name} (at most {limit:.0f} s)", flush=True)
            report["sections"][name] = res = run_section(
                name, script, gpu_args if a.device == "cuda" else cpu_args, a.device, limit, Path(tmp)
            )
            print(f"[device_check] {name}: {res.get('error') or 'ok'} in {res['seconds']} s", flush=True)
            report["seconds"] = round(time.monotonic() - started, 1)
            (out / "device_check.json").write_text(json.dumps(report, indent=2) + "\n")
    report["seconds"] = round(time.monotonic() - started, 1)
    report["acceptance"] = acceptance(report)
    (out / "device_check.json").write_text(json.dumps(report, indent=2) + "\n")
    summary = {
        n: {k: s.get("figures", {}).get(k) for k in ("tokens_per_s", "mfu", "peak_gpu_mib")}
        if n.startswith("train")
        else ("ok" if "figures" in s else s.get("error"))
        for n, s in report["sections"].items()
    }
    print(json.dumps({"seconds": report["seconds"], "summary": summary}, indent=2))
    print(f"\nThe issue's goals, set for an H200 (this run's device: {report['environment'].get('gpu') or a.device}):")
    print(acceptance_table(report["acceptance"]))


if __name__ == "__main__":
    main()
