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
check runs where the states are, one figure per sample copied with the states (`finite_hint`). A writer
thread waits for the event, then writes, hashes, fsyncs and renames the shard (store.write_file), gives
its buffer back, and lists it in the manifest with the shards other writers finished meanwhile
(`ShardCommitter.record`, one manifest write for them all).
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from eagle3_resources.errors import DiskSpaceError, StaleShardsError
from eagle3_resources.hidden_states.layers import FINAL_CONVENTION, LAYER_CONVENTION
from eagle3_resources.hidden_states.store import (
    FORMAT,
    MANIFEST,
    ShardCommitter,
    ShardImage,
    ShardPlan,
    StoredSample,
    host_buffer,
    min_bytes_per_token,
    padded_size,
    plan_shards,
    read_manifest,
    remove_untrusted,
    shard_layout,
    stale_shards,
    token_bytes,
    trusted_shards,
)

GiB = 2**30


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
        offsets = pending.image.layout.row_offsets
        if device.type != "cuda":
            with one_thread():
                sums = torch.stack([finite_hint(a, f) for _, a, f in items])
                for j, a, f in items:
                    pending.image.aux[offsets[j] : offsets[j + 1]].copy_(a)
                    pending.image.final[offsets[j] : offsets[j + 1]].copy_(f)
            pending.sums.append(([j for j, _, _ in items], sums))
            return
        # The finiteness check where the states are: one figure per sample, a few bytes to copy back.
        sums = torch.stack([finite_hint(a, f) for _, a, f in items])
        stream = self.stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for j, a, f in items:
                pending.image.aux[offsets[j] : offsets[j + 1]].copy_(a, non_blocking=True)
                pending.image.final[offsets[j] : offsets[j + 1]].copy_(f, non_blocking=True)
            host_sums = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True)
            host_sums.copy_(sums, non_blocking=True)
            event = torch.cuda.Event()
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


def finite_hint(a: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """A 0-d fp32 tensor: 0 when every element of `a` and `f` is finite once stored in bf16, NaN otherwise.

    Exact, from each tensor's extremes (`aminmax` propagates NaN; a value beyond bf16's range is one of
    them, and turns into an infinity in bf16 as it will in the shard): one reduction per tensor with no
    temporary, which on a CPU runs at memory speed where `isfinite` (4 passes, 3 temporaries) does not.
    """
    extremes = [*torch.aminmax(a), *torch.aminmax(f)]
    return torch.stack([x.to(torch.bfloat16).float() for x in extremes]).mul(0).sum()


@dataclass
class PendingShard:
    """A shard whose image is being filled (or its copies are still in flight)."""

    image: ShardImage
    rows: list[StoredSample]
    sums: list[tuple[list[int], torch.Tensor]] = field(default_factory=list)  # (sample positions, their finite_hint)
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
            for j, ok in zip(positions, torch.isfinite(hints).tolist())
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
            f"hidden_states would write {human_bytes(needed)} ({tokens_pending:,} tokens x {token_bytes(hidden_size):,} "
            f"bytes) and keeps a margin of {settings.margin_pct:g}% + {human_bytes(settings.reserve_bytes)}: "
            f"{human_bytes(required)} in all, but {probe} has {human_bytes(free)} free. "
            f"About {fits:,} of the {total_tokens:,} tokens fit: set `max_tokens` (the asset's config) to at most "
            f"that, or `dataset_weights` to keep some datasets only, or point EAGLE3_DATA_DIR at a larger volume."
        )
    return figures


def extract_to_store(
    samples: Sequence[StoredSample],
    backend: HiddenStatesBackend,
    root: Path,
    settings: StoreSettings,
    *,
    identity: dict[str, Any],
    notes: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
    progress_every_s: float = 10.0,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    buffers: HostBuffers | None = None,
    null_sink: bool = False,
) -> ExtractionReport:
    """Fill `root` with the shards of `samples`; return what this call did.

    `identity` names the target (it enters every shard's key); `notes` are recorded in the manifest only.
    `buffers`: host buffers to reuse (a benchmark's rounds); by default `writers + 1`, page-locked when the
    backend is on a GPU. `null_sink` (benchmarks only): the whole capture but the write; nothing is recorded.
    """
    root = Path(root)
    H = backend.hidden_size
    layer_ids = list(backend.layer_ids)
    plans = plan_shards(samples, H, settings.shard_bytes, {**identity, "aux_layer_ids": layer_ids})
    old = read_manifest(root) if (root / MANIFEST).exists() else {}
    manifest = {
        "format": FORMAT,
        "aux_layer_ids": layer_ids,
        "layer_convention": LAYER_CONVENTION,
        "final_hidden_state": FINAL_CONVENTION,
        "num_target_layers": backend.num_layers,
        "hidden_size": H,
        "dtype": "bfloat16",
        "identity": identity,
        **(notes or {}),
        "backend": backend.describe(),
        "shard_bytes": settings.shard_bytes,
        "planned_shards": [p.name for p in plans],
        "shards": {},
    }
    done = trusted_shards(root, old, plans, settings.verify_on_resume) if old else set()
    stale = stale_shards(root, old, plans) if old else {}
    if stale and not settings.discard_stale:
        size = sum(e["bytes"] for e in stale.values())
        raise StaleShardsError(
            f"{len(stale)} committed shard(s) in {root} ({human_bytes(size)}, {sum(e['tokens'] for e in stale.values()):,} "
            f"tokens, e.g. {', '.join(sorted(stale)[:3])}) do not match this run's plan: {why_stale(old, manifest)}. "
            f"Nothing was deleted. Restore the previous settings to keep them, or set `discard_stale_shards: true` "
            f"(the asset's config) to delete them and compute their samples again."
        )
    manifest["shards"] = {name: old["shards"][name] for name in sorted(done)}
    pending = [p for p in plans if p.name not in done]
    total_tokens = sum(p.tokens for p in plans)
    tokens_pending = sum(p.tokens for p in pending)
    check_disk(
        root,
        disk_needed(plans, {p.name for p in pending}, H),
        settings,
        tokens_pending=tokens_pending,
        total_tokens=total_tokens,
        hidden_size=H,
    )

    root.mkdir(parents=True, exist_ok=True)
    committer = ShardCommitter(root, manifest)
    committer.save_manifest()  # drops shards no longer planned or no longer trusted before anything else
    removed = remove_untrusted(root, manifest)
    if done:
        log(
            f"hidden states: {len(done)} of {len(plans)} shards already stored; {len(pending)} to go ({tokens_pending:,} tokens)"
        )
    if removed:
        log(
            f"hidden states: removed {len(removed)} untrusted file(s) left by an interrupted run: {', '.join(removed[:5])}"
        )

    report = ExtractionReport(len(plans), 0, len(done), 0, 0, 0, 0.0, removed_untrusted=removed)
    started = last = time.monotonic()
    if buffers is None:
        device = getattr(backend, "device", None)
        buffers = HostBuffers(settings.writers + 1, pin=isinstance(device, torch.device) and device.type == "cuda")
    stager = Stager()
    futures: list[Future] = []

    def progress(final: bool = False) -> None:
        elapsed = max(1e-9, time.monotonic() - started)
        rate = report.tokens_written / elapsed
        left = tokens_pending - report.tokens_written
        figures = {
            "tokens_written": report.tokens_written,
            "tokens_pending": tokens_pending,
            "tokens_per_s": round(rate, 1),
            "bytes_written": report.bytes_written,
            "gb_written": round(report.bytes_written / 1e9, 3),
            "shards_written": report.shards_written,
            "shards": len(plans),
            "eta_s": round(left / rate, 1) if rate > 0 else None,
        }
        eta = f"{figures['eta_s']:,.0f} s" if figures["eta_s"] is not None else "?"
        log(
            f"hidden states {'done: ' if final else ''}{report.tokens_written:,}/{tokens_pending:,} tokens, {rate:,.0f} tok/s, "
            f"{report.bytes_written / 1e9:.2f} GB written, shard {report.shards_written + report.shards_skipped}/{len(plans)}, ETA {eta}"
        )
        if on_progress is not None:
            on_progress(figures)

    failures: list[tuple[str, BaseException]] = []  # appended by writer threads
    lock = threading.Lock()

    def write(pending: PendingShard) -> int:
        """A writer thread: wait for the shard's copies, check it, write it, give its buffer back, then record it."""
        name, entry = pending.image.plan.name, None
        try:
            pending.wait()
            bad = pending.non_finite()
            size = pending.image.layout.size
            if not null_sink:
                entry = committer.write(pending.image, direct=settings.direct_io)
        finally:
            buffers.give(pending.image)  # durable on disk (or failed): the next shard can be built in it
        if entry is not None:
            committer.record(name, entry)
        with lock:
            report.nan_samples.extend(bad)
            report.shards_written += 1
            report.bytes_written += size
        return size

    def written(name: str, fut: Future) -> None:
        if fut.exception() is not None:
            failures.append((name, fut.exception()))

    # Twice as many threads as writers: a writer waiting for the manifest write that lists its shard (its buffer
    # already given back) does not hold up the next shard's write; the buffers bound the writes in flight.
    with ThreadPoolExecutor(max_workers=2 * max(1, settings.writers), thread_name_prefix="shard-writer") as pool:
        try:
            for plan in pending:
                if failures:  # a full disk or a failing volume: stop computing what cannot be kept
                    raise RuntimeError(f"writing {failures[0][0]} failed: {failures[0][1]}") from failures[0][1]
                rows = [samples[i] for i in plan.samples]
                layout = shard_layout(plan, rows, H)
                image = buffers.take(layout.size)  # waits while every buffer is being written
                shard = PendingShard(image, rows)
                try:
                    image.start(plan, rows, H, layout)
                    for batch in batches([len(r.input_ids) for r in rows], settings.batch_tokens):
                        outputs = backend.extract_batch([list(rows[j].input_ids) for j in batch])
                        for j, (a, f) in zip(batch, outputs):
                            if a.shape[0] != len(rows[j].input_ids) or f.shape[0] != a.shape[0]:
                                raise RuntimeError(
                                    f"{backend.name} returned {a.shape[0]} rows for {rows[j].sample_id}, "
                                    f"which has {len(rows[j].input_ids)} tokens"
                                )
                            report.tokens_written += a.shape[0]
                        stager.stage(shard, [(j, a, f) for j, (a, f) in zip(batch, outputs)])
                        if time.monotonic() - last >= progress_every_s:
                            last = time.monotonic()
                            progress()
                except BaseException:
                    shard.wait()  # copies in flight into the buffer land before it is reused
                    buffers.give(image)
                    raise
                fut = pool.submit(write, shard)
                fut.add_done_callback(lambda f, name=plan.name: written(name, f))
                futures.append(fut)
                report.samples_written += len(rows)
        finally:
            for fut in futures:  # the finished shards are committed whatever stopped the loop
                fut.exception()
    if failures:
        raise RuntimeError(
            f"{len(failures)} shard(s) could not be written, first {failures[0][0]}: {failures[0][1]}"
        ) from failures[0][1]
    report.seconds = time.monotonic() - started
    progress(final=True)
    return report


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
