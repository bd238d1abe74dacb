"""Generate completions for one dataset: the logic behind the `completions` asset.

Every result is appended to the partition's journal the moment it arrives; the Parquet output
is derived from the journal, one row per prompt. Re-running resumes: a prompt with a final
outcome in the journal is never sent again. Money is the spend package's: every attempt is
admitted and settled in the ledger shared by every process (eagle3_assets/money/).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from eagle3_assets.common.stop_signals import StopSignals
from eagle3_assets.money import ledger as L
from eagle3_assets.money.admission import HALTED, Admission
from eagle3_assets.money.caps import Caps, Pricing
from eagle3_assets.money.ledger import DEFAULT_HORIZON_S, SpendLedger
from eagle3_assets.money.settle import recover_dataset, settle_due
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
from eagle3_resources.errors import DatasetBusy
from eagle3_resources.journal import Journal, JournalContents, read_journal
from eagle3_resources.storage import DataLayout
from eagle3_resources.tokenizer.chat_format import TemplateVersion
from eagle3_resources.tokenizer.kimi import KimiTokenizer

PROGRESS_EVERY_S = 10.0


@contextlib.contextmanager
def partition_lock(journal: Path, run_id: str, *, wait: bool = False):
    """One spending run per dataset at a time: an exclusive lock next to the journal (fcntl, released by the OS on death)."""
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
                out[dataset] = ledger.write(recover_dataset, dataset, records, free=free, now=time.time())
        except DatasetBusy:
            continue
    return out


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
        prompts.select("prompt_id", "messages_json", "tools_json").rows(), ids, had_tools
    ):
        how = "tools_field" if t else "omitted" if had else "none"
        out.append(CompletionRequest(pid, json.loads(m), json.loads(t) if t else None, prompt, tools_in_request=how))
    return out


def final_results(
    journal_path: Path, contents: JournalContents | None = None
) -> tuple[dict[str, dict[str, Any]], bool]:
    """The final outcome recorded for each prompt, and whether a torn last record was skipped."""
    contents = contents if contents is not None else read_journal(journal_path)
    done = {}
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
            f"{self.dataset} {f['done']}/{f['total']} done ({f['done_before']} before this run; this run: {f['ok']} ok, "
            f"{f['errors']} err, {f['truncated']} cut) {f['requests_per_s']:.1f} req/s avg_comp={avg:.0f}tok "
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
    retries: int = 0
    blocked: int = 0  # prompts not sent: an earlier attempt's bill is outstanding
    attempt_outcomes: dict[str, int] = field(default_factory=dict)  # settled / released / unsettled / unidentified
    in_flight_at_stop: int | None = None
    after_stop_usd: float = 0.0  # billed for requests in flight at the stop (drained: kept)
    settled_late_usd: float = 0.0  # bills of earlier attempts found by look-ups during this run
    recovered_answers: int = (
        0  # billed answers lost before the journal (a kill), fetched from the provider's stored content
    )

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


def run_completions(
    dataset: str,
    requests: list[CompletionRequest],
    backend: CompletionBackend,
    settings: SamplingSettings,
    journal_path: Path,
    *,
    ledger: SpendLedger,
    caps: Caps = Caps(),
    pricing: Pricing = Pricing(),
    log: Callable[[str], None],
    run_id: str = "",
    halt: Callable[[], str | None] | None = None,
    halt_poll_s: float = 1.0,
    hold_mode: str = "drain",
    on_terminate: str = "cancel",
    resend_unsettled: bool = False,
    unsettled_wait_s: float = 60.0,
    horizon_s: float = DEFAULT_HORIZON_S,
    settle_window_s: float = 20.0,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
) -> CompletionsRun:
    """Send every prompt without a final outcome in the journal; stop at a cap, the hold, a stop, or a halt.

    Every attempt is admitted by the shared spend ledger (caps across every process, the hold) and
    settled there. A prompt whose earlier attempt is still unsettled (started, no bill yet) is not
    sent unless `resend_unsettled`. `halt` is polled every `halt_poll_s` (in a thread: it may read a
    database) and returns a reason to stop admitting (the run being cancelled from the UI) or None;
    it makes a terminate bite on runs no launcher can signal, such as in-process ones.
    `hold_mode` / `on_terminate`: "drain" lets requests in flight finish (kept), "cancel" cancels them.
    `on_progress` gets `Progress.figures()` at the start, every PROGRESS_EVERY_S and at the end.
    """
    run_id = run_id or f"local-{uuid.uuid4().hex[:12]}"
    contents = read_journal(journal_path)
    done, torn = final_results(journal_path, contents)
    if torn:
        log(f"{dataset}: the journal's last record was torn (a crash mid-write); it was skipped and truncated")
    lookup_source = getattr(backend, "account", None)
    run = CompletionsRun(0, Counter(), 0, 0.0, 0.0, None, len(done), torn, Counter())
    writer = LedgerWriter(ledger, on_error=log)

    with StopSignals() as signals, Journal(journal_path) as journal, writer:
        journal.append(
            {
                "type": "start",
                "run_id": run_id,
                "t": time.time(),
                "settings": settings.model_dump(),
                "backend": backend.describe(),
                "caps": caps.__dict__,
                "pricing": pricing.__dict__,
            }
        )

        def note(record: dict[str, Any]) -> None:
            journal.append({"run_id": run_id, "t": time.time(), **record})

        async def main() -> None:
            signals.attach()
            recovered = await writer.call(
                recover_dataset, dataset, contents.records, free=pricing.free, now=time.time()
            )
            if any(recovered.values()):
                log(f"{dataset}: attempts an earlier process left unfinished: {recovered}")
            account = lookup_source() if lookup_source is not None else None
            async with account or contextlib.nullcontext():
                lookup = account.generation if account is not None else None
                if lookup is not None:  # this dataset's unsettled bills first (they block prompts), then any due
                    mine = await writer.call(L.unsettled_ids, dataset)
                    report = (
                        await settle_due(
                            writer, lookup, deadline_s=settle_window_s, horizon_s=horizon_s, attempt_ids=mine
                        )
                        if mine
                        else None
                    )
                    sweep = await settle_due(writer, lookup, deadline_s=settle_window_s / 4, horizon_s=horizon_s)
                    for r in (report, sweep):
                        if r is not None and (r.looked_up or r.expired):
                            log(f"{dataset}: before sending: {r.line()}")
                            run.settled_late_usd += r.found_usd
                    run.recovered_answers = await recover_lost_answers(writer, account, dataset, done, note, log)
                blocked = await writer.call(L.blocked_prompts, dataset)
                pending = [
                    r for r in requests if r.prompt_id not in done and (resend_unsettled or r.prompt_id not in blocked)
                ]
                run.blocked = sum(1 for r in requests if r.prompt_id not in done and r.prompt_id in blocked)
                log(
                    f"{dataset}: {len(requests)} prompts, {len(done)} already have a final outcome, {len(pending)} to send via "
                    f"{backend.name}"
                    + (
                        f"; {run.blocked} wait for an earlier attempt's bill (unsettled: not sent twice)"
                        if run.blocked and not resend_unsettled
                        else ""
                    )
                )
                feed = Admission(
                    pending,
                    writer=writer,
                    caps=caps,
                    pricing=pricing,
                    max_tokens=settings.max_tokens,
                    run_id=run_id,
                    dataset=dataset,
                    note=note,
                    hold_mode=hold_mode,
                    resend_unsettled=resend_unsettled,
                    unsettled_wait_s=unsettled_wait_s,
                    horizon_s=horizon_s,
                    lookup=lookup,
                )
                state["feed"] = feed
                progress = Progress(
                    dataset,
                    len(requests),
                    sum(1 for r in requests if r.prompt_id in done),
                    log,
                    spent=lambda: feed.billed_usd,
                    on_report=on_progress,
                )
                state["progress"] = progress
                if on_progress is not None:
                    on_progress(progress.figures())
                signals.on_first = (
                    (lambda: feed.stop(HALTED + f"{signals.description}: draining", cancel_inflight=False))
                    if on_terminate == "drain"
                    else None
                )

                def emit(result: CompletionResult) -> None:
                    journal.append({"type": "result", "run_id": run_id, "t": time.time(), **result.to_record()})
                    progress.add(result)

                watcher = asyncio.create_task(
                    watch(feed, writer, halt, halt_poll_s, hold_mode, on_terminate, log, dataset)
                )
                ticker = asyncio.create_task(report_while_waiting(progress))
                try:
                    await backend.run(feed, settings, emit)
                finally:
                    watcher.cancel()
                    ticker.cancel()
                    await feed.close()
                    await writer.flush()
                # Not after a stop (halt, hold): it must take effect at once; the next run or the sensor looks them up.
                if lookup is not None and feed.unsettled_ids and not (feed.stopped_by or "").startswith(HALTED):
                    report = await settle_due(
                        writer,
                        lookup,
                        deadline_s=settle_window_s,
                        horizon_s=horizon_s,
                        attempt_ids=list(feed.unsettled_ids),
                    )
                    run.settled_late_usd += report.found_usd
                    feed.billed_usd += report.found_usd
                    if report.looked_up:
                        log(f"{dataset}: after the run: {report.line()}")

        state: dict[str, Any] = {}
        started = time.monotonic()
        try:
            asyncio.run(main())
        except BaseException as e:  # a stop (Dagster terminate, SIGTERM, Ctrl-C) or a run-fatal error
            feed = state.get("feed")
            if feed is not None:
                feed.stopped_by = feed.stopped_by or signals.description or f"{type(e).__name__}: {e}"
            else:
                run.stopped_by = signals.description or f"{type(e).__name__}: {e}"
            raise
        finally:
            feed, progress = state.get("feed"), state.get("progress")
            if progress is not None:
                progress.report()
            figs = ledger.figures()
            if feed is not None:
                run.sent, run.stopped_by, run.retries = feed.admitted, feed.stopped_by, feed.retries
                run.cost_usd, run.attempt_outcomes = feed.billed_usd, dict(feed.outcomes)
                run.in_flight_at_stop = feed.in_flight_at_stop
                run.after_stop_usd = feed.billed_usd - (feed.billed_at_stop or feed.billed_usd)
                run.results, run.errors, run.completion_tokens = (
                    progress.counts,
                    progress.errors,
                    progress.completion_tokens,
                )
            run.duration_s = time.monotonic() - started
            if run.stopped_by:
                log(
                    f"{dataset}: stopped after {progress.finished if progress else 0} done, ${run.cost_usd:.4f} billed ({run.stopped_by})"
                    + (
                        f"; {run.in_flight_at_stop} request(s) were in flight at the stop: ${run.after_stop_usd:.4f} billed for "
                        f"them since (kept), {run.attempt_outcomes.get('unsettled', 0) + run.attempt_outcomes.get('unidentified', 0)} "
                        "cut short (unsettled: looked up, prompts sent again)"
                        if run.in_flight_at_stop
                        else ""
                    )
                )
            journal.append(
                {
                    "type": "end",
                    "run_id": run_id,
                    "t": time.time(),
                    "stopped_by": run.stopped_by,
                    "finished": progress.finished if progress else 0,
                    "cost_usd": run.cost_usd,
                    "attempts": run.attempt_outcomes,
                    "ledger": figs.as_dict(),
                }
            )
    return run


FINISHED = {"stop": "ok", "length": "truncated", "content_filter": "filtered"}


async def recover_lost_answers(
    writer: LedgerWriter,
    account: Any,
    dataset: str,
    done: dict[str, dict[str, Any]],
    note: Callable[[dict[str, Any]], None],
    log: Callable[[str], None],
) -> int:
    """Answers that were generated and billed but never reached the journal (a kill -9, a cut stream whose provider
    finished anyway): fetched from OpenRouter's stored content, where the account keeps it, so the prompt is not paid
    for twice. Returns how many were recovered; the others' prompts are sent again (and say so)."""
    lost = await writer.call(L.lost_answers, dataset)
    if not lost:
        return 0
    recovered, unavailable, already = [], [], []
    for row in lost:
        if row["prompt_id"] in done:
            already.append(row["attempt_id"])
            continue
        content = await account.generation_content(row["generation_id"])
        if content is None:
            unavailable.append(row["attempt_id"])
            continue
        reasoning, text = content
        result = CompletionResult(
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
        note({"type": "result", **result.to_record()})
        done[row["prompt_id"]] = result.to_record()
        recovered.append(row["attempt_id"])
    await writer.call(L.mark_recovered, recovered + already, True)
    await writer.call(L.mark_recovered, unavailable, False)
    log(
        f"{dataset}: {len(recovered) + len(unavailable)} answer(s) were billed but never received: {len(recovered)} recovered "
        f"from OpenRouter's stored content"
        + (
            f"; {len(unavailable)} not stored (the account's input/output logging is off?): "
            "their prompts are sent again and paid twice"
            if unavailable
            else ""
        )
    )
    return len(recovered)


async def watch(
    feed: Admission,
    writer: LedgerWriter,
    halt: Callable[[], str | None] | None,
    poll_s: float,
    hold_mode: str,
    on_terminate: str,
    log: Callable[[str], None],
    dataset: str,
) -> None:
    """Every `poll_s`: the hold (so that cancel mode cancels in-flight requests at once) and the run's own status."""
    failing = False
    while True:
        await asyncio.sleep(poll_s)
        try:
            hold = await writer.call(L.get_hold)
            reason = await asyncio.to_thread(halt) if halt is not None else None
        except Exception as e:  # a busy database must not end the watch: the stop would stop biting
            if not failing:
                log(f"{dataset}: could not read the spend hold or the run's status ({type(e).__name__}: {e}); retrying")
            failing = True
            continue
        failing = False
        if hold:
            log(f"{dataset}: halting: spending hold: {'; '.join(hold['reasons'])} (in-flight requests: {hold_mode})")
            feed.stop(HALTED + "spending hold: " + "; ".join(hold["reasons"]), cancel_inflight=hold_mode == "cancel")
            return
        if reason:
            log(f"{dataset}: halting: {reason} (in-flight requests: {on_terminate})")
            feed.stop(HALTED + reason, cancel_inflight=on_terminate == "cancel")
            return


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
