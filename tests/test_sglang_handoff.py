"""The SGLang backend's rank-0 hand-off: a ring of shared host slabs, small messages on the queue.

Real spawned rank processes (tests/fakes/sglang.py's EchoEngine, CPU), the real RankPool and SlabRing
in the real /dev/shm: the same slab protocol a GPU host runs, with plain copies instead of DMA.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch
import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)
from fakes.sglang import ECHO_SLAB, HIDDEN, MAX_TOKENS, echo_engine, echo_rows

from eagle3_resources.errors import HandoffMemoryError, RankError, SlabsHeld
from eagle3_resources.hidden_states.extract import StoreSettings, extract_to_store
from eagle3_resources.hidden_states.sglang_backend import (
    SHM_DIR,
    Done,
    LentExtraction,
    Limits,
    RankPool,
    SlabLayout,
    SlabRing,
    SlabWait,
)
from eagle3_resources.hidden_states.store import HiddenStateStore, StoredSample

LIMITS = Limits(max_tokens=MAX_TOKENS, max_requests=4, max_length=MAX_TOKENS)


def make_pool(slabs: int = 2, **engine) -> RankPool:
    return RankPool(
        2,
        functools.partial(echo_engine, **engine),
        handoff=ECHO_SLAB,
        slabs=slabs,
        start_timeout_s=120,
        batch_timeout_s=30,
        stop_grace_s=10,
    )


def batch(k: int) -> list[list[int]]:
    """Batch k: distinct ids per batch and position, lengths varying with k (1 to 3 sequences)."""
    return [[(7 * k + 3 * j + t) % 97 + 1 for t in range(1 + (k + j) % 9)] for j in range(1 + k % 3)]


def assert_exact(rows_aux: torch.Tensor, rows_final: torch.Tensor, sequences) -> None:
    aux, final = echo_rows(sequences)
    assert rows_aux.dtype == torch.bfloat16 and torch.equal(rows_aux, aux)
    assert torch.equal(rows_final, final)


def mapped(paths: list[str]) -> list[str]:
    """Lines of this process's memory map that map one of `paths` (a leak if any remain)."""
    text = Path("/proc/self/maps").read_text()
    return [line for line in text.splitlines() if any(p in line for p in paths)]


class Recording:
    """The parent's end of the reply queue, keeping every message it hands over."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def get(self, *args, **kwargs):
        message = self.inner.get(*args, **kwargs)
        self.seen.append(message)
        return message


def tensors_in(obj) -> list:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj):
        return [t for f in dataclasses.fields(obj) for t in tensors_in(getattr(obj, f.name))]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_in(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_in(v)]
    return []


def assert_small_messages(seen: list) -> None:
    """Every reply is a Done or SlabWait of a few numbers: no tensor (not even a shared-memory handle)."""
    assert {type(m) for m in seen} <= {Done, SlabWait}
    for m in seen:
        assert not tensors_in(m), f"a reply carries tensor data: {m!r}"
        assert len(ForkingPickler.dumps(m)) < 400, m


def test_rows_arrive_exact_through_reused_slabs_and_the_queue_carries_no_rows(monkeypatch):
    pool = make_pool(slabs=2)
    try:
        pool.start()
        assert pool.infos[0]["handoff_pinned"] is False  # a CPU host: plain copies, same protocol
        recording = Recording(pool._replies)
        monkeypatch.setattr(pool, "_replies", recording)  # the pool reads its replies through it
        slabs_used = []
        for k in range(12):  # six times as many batches as slabs
            rows = pool.result(pool.submit(batch(k)))
            assert_small_messages(recording.seen)
            assert_exact(rows.aux, rows.final, batch(k))
            slabs_used.append(rows.slab)
            rows.release()
        assert sorted(set(slabs_used)) == [0, 1] and len(slabs_used) == 12
        assert pool.stats["batches"] == 12
        assert pool.stats["bytes"] == sum(len(s) for k in range(12) for s in batch(k)) * 4 * HIDDEN * 2

        # Through the backend's extract_batch: 5 sequences of 30 tokens make 3 forwards of a 64-token slab,
        # more than the 2 slabs, so the oldest is copied out of its slab; every row still exact.
        extraction = LentExtraction(pool, LIMITS)
        for round_ in range(3):
            sequences = [[(round_ * 5 + i) % 50 + 1] * 30 for i in range(5)]
            got = extraction.extract_batch(sequences)
            for s, (a, f) in zip(sequences, got, strict=True):  # one capture per sequence
                assert_exact(a, f, [s])
        assert extraction.copied_out == 3  # one per call
        extraction.release()

        seen = recording.seen
        assert_small_messages(seen)
        assert sum(isinstance(m, Done) and m.rank == 0 for m in seen) == 12 + 3 * 3
    finally:
        pool.close()
    assert not pool.alive


def test_back_pressure_rank_zero_waits_while_the_caller_holds_every_slab():
    pool = make_pool(slabs=2)
    try:
        pool.start()
        ids = [pool.submit(batch(k)) for k in range(6)]
        r0, r1 = pool.result(ids[0]), pool.result(ids[1])
        # Rank 0 has batch 2 ready and no slab to put it in: it says so instead of both sides waiting forever.
        with pytest.raises(SlabsHeld, match="holds all 2"):
            pool.result(ids[2])
        assert pool.stats["slab_waits"] >= 1
        assert_exact(r0.aux, r0.final, batch(0))
        r0.release()
        r2 = pool.result(ids[2])
        assert_exact(r1.aux, r1.final, batch(1))  # the slab still held was not written over
        assert_exact(r2.aux, r2.final, batch(2))
        r1.release()
        r2.release()
        for k in range(3, 6):
            rows = pool.result(ids[k])
            assert_exact(rows.aux, rows.final, batch(k))
            rows.release()
        assert pool.stats["batches"] == 6
        with pytest.raises(ValueError, match="in order"):
            pool.result(ids[0])  # already collected
    finally:
        pool.close()


@pytest.mark.parametrize(
    "rank_delay_s, parent_delay_s", [(0.05, 0.0), (0.0, 0.05)], ids=["rank0-slower", "parent-slower"]
)
def test_every_batch_arrives_in_order_whichever_side_is_slower(rank_delay_s, parent_delay_s):
    pool = make_pool(slabs=2, delay_s=rank_delay_s)
    try:
        pool.start()
        ids = [pool.submit(batch(k)) for k in range(10)]  # all queued at once: rank 0 runs ahead up to the ring
        for k, batch_id in enumerate(ids):
            rows = pool.result(batch_id)
            time.sleep(parent_delay_s)  # the parent reading slowly while holding the slab
            assert rows.batch_id == k
            assert_exact(rows.aux, rows.final, batch(k))
            rows.release()
        assert pool.stats["batches"] == 10
    finally:
        pool.close()


def test_rank_zero_dying_mid_batch_stops_every_rank_and_frees_the_slabs():
    pool = make_pool(slabs=2, exit_on_batch_with=99)
    paths = pool.ring.paths
    pool.start()
    first = pool.run([[1, 2, 3]])
    assert torch.equal(first[0], echo_rows([[1, 2, 3]])[0])
    rows = pool.result(pool.submit([[4, 5]]))  # held by the caller when rank 0 dies
    with pytest.raises(RankError, match="exited on batch 2"):
        pool.result(pool.submit([[98, 99]]))
    rows.release()  # after the failure: nothing to give back to
    del rows
    assert not pool.alive
    with pytest.raises(RankError, match="unusable"):
        pool.submit([[1]])
    assert not any(os.path.exists(p) for p in paths) and not mapped(paths)


@pytest.mark.slow
def test_slabs_leave_nothing_in_dev_shm():
    pool = make_pool(slabs=3)
    paths = pool.ring.paths
    assert len(paths) == 3 and all(Path(p).parent == SHM_DIR and os.path.getsize(p) == ECHO_SLAB.nbytes for p in paths)
    pool.start()
    assert not any(os.path.exists(p) for p in paths)  # rank 0 has mapped them: the names are gone already
    kept = pool.run([[5, 6]])  # a copy: the caller keeps it after close
    rows = pool.result(pool.submit([[7, 8]]))
    assert mapped(paths)
    pool.close()
    assert torch.equal(rows.aux, echo_rows([[7, 8]])[0])  # lent rows stay readable until dropped
    del rows
    assert not mapped(paths)  # the parent's mappings went with the last view
    assert torch.equal(kept[1], echo_rows([[5, 6]])[1])

    failing = make_pool(slabs=2, die_on_start=True)  # a start that fails removes them as well
    paths = failing.ring.paths
    with pytest.raises(RankError, match="exited while starting"):
        failing.start()
    assert not any(os.path.exists(p) for p in paths) and not mapped(paths)


def test_a_dev_shm_too_small_for_the_slabs_is_refused_with_the_figures():
    size = os.statvfs(SHM_DIR).f_blocks * os.statvfs(SHM_DIR).f_frsize
    layout = SlabLayout(tokens=size // (4 * 8 * 2) + 1, aux_width=3 * 8, final_width=8)  # one slab > the whole volume
    with pytest.raises(HandoffMemoryError, match=r"1 slabs of .* GB .* free .*--shm-size.*sglang_handoff_slabs"):
        SlabRing(1, layout)
    assert not [p for p in os.listdir(SHM_DIR) if p.startswith(f"eagle3-handoff-{os.getpid()}-")]


class EchoBackend:
    """The SGLang backend's parent side over a RankPool of EchoEngines: what extract_to_store drives."""

    name = "sglang-echo"
    layer_ids = [0, 1, 2]
    num_layers = 3
    hidden_size = HIDDEN

    def __init__(self, pool: RankPool):
        self.extraction = LentExtraction(pool, LIMITS)

    def describe(self):
        return {"backend": self.name}

    def extract_batch(self, sequences):
        return self.extraction.extract_batch(sequences)


def test_extract_to_store_keeps_the_lent_rows_exactly(tmp_path):
    """The store's copy out of the slab is the only one: what it keeps is the engine's rows, bit for bit."""
    samples = [
        StoredSample(f"S/{i:03d}", "train", [(5 * i + t) % 90 + 1 for t in range(3 + i % 11)], [1] * (3 + i % 11))
        for i in range(40)
    ]
    pool = make_pool(slabs=2)
    try:
        pool.start()
        extract_to_store(
            samples,
            EchoBackend(pool),
            tmp_path,
            StoreSettings(shard_bytes=16_384, batch_tokens=48, free_bytes=10**12, reserve_bytes=0),
            identity={},
            progress_every_s=3600,
            log=lambda _: None,
        )
        assert pool.stats["batches"] >= 10
    finally:
        pool.close()
    store = HiddenStateStore(tmp_path)
    assert len(store) == 40
    for s in samples:
        aux, final = echo_rows([list(s.input_ids)])
        assert torch.equal(store[s.sample_id]["aux_hidden_states"], aux), s.sample_id
        assert torch.equal(store[s.sample_id]["final_hidden_state"], final), s.sample_id
