"""Benchmark: the SGLang backend's rank-0 hand-off, slab ring against the queue paths it replaced.

    .venv/bin/python benchmarks/sglang_handoff.py [--tokens 8192] [--hidden 7168] [--batches 5] [--json out.json]

One forward's rows at Kimi-K2.5 size by default (T = 8192 tokens, H = 7168: aux [T, 3H] and final
[T, H] in bf16, 470 MB) travel from a spawned rank-0 process into the parent's shard image (a host
buffer the parent owns, as extract.py's). Timed per batch, from the parent's request to the rows
copied into the image; the engine hands over the same precomputed tensors each time (no forward).

- `slab`: this backend (`RankPool`): rank 0 copies into a free slab of the ring allocated once,
  sends (slab, tokens), the parent copies slab -> image and gives the slab back. 2 copies.
- `queue`: the first backend: `.to("cpu")` into new pageable memory (on a CPU host a clone stands in
  for it), the tensors put on a torch.multiprocessing Queue (moved into new shared memory: a copy),
  the parent copies rows -> image. 3 copies, two of them into fresh pages.
- `shm-handle`: the backend before this one (`shared_host_copy`): one copy into new shared memory
  per batch, a handle on the queue, the parent copies -> image. 2 copies, one into fresh pages.

Both processes run torch on one thread (extract.py stages on one; a shared host's cores are busy).
With CUDA the rows start on the GPU and the script also times rank 0's device-to-host copy alone:
into a page-locked slab (cudaHostRegister, non_blocking on a side stream, event) against `.to("cpu")`
into pageable memory. Prints GB/s per path and the ratios. Figures: docs/gpu-host.md, "3. Capture the hidden states".
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3_resources.hidden_states.sglang_backend import (  # noqa: E402
    SHM_DIR,
    RankPool,
    SlabLayout,
    SlabRing,
)

SHM_MARGIN = 0.9  # of /dev/shm's free bytes, the most the run plans to use


class FixedRows:
    """A rank engine whose rank 0 returns the same [T, 3H] / [T, H] bf16 rows every batch (on the GPU if any)."""

    def __init__(self, rank: int, world_size: int, tokens: int, hidden: int):
        torch.set_num_threads(1)
        self.rank = rank
        device = "cuda" if torch.cuda.is_available() else "cpu"
        g = torch.Generator().manual_seed(0)
        self.aux = torch.randn(tokens, 3 * hidden, generator=g).to(torch.bfloat16).to(device)
        self.final = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).to(device)

    def info(self) -> dict:
        return {"rank": self.rank}

    def capture(self, sequences):
        return self.aux, self.final


def fixed_rows(rank: int, world_size: int, *, tokens: int, hidden: int) -> FixedRows:
    return FixedRows(rank, world_size, tokens, hidden)


def _queue_rank(tokens: int, hidden: int, mode: str, requests, replies) -> None:
    """The replaced rank-0 loops: `queue` (.to("cpu") then the Queue's copy into shared memory) and `shm-handle`."""
    engine = FixedRows(0, 1, tokens, hidden)
    while requests.get() is not None:
        aux, final = engine.capture(None)
        if mode == "queue":
            host = [t.to("cpu") if t.is_cuda else t.clone() for t in (aux, final)]  # fresh pageable memory
        else:
            host = []
            for t in (aux, final):
                # set_(storage, offset, size): torch's stubs list this form only with a stride
                out = torch.empty(0, dtype=torch.bfloat16).set_(
                    torch.UntypedStorage._new_shared(t.numel() * 2),
                    0,
                    tuple(t.shape),  # type: ignore[call-overload]
                )
                out.copy_(t)
                host.append(out)
        replies.put(tuple(host))


def time_queue_path(mode: str, tokens: int, hidden: int, batches: int, image: tuple[torch.Tensor, torch.Tensor]):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    requests, replies = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_queue_rank, args=(tokens, hidden, mode, requests, replies))
    p.start()
    seconds = []
    try:
        for i in range(batches + 1):  # the first one warms up
            t0 = time.perf_counter()
            requests.put(i)
            aux, final = replies.get(timeout=600)
            image[0].copy_(aux)
            image[1].copy_(final)
            seconds.append(time.perf_counter() - t0)
            del aux, final
    finally:
        requests.put(None)
        p.join(60)
        if p.is_alive():
            p.kill()
    return seconds[1:]


def time_slab_path(tokens: int, hidden: int, batches: int, image: tuple[torch.Tensor, torch.Tensor], slabs: int):
    layout = SlabLayout(tokens, 3 * hidden, hidden)
    pool = RankPool(
        1,
        functools.partial(fixed_rows, tokens=tokens, hidden=hidden),
        handoff=layout,
        slabs=slabs,
        start_timeout_s=600,
        batch_timeout_s=600,
        stop_grace_s=30,
    )
    sequence = [list(range(tokens))]
    seconds = []
    try:
        pool.start()
        warm = pool.ring.count  # each slab's first use maps its pages in rank 0: once per run, not timed
        for _ in range(batches + warm):
            t0 = time.perf_counter()
            rows = pool.result(pool.submit(sequence))
            image[0].copy_(rows.aux)
            image[1].copy_(rows.final)
            rows.release()
            seconds.append(time.perf_counter() - t0)
        stats = dict(pool.stats)
    finally:
        pool.close()
    return seconds[warm:], stats


def shm_batches(slabs: int) -> int:
    """Batches of rows in /dev/shm at once, at most: the slab ring (`slabs`), or the queue paths' shared copies (the
    one in the queue and the one the parent still reads), plus one for what a path leaves until its memory goes."""
    return max(slabs, 2) + 1


def tokens_that_fit(tokens: int, hidden: int, slabs: int, free_bytes: int) -> int:
    """`tokens`, or fewer: the most whose batches (`shm_batches`) fit SHM_MARGIN of /dev/shm's free bytes (a host with
    a small /dev/shm, as a container's 64 MB default, would otherwise fail the run: SlabRing refuses what does not fit
    and torch's queue would die of SIGBUS). 0 when not even one token's rows fit."""
    room = int(free_bytes * SHM_MARGIN) // shm_batches(slabs)
    if SlabLayout(tokens, 3 * hidden, hidden).nbytes <= room:
        return tokens
    per_token = 8 + 4 * hidden * 2  # the id and the (3 + 1) x H bf16 rows
    fit = max(0, (room - 3 * 4096) // per_token)  # each region of a slab rounds up to a page
    while fit and SlabLayout(fit, 3 * hidden, hidden).nbytes > room:
        fit -= 1
    return fit


def time_device_to_host(tokens: int, hidden: int, repeats: int) -> dict:
    """On CUDA: rank 0's copy alone, into a registered (page-locked) slab vs `.to("cpu")` into pageable memory."""
    aux = torch.randn(tokens, 3 * hidden, device="cuda").to(torch.bfloat16)
    final = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    nbytes = (aux.numel() + final.numel()) * 2
    ring = SlabRing(1, SlabLayout(tokens, 3 * hidden, hidden))
    try:
        slab_aux, slab_final, _ = ring.slabs[0]
        base = slab_aux.untyped_storage()
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(base.data_ptr(), base.nbytes(), 0)
        if int(getattr(err, "value", err)) != 0:
            raise RuntimeError(f"cudaHostRegister of the slab failed: {cudart.cudaGetErrorString(err)}")
        try:
            stream = torch.cuda.Stream()
            pinned, pageable = [], []
            for _ in range(repeats + 1):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    slab_aux.copy_(aux, non_blocking=True)
                    slab_final.copy_(final, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                event.synchronize()
                pinned.append(time.perf_counter() - t0)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                a, f = aux.to("cpu"), final.to("cpu")
                pageable.append(time.perf_counter() - t0)
                del a, f
        finally:  # before the mapping can go: unmapping registered memory is undefined
            cudart.cudaHostUnregister(base.data_ptr())
    finally:
        ring.close()
    p, q = statistics.median(pinned[1:]), statistics.median(pageable[1:])
    return {
        "bytes": nbytes,
        "pinned_gb_s": round(nbytes / p / 1e9, 2),
        "pageable_gb_s": round(nbytes / q / 1e9, 2),
        "pinned_over_pageable": round(q / p, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--batches", type=int, default=5, help="timed batches per path (after one warm-up)")
    ap.add_argument("--slabs", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where rank 0's rows start (auto: CUDA when present); benchmarks/device_check.py passes it",
    )
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before CUDA is first touched; the spawned rank inherits it
    elif args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device")
    torch.set_num_threads(1)
    free = shutil.disk_usage(SHM_DIR).free
    T, H = tokens_that_fit(args.tokens, args.hidden, args.slabs, free), args.hidden
    if T < 1:
        sys.exit(f"{SHM_DIR} has {free / 1e6:,.0f} MB free: not one token's rows of hidden {H} fit its hand-off slabs")
    if T < args.tokens:
        print(
            f"{SHM_DIR} has {free / 1e9:.2f} GB free, too little for {shm_batches(args.slabs)} batches of "
            f"{args.tokens} tokens: {T} tokens per batch (the figures are per byte; a smaller batch pays its fixed "
            "costs over fewer bytes)",
            flush=True,
        )
    nbytes = T * 4 * H * 2
    image = (torch.zeros(T, 3 * H, dtype=torch.bfloat16), torch.zeros(T, H, dtype=torch.bfloat16))
    out: dict = {
        "tokens": T,
        "tokens_asked": args.tokens,
        "shm_free_bytes": free,
        "hidden": H,
        "bytes_per_batch": nbytes,
        "batches": args.batches,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
    }
    slab_s, stats = time_slab_path(T, H, args.batches, image, args.slabs)
    paths = {"slab": slab_s}
    for mode in ("queue", "shm-handle"):
        paths[mode] = time_queue_path(mode, T, H, args.batches, image)
    for name, seconds in paths.items():
        median = statistics.median(seconds)
        out[name] = {
            "median_s": round(median, 4),
            "gb_s": round(nbytes / median / 1e9, 3),
            "seconds": [round(s, 4) for s in seconds],
        }
    out["slab_stats"] = stats
    out["slab_over_queue"] = round(out["queue"]["median_s"] / out["slab"]["median_s"], 2)
    out["slab_over_shm_handle"] = round(out["shm-handle"]["median_s"] / out["slab"]["median_s"], 2)
    if torch.cuda.is_available():
        out["device_to_host"] = time_device_to_host(T, H, args.batches)
    print(
        f"hand-off of {nbytes / 1e6:.0f} MB per batch (T={T}, H={H}), rank 0 -> parent's shard image, "
        f"median of {args.batches}:"
    )
    for name in paths:
        print(f"  {name:10s} {out[name]['median_s'] * 1e3:8.1f} ms  {out[name]['gb_s']:6.2f} GB/s")
    print(f"  slab / queue      {out['slab_over_queue']}x")
    print(f"  slab / shm-handle {out['slab_over_shm_handle']}x")
    if "device_to_host" in out:
        d = out["device_to_host"]
        print(
            f"  rank 0's D2H: pinned slab {d['pinned_gb_s']} GB/s, pageable .to('cpu') {d['pageable_gb_s']} GB/s, "
            f"{d['pinned_over_pageable']}x"
        )
    print(json.dumps(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
