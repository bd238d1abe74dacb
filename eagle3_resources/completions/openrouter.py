"""OpenRouter chat completions (or any OpenAI-compatible endpoint), async on httpx.

Streaming (SSE) by default: the generation id arrives with the headers (`X-Generation-Id`) and
is journaled before the body is read, and cancelling a stream stops generation (and billing)
where the provider supports it. Non-streaming is a setting.

Before fanning out, the key is read (`/api/v1/key`, unbilled): a revoked key stops the run before
a single paid request. Every attempt, first or retry, waits for its pacing (a place in flight, the
requests-per-second turn), is then admitted by the feed (the spend ledger: caps and hold), its send
marked there (committed before the first byte leaves), and ends as billed (the response's
`usage.cost`), released (nothing was generated) or unsettled (a generation id without a bill:
looked up before the prompt is sent again).

Outcomes (../shared/reference/openrouter-api.md):
- run-fatal: 401 (bad key), 402 without Retry-After (no credits / key limit), 404 (no endpoint
  after provider filters): no new request is admitted and the run ends with the message;
- retryable: 408, 429, 5xx, 402 with Retry-After (in-flight budget), connection errors,
  truncated bodies or streams, an error inside HTTP 200 or mid-stream: capped exponential
  backoff with jitter, Retry-After honoured per request, a bounded number of attempts after which
  the prompt is `deferred` (sent again by the next materialization, never final); 429, 503 and the
  in-flight 402 also shrink the concurrency for a while (`AdaptiveLimiter`), and `X-RateLimit-*`
  headers pace requests per second (`RateLimiter`; such 429s do not use up attempts);
- per-sample: 400/403, finish_reason length / content_filter / error, empty completions:
  recorded as such and never re-sent.
The API key is sent in a header only; it is never logged or recorded.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
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
from eagle3_resources.completions.openrouter_account import KeyInfo, OpenRouterAccount
from eagle3_resources.completions.sse import (
    SSEDecoder,
    StreamedResponse,
    fold_events,
)
from eagle3_resources.completions.throttle import AdaptiveLimiter, RateLimiter
from eagle3_resources.completions.types import (
    Attempt,
    CompletionRequest,
    CompletionResult,
    Emit,
    Refusal,
    RequestFeed,
    SamplingSettings,
)
from eagle3_resources.errors import AccountError, RunFatalError, StreamError

FATAL_STATUS = {401, 404}
THROTTLE_STATUS = {429, 503}


ATTEMPT_HEADER = "X-Eagle3-Attempt"  # the ledger's attempt id: lets a bill be matched to its reservation
MAX_PACED_429 = 100  # 429s with X-RateLimit-* headers (pacing, not failure) a request may meet


class _Retry(Exception):
    def __init__(
        self,
        message: str,
        code: str,
        retry_after: float | None = None,
        throttle: bool = False,
        paced: bool = False,
        generated: bool | None = None,
    ):
        super().__init__(message)
        self.code, self.retry_after, self.throttle, self.paced, self.generated = (
            code,
            retry_after,
            throttle,
            paced,
            generated,
        )


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
    body["reasoning"] = {
        "enabled": True,
        **({"effort": settings.reasoning_effort} if settings.reasoning_effort else {}),
    }
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


@dataclass(frozen=True)
class ClientOptions:
    """The client's knobs (`OpenRouterBackend`'s keywords)."""

    concurrency: int = 256  # requests in flight, at most
    stream: bool = True  # SSE: the generation id arrives with the headers; a cancel stops generation
    max_attempts: int = 6  # per request, for retryable errors; then the prompt is deferred
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 60.0
    timeout_s: float = 900.0
    app_title: str = "eagle3-pipeline"
    preflight: bool = True  # read /key (unbilled) before the first paid request


async def _read_stream(resp: httpx.Response) -> dict[str, Any]:
    """An SSE stream folded into the body a non-streaming request would have had; one cut before [DONE] raises."""
    folded = StreamedResponse()
    decoder = SSEDecoder()
    async for line in resp.aiter_lines():
        fold_events(decoder.line(line), folded)
        if folded.done:
            break
    if not folded.done:
        raise StreamError(f"stream ended after {folded.chunks} chunks without [DONE]", "stream:truncated")
    return folded.as_body()


async def _read_body(resp: httpx.Response) -> dict[str, Any]:
    raw = await resp.aread()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _Retry(f"truncated or invalid body ({len(raw)} bytes): {e}", "bad_body") from None


class OpenRouterBackend:
    name = "openrouter"

    def __init__(self, base_url: str, api_key: str, options: ClientOptions | None = None, **keywords: Any):
        """`keywords`: `ClientOptions`' fields, where no `options` are given."""
        self.base_url = base_url.rstrip("/")
        self._api_key = api_key
        self.options = options or ClientOptions(**keywords)
        self.fatal: str | None = None
        self.limiter: AdaptiveLimiter | None = None
        self.rate = RateLimiter()
        self.key_info: KeyInfo | None = None

    @property
    def concurrency(self) -> int:
        return self.options.concurrency

    def account(self) -> OpenRouterAccount:
        """The unbilled endpoints with this backend's key (`async with` it)."""
        return OpenRouterAccount(self.base_url, self._api_key)

    def describe(self) -> dict[str, Any]:
        out = {
            "backend": self.name,
            "base_url": self.base_url,
            "concurrency": self.concurrency,
            "stream": self.options.stream,
            "max_attempts": self.options.max_attempts,
        }
        if self.limiter is not None:
            out.update(throttle_events=self.limiter.throttle_events, min_concurrency=self.limiter.min_seen)
        if self.rate.learnt:
            out["rate_limit"] = self.rate.describe()
        return out

    async def check_key(self) -> None:
        """Read /api/v1/key (unbilled) before any paid request: a bad or spent key stops the run here."""
        async with self.account() as account:
            try:
                key_info = self.key_info = await account.key()
            except AccountError as e:
                if e.status in (401, 402, 403):
                    self.fatal = f"the key was refused before any request was sent ({e})"
                    raise RunFatalError(f"OpenRouter refused the run: {self.fatal}") from None
                return  # an endpoint without /key (another OpenAI-compatible API): nothing to learn
            except httpx.TransportError:
                return
        remaining = key_info.limit_remaining_usd
        if remaining is not None and remaining <= 0:
            self.fatal = (
                f"the key has no credit left (limit_remaining ${remaining:.4f}: every request would get HTTP 402)"
            )
            raise RunFatalError(f"OpenRouter refused the run: {self.fatal}")

    async def _attempt(
        self,
        client: httpx.AsyncClient,
        feed: RequestFeed,
        attempt: Attempt,
        settings: SamplingSettings,
        state: RequestState,
    ) -> CompletionResult:
        """One attempt: its send marked in the ledger, the request, its body (streamed or not), its bill."""
        req = attempt.request
        try:  # committed before a byte leaves: after a crash, only attempts marked sent can have been billed
            await feed.sending(attempt)
        except Exception as e:
            raise _Retry(
                f"not sent: the spend ledger did not record the send ({type(e).__name__}: {e})",
                "ledger",
                generated=False,
            ) from None
        data = await self._exchange(
            client, feed, attempt, request_body(req, settings, stream=self.options.stream), state
        )
        usage = data.get("usage") or {}
        if "cost" in usage:
            feed.billed(
                attempt,
                cost_usd=float(usage.get("cost") or 0.0),
                prompt_tokens=usage.get("prompt_tokens"),
                completion_tokens=usage.get("completion_tokens"),
            )
        else:  # a complete answer without its bill (an error inside HTTP 200): the generation is looked up
            feed.unbilled(attempt, generated=None, why="response without usage.cost")
        result = parse_response(req, data, time.monotonic() - state.started, attempt.number)
        result.attempt_id, result.billed = attempt.attempt_id, "cost" in usage
        return result

    async def _exchange(
        self, client: httpx.AsyncClient, feed: RequestFeed, attempt: Attempt, body: dict[str, Any], state: RequestState
    ) -> dict[str, Any]:
        """The request and its response body (a stream folded into one); transport failures become `_Retry`."""
        headers_seen = False
        try:
            async with client.stream(
                "POST", "/chat/completions", json=body, headers={ATTEMPT_HEADER: attempt.attempt_id}
            ) as resp:
                headers_seen = True
                gen_id = resp.headers.get("x-generation-id")
                if gen_id:
                    feed.started(attempt, gen_id)
                if resp.status_code != 200:
                    self.rate.observe(resp.headers, throttled=resp.status_code == 429)
                    await resp.aread()
                    self._classify_error(attempt.request, resp, state)
                self.rate.observe(resp.headers)
                if self.options.stream and resp.headers.get("content-type", "").startswith("text/event-stream"):
                    return await _read_stream(resp)
                return await _read_body(resp)
        except httpx.ConnectError as e:  # never reached the server
            raise _Retry(f"{type(e).__name__}: {e}", type(e).__name__, generated=False) from None
        except (httpx.TransportError, httpx.DecodingError) as e:
            # OpenRouter streams answer with headers at once: none means nothing started. A non-streaming
            # request may be generating (and billed) after its connection broke: unknown.
            generated = None if headers_seen or not self.options.stream else False
            raise _Retry(f"{type(e).__name__}: {e}", type(e).__name__, generated=generated) from None

    def _classify_error(self, req: CompletionRequest, resp: httpx.Response, state: RequestState) -> None:
        status = resp.status_code
        try:
            data = resp.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            data = {}
        message, _ = _error_message(data, resp.reason_phrase or f"HTTP {status}")
        retry_after = retry_after_seconds(resp.headers)
        text = f"HTTP {status}: {message}"
        generated = None if resp.headers.get("x-generation-id") else False
        if (status == 402 and retry_after is None) or status in FATAL_STATUS:
            raise _Final(state.result("aborted", text, str(status)), fatal=text)
        if status == 402 or status in RETRYABLE_STATUS:
            paced = status == 429 and resp.headers.get("x-ratelimit-reset") is not None
            raise _Retry(
                text,
                str(status),
                retry_after,
                throttle=status in THROTTLE_STATUS or status == 402,
                paced=paced,
                generated=generated,
            )
        raise _Final(state.result("failed", text, str(status)))

    async def _pace(self, wanted: Callable[[], bool] = lambda: True) -> float | None:
        """Wait until a request may go: a place in flight (held until its attempt ends), then its requests-per-second
        turn (returned, for `RateLimiter.refund`). Attempts are reserved after this, never while waiting here. None,
        and no place held, once `wanted()` is false before the turn came."""
        assert self.limiter is not None
        await self.limiter.enter()
        try:
            token = await self.rate.acquire(wanted)
        except BaseException:
            await self.limiter.leave()
            raise
        if token is None:
            await self.limiter.leave()
        return token

    async def _complete(
        self, client: httpx.AsyncClient, feed: RequestFeed, settings: SamplingSettings, state: RequestState
    ) -> CompletionResult:
        """One request: its first attempt was taken after `_pace` (`_PacedFeed`); each retry is paced before it is
        reserved."""
        assert self.limiter is not None
        place = _Place(self, held=True)  # the first attempt's place in flight, taken by _PacedFeed.take
        attempt = state.attempt
        last_error, last_code, paced = "", "", 0
        try:
            while True:
                if self.fatal:
                    feed.unbilled(attempt, generated=False, why=f"not sent: {self.fatal}")
                    return state.aborted(f"not sent: {self.fatal}")
                state.attempts += 1
                retry_after = None
                try:
                    try:
                        result = await self._attempt(client, feed, attempt, settings, state)
                    finally:
                        await place.give_back()
                    await self.limiter.succeeded()
                    return result
                except _Final as e:
                    feed.unbilled(attempt, generated=False, why=str(e.result.error))
                    if e.fatal:
                        self.fatal = self.fatal or e.fatal
                    e.result.attempt_id = attempt.attempt_id
                    return e.result
                except _Retry as e:
                    last_error, last_code, retry_after = str(e), e.code, e.retry_after
                    feed.unbilled(attempt, generated=e.generated, why=last_error)
                    if e.throttle:
                        self.limiter.throttled()
                    if e.paced and paced < MAX_PACED_429:  # the provider said when to come back: not a failure
                        paced += 1
                        state.attempts -= 1
                        retry_after = max(retry_after or 0.0, self.rate.reset_at - time.time())
                except StreamError as e:
                    last_error, last_code = str(e), e.code
                    feed.unbilled(attempt, generated=None, why=last_error)
                if state.attempts >= self.options.max_attempts:
                    return state.result(
                        "deferred",
                        f"gave up after {state.attempts} attempts: {last_error}; sent again by "
                        "the next materialization",
                        last_code,
                    )
                await asyncio.sleep(
                    backoff_seconds(
                        state.attempts, self.options.backoff_base_s, self.options.backoff_cap_s, retry_after
                    )
                )
                nxt = await feed.retry(attempt, last_error, pace=place.take)
                if isinstance(nxt, Refusal):
                    return state.result(nxt.status, nxt.reason, last_code or "not_retried")
                attempt = state.attempt = nxt
        finally:
            await place.give_back()

    async def run(self, feed: RequestFeed, settings: SamplingSettings, emit: Emit) -> None:
        if self.options.preflight:
            await self.check_key()
        headers = {"Authorization": f"Bearer {self._api_key}", "X-Title": self.options.app_title}
        self.limiter = AdaptiveLimiter(self.concurrency)
        async with make_client(self.base_url, headers, self.concurrency, self.options.timeout_s) as client:
            await run_workers(
                _PacedFeed(feed, self),
                self.concurrency,
                lambda state: self._complete(client, feed, settings, state),
                emit,
                stop=lambda: self.fatal is not None,
            )
        if self.fatal:
            raise RunFatalError(f"OpenRouter refused the run: {self.fatal}")


class _Place:
    """A request's place in flight (the concurrency gate's), held from its pacing until its attempt has ended."""

    def __init__(self, backend: OpenRouterBackend, held: bool = False):
        self.backend, self.held = backend, held

    async def take(self) -> None:
        await self.backend._pace()
        self.held = True

    async def give_back(self) -> None:
        if self.held:
            assert self.backend.limiter is not None
            await self.backend.limiter.leave()  # (nothing can interrupt it once the gate's lock is held)
            self.held = False


class _PacedFeed:
    """The feed as the workers see it: a request's first attempt is asked for (reserved) only once its pacing lets it
    go, so no reservation waits for a place in flight or a requests-per-second turn; a kill then leaves reserved only
    what was about to be sent."""

    def __init__(self, feed: RequestFeed, backend: OpenRouterBackend):
        self._feed, self._backend = feed, backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self._feed, name)

    def _nothing_left(self) -> bool:
        return getattr(self._feed, "remaining", None) == 0

    async def take(self, wait: bool = True) -> Attempt | None:
        token = None if self._nothing_left() else await self._backend._pace(lambda: not self._nothing_left())
        if token is None:  # nothing left to take (now, or while this worker waited for its turn): no turn to wait for
            attempt = await self._feed.take(wait)
            if attempt is not None:  # requests came back meanwhile (a cancelled worker's): paced after all
                await self._backend._pace()
            return attempt
        assert self._backend.limiter is not None
        try:
            attempt = await self._feed.take(wait)
        except BaseException:
            self._backend.rate.refund(token)
            await self._backend.limiter.leave()
            raise
        if attempt is None:  # the turn goes to a request that has one
            self._backend.rate.refund(token)
            await self._backend.limiter.leave()
        return attempt
