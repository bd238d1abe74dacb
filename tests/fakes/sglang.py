"""Rank engines for testing `RankPool` on CPU: real spawned processes, no sglang.

Importable by the spawned children because pytest puts `tests/` on `sys.path`, which spawn passes on.
"""

from __future__ import annotations

import os
import time

import torch

from eagle3_resources.hidden_states.sglang_backend import SlabLayout

HIDDEN = 4
MAX_TOKENS = 64  # what EchoEngine reports as its KV pool, and what one hand-off slab holds
ECHO_SLAB = SlabLayout(tokens=MAX_TOKENS, aux_width=3 * HIDDEN, final_width=HIDDEN)


def echo_rows(sequences) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows EchoEngine's rank 0 returns for `sequences` (bf16): aux[t] = id * [1..3H], final[t] = -id * [1..H]."""
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.float32)
    aux = ids[:, None] * torch.arange(1, 3 * HIDDEN + 1, dtype=torch.float32)
    final = -ids[:, None] * torch.arange(1, HIDDEN + 1, dtype=torch.float32)
    return aux.to(torch.bfloat16), final.to(torch.bfloat16)


class EchoEngine:
    """Rank 0 returns `echo_rows` of the batch; the other ranks return nothing.

    `delay_s`: rank 0 sleeps that long in every capture (a rank slower than the parent);
    `exit_on_batch_with`: rank 0 exits (os._exit) in the middle of a batch holding that token.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        fail_on_batch_with: int | None,
        die_on_start: bool,
        delay_s: float = 0.0,
        exit_on_batch_with: int | None = None,
    ):
        if die_on_start and rank == world_size - 1:
            os._exit(3)
        self.rank, self.world_size = rank, world_size
        self.fail_on_batch_with = fail_on_batch_with
        self.delay_s, self.exit_on_batch_with = delay_s, exit_on_batch_with
        self.batches = 0

    def info(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid(), "max_total_num_tokens": MAX_TOKENS, "max_requests": 4}

    def capture(self, sequences):
        self.batches += 1
        ids = [t for s in sequences for t in s]
        if self.fail_on_batch_with is not None and self.fail_on_batch_with in ids and self.rank == self.world_size - 1:
            raise ValueError(f"rank {self.rank} refuses token {self.fail_on_batch_with}")
        if self.rank != 0:
            return None, None
        if self.exit_on_batch_with is not None and self.exit_on_batch_with in ids:
            os._exit(5)
        if self.delay_s:
            time.sleep(self.delay_s)
        return echo_rows(sequences)


def echo_engine(
    rank: int,
    world_size: int,
    *,
    fail_on_batch_with: int | None = None,
    die_on_start: bool = False,
    delay_s: float = 0.0,
    exit_on_batch_with: int | None = None,
):
    return EchoEngine(rank, world_size, fail_on_batch_with, die_on_start, delay_s, exit_on_batch_with)
