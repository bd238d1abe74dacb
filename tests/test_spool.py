"""The spool (eagle3_resources/hidden_states/spool.py): capture and training as separate processes through a
spool whose budget is a tenth of the data, kill -9 of either side at random moments, two hosts sharing the
directory; and, in one process, the refusals and the resume rules.

The processes are tests/spool_worker.py: a capture lane writing real shards through the store's API, and a
counting trainer whose checkpoint (its per-token counts and the spool position, one atomic file) is the
trainer's side of "exactly once": at the end every token of the data is counted exactly `passes` times.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import spool_worker as worker

from eagle3_resources.errors import SpoolStateError, SpoolTooSmall
from eagle3_resources.hidden_states.spool import (
    LANES,
    ORDER,
    Position,
    SpoolReader,
    SpoolSettings,
    SpoolWriter,
    create_spool,
    default_mix_shards,
    min_lane_bytes,
    read_ledger,
    read_order,
)
from eagle3_resources.hidden_states.store import (
    ALIGN,
    FORMAT,
    ShardImage,
    host_buffer,
    padded_size,
    plan_shards,
    shard_layout,
)

REPO = Path(__file__).resolve().parents[1]
SAMPLES = 160
PASSES = 2
pytestmark = pytest.mark.timeout(600)


def lane_bytes(n_lanes: int) -> tuple[list[int], list[int]]:
    """(each lane's data bytes, each lane's largest shard file) for the worker's dataset cut into n lanes."""
    data, largest = [], []
    for i in range(n_lanes):
        samples = worker.lane_samples(worker.dataset(SAMPLES), i, n_lanes)
        plans = plan_shards(samples, worker.HIDDEN, worker.SHARD_BYTES, {"target": "synthetic"})
        sizes = [shard_layout(p, [samples[j] for j in p.samples], worker.HIDDEN).size for p in plans]
        data.append(sum(sizes))
        largest.append(max(sizes))
    return data, largest


def make_spool(root: Path, lanes: list[str]) -> tuple[SpoolSettings, int]:
    """A spool whose budget is a tenth of the data's bytes, its mix the largest that budget allows (2 shards for one
    lane, 1 for two); (its settings, the data's bytes)."""
    data, largest = lane_bytes(len(lanes))
    budget = sum(data) // 10
    share = budget // len(lanes)
    mix = default_mix_shards(share, max(largest), PASSES)
    assert mix == (2 if len(lanes) == 1 else 1), mix
    for lane_max in largest:  # the budget is a tenth of the data and still holds each lane's working set
        assert share >= min_lane_bytes(PASSES, lane_max, mix), (share, lane_max)
    settings = SpoolSettings(
        {lane: share for lane in lanes},
        passes=PASSES,
        max_len=64,
        batch_tokens=256,
        seed=5,
        hidden_size=worker.HIDDEN,
        mix_shards=mix,
    )
    return create_spool(root, settings), sum(data)


class Sampler:
    """The bytes of the spool's shard files (`.tmp` of writes in flight included), sampled over and over from its own
    thread; `peak` is the largest sum seen.

    A directory scan is not a snapshot: under load it can count a file deleted early in the scan and one created late
    in it, which never coexisted. So each sample is two scans back to back, and counts only the files seen in both
    (same inode, same name but for a `.tmp` renamed in between), at the smaller of their two sizes: each existed
    from its first sighting to its second, so all existed together at the end of the first scan, and the sum is
    bytes that were on disk at one instant."""

    def __init__(self, root: Path):
        self.root, self.peak, self.samples = root, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def scan(self) -> dict[int, tuple[str, int]]:
        out = {}
        lanes = self.root / LANES
        for lane in os.scandir(lanes) if lanes.exists() else []:
            for e in os.scandir(lane.path):
                if e.name.endswith((".safetensors", ".safetensors.tmp")):
                    try:
                        st = e.stat()
                    except FileNotFoundError:
                        continue
                    out[st.st_ino] = (e.name.removesuffix(".tmp"), st.st_size)
        return out

    def bytes_now(self) -> int:
        first, second = self.scan(), self.scan()
        # the same file: same inode and name (a write in flight may have been renamed in between)
        return sum(min(a[1], b[1]) for ino, a in first.items() if (b := second.get(ino)) and a[0] == b[0])

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.bytes_now())
            self.samples += 1
            time.sleep(0.002)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class Procs:
    """The worker processes of a test, each in the process group the test puts it in; all killed at the end."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.all: list[subprocess.Popen] = []

    def start(self, *args: str, group: int | None = None) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        cmd = [sys.executable, str(REPO / "tests" / "spool_worker.py"), *args]
        p = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            process_group=0 if group is None else group,
        )
        self.all.append(p)
        return p

    def produce(self, root: Path, lane: str, index: int, lanes: int, slow: float, group: int | None = None):
        stats = self.tmp / f"produce-{lane}.jsonl"
        args = ["produce", str(root), lane, "--lane-index", str(index), "--lanes", str(lanes)]
        return self.start(*args, "--samples", str(SAMPLES), "--slow", str(slow), "--stats", str(stats), group=group)

    def consume(self, root: Path, slow: float, group: int | None = None):
        ckpt, stats = self.tmp / "trainer.json", self.tmp / "consume.jsonl"
        return self.start("consume", str(root), str(ckpt), "--slow", str(slow), "--stats", str(stats), group=group)

    def finish(self, p: subprocess.Popen) -> None:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out

    def kill_all(self) -> None:
        for p in self.all:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL) if os.getpgid(p.pid) == p.pid else p.kill()
                p.wait()


@pytest.fixture
def procs(tmp_path):
    p = Procs(tmp_path)
    yield p
    p.kill_all()


def stats(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def assert_trained_exactly(tmp: Path, n_lanes: int) -> None:
    """Every token of every lane's samples counted exactly PASSES times by the trainer, nothing else counted."""
    counts = json.loads((tmp / "trainer.json").read_text())["counts"]
    expected = {
        s.sample_id: len(s.input_ids)
        for i in range(n_lanes)
        for s in worker.lane_samples(worker.dataset(SAMPLES), i, n_lanes)
    }
    assert set(counts) == set(expected)
    wrong = {sid: row for sid, row in counts.items() if len(row) != expected[sid] or set(row) != {PASSES}}
    assert not wrong, f"{len(wrong)} sample(s) not trained exactly {PASSES} times: {list(wrong.items())[:3]}"


def assert_spool_emptied(root: Path, lanes: list[str]) -> None:
    """Every shard was deleted once trained, and recorded so: nothing is left on disk, nothing was captured again."""
    left = [p.name for lane in lanes for p in (root / LANES / lane).glob("*.safetensors*")]
    assert not left, left
    ledger = read_ledger(root)
    assert (
        ledger["deleted"]
        == len(read_order(root))
        == sum(len(json.loads((root / LANES / lane / "plan.json").read_text())["shards"]) for lane in lanes)
    )


@pytest.mark.slow
def assert_rows_read_once(bytes_read: int, root: Path, data: int) -> None:
    """A reader of every row read each chunk of every shard once, whatever the passes (`data`: the shard files' bytes),
    and no more than the chunks rows lie in: at most a shard's header chunk (ALIGN bytes of the stand-in's small
    shards; its index is in the manifest) is not read."""
    shards = len(read_order(root))
    assert data - shards * ALIGN <= bytes_read <= data, (bytes_read, data, shards)


def test_capture_and_training_as_processes_through_a_spool_of_a_tenth_of_the_data(procs, tmp_path):
    root = tmp_path / "spool"
    settings, data = make_spool(root, ["a"])
    sampler = Sampler(root)
    producer = procs.produce(root, "a", 0, 1, slow=0.0)
    trainer = procs.consume(root, slow=0.02)
    procs.finish(producer)
    procs.finish(trainer)
    sampler.stop()
    assert 0 < sampler.peak <= settings.budget_bytes, (sampler.peak, settings.budget_bytes)
    assert settings.budget_bytes * 10 <= data
    assert_trained_exactly(tmp_path, 1)
    assert_spool_emptied(root, ["a"])
    (p,) = stats(tmp_path / "produce-a.jsonl")
    assert p["waits"] > 0, "capture never paused for a full spool: the budget was not exercised"
    (c,) = stats(tmp_path / "consume.jsonl")
    assert_rows_read_once(c["bytes_read"], root, data)


def wait_for_slot(root: Path, slot: int, producer: subprocess.Popen, trainer: subprocess.Popen) -> None:
    """Until the trainer's durable position reaches `slot` (its progress, not a time); fails if the trainer ends, or
    the producer fails (it may finish: every shard committed)."""
    while Position.from_json(read_ledger(root)["position"]).slot < slot:
        for p in (producer, trainer):
            if p.poll() is not None and (p is trainer or p.returncode != 0):
                out, _ = p.communicate()
                role = "trainer" if p is trainer else "producer"
                raise AssertionError(f"the {role} ended (exit {p.returncode}) before slot {slot}:\n{out}")
        time.sleep(0.01)


@pytest.mark.slow
def test_kill_9_of_capture_then_of_training_resumes_without_losing_or_repeating_a_window(procs, tmp_path):
    root = tmp_path / "spool"
    settings, _ = make_spool(root, ["a"])
    shards = len(plan_shards(worker.dataset(SAMPLES), worker.HIDDEN, worker.SHARD_BYTES, {"target": "synthetic"}))
    slots = -(-shards // settings.mix_shards) + PASSES - 1  # mixes of 2 shards: 65 slots
    at = [round(slots * f) for f in (0.08, 0.23, 0.28, 0.4, 0.5, 0.65, 0.7, 0.82)]
    rng = random.Random(2027)
    sampler = Sampler(root)
    producer = procs.produce(root, "a", 0, 1, slow=0.01)
    trainer = procs.consume(root, slow=0.03)
    for k in (0, 4):  # twice each side, capture first, at random moments of their work (capture is ahead by 4 mixes)
        wait_for_slot(root, rng.randint(at[k], at[k + 1]), producer, trainer)
        time.sleep(rng.uniform(0.0, 0.5))
        assert producer.poll() is None, "capture had finished before its kill"
        os.killpg(producer.pid, signal.SIGKILL)
        producer.wait()
        producer = procs.produce(root, "a", 0, 1, slow=0.01)
        wait_for_slot(root, rng.randint(at[k + 2], at[k + 3]), producer, trainer)
        time.sleep(rng.uniform(0.0, 0.5))
        assert trainer.poll() is None, "training had finished before its kill"
        os.killpg(trainer.pid, signal.SIGKILL)
        trainer.wait()
        trainer = procs.consume(root, slow=0.03)
    procs.finish(producer)
    procs.finish(trainer)
    sampler.stop()
    assert sampler.peak <= settings.budget_bytes, (sampler.peak, settings.budget_bytes)
    assert_trained_exactly(tmp_path, 1)
    assert_spool_emptied(root, ["a"])
    runs = stats(tmp_path / "produce-a.jsonl")
    assert len(runs) == 1 and runs[0]["todo"] < len(
        json.loads((root / LANES / "a" / "plan.json").read_text())["shards"]
    )


@pytest.mark.slow
def test_two_hosts_sharing_the_spool_directory(procs, tmp_path):
    """Host A: two capture lanes in one process group; host B: the trainer in another. They share only files."""
    root = tmp_path / "spool"
    lanes = ["hostA-0", "hostA-1"]
    settings, _ = make_spool(root, lanes)
    sampler = Sampler(root)
    first = procs.produce(root, lanes[0], 0, 2, slow=0.0)
    second = procs.produce(root, lanes[1], 1, 2, slow=0.0, group=first.pid)
    trainer = procs.consume(root, slow=0.02)
    assert os.getpgid(second.pid) == first.pid != os.getpgid(trainer.pid) == trainer.pid
    procs.finish(trainer)
    assert_trained_exactly(tmp_path, 2)
    for p in (first, second):
        procs.finish(p)
    sampler.stop()
    assert sampler.peak <= settings.budget_bytes
    assert_spool_emptied(root, lanes)
    taken = [lane for lane, _, _ in read_order(root)]
    assert set(taken) == set(lanes)


# -- in one process: the refusals and the resume rules ------------------------------------------------------


def fill(root: Path, lane: str = "a", samples: int = 24) -> SpoolWriter:
    """Commit every shard of a lane that fits (no trainer runs here), through the same code as the worker."""
    data = worker.dataset(samples)
    plans = plan_shards(data, worker.HIDDEN, worker.SHARD_BYTES, {"target": "synthetic"})
    writer = SpoolWriter(root, lane, data, plans, {"format": FORMAT}, poll_s=0.01)
    image = ShardImage(host_buffer(max(padded_size(lay.size) for lay in writer.layouts.values()), pin=False))
    for plan in writer.todo:
        if not writer.reserve(plan, stop=lambda: True):
            break
        writer.start(image, plan, data)
        assert image.layout is not None
        for j, i in enumerate(plan.samples):
            a, b = image.layout.row_offsets[j], image.layout.row_offsets[j + 1]
            image.aux[a:b], image.final[a:b] = worker.expected_states(data[i].sample_id, b - a)
        writer.commit(image, direct=False)
    return writer


def small_spool(root: Path, share: int = 10**7, passes: int = 1, mix: int = 1) -> SpoolSettings:
    settings = SpoolSettings({"a": share}, passes, max_len=64, batch_tokens=256, seed=1, hidden_size=32, mix_shards=mix)
    return create_spool(root, settings)


def test_a_lane_whose_share_cannot_hold_its_working_set_is_refused(tmp_path):
    data = worker.dataset(24)
    plans = plan_shards(data, worker.HIDDEN, worker.SHARD_BYTES, {"target": "synthetic"})
    largest = max(shard_layout(p, [data[j] for j in p.samples], worker.HIDDEN).size for p in plans)
    need = 3 * padded_size(largest)  # 2 passes: the 2 shards the trainer may hold, and the one being written
    small_spool(tmp_path / "ok", share=need, passes=2)
    SpoolWriter(tmp_path / "ok", "a", data, plans, {"format": FORMAT})  # exactly the minimum: accepted
    small_spool(tmp_path / "no", share=need - 1, passes=2)
    with pytest.raises(SpoolTooSmall, match="needs") as e:
        SpoolWriter(tmp_path / "no", "a", data, plans, {"format": FORMAT})
    assert "budget" in e.value.what_to_do
    # mixes of 3 shards: the trainer may hold 2 of them, 6 shards, and one is being written
    mixed = 7 * padded_size(largest)
    small_spool(tmp_path / "mix", share=mixed, passes=2, mix=3)
    SpoolWriter(tmp_path / "mix", "a", data, plans, {"format": FORMAT})
    small_spool(tmp_path / "mix-no", share=mixed - 1, passes=2, mix=3)
    with pytest.raises(SpoolTooSmall, match="a mix of 3 shard"):
        SpoolWriter(tmp_path / "mix-no", "a", data, plans, {"format": FORMAT})


def test_a_shard_whose_bytes_are_not_its_checksums_is_refused(tmp_path):
    small_spool(tmp_path)
    fill(tmp_path)
    first = read_order(tmp_path) or None
    assert first is None  # nothing adopted yet
    manifest = json.loads((tmp_path / LANES / "a" / "manifest.json").read_text())
    name = next(iter(manifest["shards"]))
    path = tmp_path / LANES / "a" / name
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # one bit of the last row's loss mask
    path.write_bytes(bytes(data))
    reader = SpoolReader(tmp_path)
    steps = []  # the first slot's: every row of the first shard, planned from the manifest alone
    while (step := reader.next_step(stop=lambda: True)) is not None and step.position.slot == 0:
        steps.append(step)
    assert steps and reader.bytes_read == 0  # nothing of any file read to plan them
    match = rf"{path}: chunk \d+ \(bytes [\d,]+ to {len(data):,}\) has (xxh3_64|sha256) \w+, its lane's manifest"
    with pytest.raises(SpoolStateError, match=match):
        for step in steps:
            for w in step.windows:
                reader[w.sample_id]


def test_capture_resumes_without_capturing_again_what_the_trainer_took(tmp_path):
    small_spool(tmp_path)
    writer = fill(tmp_path)
    lane = tmp_path / LANES / "a"
    assert len(writer.todo) == len(writer.plans) > 8
    reader = SpoolReader(tmp_path, poll_s=0.01)
    while (step := reader.next_step(stop=lambda: True)) is not None and step.after.slot <= 5:
        last = step.after
    reader.commit(last)  # slots 0-4 done: 5 shards trained on their one pass and deleted; shard 5 taken
    order = [name for _, name, _ in read_order(tmp_path)]
    assert read_ledger(tmp_path)["deleted"] == 5 and len(order) == 6
    gone, taken = set(order[:5]), order[5]
    # A damaged file under the name of a shard trained and deleted, and another of a shard nobody took; the file of
    # the shard taken but not yet trained is gone (what a capture worker reading a ledger older than the trainer's
    # deletion would see: only the trainer deletes a listed shard).
    (lane / order[4]).write_bytes(b"x")
    untaken = next(p.name for p in writer.plans if p.name not in order)
    (lane / untaken).write_bytes(b"x")
    (lane / taken).unlink()
    resumed = fill(tmp_path)
    todo = {p.name for p in resumed.todo}
    assert not gone & todo and taken not in todo, "a shard the trainer took was captured again"
    assert untaken in todo  # a damaged shard nobody took is captured again
    assert not gone & set(json.loads((lane / "manifest.json").read_text())["shards"])


def test_a_trainer_checkpoint_behind_the_spools_position_is_refused_and_one_ahead_is_caught_up(tmp_path):
    small_spool(tmp_path)
    fill(tmp_path)
    reader = SpoolReader(tmp_path, poll_s=0.01)
    got = [reader.next_step(stop=lambda: True) for _ in range(6)]
    assert all(got)
    handed = [step for step in got if step is not None]  # all six, as asserted
    reader.commit(handed[3].after)
    with pytest.raises(SpoolStateError, match="behind"):
        SpoolReader(tmp_path, position=handed[1].after)
    ahead = handed[5].after
    again = SpoolReader(tmp_path, position=ahead)  # the checkpoint reached the disk, the ledger did not
    assert Position.from_json(read_ledger(tmp_path)["position"]) == ahead
    nxt = again.next_step(stop=lambda: True)
    assert nxt is not None and nxt.position == ahead


def test_a_torn_line_of_the_adoption_log_is_not_an_adoption(tmp_path):
    small_spool(tmp_path)
    fill(tmp_path)
    reader = SpoolReader(tmp_path, poll_s=0.01)
    reader.next_step(stop=lambda: True)
    whole = (tmp_path / ORDER).read_bytes()
    (tmp_path / ORDER).write_bytes(whole + b'["a", "G1-000')  # a kill in the middle of the next append
    assert read_order(tmp_path) == [tuple(json.loads(line)) for line in whole.decode().splitlines()]
    SpoolReader(tmp_path)
    assert (tmp_path / ORDER).read_bytes() == whole
