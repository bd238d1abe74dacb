"""A separate process that fills a hidden-state store, for the kill -9 tests.

    python tests/hidden_states_worker.py MODEL_FOLDER ROOT [--stall-after N] [--hang-write-at OFFSET]

Samples are drawn from a seeded generator, so every process extracts the same ones; torch runs on
one thread so every process computes bit-identical states. `--stall-after N` holds the extraction
for good in its N-th batch (the shards of the batches before it are committed), so a test can kill
the process mid-run without racing it; `--hang-write-at OFFSET` writes shards in 4 KiB chunks and
holds the second shard file's write for good once its chunk at OFFSET is written, so the kill finds
it mid-write without racing it.
"""

from __future__ import annotations

import argparse
import os
import random
import threading
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from eagle3_resources.hidden_states import store
from eagle3_resources.hidden_states.extract import HiddenStatesBackend, StoreSettings, extract_to_store
from eagle3_resources.hidden_states.store import StoredSample
from eagle3_resources.hidden_states.transformers_backend import TransformersHiddenStates

SHARD_BYTES = 40_000  # a few samples per shard at H = 64
BATCH_TOKENS = 96


def samples(vocab: int, n: int = 24, seed: int = 7) -> list[StoredSample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(8, 40)
        ids = [rng.randrange(vocab) for _ in range(length)]
        mask = [0] * (length // 2) + [1] * (length - length // 2)
        out.append(StoredSample(f"W{i % 3}/{i:03d}", "eval" if i % 5 == 0 else "train", ids, mask, group=f"W{i % 3}"))
    return out


class Slow:
    """The backend, sleeping `seconds` after each batch (tests/spool_capture_worker.py's `--slow`)."""

    def __init__(self, inner, seconds: float):
        self.inner, self.seconds = inner, seconds

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def extract_batch(self, sequences):
        out = self.inner.extract_batch(sequences)
        time.sleep(self.seconds)
        return out


class Stalled:
    """The backend, held for good in its `stall_after`-th batch (a kill then finds the extraction mid-run however
    fast or slow the machine is)."""

    def __init__(self, inner, stall_after: int):
        self.inner, self.stall_after, self.batches = inner, stall_after, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def extract_batch(self, sequences):
        out = self.inner.extract_batch(sequences)
        self.batches += 1
        if self.batches >= self.stall_after:
            threading.Event().wait()  # until the test kills the process
        return out


class HangingWrites:
    """The store's `os` (the store writes with os.pwrite only): the second shard file written is held for good once
    its chunk at offset `hang_at` is written (the other shards go on; those after it in plan order are written but
    never listed, as shards are listed in plan order)."""

    def __init__(self, hang_at: int):
        self.hang_at = hang_at
        self.paths: dict[int, str] = {}  # the fds open for writing: their file
        self.written: list[str] = []  # the files written, in the order of their first write
        self.lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(os, name)

    def open(self, path, flags, *mode):
        fd = os.open(path, flags, *mode)
        with self.lock:
            self.paths[fd] = str(path)
        return fd

    def pwrite(self, fd, data, offset):
        n = os.pwrite(fd, data, offset)
        with self.lock:
            path = self.paths.get(fd, "")
            if path not in self.written:
                self.written.append(path)
            hang = offset == self.hang_at and self.written.index(path) == 1
        if hang:
            threading.Event().wait()  # until the test kills the process
        return n


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("root")
    parser.add_argument("--stall-after", type=int, default=None, help="batches extracted, the last held for good")
    parser.add_argument("--hang-write-at", type=int, default=None, help="the offset of the 2nd shard's last write")
    args = parser.parse_args()
    if args.hang_write_at is not None:
        store.WRITE_CHUNK = 4096
        store.os = HangingWrites(args.hang_write_at)  # type: ignore[assignment]  # the store's os, one write held
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    backend: HiddenStatesBackend = TransformersHiddenStates(model)
    if args.stall_after is not None:
        backend = Stalled(backend, args.stall_after)
    settings = StoreSettings(shard_bytes=SHARD_BYTES, batch_tokens=BATCH_TOKENS, free_bytes=10**12, reserve_bytes=0)
    report = extract_to_store(
        samples(model.config.vocab_size),
        backend,
        Path(args.root),
        settings,
        identity={"target": "worker"},
        progress_every_s=3600,
    )
    print(f"done: {report.shards_written} written, {report.shards_skipped} kept", flush=True)


if __name__ == "__main__":
    main()
