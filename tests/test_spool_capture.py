"""The real capture into the spool (`capture_to_spool`): the stand-in target's transformers backend captures into a
spool lane from a separate process (tests/spool_capture_worker.py) while a `SpoolReader` in this process drains it.

The spool's budget is about a tenth of the data. What the consumer reads is compared, tensor by tensor, with what
offline extraction of the same samples writes to a store (the same worker, `store` mode); every token is counted
where it is consumed. The capture is killed with SIGKILL at random moments and restarted: nothing is lost, nothing
captured twice.
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import spool_capture_worker as worker
import torch
from test_spool import Sampler

from eagle3_resources.hidden_states.extract import SpoolCaptureReport, capture_to_spool
from eagle3_resources.hidden_states.spool import (
    LANES,
    PLAN,
    SpoolReader,
    SpoolSettings,
    create_spool,
    min_lane_bytes,
    read_ledger,
    read_order,
)
from eagle3_resources.hidden_states.store import (
    MANIFEST,
    HiddenStateStore,
    ShardPlan,
    plan_mixed_shards,
    shard_layout,
)
from eagle3_resources.hidden_states.transformers_backend import TransformersHiddenStates
from eagle3_resources.target.resource import TargetModelResource
from eagle3_resources.tokenizer.resource import TokenizerResource

REPO = Path(__file__).resolve().parents[1]
HIDDEN = 64  # the stand-in target's
PASSES = 2
LANE = "gpu0"
SEED = worker.SEED  # the spool's, which seeds the capture's interleave of the datasets
KEYS = ("input_ids", "loss_mask", "aux_hidden_states", "final_hidden_state")
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def model_folder(target_resource: TargetModelResource, tokenizer_resource: TokenizerResource) -> Path:
    return target_resource.folder(tokenizer_resource)


@pytest.fixture(scope="module")
def offline(model_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same samples extracted offline into a store, by the same worker: the reference for every state."""
    root = tmp_path_factory.mktemp("offline")
    cmd = [sys.executable, str(REPO / "tests" / "spool_capture_worker.py"), "store", str(model_folder), str(root)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return root


def make_spool(root: Path, vocab: int) -> tuple[SpoolSettings, int, list[ShardPlan]]:
    """A one-lane spool whose budget is a tenth of the data's bytes; (its settings, the data's bytes, the plan)."""
    samples = worker.samples(vocab)
    plans = plan_mixed_shards(samples, HIDDEN, worker.SHARD_BYTES, worker.IDENTITY, SEED)  # as the capture plans them
    sizes = [shard_layout(p, [samples[i] for i in p.samples], HIDDEN).size for p in plans]
    budget = sum(sizes) // 10
    assert budget >= min_lane_bytes(PASSES, max(sizes)), "the tenth must still hold the lane's working set"
    settings = SpoolSettings({LANE: budget}, PASSES, max_len=16, batch_tokens=64, seed=SEED, hidden_size=HIDDEN)
    return create_spool(root, settings), sum(sizes), plans


class Capture:
    """The capture lane's process, run after run (each in its own process group); all killed at the end."""

    def __init__(self, model: Path, root: Path, tmp: Path, slow: float = 0.0):
        self.model, self.root, self.tmp, self.slow = model, root, tmp, slow
        self.runs: list[subprocess.Popen] = []
        self.restarting = False

    @property
    def proc(self) -> subprocess.Popen:
        return self.runs[-1]

    def progress(self, run: int) -> list[dict]:
        path = self.tmp / f"progress-{run}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line) for line in lines if line.endswith("}")]  # a line cut by a kill is not a report

    def stats(self) -> list[dict]:
        path = self.tmp / "stats.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def start(self) -> subprocess.Popen:
        run = len(self.runs)
        args = ["spool", str(self.model), str(self.root), LANE, "--slow", str(self.slow)]
        args += ["--stats", str(self.tmp / "stats.jsonl"), "--progress", str(self.tmp / f"progress-{run}.jsonl")]
        p = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "spool_capture_worker.py"), *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            process_group=0,
        )
        self.runs.append(p)
        return p

    def running(self) -> bool:
        """The lane is capturing, or between a kill and its restart."""
        return self.restarting or self.proc.poll() is None

    def wait_for(self, run: int, what: str, predicate: Callable[[list[dict]], bool]) -> None:
        while not predicate(self.progress(run)):
            if self.runs[run].poll() is not None:
                out, _ = self.runs[run].communicate()
                raise AssertionError(
                    f"capture run {run} ended (exit {self.runs[run].returncode}) before {what}:\n{out}"
                )
            time.sleep(0.01)

    def finish(self) -> None:
        out, _ = self.proc.communicate(timeout=600)
        assert self.proc.returncode == 0, out

    def kill_all(self) -> None:
        for p in self.runs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.fixture
def capture(model_folder: Path, tmp_path: Path) -> Iterator[Callable[..., Capture]]:
    lanes: list[Capture] = []

    def make(slow: float = 0.0) -> Capture:
        lanes.append(Capture(model_folder, tmp_path / "spool", tmp_path, slow))
        return lanes[-1]

    yield make
    for lane in lanes:
        lane.kill_all()


def drain(
    root: Path, offline: Path, capturing: Callable[[], bool], entries: dict[str, Any] | None = None
) -> dict[str, list[int]]:
    """The consumer: every step the spool hands out, each window's tensors compared with the offline store's and its
    tokens counted; the position committed every 3 steps and whenever it waits (so finished shards are deleted).
    `entries` gets each shard's lane-manifest entry as the reader verified the shard's bytes against it (the lane's
    manifest itself unlists shards once they are deleted)."""
    store = HiddenStateStore(offline)
    reader = SpoolReader(root, poll_s=0.02)
    counts: dict[str, list[int]] = {}
    mismatches: list[str] = []
    last, steps = None, 0

    def checkpoint() -> None:
        if last is not None:
            reader.commit(last)

    while True:
        step = reader.next_step(stop=lambda: not capturing(), on_wait=checkpoint)
        if step is None and not reader.finished:  # the capture has ended: whatever it committed is visible now
            step = reader.next_step(stop=lambda: True)
        if step is None:
            break
        for w in step.windows:
            if entries is not None:
                ref = reader.shard_ref(w.shard)
                entries[ref.name] = ref.entry
            got, want = reader[w.sample_id], store[w.sample_id]
            for key in KEYS:
                if not torch.equal(got[key][w.start : w.end], want[key][w.start : w.end]):
                    mismatches.append(f"{w.sample_id} {key} [{w.start}:{w.end}]")
            row = counts.setdefault(w.sample_id, [0] * want["input_ids"].shape[0])
            for t in range(w.start, w.end):
                row[t] += 1
        last, steps = step.after, steps + 1
        if steps % 3 == 0:
            checkpoint()
    checkpoint()
    store.close()
    assert not mismatches, f"{len(mismatches)} window(s) differ from the offline store's states: {mismatches[:5]}"
    assert reader.finished, "the consumer waits for shards the capture never committed"
    return counts


def assert_each_token_consumed_exactly(counts: dict[str, list[int]], offline: Path) -> None:
    store = HiddenStateStore(offline)
    expected = {sid: store.shapes(sid)["input_ids"][0] for sid in store.sample_ids()}
    store.close()
    assert len(expected) == worker.SAMPLES and set(counts) == set(expected)
    wrong = {sid: row for sid, row in counts.items() if len(row) != expected[sid] or set(row) != {PASSES}}
    assert not wrong, f"{len(wrong)} sample(s) not consumed exactly {PASSES} times: {list(wrong.items())[:3]}"


def assert_spool_emptied(root: Path, plans: list[ShardPlan]) -> None:
    left = [p.name for p in (root / LANES / LANE).glob("*.safetensors*")]
    assert not left, left
    assert read_ledger(root)["deleted"] == len(read_order(root)) == len(plans)


@pytest.mark.slow
def test_real_capture_streams_through_a_tenth_of_the_data_bit_identical_to_the_offline_store(
    offline: Path, capture: Callable[..., Capture], tmp_path: Path, model_folder: Path
) -> None:
    root = tmp_path / "spool"
    vocab = json.loads((model_folder / "config.json").read_text())["vocab_size"]
    settings, data, plans = make_spool(root, vocab)
    sampler = Sampler(root)
    lane = capture()
    lane.start()
    # The consumer starts once the capture has filled the lane and waits for it: the capture pauses, whatever the
    # two sides' speeds.
    lane.wait_for(0, "the lane filled up", lambda reports: any(r["waiting"] for r in reports))
    entries: dict[str, Any] = {}
    counts = drain(root, offline, lane.running, entries)
    lane.finish()
    sampler.stop()

    assert settings.budget_bytes * 10 <= data
    assert 0 < sampler.peak <= settings.budget_bytes, (sampler.peak, settings.budget_bytes)
    assert_each_token_consumed_exactly(counts, offline)
    # The lane's shards are byte for byte the offline store's (the entries the reader verified them against, and the
    # store manifest's checksums), names and keys included; the lane's manifest lists only what is still on disk.
    store_shards = json.loads((offline / MANIFEST).read_text())["shards"]
    # a lane's entries also hold each chunk's digest and the rows' index (issue 42: a rank reads and verifies only the
    # chunks its rows lie in), which the offline store's do without
    assert all(set(e) - set(store_shards[name]) == {"chunks", "index"} for name, e in entries.items())
    assert {name: {k: v for k, v in e.items() if k not in ("chunks", "index")} for name, e in entries.items()} == (
        store_shards
    )
    # Only shards on disk when the last one was listed stay listed: their bytes fit the budget (not the whole run's).
    listed = json.loads((root / LANES / LANE / MANIFEST).read_text())["shards"]
    assert sum(e["bytes"] for e in listed.values()) <= settings.budget_bytes < data
    assert_spool_emptied(root, plans)
    (stats,) = lane.stats()
    assert stats["pauses"] >= 1 and stats["waited_s"] > 0 and not stats["stopped"]
    assert stats["shards_written"] == len(plans) and stats["bytes_written"] == data
    reports = lane.progress(0)
    assert max(r["lane_bytes"] for r in reports) <= settings.budget_bytes
    assert reports[-1]["pauses"] == stats["pauses"] and reports[-1]["bytes_per_s"] > 0
    print(
        f"\ncapture: {len(plans)} shards, {data:,} bytes through a {settings.budget_bytes:,}-byte spool "
        f"(peak {sampler.peak:,}, {sampler.samples} samples); {stats['pauses']} pauses, {stats['waited_s']} s waited; "
        f"{stats['bytes_per_s']:,.0f} B/s ({stats['busy_bytes_per_s']:,.0f} B/s busy) in {stats['seconds']} s"
    )


@pytest.mark.slow
def test_kill_9_of_the_capture_at_random_moments_then_restarts_lose_and_repeat_nothing(
    offline: Path, capture: Callable[..., Capture], tmp_path: Path, model_folder: Path
) -> None:
    root = tmp_path / "spool"
    vocab = json.loads((model_folder / "config.json").read_text())["vocab_size"]
    settings, _, plans = make_spool(root, vocab)
    tokens = {p.name: p.tokens for p in plans}
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    sampler = Sampler(root)
    lane = capture(slow=0.05)
    lane.start()
    expected_todo: dict[int, set[str]] = {}  # run -> the shards it must capture: the plan less what was committed
    errors: list[BaseException] = []

    def killer() -> None:
        try:
            for run in range(2):
                lane.wait_for(run, "its first commit", lambda reports: any(r["shards_written"] for r in reports))
                time.sleep(rng.uniform(0.0, 1.0))
                assert lane.proc.poll() is None, f"capture run {run} had finished before its kill (seed {seed})"
                lane.restarting = True
                os.killpg(lane.proc.pid, signal.SIGKILL)
                lane.proc.wait()
                # Committed before the kill: listed in the lane's manifest, or taken by the trainer (only a listed shard
                # is taken; a taken one may be deleted since, and a restart drops deleted ones from the manifest).
                listed = set(json.loads((root / LANES / LANE / MANIFEST).read_text())["shards"])
                taken = {name for ln, name, _ in read_order(root) if ln == LANE}
                expected_todo[run + 1] = set(tokens) - listed - taken
                lane.start()
                lane.restarting = False
        except BaseException as e:
            errors.append(e)
            lane.restarting = False

    thread = threading.Thread(target=killer)
    thread.start()
    try:
        counts = drain(root, offline, lane.running)
    finally:
        thread.join()
    if errors:
        raise errors[0]
    lane.finish()
    sampler.stop()

    assert_each_token_consumed_exactly(counts, offline)
    assert sampler.peak <= settings.budget_bytes, (sampler.peak, settings.budget_bytes)
    assert_spool_emptied(root, plans)
    for run, todo in expected_todo.items():  # each restart set out to capture exactly what was not committed
        assert 0 < len(todo) < len(plans), f"run {run}: the kill came too early or too late (seed {seed})"
        assert lane.progress(run)[0]["tokens_pending"] == sum(tokens[n] for n in todo), f"run {run}, seed {seed}"
    (final,) = lane.stats()  # only the last run lived to write its report
    assert set(final["todo"]) == expected_todo[2]
    assert final["shards_written"] == len(final["todo"])
    plan_file = json.loads((root / LANES / LANE / PLAN).read_text())
    assert [s["name"] for s in plan_file["shards"]] == [p.name for p in plans]
    left = ", ".join(f"run {run}: {len(todo)}" for run, todo in expected_todo.items())
    print(f"\nseed {seed}: {len(plans)} shards; left to capture after each kill: {left}; peak {sampler.peak:,} bytes")


def test_a_stop_request_ends_the_wait_for_room_and_the_next_call_resumes(
    target_model: Any, model_folder: Path, tmp_path: Path
) -> None:
    """No trainer: the lane fills, the capture waits, and a stop request ends the wait; what it committed stays, and
    the next call sets out to capture exactly the rest."""
    root = tmp_path / "spool"
    vocab = target_model.config.vocab_size
    settings, _, plans = make_spool(root, vocab)
    backend = TransformersHiddenStates(target_model)

    def run() -> tuple[SpoolCaptureReport, list[dict[str, Any]]]:
        seen: list[dict[str, Any]] = []
        report = capture_to_spool(
            worker.samples(vocab),
            backend,
            root,
            LANE,
            worker.SETTINGS,
            identity=worker.IDENTITY,
            log=lambda line: None,
            progress_every_s=0.0,
            on_progress=seen.append,
            poll_s=0.01,
            stop=lambda: bool(seen) and seen[-1]["waiting"],  # stop once a report says the capture waits for room
        )
        return report, seen

    first, seen = run()
    assert first.stopped and first.pauses == 1 and first.waited_s > 0
    assert 0 < first.extraction.shards_written < len(plans) and seen[-1]["pauses"] == 1
    listed = json.loads((root / LANES / LANE / MANIFEST).read_text())["shards"]
    assert len(listed) == first.extraction.shards_written
    on_disk = sum(p.stat().st_size for p in (root / LANES / LANE).glob("*.safetensors*"))
    assert on_disk == sum(e["bytes"] for e in listed.values()) <= settings.budget_bytes
    again, _ = run()
    assert again.stopped and again.extraction.shards_written == 0
    assert again.todo == [p.name for p in plans if p.name not in listed]
