"""Settling what was started: look-ups of unsettled generations, the horizon, and recovery after a crash.

    settle_due            look up unsettled generations (every due one, or given ones until found)
    settle_idle           the credit sensor's tick: recovery of idle datasets, then the due look-ups
    partition_lock        one spending run per dataset (recovery takes it too)
    recover_idle_datasets live attempts of datasets no process is completing, put right from their journals
    recover_dataset       the same for one dataset, inside a ledger transaction

A generation that was started and has no bill stays *unsettled* in the ledger and is looked up
(`/api/v1/generation`) with backoff, by whichever process gets there first: the run that started
it (before retrying its prompt), the next run, the credit sensor, or `eagle3 ledger settle`.
Past the horizon (default 15 min) it expires: the reservation is given back and its prompt may be
sent again; the account-vs-ledger drift check is then the only witness of what it cost.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_assets.money import ledger as L
from eagle3_assets.money.ledger import SpendLedger
from eagle3_assets.money.policy import SpendPolicy
from eagle3_assets.money.writer import LedgerWriter
from eagle3_resources.completions.openrouter_account import GenerationBill, OpenRouterAccount
from eagle3_resources.errors import DatasetBusy
from eagle3_resources.journal import read_journal
from eagle3_resources.storage import DataLayout

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
            f"{len(self.ids)} unsettled generation(s) looked up ({self.looked_up} look-ups): "
            f"{len(self.found_ids)} billed (${self.found_usd:.4f}), {len(self.ids) - len(self.found_ids)} not found yet"
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
    lookups = _Lookups(writer, lookup, time.monotonic() + deadline_s, asyncio.Semaphore(concurrency))
    lookups.report.expired = await writer.call(L.expire, time.time(), horizon_s)
    if attempt_ids is None:
        await lookups.every_due(stop)
    else:
        await lookups.these(attempt_ids, stop)
    return lookups.report


class _Lookups:
    """One `settle_due`: look-ups against one deadline, at most `gate`'s many at once, counted in `report`."""

    BATCH = 512  # due look-ups read from the ledger at a time

    def __init__(self, writer: LedgerWriter, lookup: Lookup, end: float, gate: asyncio.Semaphore):
        self.writer, self.lookup, self.end, self.gate = writer, lookup, end, gate
        self.report = SettleReport()

    async def one(self, attempt_id: str, generation_id: str) -> bool:
        """Look one generation up; settle its attempt if it is billed, else schedule the next look-up. True: found."""
        async with self.gate:
            try:
                bill = await asyncio.wait_for(self.lookup(generation_id), max(0.1, self.end - time.monotonic()))
            except Exception:  # a network error, a timeout: a miss like any other
                bill = None
        self.report.looked_up += 1
        self.report.ids.add(attempt_id)
        if bill is None:
            await self.writer.call(L.looked_up_in_vain, attempt_id, time.time())
            return False
        if await self.writer.call(
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
            self.report.found_ids.add(attempt_id)
            self.report.found_usd += bill.cost_usd
        return True

    async def every_due(self, stop: Callable[[], bool]) -> None:
        """One pass over every look-up the ledger has due, a batch at a time, until none is left or the deadline."""
        while time.monotonic() < self.end and not stop():
            due = await self.writer.call(L.due_lookups, time.time(), self.BATCH)
            if not due:
                break
            await asyncio.gather(*(self.one(a, g) for a, g in due))
            if len(due) < self.BATCH:
                break

    async def these(self, attempt_ids: list[str], stop: Callable[[], bool]) -> None:
        """Look these attempts up again and again, backing off from 0.25 s to 4 s, until each is settled."""
        waiting = list(attempt_ids)
        delay = 0.25
        while waiting and not stop():
            due = await self.writer.call(L.due_lookups, time.time(), len(waiting), waiting)
            if not due:  # settled or expired meanwhile (by another process, perhaps)
                break
            found = await asyncio.gather(*(self.one(a, g) for a, g in due))
            waiting = [a for (a, _), ok in zip(due, found, strict=True) if not ok]
            if not waiting or time.monotonic() + delay > self.end:
                break
            await asyncio.sleep(delay)
            delay = min(delay * 2, 4.0)


def settle_idle(
    ledger: SpendLedger, layout: DataLayout, policy: SpendPolicy, *, budget_s: float, log: Any
) -> dict[str, Any]:
    """What the credit sensor settles each tick: datasets no run is completing get their unfinished attempts put right
    (`recover_idle_datasets`); where the policy has an account, the look-ups that are due run within `budget_s`.
    Returns what it did, for the `spend` observation (empty when nothing). `log`: the sensor's (info, warning)."""
    recovered = recover_idle_datasets(layout, ledger)
    endpoint = policy.account_endpoint()
    out: dict[str, Any] = {"recovered": recovered} if recovered else {}
    if endpoint is None:
        return out

    async def look_up() -> SettleReport:
        with LedgerWriter(ledger, on_error=log.warning) as writer:
            async with OpenRouterAccount(*endpoint) as account:
                return await settle_due(writer, account.generation, deadline_s=budget_s, horizon_s=policy.horizon_s)

    try:
        report = asyncio.run(look_up())
    except Exception as e:  # look-ups are retried next tick; the hold never depends on them
        log.warning(f"looking up unsettled generations failed ({type(e).__name__}: {e})")
        return out
    if report.looked_up or report.expired:
        log.info(report.line())
        out.update(found=len(report.found_ids), found_usd=round(report.found_usd, 6), expired=len(report.expired))
    return out


@contextlib.contextmanager
def partition_lock(journal: Path, run_id: str, *, wait: bool = False) -> Iterator[None]:
    """One spending run per dataset at a time: an exclusive lock next to the journal (fcntl, released by the OS on
    death). Recovery takes it too: a dataset whose lock is free has no process completing it."""
    path = journal.with_name("lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            f.seek(0)
            raise DatasetBusy(
                f"{journal.parent.name} is being completed by run {f.read().strip() or '?'}: "
                "one spending run per dataset at a time"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(run_id)
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def recover_idle_datasets(layout: DataLayout, ledger: SpendLedger, *, free: bool = False) -> dict[str, dict[str, int]]:
    """Live attempts of datasets no process is completing (their lock is free): put right from their journals."""
    out = {}
    for dataset in ledger.read(L.datasets_with_live_attempts):
        journal = layout.completions_journal(dataset)
        try:
            with partition_lock(journal, "credit_sensor: recovering"):
                records = read_journal(journal).records
                with ledger.transaction() as conn:
                    out[dataset] = recover_dataset(conn, dataset, records, free=free, now=time.time())
        except DatasetBusy:
            continue
    return out


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
