"""Sensors: the credit sensor that halts spending, and the alerts for failed runs and checks."""

import json
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import dagster as dg
from dagster._core.storage.asset_check_execution_record import (
    AssetCheckExecutionRecordStatus,
)

from eagle3_assets.common.registry import run_datasets
from eagle3_assets.money import open_ledger, view
from eagle3_assets.money.hold import active_spending_runs, cancel_run, cancel_spending, get_hold, lift_hold, set_hold
from eagle3_assets.money.ledger import Figures, SpendLedger
from eagle3_assets.money.policy import (
    Account,
    Crossing,
    LedgerGap,
    SpendPolicy,
    account_moves,
    crossed,
    figures,
)
from eagle3_assets.money.settle import settle_idle
from eagle3_resources.alerts import AlertSink
from eagle3_resources.storage import DataStore

SPEND_ASSET = dg.AssetKey("spend")  # the observable asset in money/asset.py
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
    """One tick, in phases: read the account and the ledger; hold (or lift); stop runs over their own threshold;
    settle (money/settle.py); watch the account for anomalies; observe the `spend` asset when a figure changed."""
    tick = _Tick.start(context, spend_policy, store, alerts)
    seen = _read(tick)
    hold = _hold_or_lift(tick, seen)
    over = _stop_runs_over_their_threshold(tick, seen)
    settled = settle_idle(tick.ledger, store.layout, spend_policy, budget_s=SETTLE_BUDGET_S, log=context.log)
    watch = _watch_account(tick, seen)
    cursor = _next_cursor(tick, seen, over, watch)
    observation, cursor["observed"] = _spend_observation(tick, seen, hold, watch, settled)
    return dg.SensorResult(asset_events=[observation] if observation else [], cursor=json.dumps(cursor))


@dataclass(frozen=True)
class _Tick:
    """One evaluation of the credit sensor: what every phase reads, opened once."""

    instance: dg.DagsterInstance
    policy: SpendPolicy
    ledger: SpendLedger
    alerts: AlertSink
    log: Any  # the sensor's logger (info, warning)
    cursor: dict[str, Any]  # the last tick's state; reading the account records `account_unreadable` in it
    active: list[str]  # the ids of the spending runs in flight

    @classmethod
    def start(
        cls, context: dg.SensorEvaluationContext, policy: SpendPolicy, store: DataStore, alerts: AlertSink
    ) -> "_Tick":
        cursor = json.loads(context.cursor) if context.cursor else {}
        ledger = open_ledger(store.layout)
        active = [r.run_id for r in active_spending_runs(context.instance)]
        return cls(context.instance, policy, ledger, alerts, context.log, cursor, active)


@dataclass(frozen=True)
class _Reading:
    """What the tick read: the account (None: no key, or unreadable), the ledger's figures, what crossed."""

    account: Account | None
    ledger: Figures
    figs: dict[str, Any]  # both, as alerts carry them
    thresholds: dict[str, float | None]
    crossing: Crossing


@dataclass(frozen=True)
class _Watch:
    """The account's anomalies this tick, and the ledger gap (None without an account)."""

    found: list[str]
    gap: LedgerGap | None


def _read(tick: _Tick) -> _Reading:
    ledger = tick.ledger.figures(tick.active)
    account = _read_account(tick, ledger)
    thresholds = tick.policy.thresholds()
    return _Reading(account, ledger, figures(account, ledger), thresholds, crossed(thresholds, account, ledger))


def _read_account(tick: _Tick, ledger: Figures) -> Account | None:
    try:
        account = tick.policy.read_account()
        if account is not None and tick.cursor.pop("account_unreadable", None):
            tick.alerts.send("The account can be read again", figures(account, ledger), tick.log.info)
        return account
    except Exception as e:  # the ledger still protects us; say so loudly, once
        message = (
            f"could not read the account ({type(e).__name__}: {e}); the balance threshold is not enforced, "
            "the ledger's are"
        )
        tick.log.warning(message)
        if not tick.cursor.get("account_unreadable"):
            tick.alerts.send("Spend watch degraded: " + message, figures(None, ledger), tick.log.warning)
        tick.cursor["account_unreadable"] = True
        return None


def _hold_or_lift(tick: _Tick, seen: _Reading) -> dict[str, Any] | None:
    """Lift the hold once no threshold is crossed (where the balance could be judged), set it when one is; while it
    stands, cancel the spending runs and backfills its mode says. Returns the hold, if one stands."""
    hold = get_hold(tick.ledger)
    judged = seen.account is not None or seen.thresholds["min_balance_usd"] is None  # the balance could be read
    if hold and not seen.crossing.reasons and judged:
        lift_hold(tick.ledger, "no threshold is crossed any more")
        tick.alerts.send("Spending hold lifted: no threshold is crossed any more", seen.figs, tick.log.info)
        hold = None
    if seen.crossing.reasons and not hold:
        hold = set_hold(tick.ledger, seen.crossing.reasons, seen.figs, seen.thresholds)
        alert_in_runs(
            tick.instance,
            tick.active,
            tick.alerts.send(
                "Spending halted: "
                + "; ".join(seen.crossing.reasons)
                + f" (in-flight requests: {tick.policy.hold_action})",
                seen.figs,
                tick.log.warning,
            ),
        )
    if hold:
        cancelled, stopped = cancel_spending(tick.instance, tick.policy.hold_action)
        if cancelled or stopped:
            alert_in_runs(
                tick.instance,
                cancelled,
                tick.alerts.send(
                    "Spending runs cancelled while the hold stands",
                    {"runs": cancelled, "backfills": stopped, "hold": hold["reasons"]},
                    tick.log.warning,
                ),
            )
    return hold


def _stop_runs_over_their_threshold(tick: _Tick, seen: _Reading) -> list[str]:
    """A run over max_run_usd is about that run: it is cancelled and alerted once; nothing else is held."""
    alerted = set(tick.cursor.get("runs_over") or [])
    for run_id, why in seen.crossing.runs.items():
        run = tick.instance.get_run_by_id(run_id)
        if run is not None and not run.is_finished and run.status != dg.DagsterRunStatus.CANCELING:
            cancel_run(tick.instance, run)
        if run_id not in alerted:
            alert_in_runs(
                tick.instance,
                [run_id],
                tick.alerts.send(f"Run over its spend threshold, cancelled: {why}", seen.figs, tick.log.warning),
            )
    return sorted(set(seen.crossing.runs))


def _watch_account(tick: _Tick, seen: _Reading) -> _Watch:
    """Alert on anomalies: account moves (events, each alerted) and ledger drift (a level: alerted when it opens or
    closes)."""
    found = account_moves(tick.cursor.get("account"), seen.account)
    for move in found:
        alert_in_runs(
            tick.instance, tick.active, tick.alerts.send(f"Spend anomaly: {move}", seen.figs, tick.log.warning)
        )
    if seen.account is None:
        return _Watch(found, None)
    billed, tolerance = seen.ledger.total.settled_usd, tick.policy.tolerance_usd
    gap = LedgerGap.measure(tick.cursor, seen.account, billed, tolerance)
    if tick.cursor.get("offset_usd") is None and abs(gap.offset_usd) > tolerance:
        tick.alerts.send(
            f"Account usage and the ledger start ${gap.offset_usd:+.4f} apart (the key has spent elsewhere); "
            "from now on drift from this offset is watched",
            seen.figs,
            tick.log.info,
        )
    if gap.open:
        found.append(gap.describe(seen.account, billed, tolerance))
    if gap.open != bool(tick.cursor.get("gap_open")):
        figs = {**seen.figs, "drift_usd": round(gap.drift_usd, 6)}
        if gap.open:
            alert_in_runs(
                tick.instance, tick.active, tick.alerts.send(f"Spend anomaly: {found[-1]}", figs, tick.log.warning)
            )
        else:
            tick.alerts.send("Ledger and account agree again", figs, tick.log.info)
    return _Watch(found, gap)


def _next_cursor(tick: _Tick, seen: _Reading, over: list[str], watch: _Watch) -> dict[str, Any]:
    """The state the next tick starts from: the account and the gap as read now (as last read, when unreadable)."""
    cursor: dict[str, Any] = {"runs_over": over}
    if seen.account is not None and watch.gap is not None:
        cursor.update(account=asdict(seen.account), offset_usd=watch.gap.offset_usd, gap_open=watch.gap.open)
    else:
        kept = ("account", "offset_usd", "gap_open", "account_unreadable")
        cursor.update({k: tick.cursor[k] for k in kept if k in tick.cursor})
    return cursor


def _spend_observation(
    tick: _Tick, seen: _Reading, hold: dict[str, Any] | None, watch: _Watch, settled: dict[str, Any]
) -> tuple[dg.AssetObservation | None, dict | None]:
    """The `spend` asset's observation, when a figure changed or the heartbeat is due (not on every tick)."""
    account = asdict(seen.account) if seen.account else None
    figures = view.current_figures(tick.instance, tick.ledger, account, hold, seen.thresholds, tick.active)
    figures["anomalies"] = "; ".join(watch.found) or "none"
    if watch.gap is not None:
        figures["account_minus_ledger_offset_usd"] = round(watch.gap.offset_usd, 6)
        figures["drift_usd"] = round(watch.gap.drift_usd, 6)
    now, last = time.time(), tick.cursor.get("observed")
    if not view.due(figures, last, now) and not settled:
        return None, last
    metadata = view.observation_metadata(
        {**figures, **({"settled_this_tick": settled} if settled else {})},
        view.picture(tick.ledger, seen.thresholds, hold),
    )
    return (
        dg.AssetObservation(asset_key=SPEND_ASSET, description=view.headline(figures, hold), metadata=metadata),
        {"fingerprint": view.fingerprint(figures), "t": now},
    )


def alert_in_runs(instance: dg.DagsterInstance, run_ids: Iterable[str], alert: str) -> None:
    """An alert also goes into the log of each run it is about, where an operator looks first."""
    for run_id in run_ids:
        run = instance.get_run_by_id(run_id)
        if run is not None:
            instance.report_engine_event(alert, dagster_run=run)


def _failed_checks(instance: dg.DagsterInstance, run_id: str) -> list[dict[str, Any]]:
    out = []
    for entry in instance.all_logs(run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION):
        if entry.dagster_event is None:  # a plain log line, never of this type
            continue
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
    repository = context.repository_def
    assert repository is not None, "a sensor of the code location has its repository"
    for key in sorted(repository.asset_graph.asset_check_keys, key=lambda k: k.to_user_string()):
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
