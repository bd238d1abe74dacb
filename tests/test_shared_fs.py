"""Shared file systems as they are (issue 42, item 3), by fault injection on real files:

- ESTALE and EIO on chosen reads of the files one side replaces and the other polls (every reader of them goes
  through eagle3_resources/hidden_states/shared_fs.py, whose opener the tests swap for one that fails on purpose):
  each reader recovers; a read that keeps failing raises naming the file and the errno;
- the lease (eagle3_resources/hidden_states/lease.py): a lock that lies (`fcntl.lockf` always granted) with two capture
  sides on one lane, and two trainers on one spool: the later side's generation wins and the earlier's next commit
  is refused, nothing of it reaching the lane or the ledger; a writer stalled inside a shard's write or between its
  write and its listing, resuming beside the writer that replaced it; `lockf` answering ENOSYS or ENOLCK (Lustre
  `noflock`, NFS without a lock manager) read as "no locks here", not as a holder;
- the threads that poll these files (the sides' orphan watch, the orchestrator's spool sampler): a read that fails
  for good stops the side with its own exit code and the error in its log, and fails the orchestrating step.
"""

from __future__ import annotations

import builtins
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import polars as pl
import pytest
import spool_worker as worker
from test_spool import fill, small_spool

from eagle3_assets.stages.eagle3_drafter import streaming_sides
from eagle3_assets.stages.eagle3_drafter.spool_data import read_plans
from eagle3_assets.stages.eagle3_drafter.streaming import (
    FillSampler,
    RunFiles,
    StreamingFigures,
    StreamingJob,
    StreamingRequest,
    Watch,
    follow,
)
from eagle3_assets.stages.eagle3_drafter.streaming_plan import Hosts, StreamingInputs, plan_streaming
from eagle3_assets.stages.eagle3_drafter.streaming_sides import (
    EXIT_WATCH_FAILED,
    HEARTBEAT_FILE,
    OrphanWatch,
    last_line,
    read_heartbeat,
)
from eagle3_assets.stages.eagle3_drafter.train import TrainSettings
from eagle3_resources.errors import SharedFileUnreadable, SpoolBusy, SpoolFenced
from eagle3_resources.hidden_states import lane_lock, shared_fs
from eagle3_resources.hidden_states import store as store_module
from eagle3_resources.hidden_states.lane_lock import exclusive, holder, lane_lock_path, trainer_lock_path
from eagle3_resources.hidden_states.lease import TRAINER_LEASE, WRITER_LEASE, Lease, take_lease
from eagle3_resources.hidden_states.spool import (
    LANES,
    LEDGER,
    ORDER,
    PLAN,
    SETTINGS,
    SpoolReader,
    SpoolWriter,
    open_settings,
    read_ledger,
    read_order,
)
from eagle3_resources.hidden_states.store import (
    FORMAT,
    MANIFEST,
    ShardImage,
    ShardPlan,
    StoredSample,
    host_buffer,
    intact,
    padded_size,
    plan_shards,
    read_manifest,
)

pytestmark = pytest.mark.timeout(120)  # a bound against a hang, not a measured time
LANE = "a"


class FailingRead:
    """A real open file whose `read` fails with `code` (what NFS does to a read of a file replaced since it was
    opened); `seek` and the context manager are the file's."""

    def __init__(self, f: IO[bytes], code: int):
        self.f, self.code = f, code

    def __enter__(self) -> FailingRead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()

    def seek(self, offset: int) -> int:
        return self.f.seek(offset)

    def read(self) -> bytes:
        raise OSError(self.code, os.strerror(self.code), self.f.name)


class Faults:
    """The opener shared_fs reads with, swapped in by `install`: real files, whose reads fail with `code` for the
    files named in `times` (name -> how many reads of it fail in a row; None: every one); `failed` lists the failed
    reads' file names, `every` the failures again after each success (a flaky file system, not a blip)."""

    def __init__(self, code: int, times: dict[str, int | None], every: bool = False):
        self.code, self.times, self.every = code, dict(times), every
        self.left = dict(times)
        self.failed: list[str] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> Faults:
        monkeypatch.setattr(shared_fs, "open", self.open, raising=False)
        return self

    def open(self, path: Path, mode: str = "r") -> IO[bytes] | FailingRead:
        f = builtins.open(path, mode)  # a missing file raises here, as it would
        name = Path(path).name
        left = self.left.get(name, 0)
        if left is None or left > 0:
            self.left[name] = None if left is None else left - 1
            self.failed.append(name)
            return FailingRead(f, self.code)
        if self.every:
            self.left[name] = self.times.get(name, 0)
        return f


# -- a spool lane and its writers -------------------------------------------------------------------------------------


def lane_data() -> tuple[list[StoredSample], list[ShardPlan]]:
    data = worker.dataset(24)
    return data, plan_shards(data, worker.HIDDEN, worker.SHARD_BYTES, {"target": "synthetic"})


def new_writer(root: Path, **lease: Any) -> SpoolWriter:
    data, plans = lane_data()
    return SpoolWriter(root, LANE, data, plans, {"format": FORMAT}, poll_s=0.01, **lease)


def built(writer: SpoolWriter) -> tuple[ShardImage, str]:
    """The writer's next shard (one it has not listed), reserved and built in an image: its states in, not written."""
    data, _ = lane_data()
    listed = writer.committer.manifest["shards"]
    plan = next(p for p in writer.todo if p.name not in listed)
    image = ShardImage(host_buffer(max(padded_size(lay.size) for lay in writer.layouts.values()), pin=False))
    assert writer.reserve(plan, stop=lambda: True)
    writer.start(image, plan, data)
    assert image.layout is not None
    for j, i in enumerate(plan.samples):
        a, b = image.layout.row_offsets[j], image.layout.row_offsets[j + 1]
        image.aux[a:b], image.final[a:b] = worker.expected_states(data[i].sample_id, b - a)
    return image, plan.name


def commit_next(writer: SpoolWriter) -> str:
    image, name = built(writer)
    writer.commit(image, direct=False)
    return name


def lane_files(root: Path) -> dict[str, bytes]:
    """Every file of the lane but its lock and lease, by name: what a refused writer must leave as it was."""
    d = root / LANES / LANE
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name not in ("writer.lock", WRITER_LEASE)}


def assert_every_listed_shard_intact(root: Path) -> dict[str, Any]:
    d = root / LANES / LANE
    manifest = read_manifest(d)
    for name, entry in manifest["shards"].items():
        assert intact(d, entry, name, verify=True), f"{name}: not the bytes its manifest entry records"
    return manifest


@pytest.fixture
def lying_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    """`lockf` grants every lock, held or not: a node-local lock seen from two nodes (`nolock`, `local_lock`, Lustre
    `localflock`), or the lock an NFSv4 server gave the next side after a stalled holder's lease expired."""
    monkeypatch.setattr(lane_lock.fcntl, "lockf", lambda fd, cmd: None)


# -- reads retried ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A spool with a lane committed, a trainer that adopted and committed, a side's lock and lease, the heartbeat and
    a progress file: every kind of file the sides poll, each written by its own code (the tests only read them)."""
    root = tmp_path_factory.mktemp("shared")
    small_spool(root)
    fill(root)
    reader = SpoolReader(root, poll_s=0.01)
    step = reader.next_step(stop=lambda: True)
    assert step is not None
    reader.commit(step.after)
    with exclusive(lane_lock_path(root, "b"), "capture of lane b", wait_s=0, log=print):
        pass
    (root / HEARTBEAT_FILE).write_text(json.dumps({"run_id": "r", "beat": 3}))
    (root / "progress.jsonl").write_text('{"steps": 1}\n{"steps": 2}\n')
    return root


# Each file the other side replaces (or appends to), and the reader of it each side polls with.
READERS: dict[str, tuple[str, Callable[[Path], Any]]] = {
    "spool.json": (SETTINGS, open_settings),
    "plan.json": (PLAN, lambda root: read_plans(root, [LANE])),
    "manifest.json": (MANIFEST, lambda root: read_manifest(root / LANES / LANE)),
    "consumer.json": (LEDGER, read_ledger),
    "order.log": (ORDER, read_order),
    "lease": (WRITER_LEASE, lambda root: take_lease(root / LANES / LANE / WRITER_LEASE, "t").generation),
    "heartbeat": (HEARTBEAT_FILE, read_heartbeat),
    "progress": ("progress.jsonl", lambda root: last_line(root / "progress.jsonl")),
    "lock holder": ("writer.lock", lambda root: json.loads(holder(lane_lock_path(root, "b")))["what"]),
}


@pytest.mark.parametrize("code", [errno.ESTALE, errno.EIO], ids=["ESTALE", "EIO"])
@pytest.mark.parametrize("reader", list(READERS))
def test_a_read_failing_with_estale_or_eio_is_tried_again_and_reads_the_file(shared_files, monkeypatch, code, reader):
    name, read = READERS[reader]
    unharmed = read(shared_files)
    if reader == "lease":  # taking a lease moves its generation on: the faulty read must see the next one
        unharmed += 1
    faults = Faults(code, {name: shared_fs.TRIES - 1}).install(monkeypatch)
    assert read(shared_files) == unharmed
    assert faults.failed == [name] * (shared_fs.TRIES - 1)  # the last try read it


@pytest.mark.parametrize("code", [errno.ESTALE, errno.EIO], ids=["ESTALE", "EIO"])
def test_a_read_that_keeps_failing_raises_naming_the_file_and_the_errno(shared_files, monkeypatch, code):
    faults = Faults(code, {LEDGER: None}).install(monkeypatch)
    started = time.monotonic()
    with pytest.raises(SharedFileUnreadable) as e:
        read_ledger(shared_files)
    assert faults.failed == [LEDGER] * shared_fs.TRIES
    assert time.monotonic() - started < 2  # a short backoff: 0.15 s of waits
    assert e.value.errno == code and e.value.filename == str(shared_files / LEDGER)
    assert errno.errorcode[code] in str(e.value) and str(shared_files / LEDGER) in str(e.value)
    assert isinstance(e.value, OSError) and "file system" in e.value.what_to_do


def test_other_errors_are_not_retried(shared_files, tmp_path, monkeypatch):
    faults = Faults(errno.EACCES, {LEDGER: 1}).install(monkeypatch)
    with pytest.raises(PermissionError):
        read_ledger(shared_files)
    assert faults.failed == [LEDGER]
    assert read_ledger(tmp_path)["deleted"] == 0  # missing: each caller's own meaning, here no commit yet


def test_a_capture_lane_and_a_trainer_work_through_a_flaky_file_system(tmp_path, monkeypatch):
    """Every read of every polled file fails once with ESTALE before it succeeds: the trainer hands out the same steps
    and the resumed capture finds the same work as on a sound file system."""

    def run(root: Path) -> tuple[list[Any], list[str]]:
        small_spool(root)
        fill(root)
        reader = SpoolReader(root, poll_s=0.01)
        steps: list[list[tuple[str, int, int]]] = []
        while (step := reader.next_step(stop=lambda: True)) is not None and len(steps) < 6:
            steps.append([(w.sample_id, w.start, w.end) for w in step.windows])
            reader.commit(step.after)
        return steps, [p.name for p in fill(root).todo]

    sound = run(tmp_path / "sound")
    polled = (SETTINGS, PLAN, MANIFEST, LEDGER, ORDER, WRITER_LEASE, TRAINER_LEASE)
    faults = Faults(errno.ESTALE, dict.fromkeys(polled, 1), every=True).install(monkeypatch)
    assert run(tmp_path / "flaky") == sound
    assert set(faults.failed) == set(polled)


# -- the lease ----------------------------------------------------------------------------------------------------


def test_a_lock_that_lies_two_writers_on_one_lane_the_earlier_ones_commit_is_refused(tmp_path, lying_lock):
    small_spool(tmp_path)
    lock, said = lane_lock_path(tmp_path, LANE), list[str]()
    with exclusive(lock, "capture A", wait_s=0, log=said.append) as lease_a:
        a = new_writer(tmp_path, lease=lease_a)
        commit_next(a)
        with exclusive(lock, "capture B", wait_s=0, log=said.append) as lease_b:  # granted: the lock lies
            assert lease_b.generation == lease_a.generation + 1
            b = new_writer(tmp_path, lease=lease_b)
            before = lane_files(tmp_path)
            image, name = built(a)
            with pytest.raises(SpoolFenced, match=f"generation {lease_a.generation} .*capture B"):
                a.commit(image, direct=False)
            assert lane_files(tmp_path) == before, "the refused writer wrote in the lane"
            assert a.used_bytes() == sum(int(e["bytes"]) for e in a.committer.manifest["shards"].values())
            while b.todo and len(b.committer.manifest["shards"]) < len(b.plans):
                commit_next(b)
    manifest = assert_every_listed_shard_intact(tmp_path)
    assert sorted(manifest["shards"]) == sorted(p.name for p in b.plans)
    assert said == []  # nothing waited, nothing said: the lock granted both


def test_a_writer_stalled_between_its_shards_write_and_its_listing_is_refused(tmp_path):
    """A stall between the rename and the manifest write (where a writer thread waits for the group commit): the
    writer started meanwhile removed the unlisted file; the stalled one must not list it over the new manifest."""
    small_spool(tmp_path)
    a = new_writer(tmp_path)
    commit_next(a)
    image, name = built(a)
    entry = a.write(image, direct=False)  # written, renamed into its name, not listed yet
    b = new_writer(tmp_path)  # another capture of the lane starts (and removes the shard nobody listed)
    assert name in b.removed
    with pytest.raises(SpoolFenced):
        a.record(name, entry)
    assert name not in read_manifest(tmp_path / LANES / LANE)["shards"]
    assert not (tmp_path / LANES / LANE / name).exists()
    commit_next(b)
    assert_every_listed_shard_intact(tmp_path)


def test_a_writer_stalled_inside_its_shards_write_never_renames_it_into_place(tmp_path, monkeypatch):
    """A stall while the shard's bytes go to disk (a long write on a slow server; a node that froze): the writer that
    replaced it meanwhile captures the same shard; the stalled one's rename must not put its file under that name."""
    small_spool(tmp_path)
    a = new_writer(tmp_path)
    commit_next(a)
    write_file = store_module.write_file
    taken_over: list[SpoolWriter] = []

    def stalled(*args: Any, **kwargs: Any) -> tuple[str, bool]:
        out = write_file(*args, **kwargs)
        if not taken_over:  # the first write: the new writer starts while it is under way
            taken_over.append(new_writer(tmp_path))
        return out

    monkeypatch.setattr(store_module, "write_file", stalled)
    image, name = built(a)
    with pytest.raises(SpoolFenced):
        a.commit(image, direct=False)
    b = taken_over[0]
    assert commit_next(b) == name  # the new writer captures the shard the stalled one was writing
    assert_every_listed_shard_intact(tmp_path)
    assert name in read_manifest(tmp_path / LANES / LANE)["shards"]


def test_a_capture_process_stopped_and_continued_beside_the_one_that_replaced_it_is_refused(tmp_path):
    """A real stall: capture A, a process of its own (tests/spool_worker.py), is stopped (SIGSTOP) once it has
    committed a shard; capture B starts on the same lane and captures every shard left; A, continued (SIGCONT),
    is refused at its next commit and exits with SpoolFenced, the lane as B left it."""
    small_spool(tmp_path)
    procs = Procs(tmp_path)
    try:
        a = procs.start("A", slow=0.2)  # a shard every 0.2 s: stopped between two, or inside one
        manifest = tmp_path / LANES / LANE / MANIFEST
        deadline = time.monotonic() + 120
        while not (manifest.exists() and read_manifest(manifest.parent)["shards"]):
            assert a.poll() is None and time.monotonic() < deadline, "capture A committed no shard"
            time.sleep(0.05)
        os.kill(a.pid, signal.SIGSTOP)
        b = procs.start("B", slow=0.0)
        assert b.wait(timeout=120) == 0, b.communicate()[0]
        left_by_b = lane_files(tmp_path)
        os.kill(a.pid, signal.SIGCONT)
        out, _ = a.communicate(timeout=120)
    finally:
        procs.kill()
    assert a.returncode != 0 and "SpoolFenced" in out and "capture of lane a" in out, out
    assert lane_files(tmp_path) == left_by_b
    assert sorted(assert_every_listed_shard_intact(tmp_path)["shards"]) == sorted(p.name for p in lane_data()[1])


class Procs:
    """Capture processes on the lane (tests/spool_worker.py produce, as test_spool.py runs them), output captured;
    `kill` ends those still running."""

    def __init__(self, root: Path):
        self.root = root
        self.started: list[subprocess.Popen[str]] = []

    def start(self, name: str, slow: float) -> subprocess.Popen[str]:
        repo = Path(__file__).resolve().parents[1]
        stats = str(self.root / f"{name}.jsonl")
        args = ["produce", str(self.root), LANE, "--samples", "24", "--slow", str(slow), "--stats", stats]
        proc = subprocess.Popen(
            [sys.executable, str(repo / "tests" / "spool_worker.py"), *args],
            cwd=repo,
            env={**os.environ, "PYTHONPATH": str(repo)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.started.append(proc)
        return proc

    def kill(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
            proc.wait()


def test_a_side_whose_lease_went_stale_before_it_opened_the_spool_writes_nothing(tmp_path):
    """It stalled between its lock and its first write: a fresh lane gets no plan or manifest from it, and a torn
    order.log is not cut by a replaced trainer (the new one cuts it)."""
    small_spool(tmp_path)
    stale = take_lease(tmp_path / LANES / LANE / WRITER_LEASE, "capture A")
    take_lease(tmp_path / LANES / LANE / WRITER_LEASE, "capture B")
    with pytest.raises(SpoolFenced):
        new_writer(tmp_path, lease=stale)
    assert sorted(p.name for p in (tmp_path / LANES / LANE).iterdir()) == [WRITER_LEASE]
    fill(tmp_path)
    SpoolReader(tmp_path).next_step(stop=lambda: True)
    torn = (tmp_path / ORDER).read_bytes() + b'["a", "G1-0'  # a kill in the middle of an append
    (tmp_path / ORDER).write_bytes(torn)
    stale = take_lease(tmp_path / TRAINER_LEASE, "trainer A")
    take_lease(tmp_path / TRAINER_LEASE, "trainer B")
    with pytest.raises(SpoolFenced):
        SpoolReader(tmp_path, lease=stale)
    assert (tmp_path / ORDER).read_bytes() == torn


def test_a_lock_that_lies_two_trainers_on_one_spool_the_earlier_one_writes_no_ledger(tmp_path, lying_lock):
    small_spool(tmp_path)
    fill(tmp_path)
    lock = trainer_lock_path(tmp_path)
    with exclusive(lock, "trainer A", wait_s=0, log=print) as lease_a:
        a = SpoolReader(tmp_path, poll_s=0.01, lease=lease_a)
        steps = [a.next_step(stop=lambda: True) for _ in range(3)]
        assert all(steps) and steps[0] is not None and steps[2] is not None
        a.commit(steps[0].after)
        with exclusive(lock, "trainer B", wait_s=0, log=print) as lease_b:
            b = SpoolReader(tmp_path, poll_s=0.01, lease=lease_b)  # resumes at the ledger's position
            ledger, order = (tmp_path / LEDGER).read_bytes(), (tmp_path / ORDER).read_bytes()
            with pytest.raises(SpoolFenced, match="trainer B"):
                a.commit(steps[2].after)  # its checkpoint at a later step: the ledger must not say so
            assert (tmp_path / LEDGER).read_bytes() == ledger
            with pytest.raises(SpoolFenced):  # its next adoption: order.log must not grow
                while a.next_step(stop=lambda: True) is not None:
                    pass
            assert (tmp_path / ORDER).read_bytes() == order
            again = b.next_step(stop=lambda: True)
            assert again is not None and again.position == steps[0].after
            b.commit(again.after)
            assert read_ledger(tmp_path)["position"] == again.after.to_json()


def test_two_sides_taking_the_lease_at_once_read_one_generation_and_the_last_rename_wins(tmp_path, monkeypatch):
    """Where the lock lies both sides may take the lease at the same moment: A has opened the file when B reads it and
    renames generation 2 over it; A reads on (the file it opened: generation 1) and renames its own generation 2 over
    B's. Both hold "generation 2"; the token tells B it lost."""
    path = tmp_path / WRITER_LEASE
    take_lease(path, "an earlier side")
    b_took: list[Lease] = []

    def open_while_b_takes_it(file: Path, mode: str = "r") -> IO[Any]:
        f = builtins.open(file, mode)
        if not b_took:  # A's read of the lease, its file open: B takes the lease now, all of it
            monkeypatch.setattr(shared_fs, "open", builtins.open, raising=False)
            b_took.append(take_lease(path, "side B"))
        return f

    monkeypatch.setattr(shared_fs, "open", open_while_b_takes_it, raising=False)
    a = take_lease(path, "side A")
    b = b_took[0]
    assert a.generation == b.generation == 2
    a.check()
    with pytest.raises(SpoolFenced, match="side B holds generation 2 .*taken by side A"):
        b.check()


@pytest.mark.parametrize("code", [errno.ENOSYS, errno.ENOLCK], ids=["ENOSYS", "ENOLCK"])
def test_a_file_system_without_locks_is_said_and_fenced_by_the_lease_alone(tmp_path, monkeypatch, code):
    def no_locks(fd: int, cmd: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(lane_lock.fcntl, "lockf", no_locks)
    said: list[str] = []
    lock = lane_lock_path(tmp_path, LANE)
    with exclusive(lock, "capture A", wait_s=0, log=said.append) as first:  # wait_s=0: not read as a holder
        with exclusive(lock, "capture B", wait_s=0, log=said.append) as second:
            assert second.generation == first.generation + 1
            second.check()
            with pytest.raises(SpoolFenced):
                first.check()
    assert len(said) == 2 and all(f"gives no locks ({errno.errorcode[code]})" in line for line in said)


def test_a_lock_held_by_another_process_is_still_waited_for(tmp_path, monkeypatch):
    def held(fd: int, cmd: int) -> None:
        raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))

    monkeypatch.setattr(lane_lock.fcntl, "lockf", held)
    with pytest.raises(SpoolBusy), exclusive(lane_lock_path(tmp_path, LANE), "capture", wait_s=0, log=print):
        pass
    assert not (tmp_path / LANES / LANE / WRITER_LEASE).exists()  # no lease without the lock


# -- threads that poll -----------------------------------------------------------------------------------------------


@pytest.fixture
def sigterm() -> Iterator[None]:
    """The test process's SIGTERM handler as it was, after a test that installs an orphan watch."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


def test_an_orphan_watch_whose_heartbeat_read_keeps_failing_stops_its_side_saying_why(tmp_path, monkeypatch, sigterm):
    (tmp_path / HEARTBEAT_FILE).write_text(json.dumps({"run_id": "r", "beat": 1}))
    Faults(errno.ESTALE, {HEARTBEAT_FILE: None}).install(monkeypatch)
    said: list[str] = []
    watch = OrphanWatch(tmp_path, "r", orphan_after_s=60, log=said.append).install()  # a read every second
    try:
        with pytest.raises(SystemExit) as left:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # the side's main thread, working
                time.sleep(0.05)
        assert left.value.code == EXIT_WATCH_FAILED
    finally:
        watch.close()  # before its grace ends: it would end this process
    text = "\n".join(said)
    assert "the watch of the orchestrator's heartbeat failed: SharedFileUnreadable" in text
    assert str(tmp_path / HEARTBEAT_FILE) in text and "ESTALE" in text
    assert f"leaving (exit {EXIT_WATCH_FAILED})" in said[-1]


def test_a_spool_sampler_whose_read_keeps_failing_fails_the_orchestrating_step(tmp_path, monkeypatch):
    small_spool(tmp_path)
    Faults(errno.EIO, {SETTINGS: None}).install(monkeypatch)
    sampler = FillSampler(tmp_path, every_s=0.01)
    files = RunFiles(tmp_path / "run", tmp_path)
    inputs = StreamingInputs(1000, 100, Hosts(1, 1.0), Hosts(1, 1.0), 1e9, 10**7, 1, 10**4)
    figures = StreamingFigures(plan_streaming(inputs), "", 10**7, 10**5)
    running = StillRunning()
    try:
        with pytest.raises(SharedFileUnreadable, match=SETTINGS) as e:
            follow(stand_in_job(tmp_path), running, running, Watch(files, sampler, figures), poll_s=0.01)
    finally:
        sampler.close()
    assert e.value.errno == errno.EIO
    assert any("spool-fill-sampler" in note for note in e.value.__notes__)


class StillRunning:
    """A side that runs on, then (after 1,000 polls, ~5 s of the orchestrator's loop, which polls both sides) ends
    well: the loop must fail before that."""

    name = "side"

    def __init__(self) -> None:
        self.polls = 0

    def poll(self) -> int | None:
        self.polls += 1
        return None if self.polls < 1000 else 0

    def stop(self, grace_s: float = 30.0) -> None:
        pass

    def describe(self) -> str:
        return "a side that runs on"

    def tail(self) -> str:
        return ""


def stand_in_job(root: Path) -> StreamingJob:
    """A streaming job's fields as `follow` reads them (its log, its progress interval); the rest placeholders."""
    return StreamingJob(
        merged=pl.DataFrame(),
        merged_path=root / "merged.parquet",
        target_folder=root,
        out_dir=root / "drafter",
        settings=TrainSettings(),
        requested_draft_vocab=8,
        request=StreamingRequest(10**7, 1, 10**4, 1.0, 1.0, 1e9, {}),
        identity={},
        resources={},
        log=print,
        progress_every_s=3600,
    )


def test_a_heartbeat_whose_write_fails_is_raised_by_the_orchestrator(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    beat = streaming_sides.Heartbeat(folder, "r", every_s=0.01)
    shutil.rmtree(folder)  # the run's folder gone from under it: the next beat fails for good
    deadline = time.monotonic() + 5
    while beat.beat < 3 and time.monotonic() < deadline and not beat_failed(beat):
        time.sleep(0.01)
    with pytest.raises(FileNotFoundError) as e:
        beat.raise_if_failed()
    assert any("heartbeat" in note for note in e.value.__notes__)
    beat.close()


def beat_failed(beat: streaming_sides.Heartbeat) -> bool:
    try:
        beat.raise_if_failed()
    except FileNotFoundError:
        return True
    return False
