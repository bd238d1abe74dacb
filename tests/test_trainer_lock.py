"""One trainer per spool (eagle3_resources/hidden_states/lane_lock.py): the training side's main rank holds
`<spool>/trainer.lock` (POSIX `lockf`) for its life. Two real training sides of a streaming run on one spool
(`python -m eagle3_assets.stages.eagle3_drafter.streaming_train SPEC`, started by `LocalSides` as the step starts
them): the second waits, naming the first's host and pid; once the first is gone (kill -9: the kernel drops a dead
process's locks; or stopped with SIGTERM, as the step stops a side) the second takes the lock and gets on with its
work. The first is held past the lock by the eval
split's states, which no capture side writes here: it waits for them, lock in hand, until it is killed."""

from __future__ import annotations

import json
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_streaming_drafter import write_merged
from test_streaming_resume import alive, holder_pid, stand_in_run, wait_until

from eagle3_assets.stages.eagle3_drafter.streaming import RunFiles, side_specs
from eagle3_assets.stages.eagle3_drafter.streaming_sides import Heartbeat, LocalSide, LocalSides
from eagle3_resources.hidden_states.lane_lock import trainer_lock_path

pytestmark = pytest.mark.timeout(600)  # a bound against a hang, not a measured time
WAITING_FOR_THE_LOCK = "the streaming trainer: waiting for"  # lane_lock.exclusive's line, `what` first
PAST_THE_LOCK = "training side: waiting for the eval split's states"  # the side's first word after the lock


@pytest.fixture
def sides() -> Iterator[list[LocalSide]]:
    """The training sides the test starts; each group killed at the end, whatever happened."""
    started: list[LocalSide] = []
    yield started
    for side in started:
        try:
            os.killpg(side.pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        side.proc.wait()


def training_spec(root: Path) -> tuple[RunFiles, dict]:
    """A streaming run's folder and spool as the step makes them, and its training side's spec."""
    job, files = stand_in_run(root)
    _, spec = side_specs(job, files, "trainer-lock-test", "eval")
    return files, spec


def start_trainer(files: RunFiles, spec: dict, name: str, sides: list[LocalSide]) -> LocalSide:
    """A training side on the run's spool, with files of its own beside it (its log, progress, record, checkpoints)."""
    own = files.folder / name
    own.mkdir()
    mine = {key: str(own / Path(spec[key]).name) for key in ("progress", "record", "report", "checkpoints")}
    (own / "spec.json").write_text(json.dumps(spec | mine))
    side = LocalSides().start_training(own / "spec.json", own / "training.log", nodes=1, processes_per_node=1)
    assert isinstance(side, LocalSide)
    sides.append(side)
    return side


def kill_9(side: LocalSide) -> None:
    os.killpg(side.pgid, signal.SIGKILL)  # no handler runs: only the kernel releases its lock


def stop(side: LocalSide) -> None:
    side.stop()  # SIGTERM, as the step stops a side: it leaves through its handler (SystemExit)


@pytest.mark.slow
@pytest.mark.parametrize("end", [kill_9, stop], ids=["kill -9", "SIGTERM"])
def test_a_second_trainer_on_a_spool_waits_naming_the_first_and_proceeds_once_the_first_is_gone(
    data_dir_with_standin, tok, sides, end
):
    root = data_dir_with_standin
    write_merged(root, tok)
    files, spec = training_spec(root)
    lock = trainer_lock_path(files.spool)
    heartbeat = Heartbeat(files.folder, spec["run_id"])  # the orchestrator's: without it the sides leave as orphans
    try:
        first = start_trainer(files, spec, "first", sides)
        first_log = files.folder / "first" / "training.log"
        wait_until("the first trainer past the lock", lambda: PAST_THE_LOCK in first_log.read_text(), 300)
        assert holder_pid(lock) == first.pgid

        second = start_trainer(files, spec, "second", sides)
        log = files.folder / "second" / "training.log"
        wait_until(
            "the second trainer to wait for the lock, pass it or end",
            lambda: (
                any(line in log.read_text() for line in (WAITING_FOR_THE_LOCK, PAST_THE_LOCK))
                or second.poll() is not None
            ),
            300,
        )
        text = log.read_text()
        assert WAITING_FOR_THE_LOCK in text and PAST_THE_LOCK not in text, text[-3000:]
        # it names the holder as the holder wrote itself into the lock file: this host, the first trainer's pid
        assert f'"host": "{socket.gethostname()}"' in text and f'"pid": {first.pgid}' in text, text[-3000:]
        assert second.poll() is None and alive(first.pgid) and holder_pid(lock) == first.pgid

        end(first)
        first.proc.wait()
        wait_until("the second trainer past the lock", lambda: PAST_THE_LOCK in log.read_text(), 300)
        assert holder_pid(lock) == second.pgid and second.poll() is None
    finally:
        heartbeat.close()
