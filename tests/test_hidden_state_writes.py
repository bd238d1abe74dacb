"""How a shard reaches the disk: its safetensors image built in place (read back by safetensors' own loader),
the checksum taken while writing (against a hash of the file read back), stores checksummed with sha256 before
xxh3 (still read and verified), the manifest's group commit, a write interrupted by an exception or by SIGKILL
(nothing listed, the resume redoes it), and the finiteness check that travels with the states."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import TypedDict

import pytest
import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import load_file
from support import stop_group, wait_for

from eagle3_resources.hidden_states import extract as extract_module
from eagle3_resources.hidden_states import store as store_module
from eagle3_resources.hidden_states.extract import (
    ExtractionOptions,
    HostBuffers,
    StoreSettings,
    capture_to_spool,
    extract_to_store,
)
from eagle3_resources.hidden_states.spool import LANES, SpoolSettings, create_spool
from eagle3_resources.hidden_states.store import (
    ALIGN,
    MANIFEST,
    HiddenStateStore,
    ShardCommitter,
    ShardImage,
    StoredSample,
    file_checksum,
    host_buffer,
    plan_mixed_shards,
    plan_shards,
    read_manifest,
    write_file,
)
from eagle3_resources.hidden_states.transformers_backend import TransformersHiddenStates

REPO = Path(__file__).resolve().parents[1]


class Roomy(TypedDict):
    """StoreSettings' disk figures for a test that is not about the disk check."""

    free_bytes: int
    reserve_bytes: int


ROOMY: Roomy = {"free_bytes": 10**12, "reserve_bytes": 0}
LIBRARY_HASH = {"xxh3_128": lambda b: xxhash.xxh3_128(b).hexdigest(), "sha256": lambda b: hashlib.sha256(b).hexdigest()}


def file_xxh3(path: Path) -> str:
    """The file's XXH3-128, by the library on the bytes read back (not by the store's code)."""
    return xxhash.xxh3_128(path.read_bytes()).hexdigest()


def make_samples(n: int, vocab: int) -> list[StoredSample]:
    g = torch.Generator().manual_seed(11)
    out = []
    for i in range(n):
        L = (7, 30, 3, 51, 12)[i % 5]
        ids = torch.randint(0, vocab, (L,), generator=g).tolist()
        out.append(
            StoredSample(f"S/{i:03d}", "eval" if i % 3 == 0 else "train", ids, [i % 2] * (L // 2) + [1] * (L - L // 2))
        )
    return out


def test_a_shard_is_a_safetensors_file_holding_what_was_captured(target_model, tmp_path):
    """safetensors' own loader reads every shard; each sample's rows are the backend's states for it alone, in bf16."""
    backend = TransformersHiddenStates(target_model)
    samples = make_samples(11, target_model.config.vocab_size)
    extract_to_store(
        samples,
        backend,
        tmp_path,
        StoreSettings(shard_bytes=40_000, batch_tokens=64, **ROOMY),
        identity={},
        progress_every_s=3600,
    )
    shards = read_manifest(tmp_path)["shards"]
    assert len(shards) > 2
    seen = set()
    for name in shards:
        tensors = load_file(tmp_path / name)
        with safe_open(tmp_path / name, framework="pt") as f:
            meta = json.loads(f.metadata()["eagle3"])
        assert sorted(tensors) == ["aux_hidden_states", "final_hidden_state", "input_ids", "loss_mask", "offsets"]
        offsets = tensors["offsets"].tolist()
        for j, sid in enumerate(meta["sample_ids"]):
            s = next(x for x in samples if x.sample_id == sid)
            a, b = offsets[j], offsets[j + 1]
            assert meta["splits"][j] == s.split
            assert tensors["input_ids"][a:b].tolist() == list(s.input_ids)
            assert tensors["loss_mask"][a:b].tolist() == list(s.loss_mask)
            aux, final = backend.extract(list(s.input_ids))  # alone, unpadded: the captured states
            assert tensors["aux_hidden_states"].dtype == torch.bfloat16
            torch.testing.assert_close(
                tensors["aux_hidden_states"][a:b].float(), aux.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2
            )
            torch.testing.assert_close(
                tensors["final_hidden_state"][a:b].float(), final.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2
            )
            seen.add(sid)
        assert offsets[-1] == tensors["input_ids"].shape[0] == tensors["aux_hidden_states"].shape[0]
    assert seen == {s.sample_id for s in samples}


@pytest.mark.parametrize("checksum", ["xxh3_128", "sha256"])
@pytest.mark.parametrize("direct", [True, False])
def test_the_hash_taken_while_writing_is_the_files(tmp_path, direct, checksum):
    """Chunks, an unaligned tail (written padded under O_DIRECT, then cut), the hash of exactly the file's bytes,
    with xxh3 (new shards) and sha256 (the stores written before): the library's own digest of the bytes read back."""
    size = 5 * ALIGN + 123
    buffer = host_buffer(6 * ALIGN, pin=False)
    buffer.random_(0, 256, generator=torch.Generator().manual_seed(5))
    # numpy's stubs declare ndarray's __buffer__ for Python 3.12+ only; the buffer protocol is there on 3.11 too
    data = memoryview(buffer.numpy())  # type: ignore[arg-type]
    digest, used_direct = write_file(tmp_path / "f", data, size, direct=direct, chunk=2 * ALIGN, checksum=checksum)
    on_disk = (tmp_path / "f").read_bytes()
    assert on_disk == bytes(data[:size])
    assert digest == LIBRARY_HASH[checksum](on_disk) == file_checksum(tmp_path / "f", checksum)
    assert used_direct == (direct and hasattr(os, "O_DIRECT") and used_direct)  # O_DIRECT only when asked
    # Buffered from a bytes object (not aligned, no room for padding): the same bytes, the same hash.
    digest2, used2 = write_file(
        tmp_path / "g", memoryview(bytes(data[:size])), direct=direct, chunk=3 * ALIGN, checksum=checksum
    )
    assert not used2 and digest2 == digest and (tmp_path / "g").read_bytes() == on_disk


def test_without_xxhash_new_shards_are_sha256_and_say_so(tmp_path):
    """A bare GPU machine (the device check: torch alone) has no xxhash: shards are then hashed with sha256 and
    named sha256, and an xxh3 entry asks for the package instead of passing as unverifiable."""
    script = f"""
import hashlib, sys
from pathlib import Path
sys.modules["xxhash"] = None  # import xxhash raises ImportError, as where it is not installed
from eagle3_resources.hidden_states.store import CHECKSUM, write_file, recorded_checksum
assert CHECKSUM == "sha256", CHECKSUM
data = memoryview(bytes(range(256)) * 100)
digest, _ = write_file(Path({str(tmp_path / "f")!r}), data, direct=False)
assert digest == hashlib.sha256(bytes(data)).hexdigest()
assert recorded_checksum({{"sha256": digest}}) == ("sha256", digest)
try:
    recorded_checksum({{"xxh3_128": "00"}})
except RuntimeError as e:
    assert "pip install xxhash" in str(e), e
else:
    raise AssertionError("an xxh3 entry passed without xxhash")
print("ok")
"""
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stdout + p.stderr


def test_a_store_checksummed_with_sha256_stays_readable_and_verifiable(target_model, tmp_path):
    """A store committed before xxh3 lists `sha256` per shard. It is read as it is, `verify_on_resume` checks each
    shard with the algorithm its entry names (a rotten byte is caught and that shard alone redone, now with xxh3), and
    the shards kept keep their sha256 entries."""
    backend = TransformersHiddenStates(target_model)
    samples = make_samples(10, target_model.config.vocab_size)
    settings = StoreSettings(shard_bytes=30_000, batch_tokens=64, verify_on_resume=True, **ROOMY)
    extract_to_store(samples, backend, tmp_path, settings, identity={}, progress_every_s=3600)
    manifest = read_manifest(tmp_path)
    names = sorted(manifest["shards"])
    assert len(names) >= 3 and all(
        set(e) == {"key", "xxh3_128", "bytes", "samples", "tokens"} for e in manifest["shards"].values()
    )
    for name, entry in manifest["shards"].items():  # the entries as the sha256 store wrote them (the same shard files)
        manifest["shards"][name] = {
            "key": entry["key"],
            "sha256": hashlib.sha256((tmp_path / name).read_bytes()).hexdigest(),
            "bytes": entry["bytes"],
            "samples": entry["samples"],
            "tokens": entry["tokens"],
        }
    (tmp_path / MANIFEST).write_text(json.dumps(manifest, indent=2))
    old = {n: dict(e) for n, e in manifest["shards"].items()}
    store = HiddenStateStore(tmp_path)
    assert len(store) == len(samples) and store[samples[3].sample_id]["input_ids"].tolist() == list(
        samples[3].input_ids
    )
    store.close()

    report = extract_to_store(samples, backend, tmp_path, settings, identity={}, progress_every_s=3600)
    assert (report.shards_written, report.shards_skipped) == (0, len(names))  # every sha256 verified
    assert read_manifest(tmp_path)["shards"] == old

    rotten = tmp_path / names[1]
    data = bytearray(rotten.read_bytes())
    data[-3] ^= 0x10  # one bit of a loss-mask byte: the size and the header are intact
    rotten.write_bytes(bytes(data))
    report = extract_to_store(samples, backend, tmp_path, settings, identity={}, progress_every_s=3600)
    assert (report.shards_written, report.shards_skipped) == (1, len(names) - 1)
    after = read_manifest(tmp_path)["shards"]
    assert after[names[1]]["xxh3_128"] == file_xxh3(rotten) and "sha256" not in after[names[1]]
    assert {n: e for n, e in after.items() if n != names[1]} == {n: e for n, e in old.items() if n != names[1]}
    assert (
        hashlib.sha256(rotten.read_bytes()).hexdigest() == old[names[1]]["sha256"]
    )  # redone: the same bytes as before


def test_a_shard_rotten_on_disk_is_caught_by_its_xxh3_and_redone(target_model, tmp_path):
    backend = TransformersHiddenStates(target_model)
    samples = make_samples(10, target_model.config.vocab_size)
    settings = StoreSettings(shard_bytes=30_000, batch_tokens=64, **ROOMY)
    extract_to_store(samples, backend, tmp_path, settings, identity={}, progress_every_s=3600)
    before = read_manifest(tmp_path)["shards"]
    name = sorted(before)[0]
    data = bytearray((tmp_path / name).read_bytes())
    data[len(data) // 2] ^= 0x01  # a bit of a state in the middle of the file
    (tmp_path / name).write_bytes(bytes(data))
    kept = extract_to_store(samples, backend, tmp_path, settings, identity={}, progress_every_s=3600)
    assert kept.shards_written == 0  # trusted by size alone: the manifest's checksum is read only when verifying
    redone = extract_to_store(
        samples, backend, tmp_path, replace(settings, verify_on_resume=True), identity={}, progress_every_s=3600
    )
    assert (redone.shards_written, redone.shards_skipped) == (1, len(before) - 1)
    assert read_manifest(tmp_path)["shards"] == before and file_xxh3(tmp_path / name) == before[name]["xxh3_128"]


def test_writers_finishing_together_share_a_manifest_write_and_return_once_it_is_durable(tmp_path, monkeypatch):
    """`record` returns only when the manifest on disk lists the shard; while one manifest write is under way the
    others' shards wait for the next, which lists them all; a failed manifest write fails its writer only."""
    writes, failed, first_write = [], [], threading.Event()
    real = store_module.write_text_atomic
    committer = ShardCommitter(tmp_path, {"shards": {}})
    committer.save_manifest()

    def write_text_atomic(path, text):
        writes.append(sorted(json.loads(text)["shards"]))
        if len(writes) == 1:  # writer 0's: it fails once the seven others have handed in their shards
            first_write.set()
            deadline = time.monotonic() + 60
            while len(committer.manifest["shards"]) < 8 and time.monotonic() < deadline:
                time.sleep(0.01)
            failed.append(threading.current_thread().name)
            raise OSError(28, "No space left on device")
        real(path, text)

    monkeypatch.setattr(store_module, "write_text_atomic", write_text_atomic)
    seen, errors = {}, {}

    def writer(i: int) -> None:
        if i > 0:
            first_write.wait(60)  # writer 0's manifest write is under way
        try:
            committer.record(f"s{i}", {"key": str(i)})
        except OSError as e:
            errors[threading.current_thread().name] = e
            return
        seen[i] = sorted(read_manifest(tmp_path)["shards"])  # right after record returned

    threads = [threading.Thread(target=writer, args=(i,), name=f"w{i}", daemon=True) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    assert not any(th.is_alive() for th in threads)
    assert list(errors) == failed == ["w0"]  # only the writer whose manifest write failed sees the error
    assert all(f"s{i}" in listed for i, listed in seen.items()) and sorted(seen) == list(range(1, 8))
    assert len(writes) == 2 and writes[1] == [f"s{i}" for i in range(8)]  # the second write lists all eight
    assert sorted(read_manifest(tmp_path)["shards"]) == [f"s{i}" for i in range(8)]


def test_the_extraction_leaves_torchs_thread_count_as_it_found_it(target_model, tmp_path):
    """The CPU staging runs on one thread (extract.one_thread) and gives the caller's count back."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        extract_to_store(
            make_samples(5, target_model.config.vocab_size),
            TransformersHiddenStates(target_model),
            tmp_path,
            StoreSettings(shard_bytes=20_000, batch_tokens=64, **ROOMY),
            identity={},
            progress_every_s=3600,
        )
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


class FailingWrites:
    """The store's `os` with one write failing: the chunk at offset `at` of the file named `name` (an I/O error in
    the middle of that shard, whichever other shard is written meanwhile). Also counts the files open for writing
    at once."""

    def __init__(self, name: str, at: int):
        self.name, self.at = name, at
        self.failed = False
        self.names: dict[int, str] = {}  # the fds open for writing: their file's name
        self.most_open = 0
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(os, name)

    def open(self, path, flags, *mode):
        fd = os.open(path, flags, *mode)
        if flags & (os.O_WRONLY | os.O_RDWR):
            with self._lock:
                self.names[fd] = Path(path).name
                self.most_open = max(self.most_open, len(set(self.names.values())))
        return fd

    def close(self, fd):
        with self._lock:
            self.names.pop(fd, None)
        os.close(fd)

    def pwrite(self, fd, data, offset):
        time.sleep(0.01)  # slow enough that the next shard's capture ends while this one is written
        if self.names.get(fd) == self.name and offset == self.at and not self.failed:
            self.failed = True
            os.pwrite(fd, data, offset)  # this chunk reached the file, then the device failed
            raise OSError(5, "Input/output error")
        return os.pwrite(fd, data, offset)


def test_an_error_mid_write_lists_nothing_and_the_resume_redoes_the_shard(target_model, tmp_path, monkeypatch):
    backend = TransformersHiddenStates(target_model)
    samples = make_samples(10, target_model.config.vocab_size)
    settings = StoreSettings(shard_bytes=30_000, batch_tokens=64, writers=1, **ROOMY)
    extract_to_store(samples, backend, tmp_path / "whole", settings, identity={}, progress_every_s=3600)
    whole = {n: e["xxh3_128"] for n, e in read_manifest(tmp_path / "whole")["shards"].items()}
    assert len(whole) >= 3

    monkeypatch.setattr(store_module, "WRITE_CHUNK", ALIGN)
    failed = sorted(whole)[1]
    writes = FailingWrites(failed + ".tmp", ALIGN)  # the second shard's second chunk
    monkeypatch.setattr(store_module, "os", writes)
    root = tmp_path / "failed"
    with pytest.raises(RuntimeError, match="Input/output error"):
        extract_to_store(samples, backend, root, settings, identity={}, progress_every_s=3600)
    assert writes.most_open == 1  # writers=1: one shard written at a time
    listed = {n: e["xxh3_128"] for n, e in read_manifest(root)["shards"].items()}
    assert sorted(whole)[0] in listed and failed not in listed and len(listed) < len(whole)
    assert all(
        whole[n] == digest == file_xxh3(root / n) for n, digest in listed.items()
    )  # shards already finished were kept
    partial = root / (failed + ".tmp")
    assert partial.exists() and 0 < partial.stat().st_size  # half a shard on disk, under its temporary name
    assert not (root / failed).exists()

    monkeypatch.setattr(store_module, "os", os)
    report = extract_to_store(samples, backend, root, settings, identity={}, progress_every_s=3600)
    assert report.shards_skipped == len(listed) and report.shards_written == len(whole) - len(listed)
    assert partial.name in report.removed_untrusted
    assert {n: e["xxh3_128"] for n, e in read_manifest(root)["shards"].items()} == whole
    assert sorted(p.name for p in root.iterdir()) == sorted([*whole, MANIFEST])


def test_an_extraction_runs_once_and_a_new_one_resumes_after_an_error(target_model, tmp_path, monkeypatch):
    """An `Extraction` holds one run's state (capture-order tickets, writer failures): run again after a write error,
    it says to make a new one (it would otherwise raise the old error, or wait for a capture-order turn already
    past), and a new one finishes the store."""
    backend = TransformersHiddenStates(target_model)
    samples = make_samples(10, target_model.config.vocab_size)
    settings = StoreSettings(shard_bytes=30_000, batch_tokens=64, writers=1, **ROOMY)
    planned = [p.name for p in plan_shards(samples, target_model.config.hidden_size, 30_000, {})]
    assert len(planned) >= 3
    monkeypatch.setattr(store_module, "WRITE_CHUNK", ALIGN)
    monkeypatch.setattr(store_module, "os", FailingWrites(planned[1] + ".tmp", ALIGN))
    options = ExtractionOptions({}, log=lambda line: None, progress_every_s=3600)
    extraction = extract_module.Extraction(samples, backend, tmp_path, settings, options)
    with pytest.raises(RuntimeError, match="Input/output error"):
        extraction.run()
    listed = list(read_manifest(tmp_path)["shards"])
    assert planned[0] in listed and planned[1] not in listed

    monkeypatch.setattr(store_module, "os", os)
    with pytest.raises(RuntimeError, match="runs once"):
        extraction.run()
    report = extract_module.Extraction(samples, backend, tmp_path, settings, options).run()
    assert report.shards_written == len(planned) - len(listed)
    assert sorted(read_manifest(tmp_path)["shards"]) == planned


class HeldBack(HostBuffers):
    """Host buffers that give shard `hold`'s buffer back (after its write, before it is recorded) only once the shards
    `until` have given theirs: those are written, and ready to be recorded, before it."""

    def __init__(self, count: int, hold: str, until: list[str]):
        super().__init__(count)
        self.hold, self.until = hold, set(until)
        self.given: set[str] = set()
        self.held = False  # whether `until` came back while `hold` waited (else the test proves nothing)
        self._gives = threading.Condition()

    def give(self, image: ShardImage) -> None:
        assert image.plan is not None  # a started image
        with self._gives:
            self.given.add(image.plan.name)
            self._gives.notify_all()
            if image.plan.name == self.hold:
                self.held = self._gives.wait_for(lambda: self.until <= self.given, timeout=60)
        super().give(image)


@pytest.mark.parametrize("writers", [1, 3])
@pytest.mark.parametrize("sink", ["store", "spool"])
def test_shards_are_recorded_in_plan_order_when_later_ones_finish_writing_first(target_model, tmp_path, sink, writers):
    """The first shard's writer is held after its write until the next `writers` shards are written (all at once
    when writers > 1): the manifest (a spool lane's: the order its trainer adopts them) still lists every shard in
    plan order, so two runs of the same data commit the same order."""
    samples = make_samples(12, target_model.config.vocab_size)
    settings = StoreSettings(shard_bytes=16_000, batch_tokens=64, writers=writers, **ROOMY)
    hidden = target_model.config.hidden_size
    # the plan the sink makes: a spool lane's shards interleave the datasets (seeded by the spool's seed, 0 here)
    plans = (
        plan_shards(samples, hidden, 16_000, {})
        if sink == "store"
        else plan_mixed_shards(samples, hidden, 16_000, {}, 0)
    )
    planned = [p.name for p in plans]
    assert len(planned) >= writers + 2
    buffers = HeldBack(writers + 1, planned[0], planned[1 : 1 + writers])
    backend = TransformersHiddenStates(target_model)
    options = ExtractionOptions({"target": "t"}, log=lambda line: None, progress_every_s=3600, buffers=buffers)
    if sink == "store":
        extract_to_store(samples, backend, tmp_path, settings, options)
        manifest = read_manifest(tmp_path)
    else:
        spool = SpoolSettings(
            {"lane": 10**9}, 1, max_len=16, batch_tokens=64, seed=0, hidden_size=target_model.config.hidden_size
        )
        create_spool(tmp_path, spool)
        capture_to_spool(samples, backend, tmp_path, "lane", settings, options)
        manifest = read_manifest(tmp_path / LANES / "lane")
    assert buffers.held, "the later shards were not written while the first one was held"
    assert manifest["planned_shards"] == planned
    assert list(manifest["shards"]) == planned


def test_shards_written_early_join_the_manifest_write_that_follows_their_turn(target_model, tmp_path, monkeypatch):
    """Held back as above, the first shard is listed alone; the three written before it, waiting for their turn, are
    listed as soon as it is (not once its manifest write is durable) and share the next manifest write."""
    samples = make_samples(12, target_model.config.vocab_size)
    planned = [p.name for p in plan_shards(samples, target_model.config.hidden_size, 16_000, {"target": "t"})]
    buffers = HeldBack(4, planned[0], planned[1:4])
    committers: list[ShardCommitter] = []

    class Kept(ShardCommitter):
        def __init__(self, root: Path, manifest: dict) -> None:
            super().__init__(root, manifest)
            committers.append(self)

    real, writes = store_module.write_text_atomic, []

    def write_text_atomic(path, text):
        listed = list(json.loads(text)["shards"])
        if listed == planned[:1]:  # the first shard's write: the next three are listed meanwhile
            deadline = time.monotonic() + 30
            while not all(n in committers[0].manifest["shards"] for n in planned[1:4]) and time.monotonic() < deadline:
                time.sleep(0.01)
        if listed:
            writes.append(listed)
        real(path, text)

    monkeypatch.setattr(extract_module, "ShardCommitter", Kept)
    monkeypatch.setattr(store_module, "write_text_atomic", write_text_atomic)
    settings = StoreSettings(shard_bytes=16_000, batch_tokens=64, writers=3, **ROOMY)
    backend = TransformersHiddenStates(target_model)
    extract_to_store(
        samples, backend, tmp_path, settings, identity={"target": "t"}, progress_every_s=3600, buffers=buffers
    )
    assert buffers.held and writes[0] == planned[:1]
    assert writes[1][:4] == planned[:4]  # one manifest write for the three
    assert list(read_manifest(tmp_path)["shards"]) == planned


def worker(model_folder: Path, root: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "hidden_states_worker.py"), str(model_folder), str(root), *extra],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kill_9_in_the_middle_of_a_shard_write(target_resource, tokenizer_resource, tmp_path):
    """SIGKILL while a shard's bytes are going to disk: neither it nor the shards written after it are listed (shards
    are listed in plan order), and the resume redoes them all."""
    folder = target_resource.folder(tokenizer_resource)
    root = tmp_path / "killed"
    hang_at = 2 * ALIGN  # the second shard file written is held for good once its third chunk is on disk
    proc = worker(folder, root, "--hang-write-at", str(hang_at))
    assert proc.stdout is not None  # stdout=PIPE

    def held_and_settled() -> Path | None:
        """The held shard's partial file, once it is the only shard mid-write (its third chunk on disk), the shards
        before it in plan order are listed and one after it is written: shards are listed in plan order, so that one
        waits for the held one's turn. (Only the held file stays a .tmp once a later shard is written.)"""
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        partials = list(root.glob("*.safetensors.tmp"))
        try:
            if not (root / MANIFEST).exists() or len(partials) != 1 or partials[0].stat().st_size != hang_at + ALIGN:
                return None
        except FileNotFoundError:  # renamed meanwhile: not the held one
            return None
        manifest = read_manifest(root)
        planned, k = manifest["planned_shards"], manifest["planned_shards"].index(partials[0].name.removesuffix(".tmp"))
        if list(manifest["shards"]) == planned[:k] and any((root / n).exists() for n in planned[k + 1 :]):
            return partials[0]
        return None

    try:
        wait_for(lambda: held_and_settled() is not None, 600, "the held shard mid-write, a later one written")
        partial = held_and_settled()
        assert partial is not None  # nothing moves while the held write is held
        os.killpg(proc.pid, signal.SIGKILL)  # in the middle of that shard's write, whatever the scheduling
        proc.wait()
    finally:
        stop_group(proc)
    manifest = read_manifest(root)
    listed, planned = manifest["shards"], manifest["planned_shards"]
    target = partial.name.removesuffix(".tmp")
    k = planned.index(target)
    assert list(listed) == planned[:k]  # in plan order: none after the held one, though some are written
    assert any((root / n).exists() for n in planned[k + 1 :])
    for name, entry in listed.items():  # what is listed is whole
        assert file_xxh3(root / name) == entry["xxh3_128"]

    resumed = worker(folder, root)
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out
    final = read_manifest(root)["shards"]
    assert f"{len(planned) - len(listed)} written, {len(listed)} kept" in out
    assert target in final and file_xxh3(root / target) == final[target]["xxh3_128"]
    assert sorted(p.name for p in root.iterdir()) == sorted([*planned, MANIFEST])
    assert len(HiddenStateStore(root)) == 24


class Poisoned:
    """Wraps a backend: NaN in one sample's aux, +inf in another's final, huge but finite values in a third."""

    def __init__(self, inner, nan_id: list[int], inf_id: list[int], huge_id: list[int]):
        self.inner, self.nan_id, self.inf_id, self.huge_id = inner, nan_id, inf_id, huge_id

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def extract_batch(self, sequences):
        out = []
        for s, (a, f) in zip(sequences, self.inner.extract_batch(sequences), strict=True):  # one per sequence
            a, f = a.clone(), f.clone()
            if s == self.nan_id:
                a[len(s) // 2, 5] = float("nan")
            if s == self.inf_id:
                f[-1, 0] = float("inf")
            if s == self.huge_id:  # near bf16's largest finite value: a sum would overflow, yet all is finite
                a[:, :] = 3.0e38
            out.append((a, f))
        return out


def test_non_finite_states_are_caught_where_they_are_computed(target_model, tmp_path):
    samples = make_samples(9, target_model.config.vocab_size)
    nan, inf, huge = samples[1], samples[4], samples[6]
    backend = Poisoned(
        TransformersHiddenStates(target_model), list(nan.input_ids), list(inf.input_ids), list(huge.input_ids)
    )
    report = extract_to_store(
        samples,
        backend,
        tmp_path,
        StoreSettings(shard_bytes=20_000, batch_tokens=96, **ROOMY),
        identity={},
        progress_every_s=3600,
    )
    assert sorted(report.nan_samples) == sorted([nan.sample_id, inf.sample_id])
    store = HiddenStateStore(tmp_path)
    assert store[huge.sample_id]["aux_hidden_states"].float().isfinite().all()  # stored as it came, and finite
    assert not store[nan.sample_id]["aux_hidden_states"].float().isfinite().all()
