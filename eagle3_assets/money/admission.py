"""Admission: every attempt of every request is reserved in the shared ledger just before it is sent.

`Admission` is the feed a completion backend pulls from (`RequestFeed`). Workers ask for a first
attempt (`take`) or a further one (`retry`) once they may send it: a backend waits for its pacing (a
concurrency slot, the provider's requests per second) before asking, so no reservation holds a cap's
headroom while it waits. One admission task serves all who are waiting with
one ledger transaction, which checks the hold and every cap against settled + reserved spend of
every process and reserves the longest prefix that fits. When a request does not fit:
- if it cannot fit even once everything live has settled, the cap is *reached*: admission stops
  for good (in-flight requests finish, or with on_cap="cancel" are cancelled);
- otherwise it waits for in-flight attempts to settle (this process's, or for up to two minutes
  another's: a reservation left by a process that died is put right by the next run of its
  dataset or by the credit sensor) and tries again.
The hold stops admission the same way (drained or cancelled by `hold_mode`).

The send of each attempt is marked in the ledger (`sending`: committed, so in the OS, before a byte
leaves the process; marks of concurrent sends share the writer's group commits). Each attempt then
ends in the ledger as billed (settled from the response's `usage.cost`), released (nothing was
generated, or never sent), unsettled (a generation id but no bill: looked up later) or
unidentified (sent, cut short before any id). After a kill, recovery (the next run of the dataset,
the credit sensor) releases at once every reservation whose send was never marked: only attempts
that may have reached the provider stay held. A retry after an unsettled attempt waits for its
bill (up to `unsettled_wait_s`), and is not sent at all after an unidentified one, unless
`resend_unsettled`: a prompt is never knowingly paid twice.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from eagle3_assets.money import ledger as L
from eagle3_assets.money.caps import Caps, Pricing
from eagle3_assets.money.settle import Lookup, settle_due
from eagle3_assets.money.writer import LedgerWriter
from eagle3_resources.completions.types import Attempt, CompletionRequest, Refusal

HALTED = "halted: "  # prefix of `stopped_by` when the hold or a terminate stopped the run
BATCH = 256  # attempts reserved per transaction, at most
RECHECK_S = 0.5  # a request that waits for headroom tries again at least this often
OTHERS_WAIT_S = 120.0  # with nothing of ours in flight, how long to wait on other processes' reservations

_Slot = tuple[
    asyncio.Future, CompletionRequest, Attempt | None, bool
]  # a waiting worker: its future, request, previous


@dataclass(frozen=True)
class AdmissionTerms:
    """What every attempt of a run is admitted under: the caps, the worst-case prices and the stop rules."""

    caps: Caps
    pricing: Pricing
    max_tokens: int
    hold_mode: str = "drain"  # the hold's in-flight requests: "drain" (finish) or "cancel"
    resend_unsettled: bool = False  # send a prompt again although an earlier attempt has no bill yet
    unsettled_wait_s: float = 60.0  # how long a retry waits for the bill of the attempt before it
    horizon_s: float = L.DEFAULT_HORIZON_S


class Admission:
    def __init__(
        self,
        pending: list[CompletionRequest],
        *,
        writer: LedgerWriter,
        terms: AdmissionTerms,
        run_id: str,
        dataset: str,
        note: Callable[[dict[str, Any]], None] = lambda record: None,
        lookup: Lookup | None = None,
        owner: str | None = None,
    ):
        self.pending: deque[CompletionRequest] = deque(pending)
        self.writer = writer
        self.terms = terms
        self.run_id = run_id
        self.dataset = dataset
        self.note = note
        self.lookup = lookup
        self.owner = owner or L.process_owner()
        self.admitted = 0  # first attempts
        self.retries = 0
        self.stopped_by: str | None = None
        self.live: dict[str, Attempt] = {}
        self.billed_usd = 0.0
        self.outcomes: dict[str, int] = {}
        self.in_flight_at_stop: int | None = None
        self.billed_at_stop: float | None = None
        self.unsettled_ids: list[str] = []
        self._waiters: deque[tuple[asyncio.Future, Attempt | None, bool]] = deque()
        self._wake: asyncio.Event | None = None
        self._settled: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._waiting_on_others_since: float | None = None
        self.cancel_inflight: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._bind_if_running()

    # -- the loop ------------------------------------------------------------------------------

    def _bind(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._wake, self._settled, self.cancel_inflight = asyncio.Event(), asyncio.Event(), asyncio.Event()
            self._task = self._loop.create_task(self._serve())

    async def close(self) -> None:
        """Stop the admission task; attempts still live are ended as unbilled (a safety net, normally none)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for attempt in list(self.live.values()):
            self.unbilled(attempt, generated=None if attempt.sent else False, why="the run ended with it in flight")

    async def _ask(self, previous: Attempt | None, wait: bool = True) -> Attempt | None:
        self._bind()
        if self.stopped_by:
            return None
        assert self._loop is not None and self._wake is not None  # bound just above
        future = self._loop.create_future()
        self._waiters.append((future, previous, wait))
        self._wake.set()
        return await future

    async def take(self, wait: bool = True) -> Attempt | None:
        """The next request's first attempt, admitted; None when there is none or admission has stopped.

        wait=False: None also when it does not fit *now* (a backend filling a batch must not wait on
        headroom that only its own unsent batch would give back).
        """
        return await self._ask(None, wait)

    @property
    def remaining(self) -> int:
        """Requests whose first attempt has not been admitted yet (a backend need not pace for more than these)."""
        return len(self.pending)

    async def retry(
        self, previous: Attempt, why: str, pace: Callable[[], Awaitable[Any]] | None = None
    ) -> Attempt | Refusal:
        """The next attempt of the request `previous` belongs to (which must have ended).

        `pace`: the backend's wait before a send, awaited once the retry is allowed and before it is reserved."""
        if previous.outcome == "unsettled" and not self.terms.resend_unsettled:
            found = await self._wait_for_bill(previous)
            if not found:
                return Refusal(
                    "deferred",
                    f"{why}; generation {previous.generation_id} was not billed within "
                    f"{self.terms.unsettled_wait_s:.0f} s, so the prompt is not sent again until it is",
                )
        elif previous.outcome == "unidentified" and not self.terms.resend_unsettled:
            return Refusal(
                "deferred",
                f"{why}; the attempt was cut short before its generation id arrived: it cannot be "
                "looked up, so the prompt is not sent again before the horizon passes",
            )
        if pace is not None:
            await pace()
        nxt = await self._ask(previous)
        if nxt is None:
            return Refusal("aborted", f"{why}; not retried: {self.stopped_by}")
        self.retries += 1
        return nxt

    async def _wait_for_bill(self, previous: Attempt) -> bool:
        if self.lookup is None:
            return False
        report = await settle_due(
            self.writer,
            self.lookup,
            deadline_s=self.terms.unsettled_wait_s,
            horizon_s=self.terms.horizon_s,
            attempt_ids=[previous.attempt_id],
            stop=lambda: self.stopped_by is not None,
        )
        if previous.attempt_id in report.found_ids:
            previous.outcome = "settled"
            self.billed_usd += report.found_usd
            return True
        return False

    async def _serve(self) -> None:
        assert self._wake is not None  # _bind made it before starting this task
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._waiters:
                if self.stopped_by:
                    self._refuse_all()
                    break
                if not await self._round():
                    break

    def _refuse_all(self) -> None:
        while self._waiters:
            future, _, _ = self._waiters.popleft()
            if not future.done():
                future.set_result(None)

    async def _round(self) -> bool:
        """One reservation transaction for everyone waiting. False: wait for a wake-up before the next."""
        slots, wants = self._collect()
        if not slots:
            return True
        ids, block = await self._reserve(slots, wants)
        self._hand_out(slots, ids, wants)
        self._requeue(slots[len(ids) :], block)
        if ids:
            self._waiting_on_others_since = None
        if block is not None:
            await self._blocked(block)
        return True

    def _collect(self) -> tuple[list[_Slot], list[L.Want]]:
        """Up to BATCH waiting workers and what each wants reserved (a first attempt is the next pending request)."""
        slots: list[_Slot] = []
        wants: list[L.Want] = []
        taken_firsts = 0
        while self._waiters and len(slots) < BATCH:
            future, previous, wait = self._waiters.popleft()
            if future.done():  # its worker was cancelled while waiting
                continue
            if previous is None:
                if taken_firsts >= len(self.pending):
                    future.set_result(None)  # nothing left to send
                    continue
                req, number = self.pending[taken_firsts], 1
                taken_firsts += 1
            else:
                req, number = previous.request, previous.number + 1
            slots.append((future, req, previous, wait))
            worst = self.terms.pricing.worst_case(len(req.prompt_ids), self.terms.max_tokens)
            wants.append(L.Want(req.prompt_id, number, worst, self.terms.max_tokens))
        return slots, wants

    async def _reserve(self, slots: list[_Slot], wants: list[L.Want]) -> tuple[list[str], L.Block | None]:
        """The ledger transaction: the longest prefix of `wants` that fits every cap, and what blocked the rest."""
        reserving = asyncio.ensure_future(
            self.writer.call(
                L.reserve,
                wants,
                run_id=self.run_id,
                dataset=self.dataset,
                owner=self.owner,
                caps=self.terms.caps,
                now=time.time(),
            )
        )
        try:
            return await asyncio.shield(reserving)
        except asyncio.CancelledError:  # the run is ending: what was reserved for nobody is given back, never left live
            ids, _ = await reserving
            for attempt_id in ids:
                self.writer.post(L.release, attempt_id, "not sent: the run ended while it was reserved", time.time())
            for future, *_ in slots:
                if not future.done():
                    future.cancel()
            raise

    def _hand_out(self, slots: list[_Slot], ids: list[str], wants: list[L.Want]) -> None:
        """Each reserved attempt to its worker; one whose worker was cancelled meanwhile is released, never sent."""
        returned: list[CompletionRequest] = []
        for (future, req, previous, _), attempt_id, want in zip(slots, ids, wants, strict=False):
            if previous is None:
                self.pending.popleft()
            attempt = Attempt(req, attempt_id, want.number)
            if future.done():  # cancelled meanwhile: never sent
                self.writer.post(L.release, attempt_id, "not sent: its worker was cancelled", time.time())
                if previous is None:
                    returned.append(req)
                continue
            self.live[attempt_id] = attempt
            if previous is None:
                self.admitted += 1
            future.set_result(attempt)
        self.pending.extendleft(reversed(returned))

    def _requeue(self, refused: list[_Slot], block: L.Block | None) -> None:
        """Workers that did not fit go back to the front of the queue, in order (those who will not wait are told)."""
        if block is not None and not (block.hold or block.reached or not self.live):
            for future, _, _, wait in refused:  # it may fit later: those who will not wait are told now
                if not wait and not future.done():
                    future.set_result(None)
            refused = [slot for slot in refused if slot[3]]
        for future, _, previous, wait in reversed(refused):
            self._waiters.appendleft((future, previous, wait))

    async def _blocked(self, block: L.Block) -> None:
        """A cap or the hold stood in the way: stop for good, or wait for something in flight to settle."""
        if block.hold:
            self.stop(HALTED + block.reason, cancel_inflight=self.terms.hold_mode == "cancel")
            return
        if not self.live:  # only other processes' reservations stand in the way: they settle, or go stale
            since = self._waiting_on_others_since = self._waiting_on_others_since or time.monotonic()
            if time.monotonic() - since > OTHERS_WAIT_S:
                block = L.Block(
                    f"{block.reason}; other processes' reservations did not settle within {OTHERS_WAIT_S:.0f} s",
                    reached=True,
                )
        if block.reached:
            self.stop(block.reason, cancel_inflight=self.terms.caps.on_cap == "cancel")
            return
        assert self._settled is not None
        self._settled.clear()  # wait for one of ours to settle (or for another process's, polled)
        try:
            await asyncio.wait_for(self._settled.wait(), RECHECK_S)
        except TimeoutError:
            pass

    def stop(self, reason: str, cancel_inflight: bool = False) -> None:
        """No new attempt is admitted from now on; with cancel_inflight, live ones are cancelled."""
        if self.stopped_by is None:
            self.stopped_by = reason
            self.in_flight_at_stop, self.billed_at_stop = len(self.live), self.billed_usd
        self._bind_if_running()
        if cancel_inflight and self.cancel_inflight is not None:
            self.cancel_inflight.set()
        if self._wake is not None:
            self._wake.set()

    def _bind_if_running(self) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self._bind()

    # -- the money side of each attempt ---------------------------------------------------------

    async def sending(self, attempt: Attempt) -> None:
        """Mark the attempt sent, committed before the caller sends a byte; raises if the ledger cannot record it
        (the attempt must then not be sent). Awaits one group commit of the writer, shared by concurrent sends."""
        await self.writer.call(L.sending, attempt.attempt_id, time.time())
        attempt.sent = True

    def started(self, attempt: Attempt, generation_id: str) -> None:
        if attempt.generation_id == generation_id:
            return
        attempt.generation_id = generation_id
        self.note(
            {
                "type": "inflight",
                "prompt_id": attempt.request.prompt_id,
                "generation_id": generation_id,
                "attempt_id": attempt.attempt_id,
                "attempt": attempt.number,
            }
        )
        self.writer.post(L.opened, attempt.attempt_id, generation_id)

    def billed(
        self, attempt: Attempt, *, cost_usd: float, prompt_tokens: int | None, completion_tokens: int | None
    ) -> None:
        if not self._end(attempt, "settled"):
            return
        self.billed_usd += cost_usd
        self.writer.post(
            L.settle,
            attempt.attempt_id,
            cost_usd=cost_usd,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            source="response",
            now=time.time(),
            generation_id=attempt.generation_id,
            on_commit=self._on_commit,
        )

    def unbilled(self, attempt: Attempt, *, generated: bool | None, why: str) -> None:
        if generated is False or not attempt.sent or self.terms.pricing.free:
            if self._end(attempt, "released"):
                self.writer.post(L.release, attempt.attempt_id, why, time.time(), on_commit=self._on_commit)
            return
        state = "unsettled" if attempt.generation_id else "unidentified"
        if self._end(attempt, state):
            if state == "unsettled":
                self.unsettled_ids.append(attempt.attempt_id)
            self.writer.post(
                L.unsettle, attempt.attempt_id, attempt.generation_id, why, time.time(), on_commit=self._on_commit
            )

    def _end(self, attempt: Attempt, outcome: str) -> bool:
        if attempt.outcome is not None:
            return False
        attempt.outcome = outcome
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        self.live.pop(attempt.attempt_id, None)
        return True

    def _on_commit(self, ok: bool, value: Any) -> None:
        loop, settled = self._loop, self._settled
        if loop is not None and settled is not None:
            try:
                loop.call_soon_threadsafe(settled.set)
            except RuntimeError:
                pass
