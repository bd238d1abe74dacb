"""In-process generation with transformers: the CPU default, on the stand-in target.

The prompt ids come from our own chat format and the target's own output ids are kept, exactly
as the SGLang backend does; the text split into reasoning and content mirrors what an API
returns (reasoning before `</think>`, content after, `<|im_end|>` not shown).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from eagle3_resources.completions.types import CompletionRequest, CompletionResult, Emit, RequestFeed, SamplingSettings
from eagle3_resources.tokenizer.kimi import KimiTokenizer
from eagle3_resources.tokenizer.special_tokens import EOS, IM_END, PAD, THINK_END


def split_completion(tokenizer: KimiTokenizer, ids: list[int]) -> tuple[str, str, str]:
    """(reasoning, content, finish_reason) of generated ids, cut at the first end-of-turn."""
    stops = {tokenizer.token_id(IM_END), tokenizer.token_id(EOS)}
    end = next((i for i, t in enumerate(ids) if t in stops), None)
    finish = "stop" if end is not None else "length"
    body = ids if end is None else ids[:end]
    sep = tokenizer.token_id(THINK_END)
    if sep in body:
        cut = body.index(sep)
        return tokenizer.decode(body[:cut]), tokenizer.decode(body[cut + 1 :]), finish
    return tokenizer.decode(body), "", finish


class TransformersBackend:
    name = "local"

    def __init__(self, model, tokenizer: KimiTokenizer, batch_size: int = 8):
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "model_type": self.model.config.model_type, "batch_size": self.batch_size}

    def _generate(self, batch: list[CompletionRequest], settings: SamplingSettings, seed: int) -> list[list[int]]:
        import torch

        pad = self.tokenizer.token_id(PAD)
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):  # left padding: generation continues every row at its end
            ids[row, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[row, width - len(r.prompt_ids) :] = 1
        torch.manual_seed(seed)
        sample = settings.temperature > 0
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids.to(self.model.device),
                attention_mask=mask.to(self.model.device),
                max_new_tokens=settings.max_tokens,
                do_sample=sample,
                temperature=settings.temperature if sample else None,
                top_p=settings.top_p if sample else None,
                top_k=settings.top_k if sample else None,
                eos_token_id=[self.tokenizer.token_id(IM_END), self.tokenizer.token_id(EOS)],
                pad_token_id=pad,
            )
        return [row[width:].tolist() for row in out.cpu()]

    async def run(self, feed: RequestFeed, settings: SamplingSettings, emit: Emit) -> None:
        max_len = getattr(self.model.config, "max_position_embeddings", None)
        batch_no = 0
        while True:
            batch = []
            while len(batch) < self.batch_size and (req := feed.take()) is not None:
                if max_len and len(req.prompt_ids) + settings.max_tokens > max_len:
                    emit(CompletionResult(req.prompt_id, "failed", "error", error=f"prompt of {len(req.prompt_ids)} tokens + max_tokens exceeds the model's {max_len}", error_code="context_length"))
                    continue
                batch.append(req)
            if not batch:
                return
            started = time.monotonic()
            seed = (settings.seed or 0) + batch_no
            outputs = await asyncio.to_thread(self._generate, batch, settings, seed)
            latency = time.monotonic() - started
            batch_no += 1
            for req, out in zip(batch, outputs):
                pad = self.tokenizer.token_id(PAD)
                while out and out[-1] == pad:  # rows that finished early are padded
                    out.pop()
                reasoning, content, finish = split_completion(self.tokenizer, out)
                sep = self.tokenizer.token_id(THINK_END)
                body_end = next((i for i, t in enumerate(out) if t in (self.tokenizer.token_id(IM_END), self.tokenizer.token_id(EOS))), None)
                kept = out if body_end is None else out[: body_end + 1]
                emit(
                    CompletionResult(
                        prompt_id=req.prompt_id,
                        status="ok" if finish == "stop" else "truncated",
                        finish_reason=finish,
                        reasoning=reasoning,
                        content=content,
                        completion_ids=kept,
                        prompt_tokens=len(req.prompt_ids),
                        completion_tokens=len(kept),
                        reasoning_tokens=kept.index(sep) if sep in kept else len(kept),
                        provider="transformers",
                        model=settings.model,
                        latency_s=latency,
                    )
                )
