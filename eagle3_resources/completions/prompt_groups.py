"""Which prompts of a local batch generate together: one padded batch per group of similar lengths.

A padded batch pays for its longest prompt in every row: the prefill's attention grows with rows x width^2 and each
decode step's with rows x width, on top of a per-step cost that does not depend on the rows (the stand-in's
163,840-id head). One 4,435-token prompt among seven of 200-1,800 tokens (B8) makes the batch ~5x the work of its
rows alone. So the batch is cut, after sorting by length, into contiguous groups that minimise `GenerationCost`
(dynamic programming over the sorted lengths: exact, and a batch is a few dozen rows at most).

The constants were measured on the stand-in target (8 layers, hidden 64, one CPU thread; `/tmp/step_w.py` in the
note of 2026-12-06): prefill 136 ms at 8 x 300 tokens and 4.7 s at 8 x 4,435; a decode step 25.5 ms at 8 x 300 and
99 ms at 8 x 4,435. Only their ratios matter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class GenerationCost:
    """Seconds of a padded batch of `rows` prompts `width` tokens wide decoding `steps` tokens."""

    step_s: float = 16e-3  # a decode step's fixed cost (the head over the vocabulary, transformers' own work)
    step_row_token_s: float = 2.3e-6  # a decode step's attention, per row and padded key
    prefill_token_s: float = 48e-6  # the prefill's linear work, per row and padded token
    prefill_pair_s: float = 28e-9  # the prefill's attention, per row and padded token squared

    def batch(self, rows: int, width: int, steps: int) -> float:
        prefill = rows * width * (self.prefill_token_s + self.prefill_pair_s * width)
        return prefill + steps * (self.step_s + self.step_row_token_s * rows * width)


def prompt_groups(lengths: Sequence[int], steps: int, cost: GenerationCost = GenerationCost()) -> list[list[int]]:
    """The rows (indices into `lengths`) of each group, longest group first, each group's rows in their batch order;
    groups cut the rows sorted by length into the contiguous runs of least total `cost` for `steps` decode steps."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    n = len(order)
    # best[j]: the least cost of the first j rows of `order`; cut[j]: where the last group of that solution starts
    best, cut = [0.0] + [float("inf")] * n, [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # the group order[i:j], padded to its longest, order[i]
            total = best[i] + cost.batch(j - i, lengths[order[i]], steps)
            if total < best[j]:
                best[j], cut[j] = total, i
    groups: list[list[int]] = []
    j = n
    while j > 0:
        groups.append(sorted(order[cut[j] : j]))
        j = cut[j]
    return groups[::-1]
