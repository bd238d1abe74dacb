"""Completions from an SGLang server's native `/generate` endpoint, which returns token ids.

The prompt is sent as `input_ids` rendered by our own chat format, so the prompt the target
saw is exactly the one the training sample records; the returned `output_ids` are kept as the
completion ids and the text reconstruction is checked against them downstream.
Start a server with e.g. `python -m sglang.launch_server --model-path moonshotai/Kimi-K2.5
--tp 8 --trust-remote-code --port 30000` (needs the `[sglang]` extra and CUDA).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx

from eagle3_resources.completions.http import (
    RETRYABLE_STATUS,
    RequestState,
    backoff_seconds,
    make_client,
    retry_after_seconds,
    run_workers,
)
from eagle3_resources.completions.local import result_from_ids
from eagle3_resources.completions.types import (
    CompletionRequest,
    CompletionResult,
    Emit,
    Refusal,
    RequestFeed,
    SamplingSettings,
)
from eagle3_resources.tokenizer.kimi import KimiTokenizer
from eagle3_resources.tokenizer.special_tokens import EOS, IM_END


def generate_body(req: CompletionRequest, settings: SamplingSettings, stop_ids: list[int]) -> dict[str, Any]:
    params: dict[str, Any] = {
        "max_new_tokens": settings.max_tokens,
        "temperature": settings.temperature,
        "top_p": settings.top_p,
        "stop_token_ids": stop_ids,
        "skip_special_tokens": False,  # keep </think> and tool-call markers in the text
        "no_stop_trim": True,
    }
    if settings.top_k is not None:
        params["top_k"] = settings.top_k
    return {"input_ids": req.prompt_ids, "sampling_params": params, "rid": f"{req.prompt_id}-{time.time_ns()}"}


def parse_generate(
    req: CompletionRequest, data: dict[str, Any], tokenizer: KimiTokenizer, latency: float, attempts: int
) -> CompletionResult:
    meta = data.get("meta_info") or {}
    out = list(data.get("output_ids") or [])
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind == "abort":
        return CompletionResult(
            req.prompt_id,
            "failed",
            "error",
            error=str(finish.get("message") or "aborted by the server"),
            error_code="abort",
            latency_s=latency,
            attempts=attempts,
        )
    matched = finish.get("matched") if isinstance(finish, dict) else None
    # The matched stop token was generated: keep it as the completion's last id.
    if kind == "stop" and isinstance(matched, int) and (not out or out[-1] != matched):
        out.append(matched)
    return result_from_ids(
        tokenizer,
        req.prompt_id,
        out,
        prompt_tokens=meta.get("prompt_tokens"),
        completion_tokens=meta.get("completion_tokens"),
        generation_id=meta.get("id"),
        provider="sglang",
        latency_s=latency,
        attempts=attempts,
    )


class SGLangBackend:
    name = "sglang"

    def __init__(
        self,
        base_url: str,
        tokenizer: KimiTokenizer,
        *,
        concurrency: int = 256,
        max_attempts: int = 4,
        timeout_s: float = 1800.0,
        api_key: str | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.tokenizer = tokenizer
        self.concurrency = concurrency
        self.max_attempts = max_attempts
        self.timeout_s = timeout_s
        self._api_key = api_key

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "base_url": self.base_url, "concurrency": self.concurrency}

    async def _complete(
        self, client: httpx.AsyncClient, feed: RequestFeed, settings: SamplingSettings, state: RequestState
    ) -> CompletionResult:
        """Every attempt is admitted by the feed (token budget, caps); a server of one's own bills nothing."""
        stop_ids = [self.tokenizer.token_id(IM_END), self.tokenizer.token_id(EOS)]
        attempt = state.attempt
        req = attempt.request
        body = generate_body(req, settings, stop_ids)
        started = state.started
        last = ""
        while True:
            state.attempts += 1
            retry_after = None
            try:
                attempt.sent = True
                resp = await client.post("/generate", json=body)
                if resp.status_code == 200:
                    result = parse_generate(
                        req, resp.json(), self.tokenizer, time.monotonic() - started, attempt.number
                    )
                    result.attempt_id = attempt.attempt_id
                    feed.billed(
                        attempt,
                        cost_usd=0.0,
                        prompt_tokens=result.prompt_tokens,
                        completion_tokens=result.completion_tokens,
                    )
                    return result
                last = f"HTTP {resp.status_code}: {resp.text[:300]}"
                feed.unbilled(attempt, generated=False, why=last)
                if resp.status_code not in RETRYABLE_STATUS:
                    return state.result("failed", last, str(resp.status_code))
                retry_after = retry_after_seconds(resp.headers)
            except (httpx.TransportError, httpx.DecodingError, json.JSONDecodeError) as e:
                last = f"{type(e).__name__}: {e}"
                feed.unbilled(attempt, generated=None, why=last)
            if state.attempts >= self.max_attempts:
                return state.result(
                    "deferred",
                    f"gave up after {state.attempts} attempts: {last}; sent again by the next materialization",
                    "gave_up",
                )
            await asyncio.sleep(backoff_seconds(state.attempts, 1.0, 30.0, retry_after))
            nxt = await feed.retry(attempt, last)
            if isinstance(nxt, Refusal):
                return state.result(nxt.status, nxt.reason, "not_retried")
            attempt = state.attempt = nxt
            body = generate_body(req, settings, stop_ids)

    async def run(self, feed: RequestFeed, settings: SamplingSettings, emit: Emit) -> None:
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        async with make_client(self.base_url, headers, self.concurrency, self.timeout_s) as client:
            await run_workers(feed, self.concurrency, lambda state: self._complete(client, feed, settings, state), emit)
