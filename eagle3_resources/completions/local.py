"""In-process generation with transformers: the CPU default, on the stand-in target.

The prompt ids come from our own chat format and the target's own output ids are kept, exactly
as the SGLang backend does; the text split into reasoning and content mirrors what an API
returns (reasoning before `</think>`, content after, `<|im_end|>` not shown).

Sampling: transformers draws with `torch.multinomial`, which on a CPU costs ~60 ms per step
over a 163,840-id vocabulary at batch 16, about 30x an inverse-CDF draw and more than the stand-in
model's whole forward pass. So `generate` runs its greedy search behind `InverseCdfSampler`, a
logits processor that draws the token itself (temperature, top-k, exact top-p) and leaves only
that token finite; it widens each row's top-k only as far as that row's nucleus and skips rows
already finished.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from eagle3_resources.completions.prompt_groups import prompt_groups
from eagle3_resources.completions.types import (
    Attempt,
    CompletionRequest,
    CompletionResult,
    Emit,
    RequestFeed,
    SamplingSettings,
)
from eagle3_resources.cpu import LoadWatch, apply_torch_threads, rechoose_torch_threads, use_torch_threads
from eagle3_resources.tokenizer.kimi import KimiTokenizer
from eagle3_resources.tokenizer.special_tokens import EOS, IM_END, PAD, THINK_END


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

        logits = scores.float() / self.temperature
        if self.per_row:
            u = torch.cat([torch.rand((1, 1), generator=g) for g in self.generators])
        else:
            u = torch.rand((logits.shape[0], 1), generator=self.generators[0])
        token = torch.zeros((logits.shape[0], 1), dtype=torch.long)
        live = self.live_rows(input_ids, logits.shape[0])
        if len(live):
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
            vals, idx = logits[todo].topk(width, dim=-1)  # sorted, descending
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


def row_seed(seed: int, row: int) -> int:
    """The sampling seed of row `row` of a batch seeded `seed` (distinct for every batch and row)."""
    return (seed * 1_000_003 + row) % (1 << 63)


def result_from_ids(tokenizer: KimiTokenizer, prompt_id: str, generated: list[int], **fields) -> CompletionResult:
    """A result from the ids a model generated, cut after its first end-of-turn token.

    Text is split as an API returns it: reasoning before `</think>`, content after, the end
    token not shown; with no `</think>` everything is reasoning. No end token: `length`.
    """
    stops = {tokenizer.token_id(IM_END), tokenizer.token_id(EOS)}
    end = next((i for i, t in enumerate(generated) if t in stops), None)
    ids = list(generated) if end is None else list(generated[: end + 1])
    body = ids if end is None else ids[:-1]
    sep = tokenizer.token_id(THINK_END)
    if sep in body:
        cut = body.index(sep)
        reasoning, content = tokenizer.decode(body[:cut]), tokenizer.decode(body[cut + 1 :])
    else:
        cut, reasoning, content = len(body), tokenizer.decode(body), ""
    finish = "stop" if end is not None else "length"
    fields.setdefault("completion_tokens", len(ids))
    return CompletionResult(
        prompt_id=prompt_id,
        status="ok" if finish == "stop" else "truncated",
        finish_reason=finish,
        reasoning=reasoning,
        content=content,
        completion_ids=ids,
        reasoning_tokens=cut,
        **fields,
    )


class TransformersBackend:
    name = "local"

    def __init__(self, model, tokenizer: KimiTokenizer, batch_size: int = 8, log: Callable[[str], None] | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.log = log or logging.getLogger(__name__).info
        self.watch: LoadWatch | None = None  # set by `run`, after the partition's first choice of threads

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "model_type": self.model.config.model_type, "batch_size": self.batch_size}

    def _generate(self, batch: list[CompletionRequest], settings: SamplingSettings, seed: int) -> list[list[int]]:
        """Each prompt's generated ids, the batch generated in groups of similar prompt lengths (`prompt_groups`);
        row i samples from its own generator (seed `row_seed(seed, i)`), so its tokens do not depend on the groups."""
        use_torch_threads()  # generation runs in asyncio.to_thread's workers: torch's count is per thread
        if self.watch is not None:  # the load since the last batch, not only at the partition's start
            rechoose_torch_threads(self.watch, "local completions", self.log)
        out: list[list[int]] = [[] for _ in batch]
        for rows in prompt_groups([len(r.prompt_ids) for r in batch], settings.max_tokens):
            generated = self._generate_padded([batch[i] for i in rows], settings, [row_seed(seed, i) for i in rows])
            for i, ids in zip(rows, generated, strict=True):
                out[i] = ids
        return out

    def _generate_padded(
        self, batch: list[CompletionRequest], settings: SamplingSettings, seeds: list[int]
    ) -> list[list[int]]:
        import torch

        pad = self.tokenizer.token_id(PAD)
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):  # left padding: generation continues every row at its end
            ids[row, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[row, width - len(r.prompt_ids) :] = 1
        from transformers import LogitsProcessorList

        stops = [self.tokenizer.token_id(IM_END), self.tokenizer.token_id(EOS)]
        processors = LogitsProcessorList()
        if settings.temperature > 0:
            processors.append(
                InverseCdfSampler(
                    settings.temperature, settings.top_p, settings.top_k, seeds, stops, prompt_width=width
                )
            )
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids.to(self.model.device),
                attention_mask=mask.to(self.model.device),
                max_new_tokens=settings.max_tokens,
                do_sample=False,
                logits_processor=processors,
                eos_token_id=stops,
                pad_token_id=pad,
            )
        return [row[width:].tolist() for row in out.cpu()]

    async def run(self, feed: RequestFeed, settings: SamplingSettings, emit: Emit) -> None:
        max_len = getattr(self.model.config, "max_position_embeddings", None)
        await asyncio.to_thread(apply_torch_threads, "local completions", self.log)  # the load now, not at start-up
        self.watch = LoadWatch()
        batch_no = 0
        while True:
            batch: list[Attempt] = []
            while len(batch) < self.batch_size and (attempt := await feed.take(wait=not batch)) is not None:
                req = attempt.request
                if max_len and len(req.prompt_ids) + settings.max_tokens > max_len:
                    feed.unbilled(attempt, generated=False, why="context length")
                    emit(
                        CompletionResult(
                            req.prompt_id,
                            "failed",
                            "error",
                            error_code="context_length",
                            attempt_id=attempt.attempt_id,
                            error=f"prompt of {len(req.prompt_ids)} tokens + max_tokens exceeds the model's {max_len}",
                        )
                    )
                    continue
                batch.append(attempt)
            if not batch:
                return
            started = time.monotonic()
            seed = (settings.seed or 0) + batch_no
            for attempt in batch:
                attempt.sent = True
            try:
                outputs = await asyncio.to_thread(self._generate, [a.request for a in batch], settings, seed)
            except asyncio.CancelledError:
                for attempt in batch:
                    feed.unbilled(attempt, generated=False, why="cancelled in flight")
                    emit(
                        CompletionResult(
                            attempt.request.prompt_id,
                            "aborted",
                            error="cancelled in flight",
                            error_code="cancelled",
                            attempt_id=attempt.attempt_id,
                        )
                    )
                raise
            latency = time.monotonic() - started
            batch_no += 1
            for attempt, out in zip(batch, outputs, strict=True):  # one output row per prompt
                req = attempt.request
                result = result_from_ids(
                    self.tokenizer,
                    req.prompt_id,
                    out,
                    prompt_tokens=len(req.prompt_ids),
                    provider="transformers",
                    model=settings.model,
                    latency_s=latency,
                )
                result.attempt_id = attempt.attempt_id
                feed.billed(
                    attempt,
                    cost_usd=0.0,
                    prompt_tokens=result.prompt_tokens,
                    completion_tokens=result.completion_tokens,
                )
                emit(result)
