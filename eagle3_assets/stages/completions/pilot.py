"""The pilot: a partition spends on a few prompts first, and goes on only if their data has the right shape.

`PartitionPilot` is one partition's way through it, a small state machine read top to bottom (`run`): no pilot
needed (disabled, or passed in an earlier run) or the pilot flies; it is cut short (a hold, a cap: it flies again
on the next materialization), fails its checks (nothing more is sent) or passes; then the rest's cost is projected,
checked against `max_projected_usd`, and the rest is sent.

The history's costliest mistake was money spent on data of the wrong shape (tools sent with the
wrong semantics), found only after the run. The pilot's blocking checks look at the first
`pilot_size` completions: did they succeed, do they carry an answer, does the provider's prompt
count equal our rendering (it does not when tools reach the model differently than we render
them), do the reconstructed ids match what was billed, and were the answers billed at the listed
prices (every cap is priced with them). Malformed data or a wrong price list costs a pilot.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import dagster as dg
import polars as pl

from eagle3_assets.common.metadata import json_value
from eagle3_assets.common.outcome import CheckOutcome, sample_ids
from eagle3_assets.money import ledger as L
from eagle3_assets.money.caps import Pricing
from eagle3_assets.money.ledger import SpendLedger
from eagle3_assets.money.prices import PriceCheck, PriceSheet, check_billed, configured, fetch_prices
from eagle3_assets.money.projection import Projection, project
from eagle3_assets.stages.completions.run import CompletionsRun, RunOptions, RunReport, completions_frame, final_results
from eagle3_assets.stages.token_ids.checks import BILLED_DIFF_LIMIT
from eagle3_assets.stages.token_ids.reconstruct import build_token_ids
from eagle3_resources.completions.types import CompletionBackend, CompletionRequest, SamplingSettings
from eagle3_resources.journal import Journal, read_journal
from eagle3_resources.tokenizer.kimi import KimiTokenizer

MIN_OK_SHARE = 0.5
MIN_ANSWER_SHARE = 0.25  # real Kimi answers nearly always; the stand-in forgets </think> often


def pilot_passed(journal) -> bool:
    return any(r.get("type") == "pilot" and r.get("passed") for r in read_journal(journal).records)


def pilot_outcome(completions: pl.DataFrame, token_ids: pl.DataFrame, prices: PriceCheck | None = None) -> CheckOutcome:
    """The pilot's completions have the shape training needs and agree with what was billed (tokens and dollars). When
    it fails: nothing more of the dataset is sent; read the failing figure, fix the settings (template, `max_tokens`,
    prices) and re-materialize: a new pilot runs."""
    problems: list[str] = list(prices.problems) if prices is not None else []
    final = completions.filter(pl.col("status") != "pending")
    ok = final.filter(pl.col("status") == "ok")
    n = max(1, final.height)
    if ok.height / n < MIN_OK_SHARE:
        statuses = dict(final.group_by("status").len().rows())
        problems.append(f"only {ok.height} of {final.height} pilot requests succeeded ({statuses})")
    answered = ok.filter((pl.col("content").fill_null("") != "") | pl.col("tool_calls_json").is_not_null())
    if ok.height and answered.height / ok.height < MIN_ANSWER_SHARE:
        problems.append(f"only {answered.height} of {ok.height} successful pilot completions carry an answer")
    billed_prompt = token_ids.filter(pl.col("billed_prompt_tokens").is_not_null())
    off = billed_prompt.filter(pl.col("prompt_len_diff") != 0)
    tools_off = off.filter(pl.col("tools_in_request") == "tools_field")
    if off.height:
        problems.append(
            f"the provider counted a different prompt than we render for {off.height} of {billed_prompt.height} prompts"
            + (
                f" ({tools_off.height} with tools: they reach the model differently than we declare them)"
                if tools_off.height
                else ""
            )
        )
    billed = token_ids.filter(pl.col("billed_completion_tokens").is_not_null())
    total = int(billed["billed_completion_tokens"].sum() or 0)
    diff = int(billed["completion_len_diff"].sum() or 0)
    if total and abs(diff) / total > BILLED_DIFF_LIMIT:
        problems.append(f"reconstructed completions differ from the billed counts by {diff:+,} of {total:,} tokens")
    return CheckOutcome(
        not problems,
        "pilot passed: the data has the expected shape" if not problems else "pilot failed: " + "; ".join(problems),
        {
            "pilot_requests": final.height,
            "ok": ok.height,
            # an answer after `</think>`, or a tool call (needed: MIN_ANSWER_SHARE)
            "ok_with_final_answer": answered.height,
            "min_share_with_final_answer": MIN_ANSWER_SHARE,
            "prompt_count_mismatches": off.height,
            "completion_token_diff": diff,
            "counted_completion_tokens": total,  # billed, or reported by a free backend
            "problems": problems,
            **({"prices": prices.figures()} if prices is not None else {}),
            "examples": sample_ids(off) if off.height else sample_ids(final.filter(pl.col("status") != "ok")),
        },
    )


def price_sheet(
    listed: tuple[float | None, float | None], from_api: bool, make_account: Callable | None, settings: SamplingSettings
) -> PriceSheet | None:
    """The prices the run is reserved at and its pilot's bills are checked against: the run config's (USD per million
    prompt / completion tokens), else the API's; None for a backend that bills nothing."""
    if listed[0] is not None or listed[1] is not None:
        return configured(settings.model, listed[0] or 0.0, listed[1] or 0.0)
    if not from_api or make_account is None:
        return None

    async def fetch():
        async with make_account() as account:
            return await fetch_prices(account, settings.model, settings.provider.to_request())

    sheet = asyncio.run(fetch())
    if sheet is None:
        raise dg.Failure(
            description=f"no price list for {settings.model} at this API (/models and /models/{settings.model}"
            "/endpoints): set usd_per_m_prompt_tokens and usd_per_m_completion_tokens in the run config"
        )
    if not sheet.endpoints:
        raise dg.Failure(
            description=f"the provider routing leaves no endpoint for {settings.model}: " + "; ".join(sheet.excluded),
            metadata={"prices": json_value(sheet.describe())},
        )
    return sheet


def worst_case_pricing(sheet: PriceSheet | None, log: Callable[[str], None]) -> Pricing:
    """What admission reserves per token: the highest price the routing allows (nothing for a free backend)."""
    if not sheet:
        return Pricing(source="free backend")
    pricing = sheet.pricing()
    log(
        f"prices ({sheet.source}): worst case ${pricing.prompt * 1e6:.4f} / ${pricing.completion * 1e6:.4f} per "
        f"million prompt / completion tokens over {len(sheet.endpoints)} endpoint(s)"
    )
    return pricing


def recorded_prices(sheet: PriceSheet | None) -> dict[str, Any]:
    """The price list as the materialization records it (read once: a sheet does not change during a run)."""
    return sheet.describe() if sheet else {"source": "free backend"}


@dataclass(frozen=True)
class PilotRules:
    """The run config's pilot fields."""

    size: int  # prompts sent first (0: no pilot)
    price_tolerance: float  # the share by which the pilot's bills may differ from the listed prices
    max_projected_usd: float | None  # the most the rest of a partition may be projected to cost


@dataclass(frozen=True)
class Means:
    """What every partition of one materialization shares: the backend and its settings, prices, ledger, log."""

    backend: CompletionBackend
    settings: SamplingSettings
    sheet: PriceSheet | None  # None: a backend that bills nothing
    prices: dict[str, Any]  # the sheet as recorded (`recorded_prices`)
    ledger: SpendLedger
    tokenizer: KimiTokenizer
    concurrency: int  # requests in flight (the projection's duration)
    run_id: str
    log: Callable[[str], None]


@dataclass
class Partition:
    """One dataset of the materialization: its prompts, their requests, its journal and how its runs spend."""

    key: str
    prompts: pl.DataFrame
    requests: list[CompletionRequest]
    journal: Path
    options: RunOptions


class PilotState(Enum):
    DISABLED = "pilots disabled"
    PASSED_EARLIER = "passed in an earlier run"
    DUE = "due"
    CUT_SHORT = "cut short"
    FAILED = "failed"
    PASSED = "passed"


GOES_ON = (PilotState.DISABLED, PilotState.PASSED_EARLIER, PilotState.PASSED)  # the rest of the partition is sent


@dataclass
class PartitionPilot:
    """One partition's pilot and rest, in states (`run`); what was sent and why it stopped are kept for the figures."""

    partition: Partition
    means: Means
    rules: PilotRules
    state: PilotState = PilotState.DUE
    verdict: CheckOutcome | None = None  # the pilot's check, where a pilot flew in this run
    projection: Projection | None = None
    batches: list[tuple[str, RunReport]] = field(default_factory=list)  # (pilot | rest, what its run did)
    last: RunReport | None = None  # the run whose stop ends the partition; None when the pilot stopped it

    def run(self) -> None:
        self.state = self._first_state()
        if self.state is PilotState.DUE:
            self.fly()
        if self.state in GOES_ON:
            self.check_projection()
            self.send_rest()

    def _first_state(self) -> PilotState:
        if not self.rules.size:
            return PilotState.DISABLED
        return PilotState.PASSED_EARLIER if pilot_passed(self.partition.journal) else PilotState.DUE

    def fly(self) -> None:
        """The first `size` prompts without a final outcome; a stopped pilot gives no verdict and sends no more."""
        part = self.partition
        done, _ = final_results(part.journal)
        batch = [r for r in part.requests if r.prompt_id not in done][: self.rules.size]
        self.means.log(f"{part.key}: pilot of {len(batch)} prompts before the rest")
        report = self._send("pilot", batch)
        if report.stopped_by:  # a hold, a cap: no verdict on a part of the pilot, and nothing more is sent
            self.last, self.state = report, PilotState.CUT_SHORT
            self.verdict = CheckOutcome(
                False,
                f"pilot cut short ({report.stopped_by}); it runs again on the next materialization",
                {"sent": report.sent},
            )
        else:
            frame = completions_frame(part.key, batch, part.journal, part.prompts)
            self.verdict = self._judge(frame, len(batch))
            self.state = PilotState.PASSED if self.verdict.passed else PilotState.FAILED
            if self.verdict.passed:
                self.projection = self._project(frame)
        self.means.log(f"{part.key}: {self.verdict.description}")

    def _judge(self, frame: pl.DataFrame, n: int) -> CheckOutcome:
        """The pilot's blocking checks (shape, billed counts, prices), recorded in the journal."""
        sheet = self.means.sheet
        prices = check_billed(frame, sheet, self.rules.price_tolerance) if sheet else None
        verdict = pilot_outcome(frame, build_token_ids(frame, self.means.tokenizer), prices)
        self._record(
            {"type": "pilot", "passed": verdict.passed, "description": verdict.description, "n": n},
        )
        return verdict

    def _project(self, frame: pl.DataFrame) -> Projection:
        """The rest of the partition's cost and duration from its pilot: logged and recorded."""
        part, options = self.partition, self.partition.options
        done, _ = final_results(part.journal)
        remaining = [len(r.prompt_ids) for r in part.requests if r.prompt_id not in done]
        budget_left = None
        if options.caps.token_budget is not None:
            committed = self.means.ledger.read(L.scope, f"dataset:{part.key}").committed_tokens
            budget_left = options.caps.token_budget - committed
        rate = getattr(self.means.backend, "rate", None)
        max_rps = rate.limit / rate.window_s if rate is not None and rate.limit and rate.window_s else None
        projection = project(
            frame,
            remaining,
            pricing=options.pricing,
            max_tokens=self.means.settings.max_tokens,
            token_budget_left=budget_left,
            concurrency=self.means.concurrency,
            max_rps=max_rps,
        )
        self.means.log(projection.line(part.key))
        self._record({"type": "projection", **projection.as_dict()})
        return projection

    def check_projection(self) -> None:
        """Nothing more is sent when the rest is projected to cost more than `max_projected_usd`."""
        limit, projection = self.rules.max_projected_usd, self.projection
        if projection is not None and limit is not None and projection.usd > limit:
            raise dg.Failure(
                description=f"{projection.line(self.partition.key)}: more than max_projected_usd "
                f"${limit:,.2f}. Nothing more was sent; raise the limit to go on.",
                metadata={"projection": json_value(projection.as_dict())},
            )

    def send_rest(self) -> None:
        self.last = self._send("rest", self.partition.requests)

    def _send(self, name: str, batch: list[CompletionRequest]) -> RunReport:
        part, means = self.partition, self.means
        run = CompletionsRun(
            part.key, batch, means.backend, means.settings, part.journal, means.ledger, means.log, part.options
        )
        report = run.execute()
        self.batches.append((name, report))
        return report

    def _record(self, record: dict) -> None:
        with Journal(self.partition.journal) as j:
            j.append({"type": record["type"], "run_id": self.means.run_id, "t": time.time(), **record})

    def backend_description(self) -> dict[str, Any]:
        """The backend as the partition's last run left it (what it learnt: throttling, the rate limit), read by that
        run as it finished (`RunReport.backend`)."""
        return self.batches[-1][1].backend

    def outcome(self) -> CheckOutcome:
        """The blocking `pilot` check of this partition."""
        return self.verdict or CheckOutcome(True, "no pilot needed: " + self.state.value)

    @property
    def stopped_by(self) -> str | None:
        """Why the partition stopped short of its rest, in the run's summary (else: its last batch's stop)."""
        return "pilot failed" if self.verdict is not None and not self.verdict.passed else None
