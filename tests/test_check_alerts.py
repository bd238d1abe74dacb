"""check_failure_alert: exactly one alert per failed evaluation of a non-blocking check, every partition's.

Real parts: the project's own instance configuration (its SQLite storage, or PostgreSQL from a real server), runs
materialized in-process before the sensor ever ticks (no daemon) and between ticks, the per-dataset check evaluations
the pipeline records (`per_dataset_results`, one per dataset of a multi-partition run), a loopback webhook, and the
sensor evaluated by Dagster across ticks and across instances opened afresh (a daemon restart) with the cursor it
returned.
"""

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG
from support import Webhook

from eagle3_assets.common.outcome import CheckOutcome, Checks
from eagle3_assets.common.per_dataset import dataset_check_specs, per_dataset_results
from eagle3_assets.common.registry import dataset_partitions
from eagle3_assets.operations import sensors
from eagle3_assets.operations.instance import INSTANCE_YAML, POSTGRES_INSTANCE_YAML, POSTGRES_URL_ENV
from eagle3_assets.operations.sensors import check_failure_alert
from eagle3_resources.alerts import AlertSink


def rows(fail: bool) -> CheckOutcome:
    """Every prompt has a row."""
    return CheckOutcome(not fail, "3 of 4 rows" if fail else "4 of 4 rows", {"missing": int(fail)})


def nulls(fail: bool) -> CheckOutcome:
    """No answer is empty."""
    return CheckOutcome(not fail, "2 empty answers" if fail else "no empty answer", {"empty": 2 * fail})


def gate(fail: bool) -> CheckOutcome:
    """The data is usable at all (blocking: a failure fails the run, and run_failure_alert says so)."""
    return CheckOutcome(not fail, "unusable" if fail else "usable")


# Evaluated in this order, per dataset: a run's last evaluation is its last dataset's `nulls`.
CHECKS: Checks = {"gate": (gate, "ERROR"), "rows": (rows, "WARN"), "nulls": (nulls, "WARN")}


class ProbeConfig(dg.Config):
    failing: list[str] = []  # "check@dataset": the evaluations that fail in this run


@dg.asset(
    partitions_def=dataset_partitions,
    check_specs=dataset_check_specs("probe", CHECKS, blocking={"gate"}),
    backfill_policy=dg.BackfillPolicy.single_run(),
)
def probe(context: dg.AssetExecutionContext, config: ProbeConfig):
    """A per-dataset asset whose checks fail where the run's config says, recorded as the pipeline's are."""
    datasets = context.partition_keys
    outcomes = {d: {name: fn(f"{name}@{d}" in config.failing) for name, (fn, _) in CHECKS.items()} for d in datasets}
    yield from per_dataset_results(context, {d: {"rows": 4} for d in datasets}, CHECKS, outcomes)


REPOSITORY = dg.Definitions(assets=[probe]).get_repository_def()


@pytest.fixture(params=["sqlite"])
def home(request, tmp_path, monkeypatch) -> Path:
    """A DAGSTER_HOME with the dagster.yaml `eagle3` writes: SQLite (the default), or PostgreSQL (a fresh database
    of a real server) by indirect parameter."""
    home = tmp_path / "dagster"
    home.mkdir()
    if request.param == "postgres":
        monkeypatch.setenv(POSTGRES_URL_ENV, request.getfixturevalue("postgres_url"))
        (home / "dagster.yaml").write_text(POSTGRES_INSTANCE_YAML)
    else:
        (home / "dagster.yaml").write_text(INSTANCE_YAML)
    return home


@contextmanager
def opened(home: Path) -> Iterator[dg.DagsterInstance]:
    """The instance, opened as a process opens it: each `with` is another process's view (a daemon restarted)."""
    with dg.DagsterInstance.from_config(str(home)) as instance:
        yield instance


def materialize(instance: dg.DagsterInstance, datasets: list[str], failing: set[str]) -> tuple[str, list[tuple]]:
    """One run over `datasets` (a range run when several), failing `failing`; its id and the alerts it owes:
    (title, run id) per failed evaluation of a non-blocking check."""
    tags = (
        {ASSET_PARTITION_RANGE_START_TAG: datasets[0], ASSET_PARTITION_RANGE_END_TAG: datasets[-1]}
        if len(datasets) > 1
        else {}
    )
    result = dg.materialize(
        [probe],
        instance=instance,
        partition_key=datasets[0] if len(datasets) == 1 else None,
        tags=tags,
        run_config={"ops": {"probe": {"config": {"failing": sorted(failing)}}}},
        raise_on_error=False,
    )
    assert result.success == ("gate" not in {f.split("@")[0] for f in failing}), failing
    owed = sorted(
        (f"Check failed: probe.{check} [{dataset}]", result.run_id)
        for check, dataset in (f.split("@") for f in failing)
        if check != "gate"
    )
    return result.run_id, owed


class SensorLog(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def tick(instance: dg.DagsterInstance, cursor: str | None, webhook: Webhook) -> tuple[str, list[tuple], list[str]]:
    """One evaluation of the sensor: the cursor it returns, what the webhook received, the alerts in its log."""
    sent = len(webhook.alerts)
    context = dg.build_sensor_context(
        instance=instance,
        cursor=cursor,
        resources={"alerts": AlertSink(webhook_url=webhook.url)},
        repository_def=REPOSITORY,
    )
    log = SensorLog()
    context.log.addHandler(log)
    result = check_failure_alert(context)
    assert isinstance(result, dg.SensorResult) and result.cursor is not None
    received = sorted((a["title"], a["figures"]["run_id"]) for a in webhook.alerts[sent:])
    return result.cursor, received, [line.splitlines()[0] for line in log.lines if line.startswith("ALERT ")]


def alerts_in_run_log(instance: dg.DagsterInstance, run_id: str) -> list[str]:
    return sorted(
        e.message.splitlines()[0]
        for e in instance.all_logs(run_id, of_type=dg.DagsterEventType.ENGINE_EVENT)
        if e.message.startswith("ALERT ")
    )


@pytest.mark.slow
@pytest.mark.parametrize("home", ["sqlite", "postgres"], indirect=True)
def test_every_failed_evaluation_of_every_partition_is_alerted_once(home, webhook):
    runs: dict[str, list[tuple]] = {}
    with opened(home) as instance:
        # No daemon yet: four runs end. One run over B1..B8 fails both checks in three of its datasets; B5 passes
        # in the next; A1 fails one check; A2 fails a blocking check (its run fails: not this sensor's to say) and,
        # last of all evaluations, a non-blocking one.
        for datasets, failing in [
            (["B1", "B2", "B3", "B4", "B5", "B6", "B7", "B8"], {"rows@B2", "rows@B5", "nulls@B5", "nulls@B8"}),
            (["B5"], set()),
            (["A1"], {"rows@A1"}),
            (["A2"], {"gate@A2", "nulls@A2"}),
        ]:
            run_id, owed = materialize(instance, datasets, failing)
            runs[run_id] = owed
    owed_before = sorted(a for owed in runs.values() for a in owed)
    assert len(owed_before) == 6 and len({t.split("[")[1] for t, _ in owed_before}) == 5

    # The daemon starts: its first tick alerts every failure recorded before it, each once, on the webhook, in the
    # sensor's log and in the log of the run that failed it.
    with opened(home) as instance:
        cursor, received, logged = tick(instance, None, webhook)
        assert received == owed_before
        assert sorted(logged) == sorted("ALERT " + title for title, _ in owed_before)
        for run_id, owed in runs.items():
            assert alerts_in_run_log(instance, run_id) == sorted("ALERT " + title for title, _ in owed)
        by_title = {a["title"]: a for a in webhook.alerts}
        b5 = by_title["Check failed: probe.nulls [B5]"]
        assert b5["figures"]["severity"] == "WARN" and b5["figures"]["description"] == "B5: 2 empty answers"
        assert b5["figures"]["empty"] == 2 and "*Check failed: probe.nulls [B5]*" in b5["text"]
        # The next tick sends nothing.
        again, received, logged = tick(instance, cursor, webhook)
        assert (received, logged, again) == ([], [], cursor)

    # Restarted, with the cursor it kept: nothing again. B8 passes; then B5 fails `nulls` again (a new evaluation:
    # alerted again, the pass between un-alerted nothing) and B3 fails `rows`; only these are alerted, once.
    with opened(home) as instance:
        assert tick(instance, cursor, webhook)[1:] == ([], [])
        materialize(instance, ["B8"], set())
        run_id, owed = materialize(instance, ["B3", "B4", "B5"], {"rows@B3", "nulls@B5"})
        cursor, received, logged = tick(instance, cursor, webhook)
        assert received == owed and sorted(logged) == sorted("ALERT " + title for title, _ in owed)
        assert alerts_in_run_log(instance, run_id) == sorted("ALERT " + title for title, _ in owed)
        assert tick(instance, cursor, webhook)[1:] == ([], [])
    assert len(webhook.alerts) == 8


def test_a_backlog_is_alerted_over_several_ticks_without_a_duplicate(home, webhook, monkeypatch):
    """A tick stops after its time budget (a webhook that hangs would outlast the sensor's timeout); the cursor it
    returns picks up where it stopped, across pages of the event log."""
    monkeypatch.setattr(sensors, "ALERT_BUDGET_S", 0.0)  # one evaluation per tick
    monkeypatch.setattr(sensors, "ALERT_PAGE", 2)
    with opened(home) as instance:
        owed = materialize(instance, ["A1", "A2", "B1"], {"rows@A1", "nulls@A1", "rows@B1"})[1]
        owed += materialize(instance, ["B2"], {"nulls@B2"})[1]
        cursor, received, ticks = None, [], 0
        while True:
            ticks += 1
            after, new, _ = tick(instance, cursor, webhook)
            received += new
            if after == cursor:
                break
            cursor = after
        assert sorted(received) == sorted(owed)
        # one evaluation per tick (4 datasets, 3 checks each, and each run's `all_datasets`, never alerted), then one
        # that finds nothing
        assert ticks == 4 * 3 + 2 + 1


def test_the_per_check_cursor_of_earlier_versions_is_taken_over_without_a_repeat_or_a_gap(home, webhook):
    """That sensor's cursor said, per check, which executions it had alerted (`from`, `handled`): those are not
    alerted again; the failures recorded after its last tick are, once; the cursor becomes an event-log cursor."""
    with opened(home) as instance:
        materialize(instance, ["B1", "B2"], {"rows@B1", "nulls@B2"})
        storage = instance.event_log_storage
        old = {}
        for name in ("rows", "nulls"):
            history = storage.get_asset_check_execution_history(dg.AssetCheckKey(probe.key, name), limit=100)
            old[f"probe.{name}"] = {"from": max(r.id for r in history) + 1, "handled": []}
        owed = materialize(instance, ["B1"], {"rows@B1"})[1] + materialize(instance, ["A1"], {"nulls@A1"})[1]
        cursor, received, _ = tick(instance, json.dumps(old, sort_keys=True), webhook)
        assert received == sorted(owed) and "after" in json.loads(cursor)
        assert tick(instance, cursor, webhook)[1] == []
