"""Generate completions for one dataset: the logic behind the `completions` asset.

Every result is appended to the partition's journal the moment it arrives; the Parquet output
is derived from the journal, one row per prompt. Re-running resumes: a prompt with a final
outcome in the journal is never sent again. Money is the spend package's: every attempt is
admitted and settled in the ledger shared by every process (eagle3_assets/money/).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import polars as pl

from eagle3_assets.common.stop_signals import StopSignals
from eagle3_assets.money import ledger as L
from eagle3_assets.money.admission import HALTED, Admission, AdmissionTerms
from eagle3_assets.money.caps import Caps, Pricing
from eagle3_assets.money.ledger import DEFAULT_HORIZON_S, SpendLedger
from eagle3_assets.money.settle import Lookup, recover_dataset, settle_due
from eagle3_assets.money.writer import LedgerWriter
from eagle3_assets.stages.raw_prompts.prompts import rendered_prompt_ids
from eagle3_resources.completions.types import (
    FINAL_STATUSES,
    RETRY_LATER_STATUSES,
    CompletionBackend,
    CompletionRequest,
    CompletionResult,
    SamplingSettings,
)
from eagle3_resources.journal import Journal, JournalContents, read_journal
from eagle3_resources.tokenizer.chat_format import TemplateVersion
from eagle3_resources.tokenizer.kimi import KimiTokenizer

if TYPE_CHECKING:
    from polars._typing import PolarsDataType

PROGRESS_EVERY_S = 10.0


def build_requests(
    prompts: pl.DataFrame,
    tokenizer: KimiTokenizer,
    version: TemplateVersion,
    thinking: bool,
    *,
    send_tools: bool = True,
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
    for (pid, m, t), prompt, had in zip(
        prompts.select("prompt_id", "messages_json", "tools_json").rows(), ids, had_tools, strict=True
    ):
        how = "tools_field" if t else "omitted" if had else "none"
        out.append(CompletionRequest(pid, json.loads(m), json.loads(t) if t else None, prompt, tools_in_request=how))
    return out


def final_results(
    journal_path: Path, contents: JournalContents | None = None
) -> tuple[dict[str, dict[str, Any]], bool]:
    """The final outcome recorded for each prompt, and whether a torn last record was skipped."""
    contents = contents if contents is not None else read_journal(journal_path)
    done: dict[str, dict[str, Any]] = {}
    for rec in contents.records:
        if rec.get("type") == "result" and rec.get("status") in FINAL_STATUSES:
            done.setdefault(rec["prompt_id"], rec)
    return done, contents.torn_tail


@dataclass
class Progress:
    dataset: str
    total: int
    already_done: int
    log: Callable[[str], None]
    spent: Callable[[], float] = lambda: 0.0  # dollars billed so far, every attempt (the ledger's view)
    started: float = field(default_factory=time.monotonic)
    counts: Counter = field(default_factory=Counter)
    completion_tokens: int = 0
    errors: Counter = field(default_factory=Counter)
    last_report: float = field(default_factory=time.monotonic)
    on_report: Callable[[dict[str, Any]], None] | None = None  # the figures of each report (the UI's live progress)

    def add(self, result: CompletionResult) -> None:
        self.counts[result.status] += 1
        self.completion_tokens += result.completion_tokens or 0
        if result.status in ("failed", *RETRY_LATER_STATUSES):
            self.errors[f"{result.error_code or 'unknown'}@{result.provider or '-'}"] += 1
        if time.monotonic() - self.last_report >= PROGRESS_EVERY_S:
            self.report()

    @property
    def finished(self) -> int:
        return sum(n for s, n in self.counts.items() if s in FINAL_STATUSES)

    def figures(self) -> dict[str, Any]:
        """Where the dataset stands: done (earlier runs' and this run's) of total, rate, tokens, dollars, ETA."""
        elapsed = max(1e-9, time.monotonic() - self.started)
        rate = self.finished / elapsed
        done = self.already_done + self.finished
        remaining = max(0, self.total - done)
        return {
            "done": done,
            "total": self.total,
            "done_before": self.already_done,
            "this_run": self.finished,
            "ok": self.counts["ok"],
            "truncated": self.counts["truncated"],
            "errors": self.counts["failed"] + sum(self.counts[s] for s in RETRY_LATER_STATUSES),
            "requests_per_s": round(rate, 3),
            "completion_tokens": self.completion_tokens,
            "billed_usd": round(self.spent(), 6),
            "eta_s": round(remaining / rate, 1) if rate > 0 else None,
            "elapsed_s": round(elapsed, 1),
        }

    def line(self) -> str:
        f = self.figures()
        avg = self.completion_tokens / self.finished if self.finished else 0
        eta = f"{f['eta_s'] / 3600:.1f}h" if f["eta_s"] is not None else "-"
        return (
            f"{self.dataset} {f['done']}/{f['total']} done ({f['done_before']} before this run; "
            f"this run: {f['ok']} ok, {f['errors']} err, {f['truncated']} cut) {f['requests_per_s']:.1f} req/s "
            f"avg_comp={avg:.0f}tok "
            f"tot={self.completion_tokens / 1e6:.2f}M ${f['billed_usd']:.2f} ETA {eta}"
        )

    def report(self) -> None:
        self.last_report = time.monotonic()
        self.log(self.line())
        if self.on_report is not None:
            self.on_report(self.figures())


async def report_while_waiting(progress: Progress) -> None:
    """A report every PROGRESS_EVERY_S even while no answer arrives (a slow provider, a rate cap): the rate and
    ETA keep moving on the asset's page instead of freezing at the last arrival."""
    while True:
        await asyncio.sleep(max(PROGRESS_EVERY_S, 0.5))
        if time.monotonic() - progress.last_report >= PROGRESS_EVERY_S:
            progress.report()


@dataclass
class RunReport:
    """What one run of a partition did (`CompletionsRun.execute` returns it)."""

    sent: int = 0
    results: Counter = field(default_factory=Counter)
    completion_tokens: int = 0
    cost_usd: float = 0.0
    duration_s: float = 0.0
    stopped_by: str | None = None
    resumed_done: int = 0
    torn_tail_recovered: bool = False
    errors: Counter = field(default_factory=Counter)
    retries: int = 0
    blocked: int = 0  # prompts not sent: an earlier attempt's bill is outstanding
    attempt_outcomes: dict[str, int] = field(default_factory=dict)  # settled / released / unsettled / unidentified
    in_flight_at_stop: int | None = None
    after_stop_usd: float = 0.0  # billed for requests in flight at the stop (drained: kept)
    settled_late_usd: float = 0.0  # bills of earlier attempts found by look-ups during this run
    recovered_answers: int = 0  # billed answers lost before the journal (a kill), fetched from the provider's store
    backend: dict[str, Any] = field(default_factory=dict)  # the backend's description as the run finished

    def summary(self, dataset: str) -> dict[str, Any]:
        return {
            "dataset": dataset,
            "sent": self.sent,
            "retries": self.retries,
            "stopped_by": self.stopped_by,
            "resumed_done": self.resumed_done,
            "blocked_unsettled": self.blocked,
            "duration_s": round(self.duration_s, 1),
            "results": dict(self.results),
            "errors": dict(self.errors),
            "billed_usd": round(self.cost_usd, 6),
            "attempts": self.attempt_outcomes,
            "in_flight_at_stop": self.in_flight_at_stop,
            "billed_after_stop_usd": round(self.after_stop_usd, 6),
            "settled_late_usd": round(self.settled_late_usd, 6),
            "recovered_answers": self.recovered_answers,
        }

    def take_figures(self, feed: Admission, progress: Progress) -> None:
        """The admission's and the progress's figures, once the run has ended."""
        self.sent, self.stopped_by, self.retries = feed.admitted, feed.stopped_by, feed.retries
        self.cost_usd, self.attempt_outcomes = feed.billed_usd, dict(feed.outcomes)
        self.in_flight_at_stop = feed.in_flight_at_stop
        self.after_stop_usd = feed.billed_usd - (feed.billed_at_stop or feed.billed_usd)
        self.results, self.errors, self.completion_tokens = progress.counts, progress.errors, progress.completion_tokens

    def stop_line(self, dataset: str, finished: int) -> str:
        cut = self.attempt_outcomes.get("unsettled", 0) + self.attempt_outcomes.get("unidentified", 0)
        return f"{dataset}: stopped after {finished} done, ${self.cost_usd:.4f} billed ({self.stopped_by})" + (
            f"; {self.in_flight_at_stop} request(s) were in flight at the stop: ${self.after_stop_usd:.4f} billed for "
            f"them since (kept), {cut} cut short (unsettled: looked up, prompts sent again)"
            if self.in_flight_at_stop
            else ""
        )


@dataclass(frozen=True)
class RunOptions:
    """How one run spends and stops: the keywords of `run_completions`, one frozen object.

    `halt` is polled every `halt_poll_s` (in a thread: it may read a database) and returns a reason to stop
    admitting (the run being cancelled from the UI) or None; it makes a terminate bite on runs no launcher can
    signal, such as in-process ones. `hold_mode` / `on_terminate`: "drain" lets requests in flight finish (kept),
    "cancel" cancels them. A prompt whose earlier attempt is still unsettled (started, no bill yet) is not sent
    unless `resend_unsettled`. `on_progress` gets `Progress.figures()` at the start, every PROGRESS_EVERY_S and at
    the end.
    """

    caps: Caps = Caps()
    pricing: Pricing = Pricing()
    run_id: str = ""
    halt: Callable[[], str | None] | None = None
    halt_poll_s: float = 1.0
    hold_mode: str = "drain"
    on_terminate: str = "cancel"
    resend_unsettled: bool = False
    unsettled_wait_s: float = 60.0
    horizon_s: float = DEFAULT_HORIZON_S
    settle_window_s: float = 20.0
    on_progress: Callable[[dict[str, Any]], None] | None = None

    def terms(self, max_tokens: int) -> AdmissionTerms:
        return AdmissionTerms(
            caps=self.caps,
            pricing=self.pricing,
            max_tokens=max_tokens,
            hold_mode=self.hold_mode,
            resend_unsettled=self.resend_unsettled,
            unsettled_wait_s=self.unsettled_wait_s,
            horizon_s=self.horizon_s,
        )


def run_completions(
    dataset: str,
    requests: list[CompletionRequest],
    backend: CompletionBackend,
    settings: SamplingSettings,
    journal_path: Path,
    *,
    ledger: SpendLedger,
    log: Callable[[str], None],
    **options: Any,
) -> RunReport:
    """Send every prompt without a final outcome in the journal; stop at a cap, the hold, a stop, or a halt.

    `options` are `RunOptions`' fields. Every attempt is admitted by the shared spend ledger (caps across every
    process, the hold) and settled there (`CompletionsRun`).
    """
    run = CompletionsRun(dataset, requests, backend, settings, journal_path, ledger, log, RunOptions(**options))
    return run.execute()


class CompletionsRun:
    """One run of a partition's completions, in phases read top to bottom (`execute`):

    settle before (attempts an earlier process left unfinished, bills found late, answers billed but lost),
    send (admission under the caps, the backend, the watch on the hold and the run's status), settle after
    (the bills this run left unsettled), finish (the figures, the journal's end record).
    """

    signals: StopSignals  # while it executes
    journal: Journal

    def __init__(  # the work (dataset, requests, journal), the means (backend, settings, ledger), log and options
        self,
        dataset: str,
        requests: list[CompletionRequest],
        backend: CompletionBackend,
        settings: SamplingSettings,
        journal_path: Path,
        ledger: SpendLedger,
        log: Callable[[str], None],
        options: RunOptions,
    ):
        self.dataset, self.requests, self.backend, self.settings = dataset, requests, backend, settings
        self.journal_path, self.ledger, self.log, self.options = journal_path, ledger, log, options
        self.run_id = options.run_id or f"local-{uuid.uuid4().hex[:12]}"
        self.contents = read_journal(journal_path)
        self.done, torn = final_results(journal_path, self.contents)
        self.report = RunReport(resumed_done=len(self.done), torn_tail_recovered=torn)
        self.writer = LedgerWriter(ledger, on_error=log)
        self.account_source: Callable[[], Any] | None = getattr(backend, "account", None)
        self.lookup: Lookup | None = None
        self.feed: Admission | None = None
        self.progress: Progress | None = None

    def execute(self) -> RunReport:
        if self.report.torn_tail_recovered:
            self.log(
                f"{self.dataset}: the journal's last record was torn (a crash mid-write); it was skipped and truncated"
            )
        started = time.monotonic()
        with StopSignals() as self.signals, Journal(self.journal_path) as self.journal, self.writer:
            self.journal.append(self._start_record())
            try:
                asyncio.run(self._phases())
            except BaseException as e:  # a stop (Dagster terminate, SIGTERM, Ctrl-C) or a run-fatal error
                why = self.signals.description or f"{type(e).__name__}: {e}"
                if self.feed is not None:
                    self.feed.stopped_by = self.feed.stopped_by or why
                else:
                    self.report.stopped_by = why
                raise
            finally:
                self.finish(started)
        return self.report

    async def _phases(self) -> None:
        self.signals.attach()
        await self.recover_unfinished()
        account = self.account_source() if self.account_source is not None else None
        async with account or contextlib.nullcontext():
            if account is not None:
                self.lookup = account.generation
                await self.settle_before(account)
            await self.send()
            await self.settle_after()

    def note(self, record: dict[str, Any]) -> None:
        self.journal.stamped(self.run_id)(record)

    def _start_record(self) -> dict[str, Any]:
        return {
            "type": "start",
            "run_id": self.run_id,
            "t": time.time(),
            "settings": self.settings.model_dump(),
            "backend": self.backend.describe(),
            "caps": self.options.caps.__dict__,
            "pricing": self.options.pricing.__dict__,
        }

    # -- settle before ---------------------------------------------------------------------------

    async def recover_unfinished(self) -> None:
        """Attempts an earlier process of this dataset left live are put right from the journal."""
        recovered = await self.writer.call(
            recover_dataset, self.dataset, self.contents.records, free=self.options.pricing.free, now=time.time()
        )
        if any(recovered.values()):
            self.log(f"{self.dataset}: attempts an earlier process left unfinished: {recovered}")

    async def settle_before(self, account: Any) -> None:
        """This dataset's unsettled bills first (they block prompts), then any due; then answers billed but lost."""
        assert self.lookup is not None
        window, horizon = self.options.settle_window_s, self.options.horizon_s
        mine = await self.writer.call(L.unsettled_ids, self.dataset)
        report = (
            await settle_due(self.writer, self.lookup, deadline_s=window, horizon_s=horizon, attempt_ids=mine)
            if mine
            else None
        )
        sweep = await settle_due(self.writer, self.lookup, deadline_s=window / 4, horizon_s=horizon)
        for r in (report, sweep):
            if r is not None and (r.looked_up or r.expired):
                self.log(f"{self.dataset}: before sending: {r.line()}")
                self.report.settled_late_usd += r.found_usd
        self.report.recovered_answers = await self.recover_lost_answers(account)

    async def recover_lost_answers(self, account: Any) -> int:
        """Answers that were generated and billed but never reached the journal (a kill -9, a cut stream whose provider
        finished anyway): fetched from OpenRouter's stored content, where the account keeps it, so the prompt is not
        paid for twice. Returns how many were recovered; the others' prompts are sent again (and say so)."""
        lost = await self.writer.call(L.lost_answers, self.dataset)
        if not lost:
            return 0
        recovered, unavailable, already = [], [], []
        for row in lost:
            if row["prompt_id"] in self.done:
                already.append(row["attempt_id"])
                continue
            content = await account.generation_content(row["generation_id"])
            if content is None:
                unavailable.append(row["attempt_id"])
                continue
            result = recovered_result(row, *content)
            self.note({"type": "result", **result.to_record()})
            self.done[row["prompt_id"]] = result.to_record()
            recovered.append(row["attempt_id"])
        await self.writer.call(L.mark_recovered, recovered + already, True)
        await self.writer.call(L.mark_recovered, unavailable, False)
        self.log(
            f"{self.dataset}: {len(recovered) + len(unavailable)} answer(s) were billed but never received: "
            f"{len(recovered)} recovered from OpenRouter's stored content"
            + (
                f"; {len(unavailable)} not stored (the account's input/output logging is off?): "
                "their prompts are sent again and paid twice"
                if unavailable
                else ""
            )
        )
        return len(recovered)

    # -- send ------------------------------------------------------------------------------------

    async def send(self) -> None:
        """Every prompt without a final outcome (nor, unless resend_unsettled, an unsettled bill), through admission."""
        feed = self.feed = await self._admission()
        progress = self.progress = self._progress(feed)
        if self.options.on_progress is not None:
            self.options.on_progress(progress.figures())
        self.signals.on_first = (
            (lambda: feed.stop(HALTED + f"{self.signals.description}: draining", cancel_inflight=False))
            if self.options.on_terminate == "drain"
            else None
        )

        def emit(result: CompletionResult) -> None:
            self.journal.append({"type": "result", "run_id": self.run_id, "t": time.time(), **result.to_record()})
            progress.add(result)

        watcher = asyncio.create_task(self.watch())
        ticker = asyncio.create_task(report_while_waiting(progress))
        try:
            await self.backend.run(feed, self.settings, emit)
        finally:
            watcher.cancel()
            ticker.cancel()
            await feed.close()
            await self.writer.flush()

    async def _admission(self) -> Admission:
        blocked = await self.writer.call(L.blocked_prompts, self.dataset)
        resend, done = self.options.resend_unsettled, self.done
        pending = [r for r in self.requests if r.prompt_id not in done and (resend or r.prompt_id not in blocked)]
        self.report.blocked = sum(1 for r in self.requests if r.prompt_id not in done and r.prompt_id in blocked)
        self.log(
            f"{self.dataset}: {len(self.requests)} prompts, {len(done)} already have a final outcome, {len(pending)} "
            f"to send via {self.backend.name}"
            + (
                f"; {self.report.blocked} wait for an earlier attempt's bill (unsettled: not sent twice)"
                if self.report.blocked and not resend
                else ""
            )
        )
        return Admission(
            pending,
            writer=self.writer,
            terms=self.options.terms(self.settings.max_tokens),
            run_id=self.run_id,
            dataset=self.dataset,
            note=self.journal.stamped(self.run_id),
            lookup=self.lookup,
        )

    def _progress(self, feed: Admission) -> Progress:
        return Progress(
            self.dataset,
            len(self.requests),
            sum(1 for r in self.requests if r.prompt_id in self.done),
            self.log,
            spent=lambda: feed.billed_usd,
            on_report=self.options.on_progress,
        )

    async def watch(self) -> None:
        """Every `halt_poll_s`: the hold (so that cancel mode cancels in-flight requests at once) and the run's own
        status (`halt`)."""
        assert self.feed is not None
        feed, halt, options = self.feed, self.options.halt, self.options
        failing = False
        while True:
            await asyncio.sleep(options.halt_poll_s)
            try:
                hold = await self.writer.call(L.get_hold)
                reason = await asyncio.to_thread(halt) if halt is not None else None
            except Exception as e:  # a busy database must not end the watch: the stop would stop biting
                if not failing:
                    self.log(
                        f"{self.dataset}: could not read the spend hold or the run's status ({type(e).__name__}: {e}); "
                        "retrying"
                    )
                failing = True
                continue
            failing = False
            if hold:
                why = "; ".join(hold["reasons"])
                self.log(f"{self.dataset}: halting: spending hold: {why} (in-flight requests: {options.hold_mode})")
                feed.stop(HALTED + "spending hold: " + why, cancel_inflight=options.hold_mode == "cancel")
                return
            if reason:
                self.log(f"{self.dataset}: halting: {reason} (in-flight requests: {options.on_terminate})")
                feed.stop(HALTED + reason, cancel_inflight=options.on_terminate == "cancel")
                return

    # -- settle after ----------------------------------------------------------------------------

    async def settle_after(self) -> None:
        """The bills this run left unsettled, looked up now. Not after a stop (halt, hold): it must take effect at
        once; the next run or the sensor looks them up."""
        feed = self.feed
        assert feed is not None
        if self.lookup is None or not feed.unsettled_ids or (feed.stopped_by or "").startswith(HALTED):
            return
        report = await settle_due(
            self.writer,
            self.lookup,
            deadline_s=self.options.settle_window_s,
            horizon_s=self.options.horizon_s,
            attempt_ids=list(feed.unsettled_ids),
        )
        self.report.settled_late_usd += report.found_usd
        feed.billed_usd += report.found_usd
        if report.looked_up:
            self.log(f"{self.dataset}: after the run: {report.line()}")

    # -- finish ----------------------------------------------------------------------------------

    def finish(self, started: float) -> None:
        """The figures (also after a stop or an error) and the journal's end record."""
        feed, progress, report = self.feed, self.progress, self.report
        if progress is not None:
            progress.report()
        figs = self.ledger.figures()
        if feed is not None and progress is not None:
            report.take_figures(feed, progress)
        report.duration_s = time.monotonic() - started
        report.backend = self.backend.describe()
        finished = progress.finished if progress else 0
        if report.stopped_by:
            self.log(report.stop_line(self.dataset, finished))
        self.journal.append(
            {
                "type": "end",
                "run_id": self.run_id,
                "t": time.time(),
                "stopped_by": report.stopped_by,
                "finished": finished,
                "cost_usd": report.cost_usd,
                "attempts": report.attempt_outcomes,
                "ledger": figs.as_dict(),
            }
        )


FINISHED = {"stop": "ok", "length": "truncated", "content_filter": "filtered"}


def recovered_result(row: dict[str, Any], reasoning: str, text: str) -> CompletionResult:
    """A billed answer fetched from the provider's stored content, as the result the journal would have held."""
    return CompletionResult(
        row["prompt_id"],
        FINISHED[row["finish_reason"]],
        row["finish_reason"],
        reasoning=reasoning,
        content=text,
        prompt_tokens=row["prompt_tokens"],
        completion_tokens=row["completion_tokens"],
        cost_usd=row["cost_usd"] or 0.0,
        generation_id=row["generation_id"],
        provider=row["provider"],
        attempt_id=row["attempt_id"],
        billed=True,
        extra={"recovered_from": "generation/content"},
    )


COMPLETION_COLUMNS: dict[str, PolarsDataType] = {
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


def completions_frame(
    dataset: str, requests: list[CompletionRequest], journal_path: Path, prompts: pl.DataFrame
) -> pl.DataFrame:
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
