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

import httpx

from eagle3_resources.completions.types import CompletionRequest, CompletionResult, Emit, RequestFeed

RETRYABLE_STATUS = {408, 409, 425, 429, 500, 502, 503, 504, 520, 522, 524, 529}


def make_client(base_url: str, headers: dict[str, str], concurrency: int, timeout_s: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(timeout_s, connect=30.0)
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


async def run_workers(
    feed: RequestFeed,
    concurrency: int,
    complete: Callable[[CompletionRequest], Awaitable[CompletionResult]],
    emit: Emit,
    stop: Callable[[], bool] = lambda: False,
) -> None:
    """`concurrency` workers, each taking a request, completing it and emitting the result.

    Once `stop()` is true no worker takes another request; requests in flight still finish.
    """

    async def worker() -> None:
        while not stop() and (req := feed.take()) is not None:
            emit(await complete(req))

    tasks = [asyncio.create_task(worker()) for _ in range(max(1, concurrency))]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
