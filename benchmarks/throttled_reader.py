"""Benchmark: training tokens/s against the spool's read latency, with the prefetcher on and off (issue 42, item 1).

    .venv/bin/python benchmarks/throttled_reader.py                       # the defaults: 1, 2 and 4 ranks
    .venv/bin/python benchmarks/throttled_reader.py --latency-ms 0 20 --ranks 2 --steps 20

Why. Before issue 42 every rank read a new shard whole, on its training thread, when a step first needed it: time per
token was 1/T + bytes per token / R whatever the node count. Now a rank reads only its share's rows (the chunks they
lie in) on the prefetcher's threads, `--prefetch` steps ahead; training should then run at its own rate whatever the
read latency, as long as the file system's bandwidth keeps up.

The file system made slow on purpose: every read a rank makes (`spool.pread_into`, the one place a training rank's
spool bytes come from) sleeps `latency` and is then served at `--bandwidth-mb-s` shared by every rank (one clock: a
read waits for the reads before it to have had their bytes). The spool: one lane written by the capture's own writer
(`SpoolWriter`: chunked checksums, the index in the manifest), `--samples` samples of 100 to 600 tokens at hidden size
`--hidden`, shards of `--shard-kb`, a mix of 2 shards. The steps are rank 0's reader's (`SpoolReader`, planned from the
manifests: it reads nothing). The ranks are threads, each a training rank as `SpoolWindows` runs one: its own
`SpoolFollower` holding the shards named with each step, its `Prefetcher` reading and packing its share
(`windows[rank::world]`) `--prefetch` steps ahead (0: on the training thread, when the step is asked for, as before),
its training a sleep of its share's tokens / `--rank-tok-s` (a GPU's step, which holds no GIL), then a barrier (the
gradients' all-reduce). The figure: tokens of every rank's steps over the wall time of the `--steps` steps; the ratio
is against latency 0 with the same ranks and prefetch, and prefetch on against off. Prints a table and one JSON line.
CPU only.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3_assets.stages.eagle3_drafter.data import Window, pack_windows  # noqa: E402
from eagle3_assets.stages.eagle3_drafter.spool_prefetch import Prefetcher, StepRead  # noqa: E402
from eagle3_resources.hidden_states import spool  # noqa: E402
from eagle3_resources.hidden_states.spool import (  # noqa: E402
    ReadRecord,
    ShardRef,
    SpoolFollower,
    SpoolReader,
    SpoolSettings,
    SpoolWriter,
    Step,
    create_spool,
    read_step,
)
from eagle3_resources.hidden_states.store import (  # noqa: E402
    FORMAT,
    ShardImage,
    StoredSample,
    host_buffer,
    padded_size,
    plan_shards,
)


class ThrottledDisk:
    """`spool.pread_into` made slow: each read sleeps `latency_s`, then takes its bytes at `bandwidth` B/s on one
    clock shared by every thread (the file system's pipe)."""

    def __init__(self, latency_s: float, bandwidth: float):
        self.latency_s, self.bandwidth = latency_s, bandwidth
        self.free_at = time.monotonic()  # when the pipe has served every read so far
        self.lock = threading.Lock()
        self.reads = 0
        self.bytes = 0
        self.real = spool.pread_into

    def __call__(self, fd: int, view: memoryview, offset: int) -> int:
        got = self.real(fd, view, offset)
        now = time.monotonic()
        with self.lock:
            start = max(now + self.latency_s, self.free_at)
            self.free_at = start + got / self.bandwidth
            done_at = self.free_at
            self.reads += 1
            self.bytes += got
        time.sleep(max(0.0, done_at - now))
        return got


def make_spool(root: Path, samples: int, hidden: int, shard_bytes: int, batch_tokens: int) -> None:
    """One lane, every shard committed by the capture's writer (states: small integers, exact in bf16)."""
    rng = random.Random(0)
    data = []
    for i in range(samples):
        n = rng.randint(100, 600)
        data.append(StoredSample(f"S{i:05d}", "train", [rng.randrange(1000) for _ in range(n)], [1] * n))
    plans = plan_shards(data, hidden, shard_bytes, {"target": "synthetic"})
    settings = SpoolSettings(
        {"a": 10**12}, 1, max_len=512, batch_tokens=batch_tokens, seed=0, hidden_size=hidden, mix_shards=2
    )
    create_spool(root, settings)
    writer = SpoolWriter(root, "a", data, plans, {"format": FORMAT}, poll_s=0.01)
    image = ShardImage(host_buffer(max(padded_size(lay.size) for lay in writer.layouts.values()), pin=False))
    for plan in writer.todo:
        writer.reserve(plan)
        writer.start(image, plan, data)
        image.aux.copy_(torch.arange(image.aux.numel()).reshape(image.aux.shape) % 251)
        image.final.copy_(torch.arange(image.final.numel()).reshape(image.final.shape) % 127)
        writer.commit(image, direct=False)


def plan_steps(root: Path, steps: int) -> list[tuple[Step, dict[int, ShardRef]]]:
    """Rank 0's first `steps` steps, each with the references of the shards first named with it: no data read."""
    reader = SpoolReader(root, poll_s=0.01)
    out: list[tuple[Step, dict[int, ShardRef]]] = []
    told: set[int] = set()
    while len(out) < steps and (step := reader.next_step(stop=lambda: True)) is not None:
        new = sorted({w.shard for w in step.windows} - told)
        told.update(new)
        out.append((step, {k: reader.shard_ref(k) for k in new}))
    assert reader.bytes_read == 0, "planning read data"
    return out


def train_rank(
    root: Path,
    rank: int,
    world: int,
    steps: list[tuple[Step, dict[int, ShardRef]]],
    prefetch: int,
    rank_tok_s: float,
    barrier: threading.Barrier,
) -> int:
    """One rank's steps (as `SpoolWindows` plans, submits and takes them); its tokens."""
    follower, record = SpoolFollower(root), ReadRecord()

    def load(request: StepRead) -> Any:
        source = read_step(request.step.position, request.share, request.shards, record)
        share = [Window(w.sample_id, w.start, w.end) for w in request.share]
        return pack_windows(source, share, torch.float32, False)

    prefetcher = Prefetcher(load, prefetch)
    submitted, tokens = 0, 0

    def submit_upto(n: int) -> None:
        nonlocal submitted
        while submitted < min(n, len(steps)):
            step, refs = steps[submitted]
            follower.take(step.position, list(refs.values()))
            share = step.windows[rank::world] or step.windows[:1]
            prefetcher.submit(StepRead(step, share, {k: follower.rows_of(k) for k in {w.shard for w in share}}))
            submitted += 1

    try:
        for i, (step, _) in enumerate(steps):
            submit_upto(i + max(1, prefetch))
            batch = prefetcher.take(step)
            mine = int(batch.tokens.numel()) if step.windows[rank::world] else 0
            time.sleep(mine / rank_tok_s)  # the step's training on this rank's share
            barrier.wait()  # the gradients' all-reduce
            tokens += mine
    finally:
        prefetcher.close()
    return tokens


def run(
    root: Path, world: int, prefetch: int, steps: list[tuple[Step, dict[int, ShardRef]]], rank_tok_s: float
) -> dict[str, float]:
    barrier = threading.Barrier(world)
    tokens = [0] * world
    errors: list[BaseException] = []

    def go(rank: int) -> None:
        try:
            tokens[rank] = train_rank(root, rank, world, steps, prefetch, rank_tok_s, barrier)
        except BaseException as e:  # noqa: BLE001 - raised below, in the main thread
            errors.append(e)
            barrier.abort()

    started = time.monotonic()
    threads = [threading.Thread(target=go, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    seconds = time.monotonic() - started
    return {"tokens": sum(tokens), "seconds": round(seconds, 3), "tok_s": round(sum(tokens) / seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--latency-ms", type=float, nargs="+", default=[0, 2, 10, 40])
    parser.add_argument("--bandwidth-mb-s", type=float, default=500.0)
    parser.add_argument("--prefetch", type=int, default=4, help="steps read ahead when on (the trainer's default)")
    parser.add_argument("--rank-tok-s", type=float, default=10_000, help="a rank's training rate (a sleep)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--samples", type=int, default=160)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--shard-kb", type=int, default=1024)
    parser.add_argument("--batch-tokens", type=int, default=2048)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="throttled-reader-"))
    rows: list[dict[str, Any]] = []
    try:
        root = tmp / "spool"
        make_spool(root, args.samples, args.hidden, args.shard_kb * 1024, args.batch_tokens)
        steps = plan_steps(root, args.steps)
        bytes_per_token = 4 * args.hidden * 2 + 5
        print(
            f"{len(steps)} steps of <= {args.batch_tokens} tokens, {bytes_per_token:,} B a token; each rank trains "
            f"{args.rank_tok_s:,.0f} tok/s; the file system {args.bandwidth_mb_s:,.0f} MB/s shared"
        )
        print(f"{'ranks':>5} {'latency ms':>10} {'off tok/s':>10} {'on tok/s':>10} {'on/off':>7} {'on vs 0 ms':>10}")
        for world in args.ranks:
            base: dict[int, float] = {}
            for latency in args.latency_ms:
                figures = {}
                for prefetch in (0, args.prefetch):
                    disk = ThrottledDisk(latency / 1000, args.bandwidth_mb_s * 1e6)
                    spool.pread_into = disk  # the slow file system, for this run
                    try:
                        got = run(root, world, prefetch, steps, args.rank_tok_s)
                    finally:
                        spool.pread_into = disk.real
                    figures[prefetch] = got | {"reads": disk.reads, "bytes_read": disk.bytes}
                    base.setdefault(prefetch, got["tok_s"])
                off, on = figures[0]["tok_s"], figures[args.prefetch]["tok_s"]
                row = {
                    "ranks": world,
                    "latency_ms": latency,
                    "off": figures[0],
                    "on": figures[args.prefetch],
                    "on_over_off": round(on / off, 3),
                    "on_over_latency_0": round(on / base[args.prefetch], 3),
                    "off_over_latency_0": round(off / base[0], 3),
                }
                rows.append(row)
                print(
                    f"{world:>5} {latency:>10g} {off:>10,.0f} {on:>10,.0f} {row['on_over_off']:>7.2f} "
                    f"{row['on_over_latency_0']:>10.2f}"
                )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = {"settings": vars(args) | {"json": str(args.json)}, "rows": rows}
    print(json.dumps(out))
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
