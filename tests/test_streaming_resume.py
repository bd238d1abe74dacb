"""Streaming mode's sides when their orchestrator dies or a side fails (issue 27), on the CPU stand-ins with real
processes: the step killed with kill -9 at a random moment of training leaves no side running (each leaves by
itself once the heartbeat stops) and a re-run finishes, every token trained exactly `passes` times across both runs
and the spool within its budget throughout; a capture side killed stops the training side and fails the step, and a
re-run resumes; a second capture on a lane that another holds waits for it and writes nothing."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import polars as pl
import pytest
import torch
from support import alive
from test_spool import Sampler
from test_streaming_drafter import PASSES, SHARD_BYTES, materialize, run_config, streaming_folder, write_merged

from eagle3_assets.stages.eagle3_drafter.streaming import LANE, RunFiles, StreamingJob, StreamingRequest, side_specs
from eagle3_assets.stages.eagle3_drafter.streaming_sides import Heartbeat, LocalSide, LocalSides
from eagle3_assets.stages.eagle3_drafter.streaming_train import coverage, end_line, trained_steps
from eagle3_assets.stages.eagle3_drafter.train import CHECKPOINT_FILE, TrainSettings
from eagle3_assets.stages.hidden_states.selection import target_identity
from eagle3_resources.hidden_states.lane_lock import lane_lock_path, trainer_lock_path
from eagle3_resources.hidden_states.resource import HiddenStatesResource
from eagle3_resources.hidden_states.spool import SpoolSettings, create_spool
from eagle3_resources.storage import DataLayout
from eagle3_resources.target.resource import TargetModelResource
from eagle3_resources.tokenizer.resource import TokenizerResource

REPO = Path(__file__).resolve().parents[1]
ORPHAN_AFTER_S = 3.0  # the heartbeat every 0.75 s
# a generous bound on a test that would otherwise hang (the capture-failure mutation hangs the step)
pytestmark = pytest.mark.timeout(int(os.environ.get("STREAMING_RESUME_TIMEOUT_S", "1800")))


def pending_signals(pid: int) -> set[signal.Signals]:
    """The signals pending on a process (sent to it or to its process group, not yet handled: a stopped process's),
    from /proc/<pid>/status."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    mask = int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)
    return {signal.Signals(n) for n in range(1, 32) if mask >> (n - 1) & 1}


def holder_pid(path: Path) -> int | None:
    try:
        return int(json.loads(path.read_text())["pid"])
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return None


def wait_until(what: str, ready: Callable[[], bool], limit_s: float = 600, poll_s: float = 0.05) -> None:
    """Poll until `ready()`; a bound against a hang (a failure if reached), not a measured time."""
    deadline = time.monotonic() + limit_s
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {limit_s} s for {what}")
        time.sleep(poll_s)


def lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except FileNotFoundError:
        return []


@pytest.fixture
def groups() -> Iterator[list[int]]:
    """Process groups the test started or saw started; each is killed at the end, whatever happened."""
    started: list[int] = []
    yield started
    for group in started:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def trained_steps_planned(files: RunFiles) -> int:
    """The training side's estimated step count, from its first progress line."""
    wait_until("the training side's first progress line", lambda: bool(lines(files.training_progress)), 900)
    return int(json.loads(lines(files.training_progress)[0])["estimated_steps"])


def side_pids(files: RunFiles) -> tuple[int, int]:
    capture, training = lane_lock_path(files.spool, LANE), trainer_lock_path(files.spool)
    wait_until("both sides' locks", lambda: holder_pid(capture) is not None and holder_pid(training) is not None)
    return holder_pid(capture) or 0, holder_pid(training) or 0


def start_step(
    root: Path, config: Path, files: RunFiles, tmp_path: Path, groups: list[int]
) -> tuple[subprocess.Popen, int, int]:
    """The materializing step as a process of its own (tests/streaming_materialize.py), and its two sides' pids once
    they hold their locks; all three process groups noted for the fixture's cleanup."""
    with open(tmp_path / "step.log", "wb") as log:
        step = subprocess.Popen(
            [sys.executable, "tests/streaming_materialize.py", str(root), str(config), str(tmp_path / "out.json")],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    groups.append(step.pid)
    capture_pid, training_pid = side_pids(files)
    groups.extend([capture_pid, training_pid])
    return step, capture_pid, training_pid


@pytest.mark.slow
def test_kill_9_of_the_step_leaves_no_side_running_and_a_rerun_trains_every_token_exactly_passes_times(
    data_dir_with_standin, tok, tmp_path, groups
):
    root = data_dir_with_standin
    data_bytes, _ = write_merged(root, tok)
    budget = data_bytes // 10
    files = RunFiles(streaming_folder(root), streaming_folder(root) / "spool")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(run_config(budget, streaming_orphan_after_s=ORPHAN_AFTER_S)))
    sampler = Sampler(files.spool)
    try:
        step, capture_pid, training_pid = start_step(root, config, files, tmp_path, groups)
        # kill -9 of the step at a random moment of training, past its first checkpoint (checkpoint_every: 3)
        planned = trained_steps_planned(files)
        at = random.randint(4, max(4, planned // 4))
        wait_until(f"{at} trained steps", lambda: len(lines(files.training_record)) >= at, 900)
        # The training side is paused (SIGSTOP) across the kill until it is an orphan by its own clock, so its watch
        # sees that at once when it goes on: a side whose steps are fast could otherwise train to its end and report
        # within orphan_after_s (a side that dies after its last checkpoint: the test below).
        os.kill(training_pid, signal.SIGSTOP)
        os.kill(step.pid, signal.SIGKILL)
        running = {
            log: alive(pid) for log, pid in ((files.capture_log, capture_pid), (files.training_log, training_pid))
        }
        step.wait()
        time.sleep(ORPHAN_AFTER_S + 1.0)
        os.kill(training_pid, signal.SIGCONT)
        print(f"killed the step at step {len(lines(files.training_record))} of ~{planned}; running then: {running}")

        # the orphaned training side leaves by itself, saying why, long before its work is done; the capture side
        # (ahead of it by up to a spool's worth) leaves so too, or has finished its work in the meantime
        wait_until("the orphaned sides to leave", lambda: not alive(capture_pid) and not alive(training_pid), 300)
        orphaned = "orphaned: the orchestrator's heartbeat"
        assert running[files.training_log] and orphaned in files.training_log.read_text()
        assert not any('"done": true' in line for line in lines(files.training_progress))
        capture_log = files.capture_log.read_text()
        print("the capture side " + ("was orphaned" if orphaned in capture_log else "had finished"))
        assert orphaned in capture_log or (not running[files.capture_log] or "capture side: done" in capture_log)
        assert (files.checkpoints / CHECKPOINT_FILE).exists()

        result, _ = materialize(root, budget, streaming_orphan_after_s=ORPHAN_AFTER_S)
    finally:
        sampler.stop()
    assert result.success, result.all_events[-5:]
    meta = {k: v.value for k, v in result.asset_materializations_for_node("eagle3_drafter")[0].metadata.items()}
    train_tokens = meta["train_tokens"]
    # the re-run resumed the trainer from its checkpoint, and every token was trained exactly PASSES times across
    # the two runs (the trainer's record: what the exported weights were trained on)
    assert meta["resumed_from_step"] >= 3
    assert meta["streaming_trained_token_passes"] == {str(PASSES): train_tokens}
    assert meta["streaming_train_tokens"] == PASSES * train_tokens
    # the drafter exported; the spool within its budget through both runs (sampled from here)
    assert meta["sglang_key_check"] == "ok" and (Path(meta["path"]) / "config.json").exists()
    assert sampler.samples > 100 and 0 < sampler.peak <= budget
    assert not files.folder.exists()


@pytest.mark.slow
def test_a_stopped_step_stops_both_sides_keeps_the_folder_and_a_rerun_resumes(
    data_dir_with_standin, tok, tmp_path, groups
):
    """A stop of the step (Ctrl-C: Dagster's interrupt in the step) stops both sides through the launcher, then the
    step ends; the run's folder stays and the next materialization resumes and finishes it."""
    root = data_dir_with_standin
    data_bytes, _ = write_merged(root, tok)
    budget = data_bytes // 10
    folder = streaming_folder(root)
    files = RunFiles(folder, folder / "spool")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(run_config(budget)))  # orphan_after_s: the default 60 s, far off
    step, capture_pid, training_pid = start_step(root, config, files, tmp_path, groups)
    at = random.randint(2, max(2, trained_steps_planned(files) // 4))
    wait_until(f"{at} trained steps", lambda: len(lines(files.training_record)) >= at, 900)
    # The training side is paused (SIGSTOP) until the step's stop (SIGTERM) is pending on it, so it cannot train
    # to its end (its steps are fast) between the interrupt and the stop: it goes on with the stop at hand.
    os.kill(training_pid, signal.SIGSTOP)
    os.kill(step.pid, signal.SIGINT)
    wait_until("the step's SIGTERM to the training side", lambda: signal.SIGTERM in pending_signals(training_pid), 60)
    os.kill(training_pid, signal.SIGCONT)
    assert step.wait(600) != 0
    # the step stopped both sides before it ended: they left through their SIGTERM handler, not as orphans
    assert not alive(capture_pid) and not alive(training_pid)
    for log_path in (files.capture_log, files.training_log):
        text = log_path.read_text()
        assert "stopped (SIGTERM)" in text or "capture side: done" in text, text[-2000:]
    assert "stopped (SIGTERM)" in files.training_log.read_text()
    assert files.folder.exists() and not json.loads((tmp_path / "out.json").read_text())["success"]

    result, _ = materialize(root, budget)
    assert result.success, result.all_events[-5:]
    meta = {k: v.value for k, v in result.asset_materializations_for_node("eagle3_drafter")[0].metadata.items()}
    assert meta["streaming_trained_token_passes"] == {str(PASSES): meta["train_tokens"]}


@pytest.mark.slow
def test_a_capture_side_killed_stops_the_training_side_and_a_rerun_resumes(data_dir_with_standin, tok, groups):
    root = data_dir_with_standin
    data_bytes, _ = write_merged(root, tok)
    budget = data_bytes // 10
    files = RunFiles(streaming_folder(root), streaming_folder(root) / "spool")
    seen: dict[str, int] = {}

    def kill_capture() -> None:
        capture_pid, training_pid = side_pids(files)
        groups.extend([capture_pid, training_pid])
        seen.update(capture=capture_pid, training=training_pid)
        at = random.randint(2, max(2, trained_steps_planned(files) // 3))
        wait_until(f"{at} trained steps", lambda: len(lines(files.training_record)) >= at, 900)
        seen["capture_alive"] = alive(capture_pid)
        os.killpg(capture_pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_capture, daemon=True)
    killer.start()
    result, _ = materialize(root, budget)
    killer.join()
    assert seen["capture_alive"]  # killed while it still had shards to capture
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert failure.step_failure_data.error.cause.cls_name == "CaptureFailed"
    # the orchestrator stopped the training side (SIGTERM: it left through its handler) before failing the step
    assert not alive(seen["training"])
    assert "stopped (SIGTERM)" in files.training_log.read_text()

    sampler = Sampler(files.spool)
    try:
        result, _ = materialize(root, budget)
    finally:
        sampler.stop()
    assert result.success, result.all_events[-5:]
    meta = {k: v.value for k, v in result.asset_materializations_for_node("eagle3_drafter")[0].metadata.items()}
    assert meta["streaming_trained_token_passes"] == {str(PASSES): meta["train_tokens"]}
    assert 0 < sampler.peak <= budget


def stand_in_run(root: Path) -> tuple[StreamingJob, RunFiles]:
    """A streaming run on the stand-in as the step makes it (the job, its folder and its spool), sides not started."""
    standin = str(root / "standin")
    target, tokenizer = TargetModelResource(standin_dir=standin), TokenizerResource(standin_dir=standin)
    folder = target.folder(tokenizer, print)
    job = StreamingJob(
        merged=pl.read_parquet(DataLayout(root).merged_dataset()),
        merged_path=DataLayout(root).merged_dataset(),
        target_folder=folder,
        out_dir=DataLayout(root).drafter(),
        settings=TrainSettings(ttt_steps=3, batch_tokens=200, max_len=64, checkpoint_every=3, epochs=1),
        requested_draft_vocab=512,
        request=StreamingRequest(3 * SHARD_BYTES * 4, PASSES, SHARD_BYTES, 2000.0, 500.0, 5e8, {}),
        identity=target_identity(folder),
        resources={
            "target": target.model_dump(mode="json"),
            "tokenizer": tokenizer.model_dump(mode="json"),
            "hidden_states_backend": HiddenStatesResource(batch_tokens=512).model_dump(mode="json"),
        },
        log=print,
    )
    files = RunFiles(job.folder, job.spool)
    files.folder.mkdir(parents=True)
    create_spool(files.spool, SpoolSettings({LANE: job.request.spool_bytes}, PASSES, 64, 200, 0, 64))
    return job, files


@pytest.mark.slow
def test_a_second_capture_on_a_held_lane_waits_and_writes_nothing(data_dir_with_standin, tok, groups):
    root = data_dir_with_standin
    write_merged(root, tok)
    job, files = stand_in_run(root)
    heartbeat = Heartbeat(files.folder, "lock-test")
    try:
        spec, _ = side_specs(job, files, "lock-test", "eval")
        first, second = files.folder / "first", files.folder / "second"
        for path in (first, second):
            path.mkdir()
            mine = spec | {"progress": str(path / "progress.jsonl"), "eval_done": str(path / "eval-done")}
            (path / "spec.json").write_text(json.dumps(mine | {"eval_root": str(path / "eval_states")}))
        a = LocalSides().start_capture(first / "spec.json", first / "capture.log")
        assert isinstance(a, LocalSide)  # a process group here
        groups.append(a.pgid)
        wait_until("the first capture's shards", lambda: bool(lines(first / "progress.jsonl")), 600)
        assert holder_pid(lane_lock_path(files.spool, LANE)) == a.pgid

        b = LocalSides().start_capture(second / "spec.json", second / "capture.log")
        assert isinstance(b, LocalSide)
        groups.append(b.pgid)
        log = second / "capture.log"
        wait_until(
            "the second capture to wait, write or end",
            lambda: "waiting for" in log.read_text() or (second / "progress.jsonl").exists() or b.poll() is not None,
            600,
        )
        assert "waiting for" in log.read_text(), log.read_text()[-3000:]
        # the first writes on (or waits for room); the second waits, naming the holder, and has written nothing
        written = len(lines(first / "progress.jsonl"))
        wait_until("the first capture's next figures", lambda: len(lines(first / "progress.jsonl")) > written, 600)
        assert b.poll() is None and f'"pid": {a.pgid}' in (second / "capture.log").read_text()
        assert not (second / "progress.jsonl").exists() and not (second / "eval_states").exists()

        a.stop()  # the holder gone, the second takes the lane and captures
        wait_until("the second capture's figures", lambda: bool(lines(second / "progress.jsonl")), 600)
        b.stop()
    finally:
        heartbeat.close()


def test_the_trainers_record_survives_a_line_cut_by_a_kill(tmp_path):
    """A kill can cut the record's last line; the resumed run's lines start lines of their own, each step's last
    line counts, and the steps past the last trained one are left out."""
    record = tmp_path / "training-record.jsonl"
    record.write_text('{"step": 1, "windows": [["a", 0, 5]]}\n{"step": 2, "windows": [["a", 5, 8]]}\n{"step": 3, "wi')
    end_line(record)  # as the resumed training side does before it appends (its checkpoint was at step 1)
    with open(record, "a") as f:
        f.write('{"step": 2, "windows": [["a", 5, 8], ["b", 0, 2]]}\n{"step": 3, "windows": [["a", 0, 5]]}\n')
    steps = trained_steps(record, last_step=2)
    assert steps == {1: [("a", 0, 5)], 2: [("a", 5, 8), ("b", 0, 2)]}
    assert coverage(steps, {"a": 8, "b": 3}) == {0: 1, 1: 10}


PROCESS_HOOKS = REPO / "tests" / "process_hooks"  # its sitecustomize: the first side that trains is killed


@pytest.mark.slow
def test_a_training_side_dead_after_its_last_checkpoint_is_resumed_to_its_report(
    data_dir_with_standin, tok, tmp_path, monkeypatch
):
    """The training side trains every step, writes its last checkpoint and dies before its report (as an orphan that
    finishes its steps while it notices its orchestrator is gone): the next run resumes from a checkpoint with no
    step left to train, and must still score, export and report, not stop at "no step trained"."""
    root = data_dir_with_standin
    data_bytes, _ = write_merged(root, tok)
    budget = data_bytes // 10
    files = RunFiles(streaming_folder(root), streaming_folder(root) / "spool")
    marker = tmp_path / "a training side died"
    monkeypatch.setenv("PYTHONPATH", f"{PROCESS_HOOKS}:{REPO}")
    monkeypatch.setenv("EAGLE3_TEST_DIE_AFTER_TRAINING", str(marker))

    result, _ = materialize(root, budget)
    assert marker.exists() and not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert "exited with -9" in str(failure.step_failure_data.error.cause), failure.step_failure_data.error.cause
    planned = trained_steps(files.training_record, 10**9)
    last = torch.load(files.checkpoints / CHECKPOINT_FILE, map_location="cpu", weights_only=False)["global_step"]
    assert last == max(planned) and not files.training_report.exists()

    result, _ = materialize(root, budget)
    assert result.success, result.all_events[-5:]
    meta = {k: v.value for k, v in result.asset_materializations_for_node("eagle3_drafter")[0].metadata.items()}
    assert meta["resumed_from_step"] == last and meta["streaming_train_steps"] == last
    assert meta["streaming_trained_token_passes"] == {str(PASSES): meta["train_tokens"]}
    assert meta["sglang_key_check"] == "ok" and (Path(meta["path"]) / "config.json").exists()
    assert not files.folder.exists()
