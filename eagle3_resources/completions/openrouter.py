"""OpenRouter chat completions (or any OpenAI-compatible endpoint), async on httpx.

Streaming (SSE) by default: the generation id arrives with the headers (`X-Generation-Id`) and
is journaled before the body is read, and cancelling a stream stops generation (and billing)
where the provider supports it. Non-streaming is a setting.

Outcomes (../shared/reference/openrouter-api.md):
- run-fatal: 401 (bad key), 402 without Retry-After (no credits / key limit), 404 (no endpoint
  after provider filters): no new request is admitted and the run ends with the message;
- retryable: 408, 429, 5xx, 402 with Retry-After (in-flight budget), connection errors,
  truncated bodies or streams, an error inside HTTP 200 or mid-stream: capped exponential
  backoff with jitter, Retry-After honoured per request, a bounded number of attempts; 429, 503
  and the in-flight 402 also shrink the concurrency for a while (`AdaptiveLimiter`);
- per-sample: 400/403, finish_reason length / content_filter / error, empty completions:
  recorded as such and never re-sent.
The API key is sent in a header only; it is never logged or recorded.
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
from eagle3_resources.completions.sse import (
    SSEDecoder,
    StreamedResponse,
    StreamError,
    fold_events,
)
from eagle3_resources.completions.throttle import AdaptiveLimiter
from eagle3_resources.completions.types import (
    CompletionRequest,
    CompletionResult,
    Emit,
    Note,
    RequestFeed,
    RunFatalError,
    SamplingSettings,
)

FATAL_STATUS = {401, 404}
THROTTLE_STATUS = {429, 503}


class _Retry(Exception):
    def __init__(self, message: str, code: str, retry_after: float | None = None, throttle: bool = False):
        super().__init__(message)
        self.code, self.retry_after, self.throttle = code, retry_after, throttle


class _Final(Exception):
    """A response that settles the request (per-sample failure, or run-fatal)."""

    def __init__(self, result: CompletionResult, fatal: str | None = None):
        self.result, self.fatal = result, fatal


def request_body(req: CompletionRequest, settings: SamplingSettings, stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": settings.model,
        "messages": req.messages,
        "max_tokens": settings.max_tokens,
        "temperature": settings.temperature,
        "top_p": settings.top_p,
        "stream": stream,
    }
    if req.tools:
        body["tools"] = req.tools
    if settings.top_k is not None:
        body["top_k"] = settings.top_k
    if settings.seed is not None:
        body["seed"] = settings.seed
    # Never `exclude: true`: the reasoning would be generated and billed but not returned.
    body["reasoning"] = {"enabled": True, **({"effort": settings.reasoning_effort} if settings.reasoning_effort else {})}
    provider = settings.provider.to_request()
    if provider:
        body["provider"] = provider
    return body


def _error_message(data: Any, fallback: str) -> tuple[str, str]:
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):
        return str(err.get("message") or fallback), str(err.get("code") or "")
    return fallback, ""


def parse_response(req: CompletionRequest, data: dict[str, Any], latency: float, attempts: int) -> CompletionResult:
    """A 200 body (or a folded stream) to a result; raises `_Retry` for an error inside HTTP 200."""
    choices = data.get("choices") or []
    if not choices:
        message, code = _error_message(data, "HTTP 200 without choices")
        raise _Retry(f"error inside HTTP 200: {message}", f"200:{code or 'no_choices'}")
    choice = choices[0]
    msg = choice.get("message") or {}
    usage = data.get("usage") or {}
    finish = choice.get("finish_reason")
    content = msg.get("content") or ""
    reasoning = msg.get("reasoning") or ""
    tool_calls = msg.get("tool_calls") or None
    result = CompletionResult(
        prompt_id=req.prompt_id,
        status="ok",
        finish_reason=finish,
        reasoning=reasoning,
        content=content,
        tool_calls=tool_calls,
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
        reasoning_tokens=(usage.get("completion_tokens_details") or {}).get("reasoning_tokens"),
        cost_usd=float(usage.get("cost") or 0.0),
        generation_id=data.get("id"),
        provider=data.get("provider"),
        model=data.get("model"),
        latency_s=latency,
        attempts=attempts,
        extra={"native_finish_reason": choice.get("native_finish_reason")},
    )
    if finish == "length":
        result.status = "truncated"
    elif finish == "content_filter":
        result.status = "filtered"
    elif finish == "error" or choice.get("error"):
        result.status = "failed"
        result.error, result.error_code = _error_message({"error": choice.get("error") or {}}, "finish_reason error")
        result.error_code = f"finish:{result.error_code or 'error'}"
    elif not (content or reasoning or tool_calls):
        result.status, result.error, result.error_code = "failed", "empty completion", "empty"
    return result


class OpenRouterBackend:
    name = "openrouter"

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        concurrency: int = 256,
        stream: bool = True,
        max_attempts: int = 6,
        backoff_base_s: float = 1.0,
        backoff_cap_s: float = 60.0,
        timeout_s: float = 900.0,
        app_title: str = "eagle3-pipeline",
    ):
        self.base_url = base_url.rstrip("/")
        self._api_key = api_key
        self.concurrency = concurrency
        self.stream = stream
        self.max_attempts = max_attempts
        self.backoff_base_s = backoff_base_s
        self.backoff_cap_s = backoff_cap_s
        self.timeout_s = timeout_s
        self.app_title = app_title
        self.fatal: str | None = None
        self.limiter: AdaptiveLimiter | None = None

    def describe(self) -> dict[str, Any]:
        out = {"backend": self.name, "base_url": self.base_url, "concurrency": self.concurrency, "stream": self.stream,
               "max_attempts": self.max_attempts}
        if self.limiter is not None:
            out.update(throttle_events=self.limiter.throttle_events, min_concurrency=self.limiter.min_seen)
        return out

    async def _attempt(self, client: httpx.AsyncClient, req: CompletionRequest, settings: SamplingSettings,
                       state: RequestState, note: Note) -> CompletionResult:
        body = request_body(req, settings, stream=self.stream)
        async with client.stream("POST", "/chat/completions", json=body) as resp:
            gen_id = resp.headers.get("x-generation-id")
            if gen_id and gen_id != state.generation_id:
                state.generation_id = gen_id
                note({"type": "inflight", "prompt_id": req.prompt_id, "generation_id": gen_id, "attempt": state.attempts})
            if resp.status_code != 200:
                await resp.aread()
                self._classify_error(req, resp, state)
            if self.stream and resp.headers.get("content-type", "").startswith("text/event-stream"):
                folded = StreamedResponse()
                decoder = SSEDecoder()
                async for line in resp.aiter_lines():
                    fold_events(decoder.line(line), folded)
                    if folded.done:
                        break
                if not folded.done:
                    raise StreamError(f"stream ended after {folded.chunks} chunks without [DONE]", "stream:truncated")
                data = folded.as_body()
            else:
                raw = await resp.aread()
                try:
                    data = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise _Retry(f"truncated or invalid body ({len(raw)} bytes): {e}", "bad_body") from None
        return parse_response(req, data, time.monotonic() - state.started, state.attempts)

    def _classify_error(self, req: CompletionRequest, resp: httpx.Response, state: RequestState) -> None:
        status = resp.status_code
        try:
            data = resp.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            data = {}
        message, _ = _error_message(data, resp.reason_phrase or f"HTTP {status}")
        retry_after = retry_after_seconds(resp.headers)
        text = f"HTTP {status}: {message}"
        if (status == 402 and retry_after is None) or status in FATAL_STATUS:
            raise _Final(CompletionResult(req.prompt_id, "aborted", error=text, error_code=str(status),
                                          generation_id=state.generation_id, attempts=state.attempts,
                                          latency_s=time.monotonic() - state.started), fatal=text)
        if status == 402 or status in RETRYABLE_STATUS:
            raise _Retry(text, str(status), retry_after, throttle=status in THROTTLE_STATUS or status == 402)
        raise _Final(CompletionResult(req.prompt_id, "failed", error=text, error_code=str(status), attempts=state.attempts,
                                      latency_s=time.monotonic() - state.started))

    async def _complete(self, client: httpx.AsyncClient, req: CompletionRequest, settings: SamplingSettings,
                        state: RequestState, note: Note) -> CompletionResult:
        assert self.limiter is not None
        last_error, last_code = "", ""
        while state.attempts < self.max_attempts:
            if self.fatal:
                return state.aborted(f"not sent: {self.fatal}")
            state.attempts += 1
            retry_after = None
            try:
                async with self.limiter.slot():
                    result = await self._attempt(client, req, settings, state, note)
                await self.limiter.succeeded()
                return result
            except _Final as e:
                if e.fatal:
                    self.fatal = self.fatal or e.fatal
                return e.result
            except _Retry as e:
                last_error, last_code, retry_after = str(e), e.code, e.retry_after
                if e.throttle:
                    self.limiter.throttled()
            except StreamError as e:
                last_error, last_code = str(e), e.code
            except (httpx.TransportError, httpx.DecodingError) as e:
                last_error, last_code = f"{type(e).__name__}: {e}", type(e).__name__
            if state.attempts < self.max_attempts:
                await asyncio.sleep(backoff_seconds(state.attempts, self.backoff_base_s, self.backoff_cap_s, retry_after))
        return CompletionResult(
            req.prompt_id, "failed", error=f"gave up after {self.max_attempts} attempts: {last_error}",
            error_code=last_code, generation_id=state.generation_id, latency_s=time.monotonic() - state.started,
            attempts=state.attempts,
        )

    async def lookup_generations(self, generation_ids: list[str], *, window_s: float = 20.0) -> dict[str, dict[str, Any]]:
        """What OpenRouter billed for generations whose responses were lost (GET /api/v1/generation).

        A finished generation answers 404 for a short while; each id is retried within `window_s`.
        Ids still unknown after that are left out (the caller reports them as possible double spend).
        """
        headers = {"Authorization": f"Bearer {self._api_key}"}
        found: dict[str, dict[str, Any]] = {}

        async def one(client: httpx.AsyncClient, gen: str) -> None:
            deadline = time.monotonic() + window_s
            delay = 0.25
            while True:
                try:
                    resp = await client.get("/generation", params={"id": gen})
                    if resp.status_code == 200:
                        d = resp.json().get("data") or {}
                        found[gen] = {
                            "cost_usd": float(d.get("total_cost") or 0.0),
                            "native_tokens_prompt": d.get("native_tokens_prompt"),
                            "native_tokens_completion": d.get("native_tokens_completion"),
                            "finish_reason": d.get("finish_reason"),
                            "cancelled": d.get("cancelled"),
                            "provider": d.get("provider_name"),
                        }
                        return
                    if resp.status_code not in (404, 429) and resp.status_code < 500:
                        return
                except (httpx.TransportError, json.JSONDecodeError):
                    pass
                if time.monotonic() + delay > deadline:
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 4.0)

        async with make_client(self.base_url, headers, min(32, max(1, len(generation_ids))), 60.0) as client:
            await asyncio.gather(*(one(client, g) for g in generation_ids))
        return found

    async def run(self, feed: RequestFeed, settings: SamplingSettings, emit: Emit, note: Note = lambda rec: None) -> None:
        headers = {"Authorization": f"Bearer {self._api_key}", "X-Title": self.app_title}
        self.limiter = AdaptiveLimiter(self.concurrency)
        async with make_client(self.base_url, headers, self.concurrency, self.timeout_s) as client:
            await run_workers(
                feed, self.concurrency, lambda req, state: self._complete(client, req, settings, state, note), emit,
                stop=lambda: self.fatal is not None,
            )
        if self.fatal:
            raise RunFatalError(f"OpenRouter refused the run: {self.fatal}")
