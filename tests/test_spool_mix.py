"""Data mixed in streaming as offline mixes it (issue 42, item 2), tested on the order itself, in one process:

- the capture's plan (`store.plan_mixed_shards`): every shard holds each dataset's share of its samples, every sample
  is in one shard, and the plan is a function of the samples and the seed (a resumed capture plans the same shards);
- the trainer's schedule (`SpoolReader`, a spool's `mix_shards`): each slot shuffles the windows of a mix of several
  adopted shards together, every token is still trained exactly `passes` times, and a reader reopened at any
  committed position (what a trainer resumed after kill -9 does) hands out exactly the steps an uninterrupted one
  does, its deletions never taking a shard a later step needs;
- plan.json (format 2) records each shard's datasets, and a lane planned by an earlier version is refused by name.

The drafter's quality from such data, against offline: tests/test_streaming_mix_quality.py.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest
import spool_worker as worker
from hypothesis import given, settings
from hypothesis import strategies as st
from test_spool import fill, small_spool

from eagle3_resources.errors import SpoolStateError
from eagle3_resources.hidden_states.spool import LANES, PLAN, PLAN_FORMAT, Position, SpoolReader, Step, read_ledger
from eagle3_resources.hidden_states.store import (
    StoredSample,
    interleave_groups,
    plan_mixed_shards,
    token_bytes,
)

HIDDEN = 32
SIZES = {"A": 50, "B": 30, "C": 20}  # the merged set's datasets, in its order: one after another


def merged_set(seed: int = 0) -> list[StoredSample]:
    """100 samples of three datasets of 10 to 60 tokens, dataset by dataset (as the merged parquet lists them)."""
    rng = random.Random(seed)
    out = []
    for dataset, n in SIZES.items():
        for i in range(n):
            length = rng.randint(10, 60)
            out.append(
                StoredSample(f"{dataset}/{i:03d}", "train", [rng.randrange(1000)] * length, [1] * length, dataset)
            )
    return out


def test_every_shard_holds_each_dataset_in_its_share_of_the_merged_set() -> None:
    samples = merged_set()
    shard_bytes = 300 * token_bytes(HIDDEN)  # ~9 samples a shard
    plans = plan_mixed_shards(samples, HIDDEN, shard_bytes, {"target": "synthetic"}, seed=5)
    order = [i for p in plans for i in p.samples]
    assert sorted(order) == list(range(len(samples)))  # every sample in exactly one shard
    assert all(p.name == f"mixed-{k:05d}.safetensors" for k, p in enumerate(plans)) and len(plans) >= 8
    share = {d: n / len(samples) for d, n in SIZES.items()}
    for p in plans:
        mix = Counter(samples[i].group for i in p.samples)
        for dataset, part in share.items():  # within less than two samples of its share of this shard, never absent
            assert abs(mix[dataset] - part * len(p.samples)) < 2 and mix[dataset] > 0, (p.name, dict(mix))
    # after every sample, each dataset has had its share so far rounded down or up
    seen: Counter[str] = Counter()
    for t, i in enumerate(order, 1):
        seen[samples[i].group] += 1
        for dataset, n in SIZES.items():
            assert t * n // len(samples) <= seen[dataset] <= -(-t * n // len(samples)), (t, dict(seen))
    # a function of the samples and the seed: the same plan again (a resumed capture), another for another seed
    assert plan_mixed_shards(samples, HIDDEN, shard_bytes, {"target": "synthetic"}, seed=5) == plans
    assert [p.samples for p in plan_mixed_shards(samples, HIDDEN, shard_bytes, {}, seed=6)] != [
        p.samples for p in plans
    ]


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=6), seed=st.integers(0, 10**6))
def test_the_interleave_keeps_every_dataset_at_its_share_after_every_sample(sizes: list[int], seed: int) -> None:
    samples = [StoredSample(f"{g}/{i}", "train", [1], [1], f"d{g}") for g, n in enumerate(sizes) for i in range(n)]
    order = interleave_groups(samples, seed)
    assert sorted(order) == list(range(len(samples)))
    seen: Counter[str] = Counter()
    for t, i in enumerate(order, 1):
        seen[samples[i].group] += 1
        for g, n in enumerate(sizes):
            assert t * n // len(samples) <= seen[f"d{g}"] <= -(-t * n // len(samples))


def all_steps(root: Path, position: Position | None = None) -> list[Step]:
    """Every step a reader opened at `position` hands out from a filled spool (nothing else commits meanwhile)."""
    reader = SpoolReader(root, position=position, poll_s=0.01)
    steps = []
    while (step := reader.next_step(stop=lambda: True)) is not None:
        steps.append(step)
    assert reader.finished
    return steps


def test_the_trainer_shuffles_a_mix_of_several_shards_and_trains_every_token_passes_times(tmp_path: Path) -> None:
    passes, mix = 2, 3
    small_spool(tmp_path, passes=passes, mix=mix)
    writer = fill(tmp_path, samples=40)
    shards = len(writer.plans)
    assert shards >= 3 * mix
    steps = all_steps(tmp_path)
    slots: dict[int, set[tuple[int, int]]] = {}
    counts: Counter[tuple[str, int]] = Counter()
    for step in steps:
        for w in step.windows:
            slots.setdefault(step.position.slot, set()).add((w.shard, w.pass_index))
            counts.update((w.sample_id, t) for t in range(w.start, w.end))
    mixes = -(-shards // mix)
    assert sorted(slots) == list(range(mixes + passes - 1))
    for slot, parts in slots.items():  # slot i: pass p of every shard of mix i - p
        expected = {
            (k, p) for p in range(passes) if 0 <= slot - p < mixes for k in range(shards) if k // mix == slot - p
        }
        assert parts == expected, slot
    # one slot's steps draw on all of its mix's shards throughout: its first step already mixes several
    first = {w.shard for w in steps[0].windows}
    assert len(first) > 1, first
    lengths = {s.sample_id: len(s.input_ids) for s in worker.dataset(40)}
    assert set(counts.values()) == {passes} and len(counts) == sum(lengths.values())


def test_a_reader_reopened_at_any_committed_position_hands_out_the_same_steps(tmp_path: Path) -> None:
    """What a trainer killed with kill -9 and resumed from its checkpoint does: a new reader at the checkpoint's
    position (which commits it, deleting the mixes whose passes are all done) goes on with exactly the steps the
    uninterrupted run had there; a shard deleted too early would fail its next read ("its file is gone")."""
    passes, mix = 2, 3
    small_spool(tmp_path / "whole", passes=passes, mix=mix)
    fill(tmp_path / "whole", samples=40)
    reference = all_steps(tmp_path / "whole")
    root = tmp_path / "resumed"
    small_spool(root, passes=passes, mix=mix)
    fill(root, samples=40)
    cuts = sorted(random.Random(42).sample(range(1, len(reference)), 6))
    reader = SpoolReader(root, poll_s=0.01)
    done: list[Step] = []
    for cut in [*cuts, len(reference)]:
        while len(done) < cut:
            step = reader.next_step(stop=lambda: True)
            assert step is not None
            done.append(step)
        at = done[-1].after  # the checkpoint after this step is durable; the process dies before its commit
        reader = SpoolReader(root, position=at, poll_s=0.01)  # the next process, from that checkpoint
        adopted = len((root / "order.log").read_text().splitlines())
        assert read_ledger(root)["deleted"] == min(adopted, mix * max(0, at.slot - passes + 1)), at
    assert reader.at_end()
    assert [(s.position, s.windows) for s in done] == [(s.position, s.windows) for s in reference]
    assert not list((root / LANES / "a").glob("*.safetensors"))  # every shard deleted once trained out


def test_plan_json_records_each_shards_datasets_and_an_earlier_format_is_refused(tmp_path: Path) -> None:
    small_spool(tmp_path)
    writer = fill(tmp_path, samples=12)
    plan = json.loads((tmp_path / LANES / "a" / PLAN).read_text())
    assert plan["format"] == PLAN_FORMAT
    data = worker.dataset(12)
    for entry, p in zip(plan["shards"], writer.plans, strict=True):
        assert entry["datasets"] == dict(sorted(Counter(data[i].group for i in p.samples).items()))
        assert entry["windows"] == sum(-(-len(data[i].input_ids) // 64) for i in p.samples)
    (tmp_path / LANES / "a" / PLAN).write_text(json.dumps({"shards": plan["shards"]}))  # as format 1 wrote it
    with pytest.raises(SpoolStateError, match="eagle3-spool-plan/1 .*dataset by dataset"):
        fill(tmp_path, samples=12)
