"""Adaptive concurrency: back off when the API says it is overloaded, recover when it is not.

A gate in front of every HTTP attempt. 429, 503 and the in-flight-budget 402 shrink the number of
attempts allowed in flight (x0.8, at most once per `cooldown_s`, never below `floor`); every
`recover_after` successes grow it back by one, up to the configured concurrency. The request that
was refused waits its own Retry-After; the others carry on, at most slightly fewer at a time.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager


class AdaptiveLimiter:
    def __init__(self, limit: int, *, floor: int = 4, decrease: float = 0.8, recover_after: int = 8, cooldown_s: float = 1.0):
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
        async with self._cond:
            await self._cond.wait_for(lambda: self.active < self.limit)
            self.active += 1
        try:
            yield
        finally:
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
