"""The spool: the hidden-state store used as a bounded queue between capture and training (issue 27).

Capture workers ("lanes", one per capture host) commit shards with the store's own machinery
(`ShardCommitter`: the file written, fsynced and renamed, then listed in the lane's manifest with
its checksum); one trainer takes them in commit order, trains each row `passes` times, and deletes a
shard once all its passes are durable in the trainer's position. Capture pauses while its lane's
share of the byte budget is full, training waits while no shard is committed. The trainer may be several
processes (torchrun DDP): rank 0 alone is the spool's reader (`SpoolReader`: it adopts, commits and deletes);
every other rank is a `SpoolFollower`, which only reads the shard files rank 0 names to it (see "Several ranks").

Layout under `root` (a directory both sides see: local disk, NFS, a ReadWriteMany volume):

    spool.json                  settings, written once: byte budget, each lane's share of it, passes,
                                window length, step tokens, seed, hidden size, shards per mix
    lanes/<lane>/               one store per capture worker (manifest.json, shards, as store.py)
        plan.json               the lane's capture plan: every shard's name, key, tokens, file bytes,
                                windows and samples of each dataset (PLAN_FORMAT)
    order.log                   the trainer's adoption log: one JSON line per shard taken, appended and
                                fsynced before any of its rows is handed out
    consumer.json               the trainer's ledger: its durable position, shards deleted, passes done

Every file has ONE writer: a lane's folder its capture worker, order.log and consumer.json the trainer (its rank
0 when it is several processes; a follower rank writes nothing under `root`).
Nothing relies on a lock across hosts: each writer holds a lease (lease.py: a generation number in
`lanes/<lane>/writer.lease`, `trainer.lease`) and checks it before every commit, so a second writer (a stalled one
resuming, or one beside it where the file system's lock lies) is refused (`SpoolFenced`) instead of writing beside the
newest. Every read of a file the other side writes retries ESTALE and EIO (shared_fs.py), as NFS and Lustre give them
for a moment. What is assumed of the file system: a rename over a file is atomic
for readers (they see the old file or the new, as NFS's close-to-open consistency gives a reader that
opens the file after the rename), fsync of a file and of a directory makes a write and a rename durable,
and an append by the single writer followed by fsync is durable. A reader that sees an older version of a
file than the newest (NFS attribute caching) only sees less progress: the trainer fewer committed shards
(it waits a little longer), a capture worker fewer deletions (it counts more bytes than are on disk, and
waits). Every stale view errs on the safe side, so the budget is never exceeded and nothing is lost.

The schedule. Shards are numbered in the order the trainer adopts them (order.log) and that order is cut into mixes of
`mix_shards` consecutive shards (the last may be short); the trainer's work is cut into slots: slot i trains pass p of
every shard of mix i - p for every p < passes (the mixes that exist), its windows shuffled together by (seed, i) and
packed into steps of at most `batch_tokens` tokens. So each shard is trained `passes` times, in `passes` consecutive
slots, shuffled with the other shards of its mix and its neighbours' other passes, and is done (deletable) once slot `m
+ passes - 1` is (m its mix); the trainer holds at most `passes` mixes on disk (and in memory: a rank reads of a shard
only the chunks its steps' rows lie in, each once, verified against its chunk's digest, and serves them from memory for
all its passes (`ShardRows`), so the spool carries each byte once in and at most once out to each rank; with the slot
before's, kept for a trainer that prefetches, `passes + 1` mixes). A slot is a function of the adopted order, so it is
the same in every process and after every restart. Why mixes: capture plans shards that interleave the datasets
(store.plan_mixed_shards), but a shard holds a few samples (~7 of Kimi-K2.5 at 4 GB); a mix of several is the shuffle
window offline training has over the whole set, as wide as the budget and memory allow (`default_mix_shards`).
`mix_shards` 1 is the schedule of spools of format 1.

The position. `Position(slot, step)`: every step before it is trained. The trainer records the position
after a step in its own checkpoint (written atomically with the weights) and only then calls
`SpoolReader.commit(position)`, which writes consumer.json atomically and then deletes the shards done.
Exactly-once means: the windows counted in the durable position are exactly those whose updates are in the
durable weights. A kill after the checkpoint but before `commit` leaves consumer.json behind; the restarted
trainer passes its checkpoint's position and the reader catches up (commits it). Steps trained after the
last checkpoint died with the process that trained them and are trained again from the checkpoint, which
is an exact resume, not a repeat: no update of the surviving weights saw them. A checkpoint older than
consumer.json's position is refused (its shards may be deleted).

The budget. A lane's bytes = its committed shards not yet deleted (the file bytes in its manifest, minus
the shards the trainer's ledger says are deleted: deletions are recorded only after the unlink) + the
shards reserved by its writers (their padded size: an O_DIRECT write lays down the padded tail before
truncating it). A writer reserves before writing a shard and waits while reservation would exceed the
lane's share. So the bytes of shard files under `root` (including `.tmp` files of writes in flight) never
exceed the budget. A lane's share must hold `passes x mix_shards + 1` of its largest shards (`min_lane_bytes`):
the `passes` mixes the trainer may be holding from it and the one being written. Below that, capture and
training could wait for each other forever; `SpoolTooSmall` refuses it before anything starts. (At the minimum,
when the trainer waits for mix i + 1 its checkpoint deletes mix i - passes + 1, which leaves room for all of
mix i + 1: capture and training take turns inside a mix. `default_mix_shards` leaves room for a whole mix more,
so capture writes the next mix while the trainer trains this one.)

Several ranks. Under torchrun the trainer's data parallel ranks share one schedule: rank 0's `SpoolReader` decides every
step (`try_next_step`, which never waits and reads no shard bytes: a step is planned from the manifest entries' index,
each shard's sample ids and row offsets) and hands it to the others with the references of its shards (`shard_ref`:
lane, name, key and the manifest entry, chunk digests and index included). Every rank, rank 0 too, reads only the rows
of its share of each step (`read_step`: the chunks they lie in, each chunk verified against its digest before a row of
it is used, so a part of a shard is verifiable and a damaged chunk no row of a rank lies in is never read by that rank),
on a prefetcher several steps ahead (spool_prefetch.py), and keeps what it read until the shard's passes are done, so it
reads each chunk at most once (`reads`: each rank's record of the shards it read, at the first step whose share needed
them). A shard listed without chunk digests (a spool of the version before) is refused by name. Deletion stays safe:
rank 0 deletes only shards whose passes are all before the committed position, and it commits a position only after the
trainer's checkpoint at it, when every step before it has been trained by every rank (each step ends in the gradients'
all-reduce, which no rank passes before every rank has read its share of that step's data, and the checkpoint's barrier
follows). A shard a rank still needs is one of a step not yet trained, so it is not deleted; the steps a rank has read
ahead are after the position, so their shards are not deleted either. The wait for capture is decided by rank 0 and told
to every rank, because the trainer's checkpoint on waiting (`on_wait`) is collective (spool_data.py).
"""

from __future__ import annotations

import json
import math
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3_resources.atomic_files import fsync_dir, write_json_atomic
from eagle3_resources.errors import SpoolFenced, SpoolStateError, SpoolTooSmall
from eagle3_resources.hidden_states.lease import TRAINER_LEASE, WRITER_LEASE, Lease, take_lease
from eagle3_resources.hidden_states.shared_fs import read_bytes, read_json, read_text
from eagle3_resources.hidden_states.store import (
    MANIFEST,
    ShardCommitter,
    ShardFile,
    ShardImage,
    ShardLayout,
    ShardPlan,
    StoredSample,
    chunk_digest,
    padded_size,
    read_manifest,
    remove_untrusted,
    shard_layout,
    trusted_shards,
)
from eagle3_resources.kill_points import kill_point

SETTINGS = "spool.json"
LEDGER = "consumer.json"
ORDER = "order.log"
LANES = "lanes"
PLAN = "plan.json"
SPOOL_FORMAT = "eagle3-spool/2"  # 2: the shuffle span (`mix_shards`); a spool.json without it mixes 1 shard
PLAN_FORMAT = "eagle3-spool-plan/2"  # 2: shards that interleave the datasets (store.plan_mixed_shards), named mixed-N
# The default mix's ceiling on the shards one training rank holds in memory: (passes + 1) mixes of them, each shard
# whole at most (a rank holds the chunks of it that it read: see "The schedule"). Every rank of a node holds its own,
# so 8 ranks hold 8 times this.
MIX_MEMORY_BYTES = 16 * 2**30


def min_lane_bytes(passes: int, shard_file_bytes: int, mix_shards: int = 1) -> int:
    """The least share a lane can run with: the `passes` mixes of `mix_shards` shards the trainer may hold from it,
    plus one shard being written."""
    return (passes * mix_shards + 1) * padded_size(shard_file_bytes)


def default_mix_shards(
    share_bytes: int, shard_file_bytes: int, passes: int, memory_bytes: int = MIX_MEMORY_BYTES
) -> int:
    """The most shards a mix can span (at least 1) within a lane's share and a rank's memory: `passes + 1` mixes fit
    the share (the trainer holds `passes` of them while capture writes the next one whole, so neither waits for the
    other inside a mix) and the `passes + 1` mixes a rank holds in memory fit `memory_bytes`."""
    per_mix = (passes + 1) * padded_size(shard_file_bytes)
    return max(1, min(share_bytes, memory_bytes) // per_mix)


def _read_json(path: Path) -> dict[str, Any] | None:
    """The file's JSON, None while it does not exist; ESTALE and EIO retried (shared_fs.py)."""
    try:
        return dict(read_json(path))
    except FileNotFoundError:
        return None


@dataclass(frozen=True)
class SpoolSettings:
    """What both sides must agree on; written once to spool.json (`create_spool`)."""

    lanes: dict[str, int]  # lane -> its share of the byte budget (bytes of shard files)
    passes: int  # times every row is trained
    max_len: int  # a sample longer than this is cut into consecutive windows (every token trained)
    batch_tokens: int  # tokens per step at most (a longer window is a step of its own)
    seed: int
    hidden_size: int
    mix_shards: int = 1  # consecutive adopted shards whose windows are shuffled together (`default_mix_shards`)

    @property
    def budget_bytes(self) -> int:
        return sum(self.lanes.values())

    def to_json(self) -> dict[str, Any]:
        return {"format": SPOOL_FORMAT, **asdict(self), "budget_bytes": self.budget_bytes}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SpoolSettings:
        return cls(
            lanes={k: int(v) for k, v in d["lanes"].items()},
            passes=int(d["passes"]),
            max_len=int(d["max_len"]),
            batch_tokens=int(d["batch_tokens"]),
            seed=int(d["seed"]),
            hidden_size=int(d["hidden_size"]),
            mix_shards=int(d.get("mix_shards", 1)),  # a spool of format 1 mixed one shard's passes
        )


def create_spool(root: Path, settings: SpoolSettings) -> SpoolSettings:
    """Write spool.json once; a spool that exists must have these settings (else `SpoolStateError`)."""
    if (
        settings.passes < 1
        or settings.max_len < 4
        or settings.batch_tokens < 1
        or settings.mix_shards < 1
        or not settings.lanes
    ):
        raise ValueError(f"spool settings out of range: {settings}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    old = _read_json(root / SETTINGS)
    if old is None:
        write_json_atomic(root / SETTINGS, settings.to_json())
        return settings
    if SpoolSettings.from_json(old) != settings:
        raise SpoolStateError(
            f"{root / SETTINGS} holds other settings ({old}) than this run's ({settings.to_json()}); "
            "a spool's settings cannot change mid-run"
        )
    return settings


def open_settings(root: Path) -> SpoolSettings:
    d = _read_json(Path(root) / SETTINGS)
    if d is None:
        raise SpoolStateError(f"{Path(root) / SETTINGS} does not exist: create the spool (create_spool) first")
    return SpoolSettings.from_json(d)


# -- the trainer's durable records, as both sides read them ------------------------------------------------


@dataclass(frozen=True, order=True)
class Position:
    """Every step before (slot, step) is trained; steps are counted within their slot."""

    slot: int = 0
    step: int = 0

    def to_json(self) -> dict[str, int]:
        return {"slot": self.slot, "step": self.step}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Position:
        return cls(int(d["slot"]), int(d["step"]))


def read_order(root: Path) -> list[tuple[str, str, str]]:
    """The adopted shards, (lane, name, key), in adoption order; a torn last line (a kill mid-append, never
    fsynced, so never used) is not an adoption."""
    try:
        text = read_text(Path(root) / ORDER)
    except FileNotFoundError:
        return []
    lines = text.split("\n")[:-1]  # the part after the last newline is torn or empty
    out = []
    for line in lines:
        lane, name, key = json.loads(line)
        out.append((str(lane), str(name), str(key)))
    return out


def read_ledger(root: Path) -> dict[str, Any]:
    return _read_json(Path(root) / LEDGER) or {"position": Position().to_json(), "deleted": 0}


def trained_out(position: Position, passes: int, mix_shards: int = 1) -> int:
    """How many adopted shards (a prefix of the order) have had all their passes at `position`: those of the mixes
    whose last slot is before it (the last mix may hold fewer shards: callers cap this at the shards adopted)."""
    return mix_shards * max(0, position.slot - passes + 1)


@dataclass
class _ConsumerView:
    """What a capture worker knows of the trainer: which of its shards are deleted, which are fully trained."""

    deleted: set[str] = field(default_factory=set)
    trained: dict[str, str] = field(default_factory=dict)  # name -> key
    adopted: dict[str, str] = field(default_factory=dict)  # name -> key, every shard the trainer has taken


class _ConsumerWatch:
    """A capture worker's view of the trainer, brought up to date on every call and kept between calls: the ledger
    is re-read, order.log only from where the last call stopped (it only grows; a torn last line waits for the next
    call), and the trained and deleted shards only grow. At Kimi-K2.5 scale order.log reaches ~86k lines (10 MB):
    parsing it whole on every reservation poll would hold the GIL the capture's GPU thread needs. Several writer
    threads share one watch (a lock); the returned view is the watch's own, for reading."""

    def __init__(self, root: Path, lane: str, passes: int, mix_shards: int):
        self.root, self.lane, self.passes, self.mix = Path(root), lane, passes, mix_shards
        self.offset = 0
        self.order: list[tuple[str, str, str]] = []
        self.current = _ConsumerView()
        self.trained_upto = self.deleted_upto = 0  # prefixes of the order already in `current`
        self.lock = threading.Lock()

    def _read_new_lines(self) -> None:
        try:
            data = read_bytes(self.root / ORDER, self.offset)
        except FileNotFoundError:
            return
        whole = data.rfind(b"\n") + 1  # the part after the last newline is torn or empty
        for line in data[:whole].decode().split("\n")[:-1]:
            lane, name, key = json.loads(line)
            self.order.append((str(lane), str(name), str(key)))
            if lane == self.lane:
                self.current.adopted[str(name)] = str(key)
        self.offset += whole

    def view(self) -> _ConsumerView:
        with self.lock:
            ledger = read_ledger(self.root)  # the ledger first: order.log only grows, so it holds what it counts
            self._read_new_lines()
            deleted = min(len(self.order), int(ledger["deleted"]))
            position = Position.from_json(ledger["position"])
            done = min(len(self.order), trained_out(position, self.passes, self.mix))
            for ln, name, key in self.order[self.trained_upto : max(done, deleted)]:
                if ln == self.lane:
                    self.current.trained[name] = key
            for ln, name, _ in self.order[self.deleted_upto : deleted]:
                if ln == self.lane:
                    self.current.deleted.add(name)
            self.trained_upto = max(self.trained_upto, done, deleted)
            self.deleted_upto = max(self.deleted_upto, deleted)
            return self.current


# -- the capture side ---------------------------------------------------------------------------------------


class SpoolWriter:
    """One capture lane: its store (the lane's folder), its plan, its share of the budget.

    `todo` is what is left to capture after a resume: the planned shards neither committed intact nor already
    trained on (a shard the trainer has finished and deleted is never captured again). Call `reserve(plan)`
    before capturing a shard (it waits while the lane is full) and `commit(image)` once its states are in
    (or `write` then `record`, as the store's writer threads do: the image's buffer is free after `write`);
    `release(plan)` if a reserved shard will not be written. Several writer threads may share one SpoolWriter.
    `extract.capture_to_spool` runs a hidden-states backend's capture into a lane this way.

    `lease`: the lane's lease its capture side took with the lane's lock (lane_lock.exclusive); without one the writer
    takes one of its own. It is checked before the writer's first write to the lane and before each shard's file is
    opened, renamed into its name and listed in the manifest: a writer a later one has replaced raises `SpoolFenced`.
    """

    def __init__(
        self,
        root: Path,
        lane: str,
        samples: Sequence[StoredSample],
        plans: Sequence[ShardPlan],
        manifest_settings: dict[str, Any],
        *,
        verify_on_resume: bool = False,
        poll_s: float = 0.2,
        lease: Lease | None = None,
    ):
        self.root, self.lane = Path(root), lane
        self.settings = open_settings(self.root)
        if lane not in self.settings.lanes:
            raise SpoolStateError(f"lane {lane!r} is not one of the spool's lanes {sorted(self.settings.lanes)}")
        self.share = self.settings.lanes[lane]
        self.dir = self.root / LANES / lane
        self.poll_s = poll_s
        hidden = self.settings.hidden_size
        self.layouts: dict[str, ShardLayout] = {
            p.name: shard_layout(p, [samples[i] for i in p.samples], hidden) for p in plans
        }
        self.plans = list(plans)
        largest = max((lay.size for lay in self.layouts.values()), default=0)
        mix = self.settings.mix_shards
        need = min_lane_bytes(self.settings.passes, largest, mix)
        if need > self.share:
            raise SpoolTooSmall(
                f"lane {lane!r}: its share of the spool is {self.share:,} bytes; it needs {need:,} "
                f"({self.settings.passes} passes x a mix of {mix} shard(s) + 1 of its largest shard, "
                f"{largest:,} bytes)"
            )
        self.dir.mkdir(parents=True, exist_ok=True)
        self.lease = lease or take_lease(self.dir / WRITER_LEASE, f"the capture of lane {lane}")
        self.lease.check()  # a side that stalled since it took its lock writes nothing, not even its plan
        self._write_plan(samples)
        old = read_manifest(self.dir) if (self.dir / MANIFEST).exists() else {"shards": {}}
        intact = trusted_shards(self.dir, old, self.plans, verify_on_resume)
        present = {p.name for p in self.plans if (self.dir / p.name).exists()}
        # The trainer's records are read after the files are looked at: it records a shard as trained before it
        # deletes the file, so a file found missing above is one these records already account for.
        self.consumer = _ConsumerWatch(self.root, lane, self.settings.passes, mix)
        view = self.consumer.view()
        keys = {p.name: p.key for p in self.plans}
        # Kept listed: intact shards, and shards fully trained but not yet deleted (still on disk, still counted).
        kept = {
            name: entry
            for name, entry in old.get("shards", {}).items()
            if name not in view.deleted
            and (name in intact or (name in view.trained and view.trained[name] == keys.get(name)))
        }
        # Never captured again: a shard trained on all its passes, or one the trainer took whose file is gone (only
        # the trainer deletes a listed shard). A damaged file the trainer has not finished is captured again.
        self.todo = [
            p
            for p in self.plans
            if p.name not in kept
            and view.trained.get(p.name) != p.key
            and not (view.adopted.get(p.name) == p.key and p.name not in present)
        ]
        manifest = {**manifest_settings, "hidden_size": hidden, "planned_shards": list(keys), "shards": kept}
        self.committer = ShardCommitter(self.dir, manifest, fence=self.lease.check, chunked=True)
        self.committer.save_manifest()
        self.removed = remove_untrusted(self.dir, manifest)  # .tmp of a write cut short, a shard never listed
        self._lock = threading.Lock()
        self._committed = {name: int(e["bytes"]) for name, e in kept.items()}
        self._reserved: dict[str, int] = {}
        self.waits = 0  # reservations that had to wait
        self.waited_s = 0.0

    def _write_plan(self, samples: Sequence[StoredSample]) -> None:
        """plan.json: every shard's name, key, tokens, file bytes, training windows (of the spool's max_len, for the
        trainer's step estimate) and samples of each dataset (what the mix is, for a reader of the file)."""
        max_len = self.settings.max_len
        shards = []
        for p in self.plans:
            rows = [samples[i] for i in p.samples]
            datasets: dict[str, int] = {}
            for r in rows:
                datasets[r.group] = datasets.get(r.group, 0) + 1
            windows = sum(-(-len(r.input_ids) // max_len) for r in rows)
            entry = {"name": p.name, "key": p.key, "tokens": p.tokens, "bytes": self.layouts[p.name].size}
            shards.append(entry | {"windows": windows, "datasets": dict(sorted(datasets.items()))})
        plan = {"format": PLAN_FORMAT, "shards": shards}
        old = _read_json(self.dir / PLAN)
        if old is None:
            write_json_atomic(self.dir / PLAN, plan)
        elif old.get("format") != PLAN_FORMAT:
            raise SpoolStateError(
                f"{self.dir / PLAN} is of the format {old.get('format', 'eagle3-spool-plan/1')} (shards planned "
                f"dataset by dataset), this version writes {PLAN_FORMAT}: finish that run with the version that "
                "started it, or delete the spool to start afresh"
            )
        elif old != plan:
            raise SpoolStateError(
                f"{self.dir / PLAN} records another capture plan than this run's ({len(old['shards'])} shards "
                f"against {len(plan['shards'])}): a lane's plan cannot change mid-run"
            )

    def used_bytes(self) -> int:
        """Bytes of this lane's shards on disk, at most: committed and not yet deleted, plus reserved."""
        deleted = self.consumer.view().deleted
        with self._lock:
            return self._used(deleted)

    def _used(self, deleted: set[str]) -> int:
        # a deleted shard is off disk for good: dropped here, so this stays the few shards the trainer holds
        self._committed = {name: n for name, n in self._committed.items() if name not in deleted}
        return sum(self._committed.values()) + sum(self._reserved.values())

    def reserve(self, plan: ShardPlan, stop: Callable[[], bool] = lambda: False) -> bool:
        """Wait until the shard fits the lane's share, then reserve its bytes; False if `stop()` said so first."""
        need = padded_size(self.layouts[plan.name].size)
        started, waited = time.monotonic(), False
        while True:
            deleted = self.consumer.view().deleted
            with self._lock:
                if self._used(deleted) + need <= self.share:
                    self._reserved[plan.name] = need
                    if waited:
                        self.waits += 1
                        self.waited_s += time.monotonic() - started
                    return True
            if stop():
                return False
            waited = True
            time.sleep(self.poll_s)

    def start(self, image: ShardImage, plan: ShardPlan, samples: Sequence[StoredSample]) -> None:
        """Lay out a reserved shard in `image` (ids, masks, offsets written; the states are the caller's)."""
        image.start(plan, [samples[i] for i in plan.samples], self.settings.hidden_size, self.layouts[plan.name])

    def release(self, plan: ShardPlan) -> None:
        """Give back the reservation of a shard that will not be written (its capture failed or was stopped)."""
        with self._lock:
            self._reserved.pop(plan.name, None)

    def write(self, image: ShardImage, *, direct: bool = True) -> dict[str, Any]:
        """Write the reserved shard under its name, fsynced (`ShardCommitter.write`); not listed yet (`record`). The
        image's buffer is free when this returns; the shard's bytes stay reserved until `record`."""
        plan = image.plan
        assert plan is not None and plan.name in self._reserved, "reserve() the shard before writing it"
        try:
            self.lease.check()  # before the file is opened: a replaced writer never truncates the newer one's .tmp
            return self.committer.write(image, direct=direct)
        except SpoolFenced:
            # a replaced writer touches nothing more in the lane, not even its own .tmp: by now that name may be the
            # newer writer's file (the newer one removes the leftovers it does not list when it starts)
            self.release(plan)
            raise
        except BaseException:
            (self.dir / (plan.name + ".tmp")).unlink(missing_ok=True)
            self.release(plan)
            raise

    def record(self, name: str, entry: dict[str, Any], listed: Callable[[], None] | None = None) -> None:
        """List the written shard in the lane's manifest (`ShardCommitter.record`, which calls `listed`); its
        reservation becomes committed bytes. If the manifest write fails, the file stays on disk unlisted and its
        bytes stay reserved (counted)."""
        # Deleted shards leave the lane's manifest as the next shard is listed: it stays the few shards on disk
        # instead of growing to every shard of the run (at Kimi-K2.5 scale ~86k entries, 22 MB of JSON rewritten
        # per commit and read twice per shard by the trainer). The trainer reads a shard's entry only before its
        # last pass is committed, and the ledger records a deletion only after the unlink.
        self.committer.record(name, entry, drop=self.consumer.view().deleted, listed=listed)
        with self._lock:
            self._committed[name] = int(entry["bytes"])
            del self._reserved[name]

    def commit(self, image: ShardImage, *, direct: bool = True) -> dict[str, Any]:
        """Write and list the reserved shard (the store's atomic commit); its reservation becomes committed bytes."""
        entry = self.write(image, direct=direct)
        assert image.plan is not None  # write() has checked it
        self.record(image.plan.name, entry)
        return entry


# -- the training side --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpoolWindow:
    """Tokens start:end of one sample, in one pass over its shard."""

    shard: int  # index in the adoption order
    sample_id: str
    start: int
    end: int
    pass_index: int

    @property
    def tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Step:
    position: Position  # where this step is
    after: Position  # the position once it is trained: what the trainer's checkpoint records
    windows: list[SpoolWindow]


@dataclass(frozen=True)
class ShardRef:
    """An adopted shard as rank 0 hands it to the other ranks: where it is and the manifest entry (bytes, checksum)
    rank 0 read it with, so every rank verifies the same bytes."""

    index: int  # in the adoption order
    lane: str
    name: str
    key: str
    entry: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ShardRead:
    """One shard file a training rank read rows of (its record, `reads`: each shard once, at the first step whose share
    needed its rows): `at` is that step's position, `index` the shard's place in the adoption order."""

    at: Position
    index: int
    lane: str
    name: str

    def to_json(self) -> dict[str, Any]:
        return {"slot": self.at.slot, "step": self.at.step, "index": self.index, "lane": self.lane, "name": self.name}


class ShardRows:
    """One adopted shard, read by rows (issue 42): its samples and tensors from its manifest entry's index (nothing is
    read to plan steps over it), its bytes read on demand a chunk at a time into one buffer of the shard's size (pinned
    with `pin`: the rows are copied to the GPU from it), each chunk verified against the entry's digest before any of
    its rows is used. A chunk read stays in the buffer while the shard is held, so a rank reads each chunk at most once
    over the shard's passes, and never a chunk that no row of its steps lies in (a damaged one among them goes
    unnoticed by this rank: it trains nothing from it)."""

    KEYS = ("input_ids", "loss_mask", "aux_hidden_states", "final_hidden_state")

    def __init__(self, path: Path, entry: dict[str, Any], *, pin: bool = False):
        chunks, index = entry.get("chunks"), entry.get("index")
        if chunks is None or index is None:
            raise SpoolStateError(
                f"{path}: its lane's manifest lists it without chunk checksums (written by the version before chunked "
                "reads): finish that run with the version that started it, or delete the spool to start afresh"
            )
        self.path, self.entry, self.pin = path, entry, pin
        self.size = int(entry["bytes"])
        self.algorithm, self.chunk, self.digests = str(chunks["algorithm"]), int(chunks["bytes"]), chunks["digests"]
        if len(self.digests) != -(-self.size // self.chunk):
            raise SpoolStateError(
                f"{path}: {len(self.digests)} chunk digests for {self.size:,} bytes in chunks of {self.chunk:,}"
            )
        offsets = index["offsets"]
        self.samples: dict[str, tuple[int, int]] = {
            str(sid): (int(offsets[j]), int(offsets[j + 1])) for j, sid in enumerate(index["sample_ids"])
        }
        # key -> (dtype, bytes per row, byte offset in the file)
        self.tensors: dict[str, tuple[torch.dtype, list[int], int]] = {
            key: (ShardFile.DTYPES[t["dtype"]], [int(d) for d in t["shape"]], int(t["offset"]))
            for key, t in index["tensors"].items()
        }
        self._buffer: torch.Tensor | None = None  # allocated at the first read: planning needs none
        # each chunk's state: 0 not read, 1 being read (by one of the prefetcher's threads), 2 read and verified
        self._state = bytearray(len(self.digests))
        self._changed = threading.Condition()

    def _row_bytes(self, key: str) -> int:
        dtype, shape, _ = self.tensors[key]
        return math.prod(shape[1:]) * dtype.itemsize

    def chunks_of(self, sample_id: str, start: int, end: int) -> set[int]:
        """The chunks that rows start:end of the sample lie in, in every tensor."""
        a, _ = self.samples[sample_id]
        out: set[int] = set()
        for key in self.KEYS:
            _, _, at = self.tensors[key]
            row = self._row_bytes(key)
            lo, hi = at + (a + start) * row, at + (a + end) * row
            if hi > lo:
                out.update(range(lo // self.chunk, (hi - 1) // self.chunk + 1))
        return out

    def read(self, chunks: set[int]) -> list[int]:
        """Read and verify those of `chunks` not read yet, waiting for any another thread is reading; the ones this
        call read (each chunk is read once, by one thread; a contiguous run is one read)."""
        with self._changed:
            mine = sorted(c for c in chunks if self._state[c] == 0)
            for c in mine:
                self._state[c] = 1
            if mine and self._buffer is None:
                if not self.path.exists():
                    for c in mine:
                        self._state[c] = 0
                    raise SpoolStateError(
                        f"{self.path}: listed and taken by the trainer, but its file is gone (deleted too early?)"
                    )
                self._buffer = torch.empty(self.size, dtype=torch.uint8, pin_memory=self.pin)
        done: list[int] = []
        try:
            if mine:
                assert self._buffer is not None
                view = self._buffer.numpy().data
                with open(self.path, "rb", buffering=0) as f:
                    run: list[int] = []
                    for c in mine:
                        if run and c != run[-1] + 1:
                            done += self._read_run(f.fileno(), view, run)
                            run = []
                        run.append(c)
                    done += self._read_run(f.fileno(), view, run)
        finally:
            with self._changed:
                for c in mine:
                    self._state[c] = 2 if c in done else 0  # a failed read leaves its chunks to be read again
                self._changed.notify_all()
        with self._changed:  # the chunks another thread is reading
            while any(self._state[c] == 1 for c in chunks):
                self._changed.wait()
            failed = sorted(c for c in chunks if self._state[c] != 2)
        if failed:
            return done + self.read(set(failed))  # the other thread's read failed: this one tries and raises
        return done

    def _read_run(self, fd: int, view: memoryview, run: list[int]) -> list[int]:
        """Read the chunks `run` (consecutive) with `pread_into`, then verify each: the run, once all are verified."""
        lo, hi = run[0] * self.chunk, min(self.size, (run[-1] + 1) * self.chunk)
        done = 0
        while done < hi - lo:
            got = pread_into(fd, view[lo + done : hi], lo + done)
            if not got:
                raise SpoolStateError(
                    f"{self.path}: ends at byte {lo + done:,}, {self.size:,} recorded in its lane's manifest"
                )
            done += got
        for c in run:
            a, b = c * self.chunk, min(self.size, (c + 1) * self.chunk)
            got_digest = chunk_digest(view[a:b], self.algorithm)
            if got_digest != self.digests[c]:
                raise SpoolStateError(
                    f"{self.path}: chunk {c} (bytes {a:,} to {b:,}) has {self.algorithm} {got_digest}, its lane's "
                    f"manifest records {self.digests[c]}"
                )
        return run

    def sample(self, sample_id: str) -> dict[str, torch.Tensor]:
        """The sample's tensors, views of the buffer: only the rows whose chunks were `read` hold its bytes."""
        assert self._buffer is not None, "read() the sample's rows first"
        a, b = self.samples[sample_id]
        out = {}
        for key in self.KEYS:
            dtype, shape, at = self.tensors[key]
            row = self._row_bytes(key)
            out[key] = self._buffer[at + a * row : at + b * row].view(dtype).view(b - a, *shape[1:])
        return out


def pread_into(fd: int, view: memoryview, offset: int) -> int:
    """The one place a training rank's spool bytes come from: up to len(view) bytes at `offset` (benchmarks/
    throttled_reader.py wraps it to make the file system slow)."""
    return os.preadv(fd, [view], offset)


class ReadRecord:
    """A rank's record of its spool reads: the bytes of the chunks it read (`bytes_read`: each chunk once) and, per
    shard, the first step whose rows in it this rank needed (`reads`: each shard once, in the order of those steps;
    the same whichever of the prefetcher's threads read first). Written by the threads that read, read by any."""

    def __init__(self) -> None:
        self.bytes_read = 0
        self._first: dict[int, ShardRead] = {}
        self._lock = threading.Lock()

    @property
    def reads(self) -> list[ShardRead]:
        with self._lock:
            return sorted(self._first.values(), key=lambda r: (r.at, r.index))

    def rows(self, at: Position, index: int, lane: str, shard: ShardRows, windows: Sequence[SpoolWindow]) -> None:
        """Read the chunks `windows` (of the step at `at`, all of shard `index`) need, counting what was read."""
        need: set[int] = set()
        for w in windows:
            need |= shard.chunks_of(w.sample_id, w.start, w.end)
        with self._lock:
            first = self._first.get(index)
            if first is None or at < first.at:
                self._first[index] = ShardRead(at, index, lane, shard.path.name)
        read = shard.read(need)
        with self._lock:
            self.bytes_read += sum(min(shard.size, (c + 1) * shard.chunk) - c * shard.chunk for c in read)


def read_step(
    at: Position, windows: Sequence[SpoolWindow], shards: dict[int, tuple[str, ShardRows]], record: ReadRecord
) -> dict[str, dict[str, torch.Tensor]]:
    """Read the rows of `windows` (a rank's share of the step at `at`) from their `shards` ({index: (lane, rows)}); the
    source `pack_windows` takes: every sample of the windows, its tensors views whose windows' rows are read."""
    by_shard: dict[int, list[SpoolWindow]] = {}
    for w in windows:
        by_shard.setdefault(w.shard, []).append(w)
    for k, mine in by_shard.items():
        lane, shard = shards[k]
        record.rows(at, k, lane, shard, mine)
    return {w.sample_id: shards[w.shard][1].sample(w.sample_id) for w in windows}


class SpoolReader:
    """The trainer's side: steps in a fixed order from the adopted shards; `commit` after each checkpoint.

    `reader[sample_id]` gives a sample's tensors (input_ids, loss_mask, aux_hidden_states, final_hidden_state)
    for any window of the steps handed out and not yet past, as the store does (a `SampleSource`).
    """

    def __init__(
        self,
        root: Path,
        *,
        position: Position | None = None,
        poll_s: float = 0.2,
        lease: Lease | None = None,
        pin: bool = False,
    ):
        """`lease`: the spool's trainer lease the training side took with its lock (lane_lock.exclusive); without one
        the reader takes one of its own. It is checked before each write under `root` (order.log, consumer.json, a
        deletion): a reader a later one has replaced raises `SpoolFenced`. `pin`: shards' rows read into pinned memory
        (a CUDA trainer's)."""
        self.root = Path(root)
        self.pin = pin
        self.settings = open_settings(self.root)
        self.poll_s = poll_s
        self.lease = lease or take_lease(self.root / TRAINER_LEASE, "the spool's trainer")
        self._truncate_torn_order()
        self.order = read_order(self.root)
        ledger = read_ledger(self.root)
        self.committed = Position.from_json(ledger["position"])
        self.deleted = int(ledger["deleted"])
        if position is not None and position < self.committed:
            raise SpoolStateError(
                f"the trainer resumes at {position}, behind the spool's recorded position {self.committed} "
                f"({self.root / LEDGER}): shards it would train again may be deleted"
            )
        self.cursor = position or self.committed
        self.lane_plans: dict[str, dict[str, dict[str, Any]]] | None = None
        self.total: int | None = None  # shards in every lane's plan
        self._slot: tuple[int, list[list[SpoolWindow]]] | None = None
        self._loaded: dict[int, ShardRows] = {}
        self._by_sample: dict[str, int] = {}
        self._next_lane = 0
        self.waited_s = 0.0
        self.record = ReadRecord()  # the chunks this process read (`reader[sample_id]`, or `read_step` for it)
        self._last_at = self.cursor  # the position of the step handed out last (what `reader[sample_id]` reads for)
        self._commit_pending_deletions()
        if self.cursor > self.committed:  # the checkpoint is durable and ahead of the ledger: catch up
            self.commit(self.cursor)

    # -- files

    def _truncate_torn_order(self) -> None:
        path = self.root / ORDER
        if not path.exists():
            return
        data = read_bytes(path)
        keep = data.rfind(b"\n") + 1
        if keep != len(data):
            self.lease.check()
            with open(path, "r+b") as f:
                f.truncate(keep)
                os.fsync(f.fileno())

    def _append_order(self, ref: tuple[str, str, str]) -> None:
        self.lease.check()
        path = self.root / ORDER
        new = not path.exists()
        with open(path, "a") as f:
            f.write(json.dumps(list(ref)) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if new:
            fsync_dir(self.root)
        self.order.append(ref)

    def _write_ledger(self) -> None:
        self.lease.check()  # a replaced trainer's position must never reach consumer.json
        p, m = self.settings.passes, self.settings.mix_shards
        done = min(len(self.order), trained_out(self.committed, p, m))
        in_progress = range(done, min(len(self.order), (self.committed.slot + 1) * m))
        write_json_atomic(
            self.root / LEDGER,
            {
                "position": self.committed.to_json(),
                "deleted": self.deleted,
                "trained_out": done,
                "adopted": len(self.order),
                "passes": p,
                "mix_shards": m,
                # passes finished of the shards still being trained (each earlier one has all `passes`)
                "passes_done": {
                    f"{self.order[k][0]}/{self.order[k][1]}": self.committed.slot - k // m for k in in_progress
                },
            },
        )

    def _commit_pending_deletions(self) -> None:
        """Delete the shards the durable position has finished, then record the deletion (in that order: a
        capture worker counts a shard's bytes until the ledger says its file is gone)."""
        s = self.settings
        done = min(len(self.order), trained_out(self.committed, s.passes, s.mix_shards))
        if done <= self.deleted:
            return
        self.lease.check()
        lanes = set()
        for lane, name, _ in self.order[self.deleted : done]:
            (self.root / LANES / lane / name).unlink(missing_ok=True)
            lanes.add(lane)
            kill_point("spool.shard_deleted")  # fault injection for tests (eagle3_resources/kill_points.py)
        for lane in lanes:
            fsync_dir(self.root / LANES / lane)
        self.deleted = done
        self._write_ledger()
        kill_point("spool.deletions_recorded")

    def commit(self, position: Position) -> None:
        """Record `position` durably (call it once the trainer's checkpoint at that position is durable), then
        delete the shards it has finished."""
        if position <= self.committed:
            return
        if position > self.cursor:
            raise ValueError(f"commit({position}) is past the last step handed out ({self.cursor})")
        self.committed = position
        self._write_ledger()
        kill_point("spool.position_committed")  # fault injection for tests (eagle3_resources/kill_points.py)
        self._commit_pending_deletions()

    # -- adoption

    def _read_plans(self) -> bool:
        if self.lane_plans is not None:
            return True
        plans = {}
        for lane in self.settings.lanes:
            plan = _read_json(self.root / LANES / lane / PLAN)
            if plan is None:
                return False
            plans[lane] = {s["name"]: s for s in plan["shards"]}
        self.lane_plans = plans
        self.total = sum(len(v) for v in plans.values())
        return True

    def _adopt_one(self) -> bool:
        """Take one committed, planned shard no one has taken, from the lanes in turn; False if there is none."""
        assert self.lane_plans is not None
        taken = {(lane, name) for lane, name, _ in self.order}
        lanes = sorted(self.settings.lanes)
        for k in range(len(lanes)):
            lane = lanes[(self._next_lane + k) % len(lanes)]
            d = self.root / LANES / lane
            manifest = _read_json(d / MANIFEST)
            if manifest is None:
                continue
            for name, entry in manifest.get("shards", {}).items():  # commit order
                plan = self.lane_plans[lane].get(name)
                if (lane, name) not in taken and plan is not None and plan["key"] == entry["key"]:
                    self._append_order((lane, name, entry["key"]))
                    self._next_lane = (self._next_lane + k + 1) % len(lanes)
                    return True
        return False

    def _load(self, k: int) -> ShardRows:
        """The shard at adoption index `k`, indexed from its manifest entry: nothing of its file is read here."""
        if k not in self._loaded:
            lane, name, key = self.order[k]
            d = self.root / LANES / lane
            entry = (_read_json(d / MANIFEST) or {}).get("shards", {}).get(name)
            if entry is None or entry["key"] != key:
                raise SpoolStateError(f"{d / name}: adopted by the trainer, no longer listed in {d / MANIFEST}")
            shard = ShardRows(d / name, entry, pin=self.pin)
            for sid in shard.samples:
                if sid in self._by_sample and self._by_sample[sid] != k:
                    raise SpoolStateError(f"sample {sid!r} is in two shards of the spool: {self.order[k]} and another")
                self._by_sample[sid] = k
            self._loaded[k] = shard
        return self._loaded[k]

    def rows_of(self, k: int) -> tuple[str, ShardRows]:
        """(lane, rows) of the shard at adoption index `k`, which a step handed out holds."""
        return self.order[k][0], self._load(k)

    @property
    def bytes_read(self) -> int:
        return self.record.bytes_read

    @property
    def reads(self) -> list[ShardRead]:
        """Every shard file this reader read some of, in order, with the step that first did."""
        return self.record.reads

    # -- steps

    @property
    def mixes(self) -> int:
        """Mixes in every lane's plan: the adopted order cut into runs of `mix_shards` shards (the last may be
        short)."""
        assert self.total is not None
        return -(-self.total // self.settings.mix_shards)

    def _mix(self, mix: int) -> range:
        """The adoption indices of mix `mix`'s shards."""
        assert self.total is not None
        m = self.settings.mix_shards
        return range(mix * m, min((mix + 1) * m, self.total))

    def _slot_parts(self, slot: int) -> list[tuple[int, int]]:
        """(shard index, pass) of slot `slot`: pass p of every shard of mix `slot - p`."""
        return [(k, p) for p in range(self.settings.passes) if 0 <= slot - p < self.mixes for k in self._mix(slot - p)]

    def _steps_of(self, slot: int) -> list[list[SpoolWindow]]:
        s = self.settings
        windows: list[SpoolWindow] = []
        for k, p in self._slot_parts(slot):
            for sid, (a, b) in self._load(k).samples.items():
                n = b - a
                windows.extend(SpoolWindow(k, sid, x, min(n, x + s.max_len), p) for x in range(0, n, s.max_len))
        random.Random(f"{s.seed}:{slot}").shuffle(windows)
        steps: list[list[SpoolWindow]] = []
        tokens = 0
        for w in windows:
            if steps and tokens + w.tokens <= s.batch_tokens:
                steps[-1].append(w)
                tokens += w.tokens
            else:
                steps.append([w])
                tokens = w.tokens
        # The shards of this slot and of the one before stay indexed: a step handed out just before this slot's first
        # may still be read (`reader[sample_id]`); a prefetcher holds its steps' shards itself (`rows_of`).
        keep = {k for k, _ in [*self._slot_parts(slot), *self._slot_parts(slot - 1)]}
        for k in [k for k in self._loaded if k not in keep]:
            for sid in self._loaded.pop(k).samples:
                self._by_sample.pop(sid, None)
        return steps

    def shard_ref(self, k: int) -> ShardRef:
        """The shard at adoption index `k`, loaded (by a step handed out), as the other ranks are to read it."""
        lane, name, key = self.order[k]
        return ShardRef(k, lane, name, key, self._load(k).entry)

    def try_next_step(self) -> Step | None:
        """The next step if the shards it needs are committed, else None at once (`finished` tells the end from a
        step that must be waited for). `next_step` is the waiting form; several ranks use this one (spool_data.py)."""
        if not self._read_plans():
            return None
        return self._try_step()

    @property
    def finished(self) -> bool:
        return self.total is not None and self.cursor.slot >= self.mixes + self.settings.passes - 1

    def at_end(self) -> bool:
        """`finished`, the lanes' plans read first: a reader opened at a trainer's last position (a run resumed with
        no step left to train) has not read them, as it was asked for no step."""
        return self._read_plans() and self.finished

    def _try_step(self) -> Step | None:
        """The next step if the shards it needs are committed (adopting them), else None (or `finished`)."""
        assert self.total is not None
        while not self.finished:
            slot = self.cursor.slot
            while len(self.order) < min((slot + 1) * self.settings.mix_shards, self.total):
                if not self._adopt_one():
                    return None
            if self._slot is None or self._slot[0] != slot:
                self._slot = (slot, self._steps_of(slot))
            steps = self._slot[1]
            here = self.cursor
            if here.step >= len(steps):  # a slot without windows (shards of empty samples only)
                self.cursor = Position(slot + 1, 0)
                continue
            self.cursor = Position(slot, here.step + 1) if here.step + 1 < len(steps) else Position(slot + 1, 0)
            self._last_at = here
            return Step(here, self.cursor, steps[here.step])
        return None

    def next_step(
        self, stop: Callable[[], bool] = lambda: False, on_wait: Callable[[], None] | None = None
    ) -> Step | None:
        """The next step, waiting while a shard it needs is not committed yet; None when every pass is done
        (`finished`) or `stop()` said so while waiting. `on_wait` is called once before waiting: the trainer
        checkpoints and commits there, so the shards it has finished are deleted and capture can go on."""
        started: float | None = None
        try:
            while True:
                if self._read_plans():
                    step = self._try_step()
                    if step is not None or self.finished:
                        return step
                if started is None:
                    started = time.monotonic()
                    if on_wait is not None:
                        on_wait()
                        continue
                if stop():
                    return None
                time.sleep(self.poll_s)
        finally:
            if started is not None:
                self.waited_s += time.monotonic() - started

    def __getitem__(self, sample_id: str) -> dict[str, torch.Tensor]:
        """The sample's tensors (views of its shard in memory, its rows read and verified), as
        `HiddenStateStore[sample_id]` gives them."""
        k = self._by_sample[sample_id]
        shard = self._loaded[k]
        a, b = shard.samples[sample_id]
        self.record.rows(self._last_at, k, self.order[k][0], shard, [SpoolWindow(k, sample_id, 0, b - a, 0)])
        return shard.sample(sample_id)


class SpoolFollower:
    """A training rank other than 0: it holds the shards rank 0 names (`take`, indexed from the manifest entries rank 0
    read, nothing read yet) and reads the rows of its share of each step from them (`read_step`, or
    `follower[sample_id]` for a whole sample), chunk-verified as rank 0 reads them. It never writes under the spool's
    root and never adopts: the schedule is rank 0's alone (see the module's docstring, "Several ranks")."""

    def __init__(self, root: Path, *, pin: bool = False):
        self.root = Path(root)
        self.settings = open_settings(self.root)
        self.pin = pin
        self._loaded: dict[int, tuple[str, ShardRows]] = {}
        self._by_sample: dict[str, int] = {}
        self.record = ReadRecord()
        self._last_at = Position()

    def take(self, at: Position, refs: Sequence[ShardRef]) -> None:
        """Hold the shards `refs` (those rank 0 named with the step at `at`) unless already held, and drop those whose
        passes all ended before the previous slot (as `SpoolReader` keeps the last two slots')."""
        slot, m = at.slot, self.settings.mix_shards
        self._last_at = at
        for k in [k for k in self._loaded if k // m < slot - self.settings.passes]:
            for sid in self._loaded.pop(k)[1].samples:
                self._by_sample.pop(sid, None)
        for ref in refs:
            if ref.index in self._loaded:
                continue
            shard = ShardRows(self.root / LANES / ref.lane / ref.name, ref.entry, pin=self.pin)
            for sid in shard.samples:
                if self._by_sample.get(sid, ref.index) != ref.index:
                    raise SpoolStateError(f"sample {sid!r} is in two shards of the spool: {ref.name} and another")
                self._by_sample[sid] = ref.index
            self._loaded[ref.index] = (ref.lane, shard)

    def rows_of(self, k: int) -> tuple[str, ShardRows]:
        return self._loaded[k]

    @property
    def bytes_read(self) -> int:
        return self.record.bytes_read

    @property
    def reads(self) -> list[ShardRead]:
        return self.record.reads

    def __getitem__(self, sample_id: str) -> dict[str, torch.Tensor]:
        k = self._by_sample[sample_id]
        lane, shard = self._loaded[k]
        a, b = shard.samples[sample_id]
        self.record.rows(self._last_at, k, lane, shard, [SpoolWindow(k, sample_id, 0, b - a, 0)])
        return shard.sample(sample_id)


def spool_status(root: Path) -> dict[str, Any]:
    """The spool's fill, from the files themselves (bytes of shard files on disk, `.tmp` included) and the
    trainer's ledger: what a progress report shows."""
    root = Path(root)
    settings = open_settings(root)
    ledger = read_ledger(root)
    lanes = {}
    for lane, share in settings.lanes.items():
        d = root / LANES / lane
        on_disk = 0
        if d.exists():
            for e in os.scandir(d):
                if e.name.endswith((".safetensors", ".safetensors.tmp")):
                    try:
                        on_disk += e.stat().st_size
                    except FileNotFoundError:
                        pass
        plan = _read_json(d / PLAN) or {"shards": []}
        manifest = _read_json(d / MANIFEST) or {"shards": {}}
        lanes[lane] = {
            "share_bytes": share,
            "bytes_on_disk": on_disk,
            "planned_shards": len(plan["shards"]),
            "listed_shards": len(manifest["shards"]),
        }
    return {
        "budget_bytes": settings.budget_bytes,
        "bytes_on_disk": sum(v["bytes_on_disk"] for v in lanes.values()),
        "lanes": lanes,
        "adopted": len(read_order(root)),
        "position": ledger["position"],
        "deleted": ledger["deleted"],
    }
