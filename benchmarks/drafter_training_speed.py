"""Benchmark: drafter training tokens/s and MFU on synthetic data, at any width, on the CPU or one GPU.

    .venv/bin/python benchmarks/drafter_training_speed.py --device cpu --hidden 256 --steps 6
    python benchmarks/drafter_training_speed.py --device cuda --hidden 7168 --intermediate 18432 --draft-vocab 32000 \\
        --target-vocab 163840 --batch-tokens 4096 --steps 8          # a Kimi-K2.5-wide drafter on one GPU

Random bf16 aux and final hidden states (the trainer's speed does not depend on what they mean) in
samples of mixed lengths, trained by this project's `train` (TTT 7 steps) for a few optimizer steps.
The teacher's full-vocabulary argmax is computed for every window before the clock starts, as it is
cached from the second epoch of a real run on. The first `--warmup` steps (allocator, cuBLAS,
torch.compile) are not timed: tokens/s is over the rest, MFU against the FLOPs-per-token formula of
`model.train_flops_per_token` and the GPU's dense bf16 peak: `--peak-tflops` if given, else the trainer's table
by the name the GPU reports (989 for an H200 or H100 SXM, 835 for an NVL board, 756 for an H100 PCIe), else 989,
marked "assumed" in `peak_source`; `mfu_at_790` uses the 790 of the issue's own figures). Prints one JSON
line (and writes it to `--json`); needs torch only (and this project's drafter modules).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3_assets.stages.eagle3_drafter.data import Teacher, WindowPlan, plan_windows  # noqa: E402
from eagle3_assets.stages.eagle3_drafter.model import (  # noqa: E402
    DrafterConfig,
    Eagle3Drafter,
    train_flops_per_token,
)
from eagle3_assets.stages.eagle3_drafter.train import TrainHistory, TrainSettings, peak_tflops, train  # noqa: E402

STARTED = time.perf_counter()  # `--budget-s` counts from here (the imports above are a few seconds)


def synthetic_source(
    samples: int, min_len: int, max_len: int, hidden: int, vocab: int, seed: int, device: torch.device
) -> dict:
    """Samples as the store hands them over (CPU, bf16 states); drawn on `device` (fast on a GPU)."""
    rng = random.Random(seed)
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for i in range(samples):
        n = rng.randint(min_len, max_len)
        prompt = n // 4
        out[f"s{i}"] = {
            "input_ids": torch.randint(0, vocab, (n,), generator=g, device=device, dtype=torch.int32).cpu(),
            "loss_mask": torch.tensor([0] * prompt + [1] * (n - prompt), dtype=torch.int8),
            "aux_hidden_states": torch.randn(n, 3 * hidden, generator=g, device=device, dtype=torch.bfloat16).cpu(),
            "final_hidden_state": torch.randn(n, hidden, generator=g, device=device, dtype=torch.bfloat16).cpu(),
        }
    return out


@dataclass(frozen=True)
class SpeedOptions:
    """One measurement's shape and length, as the command line gives them."""

    device: str
    hidden: int
    intermediate: int | None  # None: 2 x hidden
    draft_vocab: int
    target_vocab: int
    batch_tokens: int
    steps: int  # timed optimizer steps
    warmup: int  # untimed steps before them
    min_len: int
    max_len: int
    window: int
    peak_tflops: float | None  # None: the device's, from the trainer's table
    compile: bool | None  # None: the trainer's own default
    budget_s: float | None = None  # None: all `steps`; else the timed steps that fit (at least one) from `STARTED`


@dataclass
class Prepared:
    """What the clock does not count: the data, the drafter and the teacher (the target's head, its argmax cache)."""

    cfg: DrafterConfig
    source: dict
    model: Eagle3Drafter
    plan: WindowPlan
    teacher: Teacher
    phases: dict[str, float]  # where the section's wall time goes before the clock starts


def drafter_config(o: SpeedOptions) -> DrafterConfig:
    return DrafterConfig.of_width(
        o.hidden,
        intermediate_size=o.intermediate or 2 * o.hidden,
        vocab_size=o.target_vocab,
        draft_vocab_size=o.draft_vocab,
        max_position_embeddings=max(4096, o.window),
    )


def samples_needed(o: SpeedOptions) -> int:
    """Enough samples for warm-up + timed steps (one epoch)."""
    avg = (o.min_len + o.max_len) / 2
    return int((o.steps + o.warmup + 1) * o.batch_tokens / avg) + 2


def made_drafter(
    o: SpeedOptions, cfg: DrafterConfig, dev: torch.device, phases: dict[str, float]
) -> tuple[Eagle3Drafter, torch.Tensor, torch.Tensor]:
    """(the drafter, the target's head, the draft vocabulary's ids); the drafter's construction timed as model_s."""
    vocab, hidden = o.target_vocab, o.hidden
    # the target's embedding and head (163,840 x 7168 for Kimi) drawn where they will live
    embed = torch.randn(vocab, hidden, generator=torch.Generator(device=dev).manual_seed(1), device=dev) * 0.02
    head = torch.randn(vocab, hidden, generator=torch.Generator(device=dev).manual_seed(2), device=dev) * 0.02
    draft_ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(3))[: o.draft_vocab].sort().values
    torch.manual_seed(0)
    started = time.perf_counter()
    with dev:  # initialised where it trains: on the host, Kimi width's ~1B parameters take 10-30 s of the cap
        model = Eagle3Drafter(cfg, embed, draft_ids.to(dev))
    del embed
    phases["model_s"] = time.perf_counter() - started
    return model, head, draft_ids


def cached_teacher(
    source: dict, head: torch.Tensor, draft_ids: torch.Tensor, window: int, dev: torch.device
) -> tuple[WindowPlan, Teacher]:
    """The windows, and a teacher holding every window's argmax: the cache a real run has from its second epoch on."""
    plan = plan_windows([(k, len(v["input_ids"])) for k, v in source.items()], window)
    teacher = Teacher(head, draft_ids, dev)
    for w in plan.windows:
        teacher.argmax(
            (w.sample_id, w.start, w.end),
            source[w.sample_id]["final_hidden_state"][w.start : w.end].to(dev, teacher.dtype),
        )
    return plan, teacher


def prepare(o: SpeedOptions, dev: torch.device) -> Prepared:
    cfg = drafter_config(o)
    n = samples_needed(o)
    phases: dict[str, float] = {}
    started = time.perf_counter()
    source = synthetic_source(n, o.min_len, o.max_len, o.hidden, o.target_vocab, seed=0, device=dev)
    phases["data_s"] = time.perf_counter() - started
    model, head, draft_ids = made_drafter(o, cfg, dev, phases)
    started = time.perf_counter()
    plan, teacher = cached_teacher(source, head, draft_ids, o.window, dev)
    phases["teacher_s"] = time.perf_counter() - started
    # Only the teacher's copy of the head is kept (bf16 on a GPU): the fp32 draw would stay on the device through the
    # timed steps and count in `peak_gpu_mib` (4.7 GB at Kimi width), which a real run keeps on the host
    return Prepared(cfg, source, model, plan, teacher, phases)


@dataclass(frozen=True)
class Timed:
    """The timed steps of a training run, and its record."""

    history: TrainHistory
    steps: int
    seconds: float
    tokens: int


def timed_training(o: SpeedOptions, p: Prepared, dev: torch.device, log) -> Timed:
    """Train `warmup + steps` optimizer steps, timing the last `steps`: the clock runs from the end of step `warmup`
    to the end of step `warmup + steps`; the set-up before it is `to_first_timed_step_s`. With `budget_s`, the run
    ends early after the first timed step whose successor (taking as long as it did) would end past the budget: the
    figures are from the timed steps done."""
    extra: dict[str, Any] = {} if o.compile is None else {"compile": o.compile}
    settings = TrainSettings(
        ttt_steps=7,
        epochs=1,
        batch_tokens=o.batch_tokens,
        max_len=o.window,
        checkpoint_every=0,
        warmup_steps=2,
        **extra,
    )
    marks: list[tuple[float, int, int]] = []  # (time, tokens, step) at the clock's two ends
    clock_ends = (o.warmup, o.warmup + o.steps)
    deadline = None if o.budget_s is None else STARTED + o.budget_s
    last_step_at = [time.perf_counter()]

    def on_step(step: int, tokens: int) -> bool:
        # the host runs ahead of the device by no more than its launch queue (a step or so: nothing is read back
        # inside a step), so a step's host time is near its device time; the margin the device check leaves covers it
        now = time.perf_counter()
        step_s, last_step_at[0] = now - last_step_at[0], now
        out_of_time = deadline is not None and step > clock_ends[0] and now + step_s > deadline
        if step in clock_ends or out_of_time:  # the clock's two ends wait for the device; the steps between run free
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            marks.append((time.perf_counter(), tokens, step))
        return out_of_time

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    train_started = time.perf_counter()
    history = train(
        p.model,
        p.source,
        p.plan.windows,
        [],
        settings,
        head=p.teacher.head,  # unused beside `teacher`
        device=dev,
        log=log,
        teacher=p.teacher,
        stop_after_steps=o.steps + o.warmup,
        on_step=on_step,
    )
    if len(marks) < 2:
        raise RuntimeError(f"too few samples for {o.steps} + {o.warmup} steps")
    # set-up (torch.compile of the MLP included) and the untimed warm-up steps
    p.phases["to_first_timed_step_s"] = marks[0][0] - train_started
    (start, start_tokens, start_step), (end, end_tokens, end_step) = marks
    return Timed(history, end_step - start_step, end - start, end_tokens - start_tokens)


ASSUMED_PEAK_TFLOPS = 989.0  # an H200's, for a GPU the table does not know


def mfu_peak(o: SpeedOptions, dev: torch.device) -> tuple[float, str]:
    """The dense bf16 peak MFU divides by, and where it came from: "given", "table" or "assumed"."""
    if o.peak_tflops is not None:
        return o.peak_tflops, "given"
    known = peak_tflops(dev)
    return (known, "table") if known is not None else (ASSUMED_PEAK_TFLOPS, "assumed")


def speed_figures(o: SpeedOptions, p: Prepared, dev: torch.device, timed: Timed) -> dict:
    """The JSON: the shape, tokens/s, FLOPs and MFU (on a GPU), the phases, the peak GPU memory."""
    mean_window = sum(w.tokens for w in p.plan.windows) / len(p.plan.windows)
    fpt = train_flops_per_token(p.cfg, ttt_steps=7, mean_window=mean_window)["total"]
    rate = timed.tokens / timed.seconds
    history = timed.history
    peak, source = mfu_peak(o, dev)
    return {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "hidden": o.hidden,
        "intermediate": p.cfg.intermediate_size,
        "heads": p.cfg.num_attention_heads,
        "kv_heads": p.cfg.num_key_value_heads,
        "draft_vocab": o.draft_vocab,
        "target_vocab": o.target_vocab,
        "batch_tokens": o.batch_tokens,
        "timed_steps": timed.steps,
        "timed_steps_asked": o.steps,
        "budget_s": o.budget_s,
        "windows": len(p.plan.windows),
        "mean_window": round(mean_window, 1),
        "tokens_per_s": round(rate, 1),
        "gflop_per_token": round(fpt / 1e9, 3),
        "tflops": round(rate * fpt / 1e12, 2),
        "mfu": round(rate * fpt / (peak * 1e12), 4) if dev.type == "cuda" else None,
        "peak_tflops": peak if dev.type == "cuda" else None,
        "peak_source": source if dev.type == "cuda" else None,
        "mfu_at_790": round(rate * fpt / 790e12, 4) if dev.type == "cuda" else None,
        "seconds": round(timed.seconds, 2),
        "phases": {k: round(v, 2) for k, v in p.phases.items()},
        "compile": history.compiled,
        "final_loss": history.step_loss[-1] if history.step_loss else None,
        "peak_gpu_mib": round(torch.cuda.max_memory_allocated(dev) / 2**20) if dev.type == "cuda" else None,
    }


def measure(o: SpeedOptions, log=print) -> dict:
    dev = torch.device(o.device)
    prepared = prepare(o, dev)
    return speed_figures(o, prepared, dev, timed_training(o, prepared, dev, log))


def parse_args() -> tuple[SpeedOptions, str | None]:
    """(the options, the --json path)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=None, help="default 2 x hidden")
    p.add_argument("--draft-vocab", type=int, default=2048)
    p.add_argument("--target-vocab", type=int, default=8192)
    p.add_argument("--batch-tokens", type=int, default=2048)
    p.add_argument("--steps", type=int, default=6, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--min-len", type=int, default=128)
    p.add_argument("--max-len", type=int, default=768)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument(
        "--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak (default: by its name, else 989)"
    )
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="seconds from start-up: the timed steps that fit (at least one), not all of --steps",
    )
    p.add_argument("--json", default=None, help="also write the figures here")
    a = p.parse_args()
    options = SpeedOptions(
        device=a.device,
        hidden=a.hidden,
        intermediate=a.intermediate,
        draft_vocab=a.draft_vocab,
        target_vocab=a.target_vocab,
        batch_tokens=a.batch_tokens,
        steps=a.steps,
        warmup=a.warmup,
        min_len=a.min_len,
        max_len=a.max_len,
        window=a.window,
        peak_tflops=a.peak_tflops,
        compile={"auto": None, "on": True, "off": False}[a.compile],
        budget_s=a.budget_s,
    )
    return options, a.json


def main() -> None:
    options, json_path = parse_args()
    figures = measure(options, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(figures))
    if json_path:
        Path(json_path).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
