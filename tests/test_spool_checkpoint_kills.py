"""kill -9 of the streaming trainer INSIDE its checkpoint write, at each step of it, on purpose (issue 40).

The kill tests of tests/test_spool_training.py pick random moments, which almost never fall inside a checkpoint's
write: moving the spool commit (which deletes the finished shards) before the checkpoint holding its position is
durable passed them. Here the trainer (tests/spool_training_worker.py: the real `Trainer` over `SpoolWindows`; capture
is tests/spool_worker.py's producer, another process, through a spool that holds the least it can run with) kills
itself at a named step of the write (`EAGLE3_KILL_AT`, eagle3_resources/kill_points.py), the Nth time it gets there;
each point of `KILL_POINTS` is one test:

    checkpoint.tmp_written -> checkpoint.renamed -> checkpoint.durable        (Trainer.save_checkpoint's file)
    -> spool.position_committed -> spool.shard_deleted (each) -> spool.deletions_recorded     (SpoolReader.commit)

Then it is restarted without the hook, and the run must end as the uninterrupted one does: the same windows in the
same steps, every token trained exactly `passes` times, bit-equal weights (one torch thread, fp32), the spool
emptied. What the kill left is checked from outside as well: the spool's recorded position is never ahead of the
durable checkpoint's, and no shard the checkpoint's position still needs is gone from disk.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import spool_worker as producer
import torch
from test_spool_training import PASSES, Run, assert_spool_emptied, finish

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
from eagle3_resources.kill_points import ENV, KILL_POINTS, kill_point

SAMPLES = 30  # ~25 shards, ~40 steps: a run of a few seconds
NTH = 4  # the 4th checkpoint (4th deletion): a few shards already finished and deleted, most of the run still ahead
pytestmark = pytest.mark.timeout(600)


class SmallRun(Run):
    """tests/test_spool_training.py's run (a producer and the real trainer as processes) on SAMPLES samples."""

    def produce(self, slow: float) -> subprocess.Popen:
        stats = self.tmp / "produce.jsonl"
        args = ["produce", str(self.root), "a", "--samples", str(SAMPLES), "--slow", str(slow), "--stats", str(stats)]
        return self._start("spool_worker.py", *args)


def make_spool(root: Path) -> None:
    """One lane whose share is the least it can run with (`passes` + 1 of its largest shards): capture waits for
    the trainer's deletions throughout."""
    samples = producer.dataset(SAMPLES)
    plans = plan_shards(samples, producer.HIDDEN, producer.SHARD_BYTES, {"target": "synthetic"})
    sizes = [shard_layout(p, [samples[j] for j in p.samples], producer.HIDDEN).size for p in plans]
    share = min_lane_bytes(PASSES, max(sizes))
    assert share * 4 < sum(sizes), (share, sum(sizes))
    create_spool(
        root,
        SpoolSettings({"a": share}, passes=PASSES, max_len=64, batch_tokens=256, seed=5, hidden_size=producer.HIDDEN),
    )


def assert_every_token_trained_passes_times(steps: list[list[list]]) -> None:
    counts = {s.sample_id: [0] * len(s.input_ids) for s in producer.dataset(SAMPLES)}
    for windows in steps:
        for sid, start, end, _pass, _shard in windows:
            for t in range(start, end):
                counts[sid][t] += 1
    wrong = {sid: row for sid, row in counts.items() if set(row) != {PASSES}}
    assert not wrong, f"{len(wrong)} sample(s) not trained exactly {PASSES} times: {list(wrong.items())[:2]}"


@pytest.fixture(autouse=True)
def one_torch_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights compared bit for bit: every trainer process on one torch thread (docs/testing.md, "Torch threads")."""
    monkeypatch.setenv("EAGLE3_TORCH_THREADS", "1")
    monkeypatch.delenv(ENV, raising=False)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """The run no kill touched, once for every kill point."""
    run = SmallRun(tmp_path_factory.mktemp("uninterrupted"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EAGLE3_TORCH_THREADS", "1")
        mp.delenv(ENV, raising=False)
        make_spool(run.root)
        try:
            finish(run.produce(slow=0.0), run.train(slow=0.0))
            yield run
        finally:
            run.kill_all()


def wait_killed(trainer, capture, point: str, deadline_s: float = 300) -> None:
    """Until the trainer has died of its own SIGKILL at `point` (not ended, not failed otherwise)."""
    deadline = time.monotonic() + deadline_s
    while trainer.poll() is None:
        assert capture.poll() in (None, 0), f"capture failed:\n{capture.communicate()[0]}"
        assert time.monotonic() < deadline, f"the trainer never reached {point}@{NTH}"
        time.sleep(0.01)
    out = trainer.communicate()[0]
    assert trainer.returncode == -signal.SIGKILL, (
        f"the trainer ended (exit {trainer.returncode}) before {point}:\n{out}"
    )


def spool_ahead_of_the_checkpoint(run: Run, point: str) -> list[str]:
    """What the kill left, read from outside, wrong: the spool's recorded position ahead of the durable checkpoint's
    (where a resume starts), or an adopted shard gone from disk that the checkpoint's position still needs."""
    ckpt = run.tmp / "ckpt" / CHECKPOINT_FILE
    state = torch.load(ckpt, weights_only=False) if ckpt.exists() else None
    at = Position.from_json(state["data"]["spool_position"]) if state is not None else Position()
    recorded = Position.from_json(read_ledger(run.root)["position"])
    wrong = []
    if recorded > at:
        wrong.append(f"killed at {point}: the spool records {recorded}, the durable checkpoint is at {at}")
    order = read_order(run.root)
    gone = [k for k, (lane, name, _) in enumerate(order) if not (run.root / LANES / lane / name).exists()]
    if early := [k for k in gone if k + PASSES > at.slot]:  # shard k's last pass is slot k + passes - 1
        wrong.append(f"killed at {point}: shards {early} deleted, still needed from the checkpoint's {at}")
    return wrong


@pytest.mark.slow
@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_a_trainer_killed_at_each_step_of_its_checkpoint_write_resumes_to_the_uninterrupted_result(
    point: str, uninterrupted: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    run = SmallRun(tmp_path / "killed")
    try:
        make_spool(run.root)
        capture = run.produce(slow=0.0)
        monkeypatch.setenv(ENV, f"{point}@{NTH}")
        trainer = run.train(slow=0.0)
        monkeypatch.delenv(ENV)
        wait_killed(trainer, capture, point)
        if point == "checkpoint.tmp_written":
            assert (run.tmp / "ckpt" / (CHECKPOINT_FILE + ".tmp")).exists()
        assert Position.from_json(read_ledger(run.root)["position"]) > Position(), "killed before any commit"
        wrong_at_kill = spool_ahead_of_the_checkpoint(run, point)

        _, out = finish(capture, run.train(slow=0.0))  # resumed, no hook
        resumed_at = json.loads((run.tmp / "t.jsonl").read_text().splitlines()[-1])["resumed_from_step"]
        assert resumed_at is not None and f"resumed from the checkpoint at step {resumed_at}/" in out, out
        steps = run.trained_steps()
        assert steps == uninterrupted.trained_steps()  # none lost, none trained twice
        assert_every_token_trained_passes_times(steps)
        assert_spool_emptied(run.root)
        a, b = uninterrupted.final_state(), run.final_state()
        assert b["global_step"] == a["global_step"] == len(steps)
        for k in a["model"]:  # one thread, fp32: bit-equal
            torch.testing.assert_close(b["model"][k], a["model"][k], rtol=0, atol=0, msg=k)
        assert b["history"]["step_loss"] == a["history"]["step_loss"]
        assert not wrong_at_kill
    finally:
        run.kill_all()


def test_a_kill_point_not_named_is_passed_and_a_name_that_is_no_point_is_refused(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(ENV, "checkpoint.renamed@2")
    kill_point("checkpoint.tmp_written")  # another point: passed
    monkeypatch.setenv(ENV, "checkpoint.renamd")
    with pytest.raises(ValueError, match="no such kill point"):
        kill_point("checkpoint.tmp_written")
