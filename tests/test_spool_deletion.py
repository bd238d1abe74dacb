"""When the spool deletes a shard (issue 40): only once every pass over it has been handed out and the position after
its last pass committed, and then at once. Read from outside: the shard files on disk and the spool's own logs
(order.log, consumer.json), after every step handed out and every commit.

A shard deleted one pass early passed the end-to-end tests: the trainer reads a shard once and serves it from memory
for all its passes, so only a resume (which reads it again) missed it.
"""

from __future__ import annotations

import pytest
import spool_worker as worker
from test_spool import fill, small_spool

from eagle3_resources.hidden_states.spool import LANES, SpoolReader, read_ledger, read_order
from eagle3_resources.hidden_states.store import plan_shards

SAMPLES = 24
MAX_LEN = 64  # small_spool's window length


def windows_of_each_shard() -> dict[str, set[tuple[str, int, int]]]:
    """Every planned shard's windows (sample id, start, end): what each of its passes must hand out."""
    data = worker.dataset(SAMPLES)
    plans = plan_shards(data, worker.HIDDEN, worker.SHARD_BYTES, {"target": "synthetic"})
    out = {}
    for plan in plans:
        out[plan.name] = {
            (data[i].sample_id, x, min(len(data[i].input_ids), x + MAX_LEN))
            for i in plan.samples
            for x in range(0, len(data[i].input_ids), MAX_LEN)
        }
    return out


@pytest.mark.parametrize("passes", [2, 3])
def test_a_shard_is_deleted_once_the_position_after_its_last_pass_is_committed_not_a_pass_earlier(tmp_path, passes):
    small_spool(tmp_path, passes=passes)
    fill(tmp_path, samples=SAMPLES)  # every shard committed by capture; the share holds them all
    expected = windows_of_each_shard()
    lane = tmp_path / LANES / "a"
    reader = SpoolReader(tmp_path, poll_s=0.01)
    # each window handed out: (the position after its step, as (slot, step); the shard's name; the pass; the window)
    handed: list[tuple[tuple[int, int], str, int, tuple[str, int, int]]] = []
    last_slot: dict[str, int] = {}  # the slot of the last step that handed out a window of the shard
    seen_gone: list[int] = []  # shards gone at each check

    def check(when: str) -> None:
        """Each shard gone from disk has had every window of every pass handed out in steps before the spool's
        committed position; each one whose last step's slot is before that position is gone; consumer.json counts
        exactly the shards gone, a prefix of order.log."""
        order = [name for _, name, _ in read_order(tmp_path)]
        gone = [k for k, name in enumerate(order) if not (lane / name).exists()]
        ledger = read_ledger(tmp_path)  # after the files: it records a position before deleting what it finished
        at = (ledger["position"]["slot"], ledger["position"]["step"])
        done: dict[tuple[str, int], set[tuple[str, int, int]]] = {(n, p): set() for n in order for p in range(passes)}
        for after, name, p, window in handed:
            if after <= at:
                done[(name, p)].add(window)

        def passes_done(name: str) -> list[int]:
            return [p for p in range(passes) if done[(name, p)] == expected[name]]

        early = [
            f"#{k} {order[k]} (passes committed: {passes_done(order[k])})"
            for k in gone
            if len(passes_done(order[k])) < passes
        ]
        assert not early, f"{when}: deleted before all {passes} passes were committed at {at}: {', '.join(early)}"
        late = [
            k for k, n in enumerate(order) if k not in gone and len(passes_done(n)) == passes and last_slot[n] < at[0]
        ]
        assert not late, f"{when}: shards {late} finished in a slot before the committed {at} are still on disk"
        assert ledger["deleted"] == len(gone) and gone == list(range(len(gone))), (when, ledger, gone)
        seen_gone.append(len(gone))

    steps = 0
    while (step := reader.next_step(stop=lambda: True)) is not None:
        names = [name for _, name, _ in read_order(tmp_path)]
        after = (step.after.slot, step.after.step)
        for w in step.windows:
            handed.append((after, names[w.shard], w.pass_index, (w.sample_id, w.start, w.end)))
            last_slot[names[w.shard]] = step.position.slot
        steps += 1
        check(f"step {steps} handed out")
        if steps % 2 == 0:  # a checkpoint every 2 steps, as the trainer commits once its checkpoint is durable
            reader.commit(step.after)
            check(f"commit after step {steps}")
    reader.commit(reader.cursor)
    check("the last commit")
    assert reader.finished and seen_gone[-1] == len(expected)
    assert len({n for n in seen_gone if 0 < n < len(expected)}) > len(expected) // 2  # deleted along the way
