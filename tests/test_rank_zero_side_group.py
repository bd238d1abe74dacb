"""Rank 0's word where the world is not gloo (NCCL on GPUs): `RankZeroWord` makes a gloo group of its own and every
word travels on it. No GPU here, so the world is torch's `fake` backend, whose collectives move nothing
(tests/rank_zero_side_group_worker.py): rank 1 receives rank 0's result-less "done" past the collective timeout
(4 s; rank 0 works alone 7 s), rank 0's error as its own, and every rank's figures gathered at the end of streaming
training, only if they went over that gloo group. Not here: NCCL itself."""

from __future__ import annotations

import json

import pytest
from test_rank_zero_evaluations import two_ranks

WORKER = "rank_zero_side_group_worker.py"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_world_that_is_not_gloo_hears_rank_0_over_a_gloo_group_of_its_own(tmp_path):
    done = two_ranks(tmp_path / "run", "--alone-s", "7", worker=WORKER)
    assert done.returncode == 0, done.stdout[-4000:]
    main, other = (json.loads((tmp_path / f"run.rank{r}.json").read_text()) for r in (0, 1))
    assert main["result"] == "rank 0's result" and other["result"] is None
    assert main["world_backend"] == other["world_backend"] == "fake"
    assert main["word_backend"] == other["word_backend"] == "gloo"
    # every rank's figures on every rank: the sum of the bytes and the longest wait are the whole side's
    assert main["bytes_read"] == other["bytes_read"] == [1000, 1001]
    assert main["waited_s"] == other["waited_s"] == [0.5, 1.0]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rank_0s_error_reaches_the_other_rank_over_that_group(tmp_path):
    done = two_ranks(tmp_path / "run", "--fail", worker=WORKER)
    assert done.returncode != 0
    assert "[rank1]: eagle3_resources.errors.DrafterError: rank 0 failed: ValueError: rank 0's work failed" in (
        done.stdout
    ), done.stdout[-4000:]
