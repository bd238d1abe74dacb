"""The real drafter trainer on a spool (issue 27, streaming mode): capture (tests/spool_worker.py's producer, real
shards through the store's API) and training (tests/spool_training_worker.py: `Trainer` over `SpoolWindows`, a tiny
drafter on the CPU) as separate processes through a spool whose budget is a tenth of the data.

The trainer's own record of each step it trained (a hook after the step) is what is counted: every token of the
data trained exactly `passes` times, the spool never above its budget (sampled from another thread throughout), and
kill -9 of the training process at random moments, then a restart, trains the same windows in the same steps as an
uninterrupted run and ends at bit-equal weights.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import spool_worker as producer
import torch
from test_spool import Sampler, assert_rows_read_once

from eagle3_assets.stages.eagle3_drafter.train import CHECKPOINT_FILE
from eagle3_resources.hidden_states.spool import (
    LANES,
    Position,
    SpoolSettings,
    create_spool,
    min_lane_bytes,
    read_ledger,
    read_order,
)
from eagle3_resources.hidden_states.store import plan_shards, shard_layout

REPO = Path(__file__).resolve().parents[1]
SAMPLES = 60
PASSES = 2
pytestmark = pytest.mark.timeout(900)


def make_spool(root: Path) -> tuple[SpoolSettings, int]:
    """One lane; its share a tenth of the data's shard bytes (asserted to hold the lane's working set)."""
    samples = producer.dataset(SAMPLES)
    plans = plan_shards(samples, producer.HIDDEN, producer.SHARD_BYTES, {"target": "synthetic"})
    sizes = [shard_layout(p, [samples[j] for j in p.samples], producer.HIDDEN).size for p in plans]
    budget = sum(sizes) // 10
    assert budget >= min_lane_bytes(PASSES, max(sizes)), (budget, max(sizes))
    settings = SpoolSettings(
        {"a": budget}, passes=PASSES, max_len=64, batch_tokens=256, seed=5, hidden_size=producer.HIDDEN
    )
    return create_spool(root, settings), sum(sizes)


class Run:
    """A producer and a trainer on one spool under `tmp`; every process it starts is killed at the end."""

    def __init__(self, tmp: Path):
        self.tmp, self.root = tmp, tmp / "spool"
        self.procs: list[subprocess.Popen] = []
        self.trainer_runs = 0
        tmp.mkdir(parents=True, exist_ok=True)

    def _start(self, script: str, *args: str) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}", "OMP_NUM_THREADS": "1"}
        p = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / script), *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            process_group=0,
        )
        self.procs.append(p)
        return p

    def produce(self, slow: float) -> subprocess.Popen:
        stats = self.tmp / "produce.jsonl"
        args = ["produce", str(self.root), "a", "--samples", str(SAMPLES), "--slow", str(slow), "--stats", str(stats)]
        return self._start("spool_worker.py", *args)

    def train(self, slow: float) -> subprocess.Popen:
        self.trainer_runs += 1
        record = self.tmp / f"record-{self.trainer_runs}.jsonl"
        args = [str(self.root), str(self.tmp / "ckpt"), "--record", str(record), "--stats", str(self.tmp / "t.jsonl")]
        return self._start("spool_training_worker.py", *args, "--slow", str(slow))

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def trained_steps(self) -> list[list[list]]:
        """Each optimizer step's windows as the trainer recorded them after training it, in step order; a step that
        a killed run trained after its last checkpoint and the resumed run trained again is the resumed run's."""
        steps: dict[int, list[list]] = {}
        for k in range(1, self.trainer_runs + 1):
            text = (self.tmp / f"record-{k}.jsonl").read_text()
            lines = text.split("\n")
            if lines[-1]:  # a line torn by kill -9 (never completed): only a killed run's last
                assert k < self.trainer_runs, f"record-{k}: a torn line from a run that was not killed"
            for line in lines[:-1]:
                entry = json.loads(line)
                steps[entry["step"]] = entry["windows"]
        assert list(steps) == sorted(steps) and sorted(steps) == list(range(1, len(steps) + 1)), sorted(steps)
        return [steps[k] for k in sorted(steps)]

    def final_state(self) -> dict:
        return torch.load(self.tmp / "ckpt" / CHECKPOINT_FILE, weights_only=False)


@pytest.fixture
def runs(tmp_path: Path) -> Iterator[Callable[[str], Run]]:
    made: list[Run] = []

    def make(name: str) -> Run:
        made.append(Run(tmp_path / name))
        return made[-1]

    yield make
    for r in made:
        r.kill_all()


def finish(*procs: subprocess.Popen) -> list[str]:
    """Each process's output once all have ended; fails as soon as one fails (the other, waiting on the spool for
    it, is killed at the fixture's end)."""
    while any(p.poll() is None for p in procs):
        for p in procs:
            if p.poll() not in (None, 0):
                role = "the trainer" if "spool_training_worker" in str(p.args) else "capture"
                raise AssertionError(f"{role} failed (exit {p.returncode}):\n{p.communicate()[0]}")
        time.sleep(0.05)
    outs = [p.communicate()[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out
    return outs


def stats(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_every_token_trained_passes_times(steps: list[list[list]]) -> None:
    lengths = {s.sample_id: len(s.input_ids) for s in producer.dataset(SAMPLES)}
    counts = {sid: [0] * n for sid, n in lengths.items()}
    for windows in steps:
        for sid, start, end, _pass, _shard in windows:
            for t in range(start, end):
                counts[sid][t] += 1
    wrong = {sid: row for sid, row in counts.items() if set(row) != {PASSES}}
    assert not wrong, f"{len(wrong)} sample(s) not trained exactly {PASSES} times: {list(wrong.items())[:2]}"
    passes = sorted((sid, start, end, p) for windows in steps for sid, start, end, p, _ in windows)
    assert len(passes) == len(set(passes))  # each window once per pass


def assert_spool_emptied(root: Path) -> None:
    assert not list((root / LANES / "a").glob("*.safetensors*"))
    planned = len(json.loads((root / LANES / "a" / "plan.json").read_text())["shards"])
    assert read_ledger(root)["deleted"] == len(read_order(root)) == planned


@pytest.mark.slow
def test_the_trainer_trains_every_token_passes_times_through_a_spool_of_a_tenth_of_the_data(runs):
    run = runs("one")
    settings, data = make_spool(run.root)
    sampler = Sampler(run.root)
    finish(run.produce(slow=0.0), run.train(slow=0.0))
    sampler.stop()
    assert settings.budget_bytes * 10 <= data
    assert 0 < sampler.peak <= settings.budget_bytes, (sampler.peak, settings.budget_bytes)
    (p,) = stats(run.tmp / "produce.jsonl")
    assert p["waits"] > 0, "capture never paused for a full spool: the budget was not exercised"
    steps = run.trained_steps()
    assert_every_token_trained_passes_times(steps)
    assert_spool_emptied(run.root)
    (t,) = stats(run.tmp / "t.jsonl")
    assert t["steps"] == len(steps) and t["finite"]
    assert_rows_read_once(t["bytes_read"], run.root, data)
    state = run.final_state()
    assert state["data"]["spool_steps"] == len(steps) == state["global_step"]
    assert Position.from_json(state["data"]["spool_position"]) == Position.from_json(read_ledger(run.root)["position"])

    # Run again on the finished spool and checkpoint (what a run killed after its last checkpoint leaves): it resumes
    # at the last step, trains and reads nothing, and its reader is at its end.
    finish(run.train(slow=0.0))
    (_, again) = stats(run.tmp / "t.jsonl")
    assert again["resumed_from_step"] == again["steps"] == len(steps) and again["trained_out"], again
    assert again["bytes_read"] == 0 and run.trained_steps() == steps


def wait_for_slot(
    root: Path, slot: int, capture: subprocess.Popen, trainer: subprocess.Popen, deadline_s: float = 900
) -> None:
    """Until the spool's durable position (the trainer's committed checkpoints; rank 0's with several ranks) reaches
    `slot`; fails if the trainer ends, capture fails, or `deadline_s` passes (a trainer stuck, e.g. a rank waiting in
    a collective the others never join)."""
    deadline = time.monotonic() + deadline_s
    while Position.from_json(read_ledger(root)["position"]).slot < slot:
        for p, role in ((capture, "capture"), (trainer, "trainer")):
            if p.poll() is not None and (p is trainer or p.returncode != 0):
                out, _ = p.communicate()
                raise AssertionError(f"the {role} ended (exit {p.returncode}) before slot {slot}:\n{out}")
        assert time.monotonic() < deadline, f"stuck before slot {slot}"
        time.sleep(0.01)


@pytest.mark.slow
def test_kill_9_of_the_trainer_resumes_without_losing_or_repeating_a_trained_window(runs):
    whole = runs("whole")
    make_spool(whole.root)
    finish(whole.produce(slow=0.01), whole.train(slow=0.0))

    killed = runs("killed")
    settings, _ = make_spool(killed.root)
    slots = len(json.loads((whole.root / LANES / "a" / "plan.json").read_text())["shards"]) + PASSES - 1
    rng = random.Random(2027)
    sampler = Sampler(killed.root)
    capture, trainer = killed.produce(slow=0.01), killed.train(slow=0.01)
    resumed_at = []
    for lo, hi in ((3, slots // 3), (slots // 2, 2 * slots // 3)):  # two kills at random moments of the run
        wait_for_slot(killed.root, rng.randint(lo, hi), capture, trainer)
        time.sleep(rng.uniform(0.0, 0.3))
        assert trainer.poll() is None, "training had finished before its kill"
        os.killpg(trainer.pid, signal.SIGKILL)
        trainer.wait()
        resumed_at.append(torch.load(killed.tmp / "ckpt" / CHECKPOINT_FILE, weights_only=False)["global_step"])
        trainer = killed.train(slow=0.01)
    _, out = finish(capture, trainer)
    sampler.stop()
    assert f"resumed from the checkpoint at step {resumed_at[-1]}/" in out
    assert sampler.peak <= settings.budget_bytes, (sampler.peak, settings.budget_bytes)

    reference, steps = whole.trained_steps(), killed.trained_steps()
    assert steps == reference  # the same windows in the same steps: none lost, none trained twice
    assert_every_token_trained_passes_times(steps)
    assert_spool_emptied(killed.root)
    a, b = whole.final_state(), killed.final_state()
    assert b["global_step"] == a["global_step"] == len(reference)
    for k in a["model"]:  # one thread, fp32: bit-equal
        torch.testing.assert_close(b["model"][k], a["model"][k], rtol=0, atol=0, msg=k)
    assert b["history"]["step_loss"] == a["history"]["step_loss"]
