"""Rank engines for testing `RankPool` on CPU: real spawned processes, no sglang.

Importable by the spawned children because pytest puts `tests/` on `sys.path`, which spawn passes on.
"""

from __future__ import annotations

import os

import torch

HIDDEN = 4


class EchoEngine:
    """Rank 0 returns rows derived from the token ids: aux[t] = id * [1..3H], final[t] = -id * [1..H]."""

    def __init__(self, rank: int, world_size: int, fail_on_batch_with: int | None, die_on_start: bool):
        if die_on_start and rank == world_size - 1:
            os._exit(3)
        self.rank, self.world_size = rank, world_size
        self.fail_on_batch_with = fail_on_batch_with
        self.batches = 0

    def info(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid(), "max_total_num_tokens": 64, "max_requests": 4}

    def capture(self, sequences):
        self.batches += 1
        ids = torch.tensor([t for s in sequences for t in s], dtype=torch.float32)
        if self.fail_on_batch_with is not None and self.fail_on_batch_with in ids.tolist() and self.rank == self.world_size - 1:
            raise ValueError(f"rank {self.rank} refuses token {self.fail_on_batch_with}")
        if self.rank != 0:
            return None, None
        aux = ids[:, None] * torch.arange(1, 3 * HIDDEN + 1, dtype=torch.float32)
        final = -ids[:, None] * torch.arange(1, HIDDEN + 1, dtype=torch.float32)
        return aux.to(torch.bfloat16), final.to(torch.bfloat16)


def echo_engine(rank: int, world_size: int, *, fail_on_batch_with: int | None = None, die_on_start: bool = False):
    return EchoEngine(rank, world_size, fail_on_batch_with, die_on_start)
