"""What each training rank reads from the spool, from its own record (`SpoolWindows.reads`, issues 40 and 42).

Two gloo ranks under torchrun (tests/spool_ddp_worker.py: rank 0 reads the spool, rank 1 follows it) train through a
spool that capture (tests/spool_worker.py's producer, another process) fills as they go. Each rank's record of the
shard files it read is checked against the steps it trained (each rank's own record of its windows): every rank, rank
0 too (it plans steps from the manifest and reads only its share's rows, issue 42), reads of each shard the chunks its
share of the steps needs, first at the first step whose share needs it: not a step or a slot earlier, never a shard
its share does not need, never one again. Each read is the file order.log adopted at that index, and the bytes
counted are at most those files'. Before this, a follower reading a shard early or twice was caught only by
`bytes_read <= data`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_spool_checkpoint_kills import SmallRun, make_spool
from test_spool_ddp import RANKS, DdpRun, finish
from test_spool_training import stats

from eagle3_resources.hidden_states.spool import LANES, read_order

pytestmark = pytest.mark.timeout(600)


class SmallDdpRun(SmallRun, DdpRun):
    """tests/test_spool_ddp.py's two-rank run, on tests/test_spool_checkpoint_kills.py's smaller data."""


def positions(steps: list[list[list]]) -> list[tuple[int, int]]:
    """Each step's position (slot, step within the slot): slot i trains pass p of shard i - p."""
    out: list[tuple[int, int]] = []
    for windows in steps:
        slots = {shard + p for _sid, _start, _end, p, shard in windows}
        assert len(slots) == 1, slots
        (slot,) = slots
        out.append((slot, out[-1][1] + 1 if out and out[-1][0] == slot else 0))
    return out


def first_needs(steps: list[list[list]], rank: int) -> list[tuple[int, int, int]]:
    """(slot, step, shard) the first time the rank's share of a step needs the shard, in order: its windows
    `windows[rank::RANKS]`, or the step's first window for a rank left without one (it joins at weight 0)."""
    seen: set[int] = set()
    out = []
    for (slot, step), windows in zip(positions(steps), steps, strict=True):
        share = windows[rank::RANKS] or windows[:1]
        for shard in sorted({w[4] for w in share} - seen):
            seen.add(shard)
            out.append((slot, step, shard))
    return out


@pytest.mark.slow
def test_each_rank_reads_each_shard_once_at_the_first_step_that_needs_it(tmp_path: Path):
    run = SmallDdpRun(tmp_path / "ddp")
    try:
        make_spool(run.root)
        finish(run.produce(slow=0.0), run.train_ddp(slow=0.0))
        steps = run.ddp_steps()
    finally:
        run.kill_all()
    order = read_order(run.root)
    plan = {
        s["name"]: int(s["bytes"]) for s in json.loads((run.root / LANES / "a" / "plan.json").read_text())["shards"]
    }
    assert len(order) == len(plan) > 10
    ranks = {s["rank"]: s for s in stats(run.tmp / "ddp.jsonl")}
    assert sorted(ranks) == list(range(RANKS)) and all(s["steps"] == len(steps) for s in ranks.values())

    for rank, s in ranks.items():
        reads = s["reads"]
        indices = [r["index"] for r in reads]
        twice = sorted({k for k in indices if indices.count(k) > 1})
        assert not twice, f"rank {rank} read shards {twice} more than once: {[r for r in reads if r['index'] in twice]}"
        wrong_file = [r for r in reads if (r["lane"], r["name"]) != order[r["index"]][:2]]
        assert not wrong_file, f"rank {rank} read files that are not the adopted shard at their index: {wrong_file}"
        assert 0 < s["bytes_read"] <= sum(plan[r["name"]] for r in reads), rank  # chunks of those files, once

    # every rank: what its share needs, at the first step that needs it, nothing else
    for rank in range(RANKS):
        got = [(r["slot"], r["step"], r["index"]) for r in ranks[rank]["reads"]]
        want = first_needs(steps, rank)
        wanted_at = {k: (slot, step) for slot, step, k in want}
        off = [f"shard {k} at {(slot, step)}, first needed at {wanted_at.get(k, 'never')}" for slot, step, k in got]
        off = [o for o, g in zip(off, got, strict=True) if g not in want]
        assert got == want, f"rank {rank}: {len(got)} reads, {len(want)} wanted; off: {off[:4]}"
