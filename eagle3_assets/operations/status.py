"""`eagle3 status`: the operator's picture in a terminal (over SSH, no UI needed).

What it reads, and nothing else (it never builds the code location, so it answers in a second or two):

- the Dagster instance: each stage's latest materialization (per dataset for the partitioned
  ones) and its metadata; the latest evaluation of each asset check per dataset; the runs that are
  queued, starting, started or being cancelled;
- the data root's spend ledger: billed in all and today, in flight, unsettled, per dataset; the
  spending hold.

`gather_status` returns a `Status`; `render_text` and `as_json` turn it into what the command
prints. Every section is read on its own: one that cannot be read is reported in `errors` and the
others are still shown.

Check evaluations and partitions: an evaluation that names its partition is that dataset's. One
that does not (older instances, runs over several datasets that judged each one and combined the
verdicts) belongs to every dataset its run covers (`registry.run_datasets`); when such a combined
verdict failed and lists `failed_datasets` in its metadata, only those datasets are shown failing.

Figures of a run over several datasets: a stage's metadata may hold the run's totals rather than the
partition's. Where the metadata has a per-dataset figure (`per_dataset`) it is used; otherwise a
figure that is the same for every partition the run materialized is marked `shared` (printed with a
`*`): it is the run's total over its datasets, not this dataset's.

Dollars per dataset are the ledger's, never metadata's: its `dataset:<name>` scope (billed, every run,
answers kept or not), so a run over several datasets shows each its own.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

import dagster as dg
from dagster._core.storage.asset_check_execution_record import (
    COMPLETED_ASSET_CHECK_EXECUTION_RECORD_STATUSES,
    AssetCheckExecutionRecord,
)

from eagle3_assets.common.registry import DATASETS, run_datasets

# Stage -> the figures shown: (label, metadata keys tried in order). Per-dataset stages first.
PARTITIONED: dict[str, tuple[str, list[tuple[str, tuple[str, ...]]]]] = {
    "raw_prompts": ("prompts", [("rows", ("rows",)), ("tokens", ("tokens",))]),
    "completions": ("completions", [("rows", ("rows",)), ("tokens", ("completion_tokens",)), ("usd", ("cost_usd",))]),
    "token_ids": ("token_ids", [("rows", ("rows",)), ("tokens", ("tokens", "completion_tokens"))]),
}
# Where a stage's metadata keeps one entry per dataset (`per_dataset`), the keys that hold the same figure there.
PER_DATASET_KEYS: dict[str, dict[str, tuple[str, ...]]] = {
    "raw_prompts": {"rows": ("selected",)},
    "token_ids": {"rows": ("rows",), "tokens": ("tokens", "completion_tokens")},
}
UNPARTITIONED: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "merged_dataset": [("rows", ("rows",)), ("tokens", ("tokens",))],
    "hidden_states": [("samples", ("samples",)), ("tokens", ("tokens",)), ("bytes", ("bytes", "bytes_written"))],
    # The real accept length (lossless speculative decoding with the target) leads; the simulated one (teacher-forced
    # on the eval split, `accept_length` in materializations before it was named so) is beside it, named.
    "eagle3_drafter": [
        ("accept_length", ("accept_length_real",)),
        ("untrained", ("accept_length_real_untrained",)),
        ("simulated", ("accept_length_simulated", "accept_length")),
        ("final_loss", ("final_loss",)),
    ],
}
IN_PROGRESS = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
]
CHECK_PAGE = 200  # executions of one check read per query
CHECK_HISTORY_MAX = 2000  # at most this many per check, looking for a dataset's latest evaluation
WIDTH = 118


@dataclass
class CheckState:
    """The latest completed evaluation of one asset check for one dataset (or for an unpartitioned stage)."""

    name: str
    passed: bool
    severity: str  # WARN | ERROR
    description: str
    run_id: str
    timestamp: float
    partition: str | None  # as recorded; None: attributed to the dataset by its run's tags

    @property
    def label(self) -> str:
        return f"{self.severity} {self.name}"


@dataclass
class StageState:
    """One stage (of one dataset, for the per-dataset stages): its latest materialization and checks."""

    asset: str
    materialized: bool = False
    timestamp: float | None = None
    run_id: str | None = None
    figures: dict[str, Any] = field(default_factory=dict)  # label -> value (None: not in the metadata)
    shared: list[str] = field(default_factory=list)  # labels whose value is the run's total over several datasets
    checks: list[CheckState] = field(default_factory=list)

    @property
    def failing(self) -> list[CheckState]:
        return [c for c in self.checks if not c.passed]


@dataclass
class DatasetStatus:
    dataset: str
    stages: dict[str, StageState]


@dataclass
class RunState:
    run_id: str
    status: str
    job: str
    datasets: list[str]
    created: float
    started: float | None
    spends: bool
    progress: dict[str, str] = field(default_factory=dict)  # dataset -> its latest progress line, this run's


@dataclass
class Money:
    ledger: str
    day: str
    billed_usd: float = 0.0
    today_usd: float = 0.0
    in_flight: int = 0
    in_flight_worst_usd: float = 0.0
    unsettled: int = 0  # attempts with a generation id and no bill yet
    unidentified: int = 0  # attempts cut before their id arrived
    unsettled_worst_usd: float = 0.0
    expired_worst_usd: float = 0.0
    per_dataset: dict[str, dict[str, float]] = field(default_factory=dict)  # only datasets the ledger has figures for
    hold: dict[str, Any] | None = None  # since, reasons, thresholds


@dataclass
class Status:
    at: float
    dagster_home: str | None
    data_dir: str | None
    datasets: list[DatasetStatus] = field(default_factory=list)
    stages: list[StageState] = field(default_factory=list)  # the unpartitioned stages
    runs: list[RunState] = field(default_factory=list)
    money: Money | None = None
    errors: list[str] = field(default_factory=list)


# -- gathering ------------------------------------------------------------------------------------


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
    if not row.materialized or len(runs.datasets(row.run_id)) < 2:
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
        asset = key.asset_key.to_user_string()
        if asset in PARTITIONED:
            for ds, check in latest_checks(instance, key, names, runs).items():
                rows[names.index(ds)].stages[asset].checks.append(check)
        elif asset in UNPARTITIONED:
            for check in latest_checks(instance, key, None, runs).values():
                singles[list(UNPARTITIONED).index(asset)].checks.append(check)
    status.datasets, status.stages = rows, singles


def _gather_runs(instance: dg.DagsterInstance, status: Status) -> None:
    from eagle3_assets.money.hold import spends

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
        meta = record.asset_observation.metadata
        if record.run_id == run_id and record.partition_key and record.partition_key not in out and "progress" in meta:
            out[record.partition_key] = meta["progress"].value
    return out


def _gather_money(ledger, status: Status) -> None:
    from eagle3_assets.money import ledger as L
    from eagle3_assets.money.hold import get_hold

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
    ledger,
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


# -- rendering ------------------------------------------------------------------------------------


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 48 * 3600:
        return f"{s // 3600}h{(s % 3600) // 60:02d}" if s < 10 * 3600 else f"{s // 3600}h"
    return f"{s // 86400}d"


def count(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    n = int(value)
    if abs(n) < 1_000_000:
        return f"{n:,}"
    if abs(n) < 1_000_000_000:
        return f"{n / 1e6:.1f}M"
    return f"{n / 1e9:.1f}G"


def dollars(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.4f}" if abs(value) < 1000 else f"{value:,.0f}"


def nbytes(value: Any) -> str:
    if value is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{int(value)} B"


def span(datasets: Sequence[str]) -> str:
    """A run's datasets, short: `B6`, `A1,B2`, `A1...B8` for a registry range of three or more."""
    names = list(DATASETS)
    if not datasets:
        return "-"
    idx = [names.index(d) for d in datasets if d in names]
    if len(idx) == len(datasets) >= 3 and idx == list(range(idx[0], idx[-1] + 1)):
        return f"{datasets[0]}...{datasets[-1]}"
    return ",".join(datasets)


def utc(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M UTC")


class _Paint:
    def __init__(self, on: bool):
        self.on = on

    def __call__(self, text: str, colour: str) -> str:
        codes = {"green": "32", "yellow": "33", "red": "31", "dim": "2", "bold": "1"}
        return f"\033[{codes[colour]}m{text}\033[0m" if self.on and text.strip() else text


def _checks_cell(stage: StageState) -> tuple[str, str]:
    """(text, colour) of a stage's checks in the table: ok, `2 WARN`, `1 ERROR`, or - when none was evaluated."""
    failing = stage.failing
    if not stage.checks:
        return "-", "dim"
    if not failing:
        return "ok", "green"
    worst = "ERROR" if any(c.severity == "ERROR" for c in failing) else "WARN"
    return f"{len(failing)} {worst}", "red" if worst == "ERROR" else "yellow"


# (label, width) per stage group of the dataset table: when, figures, checks
GROUP_COLUMNS = {
    "raw_prompts": [("age", 5), ("rows", 7), ("tokens", 9), ("checks", 7)],
    "completions": [("age", 5), ("rows", 7), ("tokens", 9), ("usd", 8), ("checks", 7)],
    "token_ids": [("age", 5), ("rows", 7), ("tokens", 9), ("checks", 7)],
}
GAP = "  "


def _group_width(asset: str) -> int:
    cols = GROUP_COLUMNS[asset]
    return sum(w for _, w in cols) + len(cols) - 1


def _dataset_table(status: Status, paint: _Paint) -> list[str]:
    name_w = max([7, *(len(d.dataset) for d in status.datasets)])
    head1 = f"{'':{name_w}}" + "".join(GAP + f"{PARTITIONED[a][0]:<{_group_width(a)}}" for a in GROUP_COLUMNS)
    head2 = f"{'dataset':{name_w}}" + "".join(
        GAP + " ".join(f"{label:>{w}}" if label not in ("age", "checks") else f"{label:<{w}}" for label, w in cols)
        for cols in GROUP_COLUMNS.values()
    )
    lines = [paint(head1.rstrip(), "bold"), paint(head2.rstrip(), "bold")]
    shared_any = False
    for row in status.datasets:
        line = f"{row.dataset:{name_w}}"
        notes = []
        for asset, cols in GROUP_COLUMNS.items():
            stage = row.stages[asset]
            line += GAP
            if not stage.materialized:
                line += paint(f"{'not materialized':<{_group_width(asset)}}", "dim")
                if stage.failing:
                    notes.append(f"{PARTITIONED[asset][0]}: " + ", ".join(c.label for c in stage.failing))
                continue
            cells = []
            for label, w in cols:
                if label == "age":
                    cells.append(f"{age(status.at - stage.timestamp):<{w}}")
                elif label == "checks":
                    text, colour = _checks_cell(stage)
                    cells.append(paint(f"{text:<{w}}", colour))
                else:
                    value = stage.figures.get(label)
                    text = dollars(value) if label == "usd" else count(value)
                    if label in stage.shared:
                        text += "*"
                        shared_any = True
                    cells.append(f"{text:>{w}}")
            line += " ".join(cells)
            if stage.failing:
                notes.append(f"{PARTITIONED[asset][0]}: " + ", ".join(c.label for c in stage.failing))
        lines.append(line.rstrip())
        if notes:
            indent = " " * (name_w + len(GAP))
            for wrapped in textwrap.wrap("failing: " + "; ".join(notes), WIDTH - len(indent)):
                lines.append(indent + paint(wrapped, "yellow"))
    if shared_any:
        lines.append("* the run's total over all its datasets (its metadata holds no figure of this dataset alone)")
    return lines


def _stage_table(status: Status, paint: _Paint) -> list[str]:
    lines = [paint(f"{'stage':<15} {'age':<5} {'figures':<58} checks", "bold")]
    for stage in status.stages:
        if not stage.materialized:
            lines.append(f"{stage.asset:<15} {'-':<5} " + paint("not materialized", "dim"))
            continue
        parts = []
        for label, value in stage.figures.items():
            text = nbytes(value) if label == "bytes" else count(value)
            parts.append(f"{label} {text}")
        text, colour = _checks_cell(stage)
        checks = paint(", ".join(c.label for c in stage.failing) if stage.failing else text, colour)
        lines.append(f"{stage.asset:<15} {age(status.at - stage.timestamp):<5} {'  '.join(parts):<58} {checks}")
    return lines


def _runs_lines(status: Status, paint: _Paint) -> list[str]:
    if not status.runs:
        return ["no runs in progress (queued, starting, started or cancelling)"]
    lines = [paint(f"{'run':<8}  {'status':<11} {'job':<22} {'datasets':<14} {'queued':>7} {'running':>8}", "bold")]
    for r in status.runs:
        running = age(status.at - r.started) if r.started else "-"
        colour = "red" if r.status == "CANCELING" else "yellow" if r.status in ("QUEUED", "NOT_STARTED") else "green"
        lines.append(
            f"{r.run_id[:8]:<8}  {paint(f'{r.status:<11}', colour)} {r.job[:22]:<22} {span(r.datasets)[:14]:<14} "
            f"{age(status.at - r.created):>7} {running:>8}" + ("  spends" if r.spends else "")
        )
        lines += [f"{'':10}{ds}: {line}" for ds, line in sorted(r.progress.items())]
    return lines


def _money_lines(status: Status, paint: _Paint) -> list[str]:
    m = status.money
    if m is None:
        return ["spend ledger: not read"]
    lines = [
        (
            f"billed ${m.billed_usd:.4f} in all, ${m.today_usd:.4f} today ({m.day} UTC); in flight {m.in_flight} "
            f"(worst ${m.in_flight_worst_usd:.4f}); unsettled {m.unsettled + m.unidentified} (worst ${m.unsettled_worst_usd:.4f})"
        )
    ]
    if m.expired_worst_usd:
        lines.append(f"expired unsettled (never billed, horizon passed): worst ${m.expired_worst_usd:.4f}")
    if m.per_dataset:
        per = ", ".join(
            f"{ds} ${f['billed_usd']:.4f}"
            + (
                f" (+${f['in_flight_worst_usd'] + f['unsettled_worst_usd']:.4f} open)"
                if f["in_flight_worst_usd"] + f["unsettled_worst_usd"]
                else ""
            )
            for ds, f in m.per_dataset.items()
        )
        lines += textwrap.wrap("per dataset: " + per, WIDTH, subsequent_indent="  ")
    if m.hold is None:
        lines.append("spending hold: none")
    else:
        lines.append(
            paint(f"SPENDING HELD since {utc(m.hold['since'])} ({age(status.at - m.hold['since'])} ago):", "red")
        )
        for reason in m.hold["reasons"]:
            lines += textwrap.wrap(reason, WIDTH, initial_indent="  ", subsequent_indent="    ")
        lines.append("  `eagle3 hold lift` lifts it (the credit sensor sets it again while a threshold is crossed)")
    lines.append(paint(f"ledger {m.ledger}", "dim"))
    return lines


def render_text(status: Status, colour: bool = False) -> str:
    paint = _Paint(colour)
    out = [
        paint(f"eagle3 status at {utc(status.at)}", "bold"),
        f"DAGSTER_HOME {status.dagster_home or '-'}",
        f"data root    {status.data_dir or '-'}",
        "",
    ]
    out += _dataset_table(status, paint)
    out += [""] + _stage_table(status, paint)
    out += ["", paint("runs", "bold")] + _runs_lines(status, paint)
    out += ["", paint("money", "bold")] + _money_lines(status, paint)
    if status.errors:
        out += ["", paint("could not read:", "red")] + [f"  {e}" for e in status.errors]
    return "\n".join(out) + "\n"


def _iso(t: float | None) -> str | None:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds") if t is not None else None


def as_json(status: Status) -> dict[str, Any]:
    """The same data as the text, for scripts: times as ISO 8601 UTC (and `age_s`), money in dollars."""

    def stage(s: StageState) -> dict[str, Any]:
        d = asdict(s)
        d["materialized_at"], d["age_s"] = (
            _iso(s.timestamp),
            (round(status.at - s.timestamp, 1) if s.timestamp else None),
        )
        d["checks"] = {c.name: {**asdict(c), "at": _iso(c.timestamp)} for c in s.checks}
        d["failing"] = [c.label for c in s.failing]
        d.pop("timestamp")
        return d

    money = asdict(status.money) if status.money else None
    if money and money["hold"]:
        money["hold"]["since"] = _iso(money["hold"]["since"])
    return {
        "at": _iso(status.at),
        "dagster_home": status.dagster_home,
        "data_dir": status.data_dir,
        "datasets": {d.dataset: {asset: stage(s) for asset, s in d.stages.items()} for d in status.datasets},
        "stages": {s.asset: stage(s) for s in status.stages},
        "runs": [{**asdict(r), "created": _iso(r.created), "started": _iso(r.started)} for r in status.runs],
        "money": money,
        "errors": status.errors,
    }


def colour_wanted(stream=None) -> bool:
    stream = stream or sys.stdout
    return (
        hasattr(stream, "isatty")
        and stream.isatty()
        and not os.environ.get("NO_COLOR")
        and os.environ.get("TERM") != "dumb"
    )


def status_command(as_json_output: bool = False) -> int:
    """`eagle3 status`: DAGSTER_HOME must be set (cli.dagster_home())."""
    from eagle3_assets.money import open_data_root_ledger
    from eagle3_resources.storage import default_data_dir

    ledger, ledger_error = None, None
    try:
        ledger = open_data_root_ledger()
    except Exception as e:
        ledger_error = f"spend ledger: {type(e).__name__}: {e}"
    try:
        instance = dg.DagsterInstance.get()
    except Exception as e:
        status = gather_status(None, ledger, data_dir=str(default_data_dir()))
        status.errors.insert(0, f"Dagster instance at {os.environ.get('DAGSTER_HOME')}: {type(e).__name__}: {e}")
    else:
        with instance:
            status = gather_status(instance, ledger, data_dir=str(default_data_dir()))
    if ledger_error:
        status.errors.append(ledger_error)
    if as_json_output:
        print(json.dumps(as_json(status), indent=2, default=str))
    else:
        sys.stdout.write(render_text(status, colour=colour_wanted()))
    return 1 if status.errors else 0
