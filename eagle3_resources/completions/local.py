"""The local completions backend: the target generates in-process with transformers (the CPU default, on the
stand-in target), on one lane or several (`local_lanes`).

The prompt ids come from our own chat format and the target's own output ids are kept, exactly
as the SGLang backend does; the text split into reasoning and content mirrors what an API
returns (reasoning before `</think>`, content after, `<|im_end|>` not shown). How a batch is
decoded and sampled: `local_generate`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from eagle3_resources.completions.local_generate import Decoding, generate_rows, prompt_seed
from eagle3_resources.completions.local_lanes import LaneModel, LaneProcesses, lane_shares
from eagle3_resources.completions.types import (
    Attempt,
    CompletionRequest,
    CompletionResult,
    Emit,
    RequestFeed,
    SamplingSettings,
)
from eagle3_resources.cpu import (
    LoadWatch,
    apply_torch_threads,
    choose_since,
    rechoose_torch_threads,
    set_torch_threads,
    use_torch_threads,
)
from eagle3_resources.tokenizer.kimi import KimiTokenizer
from eagle3_resources.tokenizer.special_tokens import EOS, IM_END, THINK_END


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
    """Generates with `model` in this process, and on machines with free CPUs in lane processes beside it: each
    round takes up to `batch_size` prompts per lane from the feed and deals them out by their work (`lane_shares`).

    `lanes`: None chooses at the start of each run, from the CPUs free then (`apply_torch_threads`' rule: a lane per
    free CPU, one torch thread each; one lane keeps today's single process, its thread count re-chosen each round);
    a number fixes it. Lanes need the model on the CPU, loaded from a local folder (`LaneModel.of`)."""

    name = "local"

    def __init__(
        self,
        model,
        tokenizer: KimiTokenizer,
        batch_size: int = 8,
        log: Callable[[str], None] | None = None,
        lanes: int | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.log = log or logging.getLogger(__name__).info
        self.lanes = lanes
        self.lane_model = LaneModel.of(model)
        self.processes: LaneProcesses | None = None
        self.last_lanes: int | None = None
        self.watch: LoadWatch | None = None  # set by `run`, after the partition's first choice of threads

    def describe(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "model_type": self.model.config.model_type,
            "batch_size": self.batch_size,
            "lanes": "auto" if self.lanes is None else self.lanes,
        }

    def close(self, kill: bool = False) -> None:
        """Stop the lane processes (the backend's owner calls it when its work is done; `kill`: mid-generation)."""
        if self.processes is not None:
            self.processes.close(kill)
            self.processes = None

    def _lanes_cpu_s(self) -> float:
        return self.processes.cpu_seconds() if self.processes is not None else 0.0

    def _lane_count(self, threads: int) -> int:
        wanted = threads if self.lanes is None else self.lanes
        if wanted > 1 and self.lane_model is None:
            return 1
        return max(1, wanted)

    def _ensure_processes(self, workers: int) -> LaneProcesses:
        if self.processes is not None and self.processes.workers != workers:
            self.close()
        if self.processes is None:
            assert self.lane_model is not None
            self.processes = LaneProcesses(self.lane_model, workers)
        return self.processes

    def _generate_here(self, prompts: list[list[int]], decoding: Decoding, seeds: list[int], single: bool):
        """Lane 0, in asyncio.to_thread's worker: torch's thread count is per thread."""
        if single:
            import torch

            torch.set_num_threads(1)
        else:
            use_torch_threads()
            if self.watch is not None:  # the load since the last batch, not only at the partition's start
                rechoose_torch_threads(self.watch, "local completions", self.log)
        return generate_rows(self.model, prompts, decoding, seeds)

    async def _generate(self, batch: list[CompletionRequest], decoding: Decoding, seed: int | None, lanes: int):
        """Each request's generated ids: the batch dealt out to `lanes` lanes, lane 0 in this process."""
        prompts = [r.prompt_ids for r in batch]
        seeds = [prompt_seed(seed, r.prompt_id) for r in batch]
        shares = lane_shares([len(p) for p in prompts], lanes, decoding.max_tokens)
        processes = self._ensure_processes(lanes - 1) if len(shares) > 1 else None
        jobs = []
        for k, rows in enumerate(shares):
            args = ([prompts[i] for i in rows], decoding, [seeds[i] for i in rows])
            if k == 0:
                jobs.append(asyncio.to_thread(self._generate_here, *args, lanes > 1))
            else:
                assert processes is not None
                jobs.append(processes.generate(*args))
        try:
            results = await asyncio.gather(*jobs)
        except BaseException:
            self.close(kill=True)  # a stop or a failed lane: what the lanes are generating is dropped
            raise
        out: list[list[int]] = [[] for _ in batch]
        for rows, generated in zip(shares, results, strict=True):
            for i, ids in zip(rows, generated, strict=True):
                out[i] = ids
        return out

    async def run(self, feed: RequestFeed, settings: SamplingSettings, emit: Emit) -> None:
        max_len = getattr(self.model.config, "max_position_embeddings", None)
        # The load now, not at start-up: after an earlier run of this backend, the load since then (no waiting).
        since = choose_since(self.watch) if self.watch is not None else None
        stage = "local completions"
        if since is None:
            threads = await asyncio.to_thread(apply_torch_threads, stage, self.log)
        else:
            threads = await asyncio.to_thread(set_torch_threads, since, stage, self.log)
        lanes = self._lane_count(threads)
        if lanes != self.last_lanes:  # said when it changes, not before each of a run's phases
            self.log(
                f"local completions on {lanes} lanes (this process and {lanes - 1} more), one torch thread each"
                if lanes > 1
                else "local completions in this process only"
            )
            self.last_lanes = lanes
        self.watch = LoadWatch(self._lanes_cpu_s)
        decoding = Decoding.of(settings, self.tokenizer)
        while True:
            batch: list[Attempt] = []
            while len(batch) < self.batch_size * lanes and (attempt := await feed.take(wait=not batch)) is not None:
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
            for attempt in batch:
                attempt.sent = True
            try:
                outputs = await self._generate([a.request for a in batch], decoding, settings.seed, lanes)
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
