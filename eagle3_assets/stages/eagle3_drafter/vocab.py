"""The draft vocabulary: the target tokens the drafter can propose.

The `draft_vocab_size` most frequent target tokens under the loss mask (ties broken by id), kept
in ascending id order; `d2t[i] = target_id(i) - i`, `t2d` marks them in the target vocabulary.
When fewer distinct tokens exist than requested the vocabulary is padded with the lowest unused
ids (a drafter with too few entries crashes some loaders).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch


def count_loss_tokens(samples: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> Counter:
    counts: Counter = Counter()
    for ids, mask in samples:
        counts.update(ids[mask.bool()].tolist())
    return counts


def effective_draft_vocab_size(requested: int, distinct: int, multiple: int = 64) -> int:
    """No larger than the tokens ever seen (rounded up): entries beyond them are never targets."""
    return min(requested, max(multiple, -(-distinct // multiple) * multiple))


def build_draft_vocab(counts: Counter, size: int, target_vocab: int) -> torch.Tensor:
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]
    chosen = {t for t, _ in ranked}
    filler = (t for t in range(target_vocab) if t not in chosen)
    while len(chosen) < size:
        chosen.add(next(filler))
    return torch.tensor(sorted(chosen), dtype=torch.long)
