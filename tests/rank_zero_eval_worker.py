"""Two torchrun ranks (gloo, CPU) train a tiny drafter for two epochs while rank 0 alone scores the untrained drafter
and each epoch's held-out split, slower than the collective timeout, for tests/test_rank_zero_evaluations.py.

    EAGLE3_COLLECTIVE_TIMEOUT_S=4 python -m torch.distributed.run --standalone --nproc-per-node=2 \
        tests/rank_zero_eval_worker.py OUT [--eval-s S] [--fail-at untrained|epoch]

The process group is joined as the product joins it (`train_cli.join_process_group`: its timeout from
EAGLE3_COLLECTIVE_TIMEOUT_S). The held-out evaluation sleeps `--eval-s` first (on rank 0, the only rank that runs it)
or raises at the named point. Each rank writes OUT.rank<R>.json: the untrained scores and the epochs' records.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from spool_training_worker import VOCAB, tiny_drafter

from eagle3_assets.stages.eagle3_drafter.data import Teacher, plan_windows
from eagle3_assets.stages.eagle3_drafter.pipeline import score_untrained
from eagle3_assets.stages.eagle3_drafter.train import (
    FixedWindows,
    RunOptions,
    Trainer,
    TrainSettings,
    eval_samples,
)
from eagle3_assets.stages.eagle3_drafter.train_cli import join_process_group


def samples(hidden: int) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = {}
    for i, n in enumerate([40, 13, 64, 25, 31, 50, 8, 64]):
        out[f"s{i}"] = {
            "input_ids": torch.randint(0, VOCAB, (n,), generator=g, dtype=torch.int32),
            "loss_mask": (torch.arange(n) >= n // 3).to(torch.int8),
            "aux_hidden_states": torch.randn(n, 3 * hidden, generator=g).bfloat16(),
            "final_hidden_state": torch.randn(n, hidden, generator=g).bfloat16(),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--eval-s", type=float, default=0.0)
    parser.add_argument("--fail-at", choices=["untrained", "epoch"], default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist, _ = join_process_group("cpu")
    cpu = torch.device("cpu")
    model, head = tiny_drafter()
    source = samples(model.cfg.target_hidden_size)
    windows = plan_windows([(k, len(v["input_ids"])) for k, v in source.items()], 48).windows
    teacher = Teacher(head, model.draft_ids, cpu)
    phase = ["untrained"]

    def held_out():
        if args.fail_at == phase[0]:
            raise ValueError(f"the held-out split is unreadable ({phase[0]})")
        time.sleep(args.eval_s)
        return eval_samples(source, windows[:3], teacher, cpu)

    untrained = score_untrained(model, held_out, 3, dist, print, "eval")
    phase[0] = "epoch"
    settings = TrainSettings(ttt_steps=3, epochs=2, batch_tokens=100, max_len=48, checkpoint_every=0, warmup_steps=1)
    data = FixedWindows(source, windows, settings, cpu, dist)
    history = Trainer(model, data, settings, RunOptions(cpu, print, None, dist), teacher, held_out).fit()
    record = {"untrained": untrained, "epochs": history.epochs, "steps": len(history.step_loss)}
    Path(f"{args.out}.rank{dist.rank}.json").write_text(json.dumps(record))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
