"""Training data for the drafter, read on demand: memory stays bounded whatever the dataset size.

A sample longer than `max_len` is cut into consecutive windows of at most `max_len` tokens, each
keeping its true positions, so no token is dropped (the drafter attends within its window; the
target's aux states carry the longer context). A window is loaded, with its teacher computed from
the stored final hidden states, only when a step needs it. Windows are packed into optimizer
steps by a token budget, in an order that depends only on the seed and the epoch: a resumed run
sees exactly the batches an uninterrupted one would.

The source of a sample's tensors is either the hidden-state store (offline) or the target itself,
run inside the loop (online, `OnlineSource`): the same dict either way.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from eagle3_assets.stages.eagle3_drafter.model import DocLayout, QueryRows, loss_rows


@dataclass
class Sample:
    """One training window on the training device."""

    tokens: torch.Tensor  # [L] target ids
    positions: torch.Tensor  # [L] positions in the original sequence
    mask: torch.Tensor  # [L] 1 where the token is a completion token
    aux: torch.Tensor  # [L, 3H_t] float32
    teacher_p: torch.Tensor  # [L, V_draft] target distribution over the draft vocabulary
    teacher_argmax: torch.Tensor  # [L] the target's argmax over its full vocabulary


@dataclass
class PackedBatch:
    """The windows of one training step (of one rank) packed into one sequence of T tokens."""

    tokens: torch.Tensor  # [T] target ids
    positions: torch.Tensor  # [T] positions in the original sequences
    mask: torch.Tensor  # [T] 1 where the token is a completion token
    aux: torch.Tensor  # [T, 3H_t] bf16 as stored (fp32 on the CPU, which trains in fp32)
    final: torch.Tensor  # [T, H_t] the target's final hidden states, bf16 as stored
    layout: DocLayout
    keys: list[tuple[str, int, int]]  # each window's (sample id, start, end): the teacher's cache keys
    rows: QueryRows | None = None  # the rows TTT steps >= 1 run over (`model.loss_rows`; None: every row)

    def to(self, device: torch.device) -> PackedBatch:
        """On `device`; from pinned memory without blocking the host on CUDA."""
        nb = device.type == "cuda"
        return PackedBatch(
            tokens=self.tokens.to(device, non_blocking=nb),
            positions=self.positions.to(device, non_blocking=nb),
            mask=self.mask.to(device, non_blocking=nb),
            aux=self.aux.to(device, non_blocking=nb),
            final=self.final.to(device, non_blocking=nb),
            layout=self.layout.to(device, non_blocking=nb),
            keys=self.keys,
            rows=self.rows.to(device, non_blocking=nb) if self.rows is not None else None,
        )


def pack_windows(
    source: SampleSource,
    windows: Sequence[Window],
    aux_dtype: torch.dtype,
    pin: bool,
    waste: float = 1.1,
    ttt_steps: int | None = None,
) -> PackedBatch:
    """Read and pack windows on the host (a sample cut into several of them is read once); `pin` puts the
    result in page-locked memory for a non-blocking copy to the GPU. `waste`: see `DocLayout` (on the GPU,
    fewer, padded attention calls pay; on the CPU a call costs nothing but its work). `ttt_steps`: the rows TTT
    steps >= 1 need are worked out here, on the host (`model.loss_rows`); None: every row."""
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("tokens", "positions", "mask", "aux", "final")}
    last: tuple[str, dict[str, torch.Tensor]] | None = None
    for w in windows:
        if last is None or last[0] != w.sample_id:
            last = (w.sample_id, source[w.sample_id])
        data, a, b = last[1], w.start, w.end
        parts["tokens"].append(data["input_ids"][a:b].long())
        parts["positions"].append(torch.arange(a, b))
        parts["mask"].append(data["loss_mask"][a:b].long())
        parts["aux"].append(data["aux_hidden_states"][a:b].to(aux_dtype))
        parts["final"].append(data["final_hidden_state"][a:b])
    out = {k: torch.cat(v) for k, v in parts.items()}
    lengths = [w.tokens for w in windows]
    rows = loss_rows(lengths, out["mask"], ttt_steps, waste, pin) if ttt_steps is not None else None
    if pin:
        out = {k: v.pin_memory() for k, v in out.items()}
    return PackedBatch(
        **out,
        layout=DocLayout(lengths, waste=waste, pin=pin),
        keys=[(w.sample_id, w.start, w.end) for w in windows],
        rows=rows,
    )


class SampleSource(Protocol):
    def __getitem__(self, sample_id: str) -> dict[str, torch.Tensor]: ...


@dataclass(frozen=True)
class Window:
    sample_id: str
    start: int
    end: int

    @property
    def tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class WindowPlan:
    windows: list[Window]
    samples: int
    tokens: int
    split_samples: int  # samples longer than max_len, cut into several windows (nothing dropped)


def plan_windows(lengths: Sequence[tuple[str, int]], max_len: int) -> WindowPlan:
    """Consecutive windows of at most `max_len` tokens covering every sample whole."""
    if max_len < 4:
        raise ValueError(f"max_len {max_len} is too short for training-time test")
    out: list[Window] = []
    split = 0
    for sample_id, n in lengths:
        split += n > max_len
        out.extend(Window(sample_id, a, min(n, a + max_len)) for a in range(0, n, max_len))
    return WindowPlan(out, len(lengths), sum(n for _, n in lengths), split)


def plan_steps(windows: Sequence[Window], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Window indices per optimizer step for one epoch: shuffled by (seed, epoch), packed up to `batch_tokens`."""
    order = list(range(len(windows)))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    steps: list[list[int]] = []
    tokens = 0
    for i in order:
        if steps and tokens + windows[i].tokens <= batch_tokens:
            steps[-1].append(i)
            tokens += windows[i].tokens
        else:
            steps.append([i])
            tokens = windows[i].tokens
    return steps


def vocab_argmax(x: torch.Tensor, head: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """argmax(x @ head.T, -1) in tiles of rows x cols logits, never all at once; ties go to the lowest id, as
    `argmax` does."""
    out = []
    for i in range(0, x.shape[0], rows):
        xi = x[i : i + rows]
        best = torch.full((xi.shape[0],), float("-inf"), device=x.device)
        arg = torch.zeros(xi.shape[0], dtype=torch.long, device=x.device)
        for j in range(0, head.shape[0], cols):
            m, a = (xi @ head[j : j + cols].T).float().max(-1)
            better = m > best
            best, arg = torch.where(better, m, best), torch.where(better, a + j, arg)
        out.append(arg)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long, device=x.device)


class Teacher:
    """The target's next-token distribution over the draft vocabulary, and its argmax over the full vocabulary,
    from the stored final hidden states.

    The argmax needs the full-vocabulary logits (163,840 x H multiply-adds per token for Kimi), the
    costliest part of a CPU step, and it never changes: it is computed once per window and kept
    (int32, 4 bytes a token) up to `cache_tokens`; the draft-vocabulary distribution is recomputed
    each time (H x draft vocabulary per token), so memory stays bounded. The loss and the accuracy read the argmax
    at position j only where token j+1 is a completion token (`argmax_needed`): on the CPU only there is it
    computed, the rest hold -1 (equal to no draft id). Prompts are most of the tokens (the first command: 13k
    completion tokens of 101k; on the CPU the full-vocabulary pass was 44 of the first epoch's 81 s at H = 64, one
    thread)."""

    def __init__(
        self, head: torch.Tensor, draft_ids: torch.Tensor, device: torch.device, cache_tokens: int = 50_000_000
    ):
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.head = head.to(device, dtype)
        self.head_draft = self.head[draft_ids.to(device)]
        self.device, self.dtype = device, dtype
        # CPU: logits tiles of 512 x 4096 (8 MB) stay in cache; 1024-row slabs over the whole vocabulary
        # (671 MB at Kimi's 163,840) ran at half the speed (1,179 vs 2,000-3,400 tok/s at H = 64, 2 threads)
        self.tile = (512, 4096) if device.type == "cpu" else (4096, 32768)
        self.cache: dict[tuple[str, int, int], torch.Tensor] = {}
        self.cache_tokens, self.cached_tokens = cache_tokens, 0

    def argmax(self, key: tuple[str, int, int], final: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The argmax at each position of the window `key`; given its loss `mask`, on the CPU only where it is read
        (`argmax_needed`), the others -1."""
        hit = self.cache.get(key)
        if hit is not None:
            return hit.to(self.device, torch.long)
        if mask is None or self.device.type != "cpu":  # on a GPU, picking the rows would wait for the device
            out = vocab_argmax(final, self.head, *self.tile)
        else:
            out = torch.full((final.shape[0],), -1, dtype=torch.long, device=final.device)
            rows = argmax_needed(mask).to(final.device).nonzero().squeeze(1)
            if rows.numel():
                out[rows] = vocab_argmax(final[rows], self.head, *self.tile)
        if self.cached_tokens + out.numel() <= self.cache_tokens:
            self.cache[key] = out.to(torch.int32)
            self.cached_tokens += out.numel()
        return out

    def __call__(
        self, key: tuple[str, int, int], final: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(distribution over the draft vocabulary, argmax where it is read) of one window; `mask`: its loss mask."""
        final = final.to(self.device, self.dtype)
        p = torch.softmax((final @ self.head_draft.T).float(), -1)
        return p, self.argmax(key, final, mask)

    def packed(self, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(distribution [T, V_draft] fp32, argmax [T]) of a packed batch on the device: one matmul for the
        distribution, the argmax per window (cached)."""
        final = batch.final.to(self.device, self.dtype)
        p = torch.softmax((final @ self.head_draft.T).float(), -1)
        a = batch.layout.starts
        arg = [
            self.argmax(key, final[s : s + n], batch.mask[s : s + n])
            for key, s, n in zip(batch.keys, a, batch.layout.lengths, strict=True)
        ]
        return p, torch.cat(arg)


def argmax_needed(mask: torch.Tensor) -> torch.Tensor:
    """The positions of one window whose teacher argmax the loss and the accuracy read: j where token j+1 is a
    completion token (TTT step k at t is weighed against the teacher at j = t+1+k and predicts token j+1)."""
    needed = torch.zeros(mask.shape[0], dtype=torch.bool, device=mask.device)
    needed[:-1] = mask[1:] != 0
    return needed


def load_window(source: SampleSource, window: Window, teacher: Teacher, device: torch.device) -> Sample:
    """One window's tensors on `device`, with its teacher."""
    data = source[window.sample_id]
    a, b = window.start, window.end
    teacher_p, argmax = teacher((window.sample_id, a, b), data["final_hidden_state"][a:b], data["loss_mask"][a:b])
    return Sample(
        tokens=data["input_ids"][a:b].long().to(device),
        positions=torch.arange(a, b, device=device),
        mask=data["loss_mask"][a:b].long().to(device),
        aux=data["aux_hidden_states"][a:b].to(device, torch.float32),
        teacher_p=teacher_p,
        teacher_argmax=argmax,
    )


class OnlineSource:
    """The target computes each sample's hidden states when the loop asks (no store: for a target that fits beside
    the trainer). The last sample is kept, since a long sample's windows are asked for one after another."""

    def __init__(self, backend, rows: Mapping[str, tuple[Sequence[int], Sequence[int]]]):
        self.backend = backend
        self.rows = rows
        self._last: tuple[str, dict[str, torch.Tensor]] | None = None

    def __getitem__(self, sample_id: str) -> dict[str, torch.Tensor]:
        if self._last is not None and self._last[0] == sample_id:
            return self._last[1]
        ids, mask = self.rows[sample_id]
        aux, final = self.backend.extract(list(ids))
        data = {
            "input_ids": torch.as_tensor(list(ids), dtype=torch.int32),
            "loss_mask": torch.as_tensor(list(mask), dtype=torch.int8),
            # bf16, as the store keeps them: online and offline training see the same numbers
            "aux_hidden_states": aux.to("cpu", torch.bfloat16),
            "final_hidden_state": final.to("cpu", torch.bfloat16),
        }
        self._last = (sample_id, data)
        return data

    def length(self, sample_id: str) -> int:
        return len(self.rows[sample_id][0])
