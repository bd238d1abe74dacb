"""The device check's `speculative` section (`benchmarks/drafter_device_check.py`) keeps to the budget it is given,
as the training and extraction sections do: a GPU host where it runs slow (eager batch-1 decoding is host-bound)
gets its figures, cut where they can be cut and saying so, instead of a section killed at its cap with none.

Run here on the CPU in its quick shape: with no budget every step and prompt asked is done; with a budget already
spent, one of each (the least that still gives an accept length); and training is told to end early enough to leave
the trained drafter's decoding the time the untrained one's took, times the reserve. On a fake clock (the
benchmark's `time`, advanced by fake decoding and training): no prompt starts that the slowest so far says would end
past the deadline, and training's step time leaves out the trainer's set-up.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from eagle3_assets.stages.eagle3_drafter.train import TrainHistory

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import drafter_device_check as check  # noqa: E402

UNUSED: Any = None  # a model the fakes below never touch

QUICK = (
    "--device cpu --hidden 64 --layers 8 --vocab 2048 --fit-steps 4 --train-samples 24 --prompt-len 16 "
    "--completion-len 16 --prompts 3 --new-tokens 6 --epochs 2"
).split()


def cut_figures(figures: dict) -> tuple[int, ...]:
    return (
        figures["fit_steps"],
        figures["train_steps"],
        figures["untrained"]["prompts"],
        figures["trained"]["prompts"],
    )


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("budget_s", "started_s_ago", "spent"), [(None, 0.0, False), (1.0, 1000.0, True)])
def test_the_speculative_check_keeps_to_its_budget(monkeypatch, budget_s, started_s_ago, spent):
    monkeypatch.setattr(check, "STARTED", time.perf_counter() - started_s_ago)
    args = [*QUICK] if budget_s is None else [*QUICK, "--budget-s", str(budget_s)]
    figures = check.measure(check.parse_args(args))
    asked = (figures["fit_steps_asked"], figures["train_steps_asked"], 3, 3)
    assert asked[1] >= 2, "the quick shape must ask for more than one training step, or the cut is not seen"
    assert cut_figures(figures) == ((1, 1, 1, 1) if spent else asked)
    # the trained drafter is asked for the prompts the untrained one decoded: the two are compared on the same ones
    assert (figures["untrained"]["prompts_asked"], figures["trained"]["prompts_asked"]) == (3, 1 if spent else 3)
    assert figures["budget_s"] == budget_s
    # what was done still gives the section's figures
    for name in ("trained", "untrained"):
        assert figures[name]["accept_length_sglang"] >= 1.0
    assert figures["train_tokens"] > 0 and figures["final_loss"] is not None


@pytest.mark.timeout(600)
def test_training_leaves_the_trained_drafters_decoding_the_time_the_untrained_ones_took(monkeypatch):
    floor_s, budget_s = 40.0, 1000.0
    monkeypatch.setattr(check, "STARTED", time.perf_counter())
    decoded: list[tuple[str, list, check.Deadline]] = []

    def speculative_run(name, target, drafter, held_out, a, deadline=None):
        decoded.append((name, held_out, deadline))
        return {"prompts": 2, "prompts_asked": len(held_out), "seconds": floor_s}

    deadlines: list[check.Deadline] = []

    def train_drafter(drafter, source, head, draft_ids, epochs, device, compile_mlp=None, deadline=None):
        deadlines.append(deadline)
        return {}

    monkeypatch.setattr(check, "speculative_run", speculative_run)
    monkeypatch.setattr(check, "train_drafter", train_drafter)
    check.measure(check.parse_args([*QUICK, "--budget-s", str(budget_s)]))
    end = check.STARTED + budget_s
    assert deadlines[0].at == pytest.approx(end - check.TRAINED_DECODE_RESERVE * floor_s)
    (first, first_prompts, first_deadline), (second, second_prompts, second_deadline) = decoded
    assert (first, second) == ("untrained", "trained")
    assert len(first_prompts) == 3 and len(second_prompts) == 2, "the trained drafter decodes the floor's prompts"
    assert second_deadline.at == pytest.approx(end)
    assert first_deadline.at is not None and first_deadline.at < end - budget_s / 2  # a third of what was left


def test_a_deadline_starts_a_unit_only_if_it_would_end_in_time():
    now = time.perf_counter()
    assert check.Deadline(None).fits(1e9) and check.Deadline(None).share(0.5).at is None
    assert check.Deadline(now + 100).fits(10) and not check.Deadline(now + 100).fits(200)
    assert check.Deadline(now + 100).before(95).fits(10) is False
    half = check.Deadline(now + 100).share(0.5).at
    assert half is not None and now + 45 < half < now + 55
    assert check.Deadline(now - 5).share(0.5).at == pytest.approx(time.perf_counter(), abs=1.0)


class FakeClock:
    """The benchmark's `time`, advanced only by the fake decoding below: prompt timings that cannot drift."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    monotonic = perf_counter


class FakeReport:
    def __init__(self, prompts: list):
        self.prompts = prompts

    def totals(self) -> dict:
        keys = ("accept_length_sglang", "accept_length_per_round", "accept_length_vllm", "position_acceptance")
        more = ("lossless", "mismatched_prompts", "lossless_up_to_ties", "mismatched_at_ties")
        speed = ("spec_tokens_per_s", "greedy_tokens_per_s", "speedup")
        return {k: 1.0 for k in (*keys, *more, *speed)}


def test_no_prompt_starts_that_the_slowest_so_far_says_would_end_past_the_deadline(monkeypatch):
    """Warm-up 0.5 s, then prompts of 3, 1, 1, 1 s against a deadline at 7 s: the first ends at 3.5, the second
    (3 s more, as the slowest took, ends by 6.5) starts and ends at 4.5; a third would by the slowest end at 7.5:
    two prompts. By the last prompt's time instead, or none, all four would run."""
    clock = FakeClock()
    monkeypatch.setattr(check, "time", clock)
    costs = iter([0.5, 3.0, 1.0, 1.0, 1.0])

    def evaluate_speculative(target, drafter, prompts, **kwargs):
        clock.now += next(costs)
        return FakeReport(list(prompts))

    monkeypatch.setattr(check, "evaluate_speculative", evaluate_speculative)
    a = check.parse_args(QUICK)
    figures = check.speculative_run("trained", UNUSED, UNUSED, [[1], [2], [3], [4]], a, check.Deadline(7.0))
    assert (figures["prompts"], figures["prompts_asked"], figures["seconds"]) == (2, 4, 4.5)


def test_training_ends_by_its_step_time_not_counting_the_set_up_as_a_step(monkeypatch):
    """The trainer's set-up (10 s here) comes before its first step: counted as a step, it would end training after
    one step of a budget that holds five. Steps of 1 s from 10 s against a deadline at 15 s: five steps."""
    clock = FakeClock()
    monkeypatch.setattr(check, "time", clock)

    def train(model, source, windows, eval_windows, settings, *, on_step, **kwargs):
        clock.now += 10.0  # set-up
        history = TrainHistory()
        for step in range(1, 100):
            clock.now += 1.0
            history.step_loss.append(1.0)
            if on_step(step, step * 64):
                break
        return history

    monkeypatch.setattr(check, "train", train)
    source = {"s0": {"input_ids": torch.zeros(64, dtype=torch.int32)}}
    head, draft_ids = torch.zeros(16, 8), torch.arange(4)
    figures = check.train_drafter(UNUSED, source, head, draft_ids, 1, torch.device("cpu"), False, check.Deadline(15.0))
    assert figures["train_steps"] == 5
