"""Reads off the critical path (issue 42, item 1): a rank reads only the chunks its rows lie in, verified chunk by
chunk, on the prefetcher's threads several steps ahead; its errors reach the training thread; and the steps trained
are the same, bit for bit, with the prefetcher on or off. In one process, on the CPU, through tests/test_spool.py's
small spool (`fill`: shards committed by the capture's own writer, states of a known function of sample and row)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import spool_worker as worker
import torch
from test_spool import fill, small_spool

from eagle3_assets.stages.eagle3_drafter.spool_data import SpoolWindows
from eagle3_assets.stages.eagle3_drafter.train import TrainSettings
from eagle3_resources.errors import SpoolStateError
from eagle3_resources.hidden_states import spool as spool_module
from eagle3_resources.hidden_states.spool import LANES, Position, ReadRecord, ShardRows, SpoolWindow, read_step

pytestmark = pytest.mark.timeout(120)


def settings() -> TrainSettings:
    """The trainer's settings on `small_spool` (its window length, step tokens and seed)."""
    return TrainSettings(ttt_steps=3, epochs=1, batch_tokens=256, max_len=64, seed=1, warmup_steps=5)


def windows_of(root: Path, prefetch_steps: int) -> SpoolWindows:
    return SpoolWindows(
        root,
        settings(),
        torch.device("cpu"),
        lambda _m: None,
        poll_s=0.01,
        stop=lambda: True,
        prefetch_steps=prefetch_steps,
    )


def first_shard(root: Path) -> tuple[Path, dict[str, Any]]:
    manifest = json.loads((root / LANES / "a" / "manifest.json").read_text())
    name, entry = next(iter(manifest["shards"].items()))
    return root / LANES / "a" / name, entry


def flip_a_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_damaged_chunk_outside_a_ranks_rows_is_not_read_one_inside_fails_naming_file_and_chunk(tmp_path):
    small_spool(tmp_path)
    fill(tmp_path)
    path, entry = first_shard(tmp_path)
    shard = ShardRows(path, entry)
    sid, (a, b) = max(shard.samples.items(), key=lambda item: item[1][1] - item[1][0])
    n = b - a
    mine = SpoolWindow(0, sid, 0, n // 3, 0)  # this rank's rows: the sample's first third (a window of its own)
    theirs = SpoolWindow(0, sid, 2 * n // 3, n, 0)  # another rank's: its last third
    only_theirs = sorted(shard.chunks_of(sid, theirs.start, theirs.end) - shard.chunks_of(sid, 0, mine.end))
    assert only_theirs and len(shard.digests) > 4, (only_theirs, len(shard.digests))
    damaged = only_theirs[len(only_theirs) // 2]
    flip_a_byte(path, damaged * shard.chunk + 5)

    record = ReadRecord()
    got = read_step(Position(), [mine], {0: ("a", ShardRows(path, entry))}, record)[sid]
    aux, final = (t[: mine.end] for t in worker.expected_states(sid, n))
    assert torch.equal(got["aux_hidden_states"][: mine.end], aux)
    assert torch.equal(got["final_hidden_state"][: mine.end], final)
    assert 0 < record.bytes_read < int(entry["bytes"])  # only the chunks its rows lie in
    with pytest.raises(
        SpoolStateError, match=rf"^{path}: chunk {damaged} \(bytes [\d,]+ to [\d,]+\) has \w+ \w+, its "
    ):
        read_step(Position(), [theirs], {0: ("a", ShardRows(path, entry))}, ReadRecord())


def test_the_prefetcher_reads_the_next_steps_while_the_trainer_trains(tmp_path, monkeypatch):
    """Each read made 50 ms slow: with 3 steps read ahead, the trainer finds each next step read already when it asks
    for it, and the reads ran on the prefetcher's threads."""
    small_spool(tmp_path)
    fill(tmp_path)
    read = spool_module.pread_into
    threads: set[str] = set()

    def slow(fd: int, view: memoryview, offset: int) -> int:
        threads.add(threading.current_thread().name)
        time.sleep(0.05)
        return read(fd, view, offset)

    monkeypatch.setattr(spool_module, "pread_into", slow)
    data = windows_of(tmp_path, prefetch_steps=3)
    steps = data.steps(0, 0)
    next(steps)
    ready = []
    for _ in range(5):
        time.sleep(0.3)  # the step's training: long beside a read (50 ms), so the next step's read is done by now
        assert data.prefetcher is not None
        pending = data.prefetcher._pending  # the steps submitted: the next one first, as the trainer is about to ask
        ready.append(bool(pending) and pending[0][1] is not None and pending[0][1].done())
        next(steps)
    steps.close()
    assert ready == [True] * 5, ready  # the training thread found each next step read already
    assert threads and all(name.startswith("spool-prefetch") for name in threads), threads
    assert data.prefetcher is not None and data.prefetcher._pool is not None
    assert all(not t.is_alive() for t in data.prefetcher._pool._threads)  # closed with the steps


def test_without_the_prefetcher_the_trainer_waits_for_every_read(tmp_path, monkeypatch):
    """The same, with the prefetcher off: the measure above does see a read on the training thread."""
    small_spool(tmp_path)
    fill(tmp_path)
    read = spool_module.pread_into

    def slow(fd: int, view: memoryview, offset: int) -> int:
        time.sleep(0.05)
        return read(fd, view, offset)

    monkeypatch.setattr(spool_module, "pread_into", slow)
    steps = windows_of(tmp_path, prefetch_steps=0).steps(0, 0)
    waits = []
    for _ in range(3):
        started = time.monotonic()
        next(steps)
        waits.append(time.monotonic() - started)
    steps.close()
    assert min(waits) >= 0.05, waits


def test_an_error_of_the_prefetcher_is_raised_on_the_training_thread_at_the_step_that_needed_the_read(tmp_path):
    small_spool(tmp_path)
    fill(tmp_path)
    path, entry = first_shard(tmp_path)
    flip_a_byte(path, int(entry["bytes"]) - 1)  # the last row's loss mask: its chunk is read for the first slot
    data = windows_of(tmp_path, prefetch_steps=3)
    trained = 0
    with pytest.raises(SpoolStateError, match=rf"^{path}: chunk \d+ "):
        for _ in data.steps(0, 0):
            trained += 1
    assert data.current is None or data.current.position.slot == 0  # it failed in the damaged shard's slot
    assert data.prefetcher is not None and data.prefetcher._pool is not None
    assert all(not t.is_alive() for t in data.prefetcher._pool._threads)


def batches(root: Path, prefetch_steps: int) -> list[tuple[Position, list[Any], dict[str, torch.Tensor]]]:
    data = windows_of(root, prefetch_steps)
    out = []
    for windows, batch in data.steps(0, 0):
        assert data.current is not None
        tensors = {k: getattr(batch, k) for k in ("tokens", "positions", "mask", "aux", "final")}
        out.append((data.current.position, windows, tensors))
    return out


def test_the_steps_trained_are_the_same_bit_for_bit_with_the_prefetcher_on_and_off(tmp_path, monkeypatch):
    """Every step: the same position, windows and packed tensors, whose states are the rows the capture wrote. Each
    read takes 5 ms, so the prefetcher's threads overlap: one needing a chunk another is reading must wait for it."""
    read = spool_module.pread_into

    def slow(fd: int, view: memoryview, offset: int) -> int:
        time.sleep(0.005)
        return read(fd, view, offset)

    monkeypatch.setattr(spool_module, "pread_into", slow)
    for name in ("on", "off"):
        small_spool(tmp_path / name, passes=2, mix=2)
        fill(tmp_path / name)
    on, off = batches(tmp_path / "on", prefetch_steps=4), batches(tmp_path / "off", prefetch_steps=0)
    assert len(on) == len(off) > 10
    for (p, w, t), (q, v, u) in zip(on, off, strict=True):
        assert (p, w) == (q, v)
        for k in t:
            assert torch.equal(t[k], u[k]), (p, k)
    for _, windows, t in on:  # the rows read are the rows written
        aux = torch.cat([worker.expected_states(w.sample_id, w.end)[0][w.start : w.end] for w in windows])
        assert torch.equal(t["aux"], aux.float())


def test_a_cuda_trainer_reads_rows_into_pinned_memory(tmp_path, monkeypatch):
    """The CUDA path on the CPU: the reader of a trainer on a CUDA device reads its rows into page-locked memory (the
    allocation's `pin_memory` asked for, recorded instead of done: there is no CUDA here)."""
    small_spool(tmp_path)
    fill(tmp_path)
    asked: list[bool] = []
    empty = torch.empty

    def recorded(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        asked.append(pin_memory)
        return empty(*args, **kwargs)

    data = SpoolWindows(tmp_path, settings(), torch.device("cuda"), lambda _m: None, stop=lambda: True)
    reader = data._open_reader()
    step = reader.next_step(stop=lambda: True)
    assert step is not None
    monkeypatch.setattr(spool_module.torch, "empty", recorded)
    reader[step.windows[0].sample_id]
    assert asked == [True]
