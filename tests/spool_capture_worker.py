"""The stand-in target's real capture as a separate process, for tests/test_spool_capture.py.

    python tests/spool_capture_worker.py spool MODEL_FOLDER SPOOL LANE --stats FILE --progress FILE [--slow S]
    python tests/spool_capture_worker.py store MODEL_FOLDER ROOT

`spool` captures the samples into lane LANE of the spool at SPOOL (`capture_to_spool`), `store` into an offline
store (an `Extraction`), with the same samples, shard size, shards (the spool's interleave of the datasets, by its
seed: `SpoolShards`) and so batches, so the two write the same shards.
The samples are tests/hidden_states_worker.py's (seeded), and torch runs on one thread, so every process computes
bit-identical states. `--slow` sleeps after each batch (a kill then lands in the middle of the capture).
`--progress` gets every progress report's figures, one JSON line each (a report at every batch, and at every poll
while the lane is full); `--stats` one JSON line of the call's report at the end.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from hidden_states_worker import Slow
from hidden_states_worker import samples as worker_samples
from transformers import AutoModelForCausalLM

from eagle3_resources.hidden_states.extract import (
    Extraction,
    ExtractionOptions,
    HiddenStatesBackend,
    StoreSettings,
    capture_to_spool,
)
from eagle3_resources.hidden_states.store import ShardPlan, StoredSample, plan_mixed_shards
from eagle3_resources.hidden_states.transformers_backend import TransformersHiddenStates

SAMPLES = 64
SHARD_BYTES = 16_000  # one or two samples a shard at H = 64: 56 shards
BATCH_TOKENS = 48
IDENTITY = {"target": "spool-capture-worker"}
SEED = 3  # the test spool's, which seeds the capture's interleave of the datasets
SETTINGS = StoreSettings(shard_bytes=SHARD_BYTES, batch_tokens=BATCH_TOKENS, free_bytes=10**12, reserve_bytes=0)


def samples(vocab: int) -> list[StoredSample]:
    return worker_samples(vocab, SAMPLES, seed=7)


class SpoolShards(Extraction):
    """An offline extraction into the spool lane's shards (`plan_mixed_shards` by the spool's seed, as
    `SpoolCapture.shard_plans`): a sample is batched with the same others, so its states are the same bits (a batch of
    other lengths pads differently, and the CPU's sums then round differently)."""

    def shard_plans(self) -> list[ShardPlan]:
        identity = {**self.options.identity, "aux_layer_ids": self.layer_ids}
        return plan_mixed_shards(self.samples, self.hidden_size, self.settings.shard_bytes, identity, SEED)


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("spool")
    s.add_argument("model")
    s.add_argument("root", type=Path)
    s.add_argument("lane")
    s.add_argument("--stats", type=Path, required=True)
    s.add_argument("--progress", type=Path, required=True)
    s.add_argument("--slow", type=float, default=0.0)
    o = sub.add_parser("store")
    o.add_argument("model")
    o.add_argument("root", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    backend: HiddenStatesBackend = TransformersHiddenStates(model)
    data = samples(model.config.vocab_size)
    if args.mode == "store":
        SpoolShards(data, backend, args.root, SETTINGS, ExtractionOptions(IDENTITY, progress_every_s=3600)).run()
        return
    if args.slow:
        backend = Slow(backend, args.slow)
    with open(args.progress, "a") as progress:

        def on_progress(figures: dict) -> None:
            progress.write(json.dumps(figures) + "\n")
            progress.flush()

        report = capture_to_spool(
            data,
            backend,
            args.root,
            args.lane,
            SETTINGS,
            identity=IDENTITY,
            log=lambda line: None,
            progress_every_s=0.0,
            on_progress=on_progress,
            poll_s=0.02,
        )
    e = report.extraction
    stats = {
        "todo": report.todo,
        "shards_written": e.shards_written,
        "shards_skipped": e.shards_skipped,
        "tokens_written": e.tokens_written,
        "bytes_written": e.bytes_written,
        "pauses": report.pauses,
        "waited_s": round(report.waited_s, 3),
        "stopped": report.stopped,
        "bytes_per_s": round(report.bytes_per_s, 1),
        "busy_bytes_per_s": round(report.busy_bytes_per_s, 1),
        "seconds": round(e.seconds, 3),
    }
    with open(args.stats, "a") as f:
        f.write(json.dumps(stats) + "\n")


if __name__ == "__main__":
    main()
