"""Sensors: the credit sensor that halts spending, and the alerts for failed runs and checks."""

import asyncio
import json
import time
from dataclasses import asdict
from typing import Any

import dagster as dg
from dagster._core.storage.asset_check_execution_record import (
    AssetCheckExecutionRecordStatus,
)

from eagle3_assets.common.registry import run_datasets
from eagle3_assets.money import get_hold, lift_hold, open_ledger, set_hold, view
from eagle3_assets.money.hold import active_spending_runs, cancel_run, cancel_spending
from eagle3_assets.money.ledger import Figures
from eagle3_assets.money.policy import (
    Account,
    LedgerGap,
    SpendPolicy,
    account_moves,
    crossed,
    figures,
)
from eagle3_assets.money.settle import settle_due
from eagle3_assets.money.writer import LedgerWriter
from eagle3_assets.stages.completions.run import recover_idle_datasets
from eagle3_resources.alerts import AlertSink
from eagle3_resources.completions.openrouter_account import OpenRouterAccount
from eagle3_resources.storage import DataStore

SPEND_ASSET = dg.AssetKey("spend")  # the observable asset in assets/spend.py
SETTLE_BUDGET_S = 8.0  # look-ups per tick, at most (a sensor that times out sets no hold: the hold is decided first)


@dg.sensor(
    name="credit_sensor",
    minimum_interval_seconds=5,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Holds spending when the account balance or the ledger crosses a SpendPolicy threshold (queued "
    "spending runs are cancelled; running ones drain, or are cancelled with EAGLE3_HOLD_MODE=cancel); stops a run "
    "over its own threshold; looks up unsettled generations; alerts on account anomalies.",
)
def credit_sensor(context: dg.SensorEvaluationContext, spend_policy: SpendPolicy, store: DataStore, alerts: AlertSink):
    instance = context.instance
    cursor = json.loads(context.cursor) if context.cursor else {}
    ledger = open_ledger(store.layout)
    active = [r.run_id for r in active_spending_runs(instance)]
    figs_ledger = ledger.figures(active)
    account = _read_account(spend_policy, cursor, figs_ledger, alerts, context.log)
    figs = figures(account, figs_ledger)
    thresholds = spend_policy.thresholds()
    crossing = crossed(thresholds, account, figs_ledger)
    hold = get_hold(ledger)
    judged = account is not None or thresholds["min_balance_usd"] is None  # the balance could be read where it matters
    if hold and not crossing.reasons and judged:
        lift_hold(ledger, "no threshold is crossed any more")
        alerts.send("Spending hold lifted: no threshold is crossed any more", figs, context.log.info)
        hold = None
    if crossing.reasons and not hold:
        hold = set_hold(ledger, crossing.reasons, figs, thresholds)
        alert_in_runs(
            instance,
            active,
            alerts.send(
                "Spending halted: "
                + "; ".join(crossing.reasons)
                + f" (in-flight requests: {spend_policy.hold_action})",
                figs,
                context.log.warning,
            ),
        )
    if hold:
        cancelled, stopped = cancel_spending(instance, spend_policy.hold_action)
        if cancelled or stopped:
            alert_in_runs(
                instance,
                cancelled,
                alerts.send(
                    "Spending runs cancelled while the hold stands",
                    {"runs": cancelled, "backfills": stopped, "hold": hold["reasons"]},
                    context.log.warning,
                ),
            )
    over = _stop_runs_over_their_threshold(instance, crossing.runs, cursor, figs, alerts, context.log)
    settled = _settle(spend_policy, store, ledger, context.log)
    found, gap = _watch_account(
        cursor, account, figs_ledger, spend_policy.tolerance_usd, figs, alerts, context.log, instance, active
    )
    new_cursor: dict[str, Any] = {"runs_over": over}
    if account is not None:
        new_cursor.update(account=asdict(account), offset_usd=gap.offset_usd, gap_open=gap.open)
    else:
        new_cursor.update(
            {k: cursor[k] for k in ("account", "offset_usd", "gap_open", "account_unreadable") if k in cursor}
        )
    observation, new_cursor["observed"] = _spend_observation(
        instance, ledger, account, hold, thresholds, found, gap, settled, cursor.get("observed"), active
    )
    return dg.SensorResult(asset_events=[observation] if observation else [], cursor=json.dumps(new_cursor))


def _spend_observation(
    instance,
    ledger,
    account: Account | None,
    hold,
    thresholds,
    anomalies: list[str],
    gap: LedgerGap | None,
    settled: dict[str, Any],
    last: dict[str, Any] | None,
    active: list[str],
) -> tuple[dg.AssetObservation | None, dict | None]:
    """The `spend` asset's observation, when a figure changed or the heartbeat is due (not on every tick)."""
    figures = view.current_figures(instance, ledger, asdict(account) if account else None, hold, thresholds, active)
    figures["anomalies"] = "; ".join(anomalies) or "none"
    if gap is not None:
        figures["account_minus_ledger_offset_usd"] = round(gap.offset_usd, 6)
        figures["drift_usd"] = round(gap.drift_usd, 6)
    now = time.time()
    if not view.due(figures, last, now) and not settled:
        return None, last
    metadata = view.observation_metadata(
        {**figures, **({"settled_this_tick": settled} if settled else {})}, view.picture(ledger, thresholds, hold)
    )
    return (
        dg.AssetObservation(asset_key=SPEND_ASSET, description=view.headline(figures, hold), metadata=metadata),
        {"fingerprint": view.fingerprint(figures), "t": now},
    )


def alert_in_runs(instance: dg.DagsterInstance, run_ids, alert: str) -> None:
    """An alert also goes into the log of each run it is about, where an operator looks first."""
    for run_id in run_ids:
        run = instance.get_run_by_id(run_id)
        if run is not None:
            instance.report_engine_event(alert, dagster_run=run)


def _read_account(
    policy: SpendPolicy, cursor: dict[str, Any], ledger: Figures, alerts: AlertSink, log
) -> Account | None:
    try:
        account = policy.read_account()
        if account is not None and cursor.pop("account_unreadable", None):
            alerts.send("The account can be read again", figures(account, ledger), log.info)
        return account
    except Exception as e:  # the ledger still protects us; say so loudly, once
        message = f"could not read the account ({type(e).__name__}: {e}); the balance threshold is not enforced, the ledger's are"
        log.warning(message)
        if not cursor.get("account_unreadable"):
            alerts.send("Spend watch degraded: " + message, figures(None, ledger), log.warning)
        cursor["account_unreadable"] = True
        return None


def _stop_runs_over_their_threshold(
    instance: dg.DagsterInstance,
    runs: dict[str, str],
    cursor: dict[str, Any],
    figs: dict[str, Any],
    alerts: AlertSink,
    log,
) -> list[str]:
    """A run over max_run_usd is about that run: it is cancelled and alerted once; nothing else is held."""
    alerted = set(cursor.get("runs_over") or [])
    for run_id, why in runs.items():
        run = instance.get_run_by_id(run_id)
        if run is not None and not run.is_finished and run.status != dg.DagsterRunStatus.CANCELING:
            cancel_run(instance, run)
        if run_id not in alerted:
            alert_in_runs(
                instance, [run_id], alerts.send(f"Run over its spend threshold, cancelled: {why}", figs, log.warning)
            )
    return sorted(set(runs))


def _settle(policy: SpendPolicy, store: DataStore, ledger, log) -> dict[str, Any]:
    """Datasets no run is completing get their unfinished attempts put right; due look-ups run within a budget."""
    recovered = recover_idle_datasets(store.layout, ledger)
    endpoint = policy.account_endpoint()
    out: dict[str, Any] = {"recovered": recovered} if recovered else {}
    if endpoint is None:
        return out

    async def look_up():
        with LedgerWriter(ledger, on_error=log.warning) as writer:
            async with OpenRouterAccount(*endpoint) as account:
                return await settle_due(
                    writer, account.generation, deadline_s=SETTLE_BUDGET_S, horizon_s=policy.horizon_s
                )

    try:
        report = asyncio.run(look_up())
    except Exception as e:  # look-ups are retried next tick; the hold never depends on them
        log.warning(f"looking up unsettled generations failed ({type(e).__name__}: {e})")
        return out
    if report.looked_up or report.expired:
        log.info(report.line())
        out.update(found=len(report.found_ids), found_usd=round(report.found_usd, 6), expired=len(report.expired))
    return out


def _watch_account(
    cursor: dict[str, Any],
    account: Account | None,
    ledger: Figures,
    tolerance: float,
    figs: dict[str, Any],
    alerts: AlertSink,
    log,
    instance,
    active: list[str],
) -> tuple[list[str], LedgerGap | None]:
    """Alert on anomalies: account moves (events, each alerted) and ledger drift (a level: alerted when it opens or closes)."""
    found = account_moves(cursor.get("account"), account)
    for move in found:
        alert_in_runs(instance, active, alerts.send(f"Spend anomaly: {move}", figs, log.warning))
    if account is None:
        return found, None
    billed = ledger.total.settled_usd
    gap = LedgerGap.measure(cursor, account, billed, tolerance)
    if cursor.get("offset_usd") is None and abs(gap.offset_usd) > tolerance:
        alerts.send(
            f"Account usage and the ledger start ${gap.offset_usd:+.4f} apart (the key has spent elsewhere); "
            "from now on drift from this offset is watched",
            figs,
            log.info,
        )
    if gap.open:
        found.append(gap.describe(account, billed, tolerance))
    if gap.open != bool(cursor.get("gap_open")):
        if gap.open:
            alert_in_runs(
                instance,
                active,
                alerts.send(f"Spend anomaly: {found[-1]}", {**figs, "drift_usd": round(gap.drift_usd, 6)}, log.warning),
            )
        else:
            alerts.send("Ledger and account agree again", {**figs, "drift_usd": round(gap.drift_usd, 6)}, log.info)
    return found, gap


def _failed_checks(instance: dg.DagsterInstance, run_id: str) -> list[dict[str, Any]]:
    out = []
    for entry in instance.all_logs(run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION):
        ev = entry.dagster_event.asset_check_evaluation_data
        if not ev.passed and ev.blocking:  # the others are alerted by check_failure_alert
            out.append(
                {
                    "check": f"{ev.asset_key.to_user_string()}.{ev.check_name}",
                    "severity": ev.severity.value,
                    "description": ev.description,
                }
            )
    return out


def _partition_label(run: dg.DagsterRun | None) -> str:
    if run is None:
        return ""
    datasets = run_datasets(run.tags)
    return f" [{','.join(datasets)}]" if datasets else ""


@dg.run_failure_sensor(
    name="run_failure_alert",
    default_status=dg.DefaultSensorStatus.RUNNING,
    minimum_interval_seconds=10,
    description="Alerts on every failed run, with its error and the blocking checks that failed it.",
)
def run_failure_alert(context: dg.RunFailureSensorContext, alerts: AlertSink):
    run = context.dagster_run
    alert_in_runs(
        context.instance,
        [run.run_id],
        alerts.send(
            f"Run failed: {run.job_name}{_partition_label(run)}",
            {
                "run_id": run.run_id,
                "error": context.failure_event.message,
                "failed_checks": _failed_checks(context.instance, run.run_id),
            },
            context.log.error,
        ),
    )


CHECK_HISTORY_WINDOW = 200  # executions of one check read per tick; far more than run between two ticks


def _resolved(instance: dg.DagsterInstance, record) -> bool:
    if record.status != AssetCheckExecutionRecordStatus.PLANNED:
        return True
    run = instance.get_run_by_id(record.run_id)  # a check planned by a run that ended never evaluates
    return run is None or run.is_finished


def newly_resolved(records: list, state: dict[str, Any] | None, is_resolved) -> tuple[list, dict[str, Any]]:
    """The executions of one check (ascending ids) resolved since `state`, and the state to keep.

    State: `from`, the oldest execution still in flight at the last look (runs of several partitions
    evaluate a check concurrently and finish in any order), and `handled`, the ids above it already
    returned. Without a state only the latest execution counts (no flood of old history).
    """
    state = state or {"from": records[-1].id, "handled": []}
    handled = set(state["handled"])
    out, pending = [], []
    for record in records:
        if record.id < state["from"] or record.id in handled:
            continue
        if is_resolved(record):
            out.append(record)
            handled.add(record.id)
        else:
            pending.append(record.id)
    start = min(pending) if pending else records[-1].id + 1
    return out, {"from": start, "handled": sorted(i for i in handled if i >= start)}


@dg.sensor(
    name="check_failure_alert",
    minimum_interval_seconds=10,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Alerts once per failed non-blocking asset check (blocking ones fail their run: run_failure_alert).",
)
def check_failure_alert(context: dg.SensorEvaluationContext, alerts: AlertSink):
    """Every failed evaluation of every non-blocking check, once, with its figures.

    The cursor is `newly_resolved`'s state per check, over each check's execution history (not a
    global event cursor: SQLite event storage is run-sharded and has none).
    """
    state: dict[str, dict[str, Any]] = json.loads(context.cursor) if context.cursor else {}
    instance = context.instance
    storage = instance.event_log_storage
    for key in sorted(context.repository_def.asset_graph.asset_check_keys, key=lambda k: k.to_user_string()):
        name = f"{key.asset_key.to_user_string()}.{key.name}"
        records = sorted(storage.get_asset_check_execution_history(key, limit=CHECK_HISTORY_WINDOW), key=lambda r: r.id)
        if not records:
            continue
        resolved, state[name] = newly_resolved(records, state.get(name), lambda r: _resolved(instance, r))
        for record in resolved:
            if record.status != AssetCheckExecutionRecordStatus.FAILED or record.event is None:
                continue
            ev = record.event.dagster_event.asset_check_evaluation_data
            if ev.blocking:
                continue  # it failed its run: run_failure_alert says so
            figs = {"severity": ev.severity.value, "description": ev.description, "run_id": record.run_id}
            figs.update({k: v.value if hasattr(v, "value") else str(v) for k, v in (ev.metadata or {}).items()})
            partition = (
                f" [{ev.partition}]" if ev.partition else _partition_label(instance.get_run_by_id(record.run_id))
            )
            alert_in_runs(
                instance, [record.run_id], alerts.send(f"Check failed: {name}{partition}", figs, context.log.warning)
            )
    return dg.SensorResult(cursor=json.dumps(state, sort_keys=True))
