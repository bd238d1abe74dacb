"""Reading what `eagle3 status` shows: the Dagster instance and the spend ledger, into a `Status`.

The instance: each stage's latest materialization (per dataset for the partitioned ones) and its
metadata; the latest evaluation of each asset check per dataset; the runs that are queued,
starting, started or being cancelled. The ledger: billed in all and today, in flight, unsettled,
per dataset; the spending hold. Every section is read on its own: one that cannot be read is
reported in `errors` and the others are still filled in.

Check evaluations and partitions: an evaluation that names its partition is that dataset's. One
that does not (older instances, runs over several datasets that judged each one and combined the
verdicts) belongs to every dataset its run covers (`registry.run_datasets`); when such a combined
verdict failed and lists `failed_datasets` in its metadata, only those datasets are shown failing. A failed
evaluation whose metadata says `standin: true` is one the tiny stand-in target explains (`common/standin.py`): its
`CheckState.standin`, shown tagged `(stand-in)`.

Figures of a run over several datasets: a stage's metadata may hold the run's totals rather than the
partition's. Where the metadata has a per-dataset figure (`per_dataset`) it is used; otherwise a
figure that is the same for every partition the run materialized is marked `shared` (printed with a
`*`): it is the run's total over its datasets, not this dataset's.

Dollars per dataset are the ledger's, never metadata's: its `dataset:<name>` scope (billed, every run,
answers kept or not), so a run over several datasets shows each its own.

The check history is read through the instance's event log storage (`dagster._core`: Dagster has no
public API for it); this module is the only one of `eagle3 status` that does.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import dagster as dg
from dagster._core.storage.asset_check_execution_record import (
    COMPLETED_ASSET_CHECK_EXECUTION_RECORD_STATUSES,
    AssetCheckExecutionRecord,
)

from eagle3_assets.common.per_dataset import is_summary
from eagle3_assets.common.registry import DATASETS, run_datasets
from eagle3_assets.common.standin import STANDIN_KEY
from eagle3_assets.money import ledger as L
from eagle3_assets.money.hold import get_hold, spends
from eagle3_assets.money.ledger import SpendLedger
from eagle3_assets.operations.status_model import (
    PARTITIONED,
    PER_DATASET_KEYS,
    UNPARTITIONED,
    CheckState,
    DatasetStatus,
    Money,
    RunState,
    StageState,
    Status,
)

IN_PROGRESS = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
]
CHECK_PAGE = 200  # executions of one check read per query
CHECK_HISTORY_MAX = 2000  # at most this many per check, looking for a dataset's latest evaluation


def _value(entry: Any) -> Any:
    """A metadata entry's plain value (MetadataValue or raw)."""
    value = getattr(entry, "value", entry)
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float, str, list, dict)):
        return value
    return str(value)


def _first(metadata: Mapping[str, Any], keys: Iterable[str]) -> Any:
    for key in keys:
        if key in metadata:
            value = _value(metadata[key])
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return value
    return None


class _Runs:
    """Runs by id, read once each."""

    def __init__(self, instance: dg.DagsterInstance):
        self.instance = instance
        self._runs: dict[str, dg.DagsterRun | None] = {}
        self._logs: dict[str, list] = {}

    def get(self, run_id: str) -> dg.DagsterRun | None:
        if run_id not in self._runs:
            self._runs[run_id] = self.instance.get_run_by_id(run_id)
        return self._runs[run_id]

    def datasets(self, run_id: str) -> list[str]:
        run = self.get(run_id)
        return run_datasets(run.tags) if run is not None else []

    def events(self, run_id: str) -> list:
        """The run's materialization and check-evaluation events."""
        if run_id not in self._logs:
            self._logs[run_id] = list(
                self.instance.all_logs(
                    run_id,
                    of_type={dg.DagsterEventType.ASSET_MATERIALIZATION, dg.DagsterEventType.ASSET_CHECK_EVALUATION},
                )
            )
        return self._logs[run_id]


def _latest_materialization(instance: dg.DagsterInstance, asset: str, partition: str | None):
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[partition] if partition else None),
        limit=1,
    ).records
    return records[0] if records else None


def _stage(record, asset: str, labels: list[tuple[str, tuple[str, ...]]], dataset: str | None) -> StageState:
    if record is None or record.asset_materialization is None:
        return StageState(asset, figures={label: None for label, _ in labels})
    metadata = record.asset_materialization.metadata or {}
    per = _value(metadata.get("per_dataset")) if dataset else None
    mine = per.get(dataset) if isinstance(per, dict) and isinstance(per.get(dataset), dict) else None
    figures = {}
    for label, keys in labels:
        own = PER_DATASET_KEYS.get(asset, {}).get(label)
        value = _first(mine, own) if mine is not None and own else None
        figures[label] = value if value is not None else _first(metadata, keys)
    return StageState(asset, True, record.timestamp, record.run_id, figures)


def _mark_shared(row: StageState, dataset: str, labels: list[tuple[str, tuple[str, ...]]], runs: _Runs) -> None:
    """Figures that every partition of a multi-dataset run recorded alike: the run's totals, not this dataset's."""
    if not row.materialized or row.run_id is None or len(runs.datasets(row.run_id)) < 2:
        return
    by_partition: dict[str, Mapping[str, Any]] = {}
    for entry in runs.events(row.run_id):
        mat = entry.asset_materialization
        if mat is not None and mat.asset_key == dg.AssetKey(row.asset) and mat.partition:
            by_partition[mat.partition] = mat.metadata or {}
    if len(by_partition) < 2:
        return
    for label, keys in labels:
        own = PER_DATASET_KEYS.get(row.asset, {}).get(label)
        per = _value(by_partition.get(dataset, {}).get("per_dataset"))
        if (
            own
            and isinstance(per, dict)
            and isinstance(per.get(dataset), dict)
            and _first(per[dataset], own) is not None
        ):
            continue  # read from the dataset's own entry
        values = {json.dumps(_first(m, keys)) for m in by_partition.values()}
        if len(values) == 1 and row.figures.get(label) is not None:
            row.shared.append(label)


def _check_keys(runs: _Runs, run_ids: Iterable[str], assets: Iterable[str]) -> set[dg.AssetCheckKey]:
    """The checks evaluated by the runs that made the latest materializations (public API, no code location needed)."""
    wanted = {dg.AssetKey(a) for a in assets}
    keys = set()
    for run_id in run_ids:
        for entry in runs.events(run_id):
            if entry.dagster_event.event_type == dg.DagsterEventType.ASSET_CHECK_EVALUATION:
                ev = entry.dagster_event.asset_check_evaluation_data
                if ev.asset_key in wanted:
                    keys.add(ev.asset_check_key)
    return keys


def _check_state(record: AssetCheckExecutionRecord, ev, passed: bool) -> CheckState:
    return CheckState(
        name=record.key.name,
        passed=passed,
        severity=ev.severity.value,
        description=ev.description or "",
        run_id=record.run_id,
        timestamp=record.create_timestamp,
        partition=record.partition or ev.partition,
        standin=not passed and _value(ev.metadata.get(STANDIN_KEY)) is True,
    )


def latest_checks(
    instance: dg.DagsterInstance, key: dg.AssetCheckKey, datasets: Sequence[str] | None, runs: _Runs | None = None
) -> dict[str | None, CheckState]:
    """The latest completed evaluation of a check per dataset (`datasets` given) or overall (key None).

    Evaluations that carry no partition are given to the datasets of their run; a combined verdict
    that failed and names `failed_datasets` fails only those.
    """
    runs = runs or _Runs(instance)
    storage = instance.event_log_storage
    out: dict[str | None, CheckState] = {}
    cursor, read = None, 0
    while read < CHECK_HISTORY_MAX:
        records = storage.get_asset_check_execution_history(
            key, limit=CHECK_PAGE, cursor=cursor, status=COMPLETED_ASSET_CHECK_EXECUTION_RECORD_STATUSES
        )
        for record in records:  # newest first
            ev = record.evaluation
            if ev is None:
                continue
            if datasets is None:
                return {None: _check_state(record, ev, ev.passed)}
            partition = record.partition or ev.partition
            covered = [partition] if partition else runs.datasets(record.run_id)
            failed = _value(ev.metadata.get("failed_datasets")) if not partition and not ev.passed else None
            for ds in covered:
                if ds in datasets and ds not in out:
                    passed = ev.passed or (isinstance(failed, list) and ds not in failed)
                    out[ds] = _check_state(record, ev, passed)
            if len(out) == len(datasets):
                return out
        read += len(records)
        if len(records) < CHECK_PAGE:
            break
        cursor = records[-1].id
    return out


def _gather_assets(instance: dg.DagsterInstance, status: Status, check_keys: Iterable[dg.AssetCheckKey] | None) -> None:
    runs = _Runs(instance)
    names = list(DATASETS)
    rows = []
    for ds in names:
        stages = {}
        for asset, (_, labels) in PARTITIONED.items():
            stages[asset] = _stage(_latest_materialization(instance, asset, ds), asset, labels, ds)
            _mark_shared(stages[asset], ds, labels, runs)
        rows.append(DatasetStatus(ds, stages))
    singles = [
        _stage(_latest_materialization(instance, asset, None), asset, labels, None)
        for asset, labels in UNPARTITIONED.items()
    ]
    materialized_by = {s.run_id for r in rows for s in r.stages.values() if s.run_id} | {
        s.run_id for s in singles if s.run_id
    }
    keys = (
        set(check_keys)
        if check_keys is not None
        else _check_keys(runs, materialized_by, [*PARTITIONED, *UNPARTITIONED])
    )
    for key in sorted(keys, key=lambda k: k.to_user_string()):
        if is_summary(key):  # every dataset's evaluations in one: each dataset's own are read instead
            continue
        asset = key.asset_key.to_user_string()
        if asset in PARTITIONED:
            for dataset, check in latest_checks(instance, key, names, runs).items():
                rows[names.index(str(dataset))].stages[asset].checks.append(check)
        elif asset in UNPARTITIONED:
            for check in latest_checks(instance, key, None, runs).values():
                singles[list(UNPARTITIONED).index(asset)].checks.append(check)
    status.datasets, status.stages = rows, singles


def _gather_runs(instance: dg.DagsterInstance, status: Status) -> None:
    records = instance.get_run_records(filters=dg.RunsFilter(statuses=IN_PROGRESS))
    status.runs = [
        RunState(
            run_id=r.dagster_run.run_id,
            status=r.dagster_run.status.value,
            job=r.dagster_run.job_name,
            datasets=run_datasets(r.dagster_run.tags),
            created=r.create_timestamp.timestamp(),
            started=r.start_time,
            spends=spends(r.dagster_run),
        )
        for r in sorted(records, key=lambda r: r.create_timestamp)
    ]
    for run in status.runs:
        run.progress = run_progress(instance, run.run_id)


def run_progress(instance: dg.DagsterInstance, run_id: str) -> dict[str, str]:
    """The latest progress observation of each dataset a running run completes (the `completions` asset's)."""
    out: dict[str, str] = {}
    records = instance.fetch_observations(
        dg.AssetKey("completions"), limit=200
    ).records  # a running run's are the newest
    for record in records:  # newest first
        meta = record.asset_observation.metadata if record.asset_observation is not None else {}
        if record.run_id == run_id and record.partition_key and record.partition_key not in out and "progress" in meta:
            out[record.partition_key] = str(meta["progress"].value)
    return out


def _gather_money(ledger: SpendLedger, status: Status) -> None:
    figs = ledger.figures(now=status.at)
    money = Money(
        ledger=ledger.location,
        day=figs.day,
        billed_usd=L.usd(figs.total.settled_usd),
        today_usd=L.usd(figs.today.settled_usd),
        in_flight=figs.live,
        in_flight_worst_usd=L.usd(figs.total.live_usd),
        unsettled=figs.unsettled,
        unidentified=figs.unidentified,
        unsettled_worst_usd=L.usd(figs.total.stuck_usd),
        expired_worst_usd=L.usd(figs.total.expired_usd),
    )
    for ds in DATASETS:
        scope = ledger.read(L.scope, f"dataset:{ds}")
        if scope.attempts:
            money.per_dataset[ds] = {
                "billed_usd": L.usd(scope.settled_usd),
                "in_flight_worst_usd": L.usd(scope.live_usd),
                "unsettled_worst_usd": L.usd(scope.stuck_usd),
                "billed_tokens": scope.settled_tokens,
                "attempts": scope.attempts,
            }
    for row in status.datasets:  # each dataset's own dollars, from its ledger scope
        stage = row.stages["completions"]
        if stage.materialized:
            stage.figures["usd"] = money.per_dataset.get(row.dataset, {}).get("billed_usd", 0.0)
            stage.shared = [label for label in stage.shared if label != "usd"]
    hold = get_hold(ledger)
    if hold is not None:
        money.hold = {"since": hold["since"], "reasons": list(hold["reasons"]), "thresholds": hold.get("thresholds")}
    status.money = money


def gather_status(
    instance: dg.DagsterInstance | None,
    ledger: SpendLedger | None,
    *,
    check_keys: Iterable[dg.AssetCheckKey] | None = None,
    now: float | None = None,
    data_dir: str | None = None,
) -> Status:
    """Everything `eagle3 status` shows. `ledger`: a SpendLedger, or None where there is none.

    `check_keys`: the asset checks to report (e.g. from the definitions); by default those evaluated
    by the runs that made the latest materializations. A section that cannot be read is named in
    `errors`; the others are still filled in.
    """
    home = os.environ.get("DAGSTER_HOME")
    status = Status(at=time.time() if now is None else now, dagster_home=home, data_dir=data_dir)
    blank = {
        asset: StageState(asset, figures={label: None for label, _ in labels})
        for asset, (_, labels) in PARTITIONED.items()
    }
    status.datasets = [
        DatasetStatus(ds, {a: StageState(a, figures=dict(s.figures)) for a, s in blank.items()}) for ds in DATASETS
    ]
    status.stages = [StageState(a, figures={label: None for label, _ in labels}) for a, labels in UNPARTITIONED.items()]
    parts = (
        [
            ("materializations and checks", lambda: _gather_assets(instance, status, check_keys)),
            ("runs", lambda: _gather_runs(instance, status)),
        ]
        if instance is not None
        else []
    )
    parts.append(("spend ledger", lambda: _gather_money(ledger, status) if ledger is not None else None))
    for what, fn in parts:
        try:
            fn()
        except Exception as e:  # one unreadable section must not hide the others
            status.errors.append(f"{what}: {type(e).__name__}: {e}")
    return status
