"""Run a hidden-states backend over samples and fill the shard store: batches in, shards out.

The loop plans the shards first (so a resumed run plans the same ones), skips those already
committed, checks the disk before the first byte, and runs each pending shard's samples through
the backend in batches sized by a token budget. Whatever stops the loop (an error, Dagster's
terminate, Ctrl-C), the shards already finished are committed before it returns. Imports torch only.

Nothing on the compute stream waits for the host. Each shard is built in place as its safetensors
image in a host buffer (`ShardImage`, `writers + 1` of them, allocated once per `HostBuffers` and
page-locked when the states come from a GPU). A batch's states are copied straight to their rows'
offsets; on a GPU with `non_blocking` on a side stream that first waits for the forward, so the next
batch's forward runs while they cross, and an event marks the shard's last copy. The finiteness
check runs where the states are, one figure per sample copied with the states (`finite_hints`). A writer
thread waits for the event, then writes, hashes, fsyncs and renames the shard (store.write_file), gives
its buffer back, and lists it in the manifest with the shards other writers finished meanwhile
(`ShardCommitter.record`, one manifest write for them all), in the order the shards were captured (`InOrder`).

The same phases fill a lane of the streaming spool (`capture_to_spool`, spool.py): there the lane's
`SpoolWriter` plans what is left to capture, each shard's bytes are reserved in the lane's share of the
budget before its image is started (capture pauses while the lane is full), and the writer threads write
and list shards through it; the spool's budget, not the free space, bounds what is on disk.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from eagle3_resources.errors import DiskSpaceError, SpoolStateError, StaleShardsError
from eagle3_resources.hidden_states.layers import FINAL_CONVENTION, LAYER_CONVENTION
from eagle3_resources.hidden_states.lease import Lease
from eagle3_resources.hidden_states.spool import SpoolWriter, open_settings
from eagle3_resources.hidden_states.store import (
    FORMAT,
    MANIFEST,
    ShardCommitter,
    ShardImage,
    ShardPlan,
    ShardPlanner,
    StoredSample,
    host_buffer,
    min_bytes_per_token,
    padded_size,
    plan_mixed_shards,
    plan_shards,
    read_manifest,
    remove_untrusted,
    shard_layout,
    stale_shards,
    token_bytes,
    trusted_shards,
)

GiB = 2**30


class ShardSink(Protocol):
    """Where the writer threads put finished shards: the store's `ShardCommitter`, or a spool lane's `SpoolWriter`."""

    def write(self, image: ShardImage, *, direct: bool = True) -> dict[str, Any]: ...

    def record(self, name: str, entry: dict[str, Any], *, listed: Callable[[], None] | None = None) -> None: ...


class HiddenStatesBackend(Protocol):
    name: str
    layer_ids: list[int]
    num_layers: int
    hidden_size: int

    def describe(self) -> dict[str, Any]: ...

    def extract_batch(self, sequences: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]: ...


@dataclass(frozen=True)
class StoreSettings:
    shard_bytes: int = 1 * GiB  # a shard's size; 1-2 GB keeps file counts low and resume loss small
    batch_tokens: int = 8192  # padded tokens per backend call (longest sample x samples in the batch)
    writers: int = 4  # background threads writing finished shards (one shard each); writers + 1 host buffers
    direct_io: bool = True  # O_DIRECT writes where the file system takes them (no page-cache copy), else buffered
    verify_on_resume: bool = False  # re-hash committed shards before trusting them (reads them all)
    free_bytes: int | None = None  # the volume's free space; None = ask the file system
    margin_pct: float = 5.0  # free space kept beyond what the store needs
    reserve_bytes: int = 1 * GiB  # and this much on top
    discard_stale: bool = False  # delete committed shards the new plan does not want (else refuse)


class HostBuffers:
    """`count` reusable host buffers for shard images, handed out one at a time and given back by the writers.

    Allocated on first use (page-locked with `pin`) and kept: a benchmark or a long run pays for them once.
    A buffer too small for a shard is replaced by one that fits.
    """

    def __init__(self, count: int, *, pin: bool = False):
        self.count, self.pin = count, pin
        self._free: list[torch.Tensor] = []
        self._made = 0
        self._cond = threading.Condition()

    def reserve(self, nbytes: int) -> None:
        """Allocate every buffer now, each of at least `nbytes` (a benchmark keeps allocation out of its timings)."""
        nbytes = padded_size(nbytes)
        with self._cond:
            if self._made != len(self._free):
                raise RuntimeError("reserve() while buffers are in use")
            self._free = [b if b.numel() >= nbytes else host_buffer(nbytes, pin=self.pin) for b in self._free]
            self._free += [host_buffer(nbytes, pin=self.pin) for _ in range(self.count - len(self._free))]
            self._made = self.count
            for b in self._free:
                b.zero_()  # fault the pages in now, not inside the first timed copy

    def take(self, nbytes: int) -> ShardImage:
        nbytes = padded_size(nbytes)
        with self._cond:
            while not self._free and self._made >= self.count:
                self._cond.wait()  # every buffer is being filled or written: the writers set the pace
            if self._free:
                buffer = self._free.pop()
            else:
                self._made += 1
                buffer = None
        if buffer is None or buffer.numel() < nbytes:
            buffer = host_buffer(nbytes, pin=self.pin)
        return ShardImage(buffer)

    def give(self, image: ShardImage) -> None:
        with self._cond:
            self._free.append(image.buffer)
            self._cond.notify()


class Stager:
    """Copies a batch's states into a shard image where the forward does not wait for them.

    States on the host are copied right away. States on a GPU are copied with `non_blocking` on a side
    stream that first waits for the compute stream; the source tensors are kept until the shard's
    event has completed (the caching allocator must not hand their memory to the next forward early).
    """

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}

    def stream(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def stage(self, pending: PendingShard, items: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """items: (position of the sample in the shard, aux [L, 3H], final [L, H])."""
        if not items:
            return
        device = items[0][1].device
        layout = pending.image.layout
        assert layout is not None  # the image was started before its first batch
        offsets = layout.row_offsets
        if device.type != "cuda":
            with one_thread():
                sums = finite_hints([(a, f) for _, a, f in items])
                for j, a, f in items:
                    pending.image.aux[offsets[j] : offsets[j + 1]].copy_(a)
                    pending.image.final[offsets[j] : offsets[j + 1]].copy_(f)
            pending.sums.append(([j for j, _, _ in items], sums))
            return
        # The finiteness check where the states are: one figure per sample, a few bytes to copy back.
        sums = finite_hints([(a, f) for _, a, f in items])
        stream = self.stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for j, a, f in items:
                pending.image.aux[offsets[j] : offsets[j + 1]].copy_(a, non_blocking=True)
                pending.image.final[offsets[j] : offsets[j + 1]].copy_(f, non_blocking=True)
            host_sums = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True)
            host_sums.copy_(sums, non_blocking=True)
            # blocking: the writer thread that waits for it sleeps rather than spinning a core (CUDA's default for a
            # process with fewer contexts than cores) beside the thread launching the next forward
            event = torch.cuda.Event(blocking=True)
            event.record(stream)
        pending.keep.append((items, sums))  # alive until the event: nothing reuses their memory mid-copy
        pending.events.append(event)
        pending.sums.append(([j for j, _, _ in items], host_sums))


@contextlib.contextmanager
def one_thread():
    """torch's CPU ops on the calling thread alone for the block, then the caller's thread count again.

    The staging copies and checks are memory-bound: one thread moves ~10 GB/s. Split over the intra-op
    pool, each op waits for its slowest thread, and on a host whose cores are busy (the writers'
    syscalls, other processes) that thread is often descheduled: measured on a shared 2-core host,
    1 GB of states staged in 2.7 s of wall time (0.6 s of CPU) on 2 threads, in 0.33 s on one.
    """
    n = torch.get_num_threads()
    if n > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if n > 1:
            torch.set_num_threads(n)


def finite_hints(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """One fp32 figure per (aux, final) pair: 0 when every element of both is finite once stored in bf16, NaN otherwise.

    Exact, from each tensor's extremes (`aminmax` propagates NaN; a value beyond bf16's range is one of
    them, and turns into an infinity in bf16 as it will in the shard): one reduction per tensor with no
    temporary, which on a CPU runs at memory speed where `isfinite` (4 passes, 3 temporaries) does not.
    Two reductions per sample and four ops for the whole batch (the extremes stacked, at their promoted dtype, then
    rounded to bf16 once): on a GPU whose forward waits for the host (an MoE's routing), every launch between two
    forwards counts, and the check costs ~2 per sample instead of ~9.
    """
    extremes = torch.stack([x for a, f in pairs for x in (*torch.aminmax(a), *torch.aminmax(f))])
    return extremes.to(torch.bfloat16).float().view(-1, 4).mul(0).sum(1)


class InOrder:
    """Lets the writer threads record their shards in the order they were captured: ticket 0, 1, 2, ... by submission.

    The writes finish in any order (several run at once, and which waiting writer gets `Extraction._writing` next is
    up to the scheduler), yet the manifest's order is a spool lane's commit order, which its trainer's steps follow:
    recorded in capture order, two runs of the same data train the same steps. A writer whose write finished early
    waits only for the earlier shards to be listed (`done` is called from `ShardCommitter.record` once its shard is in
    the manifest in memory), then joins their manifest write. FIFO admission to `_writing` alone would not do: two
    writes admitted in order still finish out of order. A ticket that fails or has nothing to record is `done` at
    once, so it never holds a later one back; and a writer waits only for earlier tickets, whose tasks the pool
    started first (it runs them in submission order), none of which waits for a later one: no deadlock.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = 0  # the ticket whose turn it is
        self._early: set[int] = set()  # tickets done before their turn

    def wait(self, ticket: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._next == ticket)

    def done(self, ticket: int) -> None:
        """Ticket `ticket` is recorded or will not be (idempotent): the turn moves past it once earlier ones are."""
        with self._cond:
            if ticket >= self._next:
                self._early.add(ticket)
            while self._next in self._early:
                self._early.remove(self._next)
                self._next += 1
            self._cond.notify_all()


@dataclass
class PendingShard:
    """A shard whose image is being filled (or its copies are still in flight)."""

    image: ShardImage
    rows: list[StoredSample]
    sums: list[tuple[list[int], torch.Tensor]] = field(default_factory=list)  # (sample positions, their finite_hints)
    events: list[Any] = field(default_factory=list)  # CUDA events, one per staged batch
    keep: list[Any] = field(default_factory=list)  # device tensors in flight

    def wait(self) -> None:
        """Block this (writer) thread until every copy into the image has landed."""
        for event in self.events:
            event.synchronize()
        self.keep.clear()

    def non_finite(self) -> list[str]:
        """Samples with a NaN or an infinity in their stored (bf16) states; call after `wait`."""
        return [
            self.rows[j].sample_id
            for positions, hints in self.sums
            for j, ok in zip(positions, torch.isfinite(hints).tolist(), strict=True)  # built together in stage()
            if not ok
        ]


def human_bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def why_stale(old: dict[str, Any], new: dict[str, Any]) -> str:
    """The likeliest reason committed shards no longer match the plan, in words."""
    reasons = [
        what
        for key, what in (
            ("identity", "the target (its config or weights) changed"),
            ("aux_layer_ids", "the layer ids changed"),
            ("shard_bytes", "the shard size (`shard_gb`) changed"),
        )
        if old.get(key) != new.get(key)
    ]
    return "; ".join(reasons) or "their samples changed (the merged set, `max_tokens` or `dataset_weights`)"


@dataclass
class ExtractionReport:
    shards: int
    shards_written: int
    shards_skipped: int
    samples_written: int
    tokens_written: int
    bytes_written: int
    seconds: float
    nan_samples: list[str] = field(default_factory=list)
    removed_untrusted: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_written / self.seconds if self.seconds > 0 else 0.0


def batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Positions grouped so that longest x count stays within `batch_tokens` (a longer sample goes alone).

    Sorted by length first, so padding stays small; deterministic, so a resumed shard is computed
    from exactly the same batches.
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    out: list[list[int]] = []
    for i in order:
        if out and lengths[i] * (len(out[-1]) + 1) <= batch_tokens:  # sorted: i is the batch's longest
            out[-1].append(i)
        else:
            out.append([i])
    return out


def disk_needed(plans: Sequence[ShardPlan], pending: set[str], hidden_size: int) -> int:
    """Bytes the pending shards will take (states, ids, masks; headers are under 0.1% and covered by the margin)."""
    return sum(p.tokens for p in plans if p.name in pending) * token_bytes(hidden_size)


def check_disk(
    root: Path, needed: int, settings: StoreSettings, *, tokens_pending: int, total_tokens: int, hidden_size: int
) -> dict[str, int]:
    """Refuse before the first byte when `needed` plus the margin exceeds the free space; say what would fit."""
    probe = Path(root)
    while not probe.exists():
        probe = probe.parent
    free = settings.free_bytes if settings.free_bytes is not None else shutil.disk_usage(probe).free
    required = int(needed * (1 + settings.margin_pct / 100)) + settings.reserve_bytes
    figures = {"needed_bytes": needed, "required_with_margin_bytes": required, "free_bytes": free}
    if required > free:
        usable = max(0, (free - settings.reserve_bytes) / (1 + settings.margin_pct / 100))
        fits = int(usable // token_bytes(hidden_size))
        raise DiskSpaceError(
            f"hidden_states would write {human_bytes(needed)} "
            f"({tokens_pending:,} tokens x {token_bytes(hidden_size):,} bytes) and keeps a margin of "
            f"{settings.margin_pct:g}% + {human_bytes(settings.reserve_bytes)}: "
            f"{human_bytes(required)} in all, but {probe} has {human_bytes(free)} free. "
            f"About {fits:,} of the {total_tokens:,} tokens fit: set `max_tokens` (the asset's config) to at most "
            f"that, or `dataset_weights` to keep some datasets only, or point EAGLE3_DATA_DIR at a larger volume."
        )
    return figures


@dataclass(frozen=True)
class ExtractionOptions:
    """How one extraction runs and reports, beside the store's own figures (`StoreSettings`)."""

    identity: dict[str, Any]  # names the target: it enters every shard's key
    notes: dict[str, Any] | None = None  # recorded in the manifest only
    log: Callable[[str], None] = print
    progress_every_s: float = 10.0  # a progress line (and `on_progress`) at most this often
    on_progress: Callable[[dict[str, Any]], None] | None = None  # the progress figures (the asset's observations)
    buffers: HostBuffers | None = None  # host buffers to reuse (a benchmark's rounds); None: writers + 1, see run()
    null_sink: bool = False  # benchmarks only: the whole capture but the write; nothing is recorded


def extract_to_store(
    samples: Sequence[StoredSample],
    backend: HiddenStatesBackend,
    root: Path,
    settings: StoreSettings,
    options: ExtractionOptions | None = None,
    **fields: Any,
) -> ExtractionReport:
    """Fill `root` with the shards of `samples`; return what this call did (`Extraction` tells how, phase by phase).

    `options`, or its fields by name (`identity={...}, progress_every_s=3600`), which replace those of `options`.
    """
    options = ExtractionOptions(**fields) if options is None else replace(options, **fields)
    return Extraction(samples, backend, Path(root), settings, options).run()


@dataclass(frozen=True)
class ResumePlan:
    """Every shard of the store, and which of them a run still has to compute."""

    shards: list[ShardPlan]
    manifest: dict[str, Any]  # the manifest this run writes, listing the committed shards it keeps
    done: set[str]  # committed, trusted, and wanted as they are
    pending: list[ShardPlan]

    @property
    def total_tokens(self) -> int:
        return sum(p.tokens for p in self.shards)

    @property
    def tokens_pending(self) -> int:
        return sum(p.tokens for p in self.pending)


class Extraction:
    """One `extract_to_store` call, in the order its phases run:

    plan        the shards (a resumed run plans the same ones); which are committed and trusted; stale ones refused
    check_disk  the pending shards' bytes plus the margin against the free space, before the first byte
    open_store  the manifest rewritten with the shards kept, files no manifest lists removed
    capture     each pending shard, once admitted (`admit`: always for a store; a spool lane's reservation), its
                batches through the backend (`capture_batch`), staged into its host image
    write       on a writer thread: wait for the copies, check, write, hash, fsync, rename, record (`ShardCommitter`)
                once the shards captured before it are (`InOrder`)
    finish      every shard handed to a writer is committed whatever stopped the loop; then the report
    """

    def __init__(
        self,
        samples: Sequence[StoredSample],
        backend: HiddenStatesBackend,
        root: Path,
        settings: StoreSettings,
        options: ExtractionOptions,
    ):
        self.samples, self.backend, self.root = samples, backend, root
        self.settings, self.options = settings, options
        self.hidden_size = backend.hidden_size
        self.layer_ids = list(backend.layer_ids)
        self.stager = Stager()
        self.failures: list[tuple[str, BaseException]] = []  # appended by writer threads
        self._lock = threading.Lock()  # the writers' report figures
        # `writers` files written at once: the pool has twice that many threads (see capture) and the buffers let a
        # captured shard reach a writer while another is still written, so without this writers + 1 could overlap
        self._writing = threading.BoundedSemaphore(max(1, settings.writers))
        self._in_order = InOrder()  # the shards are recorded in capture order, whatever order their writes end in
        self._ran = False

    def run(self) -> ExtractionReport:
        # its state is one run's (capture-order tickets, writer failures, a lane's pauses): a second run would wait
        # for a ticket already past, or raise the first run's error; a new Extraction plans from the disk instead
        if self._ran:
            raise RuntimeError("an Extraction runs once: make a new one to resume (it plans from the store on disk)")
        self._ran = True
        self.resume = self.plan()
        self.check_disk()
        self.committer, removed = self.open_store()
        plan = self.resume
        self.report = ExtractionReport(len(plan.shards), 0, len(plan.done), 0, 0, 0, 0.0, removed_untrusted=removed)
        self._started = self._last_progress = time.monotonic()
        buffers = self.options.buffers
        if buffers is None:  # page-locked when the states come from a GPU
            device = getattr(self.backend, "device", None)
            buffers = HostBuffers(
                self.settings.writers + 1, pin=isinstance(device, torch.device) and device.type == "cuda"
            )
        self.buffers = buffers
        self.capture()
        return self.finish()

    # ------------------------------------------------------------ before the first byte

    def shard_plans(self) -> list[ShardPlan]:
        """Every shard of the samples, by dataset (deterministic: a resumed run plans the same ones; a spool lane's
        interleave the datasets: `SpoolCapture.shard_plans`)."""
        identity = {**self.options.identity, "aux_layer_ids": self.layer_ids}
        return plan_shards(self.samples, self.hidden_size, self.settings.shard_bytes, identity)

    def plan(self) -> ResumePlan:
        """The shards, the committed ones this run keeps; StaleShardsError for committed ones it would replace."""
        root = self.root
        shards = self.shard_plans()
        old = read_manifest(root) if (root / MANIFEST).exists() else {}
        manifest = self.new_manifest(shards)
        done = trusted_shards(root, old, shards, self.settings.verify_on_resume) if old else set()
        stale = stale_shards(root, old, shards) if old else {}
        if stale and not self.settings.discard_stale:
            raise stale_error(root, stale, why_stale(old, manifest))
        manifest["shards"] = {name: old["shards"][name] for name in sorted(done)}
        return ResumePlan(shards, manifest, done, [p for p in shards if p.name not in done])

    def new_manifest(self, shards: list[ShardPlan]) -> dict[str, Any]:
        """The manifest's settings (its key order is the file's), with no shard listed yet."""
        return {
            "format": FORMAT,
            "aux_layer_ids": self.layer_ids,
            "layer_convention": LAYER_CONVENTION,
            "final_hidden_state": FINAL_CONVENTION,
            "num_target_layers": self.backend.num_layers,
            "hidden_size": self.hidden_size,
            "dtype": "bfloat16",
            "identity": self.options.identity,
            **(self.options.notes or {}),
            "backend": self.backend.describe(),
            "shard_bytes": self.settings.shard_bytes,
            "planned_shards": [p.name for p in shards],
            "shards": {},
        }

    def check_disk(self) -> None:
        plan = self.resume
        check_disk(
            self.root,
            disk_needed(plan.shards, {p.name for p in plan.pending}, self.hidden_size),
            self.settings,
            tokens_pending=plan.tokens_pending,
            total_tokens=plan.total_tokens,
            hidden_size=self.hidden_size,
        )

    def open_store(self) -> tuple[ShardSink, list[str]]:
        """The store's folder and manifest as this run keeps them; (the committer, the untrusted files removed)."""
        plan, log = self.resume, self.options.log
        self.root.mkdir(parents=True, exist_ok=True)
        committer = ShardCommitter(self.root, plan.manifest)
        committer.save_manifest()  # drops shards no longer planned or no longer trusted before anything else
        removed = remove_untrusted(self.root, plan.manifest)
        if plan.done:
            log(
                f"hidden states: {len(plan.done)} of {len(plan.shards)} shards already stored; "
                f"{len(plan.pending)} to go ({plan.tokens_pending:,} tokens)"
            )
        if removed:
            log(
                f"hidden states: removed {len(removed)} untrusted file(s) left by an interrupted run: "
                f"{', '.join(removed[:5])}"
            )
        return committer, removed

    # ------------------------------------------------------------ the capture loop (this thread)

    def capture(self) -> None:
        """Capture each pending shard here and hand it to a writer thread, which writes it while the next is captured.

        Twice as many threads as writers: a writer waiting for the manifest write that lists its shard (its buffer
        already given back) does not hold up the next shard's write; the buffers bound the writes in flight.
        """
        futures: list[Future[int]] = []
        workers = 2 * max(1, self.settings.writers)
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shard-writer") as pool:
            try:
                for plan in self.resume.pending:
                    if self.failures:  # a full disk or a failing volume: stop computing what cannot be kept
                        name, error = self.failures[0]
                        raise RuntimeError(f"writing {name} failed: {error}") from error
                    if not self.admit(plan):
                        break
                    try:
                        shard = self.capture_shard(plan)
                    except BaseException:
                        self.release(plan)
                        raise
                    future = pool.submit(self.write, shard, len(futures))
                    future.add_done_callback(functools.partial(self._written, plan.name))
                    futures.append(future)
                    self.report.samples_written += len(shard.rows)
            finally:
                for future in futures:  # the finished shards are committed whatever stopped the loop
                    future.exception()

    def admit(self, plan: ShardPlan) -> bool:
        """Whether to capture `plan` now (a store always does; a spool lane waits for room, or is stopped)."""
        return True

    def release(self, plan: ShardPlan) -> None:
        """`plan` was admitted but its capture failed: nothing to give back for a store."""

    def capture_shard(self, plan: ShardPlan) -> PendingShard:
        """One shard's samples through the backend, batch by batch, into a host image (its copies may be in flight)."""
        rows = [self.samples[i] for i in plan.samples]
        layout = shard_layout(plan, rows, self.hidden_size)
        image = self.buffers.take(layout.size)  # waits while every buffer is being written
        shard = PendingShard(image, rows)
        try:
            image.start(plan, rows, self.hidden_size, layout)
            for batch in batches([len(r.input_ids) for r in rows], self.settings.batch_tokens):
                self.capture_batch(shard, batch)
                if time.monotonic() - self._last_progress >= self.options.progress_every_s:
                    self._last_progress = time.monotonic()
                    self.progress()
        except BaseException:
            shard.wait()  # copies in flight into the buffer land before it is reused
            self.buffers.give(image)
            raise
        return shard

    def capture_batch(self, shard: PendingShard, batch: list[int]) -> None:
        """The samples at positions `batch` of the shard through the backend, their states staged into its image."""
        rows = shard.rows
        outputs = self.backend.extract_batch([list(rows[j].input_ids) for j in batch])
        for j, (a, f) in zip(batch, outputs, strict=False):
            if a.shape[0] != len(rows[j].input_ids) or f.shape[0] != a.shape[0]:
                raise RuntimeError(
                    f"{self.backend.name} returned {a.shape[0]} rows for {rows[j].sample_id}, "
                    f"which has {len(rows[j].input_ids)} tokens"
                )
            self.report.tokens_written += a.shape[0]
        self.stager.stage(shard, [(j, a, f) for j, (a, f) in zip(batch, outputs, strict=False)])

    # ------------------------------------------------------------ the writers (their own threads)

    def write(self, shard: PendingShard, ticket: int) -> int:
        """A writer thread: wait for the shard's copies, check it, write it, give its buffer back, then record it once
        the shards captured before it are (`ticket`: its place in the capture order, see `InOrder`)."""
        plan, layout = shard.image.plan, shard.image.layout
        assert plan is not None and layout is not None  # started by capture_shard
        entry = None
        try:
            try:
                shard.wait()
                bad = shard.non_finite()
                if not self.options.null_sink:
                    with self._writing:
                        entry = self.committer.write(shard.image, direct=self.settings.direct_io)
            finally:
                self.buffers.give(shard.image)  # durable on disk (or failed): the next shard can be built in it
            if entry is not None:
                self._in_order.wait(ticket)
                self.committer.record(plan.name, entry, listed=functools.partial(self._in_order.done, ticket))
        finally:
            self._in_order.done(ticket)  # a failed shard holds no later one back
        with self._lock:
            self.report.nan_samples.extend(bad)
            self.report.shards_written += 1
            self.report.bytes_written += layout.size
        return layout.size

    def _written(self, name: str, future: Future[int]) -> None:
        error = future.exception()
        if error is not None:
            self.failures.append((name, error))

    # ------------------------------------------------------------ progress and the end

    def progress(self, final: bool = False) -> None:
        """A progress line in the log, and its figures to `on_progress`."""
        report, pending, shards = self.report, self.resume.tokens_pending, len(self.resume.shards)
        rate = report.tokens_written / max(1e-9, time.monotonic() - self._started)
        left = pending - report.tokens_written
        figures = {
            "tokens_written": report.tokens_written,
            "tokens_pending": pending,
            "tokens_per_s": round(rate, 1),
            "bytes_written": report.bytes_written,
            "gb_written": round(report.bytes_written / 1e9, 3),
            "shards_written": report.shards_written,
            "shards": shards,
            "eta_s": round(left / rate, 1) if rate > 0 else None,
        }
        extra, said = self.progress_extra()
        figures.update(extra)
        eta = f"{figures['eta_s']:,.0f} s" if figures["eta_s"] is not None else "?"
        self.options.log(
            f"hidden states {'done: ' if final else ''}{report.tokens_written:,}/{pending:,} tokens, "
            f"{rate:,.0f} tok/s, {report.bytes_written / 1e9:.2f} GB written, "
            f"shard {report.shards_written + report.shards_skipped}/{shards}, ETA {eta}{said}"
        )
        if self.options.on_progress is not None:
            self.options.on_progress(figures)

    def progress_extra(self) -> tuple[dict[str, Any], str]:
        """Figures beside the store's own for a progress report, and their words at the end of its line."""
        return {}, ""

    def finish(self) -> ExtractionReport:
        """Raise if a shard could not be written; else the report, with a last progress line."""
        if self.failures:
            name, error = self.failures[0]
            raise RuntimeError(f"{len(self.failures)} shard(s) could not be written, first {name}: {error}") from error
        self.report.seconds = time.monotonic() - self._started
        self.progress(final=True)
        return self.report


def stale_error(root: Path, stale: dict[str, dict[str, Any]], why: str) -> StaleShardsError:
    """What a run refuses with when committed shards do not match its plan: how many, how big, why, what to do."""
    size = sum(e["bytes"] for e in stale.values())
    tokens = sum(e["tokens"] for e in stale.values())
    return StaleShardsError(
        f"{len(stale)} committed shard(s) in {root} ({human_bytes(size)}, {tokens:,} "
        f"tokens, e.g. {', '.join(sorted(stale)[:3])}) do not match this run's plan: {why}. "
        f"Nothing was deleted. Restore the previous settings to keep them, or set `discard_stale_shards: true` "
        f"(the asset's config) to delete them and compute their samples again."
    )


def store_figures(root: Path) -> dict[str, Any]:
    """Totals of a store from its manifest: bytes per token against the (3 + 1) x H x 2 minimum."""
    m = read_manifest(root)
    shards = m.get("shards", {})
    tokens = sum(s["tokens"] for s in shards.values())
    nbytes = sum(s["bytes"] for s in shards.values())
    floor = min_bytes_per_token(m["hidden_size"])
    per_token = nbytes / tokens if tokens else 0.0
    return {
        "shards": len(shards),
        "samples": sum(s["samples"] for s in shards.values()),
        "tokens": tokens,
        "bytes": nbytes,
        "bytes_per_token": round(per_token, 2),
        "min_bytes_per_token": floor,
        "overhead_pct": round(100 * (per_token / floor - 1), 3) if tokens else 0.0,
    }


# -- the streaming mode: the same capture into a lane of the spool (spool.py) -----------------------------------


@dataclass
class SpoolCaptureReport:
    """What one `capture_to_spool` call did: the extraction's figures, and how long the lane waited for the trainer."""

    lane: str
    extraction: ExtractionReport
    todo: list[str]  # the shards this call set out to capture (what its resume left to do), in plan order
    pauses: int  # shards whose reservation had to wait for room in the lane's share
    waited_s: float  # seconds the capture spent waiting for that room
    stopped: bool  # a stop request ended the capture before every shard of `todo` was captured

    @property
    def bytes_per_s(self) -> float:
        """Bytes written per second of the whole call, waits included."""
        e = self.extraction
        return e.bytes_written / e.seconds if e.seconds > 0 else 0.0

    @property
    def busy_bytes_per_s(self) -> float:
        """Bytes written per second the capture was not waiting for the trainer: the lane's own rate."""
        busy = self.extraction.seconds - self.waited_s
        return self.extraction.bytes_written / busy if busy > 0 else 0.0


class SpoolCapture(Extraction):
    """An `Extraction` whose shards go to the spool lane `lane` under `root` instead of a store. Its phases:

    plan        the lane's shards interleave its datasets (`planner`: store.plan_mixed_shards, seeded by the spool's
                seed), then its `SpoolWriter` (its plan.json, manifest and resume): `todo` is the pending list; the
                spool's hidden size must be the backend's; a share that cannot hold the working set is `SpoolTooSmall`
    check_disk  not applied: the lane's share of the spool's byte budget is the bound (`reserve` enforces it)
    open_store  the writer has rewritten the lane's manifest and removed the files it does not list; said in the log
    capture     as the store's, each shard's bytes reserved first (`admit`: waits while the lane is full; `stop()`
                ends the wait and the capture)
    write       as the store's, through the writer (`SpoolWriter.write`, then `record`: its reservation becomes
                committed bytes)
    finish      as the store's
    """

    def __init__(
        self,
        samples: Sequence[StoredSample],
        backend: HiddenStatesBackend,
        root: Path,
        lane: str,
        settings: StoreSettings,
        options: ExtractionOptions,
        *,
        stop: Callable[[], bool] | None = None,
        poll_s: float = 0.2,
        lease: Lease | None = None,
        planner: ShardPlanner | None = None,
    ):
        if options.null_sink:
            raise ValueError("null_sink is for benchmarks of the store's capture; a spool lane always writes")
        super().__init__(samples, backend, root, settings, options)
        self.lane, self.poll_s, self.lease = lane, poll_s, lease
        self.planner: ShardPlanner = planner or plan_mixed_shards
        self.stop: Callable[[], bool] = stop or (lambda: False)
        self.pauses, self.waited_s, self.stopped = 0, 0.0, False
        self._waiting_since: float | None = None

    def shard_plans(self) -> list[ShardPlan]:
        """The lane's shards, each holding every dataset in its share (the trainer takes them in order: a shard of
        one dataset at a time would train the datasets one after another); the same ones after a resume."""
        identity = {**self.options.identity, "aux_layer_ids": self.layer_ids}
        seed = open_settings(self.root).seed
        return self.planner(self.samples, self.hidden_size, self.settings.shard_bytes, identity, seed)

    def plan(self) -> ResumePlan:
        spool = open_settings(self.root)
        if spool.hidden_size != self.hidden_size:
            raise SpoolStateError(
                f"the spool at {self.root} is for hidden size {spool.hidden_size}; "
                f"{self.backend.name} captures {self.hidden_size}"
            )
        shards = self.shard_plans()
        self.writer = SpoolWriter(
            self.root,
            self.lane,
            self.samples,
            shards,
            self.new_manifest(shards),
            verify_on_resume=self.settings.verify_on_resume,
            poll_s=self.poll_s,
            lease=self.lease,
        )
        todo = {p.name for p in self.writer.todo}
        done = {p.name for p in shards if p.name not in todo}
        return ResumePlan(shards, self.writer.committer.manifest, done, list(self.writer.todo))

    def check_disk(self) -> None:
        """Not applied: the spool's budget bounds the lane's bytes on disk, whatever the data's size."""

    def open_store(self) -> tuple[ShardSink, list[str]]:
        plan, removed = self.resume, self.writer.removed
        self.options.log(
            f"hidden states -> spool lane {self.lane!r}: {len(plan.pending)} of {len(plan.shards)} shards to capture "
            f"({plan.tokens_pending:,} tokens) within a share of {human_bytes(self.writer.share)}"
        )
        if removed:
            self.options.log(
                f"hidden states: removed {len(removed)} untrusted file(s) left by an interrupted run: "
                f"{', '.join(removed[:5])}"
            )
        return self.writer, removed

    def admit(self, plan: ShardPlan) -> bool:
        """Reserve the shard's bytes in the lane's share, waiting while it is full; False on a stop request."""
        if self.stop():
            self.stopped = True
            return False
        ok = self.writer.reserve(plan, self._waiting)
        if self._waiting_since is not None:
            self.pauses += 1
            self.waited_s += time.monotonic() - self._waiting_since
            self._waiting_since = None
        self.stopped = not ok
        return ok

    def _waiting(self) -> bool:
        """`reserve`'s stop, called at each poll while the lane is full: progress goes on, a stop ends the wait."""
        now = time.monotonic()
        if self._waiting_since is None:
            self._waiting_since = now
        if now - self._last_progress >= self.options.progress_every_s:
            self._last_progress = now
            self.progress()
        return self.stop()

    def release(self, plan: ShardPlan) -> None:
        self.writer.release(plan)

    def progress_extra(self) -> tuple[dict[str, Any], str]:
        now = time.monotonic()
        waiting = self._waiting_since is not None
        waited = self.waited_s + (now - self._waiting_since if self._waiting_since is not None else 0.0)
        elapsed = max(1e-9, now - self._started)
        used = self.writer.used_bytes()
        figures = {
            "lane": self.lane,
            "lane_bytes": used,
            "lane_share_bytes": self.writer.share,
            "waiting": waiting,  # for room in the lane's share, that is for the trainer
            "pauses": self.pauses + int(waiting),
            "waited_s": round(waited, 3),
            "bytes_per_s": round(self.report.bytes_written / elapsed, 1),
            "busy_bytes_per_s": round(self.report.bytes_written / max(1e-9, elapsed - waited), 1),
        }
        said = (
            f"; lane {self.lane} {human_bytes(used)} of {human_bytes(self.writer.share)}, "
            f"{'waiting for the trainer, ' if waiting else ''}{figures['pauses']} pause(s), {waited:,.1f} s waited"
        )
        return figures, said

    def run_lane(self) -> SpoolCaptureReport:
        report = self.run()
        todo = [p.name for p in self.resume.pending]
        return SpoolCaptureReport(self.lane, report, todo, self.pauses, self.waited_s, self.stopped)


# extract_to_store's parameters and the lane's (lane, stop, poll_s): the options stay one ExtractionOptions
def capture_to_spool(
    samples: Sequence[StoredSample],
    backend: HiddenStatesBackend,
    spool_root: Path,
    lane: str,
    settings: StoreSettings,
    options: ExtractionOptions | None = None,
    *,
    stop: Callable[[], bool] | None = None,
    poll_s: float = 0.2,
    lease: Lease | None = None,
    planner: ShardPlanner | None = None,
    **fields: Any,
) -> SpoolCaptureReport:
    """Capture the lane's `samples` through `backend` into lane `lane` of the spool at `spool_root` (`create_spool`
    first), resuming what an earlier call left; returns when every planned shard is committed (or trained and deleted
    already), or when `stop()` says so (the shards captured by then are committed first).

    `settings`: the store's (shard_bytes, batch_tokens, writers, direct_io, verify_on_resume; the free-space fields are
    not used). `options`, or its fields by name, as `extract_to_store`'s; `on_progress` gets the lane's figures too
    (lane_bytes, lane_share_bytes, waiting, pauses, waited_s, bytes_per_s, busy_bytes_per_s). `poll_s`: how often a
    full lane looks for room. `lease`: the lane's lease the capture side took with its lock (`SpoolWriter`'s).
    `planner`: how the samples become shards (None: `plan_mixed_shards`, every dataset in every shard; a benchmark
    passes another to show the order it replaced).
    """
    options = ExtractionOptions(**fields) if options is None else replace(options, **fields)
    capture = SpoolCapture(
        samples,
        backend,
        Path(spool_root),
        lane,
        settings,
        options,
        stop=stop,
        poll_s=poll_s,
        lease=lease,
        planner=planner,
    )
    return capture.run_lane()
