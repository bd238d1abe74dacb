"""Spend control: the figures, the thresholds, the hold, and which runs spend money.

The credit sensor reads the account (`/api/v1/key`) and the project's own ledger (the journals),
compares them with the thresholds, and when one is crossed sets a *hold* (kept in the Dagster
instance, so every process sees it) and cancels every queued or running run that spends. While
the hold stands, spending runs are cancelled as they appear and the `completions` asset refuses
to start. The operator lifts it (`eagle3 hold lift`, or the `lift_spend_hold` job), or raises the
threshold, after which the sensor lifts it by itself once the figures are within bounds again.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

import dagster as dg
import httpx
from pydantic import Field

from eagle3_assets.completions import Ledger

HOLD_KEY = "eagle3/spend_hold"
SPENDING_ASSET = dg.AssetKey("completions")
SPENDING_JOBS = {"eagle3_pipeline"}
SPEND_TAG = "eagle3/spends"  # optional: runs can also be marked by hand
ACTIVE_STATUSES = [
    dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED,
]


class SpendPolicy(dg.ConfigurableResource):
    """Thresholds the credit sensor and the client enforce (each unset = not enforced)."""

    min_balance_usd: Optional[float] = Field(default=None, description="hold when the account's remaining credit falls below")
    max_run_usd: Optional[float] = Field(default=None, description="hold when one run has spent more than this")
    max_day_usd: Optional[float] = Field(default=None, description="hold when today's (UTC) ledger exceeds this")
    max_total_usd: Optional[float] = Field(default=None, description="hold when the whole ledger exceeds this")
    ledger_tolerance_usd: float = Field(default=1.0, description="warn when ledger and account usage differ by more")
    account_base_url: Optional[str] = Field(default=None, description="OpenRouter API base URL for /key (unset: ledger only)")
    account_api_key: Optional[str] = Field(default=None, description="OPENROUTER_API_KEY (EnvVar)")

    def thresholds(self) -> dict[str, Optional[float]]:
        return {"min_balance_usd": self.min_balance_usd, "max_run_usd": self.max_run_usd,
                "max_day_usd": self.max_day_usd, "max_total_usd": self.max_total_usd}

    def read_account(self) -> Optional["Account"]:
        if not (self.account_base_url and self.account_api_key):
            return None
        resp = httpx.get(f"{self.account_base_url.rstrip('/')}/key", headers={"Authorization": f"Bearer {self.account_api_key}"},
                         timeout=15)
        resp.raise_for_status()
        data = resp.json()["data"]
        return Account(usage_usd=float(data.get("usage") or 0.0), limit_remaining_usd=data.get("limit_remaining"), t=time.time())


@dataclass
class Account:
    usage_usd: float
    limit_remaining_usd: Optional[float]
    t: float


def crossed(policy: SpendPolicy, account: Optional[Account], ledger: Ledger) -> list[str]:
    """Every threshold crossed, each with the figures that crossed it."""
    out = []
    if policy.min_balance_usd is not None and account is not None and account.limit_remaining_usd is not None:
        if account.limit_remaining_usd < policy.min_balance_usd:
            out.append(f"account balance ${account.limit_remaining_usd:.2f} < minimum ${policy.min_balance_usd:.2f}")
    if policy.max_run_usd is not None:
        for run_id, usd in ledger.by_run_usd.items():
            if usd > policy.max_run_usd:
                out.append(f"run {run_id[:8]} spent ${usd:.2f} > ${policy.max_run_usd:.2f} per run")
    if policy.max_day_usd is not None and ledger.day_usd > policy.max_day_usd:
        out.append(f"spent today ${ledger.day_usd:.2f} > ${policy.max_day_usd:.2f} per day")
    if policy.max_total_usd is not None and ledger.total_usd > policy.max_total_usd:
        out.append(f"spent in all ${ledger.total_usd:.2f} > ${policy.max_total_usd:.2f}")
    return out


def account_moves(previous: Optional[dict[str, Any]], account: Optional[Account]) -> list[str]:
    """Moves an account never makes between two readings: usage going down, balance going up."""
    out: list[str] = []
    if not previous or account is None:
        return out
    if account.usage_usd < previous["usage_usd"] - 1e-9:
        out.append(f"account usage went DOWN from ${previous['usage_usd']:.4f} to ${account.usage_usd:.4f}")
    if (account.limit_remaining_usd is not None and previous.get("limit_remaining_usd") is not None
            and account.limit_remaining_usd > previous["limit_remaining_usd"] + 1e-9):
        out.append(f"account balance went UP from ${previous['limit_remaining_usd']:.4f} to ${account.limit_remaining_usd:.4f}")
    return out


@dataclass
class LedgerGap:
    """How far the account's usage has drifted from the ledger since the first reading.

    A key may have spent before this project (or for others), so the account and the ledger start
    apart; that offset is taken at the first reading and said once, and drift from it is what is
    watched. A gap is a level, not an event: it is alerted when it opens and when it closes.
    """

    offset_usd: float  # account usage - ledger at the first reading
    drift_usd: float
    open: bool

    @classmethod
    def measure(cls, previous: Optional[dict[str, Any]], account: Account, ledger: Ledger, tolerance: float) -> LedgerGap:
        offset = previous["offset_usd"] if previous and previous.get("offset_usd") is not None else account.usage_usd - ledger.total_usd
        drift = account.usage_usd - ledger.total_usd - offset
        return cls(offset_usd=offset, drift_usd=drift, open=abs(drift) > tolerance)

    def describe(self, account: Account, ledger: Ledger, tolerance: float) -> str:
        return (f"ledger ${ledger.total_usd:.4f} and account usage ${account.usage_usd:.4f} have drifted ${self.drift_usd:+.4f} "
                f"apart (more than ${tolerance:.2f}) since the first reading (offset ${self.offset_usd:.4f})")


def spends(run: dg.DagsterRun) -> bool:
    """Does this run buy completions? By job and asset selection (asset tags never reach runs)."""
    if run.tags.get(SPEND_TAG) == "true":
        return True
    selection = run.asset_selection
    if selection is not None:
        return SPENDING_ASSET in selection
    return run.job_name in SPENDING_JOBS


# -- the hold ------------------------------------------------------------------------------


def get_hold(instance: dg.DagsterInstance) -> Optional[dict[str, Any]]:
    raw = instance.run_storage.get_cursor_values({HOLD_KEY}).get(HOLD_KEY)
    return json.loads(raw) if raw else None


def set_hold(instance: dg.DagsterInstance, reasons: list[str], figures: dict[str, Any], thresholds: dict[str, Any]) -> dict[str, Any]:
    hold = {"since": time.time(), "reasons": reasons, "figures": figures, "thresholds": thresholds}
    instance.run_storage.set_cursor_values({HOLD_KEY: json.dumps(hold)})
    return hold


def halt_reason(instance: dg.DagsterInstance, run_id: str) -> Optional[str]:
    """Why a running completions run must stop admitting requests now, if it must."""
    hold = get_hold(instance)
    if hold:
        return "spending hold: " + "; ".join(hold["reasons"])
    run = instance.get_run_by_id(run_id)
    if run is not None and run.status == dg.DagsterRunStatus.CANCELING:
        return "the run is being cancelled"
    return None


def lift_hold(instance: dg.DagsterInstance) -> Optional[dict[str, Any]]:
    hold = get_hold(instance)
    instance.run_storage.set_cursor_values({HOLD_KEY: ""})
    return hold


def cancel_spending(instance: dg.DagsterInstance) -> tuple[list[str], list[str]]:
    """Cancel every queued or running run that spends, and stop backfills that would launch more."""
    from dagster._core.execution.backfill import BulkActionStatus

    cancelled = []
    for run in instance.get_runs(filters=dg.RunsFilter(statuses=ACTIVE_STATUSES)):
        if spends(run):
            instance.run_coordinator.cancel_run(run.run_id)
            cancelled.append(run.run_id)
    stopped = []
    for backfill in instance.get_backfills(status=BulkActionStatus.REQUESTED):
        selection = backfill.asset_selection
        if (selection is not None and SPENDING_ASSET in selection) or backfill.job_name in SPENDING_JOBS:
            instance.update_backfill(backfill.with_status(BulkActionStatus.CANCELING))
            stopped.append(backfill.backfill_id)
    return cancelled, stopped


def figures(account: Optional[Account], ledger: Ledger) -> dict[str, Any]:
    return {"account": asdict(account) if account else None, "ledger_total_usd": round(ledger.total_usd, 6),
            "ledger_day_usd": round(ledger.day_usd, 6), "top_runs_usd": dict(sorted(ledger.by_run_usd.items(), key=lambda kv: -kv[1])[:5])}
