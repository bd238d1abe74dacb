"""How the local backend decodes a batch: transformers' `generate`, left-padded, in groups of similar prompt lengths
(`prompt_groups`), each row sampling from a seed of its own.

Sampling: transformers draws with `torch.multinomial`, which on a CPU costs ~60 ms per step
over a 163,840-id vocabulary at batch 16, about 30x an inverse-CDF draw and more than the stand-in
model's whole forward pass. So `generate` runs its greedy search behind `InverseCdfSampler`, a
logits processor that draws the token itself (temperature, top-k, exact top-p) and leaves only
that token finite; it widens each row's top-k only as far as that row's nucleus and skips rows
already finished.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from eagle3_resources.completions.prompt_groups import prompt_groups
from eagle3_resources.completions.types import SamplingSettings
from eagle3_resources.tokenizer.kimi import KimiTokenizer
from eagle3_resources.tokenizer.special_tokens import EOS, IM_END, PAD


class InverseCdfSampler:
    """A transformers logits processor that samples, so greedy search returns the sampled token.

    Exact top-p without a full sort: each row's sorted top-k is widened (`WIDTHS`, then the cap) only until it holds
    that row's nucleus, so a peaked row costs a top-64. Rows already finished (a stop id among the tokens after
    `prompt_width`) are not sampled: greedy search replaces their token with padding, and their flat distributions
    would widen every row's top-k. One uniform draw per row per step whatever the rows' state, so a row's tokens
    depend only on its seed and the step (with one generator per row, not on the rows beside it)."""

    WIDTHS = (64, 4096, 32768)

    def __init__(
        self,
        temperature: float,
        top_p: float | None,
        top_k: int | None,
        seed: int | Sequence[int],
        stops: Sequence[int] = (),
        prompt_width: int | None = None,
    ):
        import torch

        self.temperature = temperature
        self.top_p = top_p if top_p is not None and top_p < 1.0 else None
        self.top_k = top_k if top_k and top_k > 0 else None
        # one generator for every row, or one per row (`seed` a sequence: row i's draws depend on seed[i] alone)
        seeds = [seed] if isinstance(seed, int) else list(seed)
        self.generators = [torch.Generator().manual_seed(s) for s in seeds]
        self.per_row = not isinstance(seed, int)
        self.stops = torch.tensor(list(stops), dtype=torch.long)
        self.prompt_width = prompt_width

    def __call__(self, input_ids, scores):
        import torch

        # No copy of the [rows, 163,840] scores where it would hold the same values (x / 1.0 is x; every row live is
        # the whole matrix): each copy is milliseconds a step on a CPU (27 -> 16 ms a call at batch 8).
        logits = scores.float()
        if self.temperature != 1.0:
            logits = logits / self.temperature
        if self.per_row:
            u = torch.cat([torch.rand((1, 1), generator=g) for g in self.generators])
        else:
            u = torch.rand((logits.shape[0], 1), generator=self.generators[0])
        token = torch.zeros((logits.shape[0], 1), dtype=torch.long)
        live = self.live_rows(input_ids, logits.shape[0])
        if len(live) == logits.shape[0]:
            token = self.draw(logits, u)
        elif len(live):
            token[live] = self.draw(logits[live], u[live])
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(-1, token.to(scores.device), 0.0)

    def live_rows(self, input_ids, rows: int):
        """The rows still generating (all of them when the stops or the prompt width are not known)."""
        import torch

        if input_ids is None or self.prompt_width is None or not len(self.stops):
            return torch.arange(rows)
        done = torch.isin(input_ids[:, self.prompt_width :].cpu(), self.stops).any(-1)
        return (~done).nonzero().squeeze(1)

    def draw(self, logits, u):
        """One token per row of `logits` [n, vocab] (fp32, tempered), from the uniform draws `u` [n, 1]."""
        import torch

        lse = torch.logsumexp(logits, -1, keepdim=True)
        if self.top_p is None and self.top_k is None:
            cum = (logits - lse).exp().cumsum(-1)
            return torch.searchsorted(cum, u * cum[:, -1:]).clamp(max=cum.shape[-1] - 1)
        cap = min(logits.shape[-1], self.top_k or logits.shape[-1])
        widths = [w for w in self.WIDTHS if w < cap and self.top_p is not None] + [cap]
        token = torch.zeros_like(u, dtype=torch.long)
        todo = torch.arange(logits.shape[0])
        for width in widths:
            rows_left = logits if len(todo) == logits.shape[0] else logits[todo]
            vals, idx = rows_left.topk(width, dim=-1)  # sorted, descending
            probs = (vals - lse[todo]).exp()
            held = probs.sum(-1) >= self.top_p if self.top_p is not None and width < cap else torch.ones_like(todo) > 0
            vals, idx, probs, rows = vals[held], idx[held], probs[held], todo[held]
            if self.top_p is not None:  # the smallest prefix whose mass reaches top_p
                probs = probs.masked_fill(probs.cumsum(-1) - probs >= self.top_p, 0.0)
            cum = probs.cumsum(-1)
            pick = torch.searchsorted(cum, u[rows] * cum[:, -1:]).clamp(max=cum.shape[-1] - 1)
            token[rows] = idx.gather(-1, pick)
            todo = todo[~held]
            if not len(todo):
                break
        return token


def prompt_seed(seed: int | None, prompt_id: str) -> int:
    """The sampling seed of one prompt: the run's seed and the prompt's id only, so a prompt's completion does not
    depend on the batch, the group or the lane it is generated in, nor on how many lanes the load allowed."""
    digest = hashlib.blake2b(f"{seed or 0}:{prompt_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class Decoding:
    """What a generate call needs: the sampling settings and the tokens that pad and stop (picklable: the lanes'
    worker processes get it with every share)."""

    max_tokens: int
    temperature: float
    top_p: float | None
    top_k: int | None
    pad: int
    stops: tuple[int, ...]

    @classmethod
    def of(cls, settings: SamplingSettings, tokenizer: KimiTokenizer) -> Decoding:
        stops = (tokenizer.token_id(IM_END), tokenizer.token_id(EOS))
        pad = tokenizer.token_id(PAD)
        return cls(settings.max_tokens, settings.temperature, settings.top_p, settings.top_k, pad, stops)


def generate_rows(model: Any, prompts: list[list[int]], decoding: Decoding, seeds: list[int]) -> list[list[int]]:
    """Each prompt's generated ids, generated in groups of similar prompt lengths (`prompt_groups`); row i samples
    from its own generator (`seeds[i]`), so its tokens do not depend on the groups."""
    out: list[list[int]] = [[] for _ in prompts]
    for rows in prompt_groups([len(p) for p in prompts], decoding.max_tokens):
        generated = generate_padded(model, [prompts[i] for i in rows], decoding, [seeds[i] for i in rows])
        for i, ids in zip(rows, generated, strict=True):
            out[i] = ids
    return out


def generate_padded(model: Any, prompts: list[list[int]], decoding: Decoding, seeds: list[int]) -> list[list[int]]:
    """One left-padded `generate` call over `prompts`."""
    import torch
    from transformers import LogitsProcessorList

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), decoding.pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):  # left padding: generation continues every row at its end
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    stops = list(decoding.stops)
    processors = LogitsProcessorList()
    if decoding.temperature > 0:
        processors.append(
            InverseCdfSampler(decoding.temperature, decoding.top_p, decoding.top_k, seeds, stops, prompt_width=width)
        )
    with torch.no_grad():
        out = model.generate(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            max_new_tokens=decoding.max_tokens,
            do_sample=False,
            logits_processor=processors,
            eos_token_id=stops,
            pad_token_id=decoding.pad,
        )
    return [row[width:].tolist() for row in out.cpu()]
