"""The spending hold, and which Dagster runs spend money.

When a threshold is crossed the credit sensor sets a *hold*: a row in the spend ledger, which
every admission reads in its own transaction, so no process sends another request while it
stands (in-process runs, CLI materializations and daemon-launched runs alike). What happens to
requests already in flight is the policy's `hold_mode`: "drain" (the default: they finish and are
kept; nothing paid is thrown away) or "cancel" (their streams are cancelled now). Queued runs that
would spend are cancelled either way; with "cancel" started ones are terminated too.

Lifting: `eagle3 hold lift` (or the `lift_spend_hold` job) removes it; the sensor sets it again
only if current figures cross a threshold (today's spend, runs still in flight, the balance now);
it also lifts it by itself once no threshold is crossed any more (a top-up, a new UTC day, a
raised threshold).
"""

from __future__ import annotations

import time
from typing import Any

import dagster as dg

from eagle3_assets.money import ledger as L
from eagle3_assets.money.ledger import SpendLedger

SPENDING_ASSET = dg.AssetKey("completions")
SPENDING_JOBS = {"eagle3_pipeline"}
SPEND_TAG = "eagle3/spends"  # optional: runs can also be marked by hand
ACTIVE_STATUSES = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
]
NOT_RUNNING = (dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED)


def get_hold(ledger: SpendLedger) -> dict[str, Any] | None:
    return ledger.read(L.get_hold)


def set_hold(
    ledger: SpendLedger, reasons: list[str], figures: dict[str, Any], thresholds: dict[str, Any]
) -> dict[str, Any]:
    return ledger.write(L.set_hold, reasons, figures, thresholds, time.time())


def lift_hold(ledger: SpendLedger, why: str = "lifted by the operator") -> dict[str, Any] | None:
    return ledger.write(L.lift_hold, time.time(), why)


def spends(run: dg.DagsterRun) -> bool:
    """Does this run buy completions? By job and asset selection (asset tags never reach runs)."""
    if run.tags.get(SPEND_TAG) == "true":
        return True
    selection = run.asset_selection
    if selection is not None:
        return SPENDING_ASSET in selection
    return run.job_name in SPENDING_JOBS


def cancelling(instance: dg.DagsterInstance, run_id: str) -> str | None:
    """Why a running completions run must stop admitting requests now (a terminate from the UI), if it must."""
    run = instance.get_run_by_id(run_id)
    if run is not None and run.status == dg.DagsterRunStatus.CANCELING:
        return "the run is being cancelled"
    return None


def cancel_run(instance: dg.DagsterInstance, run: dg.DagsterRun) -> None:
    """Cancel a run whatever its state, never leaving it CANCELING with no process to finish it.

    The coordinator dequeues a QUEUED run and asks the launcher to terminate the others; a run
    that has a record but no process yet (NOT_STARTED, just created by `job launch`) has nothing
    to terminate, and used to stay CANCELING for good, holding its dataset's queue slot. Such a
    run is marked CANCELED directly; if its worker starts later it sees that and does not execute.
    """
    terminated = instance.run_coordinator.cancel_run(run.run_id)
    now = instance.get_run_by_id(run.run_id)
    if now is None or now.is_finished:
        return
    if not terminated and (run.status in NOT_RUNNING or now.status == dg.DagsterRunStatus.CANCELING):
        instance.report_run_canceled(
            now, message="Canceled by the spend hold before its process started (nothing to terminate)"
        )


def cancel_spending(instance: dg.DagsterInstance, hold_mode: str = "drain") -> tuple[list[str], list[str]]:
    """Cancel runs that would spend, and stop backfills that would launch more.

    Queued and not-yet-started runs are cancelled; started ones only with hold_mode="cancel"
    (with "drain" they stop admitting by themselves, in-flight requests finish and are kept).
    """
    from dagster._core.execution.backfill import BulkActionStatus

    cancelled = []
    for run in active_spending_runs(instance):
        if hold_mode == "cancel" or run.status in NOT_RUNNING:
            cancel_run(instance, run)
            cancelled.append(run.run_id)
    stopped = []
    for backfill in instance.get_backfills(status=BulkActionStatus.REQUESTED):
        selection = backfill.asset_selection
        if (selection is not None and SPENDING_ASSET in selection) or backfill.job_name in SPENDING_JOBS:
            instance.update_backfill(backfill.with_status(BulkActionStatus.CANCELING))
            stopped.append(backfill.backfill_id)
    return cancelled, stopped


def active_spending_runs(instance: dg.DagsterInstance) -> list[dg.DagsterRun]:
    return [r for r in instance.get_runs(filters=dg.RunsFilter(statuses=ACTIVE_STATUSES)) if spends(r)]
