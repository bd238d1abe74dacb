"""The requests-per-second limiter at a run's end: workers queued for a turn stop waiting once nothing is left to send.

Found timing the suite: against a provider capping 1 request a second, a 28-prompt partition had every answer after
20 s and then waited 4 more minutes, one turn a second for each of the ~250 workers queued for a turn they no longer
needed (tests/test_cockpit.py's rps-capped run, 283 s)."""

from __future__ import annotations

import asyncio
import time

from eagle3_resources.completions.throttle import RateLimiter


def learnt(limit: int, window_s: float) -> RateLimiter:
    """A limiter that has learnt `limit` requests per `window_s` from a provider's headers, as `observe` leaves it."""
    rate = RateLimiter()
    rate.limit, rate.window_s, rate.reset_at, rate.allowance = limit, window_s, time.time() + window_s, limit
    return rate


def test_queued_workers_take_no_turn_once_nothing_is_left():
    async def main() -> list[float | None]:
        rate = learnt(1, 0.5)
        left = [1]  # one request left to send

        async def worker() -> float | None:
            token = await rate.acquire(lambda: left[0] > 0)
            if token is not None:
                left[0] -= 1  # this worker sent the last one
            return token

        return await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(40))), 30)

    tokens = asyncio.run(main())
    # One turn for the last request; the 39 others gave up instead of waiting 39 more windows for turns nobody needs.
    assert sum(t is not None for t in tokens) == 1


def test_wanted_workers_still_wait_their_turn():
    async def main() -> list[float | None]:
        rate = learnt(1, 0.1)
        return await asyncio.wait_for(asyncio.gather(*(rate.acquire() for _ in range(4))), 30)

    tokens = asyncio.run(main())
    assert all(t is not None for t in tokens) and len(set(tokens)) == 4  # one window each: the cap still holds
