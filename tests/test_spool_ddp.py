"""Several training ranks on one spool (issue 27, streaming mode across hosts): the real drafter trainer as two gloo
ranks under torchrun (tests/spool_ddp_worker.py: rank 0 reads the spool, rank 1 follows it) while capture
(tests/spool_worker.py's producer) runs as another process, through a spool whose budget is a tenth of the data.

Counted from the trainer's side (each rank records, after each step, the windows it trained): every token of the data
trained exactly `passes` times, each window once per pass, and the two ranks' windows of every step are exactly the
one-process trainer's (tests/spool_training_worker.py) on the same spool data; the spool never above its budget
(sampled throughout); the spool's files have one writer (its adoption log lists each planned shard once). The two-rank
weights equal the one-process weights up to float summation order. kill -9 of the whole torchrun job (the launcher
and its workers, each of which torchrun starts in a session of its own) at random moments, then restarts, train the
same windows in the same steps as an uninterrupted two-rank run and end at bit-equal weights.
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
import torch
from test_spool import Sampler
from test_spool_training import (
    PASSES,
    REPO,
    Run,
    assert_every_token_trained_passes_times,
    assert_spool_emptied,
    make_spool,
    stats,
    wait_for_slot,
)

from eagle3_assets.stages.eagle3_drafter.train import CHECKPOINT_FILE
from eagle3_resources.hidden_states.spool import LANES, Position, read_ledger, read_order
from eagle3_resources.hidden_states.store import ALIGN

RANKS = 2
DEADLINE_S = 900  # a run that has not ended by then is stuck (a rank waiting in a collective the others never join)


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (from /proc): torchrun starts each worker in a session of its own, so killing
    the launcher's process group does not reach them."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_9(p: subprocess.Popen) -> None:
    """SIGKILL to the process, its group and every process below it (each torchrun worker's own group too)."""
    below = descendants(p.pid)
    for pid in [p.pid, *below]:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    p.wait()


class DdpRun(Run):
    """`Run` (a producer, one-process trainers) plus two-rank trainers under torchrun; everything killed at the end."""

    def __init__(self, tmp: Path):
        super().__init__(tmp)
        self.ddp_runs = 0
        self.ddp: list[subprocess.Popen] = []

    def train_ddp(self, slow: float, checkpoint_every: int = 4, stop_file: Path | None = None) -> subprocess.Popen:
        self.ddp_runs += 1
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}", "OMP_NUM_THREADS": "1"}
        args = [str(self.root), str(self.tmp / "ckpt"), "--record", str(self.tmp / f"ddp-{self.ddp_runs}")]
        args += [
            "--stats",
            str(self.tmp / "ddp.jsonl"),
            "--slow",
            str(slow),
            "--checkpoint-every",
            str(checkpoint_every),
        ]
        args += ["--stop-file", str(stop_file)] if stop_file is not None else []
        p = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}"]
            + [str(REPO / "tests" / "spool_ddp_worker.py"), *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            process_group=0,
        )
        self.procs.append(p)
        self.ddp.append(p)
        return p

    def kill_all(self) -> None:
        for p in self.ddp:
            if p.poll() is None:
                kill_9(p)
        super().kill_all()

    def ddp_steps(self) -> list[list[list]]:
        """Each optimizer step's windows, the ranks' records merged in the order the step lists them (rank r trains
        windows r, r + RANKS, ...); a step a killed run trained after its last checkpoint is the resumed run's."""
        by_rank: list[dict[int, list[list]]] = [{} for _ in range(RANKS)]
        for k in range(1, self.ddp_runs + 1):
            for r in range(RANKS):
                lines = (self.tmp / f"ddp-{k}.rank{r}.jsonl").read_text().split("\n")
                if lines[-1]:  # a line torn by kill -9: only a killed run's last
                    assert k < self.ddp_runs, f"ddp-{k}.rank{r}: a torn line from a run that was not killed"
                for line in lines[:-1]:
                    entry = json.loads(line)
                    by_rank[r][entry["step"]] = entry["windows"]
        n = len(by_rank[0])
        for r in range(RANKS):
            assert sorted(by_rank[r]) == list(range(1, n + 1)), (r, sorted(by_rank[r]))
        steps = []
        for step in range(1, n + 1):
            shares = [by_rank[r][step] for r in range(RANKS)]
            merged: list[list] = [[] for _ in range(sum(len(s) for s in shares))]
            for r, share in enumerate(shares):
                merged[r::RANKS] = share
            steps.append(merged)
        return steps


@pytest.fixture
def runs(tmp_path: Path) -> Iterator[Callable[[str], DdpRun]]:
    made: list[DdpRun] = []

    def make(name: str) -> DdpRun:
        made.append(DdpRun(tmp_path / name))
        return made[-1]

    yield make
    for r in made:
        r.kill_all()


def finish(
    *procs: subprocess.Popen, watch: Callable[[], None] = lambda: None, deadline_s: float = DEADLINE_S
) -> list[str]:
    """Each process's output once all have ended; fails as soon as one fails, `watch()` fails (checked throughout), or
    when they have not all ended by the deadline (a deadlock: the fixture then kills them)."""
    deadline = time.monotonic() + deadline_s
    while any(p.poll() is None for p in procs):
        watch()
        for p in procs:
            if p.poll() not in (None, 0):
                raise AssertionError(f"{p.args!r} failed (exit {p.returncode}):\n{p.communicate()[0]}")
        if time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    kill_9(p)
            raise AssertionError(
                f"stuck: not ended after {deadline_s} s:\n" + "\n".join(p.communicate()[0] for p in procs)
            )
        time.sleep(0.05)
    outs = [p.communicate()[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out
    return outs


def assert_no_shard_adopted_twice(root: Path) -> None:
    """order.log has one writer, rank 0: no shard appears in it twice (a follower adopting on its own would append
    the shards rank 0 took already). Checked throughout a run, as it is read by capture during it."""
    adopted = [(lane, name) for lane, name, _key in read_order(root)]
    assert len(adopted) == len(set(adopted)), f"a shard adopted twice in {root / 'order.log'}: {adopted}"


def assert_one_adoption_per_shard(root: Path) -> None:
    """order.log, written by rank 0 alone: every planned shard adopted exactly once."""
    planned = [s["name"] for s in json.loads((root / LANES / "a" / "plan.json").read_text())["shards"]]
    adopted = [name for _lane, name, _key in read_order(root)]
    assert sorted(adopted) == sorted(planned), (len(adopted), len(planned))


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_two_ranks_train_every_token_passes_times_as_one_process_does_through_a_spool_of_a_tenth_of_the_data(runs):
    one = runs("one")
    make_spool(one.root)
    finish(one.produce(slow=0.0), one.train(slow=0.0))
    reference = one.trained_steps()

    two = runs("two")
    settings, data = make_spool(two.root)
    sampler = Sampler(two.root)
    _, out = finish(
        two.produce(slow=0.01), two.train_ddp(slow=0.0), watch=lambda: assert_no_shard_adopted_twice(two.root)
    )
    sampler.stop()
    assert "x 2 processes" in out
    assert settings.budget_bytes * 10 <= data
    assert 0 < sampler.peak <= settings.budget_bytes, (sampler.peak, settings.budget_bytes)
    (p,) = stats(two.tmp / "produce.jsonl")
    assert p["waits"] > 0, "capture never paused for a full spool: the budget was not exercised"

    steps = two.ddp_steps()
    assert_every_token_trained_passes_times(steps)
    assert steps == reference  # each step's windows, split over the ranks, are the one-process step's
    # both ranks trained in most steps (a slot's last step may hold one window: the other rank joins at weight 0)
    assert sum(len(windows) >= RANKS for windows in steps) > len(steps) // 2, [len(w) for w in steps]
    assert_one_adoption_per_shard(two.root)
    assert_spool_emptied(two.root)
    ranks = {s["rank"]: s for s in stats(two.tmp / "ddp.jsonl")}
    assert sorted(ranks) == list(range(RANKS)) and all(s["finite"] and s["world_size"] == RANKS for s in ranks.values())
    # each rank reads the chunks its share's rows lie in, each once at most (rank 0 too: it plans from the manifest);
    # together they read every row (at most a small shard's header chunk unread: test_spool.assert_rows_read_once)
    assert all(0 < s["bytes_read"] <= data for s in ranks.values()), ranks
    assert sum(s["bytes_read"] for s in ranks.values()) >= data - len(read_order(two.root)) * ALIGN
    assert all(s["steps"] == len(steps) for s in ranks.values())

    a, b = one.final_state(), two.final_state()
    assert b["global_step"] == a["global_step"] == len(steps)
    assert b["data"] == a["data"]  # the same spool position and step count in the checkpoint
    assert Position.from_json(b["data"]["spool_position"]) == Position.from_json(read_ledger(two.root)["position"])
    # The same windows per step, gradients averaged by DDP: equal up to float summation order.
    ha, hb = a["history"], b["history"]
    torch.testing.assert_close(torch.tensor(hb["step_loss"]), torch.tensor(ha["step_loss"]), rtol=1e-4, atol=1e-5)
    # the gradient's norm before clipping: a rank scaling its share wrongly shows here, not in AdamW's weights
    torch.testing.assert_close(torch.tensor(hb["grad_norm"]), torch.tensor(ha["grad_norm"]), rtol=1e-4, atol=0)
    for k in a["model"]:
        torch.testing.assert_close(b["model"][k], a["model"][k], rtol=1e-4, atol=1e-6, msg=k)

    # Run again on the finished spool and checkpoint (what a run killed after its last checkpoint leaves): every
    # rank resumes at the last step and trains nothing; rank 0's reader, opened at that position, is at its end.
    finish(two.train_ddp(slow=0.0))
    again = {s["rank"]: s for s in stats(two.tmp / "ddp.jsonl")[RANKS:]}
    assert sorted(again) == list(range(RANKS)) and again[0]["trained_out"], again
    assert all(s["resumed_from_step"] == s["steps"] == len(steps) and s["bytes_read"] == 0 for s in again.values())
    assert two.ddp_steps() == steps


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_kill_9_of_the_two_rank_trainer_resumes_without_losing_or_repeating_a_trained_window(runs):
    whole = runs("whole")
    make_spool(whole.root)
    finish(whole.produce(slow=0.01), whole.train_ddp(slow=0.0))

    killed = runs("killed")
    settings, _ = make_spool(killed.root)
    slots = len(json.loads((whole.root / LANES / "a" / "plan.json").read_text())["shards"]) + PASSES - 1
    rng = random.Random(2028)
    sampler = Sampler(killed.root)
    capture, trainer = killed.produce(slow=0.01), killed.train_ddp(slow=0.01)
    resumed_at = []
    for lo, hi in ((3, slots // 3), (slots // 2, 2 * slots // 3)):  # two kills at random moments of the run
        wait_for_slot(killed.root, rng.randint(lo, hi), capture, trainer)
        time.sleep(rng.uniform(0.0, 0.3))
        assert trainer.poll() is None, "training had finished before its kill"
        kill_9(trainer)
        resumed_at.append(torch.load(killed.tmp / "ckpt" / CHECKPOINT_FILE, weights_only=False)["global_step"])
        trainer = killed.train_ddp(slow=0.01)
    _, out = finish(capture, trainer, watch=lambda: assert_no_shard_adopted_twice(killed.root))
    sampler.stop()
    assert f"resumed from the checkpoint at step {resumed_at[-1]}/" in out
    assert sampler.peak <= settings.budget_bytes, (sampler.peak, settings.budget_bytes)

    reference, steps = whole.ddp_steps(), killed.ddp_steps()
    assert steps == reference  # the same windows in the same steps on the same ranks: none lost, none trained twice
    assert_every_token_trained_passes_times(steps)
    assert_one_adoption_per_shard(killed.root)
    assert_spool_emptied(killed.root)
    a, b = whole.final_state(), killed.final_state()
    assert b["global_step"] == a["global_step"] == len(reference)
    for k in a["model"]:  # one thread per rank, fp32, a two-term all-reduce: bit-equal
        torch.testing.assert_close(b["model"][k], a["model"][k], rtol=0, atol=0, msg=k)
    assert b["history"]["step_loss"] == a["history"]["step_loss"]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_watch_stops_or_fails_every_rank_while_rank_0_waits_for_capture(runs):
    """`stop()` is asked while rank 0 waits: "stop" ends the run on every rank (its steps so far checkpointed), an
    error of the watch (capture gone) fails every rank with rank 0's reason, none left waiting in a collective."""
    run = runs("stop")
    make_spool(run.root)
    flag = run.tmp / "watch"
    capture, trainer = run.produce(slow=0.05), run.train_ddp(slow=0.0, stop_file=flag)
    wait_for_slot(run.root, 3, capture, trainer)
    os.killpg(capture.pid, signal.SIGKILL)  # capture dies: rank 0 soon waits for a shard that never comes
    capture.wait()
    flag.write_text("stop")
    finish(trainer, deadline_s=300)
    steps = run.ddp_steps()
    ranks = {s["rank"]: s for s in stats(run.tmp / "ddp.jsonl")}
    assert sorted(ranks) == [0, 1] and all(s["steps"] == len(steps) for s in ranks.values())
    assert all(s["waited_s"] > 0 for s in ranks.values())  # rank 1 waited for rank 0's word, rank 0 for capture
    planned = len(json.loads((run.root / LANES / "a" / "plan.json").read_text())["shards"])
    assert 0 < len(steps) and Position.from_json(read_ledger(run.root)["position"]).slot < planned + PASSES - 1
    assert run.final_state()["global_step"] == len(steps)

    failing = runs("fail")
    make_spool(failing.root)
    flag = failing.tmp / "watch"
    flag.write_text("fail")
    capture, trainer = failing.produce(slow=0.05), failing.train_ddp(slow=0.0, stop_file=flag)
    deadline = time.monotonic() + 300
    while trainer.poll() is None:
        assert time.monotonic() < deadline, "a rank still waits: the watch's error did not reach every rank"
        time.sleep(0.05)
    out = trainer.communicate()[0]
    assert trainer.returncode != 0
    assert "[rank0]: RuntimeError: the capture side is gone (the test's watch)" in out, out
    follower = out.split("[rank1]: eagle3_resources.errors.SpoolStateError: rank 0 of the trainer failed reading")
    assert len(follower) > 1 and "RuntimeError: the capture side is gone" in follower[1].split("\n")[0], out
