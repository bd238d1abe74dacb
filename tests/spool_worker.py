"""A capture lane or a trainer on a spool, as a separate process, for tests/test_spool.py.

    python tests/spool_worker.py produce ROOT LANE --lanes N --samples N [--slow S]
    python tests/spool_worker.py consume ROOT CHECKPOINT [--every K] [--slow S]

The producer writes real shards through the store's API (`ShardImage`, `ShardCommitter` via `SpoolWriter`),
of synthetic samples drawn from a seeded generator (`dataset`); lane i of N captures samples i, i + N, ...
Every state is a function of its sample and row (`expected_states`), so the trainer checks that each window
it is served holds its own sample's rows. The trainer is a counting trainer: its "weights" are, for every
sample, how many times each token has been trained; they go with the spool position into one checkpoint
written atomically (the step is atomic with its checkpoint), then the position is committed to the spool.
Each run appends one JSON line of its figures to `--stats`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from pathlib import Path

import torch

from eagle3_resources.atomic_files import write_json_atomic
from eagle3_resources.hidden_states.spool import Position, SpoolReader, SpoolWriter
from eagle3_resources.hidden_states.store import (
    FORMAT,
    ShardImage,
    StoredSample,
    host_buffer,
    padded_size,
    plan_shards,
)

HIDDEN = 32
SHARD_BYTES = 40_000  # ~150 tokens at H = 32: 160 samples make ~130 shards


def dataset(n: int, seed: int = 11) -> list[StoredSample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(10, 200)
        ids = [rng.randrange(1000) for _ in range(length)]
        out.append(StoredSample(f"S{i:04d}", "train", ids, [1] * length, group=f"G{i % 4}"))
    return out


def lane_samples(samples: list[StoredSample], lane: int, lanes: int) -> list[StoredSample]:
    return samples[lane::lanes]


def _tag(sample_id: str) -> int:
    return int.from_bytes(hashlib.sha256(sample_id.encode()).digest()[:2], "little")


def expected_states(sample_id: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [n, 3H], final [n, H]) of a sample: small integers, exact in bf16."""
    t = torch.arange(n).unsqueeze(1)
    tag = _tag(sample_id)
    aux = ((tag + 7 * t + torch.arange(3 * HIDDEN)) % 251).to(torch.bfloat16)
    final = ((tag + 3 * t + torch.arange(HIDDEN)) % 127).to(torch.bfloat16)
    return aux, final


def produce(args: argparse.Namespace) -> None:
    samples = lane_samples(dataset(args.samples), args.lane_index, args.lanes)
    plans = plan_shards(samples, HIDDEN, SHARD_BYTES, {"target": "synthetic"})
    writer = SpoolWriter(args.root, args.lane, samples, plans, {"format": FORMAT, "dtype": "bfloat16"}, poll_s=0.02)
    image = ShardImage(host_buffer(max(padded_size(lay.size) for lay in writer.layouts.values()), pin=False))
    committed = 0
    for plan in writer.todo:
        if not writer.reserve(plan):
            break
        writer.start(image, plan, samples)
        assert image.layout is not None
        for j, i in enumerate(plan.samples):
            a, b = image.layout.row_offsets[j], image.layout.row_offsets[j + 1]
            aux, final = expected_states(samples[i].sample_id, b - a)
            image.aux[a:b] = aux
            image.final[a:b] = final
        time.sleep(args.slow)
        writer.commit(image, direct=False)
        committed += 1
    stats = {"lane": args.lane, "todo": len(writer.todo), "committed": committed, "waits": writer.waits}
    with open(args.stats, "a") as f:
        f.write(json.dumps(stats) + "\n")


def consume(args: argparse.Namespace) -> None:
    ckpt_path = Path(args.checkpoint)
    state = json.loads(ckpt_path.read_text()) if ckpt_path.exists() else {}
    counts: dict[str, list[int]] = state.get("counts", {})
    steps: int = state.get("steps", 0)
    position = Position.from_json(state["position"]) if state.get("position") else None
    reader = SpoolReader(args.root, position=position, poll_s=0.02)
    steps_here = 0
    last = position  # the position after the last step trained here

    def checkpoint() -> None:
        """The counts and the position in one atomic file, then the position committed to the spool."""
        write_json_atomic(ckpt_path, {"counts": counts, "steps": steps, "position": last.to_json() if last else None})
        if last is not None:
            reader.commit(last)

    while (step := reader.next_step(on_wait=checkpoint)) is not None:
        for w in step.windows:
            data = reader[w.sample_id]
            n = data["input_ids"].shape[0]
            aux, final = expected_states(w.sample_id, n)
            if not (
                torch.equal(data["aux_hidden_states"][w.start : w.end], aux[w.start : w.end])
                and torch.equal(data["final_hidden_state"][w.start : w.end], final[w.start : w.end])
            ):
                sys.exit(f"window {w} was served another sample's states")
            row = counts.setdefault(w.sample_id, [0] * n)
            for t in range(w.start, w.end):
                row[t] += 1
        steps += 1
        steps_here += 1
        last = step.after
        if steps % args.every == 0:
            checkpoint()
        time.sleep(args.slow)
    checkpoint()
    stats = {"steps": steps_here, "finished": reader.finished, "bytes_read": reader.bytes_read}
    with open(args.stats, "a") as f:
        f.write(json.dumps(stats) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="role", required=True)
    p = sub.add_parser("produce")
    p.add_argument("root", type=Path)
    p.add_argument("lane")
    p.add_argument("--lane-index", type=int, default=0)
    p.add_argument("--lanes", type=int, default=1)
    p.add_argument("--samples", type=int, required=True)
    p.add_argument("--slow", type=float, default=0.0)
    p.add_argument("--stats", type=Path, required=True)
    c = sub.add_parser("consume")
    c.add_argument("root", type=Path)
    c.add_argument("checkpoint", type=Path)
    c.add_argument("--every", type=int, default=3)
    c.add_argument("--slow", type=float, default=0.0)
    c.add_argument("--stats", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    produce(args) if args.role == "produce" else consume(args)


if __name__ == "__main__":
    main()
