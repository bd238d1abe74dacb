"""Adaptive concurrency and request pacing: back off when the API says it is overloaded, recover when it is not.

A gate in front of every HTTP attempt. 429, 503 and the in-flight-budget 402 shrink the number of
attempts allowed in flight (x0.8, at most once per `cooldown_s`, never below `floor`); every
`recover_after` successes grow it back by one, up to the configured concurrency. The request that
was refused waits its own Retry-After; the others carry on, at most slightly fewer at a time.

Beside it, `RateLimiter` paces requests per second where the provider says its limit in
`X-RateLimit-*` headers (a cap on requests, not on concurrency, which the gate above cannot see).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import asynccontextmanager


class AdaptiveLimiter:
    def __init__(
        self, limit: int, *, floor: int = 4, decrease: float = 0.8, recover_after: int = 8, cooldown_s: float = 1.0
    ):
        self.max_limit = limit
        self.limit = limit
        self.floor = min(floor, limit)
        self.decrease = decrease
        self.recover_after = recover_after
        self.cooldown_s = cooldown_s
        self.active = 0
        self.throttle_events = 0
        self.min_seen = limit
        self._successes = 0
        self._last_decrease = 0.0
        self._cond = asyncio.Condition()

    @asynccontextmanager
    async def slot(self):
        await self.enter()
        try:
            yield
        finally:
            await self.leave()

    async def enter(self) -> None:
        """Wait for room and take a place in flight (give it back with `leave`)."""
        async with self._cond:
            await self._cond.wait_for(lambda: self.active < self.limit)
            self.active += 1

    async def leave(self) -> None:
        async with self._cond:
            self.active -= 1
            self._cond.notify(1)

    def throttled(self) -> None:
        """The API pushed back (429 / 503 / in-flight 402)."""
        self.throttle_events += 1
        self._successes = 0
        now = time.monotonic()
        if now - self._last_decrease >= self.cooldown_s:
            self._last_decrease = now
            self.limit = max(self.floor, int(self.limit * self.decrease))
            self.min_seen = min(self.min_seen, self.limit)

    async def succeeded(self) -> None:
        self._successes += 1
        if self._successes >= self.recover_after and self.limit < self.max_limit:
            self._successes = 0
            async with self._cond:
                self.limit += 1
                self._cond.notify(1)


def _reset_epoch_s(value: str, now: float) -> float | None:
    """X-RateLimit-Reset: epoch milliseconds (OpenRouter), epoch seconds, or seconds from now."""
    try:
        v = float(value)
    except ValueError:
        return None
    if v > 1e11:  # epoch ms
        return v / 1000.0
    if v > 1e9:  # epoch s
        return v
    return now + v


class RateLimiter:
    """Requests per window, learnt from the provider's `X-RateLimit-*` headers; beside the concurrency gate.

    A provider that caps requests per second answers 429 with `X-RateLimit-Limit` (requests per
    window), `X-RateLimit-Remaining` and `X-RateLimit-Reset` (when the window resets; OpenRouter
    gives epoch milliseconds). From then on at most the remaining requests start before the reset,
    and windows after it are paced at the limit (their length learnt from successive resets).
    Without such headers it lets everything through.
    """

    def __init__(self) -> None:
        self.limit: int | None = None
        self.window_s: float | None = None
        self.reset_at = 0.0  # wall clock (time.time) of the current window's end
        self.allowance = 0  # requests this client may still start before reset_at
        self.waits = 0
        # The limiter outlives an event loop (the pilot and the rest of a partition each run in their own
        # `asyncio.run`, and what it learnt must carry over); an asyncio.Lock is bound to the loop it first
        # waited in, so each loop gets its own.
        self._lock: asyncio.Lock | None = None
        self._lock_loop: asyncio.AbstractEventLoop | None = None

    @property
    def learnt(self) -> bool:
        return self.limit is not None

    def observe(self, headers, throttled: bool = False) -> None:
        limit, remaining, reset = (
            headers.get("x-ratelimit-limit"),
            headers.get("x-ratelimit-remaining"),
            headers.get("x-ratelimit-reset"),
        )
        if limit is None or reset is None:
            return
        now = time.time()
        reset_at = _reset_epoch_s(reset, now)
        try:
            limit_n = int(float(limit))
            remaining_n = 0 if throttled else int(float(remaining)) if remaining is not None else limit_n
        except ValueError:
            return
        if reset_at is None or reset_at <= now:
            return
        if self.reset_at and reset_at > self.reset_at + 1e-3:  # a new window: its length is the step between resets
            step = reset_at - self.reset_at
            self.window_s = step if self.window_s is None else min(self.window_s, step)
            self.allowance = remaining_n
        else:
            self.allowance = min(self.allowance, remaining_n) if self.reset_at else remaining_n
        self.limit, self.reset_at = limit_n, reset_at

    async def acquire(self, wanted: Callable[[], bool] = lambda: True) -> float | None:
        """Wait for a request's turn; returns its token (the end of the window it counts in) for `refund`, or None
        once `wanted()` is false: a worker queued for a turn after the last request was taken stops waiting (with
        hundreds of workers queued at one request a second, the run's end otherwise waited a turn for each)."""
        if self.limit is None:
            return 0.0
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock_loop is not loop:
            self._lock, self._lock_loop = asyncio.Lock(), loop
        async with self._lock:  # one waiter at a time keeps the order and the count honest
            while True:
                if not wanted():
                    return None
                now = time.time()
                if now >= self.reset_at:
                    window = self.window_s or max(0.05, self.reset_at - now if self.reset_at > now else 1.0)
                    while self.reset_at <= now:
                        self.reset_at += window
                    self.allowance = self.limit
                if self.allowance > 0:
                    self.allowance -= 1
                    return self.reset_at
                self.waits += 1
                await asyncio.sleep(max(0.0, self.reset_at - now) + 0.005)

    def refund(self, token: float) -> None:
        """A turn taken and not used (nothing was left to send): back to the window, if it is still the current one."""
        if self.limit is not None and token and token == self.reset_at and time.time() < self.reset_at:
            self.allowance = min(self.limit, self.allowance + 1)

    def describe(self) -> dict:
        return {"limit": self.limit, "window_s": self.window_s, "waits": self.waits} if self.learnt else {}
