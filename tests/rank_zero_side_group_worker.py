"""Two torchrun ranks whose world is NOT gloo, as under NCCL on GPUs, for tests/test_rank_zero_side_group.py.

    EAGLE3_COLLECTIVE_TIMEOUT_S=4 python -m torch.distributed.run --standalone --nproc-per-node=2 \
        tests/rank_zero_side_group_worker.py OUT [--alone-s S] [--fail]

No NCCL here (no GPU), so the world is torch's own `fake` backend (torch.testing's FakeProcessGroup: every
collective on it returns at once and moves nothing) over a real TCPStore. What must move, then, moves only if
`RankZeroWord` makes the gloo group of its own that it makes under NCCL: rank 0's word while it works alone for
`--alone-s` seconds (past the collective timeout: only heartbeat rounds keep rank 1 waiting) or its error (`--fail`),
and the streaming training side's end-of-training figures (`streaming_train.gather_figures`). Each rank writes
OUT.rank<R>.json: what it received, and the backends of the world and of the word's group.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend

from eagle3_assets.stages.eagle3_drafter.rank_zero import RankZeroWord, collective_timeout
from eagle3_assets.stages.eagle3_drafter.streaming_train import gather_figures
from eagle3_resources.errors import DrafterError


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--alone-s", type=float, default=0.0)
    parser.add_argument("--fail", action="store_true")
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # A store of its own beside the launcher's: the fake backend keeps none, and the gloo group needs a real one.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1, world, is_master=rank == 0)
    dist.init_process_group("fake", store=store, rank=rank, world_size=world, timeout=collective_timeout())
    ranks = SimpleNamespace(world_size=world, main=rank == 0)
    word = RankZeroWord(ranks)

    def alone() -> str:
        time.sleep(args.alone_s)
        if args.fail:
            raise ValueError("rank 0's work failed")
        return "rank 0's result"

    result = word.alone(alone, lambda reason: DrafterError(f"rank 0 failed: {reason}"))
    data = SimpleNamespace(bytes_read=1000 + rank, waited_s=0.5 * (rank + 1), word=word)  # each rank's own figures
    figures = gather_figures(data, ranks)  # type: ignore[arg-type]  # what gather_figures reads of the spool's data
    Path(f"{args.out}.rank{rank}.json").write_text(
        json.dumps(
            {
                "result": result,
                "bytes_read": figures.bytes_read,
                "waited_s": figures.waited_s,
                "world_backend": dist.get_backend(),
                "word_backend": dist.get_backend(word.group),
            }
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
