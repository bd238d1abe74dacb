"""Generate completions for one dataset: the logic behind the `completions` asset.

Every result is appended to the partition's journal the moment it arrives; the Parquet output
is derived from the journal, one row per prompt. Re-running resumes: a prompt with a final
outcome in the journal is never sent again.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import polars as pl

from eagle3_assets.prompts import rendered_prompt_ids
from eagle3_assets.stop_signals import StopSignals
from eagle3_resources.completions.types import (
    FINAL_STATUSES,
    CompletionBackend,
    CompletionRequest,
    CompletionResult,
    SamplingSettings,
)
from eagle3_resources.journal import Journal, read_journal
from eagle3_resources.tokenizer.chat_format import TemplateVersion
from eagle3_resources.tokenizer.kimi import KimiTokenizer

PROGRESS_EVERY_S = 10.0


def build_requests(
    prompts: pl.DataFrame, tokenizer: KimiTokenizer, version: TemplateVersion, thinking: bool, *, send_tools: bool = True
) -> list[CompletionRequest]:
    """Requests in prompt-file order, each with the prompt ids the target will see.

    How tools reach the model is one choice per run, and the prompt is rendered to match it:
    `send_tools=True` sends them in the request's `tools` field and the provider's template
    declares them (a `tool_declare` turn, TypeScript-style for K2.5), so our rendering declares
    them too; `send_tools=False` (what the history's data did) sends no `tools` field, the model
    sees no declaration, and the rendering has none; tool calls then come back as raw markers in
    `content`. Each request records the choice (`tools_in_request`).
    """
    had_tools = prompts["tools_json"].is_not_null().to_list()
    if not send_tools:
        prompts = prompts.with_columns(tools_json=pl.lit(None, pl.String))
    ids = rendered_prompt_ids(prompts, tokenizer, version, thinking)
    out = []
    for (pid, m, t), prompt, had in zip(prompts.select("prompt_id", "messages_json", "tools_json").rows(), ids, had_tools):
        how = "tools_field" if t else "omitted" if had else "none"
        out.append(CompletionRequest(pid, json.loads(m), json.loads(t) if t else None, prompt, tools_in_request=how))
    return out


def final_results(journal_path: Path) -> tuple[dict[str, dict[str, Any]], bool]:
    """The final outcome recorded for each prompt, and whether a torn last record was skipped."""
    contents = read_journal(journal_path)
    done = {}
    for rec in contents.records:
        if rec.get("type") == "result" and rec.get("status") in FINAL_STATUSES:
            done.setdefault(rec["prompt_id"], rec)
    return done, contents.torn_tail


@dataclass(frozen=True)
class Pricing:
    """USD per token, for worst-case admission only; the ledger records what was billed."""

    prompt: float = 0.0
    completion: float = 0.0

    def worst_case(self, req: CompletionRequest, max_tokens: int) -> float:
        return len(req.prompt_ids) * self.prompt + max_tokens * self.completion


@dataclass(frozen=True)
class Caps:
    token_budget: int | None = None  # completion tokens for this partition, all runs together
    run_usd: float | None = None  # dollars this run may spend
    total_usd: float | None = None  # dollars the whole ledger (every partition, every run) may reach
    day_usd: float | None = None  # dollars the ledger may reach today (UTC)
    on_cap: str = "finish"  # in-flight requests when a cap is reached: "finish" or "cancel"


class Feed:
    """Admission control: hands out pending requests while every cap still holds.

    A request is admitted only if what is spent plus the worst-case cost of everything in flight
    (prompt + max_tokens at the model's price) plus its own worst case stays within each dollar
    cap, so a cap is never overshot. A request that does not fit waits for in-flight requests to
    settle; when it does not fit even with nothing in flight, the cap is reached: admission
    stops for good and, with on_cap="cancel", in-flight requests are cancelled.
    """

    def __init__(self, pending: list[CompletionRequest], caps: Caps, pricing: Pricing, max_tokens: int, *,
                 tokens_spent: int = 0, total_spent_usd: float = 0.0, day_spent_usd: float = 0.0):
        self.pending = pending
        self.caps = caps
        self.pricing = pricing
        self.max_tokens = max_tokens
        self.tokens_spent = tokens_spent
        self.run_spent_usd = 0.0
        self.total_spent_usd = total_spent_usd
        self.day_spent_usd = day_spent_usd
        self.inflight: dict[str, float] = {}
        self.admitted = 0
        self.stopped_by: str | None = None
        self._cond: asyncio.Condition | None = None
        self.cancel_inflight: asyncio.Event | None = None

    def _bind_loop(self) -> None:
        if self._cond is None:
            self._cond = asyncio.Condition()
            self.cancel_inflight = asyncio.Event()

    def _check(self, worst: float) -> tuple[str | None, bool]:
        """(the cap this request would break, whether that cap is reached for good).

        Reached: even with nothing more spent in flight the request would not fit. Otherwise it
        only has to wait for in-flight requests to settle at their (lower) actual cost.
        """
        c = self.caps
        if c.token_budget is not None and self.tokens_spent >= c.token_budget:
            return f"token budget {c.token_budget:,} reached ({self.tokens_spent:,} completion tokens)", True
        inflight = sum(self.inflight.values())
        for cap, spent, what in ((c.run_usd, self.run_spent_usd, "run"), (c.total_usd, self.total_spent_usd, "total"),
                                 (c.day_usd, self.day_spent_usd, "daily")):
            if cap is None:
                continue
            reason = f"{what} dollar cap ${cap:.2f} reached (${spent:.4f} spent, next request up to ${worst:.4f})"
            if spent + worst > cap:
                return reason, True
            if spent + inflight + worst > cap:
                return reason, False
        return None, False

    def stop(self, reason: str, cancel_inflight: bool = False) -> None:
        self.stopped_by = self.stopped_by or reason
        self._bind_loop()
        if cancel_inflight:
            self.cancel_inflight.set()
        self._cond_notify()

    def _cond_notify(self) -> None:
        async def notify():
            async with self._cond:
                self._cond.notify_all()

        try:
            asyncio.get_running_loop().create_task(notify())
        except RuntimeError:
            pass

    async def take(self) -> CompletionRequest | None:
        self._bind_loop()
        async with self._cond:
            while True:
                if self.stopped_by or self.admitted >= len(self.pending):
                    return None
                req = self.pending[self.admitted]
                worst = self.pricing.worst_case(req, self.max_tokens)
                blocked, reached = self._check(worst)
                if blocked is None:
                    self.admitted += 1
                    self.inflight[req.prompt_id] = worst
                    return req
                if reached or not self.inflight:
                    self.stopped_by = blocked
                    if self.caps.on_cap == "cancel" and self.inflight:
                        self.cancel_inflight.set()
                    self._cond.notify_all()
                    return None
                await self._cond.wait()

    def settle(self, result: CompletionResult) -> None:
        """Account for a result (called from the event loop, synchronously, on every emit)."""
        self.inflight.pop(result.prompt_id, None)
        self.tokens_spent += result.completion_tokens or 0
        self.run_spent_usd += result.cost_usd or 0.0
        self.total_spent_usd += result.cost_usd or 0.0
        self.day_spent_usd += result.cost_usd or 0.0
        if self._cond is not None:
            self._cond_notify()


@dataclass
class Progress:
    dataset: str
    total: int
    already_done: int
    log: Callable[[str], None]
    started: float = field(default_factory=time.monotonic)
    counts: Counter = field(default_factory=Counter)
    completion_tokens: int = 0
    cost_usd: float = 0.0
    errors: Counter = field(default_factory=Counter)
    last_report: float = field(default_factory=time.monotonic)
    final_ids: set = field(default_factory=set)

    def add(self, result: CompletionResult) -> None:
        self.counts[result.status] += 1
        if result.status in FINAL_STATUSES:
            self.final_ids.add(result.prompt_id)
        self.completion_tokens += result.completion_tokens or 0
        self.cost_usd += result.cost_usd or 0.0
        if result.status in ("failed", "aborted"):
            self.errors[f"{result.error_code or 'unknown'}@{result.provider or '-'}"] += 1
        if time.monotonic() - self.last_report >= PROGRESS_EVERY_S:
            self.report()

    @property
    def finished(self) -> int:
        return sum(n for s, n in self.counts.items() if s in FINAL_STATUSES)

    def line(self) -> str:
        elapsed = max(1e-9, time.monotonic() - self.started)
        rate = self.finished / elapsed
        done = self.already_done + self.finished
        remaining = max(0, self.total - done)
        eta_h = remaining / rate / 3600 if rate > 0 else float("inf")
        errs = self.counts["failed"] + self.counts["aborted"]
        avg = self.completion_tokens / self.finished if self.finished else 0
        return (
            f"{self.dataset} {done}/{self.total} ({errs} err, {self.counts['ok']} ok, {self.counts['truncated']} cut) "
            f"{rate:.1f} req/s avg_comp={avg:.0f}tok tot={self.completion_tokens / 1e6:.2f}M ${self.cost_usd:.2f} "
            f"ETA {eta_h:.1f}h"
        )

    def report(self) -> None:
        self.last_report = time.monotonic()
        self.log(self.line())


@dataclass
class CompletionsRun:
    """What one materialization did."""

    sent: int
    results: Counter
    completion_tokens: int
    cost_usd: float
    duration_s: float
    stopped_by: str | None
    resumed_done: int
    torn_tail_recovered: bool
    errors: Counter
    inflight_found: int = 0
    inflight_cost_usd: float = 0.0
    possible_double_spend: int = 0


def unreconciled_generations(records: list[dict[str, Any]]) -> dict[str, str]:
    """generation id -> prompt id, for generations that were started but produced no final result.

    An attempt cut short (a truncated stream, a reset, a stop, kill -9) may still have been billed
    while its text was lost. Each such generation is looked up once (`orphan` records mark it
    reconciled), so the ledger can match what the provider billed.
    """
    settled = {r.get("generation_id") for r in records if r.get("type") == "orphan"}
    settled |= {r.get("generation_id") for r in records if r.get("type") == "result" and r.get("status") in FINAL_STATUSES}
    out = {}
    for r in records:
        gen, pid = r.get("generation_id"), r.get("prompt_id")
        if gen and pid and gen not in settled and r.get("type") in ("inflight", "result"):
            out[gen] = pid
    return out


@dataclass
class Ledger:
    total_usd: float = 0.0
    day_usd: float = 0.0
    by_run_usd: dict[str, float] = field(default_factory=dict)


def read_ledger(journals: list[Path], now: Optional[float] = None) -> Ledger:
    """What the journals say was billed: in all, today (UTC), and per Dagster run."""
    now = time.time() if now is None else now
    day_start = datetime.fromtimestamp(now, timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0).timestamp()
    ledger = Ledger()
    for path in journals:
        for r in read_journal(path).records:
            if r.get("type") not in ("result", "orphan"):
                continue
            cost = r.get("cost_usd") or 0.0
            ledger.total_usd += cost
            if (r.get("t") or 0) >= day_start:
                ledger.day_usd += cost
            if r.get("run_id"):
                ledger.by_run_usd[r["run_id"]] = ledger.by_run_usd.get(r["run_id"], 0.0) + cost
    return ledger


HALTED = "halted: "  # prefix of `stopped_by` when `halt` stopped the run


def run_completions(
    dataset: str,
    requests: list[CompletionRequest],
    backend: CompletionBackend,
    settings: SamplingSettings,
    journal_path: Path,
    *,
    caps: Caps = Caps(),
    pricing: Pricing = Pricing(),
    total_spent_usd: float = 0.0,
    day_spent_usd: float = 0.0,
    log: Callable[[str], None],
    run_id: str = "",
    halt: Optional[Callable[[], Optional[str]]] = None,
    halt_poll_s: float = 1.0,
) -> CompletionsRun:
    """Send every prompt without a final outcome in the journal; stop at a cap, a stop, or a halt.

    `halt` is polled every `halt_poll_s` (in a thread: it may read a database) and returns a
    reason to stop admitting requests (the credit sensor's hold, the run being cancelled) or None.
    It makes the hold bite on runs that no launcher can terminate, such as in-process ones.
    """
    done, torn = final_results(journal_path)
    pending = [r for r in requests if r.prompt_id not in done]
    if torn:
        log(f"{dataset}: the journal's last record was torn (a crash mid-write); it was skipped and truncated")
    log(f"{dataset}: {len(requests)} prompts, {len(done)} already have a final outcome, {len(pending)} to send via {backend.name}")
    feed = Feed(pending, caps, pricing, settings.max_tokens,
                tokens_spent=sum(r.get("completion_tokens") or 0 for r in done.values()), total_spent_usd=total_spent_usd,
                day_spent_usd=day_spent_usd)
    progress = Progress(dataset, len(requests), len(requests) - len(pending), log)
    run = CompletionsRun(0, progress.counts, 0, 0.0, 0.0, None, len(done), torn, progress.errors)

    with StopSignals() as signals, Journal(journal_path) as journal:
        journal.append({"type": "start", "run_id": run_id, "t": time.time(), "settings": settings.model_dump(),
                        "backend": backend.describe(), "caps": caps.__dict__})

        def emit(result: CompletionResult) -> None:
            journal.append({"type": "result", "run_id": run_id, "t": time.time(), **result.to_record()})
            feed.settle(result)
            progress.add(result)

        def note(record: dict[str, Any]) -> None:
            journal.append({"run_id": run_id, "t": time.time(), **record})

        async def reconcile(when: str) -> None:
            journal.sync()
            orphans = unreconciled_generations(read_journal(journal_path).records)
            lookup = getattr(backend, "lookup_generations", None)
            if not orphans or lookup is None:
                return
            found = await lookup(list(orphans))
            cost = 0.0
            unknown = [pid for gen, pid in orphans.items() if gen not in found]
            for gen, pid in orphans.items():
                info = found.get(gen)
                note({"type": "orphan", "prompt_id": pid, "generation_id": gen, "found": info is not None,
                      "cost_usd": (info or {}).get("cost_usd"), "lookup": info})
                cost += (info or {}).get("cost_usd") or 0.0
            run.inflight_found += len(orphans) - len(unknown)
            run.inflight_cost_usd += cost
            feed.total_spent_usd += cost
            # Prompts whose lost attempt could not be looked up may be paid twice when re-sent.
            run.possible_double_spend += len({p for p in unknown if p not in done and p not in progress.final_ids})
            log(f"{dataset}: {len(orphans)} generation(s) {when} produced no result: {len(orphans) - len(unknown)} looked up "
                f"(${cost:.4f} billed for them), {len(unknown)} not found" + (f"; possible double spend on {run.possible_double_spend} "
                "re-sent prompt(s)" if run.possible_double_spend else ""))

        async def watch_halt() -> None:
            failing = False
            while True:
                await asyncio.sleep(halt_poll_s)
                try:
                    reason = await asyncio.to_thread(halt)
                except Exception as e:  # a busy database must not end the watch: the hold would stop biting
                    if not failing:
                        log(f"{dataset}: could not read the spend hold or the run's status ({type(e).__name__}: {e}); retrying")
                    failing = True
                    continue
                failing = False
                if reason:
                    log(f"{dataset}: halting: {reason}")
                    feed.stop(HALTED + reason, cancel_inflight=caps.on_cap == "cancel")
                    return

        async def main() -> None:
            signals.attach()
            await reconcile("left by an earlier run")
            watcher = asyncio.create_task(watch_halt()) if halt is not None else None
            try:
                await backend.run(feed, settings, emit, note)
            finally:
                if watcher is not None:
                    watcher.cancel()
            # Only after a normal end: a stop must not wait on look-ups (the next run does them).
            await reconcile("cut short in this run")

        started = time.monotonic()
        try:
            asyncio.run(main())
        except BaseException as e:  # a stop (Dagster terminate, SIGTERM, Ctrl-C) or a run-fatal error
            feed.stopped_by = feed.stopped_by or signals.description or f"{type(e).__name__}: {e}"
            raise
        finally:
            progress.report()
            if feed.stopped_by:
                log(f"{dataset}: stopped after {progress.finished} done, ${progress.cost_usd:.2f} spent ({feed.stopped_by})")
            journal.append({"type": "end", "run_id": run_id, "t": time.time(), "stopped_by": feed.stopped_by,
                            "finished": progress.finished, "cost_usd": progress.cost_usd})
    run.sent = feed.admitted
    run.completion_tokens = progress.completion_tokens
    run.cost_usd = progress.cost_usd
    run.duration_s = time.monotonic() - started
    run.stopped_by = feed.stopped_by
    return run


COMPLETION_COLUMNS = {
    "prompt_id": pl.String,
    "dataset": pl.String,
    "status": pl.String,
    "generation_id": pl.String,
    "provider": pl.String,
    "model": pl.String,
    "finish_reason": pl.String,
    "prompt_tokens": pl.Int64,
    "completion_tokens": pl.Int64,
    "reasoning_tokens": pl.Int64,
    "cost_usd": pl.Float64,
    "reasoning": pl.String,
    "content": pl.String,
    "tool_calls_json": pl.String,
    "completion_ids": pl.List(pl.Int32),
    "prompt_ids": pl.List(pl.Int32),
    "attempts": pl.Int64,
    "latency_s": pl.Float64,
    "error": pl.String,
    "error_code": pl.String,
    "messages_json": pl.String,
    "tools_json": pl.String,
    "tools_in_request": pl.String,
}


def completions_frame(dataset: str, requests: list[CompletionRequest], journal_path: Path, prompts: pl.DataFrame) -> pl.DataFrame:
    """One row per prompt, from the journal; prompts without a final outcome are `pending`."""
    done, _ = final_results(journal_path)
    by_id = {r.prompt_id: r for r in requests}
    src = {pid: (m, t) for pid, m, t in prompts.select("prompt_id", "messages_json", "tools_json").rows()}
    rows = []
    for pid, req in by_id.items():
        rec = done.get(pid, {})
        rows.append(
            {
                "prompt_id": pid,
                "dataset": dataset,
                "status": rec.get("status", "pending"),
                "generation_id": rec.get("generation_id"),
                "provider": rec.get("provider"),
                "model": rec.get("model"),
                "finish_reason": rec.get("finish_reason"),
                "prompt_tokens": rec.get("prompt_tokens"),
                "completion_tokens": rec.get("completion_tokens"),
                "reasoning_tokens": rec.get("reasoning_tokens"),
                "cost_usd": rec.get("cost_usd") or 0.0,
                "reasoning": rec.get("reasoning"),
                "content": rec.get("content"),
                "tool_calls_json": json.dumps(rec["tool_calls"], ensure_ascii=False) if rec.get("tool_calls") else None,
                "completion_ids": rec.get("completion_ids"),
                "prompt_ids": req.prompt_ids,
                "attempts": rec.get("attempts", 0),
                "latency_s": rec.get("latency_s"),
                "error": rec.get("error"),
                "error_code": rec.get("error_code"),
                "messages_json": src[pid][0],
                "tools_json": src[pid][1],
                "tools_in_request": req.tools_in_request,
            }
        )
    return pl.DataFrame(rows, schema=COMPLETION_COLUMNS)
