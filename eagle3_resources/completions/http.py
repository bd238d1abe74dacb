"""HTTP plumbing shared by the API backends: the client, retries, and the worker pool.

httpx's own connection pool collapses at hundreds of concurrent connections
(../shared/reference/http-clients.md); the httpx API is kept and aiohttp's pool used underneath
(`httpx-aiohttp`), which held 0.77 of the C/L limit at 2,000 in flight where httpx held 0.02.
"""

from __future__ import annotations

import asyncio
import email.utils
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from eagle3_resources.completions.types import (
    Attempt,
    CompletionResult,
    Emit,
    RequestFeed,
)

RETRYABLE_STATUS = {408, 409, 425, 429, 500, 502, 503, 504, 520, 522, 524, 529}


def make_client(base_url: str, headers: dict[str, str], concurrency: int, timeout_s: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(timeout_s, connect=30.0)
    transport: httpx.AsyncBaseTransport
    try:
        from httpx_aiohttp import AiohttpTransport

        transport = AiohttpTransport(limits=limits)
    except ImportError:  # still correct, slower past a few hundred connections
        transport = httpx.AsyncHTTPTransport(limits=limits)
    return httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout, transport=transport)


def retry_after_seconds(headers: httpx.Headers) -> float | None:
    """`Retry-After` as seconds (number or HTTP date), if present and sensible."""
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
        return max(0.0, when.timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def backoff_seconds(attempt: int, base: float, cap: float, retry_after: float | None) -> float:
    """Capped exponential backoff with full jitter; a server's Retry-After is a floor."""
    delay = random.uniform(0, min(cap, base * 2 ** (attempt - 1)))
    return max(delay, retry_after) if retry_after is not None else delay


@dataclass
class RequestState:
    """What is known about one request while it is in flight (for the journal if it is cut short)."""

    attempt: Attempt
    started: float = field(default_factory=time.monotonic)
    attempts: int = 0  # attempts that count towards max_attempts
    provider: str | None = None

    @property
    def prompt_id(self) -> str:
        return self.attempt.request.prompt_id

    def result(self, status: str, why: str, code: str) -> CompletionResult:
        """A result with no answer (aborted, deferred, failed), naming the last attempt."""
        return CompletionResult(
            self.prompt_id,
            status,
            error=why,
            error_code=code,
            generation_id=self.attempt.generation_id,
            provider=self.provider,
            attempts=self.attempt.number,
            latency_s=time.monotonic() - self.started,
            attempt_id=self.attempt.attempt_id,
        )

    def aborted(self, why: str) -> CompletionResult:
        return self.result("aborted", why, "cancelled")


async def run_workers(
    feed: RequestFeed,
    concurrency: int,
    complete: Callable[[RequestState], Awaitable[CompletionResult]],
    emit: Emit,
    stop: Callable[[], bool] = lambda: False,
) -> None:
    """`concurrency` workers, each taking a request's first attempt, completing it and emitting the result.

    Once `stop()` is true no worker takes another request; requests in flight still finish. When
    the feed asks for in-flight requests to be cancelled (a cap with on_cap="cancel", a hold in
    cancel mode), or this coroutine is cancelled (a stop), every worker ends its attempt as
    unbilled (the ledger keeps it unsettled if it may have been billed), emits its request as
    `aborted` (with the generation id, if one was seen) and ends: every request taken gets exactly
    one result.
    """

    async def worker() -> None:
        while not stop() and (attempt := await feed.take()) is not None:
            state = RequestState(attempt)
            try:
                result = await complete(state)
            except asyncio.CancelledError:
                feed.unbilled(state.attempt, generated=None, why="cancelled in flight (stop, cap or hold)")
                emit(state.aborted("cancelled in flight (stop, cap or hold)"))
                raise
            emit(result)

    tasks = [asyncio.create_task(worker()) for _ in range(max(1, concurrency))]
    cancel_event = getattr(feed, "cancel_inflight", None)

    async def cancel_on_request() -> None:
        assert cancel_event is not None  # only started where the feed has one
        await cancel_event.wait()
        for t in tasks:
            t.cancel()

    watcher = asyncio.create_task(cancel_on_request()) if cancel_event is not None else None
    try:
        results = await asyncio.gather(*tasks, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)]
        if errors:
            raise errors[0]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if watcher is not None:
            watcher.cancel()
