"""The capture's paths that a GPU host takes, driven here through faithful CPU stand-ins where the kernel offers one.

- A shard image in page-locked memory written O_DIRECT: a driver's page-locked mapping may be memory the kernel
  cannot pin again for a direct write (EFAULT), while a buffered write copies from it. memfd_secret(2) memory is
  such memory on any Linux that has it: the store must write it, buffered, with the right checksum, not fail.
- The writes of the disk measurements go the store's way: `write_files` with the store's writer count, every file
  whole, hashed or not as asked.
- Page-locked shard buffers against torch's caching host allocator, emulated by its rule (every pinned block a
  power of two, kept for reuse): a buffer costs its block, not twice it.

Not driven here (no CPU stand-in has their semantics): the side stream, its events and the `non_blocking` copies
into pinned buffers (extract.Stager, RankZeroHandoff), cudaHostRegister. benchmarks/device_check.py runs those on a
GPU host.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3_resources.hidden_states.extract import HostBuffers
from eagle3_resources.hidden_states.store import ALIGN, WRITE_CHUNK, host_buffer, padded_size, write_file, write_files

REPO = Path(__file__).resolve().parents[1]
MEMFD_SECRET = 447  # the syscall's number on x86_64 and arm64


def secret_memory(nbytes: int) -> memoryview:
    """`nbytes` of memfd_secret memory, mapped here (page-aligned, writable); skips where the kernel lacks it."""
    if os.uname().machine not in ("x86_64", "aarch64"):
        pytest.skip("memfd_secret's syscall number is known here for x86_64 and arm64 only")
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(MEMFD_SECRET, 0)
    if fd < 0:
        pytest.skip(f"memfd_secret: {os.strerror(ctypes.get_errno())} (a kernel without secretmem)")
    try:
        os.ftruncate(fd, nbytes)
        mapped = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    return memoryview(mapped)


def test_an_image_in_memory_the_kernel_cannot_pin_is_written_buffered_with_its_checksum(tmp_path):
    size = 3 * WRITE_CHUNK // 2 + 123  # a whole chunk, a part, an unaligned tail
    memory = secret_memory(padded_size(size))
    payload = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    memory[:size] = payload.numpy().tobytes()
    # The precondition, so that the test proves what it says: O_DIRECT from this memory fails with EFAULT here.
    probe = tmp_path / "probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError as e:
        pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT ({e.strerror})")
    try:
        with pytest.raises(OSError) as refused:
            os.pwrite(fd, memory[:ALIGN], 0)
        assert refused.value.errno == errno.EFAULT
    finally:
        os.close(fd)

    digest, used_direct = write_file(tmp_path / "shard", memory, size, direct=True, checksum="sha256")
    on_disk = (tmp_path / "shard").read_bytes()
    assert on_disk == bytes(memory[:size])
    assert digest == hashlib.sha256(on_disk).hexdigest()
    assert not used_direct  # said so: the benchmark reports whether the store's writes went O_DIRECT


def test_the_disk_measurements_write_as_the_store_does(tmp_path):
    """`write_files`: each file whole from the same buffer, several at once, hashed when asked, O_DIRECT where taken."""
    buffer = host_buffer(padded_size(WRITE_CHUNK + 5 * ALIGN), pin=False)
    buffer.random_(0, 256, generator=torch.Generator().manual_seed(4))
    memory = buffer.numpy().data
    sizes = [WRITE_CHUNK + 5 * ALIGN, 7 * ALIGN + 1, WRITE_CHUNK, 3]
    items = [(tmp_path / f"f{i}", n) for i, n in enumerate(sizes)]
    results = write_files(items, memory, writers=3, direct=True, checksum="sha256")
    for (path, n), (digest, _) in zip(items, results, strict=True):  # one result per item, in order
        assert path.read_bytes() == bytes(memory[:n])
        assert digest == hashlib.sha256(bytes(memory[:n])).hexdigest()
    assert all(d == "" for d, _ in write_files(items, memory, writers=2, direct=False, checksum=None))
    assert [p.stat().st_size for p, _ in items] == sizes


class CachingHostAllocator:
    """torch's pinned allocations as its caching host allocator makes them (ATen/core/CachingHostAllocator.h): a
    request is rounded up to the next power of two, and the block starts `offset` bytes into a page (0: where
    cudaHostAlloc's blocks start). Counts the page-locked bytes it hands out; CPU memory stands in for them."""

    def __init__(self, real_empty, offset: int = 0):
        self.real_empty, self.offset = real_empty, offset
        self.blocks: list[int] = []

    def __call__(self, *size, dtype=None, pin_memory=False, **kw):
        if not pin_memory:
            return self.real_empty(*size, dtype=dtype, **kw)
        (n,) = size
        block = 1 << (n - 1).bit_length()
        self.blocks.append(block)
        raw = self.real_empty(block + 2 * ALIGN, dtype=torch.uint8)
        start = (-raw.data_ptr()) % ALIGN + self.offset
        return raw[start : start + n]  # torch's tensor has the size asked for, on a block of `block` bytes


@pytest.mark.parametrize("nbytes", [2**20, 2**20 - 3 * ALIGN, 2**19 + ALIGN])
def test_a_page_locked_shard_buffer_costs_its_power_of_two_block_not_twice_it(monkeypatch, nbytes):
    """A 1 GiB shard buffer asked for with ALIGN bytes of slack became a 2 GiB pinned block; the buffer asks for the
    block's size and uses all of it, aligned for O_DIRECT."""
    allocator = CachingHostAllocator(torch.empty)
    monkeypatch.setattr(torch, "empty", allocator)
    buffer = host_buffer(nbytes, pin=True)
    block = 1 << (nbytes - 1).bit_length()
    assert allocator.blocks == [block]
    assert buffer.numel() == block and buffer.data_ptr() % ALIGN == 0


def test_a_page_locked_buffer_is_reused_for_any_shard_its_block_holds(monkeypatch):
    """Shards differ in size (whole samples): a later, larger shard that fits the first one's block is built in the
    same buffer; one that does not gets a new block, and the pinned total is the blocks'."""
    allocator = CachingHostAllocator(torch.empty)
    monkeypatch.setattr(torch, "empty", allocator)
    buffers = HostBuffers(1, pin=True)
    first = buffers.take(600_000)
    buffers.give(first)
    second = buffers.take(1_000_000)  # 2**20 holds it
    assert second.buffer is first.buffer and allocator.blocks == [2**20]
    buffers.give(second)
    third = buffers.take(2**20 + 1)
    assert third.capacity >= 2**20 + 1 and allocator.blocks == [2**20, 2**21]


def test_a_pinned_block_off_a_page_boundary_is_used_from_its_first_aligned_byte(monkeypatch):
    """Where the allocator's blocks do not start on ALIGN (`pinned_use_cuda_host_register`: malloc'd memory), the
    buffer starts at the block's first ALIGN boundary; only when that leaves too little is a larger block taken."""
    allocator = CachingHostAllocator(torch.empty, offset=16)
    monkeypatch.setattr(torch, "empty", allocator)
    buffer = host_buffer(2**20 - ALIGN, pin=True)
    assert buffer.numel() >= 2**20 - ALIGN and buffer.data_ptr() % ALIGN == 0 and allocator.blocks == [2**20]
    buffer = host_buffer(2**20, pin=True)  # a whole block asked for: the skip does not fit in it
    assert buffer.numel() >= 2**20 and buffer.data_ptr() % ALIGN == 0
    assert allocator.blocks == [2**20, 2**20, 2**21]  # the aligned try, then the one with slack


@pytest.mark.slow
def test_the_extraction_benchmark_keeps_to_its_budget_and_says_how_it_wrote(tmp_path):
    """A device check's cap kills a section that runs past it, and a killed section gives no figures: with
    `--budget-s` the benchmark starts no round that would end past it (the first always runs) and says how many it
    ran. Its figures also say whether the store's writes from its host buffers went O_DIRECT. The model is made where
    it runs (`random_deepseek_v3(device=...)`, the GPU path's construction, here on the CPU)."""
    out = tmp_path / "extraction.json"
    args = ["--device", "cpu", "--hidden", "64", "--layers", "8", "--vocab", "512", "--samples", "4"]
    args += ["--min-len", "16", "--max-len", "48", "--write-gb", "0.005", "--rounds", "2", "--budget-s", "0"]
    p = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "hidden_states_throughput.py"), *args, "--dir", str(tmp_path)]
        + ["--json", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert (figures["rounds"], figures["write_rounds"], figures["rounds_asked"]) == (1, 1, 2), figures
    assert "budget: round 2 would take" in p.stdout
    assert len(figures["seconds"]["extract"]) == len(figures["seconds"]["disk_buffered"]) == 1
    assert len(figures["settle_seconds"]) == 1  # the buffered test's store write after it, untimed
    assert figures["store_o_direct"] in (True, False) and figures["pinned_buffers"] is False
    assert figures["ratio_extraction_to_limit"] > 0


def test_the_hand_off_benchmark_fits_its_batches_in_dev_shm():
    """A GPU host's /dev/shm may be a container's 64 MB: the hand-off benchmark then runs smaller batches (said in its
    figures) instead of failing on the first slab. The batches it plans fit; one token more would not."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from sglang_handoff import SHM_MARGIN, SlabLayout, shm_batches, tokens_that_fit

    kimi = 7168
    assert tokens_that_fit(8192, kimi, 2, 24 * 2**30) == 8192  # room for all: as asked
    for free in (64 * 2**20, 300 * 2**20):
        fit = tokens_that_fit(8192, kimi, 2, free)
        assert 0 < fit < 8192
        used = [shm_batches(2) * SlabLayout(n, 3 * kimi, kimi).nbytes for n in (fit, fit + 1)]
        assert used[0] <= free * SHM_MARGIN < used[1], (fit, used, free)
    assert tokens_that_fit(8192, kimi, 2, 10_000) == 0
