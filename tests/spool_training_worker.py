"""The REAL drafter trainer (`Trainer` over `SpoolWindows`) on a spool, as a separate process, for
tests/test_spool_training.py (the capture side is tests/spool_worker.py's producer).

    python tests/spool_training_worker.py ROOT CHECKPOINT_DIR --record RECORD.jsonl --stats STATS.jsonl [--slow S]

A tiny drafter (target width spool_worker.HIDDEN, its vocabulary covering the producer's ids) trained on the CPU in
fp32, one thread. After each optimizer step a hook appends the step's windows to RECORD (one JSON line per step: the
global step and [sample id, start, end, pass, shard] per window), having checked that the trainer trained exactly
their tokens in that step (its own token count): the trainer's record of what it trained.
The run's figures go to STATS (one JSON line) when it ends.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import spool_worker as producer
import torch

from eagle3_assets.stages.eagle3_drafter.data import Teacher
from eagle3_assets.stages.eagle3_drafter.model import DrafterConfig, Eagle3Drafter
from eagle3_assets.stages.eagle3_drafter.spool_data import SpoolWindows, train_from_spool
from eagle3_assets.stages.eagle3_drafter.train import Every, RunOptions, Trainer, TrainSettings
from eagle3_resources.hidden_states.spool import open_settings

VOCAB = 1000  # the producer's ids are below 1000
DRAFT_VOCAB = 64


def tiny_drafter() -> tuple[Eagle3Drafter, torch.Tensor]:
    """(drafter, the target's lm_head), both from a fixed seed."""
    H = producer.HIDDEN
    cfg = DrafterConfig(
        hidden_size=H,
        target_hidden_size=H,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=VOCAB,
        draft_vocab_size=DRAFT_VOCAB,
    )
    g = torch.Generator().manual_seed(0)
    embed, head = torch.randn(VOCAB, H, generator=g), torch.randn(VOCAB, H, generator=g) / 16
    torch.manual_seed(0)
    return Eagle3Drafter(cfg, embed, torch.arange(0, 2 * DRAFT_VOCAB, 2)), head


def spool_settings(root: Path, checkpoint_every: int) -> TrainSettings:
    """The tiny trainer's settings on the spool at `root` (its window length, step tokens and seed)."""
    spool = open_settings(root)
    return TrainSettings(
        ttt_steps=3,
        epochs=1,
        batch_tokens=spool.batch_tokens,
        max_len=spool.max_len,
        seed=spool.seed,
        checkpoint_every=checkpoint_every,
        warmup_steps=5,
    )


def worker_arguments() -> argparse.ArgumentParser:
    """The arguments of a spool trainer worker (this one and tests/spool_ddp_worker.py)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("checkpoint_dir", type=Path)
    parser.add_argument("--record", type=Path, required=True)
    parser.add_argument("--stats", type=Path, required=True)
    parser.add_argument("--slow", type=float, default=0.0)
    parser.add_argument("--checkpoint-every", type=int, default=4)
    return parser


def main() -> None:
    args = worker_arguments().parse_args()
    torch.set_num_threads(1)
    settings = spool_settings(args.root, args.checkpoint_every)
    model, head = tiny_drafter()
    device = torch.device("cpu")
    teacher = Teacher(head, model.draft_ids, device)
    record = open(args.record, "a")

    def hooks(data: SpoolWindows) -> list[Every]:
        done = [0]  # the trainer's token count at the last step

        def write(trainer: Trainer) -> None:
            assert data.current is not None
            windows = [[w.sample_id, w.start, w.end, w.pass_index, w.shard] for w in data.current.windows]
            trained, done[0] = trainer.tokens_done - done[0], trainer.tokens_done
            if trained != (listed := sum(w.tokens for w in data.current.windows)):
                sys.exit(f"step {trainer.global_step}: the trainer trained {trained} tokens of the step's {listed}")
            record.write(json.dumps({"step": trainer.global_step, "windows": windows}) + "\n")
            record.flush()
            time.sleep(args.slow)

        return [Every(1, write)]

    options = RunOptions(device, lambda m: print(m, flush=True), args.checkpoint_dir)
    trainer, data = train_from_spool(model, args.root, settings, options, teacher, hooks=hooks, poll_s=0.02)
    record.close()
    history = trainer.history
    stats = {
        "steps": len(history.step_loss),
        "estimated_steps": data.estimated_steps,
        "waited_s": round(data.waited_s, 3),
        "bytes_read": data.bytes_read,
        "resumed_from_step": history.resumed_from_step,
        "tokens": history.tokens,
        "finite": all(x == x for x in history.step_loss),
        "trained_out": data.trained_out(),
    }
    with open(args.stats, "a") as f:
        f.write(json.dumps(stats) + "\n")


if __name__ == "__main__":
    main()
