"""What rank 0 evaluates alone under torchrun (the untrained drafter's scores, each epoch's held-out split) may take
longer than a collective's timeout (NCCL's 10 minutes by default): the other ranks wait for rank 0's word in heartbeat
rounds (`rank_zero.RankZeroWord`), not in the trainer's next collective, and an error of rank 0's ends every rank with
rank 0's reason. Two real gloo ranks (tests/rank_zero_eval_worker.py) with a 4 s collective timeout and evaluations
that take 7 s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import stop_group

HERE = Path(__file__).resolve().parent


def two_ranks(out: Path, *args: str, worker: str = "rank_zero_eval_worker.py") -> subprocess.CompletedProcess[str]:
    """`worker` (in tests/) as two torchrun ranks with a 4 s collective timeout, to its end; its output."""
    env = {**os.environ, "EAGLE3_COLLECTIVE_TIMEOUT_S": "4", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    proc = subprocess.Popen(
        [*cmd, str(HERE / worker), str(out), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        stdout, _ = proc.communicate(timeout=300)
    finally:
        stop_group(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, None)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_other_ranks_wait_out_rank_0s_evaluations_past_the_collective_timeout(tmp_path):
    done = two_ranks(tmp_path / "run", "--eval-s", "7")
    assert done.returncode == 0, done.stdout[-4000:]
    main, other = (json.loads((tmp_path / f"run.rank{r}.json").read_text()) for r in (0, 1))
    assert main["untrained"]["accept_length"] > 0 and other["untrained"] == {}
    assert [e["epoch"] for e in main["epochs"]] == [e["epoch"] for e in other["epochs"]] == [1, 2]
    assert all("accept_length" in e for e in main["epochs"]) and not any("accept_length" in e for e in other["epochs"])
    assert main["steps"] == other["steps"] > 0


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "where, what", [("untrained", "scoring the untrained drafter"), ("epoch", "evaluating epoch 1")]
)
@pytest.mark.slow
def test_an_error_of_rank_0s_evaluation_ends_every_rank_with_its_reason(tmp_path, where, what):
    done = two_ranks(tmp_path / "run", "--fail-at", where)
    assert done.returncode != 0
    reason = f"ValueError: the held-out split is unreadable ({where})"
    assert f"[rank1]: eagle3_resources.errors.DrafterError: rank 0 of the trainer failed {what}: {reason}" in (
        done.stdout
    ), done.stdout[-4000:]
