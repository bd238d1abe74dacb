"""Settling what was started: look-ups of unsettled generations, the horizon, and recovery after a crash.

A generation that was started and has no bill stays *unsettled* in the ledger and is looked up
(`/api/v1/generation`) with backoff, by whichever process gets there first: the run that started
it (before retrying its prompt), the next run, the credit sensor, or `eagle3 ledger settle`.
Past the horizon (default 15 min) it expires: the reservation is given back and its prompt may be
sent again; the account-vs-ledger drift check is then the only witness of what it cost.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from eagle3_assets.money import ledger as L
from eagle3_assets.money.writer import LedgerWriter
from eagle3_resources.completions.openrouter_account import GenerationBill

Lookup = Callable[[str], Awaitable[GenerationBill | None]]  # generation id -> its bill, None while unknown


@dataclass
class SettleReport:
    looked_up: int = 0  # look-ups made (an id may be looked up several times)
    ids: set[str] = field(default_factory=set)
    found_ids: set[str] = field(default_factory=set)
    found_usd: float = 0.0
    expired: list[tuple[str, str, str]] = field(default_factory=list)

    def line(self) -> str:
        return (
            f"{len(self.ids)} unsettled generation(s) looked up ({self.looked_up} look-ups): {len(self.found_ids)} billed "
            f"(${self.found_usd:.4f}), {len(self.ids) - len(self.found_ids)} not found yet"
            + (f"; {len(self.expired)} expired past the horizon" if self.expired else "")
        )


async def settle_due(
    writer: LedgerWriter,
    lookup: Lookup,
    *,
    deadline_s: float,
    horizon_s: float,
    attempt_ids: list[str] | None = None,
    stop: Callable[[], bool] = lambda: False,
    concurrency: int = 16,
) -> SettleReport:
    """Look up unsettled generations; settle the ones found.

    Without `attempt_ids`: one pass over every look-up that is due (each miss is scheduled again
    with backoff in the ledger), within `deadline_s`. With them: keep looking those up, backing
    off from 0.25 s to 4 s, until all are settled, the deadline passes or `stop()`.
    """
    report = SettleReport()
    report.expired = await writer.call(L.expire, time.time(), horizon_s)
    end = time.monotonic() + deadline_s
    gate = asyncio.Semaphore(concurrency)

    async def one(attempt_id: str, generation_id: str) -> bool:
        async with gate:
            try:
                bill = await asyncio.wait_for(lookup(generation_id), max(0.1, end - time.monotonic()))
            except Exception:  # a network error, a timeout: a miss like any other
                bill = None
        report.looked_up += 1
        report.ids.add(attempt_id)
        if bill is None:
            await writer.call(L.looked_up_in_vain, attempt_id, time.time())
            return False
        if await writer.call(
            L.settle,
            attempt_id,
            cost_usd=bill.cost_usd,
            prompt_tokens=bill.prompt_tokens,
            completion_tokens=bill.completion_tokens,
            source="lookup",
            now=time.time(),
            generation_id=generation_id,
            finish_reason=bill.finish_reason,
            provider=bill.provider,
        ):
            report.found_ids.add(attempt_id)
            report.found_usd += bill.cost_usd
        return True

    if attempt_ids is None:
        while time.monotonic() < end and not stop():
            due = await writer.call(L.due_lookups, time.time(), 512)
            if not due:
                break
            await asyncio.gather(*(one(a, g) for a, g in due))
            if len(due) < 512:
                break
        return report

    waiting = list(attempt_ids)
    delay = 0.25
    while waiting and not stop():
        due = await writer.call(L.due_lookups, time.time(), len(waiting), waiting)
        if not due:  # settled or expired meanwhile (by another process, perhaps)
            break
        found = await asyncio.gather(*(one(a, g) for a, g in due))
        waiting = [a for (a, _), ok in zip(due, found) if not ok]
        if not waiting or time.monotonic() + delay > end:
            break
        await asyncio.sleep(delay)
        delay = min(delay * 2, 4.0)
    return report


def recover_dataset(
    conn: Any, dataset: str, records: list[dict[str, Any]], *, free: bool, now: float
) -> dict[str, int]:
    """Live attempts of a dataset whose process is gone (the caller holds the dataset's lock), put right.

    The journal is written before the ledger (its records reach the OS at once), so it knows what a
    process killed a moment later did not get into the ledger: a result with its bill settles the
    attempt; a generation id makes it unsettled (to be looked up); with neither it is unidentified if
    its send was marked (it may have reached the provider), and released if not: the mark is committed
    before a byte leaves, so an attempt without it was never sent and cannot be billed.
    """
    results: dict[str, dict[str, Any]] = {}
    generations: dict[str, str] = {}
    for r in records:
        attempt_id = r.get("attempt_id")
        if not attempt_id:
            continue
        if r.get("type") == "result" and r.get("billed"):
            results[attempt_id] = r
        if r.get("generation_id"):
            generations[attempt_id] = r["generation_id"]
    counts = {"settled_from_journal": 0, "unsettled": 0, "unidentified": 0, "released": 0}
    for attempt_id, _prompt, generation_id, _reserved, sent_at in L.live_attempts(conn, dataset):
        result = results.get(attempt_id)
        generation_id = generation_id or generations.get(attempt_id)
        if result is not None:
            L.settle(
                conn,
                attempt_id,
                cost_usd=float(result.get("cost_usd") or 0.0),
                prompt_tokens=result.get("prompt_tokens"),
                completion_tokens=result.get("completion_tokens"),
                source="journal",
                now=now,
                generation_id=result.get("generation_id"),
            )
            counts["settled_from_journal"] += 1
        elif free:
            L.release(conn, attempt_id, "its process ended (free backend: nothing to settle)", now)
            counts["released"] += 1
        elif sent_at is None and generation_id is None:
            L.release(conn, attempt_id, "never sent: its process ended before sending it", now)
            counts["released"] += 1
        else:
            state = L.unsettle(
                conn, attempt_id, generation_id, "its process ended before it was settled (killed?)", now
            )
            counts[state or "released"] += 1
    return counts
