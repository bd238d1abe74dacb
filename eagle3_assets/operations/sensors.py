"""Sensors: the credit sensor that halts spending, and the alerts for failed runs and checks."""

import json
import time
from collections.abc import Iterable, Iterator, Sequence, Set
from dataclasses import asdict, dataclass
from typing import Any

import dagster as dg
from dagster._core.storage.asset_check_execution_record import (
    AssetCheckExecutionRecordStatus,
)
from dagster._core.storage.event_log.sql_event_log import SqlEventLogStorage

from eagle3_assets.common.per_dataset import is_summary
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


ALERT_PAGE = 500  # check evaluations read per query
ALERT_BUDGET_S = 30.0  # a tick alerts for this long at most (a down webhook waits its timeout); the rest is next tick's


def check_evaluations(
    instance: dg.DagsterInstance, after: int | None, limit: int, ascending: bool = True
) -> Sequence[dg.EventLogRecord]:
    """The instance's ASSET_CHECK_EVALUATION events with a storage id above `after` (oldest first by default).

    One event per evaluation, per partition. Their storage ids are global on every storage: PostgreSQL's event log,
    and, in Dagster's default SQLite storage, the index file each check evaluation is copied into (each run's own file
    numbers its events from 1). That storage's `get_event_records` reads the run files for this event type and refuses
    a storage-id cursor, so every SQL storage is read with the SQL storages' own query, which reads the index.
    """
    storage = instance.event_log_storage
    records_filter = dg.EventRecordsFilter(dg.DagsterEventType.ASSET_CHECK_EVALUATION, after_cursor=after)
    if isinstance(storage, SqlEventLogStorage):
        return SqlEventLogStorage.get_event_records(storage, records_filter, limit=limit, ascending=ascending)
    return storage.get_event_records(records_filter, limit=limit, ascending=ascending)


def _evaluations_after(instance: dg.DagsterInstance, after: int) -> Iterator[dg.EventLogRecord]:
    while True:
        page = check_evaluations(instance, after, ALERT_PAGE)
        yield from page
        if len(page) < ALERT_PAGE:
            return
        after = page[-1].storage_id


def _check_name(key: dg.AssetCheckKey) -> str:
    return f"{key.asset_key.to_user_string()}.{key.name}"


def _alert_failed_check(
    context: dg.SensorEvaluationContext, alerts: AlertSink, checks: Set[dg.AssetCheckKey], entry: dg.EventLogEntry
) -> None:
    """The alert for one evaluation, if it failed a non-blocking check of this code location."""
    assert entry.dagster_event is not None, "an ASSET_CHECK_EVALUATION record is a Dagster event"
    ev = entry.dagster_event.asset_check_evaluation_data
    if ev.passed or ev.asset_check_key not in checks:
        return
    if ev.blocking:
        return  # it failed its run: run_failure_alert says so
    instance = context.instance
    figs: dict[str, Any] = {"severity": ev.severity.value, "description": ev.description, "run_id": entry.run_id}
    figs.update({k: v.value if hasattr(v, "value") else str(v) for k, v in (ev.metadata or {}).items()})
    run = instance.get_run_by_id(entry.run_id) if entry.run_id else None
    partition = f" [{ev.partition}]" if ev.partition else _partition_label(run)
    title = f"Check failed: {_check_name(ev.asset_check_key)}{partition}"
    alert_in_runs(instance, [entry.run_id] if run else [], alerts.send(title, figs, context.log.warning))


def _from_per_check_cursor(
    instance: dg.DagsterInstance, state: dict[str, Any], checks: Set[dg.AssetCheckKey]
) -> tuple[int, list[dg.EventLogEntry]]:
    """The cursor this sensor kept before it walked the event log, read once: per check (`asset.check`), the
    executions below `from` and those in `handled` had been alerted. The walk starts after the last evaluation
    recorded now; the failed executions that cursor had not reached are returned, to be alerted first. (An
    evaluation recorded between the two reads is alerted twice, never missed.)"""
    newest = check_evaluations(instance, None, 1, ascending=False)
    after = newest[0].storage_id if newest else 0
    missed = []
    for key in checks:
        old = state.get(_check_name(key)) or {"from": 0, "handled": []}  # no state then: no executions then
        handled, cursor = set(old["handled"]), None
        while True:
            records = instance.event_log_storage.get_asset_check_execution_history(key, ALERT_PAGE, cursor=cursor)
            missed += [
                r.event
                for r in records
                if r.id >= old["from"]
                and r.id not in handled
                and r.status == AssetCheckExecutionRecordStatus.FAILED
                and r.event is not None
            ]
            if len(records) < ALERT_PAGE or records[-1].id < old["from"]:
                break
            cursor = records[-1].id
    return after, sorted(missed, key=lambda e: e.timestamp)


@dg.sensor(
    name="check_failure_alert",
    minimum_interval_seconds=10,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Alerts once per failed evaluation of a non-blocking asset check, every partition's, including those "
    "recorded while no daemon ran (blocking ones fail their run: run_failure_alert).",
)
def check_failure_alert(context: dg.SensorEvaluationContext, alerts: AlertSink):
    """Every failed evaluation of every non-blocking check of this code location, once, in the order recorded.

    Walks the instance's ASSET_CHECK_EVALUATION events after the cursor, `{"after": <storage id of the last one
    handled>}`: one event per evaluation and partition, so none is collapsed into its check's latest, and the
    evaluations of runs that ended while no daemon ran are in the log like any other. With no cursor (first start)
    the walk starts at the beginning of history. A later evaluation of the same check and partition is another
    event: a pass un-alerts nothing, a failure is alerted again.
    """
    repository = context.repository_def
    assert repository is not None, "a sensor of the code location has its repository"
    # `all_datasets` sums up the partitions' evaluations, each alerted on its own
    checks = {key for key in repository.asset_graph.asset_check_keys if not is_summary(key)}
    state = json.loads(context.cursor) if context.cursor else {}
    backlog: list[dg.EventLogEntry] = []
    if state and "after" not in state:  # the per-check cursor of earlier versions
        after, backlog = _from_per_check_cursor(context.instance, state, checks)
    else:
        after = int(state.get("after", 0))
    for entry in backlog:
        _alert_failed_check(context, alerts, checks, entry)
    deadline = time.monotonic() + ALERT_BUDGET_S
    for record in _evaluations_after(context.instance, after):
        _alert_failed_check(context, alerts, checks, record.event_log_entry)
        after = record.storage_id
        if time.monotonic() > deadline:
            context.log.info(f"check_failure_alert: {ALERT_BUDGET_S:.0f} s of alerts this tick; the rest next tick")
            break
    return dg.SensorResult(cursor=json.dumps({"after": after}))
