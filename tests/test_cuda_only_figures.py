"""Figures that only a GPU run gives, checked here on the CPU through the code that computes them.

- The trainer's MFU divides by the device's dense bf16 peak, found from `torch.cuda.get_device_name`: the names
  a GPU host reports ("NVIDIA H200", "NVIDIA H100 80GB HBM3", ...) must find theirs, H200 not H20's, a PCIe or
  NVL board its own lower peak, not the SXM's. The training benchmark takes the same peak unless given one, and
  says where its peak came from.
- The training benchmark keeps to the time budget the device check gives it, timing the steps that fit.
- `drafter_training_speed.py`'s peak GPU memory (`peak_gpu_mib`, train_kimi's figure) is the trainer's: the
  benchmark draws the target's head in fp32 on the device to build the teacher, which keeps its own (bf16 on a GPU)
  copy; the fp32 draw must not outlive that (4.7 GB at Kimi width that a real run keeps on the host, if at all).
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch

from eagle3_assets.stages.eagle3_drafter import train as train_module
from eagle3_assets.stages.eagle3_drafter.data import Teacher

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import drafter_training_speed as speed  # noqa: E402


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H200", 989.0),
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA GH200 480GB", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200 NVL", 835.0),
        ("NVIDIA H20", 148.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA B200", 2250.0),
        ("Tesla T4", None),
    ],
)
def test_the_mfu_peak_is_found_from_the_name_a_gpu_reports(monkeypatch, name, peak):
    asked: list[torch.device | None] = []

    def device_name(device=None) -> str:
        asked.append(device)
        return name

    monkeypatch.setattr(torch.cuda, "get_device_name", device_name)
    device = torch.device("cuda")  # as `training_device()` makes it: no index
    assert train_module.peak_tflops(device) == peak
    assert asked == [device]


def speed_options(peak_tflops: float | None, **changes) -> speed.SpeedOptions:
    """A tiny measurement on the CPU."""
    options = speed.SpeedOptions(
        device="cpu",
        hidden=64,
        intermediate=None,
        draft_vocab=128,
        target_vocab=512,
        batch_tokens=256,
        steps=1,
        warmup=1,
        min_len=16,
        max_len=64,
        window=4096,
        peak_tflops=peak_tflops,
        compile=False,
    )
    return dataclasses.replace(options, **changes)


@pytest.mark.parametrize(
    ("given", "name", "expected"),
    [
        (None, "NVIDIA H100 PCIe", (756.0, "table")),
        (None, "Tesla T4", (989.0, "assumed")),
        (500.0, "NVIDIA H100 PCIe", (500.0, "given")),
    ],
)
def test_the_training_benchmark_divides_by_the_gpus_own_peak(monkeypatch, given, name, expected):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    options = speed_options(peak_tflops=given)
    assert speed.mfu_peak(options, torch.device("cuda")) == expected


def test_no_mfu_peak_off_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert train_module.peak_tflops(torch.device("cpu")) is None


class DeviceTeacher(Teacher):
    """The teacher as on a GPU: the head it keeps is its own copy (bf16 there; on the CPU `.to(float32)` of an fp32
    head is the head itself, so the benchmark's fp32 draw and the teacher's would be one tensor)."""

    def __init__(self, head: torch.Tensor, draft_ids: torch.Tensor, device: torch.device, **kwargs):
        super().__init__(head.to(torch.bfloat16), draft_ids, device, **kwargs)


def test_the_speed_benchmark_keeps_no_head_beside_the_teachers(monkeypatch):
    """Its figures are measured after `prepare`: what `prepare` leaves alive on the device counts in the peak."""
    drawn: list[weakref.ref] = []
    made_drafter = speed.made_drafter

    def watched(*args, **kwargs):
        model, head, draft_ids = made_drafter(*args, **kwargs)
        drawn.append(weakref.ref(head))
        return model, head, draft_ids

    monkeypatch.setattr(speed, "made_drafter", watched)
    monkeypatch.setattr(speed, "Teacher", DeviceTeacher)
    options = speed_options(peak_tflops=None)
    prepared = speed.prepare(options, torch.device("cpu"))
    gc.collect()
    assert len(drawn) == 1 and drawn[0]() is None, "the fp32 head drawn for the teacher is still held"
    assert prepared.teacher.head.shape == (512, 64)
    # and the run goes on from what `prepare` kept
    timed = speed.timed_training(options, prepared, torch.device("cpu"), lambda m: None)
    assert timed.seconds > 0 and timed.tokens > 0 and timed.history.step_loss


@pytest.mark.parametrize(
    ("budget_s", "started_s_ago", "timed_steps"),
    [(None, 0.0, 3), (1e6, 0.0, 3), (1.0, 1000.0, 1)],
)
def test_the_speed_benchmark_times_the_steps_its_budget_allows(monkeypatch, budget_s, started_s_ago, timed_steps):
    """The device check gives each training section its time limit as `--budget-s`: past it, the run ends after its
    first timed step (a slow torch.compile on the GPU host still leaves figures), and the figures say so."""
    monkeypatch.setattr(speed, "STARTED", time.perf_counter() - started_s_ago)
    figures = speed.measure(speed_options(peak_tflops=None, steps=3, budget_s=budget_s), log=lambda m: None)
    assert (figures["timed_steps"], figures["timed_steps_asked"]) == (timed_steps, 3)
    assert figures["tokens_per_s"] > 0 and figures["final_loss"] is not None
