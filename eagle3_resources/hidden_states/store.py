"""The hidden-state store: shards of many samples, committed atomically, read back in O(1).

Layout under `root`:
    manifest.json               settings (H, layer ids and their convention, target) and every
                                committed shard: its content key, checksum, bytes, samples, tokens
    <group>-00000.safetensors   one shard of one group (a dataset): its samples' rows concatenated
                                along the token axis (a spool lane's are mixed-00000, ...: each holds
                                every dataset, `plan_mixed_shards`)
        input_ids           [T] int32
        loss_mask           [T] int8
        aux_hidden_states   [T, 3H] bf16   (the EAGLE-3 layers, low -> high)
        final_hidden_state  [T, H] bf16    (after the final norm: the LM-head input)
        offsets             [n + 1] int64  (sample j is rows offsets[j]:offsets[j+1])
      and in the header's metadata (key `eagle3`) the sample ids and splits, in row order.

So a token costs (3 + 1) x H x 2 bytes of states plus 5 of id and mask; headers and offsets are
the only other bytes. A shard is trusted only once the manifest lists it (written after the
shard's fsync and rename), so a process killed at any moment leaves nothing half-written that a
resume would use. Imports torch and safetensors only: benchmarks and GPU hosts read it without
Dagster or polars.

Reads are positional (`os.preadv` of one sample's rows into a fresh tensor), not memory-mapped: a
mapped shard keeps every page a reader touched in its resident set, so a trainer streaming a
large store would grow by the store's size (the pages are reclaimable, but counted against the
process and its container). A read costs the sample's bytes, and the kernel's page cache is the
only cache.

Writing: the file's layout (`ShardLayout`) is known when the shard is planned, since its token count
is, so a shard is built in place as its own safetensors image in one host buffer (`ShardImage`): the
header first, then the states copied straight to their rows' offsets as batches finish. A writer
thread then writes that buffer in large sequential chunks (O_DIRECT where the file system takes it)
while a thread of its own hashes the same bytes (so the disk never waits for the hash), fsyncs and
renames it, and gives the buffer back; the shards finished meanwhile are then listed by one manifest
write (`ShardCommitter.record`). No serialized copy and no concatenation: the bytes on disk are the
bytes the copies put in the buffer.

Checksums: a manifest entry names its algorithm by its key. New shards get `xxh3_128` (xxHash's
XXH3, 128 bits: 30 GB/s on one core where sha256 runs at 2, so the hash costs a writer ~3% of a
disk's time instead of doubling it; the threat is a torn or rotten file, not an adversary). Stores
written before carry `sha256`, and stay readable and verifiable as they are (`CHECKSUMS`). Where
`xxhash` is not installed (a bare GPU machine running the device check with torch alone) new shards get
`sha256`, named as such in their entries and in the benchmarks' output: slower, never mislabelled.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import random
import re
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import torch

from eagle3_resources.atomic_files import fsync_dir, write_json_atomic, write_text_atomic
from eagle3_resources.hidden_states.shared_fs import read_json

try:
    import xxhash
except ImportError:  # see the module docstring: sha256 then, recorded as sha256
    xxhash = None  # type: ignore[assignment]  # the module or None: every use checks

FORMAT = "eagle3-hidden-states-shards/1"
MANIFEST = "manifest.json"
KEYS = ("input_ids", "loss_mask", "aux_hidden_states", "final_hidden_state")
STATE_BYTES = 2  # bf16
ID_MASK_BYTES = 4 + 1  # int32 id + int8 mask per token
OPEN_SHARDS = 64  # a reader keeps this many shard files open (a 10 TB store has thousands)
ALIGN = 4096  # the tensors start at a page boundary, so O_DIRECT can write the image as it is
WRITE_CHUNK = 16 * 2**20  # one write (and one hash update) per 16 MiB: large sequential writes
CHECKSUM = "xxh3_128" if xxhash else "sha256"  # what new shards are hashed with (the manifest entry's key)
# What a manifest entry may carry, newest first, with the hasher this process has for each (None: not installed).
CHECKSUMS: dict[str, Callable[[], Any] | None] = {
    "xxh3_128": xxhash.xxh3_128 if xxhash else None,
    "sha256": hashlib.sha256,
}
# A spool shard's chunks (issue 42): its file cut into fixed-size chunks, each hashed on its own, so that a training
# rank reading some rows verifies only the chunks those rows lie in. 64 bits a chunk: the threat is a torn or rotten
# file.
CHUNK_CHECKSUM = "xxh3_64" if xxhash else "sha256"
CHUNK_CHECKSUMS: dict[str, Callable[[], Any] | None] = {
    "xxh3_64": xxhash.xxh3_64 if xxhash else None,
    "sha256": hashlib.sha256,
}
MAX_CHUNK_BYTES = 4 * 2**20  # a 4 GB Kimi shard: 1,024 chunks, ~19 kB of digests in its manifest entry
CHUNKS_PER_SHARD = 64  # a small shard still has several chunks (ALIGN at least), so a part of it is verifiable


def chunk_bytes(size: int) -> int:
    """The chunk of a shard of `size` bytes: a power of two from ALIGN to MAX_CHUNK_BYTES, near size / CHUNKS_PER_SHARD
    (a power of two divides WRITE_CHUNK, so the writer's hashing thread hashes whole chunks)."""
    return min(MAX_CHUNK_BYTES, max(ALIGN, 1 << max(0, size // CHUNKS_PER_SHARD - 1).bit_length()))


def min_bytes_per_token(hidden_size: int) -> int:
    """The floor the store is measured against: (3 aux + 1 final) x H x 2 bytes (bf16)."""
    return (3 + 1) * hidden_size * STATE_BYTES


def token_bytes(hidden_size: int) -> int:
    """What one stored token takes: its states plus its id and loss-mask byte."""
    return min_bytes_per_token(hidden_size) + ID_MASK_BYTES


def shard_name(group: str, index: int) -> str:
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', group)}-{index:05d}.safetensors"


@dataclass(frozen=True)
class StoredSample:
    """What the store needs of one sample; `input_ids` and `loss_mask` are sequences of ints."""

    sample_id: str
    split: str
    input_ids: Sequence[int]
    loss_mask: Sequence[int]
    # the dataset: a store's shards never mix groups (a dataset added or changed leaves the others' shards alone); a
    # spool's interleave them (`plan_mixed_shards`: its trainer takes shards in order)
    group: str = "all"


@dataclass(frozen=True)
class ShardPlan:
    name: str
    samples: tuple[int, ...]  # positions in the sample list, in order
    tokens: int
    key: str  # what the shard must contain: a committed shard with another key is redone


def plan_shards(
    samples: Sequence[StoredSample], hidden_size: int, shard_bytes: int, identity: dict[str, Any]
) -> list[ShardPlan]:
    """Cut each group's samples, in order, into shards of about `shard_bytes` (a sample is never split): the offline
    store's plan, where a dataset added or changed leaves the other datasets' shards alone.

    Deterministic in its inputs, so a resumed run plans the same shards; `identity` (target, layer
    ids, ...) enters every key, so a changed target or layer rule never reuses an old shard.
    """
    groups: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(s.group, []).append(i)
    plans: list[ShardPlan] = []
    for group, members in groups.items():
        plans.extend(cut_shards(samples, members, hidden_size, shard_bytes, identity, group))
    return plans


MIXED = "mixed"  # the name of a spool's shards (`plan_mixed_shards`): each holds every group, none is a group's
# How a spool lane's samples become shards: (samples, hidden size, shard bytes, identity, seed) -> the plan.
ShardPlanner = Callable[[Sequence[StoredSample], int, int, dict[str, Any], int], list[ShardPlan]]


def plan_mixed_shards(
    samples: Sequence[StoredSample], hidden_size: int, shard_bytes: int, identity: dict[str, Any], seed: int
) -> list[ShardPlan]:
    """The spool's plan: every group's samples interleaved in the proportions the groups have (`interleave_groups`),
    then cut in that order into shards of about `shard_bytes`, named `mixed-NNNNN`. A trainer that takes shards in
    order then trains every dataset throughout the run, as offline training's shuffle does, not one after another.

    Deterministic in its inputs and `seed` (a resumed capture plans the same shards); keys as `plan_shards`'.
    """
    order = interleave_groups(samples, seed)
    return cut_shards(samples, order, hidden_size, shard_bytes, identity, MIXED)


def interleave_groups(samples: Sequence[StoredSample], seed: int) -> list[int]:
    """Every position of `samples` once, the groups interleaved so that after any number t of them each group g has
    had floor or ceil of t x n_g / N (its share of the samples so far, n_g of the N samples being g's): so every run
    of consecutive samples, a shard or several, holds each group's share of it to within less than two samples.

    Each group's samples are shuffled by `seed` first (a dataset's own order, by source or by length, is not kept:
    offline training shuffles it too). Then, at each place, among the groups whose next sample may come (it keeps
    the group at or below the ceiling of its share) the one whose next sample is due soonest (the last place that
    keeps the group at or above the floor of its share) comes; ties in a seeded order of the groups. This earliest-
    deadline rule finds such a sequence whenever one exists, and one always does (Tijdeman's chairman assignment).
    """
    rng = random.Random(f"interleave:{seed}")
    groups: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(s.group, []).append(i)
    members = [groups[g] for g in sorted(groups)]
    for m in members:
        rng.shuffle(m)
    tie = list(range(len(members)))
    rng.shuffle(tie)
    n = len(samples)
    taken = [0] * len(members)
    order: list[int] = []
    for t in range(1, n + 1):
        best: tuple[int, int] | None = None  # (deadline, tie rank) of the group chosen so far
        chosen = -1
        for g, m in enumerate(members):
            j = taken[g]
            if j == len(m) or (j * n) // len(m) + 1 > t:  # the group is done, or its next sample is not due yet
                continue
            due = (-(-(j + 1) * n // len(m)), tie[g])
            if best is None or due < best:
                best, chosen = due, g
        order.append(members[chosen][taken[chosen]])
        taken[chosen] += 1
    return order


def cut_shards(
    samples: Sequence[StoredSample],
    order: Sequence[int],
    hidden_size: int,
    shard_bytes: int,
    identity: dict[str, Any],
    prefix: str,
) -> list[ShardPlan]:
    """The samples at `order`, in that order, cut into shards of about `shard_bytes` (a sample is never split), named
    `<prefix>-NNNNN`; each shard's key hashes `identity` and its samples (ids, splits, tokens, masks)."""
    per_token = token_bytes(hidden_size)
    head = json.dumps({"format": FORMAT, "hidden_size": hidden_size, **identity}, sort_keys=True).encode()
    plans: list[ShardPlan] = []
    current: list[int] = []
    tokens = 0
    for at in [*order, None]:  # None: the end
        if current and (at is None or (tokens + len(samples[at].input_ids)) * per_token > shard_bytes):
            h = hashlib.sha256(head)
            for j in current:
                s = samples[j]
                h.update(f"\0{s.sample_id}\0{s.split}\0".encode())
                h.update(torch.tensor(list(s.input_ids), dtype=torch.int32).numpy().tobytes())
                h.update(torch.tensor(list(s.loss_mask), dtype=torch.int8).numpy().tobytes())
            plans.append(ShardPlan(shard_name(prefix, len(plans)), tuple(current), tokens, h.hexdigest()))
            current, tokens = [], 0
        if at is not None:
            current.append(at)
            tokens += len(samples[at].input_ids)
    return plans


@dataclass(frozen=True)
class ShardLayout:
    """Where every byte of a shard's safetensors file goes, from its plan alone (before any state exists).

    Tensors in the order aux, final, offsets, input_ids, loss_mask: each starts at a multiple of its
    own item size, and the header is padded with spaces (as safetensors itself pads) so that the
    data starts at a multiple of ALIGN.
    """

    header: bytes  # the 8-byte little-endian length and the JSON header, padded
    size: int  # the whole file
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...], int]]  # key -> (dtype, shape, byte offset in the file)
    row_offsets: tuple[int, ...]  # sample j is rows row_offsets[j]:row_offsets[j + 1]
    sample_ids: tuple[str, ...] = ()  # in row order

    def index(self) -> dict[str, Any]:
        """What a reader of some rows needs without reading the file's header: the samples' ids and row offsets, and
        each tensor's dtype, shape and byte offset in the file (a spool shard's manifest entry holds it)."""
        return {
            "sample_ids": list(self.sample_ids),
            "offsets": list(self.row_offsets),
            "tensors": {
                key: {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "offset": at}
                for key, (dtype, shape, at) in self.tensors.items()
            },
        }


_ST_DTYPES = {torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int8: "I8"}


def shard_layout(plan: ShardPlan, rows: Sequence[StoredSample], hidden_size: int) -> ShardLayout:
    T, H = plan.tokens, hidden_size
    lengths = [len(r.input_ids) for r in rows]
    if sum(lengths) != T:
        raise ValueError(f"{plan.name}: the plan has {T} tokens, its samples {sum(lengths)}")
    specs = [
        ("aux_hidden_states", torch.bfloat16, (T, 3 * H)),
        ("final_hidden_state", torch.bfloat16, (T, H)),
        ("offsets", torch.int64, (len(rows) + 1,)),
        ("input_ids", torch.int32, (T,)),
        ("loss_mask", torch.int8, (T,)),
    ]
    # One metadata entry, its JSON written by us: the file's bytes, and so its checksum, are the same in every process.
    header: dict[str, Any] = {
        "__metadata__": {
            "eagle3": json.dumps(
                {
                    "format": FORMAT,
                    "key": plan.key,
                    "sample_ids": [r.sample_id for r in rows],
                    "splits": [r.split for r in rows],
                }
            )
        }
    }
    at, spans = 0, []
    for key, dtype, shape in specs:
        n = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [at, at + n]}
        spans.append((key, dtype, shape, at))
        at += n
    text = json.dumps(header, separators=(",", ":")).encode()
    padded = -(-(8 + len(text)) // ALIGN) * ALIGN - 8
    text += b" " * (padded - len(text))
    data_start = 8 + len(text)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return ShardLayout(
        struct.pack("<Q", len(text)) + text,
        data_start + at,
        {key: (dtype, shape, data_start + off) for key, dtype, shape, off in spans},
        tuple(offsets),
        tuple(r.sample_id for r in rows),
    )


def host_buffer(nbytes: int, *, pin: bool) -> torch.Tensor:
    """At least `nbytes` of host memory starting at an ALIGN boundary (O_DIRECT needs it); page-locked with `pin`
    (for CUDA copies).

    Pinned memory comes from torch's caching host allocator, which rounds every block up to a power of two and
    keeps it: `nbytes + ALIGN` of slack for the alignment would turn a 1 GiB shard's buffer into 2 GiB of
    page-locked memory. So a pinned buffer asks for the power of two itself and is all of the block from its first
    ALIGN boundary (cudaHostAlloc's blocks start on one); only where that leaves less than `nbytes` (a block off a
    page boundary, `nbytes` a power of two) is a larger block taken."""
    if pin:
        raw = torch.empty(pinned_block_size(nbytes), dtype=torch.uint8, pin_memory=True)
        skip = (-raw.data_ptr()) % ALIGN
        if skip + nbytes <= raw.numel():  # the block's own slack holds the alignment: all of it, less the skip
            return raw[skip:]
        del raw  # back to the allocator's cache before the larger request, not held beside it
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip : skip + nbytes]


def pinned_block_size(nbytes: int) -> int:
    """The size torch's caching host allocator gives a pinned request of `nbytes`: the next power of two."""
    return 1 << max(0, nbytes - 1).bit_length()


class ShardImage:
    """One shard's file, built in a reusable host buffer: header, ids, masks and offsets written at once,
    the states copied in by the capture (`aux[a:b]`, `final[a:b]` are views of the buffer)."""

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer  # uint8, ALIGN-aligned, reused shard after shard
        self.plan: ShardPlan | None = None
        self.layout: ShardLayout | None = None

    @property
    def capacity(self) -> int:
        return self.buffer.numel()

    def view(self, key: str) -> torch.Tensor:
        assert self.layout is not None  # called by start(), once the layout is set
        dtype, shape, start = self.layout.tensors[key]
        n = math.prod(shape) * dtype.itemsize
        return self.buffer[start : start + n].view(dtype).view(shape)

    def start(
        self, plan: ShardPlan, rows: Sequence[StoredSample], hidden_size: int, layout: ShardLayout | None = None
    ) -> None:
        """Lay out `plan` in the buffer and write everything but the states."""
        layout = layout or shard_layout(plan, rows, hidden_size)
        if padded_size(layout.size) > self.capacity:
            raise ValueError(f"{plan.name} needs {layout.size:,} bytes, the buffer has {self.capacity:,}")
        self.plan, self.layout = plan, layout
        self.buffer[: len(layout.header)].copy_(torch.frombuffer(bytearray(layout.header), dtype=torch.uint8))
        self.view("offsets").copy_(torch.tensor(layout.row_offsets, dtype=torch.int64))
        ids, mask = self.view("input_ids"), self.view("loss_mask")
        for j, r in enumerate(rows):
            a, b = layout.row_offsets[j], layout.row_offsets[j + 1]
            ids[a:b] = torch.as_tensor(r.input_ids, dtype=torch.int32)
            mask[a:b] = torch.as_tensor(r.loss_mask, dtype=torch.int8)
        self.aux, self.final = self.view("aux_hidden_states"), self.view("final_hidden_state")

    def memory(self) -> memoryview:
        """The whole buffer: the file is its first `layout.size` bytes."""
        return self.buffer.numpy().data  # a memoryview of the array (numpy types its buffer protocol from 3.12)


def padded_size(size: int) -> int:
    """`size` rounded up to ALIGN: an O_DIRECT write of the file's tail writes this much, then the file is truncated."""
    return -(-size // ALIGN) * ALIGN


# Errors that mean "not O_DIRECT from this memory to this file", after which the same bytes go buffered: EINVAL (the
# file system or the alignment refuses it) and EFAULT (the kernel cannot pin the buffer's pages for the DMA, as for a
# mapping of driver memory; a buffered write copies from it). A buffered write that fails the same way still raises.
DIRECT_REFUSED = (errno.EINVAL, errno.EFAULT)


def _open_for_write(path: Path, direct: bool) -> tuple[int, bool]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o644), True
        except OSError as e:  # tmpfs and some network file systems refuse O_DIRECT
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
    return os.open(path, flags, 0o644), False


class _Hashing(threading.Thread):
    """Hashes data[:n] in `chunk` pieces on a thread of its own, while the caller writes the same bytes (both release
    the GIL: hashlib and xxhash on large buffers, os.pwrite always). `digest()` waits for it; `stop()` ends it early."""

    def __init__(self, data: memoryview, n: int, chunk: int, checksum: str, chunks: list[str] | None = None):
        """`chunks`: filled with the digest (CHUNK_CHECKSUM) of each `chunk_bytes(n)` of the data, in order."""
        super().__init__(name="shard-hash", daemon=True)
        self.data, self.n = data, n
        self.chunk = chunk if chunks is None else chunk_bytes(n)  # chunk_bytes(n) divides WRITE_CHUNK: as few updates
        self.hasher = _hasher(checksum)
        self.chunks = chunks
        self.error: BaseException | None = None
        self._stop_asked = False
        self.start()

    def run(self) -> None:
        try:
            for at in range(0, self.n, self.chunk):
                if self._stop_asked:
                    return
                piece = self.data[at : min(self.n, at + self.chunk)]
                self.hasher.update(piece)
                if self.chunks is not None:
                    self.chunks.append(chunk_digest(piece, CHUNK_CHECKSUM))
        except BaseException as e:  # noqa: BLE001 - raised again by digest(), in the writer's thread
            self.error = e

    def stop(self) -> None:
        """End early (the write failed) and wait: the buffer is not read once this returns."""
        self._stop_asked = True
        self.join()

    def digest(self) -> str:
        self.join()
        if self.error is not None:
            raise self.error
        return self.hasher.hexdigest()


def write_file(
    path: Path,
    data: memoryview,
    size: int | None = None,
    *,
    direct: bool = True,
    chunk: int | None = None,
    checksum: str | None = CHECKSUM,
    chunks: list[str] | None = None,
) -> tuple[str, bool]:
    """Write data[:size] to `path` in `chunk`-sized sequential writes, hashing the same bytes meanwhile with
    `checksum` (one of CHECKSUMS) on a thread of its own, fsync; return (the hex digest, whether O_DIRECT was used).

    With `direct`, the file is opened O_DIRECT when the file system allows it and `data` starts at an ALIGN
    boundary and extends to `padded_size(size)` (a ShardImage's buffer does): the tail is written padded,
    then the file truncated to `size`. A refused O_DIRECT write (DIRECT_REFUSED) goes on with buffered writes.
    `checksum=None` (the benchmark's raw disk figure) skips the hash and returns "" for it. `chunks` (with a
    `checksum`): filled with each chunk's digest (`chunk_bytes(size)`, CHUNK_CHECKSUM). Nothing reads `data` once this
    returns or raises.
    """
    n = len(data) if size is None else size
    chunk = chunk or WRITE_CHUNK
    hashing = _Hashing(data, n, chunk, checksum, chunks) if checksum is not None else None
    try:
        direct = _write_chunks(path, data, n, chunk, direct)
    except BaseException:
        if hashing is not None:
            hashing.stop()
        raise
    return (hashing.digest() if hashing is not None else ""), direct


def _write_chunks(path: Path, data: memoryview, n: int, chunk: int, direct: bool) -> bool:
    """write_file's writes and fsync; whether they went O_DIRECT to the end."""
    aligned = direct and chunk % ALIGN == 0 and len(data) >= padded_size(n) and _address(data) % ALIGN == 0
    fd, direct = _open_for_write(path, aligned)
    try:
        done = 0
        while done < n:
            end = min(n, done + chunk)
            if direct:
                try:
                    wrote = os.pwrite(fd, data[done : padded_size(end)], done)
                except OSError as e:
                    if e.errno not in DIRECT_REFUSED:
                        raise
                    wrote = 0
                if wrote == 0 or (wrote % ALIGN and done + wrote < n):  # refused or short: buffered from here on
                    os.close(fd)
                    fd, direct = os.open(path, os.O_WRONLY), False
            else:
                wrote = os.pwrite(fd, data[done:end], done)
            done += min(wrote, n - done)
        if os.fstat(fd).st_size != n:  # O_DIRECT wrote the tail padded
            os.ftruncate(fd, n)
        os.fsync(fd)
    finally:
        os.close(fd)
    return direct


def write_files(
    items: Sequence[tuple[Path, int]],
    data: memoryview,
    *,
    writers: int,
    direct: bool = True,
    checksum: str | None = CHECKSUM,
) -> list[tuple[str, bool]]:
    """Each (path, size) of `items` written from data[:size] by `write_file`, `writers` files at once: the way the
    store's writer threads write shards (StoreSettings.writers of them, WRITE_CHUNK writes each). The disk
    measurements (the extraction benchmark's, `eagle3 gpu-check`'s) write so. Returns write_file's results in order."""
    with ThreadPoolExecutor(max_workers=max(1, writers), thread_name_prefix="disk-writer") as pool:
        return list(pool.map(lambda item: write_file(item[0], data, item[1], direct=direct, checksum=checksum), items))


def _hasher(checksum: str) -> Any:
    """A new hash object for `checksum`, one of CHECKSUMS that this process has (CHECKSUM always is)."""
    make = CHECKSUMS[checksum]
    if make is None:
        raise RuntimeError(f"{checksum} needs the xxhash package: pip install xxhash (the project's install has it)")
    return make()


def chunk_digest(data: memoryview | bytes, algorithm: str) -> str:
    """The hex digest of one chunk with `algorithm`, one of CHUNK_CHECKSUMS."""
    make = CHUNK_CHECKSUMS[algorithm]
    if make is None:
        raise RuntimeError(f"{algorithm} needs the xxhash package: pip install xxhash (the project's install has it)")
    h = make()
    h.update(data)
    return str(h.hexdigest())


def _address(view: memoryview) -> int:
    import ctypes

    if view.readonly or not len(view):
        return -1
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def read_manifest(root: Path) -> dict[str, Any]:
    return dict(read_json(Path(root) / MANIFEST))  # ESTALE and EIO retried: a spool's trainer polls it (shared_fs.py)


def file_checksum(path: Path, checksum: str = CHECKSUM) -> str:
    """The hex digest of the file's bytes with `checksum` (one of CHECKSUMS), read in WRITE_CHUNK pieces."""
    h = _hasher(checksum)
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(WRITE_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def recorded_checksum(entry: dict[str, Any]) -> tuple[str, str]:
    """(algorithm, hex digest) of a manifest entry: `xxh3_128` for shards written now, `sha256` for older ones."""
    for algorithm, hasher in CHECKSUMS.items():
        if algorithm in entry:
            if hasher is None:
                raise RuntimeError(
                    f"the manifest entry is checksummed with {algorithm}, which needs the xxhash "
                    "package: pip install xxhash (the project's install has it)"
                )
            return algorithm, entry[algorithm]
    raise ValueError(f"the manifest entry records none of the checksums {', '.join(CHECKSUMS)}: {sorted(entry)}")


class ShardCommitter:
    """Writes shards and records them in the manifest; safe to call from several writer threads.

    A shard is written, fsynced and renamed by its writer (`write`), which then gives its buffer back;
    `record` lists it. Shards finished while a manifest write is under way share the next one (a group
    commit): the directory is fsynced (their renames are durable), then the manifest replaced
    atomically, and each writer returns once a manifest that lists its shard is on disk. So a listed
    shard is always a whole, durable file, as with one manifest write per shard, for 3 fsyncs per
    group instead of 3 per shard.

    `fence`, when given, is called right before each step that publishes (a shard's rename into its name, each
    manifest write) and raises to refuse it: a spool lane's lease check (lease.py). `chunked` (a spool's lanes): each
    entry also holds its chunks' digests ("chunks") and its rows' index ("index", `ShardLayout.index`), so a reader
    of some rows reads and verifies only their chunks (spool.py's `ShardRows`); an offline store's manifest lists
    thousands of shards and is read whole, so it does without.
    """

    def __init__(
        self, root: Path, manifest: dict[str, Any], fence: Callable[[], None] = lambda: None, *, chunked: bool = False
    ):
        self.root = Path(root)
        self.manifest = manifest
        self.fence = fence
        self.chunked = chunked
        self._cond = threading.Condition()
        self._changes = 0  # entries added to self.manifest
        self._saved = 0  # of which this many are in the manifest on disk
        self._saving = False  # a writer is writing the manifest (without the lock)

    def save_manifest(self) -> None:
        with self._cond:
            self.fence()
            write_json_atomic(self.root / MANIFEST, self.manifest)

    def write(self, image: ShardImage, *, direct: bool = True) -> dict[str, Any]:
        """Write the image under a temporary name, fsync, rename; return its manifest entry (not listed yet: `record`).
        The image's buffer is no longer needed when this returns."""
        plan, layout = image.plan, image.layout
        assert plan is not None and layout is not None  # a started image
        path = self.root / plan.name
        tmp = path.with_name(path.name + ".tmp")
        chunks: list[str] | None = [] if self.chunked else None
        digest, _ = write_file(tmp, image.memory(), layout.size, direct=direct, checksum=CHECKSUM, chunks=chunks)
        self.fence()
        os.replace(tmp, path)
        entry = {
            "key": plan.key,
            CHECKSUM: digest,
            "bytes": layout.size,
            "samples": len(layout.row_offsets) - 1,
            "tokens": plan.tokens,
        }
        if chunks is not None:
            entry["chunks"] = {"algorithm": CHUNK_CHECKSUM, "bytes": chunk_bytes(layout.size), "digests": chunks}
            entry["index"] = layout.index()
        return entry

    def record(
        self, name: str, entry: dict[str, Any], drop: Collection[str] = (), listed: Callable[[], None] | None = None
    ) -> None:
        """List the written shard `name` in the manifest, unlisting the shards in `drop` (a spool's deleted ones);
        return once that manifest is durable (see the class). `listed()` is called once the shard is in the manifest
        in memory, before it is written: the caller's next shard may be listed from then on, in the same write."""
        with self._cond:
            shards = self.manifest["shards"]
            for gone in [n for n in shards if n in drop]:
                del shards[gone]
            shards[name] = entry
            self._changes += 1
            if listed is not None:
                listed()
            mine = self._changes
            while self._saved < mine:
                if self._saving:  # another writer's manifest write is under way: the next one lists this shard
                    self._cond.wait()
                    continue
                self._saving, upto = True, self._changes
                text = json.dumps(self.manifest, indent=2) + "\n"
                self._cond.release()
                try:
                    fsync_dir(self.root)  # the renames of every shard listed in `text` are durable first
                    self.fence()  # as late as can be: the window a stalled writer could slip through is this gap
                    write_text_atomic(self.root / MANIFEST, text)
                finally:  # on an error the waiting writers try again themselves
                    self._cond.acquire()
                    self._saving = False
                    self._cond.notify_all()
                self._saved = upto

    def commit(self, image: ShardImage, *, direct: bool = True) -> dict[str, Any]:
        """Write the image, fsync, rename, then list the shard in the manifest: only then is it trusted."""
        entry = self.write(image, direct=direct)
        assert image.plan is not None  # write() has checked it
        self.record(image.plan.name, entry)
        return entry


def intact(root: Path, entry: dict[str, Any], name: str, verify: bool) -> bool:
    """The committed shard's file is there with its recorded size (and, with `verify`, its recorded checksum)."""
    path = Path(root) / name
    if not path.exists() or path.stat().st_size != entry["bytes"]:
        return False
    if not verify:
        return True
    algorithm, digest = recorded_checksum(entry)
    return file_checksum(path, algorithm) == digest


def trusted_shards(root: Path, manifest: dict[str, Any], plans: Iterable[ShardPlan], verify: bool) -> set[str]:
    """The planned shards already committed with the planned content, intact on disk."""
    done = set()
    for plan in plans:
        entry = manifest.get("shards", {}).get(plan.name)
        if entry is not None and entry["key"] == plan.key and intact(root, entry, plan.name, verify):
            done.add(plan.name)
    return done


def stale_shards(root: Path, manifest: dict[str, Any], plans: Iterable[ShardPlan]) -> dict[str, dict[str, Any]]:
    """Committed, intact shards the plan does not want as they are (other samples, target, layers or size)."""
    wanted = {p.name: p.key for p in plans}
    return {
        name: entry
        for name, entry in manifest.get("shards", {}).items()
        if wanted.get(name) != entry["key"] and intact(root, entry, name, verify=False)
    }


def remove_untrusted(root: Path, manifest: dict[str, Any]) -> list[str]:
    """Delete temporary files and shard files the manifest does not list (a kill between rename and record)."""
    removed = []
    listed = set(manifest.get("shards", {}))
    for path in sorted([*Path(root).glob("*.safetensors"), *Path(root).glob("*.tmp")]):
        if path.name not in listed:
            path.unlink()
            removed.append(path.name)
    return removed


class ShardFile:
    """One shard, read by position: its safetensors header parsed once, then any row range of a tensor read with
    `os.preadv` into a tensor of its own (no mapping; see the module's docstring)."""

    DTYPES = {
        "BF16": torch.bfloat16,
        "F16": torch.float16,
        "F32": torch.float32,
        "I64": torch.int64,
        "I32": torch.int32,
        "I8": torch.int8,
        "U8": torch.uint8,
    }

    def __init__(self, path: Path):
        self.path, self.fd = path, -1
        self.fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(self.fd).st_size
            if size < 8:
                raise ValueError(f"{size} bytes: not a safetensors file")
            (n,) = struct.unpack("<Q", self._read(0, 8))
            if n + 8 > size:
                raise ValueError(f"header of {n:,} bytes in a file of {size:,}")
            header = json.loads(self._read(8, n))
            self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
            self.tensors: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
            for key, t in header.items():
                dtype, shape, (a, b) = self.DTYPES[t["dtype"]], tuple(t["shape"]), t["data_offsets"]
                if b - a != math.prod(shape) * dtype.itemsize or 8 + n + b > size:
                    raise ValueError(f"tensor {key} {shape} {t['dtype']} does not fit its bytes {a}:{b}")
                self.tensors[key] = (dtype, shape, 8 + n + a)
        except BaseException:
            self.close()
            raise

    @overload
    def _read(self, offset: int, n: int) -> bytes: ...

    @overload
    def _read(self, offset: int, n: int, into: torch.Tensor) -> torch.Tensor: ...

    def _read(self, offset: int, n: int, into: torch.Tensor | None = None) -> bytes | torch.Tensor:
        """`n` bytes from `offset`: as bytes, or into the uint8 tensor `into` (returned)."""
        out = torch.empty(n, dtype=torch.uint8) if into is None else into
        view, done = out.numpy().data, 0
        while done < n:  # preadv may return less than asked (signals, some filesystems)
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got == 0:
                raise ValueError(f"{self.path}: ends at byte {offset + done:,}, {n - done:,} bytes short")
            done += got
        return out.numpy().tobytes() if into is None else out

    def shape(self, key: str) -> tuple[int, ...]:
        return self.tensors[key][1]

    def rows(self, key: str, a: int, b: int) -> torch.Tensor:
        """Rows a:b of tensor `key`, as a new tensor."""
        dtype, shape, start = self.tensors[key]
        row = math.prod(shape[1:]) * dtype.itemsize
        buf = self._read(start + a * row, (b - a) * row, torch.empty((b - a) * row, dtype=torch.uint8))
        return buf.view(dtype).reshape(b - a, *shape[1:])

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    __del__ = close  # a store dropped without close() gives its descriptors back


class HiddenStateStore:
    """Read access: `store[sample_id]` returns one sample's tensors by index lookup and one positional read per key."""

    def __init__(self, root: Path, *, tolerate_damage: bool = False):
        """Index every committed shard. A shard whose file is missing, of another size than recorded or unreadable
        raises, unless `tolerate_damage`: then it is left out of the index and named in `damaged` (the checks)."""
        self.root = Path(root)
        self.manifest = read_manifest(self.root)
        self.hidden_size = int(self.manifest["hidden_size"])
        self.index: dict[str, tuple[str, int, int, str]] = {}  # id -> (shard, start, end, split)
        self.damaged: dict[str, str] = {}
        self._handles: OrderedDict[str, ShardFile] = OrderedDict()  # the most recently read shards, open
        for name, entry in sorted(self.manifest.get("shards", {}).items()):
            try:
                self._index_shard(name, entry)
            except Exception as e:  # noqa: BLE001 - OSError, ValueError, KeyError or safetensors' own error
                if not tolerate_damage:
                    raise ValueError(f"{self.root / name}: {e}; delete it and re-materialize hidden_states") from e
                self.damaged[name] = str(e)

    def _index_shard(self, name: str, entry: dict[str, Any]) -> None:
        size = (self.root / name).stat().st_size
        if size != entry["bytes"]:
            raise ValueError(f"{size:,} bytes on disk, {entry['bytes']:,} recorded")
        f = self.shard(name)
        meta = json.loads(f.metadata["eagle3"])
        ids, splits = meta["sample_ids"], meta["splits"]
        offsets = f.rows("offsets", 0, f.shape("offsets")[0]).tolist()
        for j, (sid, split) in enumerate(zip(ids, splits, strict=False)):  # as written: one split per id
            self.index[sid] = (name, offsets[j], offsets[j + 1], split)

    def shard(self, name: str) -> ShardFile:
        """The open shard `name` (one of at most OPEN_SHARDS kept open, least recently read closed first)."""
        if name in self._handles:
            self._handles.move_to_end(name)
        else:
            self._handles[name] = ShardFile(self.root / name)
            if len(self._handles) > OPEN_SHARDS:
                self._handles.popitem(last=False)[1].close()
        return self._handles[name]

    def close(self) -> None:
        while self._handles:
            self._handles.popitem()[1].close()

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self.index

    def __len__(self) -> int:
        return len(self.index)

    def sample_ids(self, split: str | None = None) -> list[str]:
        return [s for s, (_, _, _, sp) in self.index.items() if split is None or sp == split]

    def shapes(self, sample_id: str) -> dict[str, tuple[int, ...]]:
        """Each key's shape for one sample, from the header alone."""
        name, a, b, _ = self.index[sample_id]
        f = self.shard(name)
        return {k: (b - a, *f.shape(k)[1:]) for k in KEYS}

    def __getitem__(self, sample_id: str) -> dict[str, torch.Tensor]:
        name, a, b, _ = self.index[sample_id]
        f = self.shard(name)
        return {k: f.rows(k, a, b) for k in KEYS}
