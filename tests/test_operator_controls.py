"""The operator's controls on real Dagster instances: checks, pilot, alerts, schedule, credit sensor."""

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import dagster as dg
import polars as pl
import pytest
from dagster._core.storage.tags import (
    ASSET_PARTITION_RANGE_END_TAG,
    ASSET_PARTITION_RANGE_START_TAG,
    PARTITION_NAME_TAG,
)
from dagster._utils.tags import TagConcurrencyLimitsCounter
from fakes.openrouter import FakeOpenRouter, FakeSettings, ServerThread
from support import bills_not_in_ledger, free_port, stop_group, wait_for

from eagle3_assets.common.outcome import per_dataset
from eagle3_assets.common.per_dataset import SUMMARY_CHECK
from eagle3_assets.common.registry import DATASETS
from eagle3_assets.money import SpendPolicy, get_hold, open_ledger, set_hold
from eagle3_assets.money.settle import partition_lock
from eagle3_assets.operations.instance import dagster_home
from eagle3_assets.operations.schedules import missing_partitions_nightly
from eagle3_assets.operations.sensors import check_failure_alert, run_failure_alert
from eagle3_assets.stages.completions.asset import completions
from eagle3_assets.stages.completions.checks import COMPLETION_CHECKS
from eagle3_assets.stages.completions.run import COMPLETION_COLUMNS, final_results
from eagle3_assets.stages.eagle3_drafter.checks import drafter_accept_length, drafter_keys
from eagle3_assets.stages.hidden_states.checks import hidden_state_finite
from eagle3_assets.stages.merged_dataset.checks import dataset_mix, token_totals
from eagle3_assets.stages.raw_prompts.asset import raw_prompts
from eagle3_resources.alerts import AlertSink
from eagle3_resources.completions.resource import BackendKind, CompletionsResource
from eagle3_resources.journal import read_journal
from eagle3_resources.storage import DataStore
from eagle3_resources.target.resource import TargetModelResource
from eagle3_resources.tokenizer.resource import TokenizerResource

REPO = Path(__file__).resolve().parents[1]
KEY = "k-ops"


def step_failure_message(event: dg.DagsterEvent) -> str:
    error = event.step_failure_data.error
    assert error is not None, event
    return error.message


def stored_run(instance: dg.DagsterInstance, run_id: str) -> dg.DagsterRun:
    run = instance.get_run_by_id(run_id)
    assert run is not None, run_id
    return run


def resources_for(data_dir, fake_url, **backend):
    standin = str(data_dir / "standin")
    return {
        "store": DataStore(root=str(data_dir)),
        "tokenizer": TokenizerResource(standin_dir=standin),
        "target": TargetModelResource(standin_dir=standin),
        "completions_backend": CompletionsResource(
            backend=BackendKind.OPENROUTER, openrouter_base_url=fake_url, openrouter_api_key=KEY, **backend
        ),
        "spend_policy": SpendPolicy(),
    }


def completion_frame(rows):
    base = {c: None for c in COMPLETION_COLUMNS}
    return pl.DataFrame(
        [
            {
                **base,
                "dataset": "T",
                "prompt_id": f"p{i}",
                "status": "ok",
                "cost_usd": 0.0,
                "attempts": 1,
                "messages_json": json.dumps([{"role": "user", "content": f"q{i}"}]),
                "content": f"a{i}",
                **r,
            }
            for i, r in enumerate(rows)
        ],
        schema=COMPLETION_COLUMNS,
    )


# -- checks: pass on good data, fail on crafted bad data -----------------------------------


def test_completion_checks_pass_on_good_and_fail_on_bad_data():
    good = completion_frame([{}] * 40)
    for name, (fn, _) in COMPLETION_CHECKS.items():
        assert fn(good).passed, name
    assert not COMPLETION_CHECKS["complete"][0](
        completion_frame([{}] * 40 + [{"status": "pending", "content": None}])
    ).passed
    assert not COMPLETION_CHECKS["error_rate"][0](
        completion_frame([{}] * 30 + [{"status": "failed", "error_code": "502"}] * 5)
    ).passed
    assert not COMPLETION_CHECKS["truncated_share"][0](
        completion_frame([{}] * 30 + [{"status": "truncated"}] * 6)
    ).passed
    dup = completion_frame([{}] * 10 + [{"messages_json": json.dumps([{"role": "user", "content": "q0"}])}])
    assert not COMPLETION_CHECKS["no_duplicates"][0](dup).passed


def test_checks_judge_each_dataset_of_a_multi_partition_run_on_its_own():
    # B1: 6 of 30 failed (20%); B2..B5: none of 120. Together 6 of 150 = 4%, under the 5% limit.
    bad = completion_frame([{}] * 24 + [{"status": "failed", "error_code": "502"}] * 6).with_columns(
        dataset=pl.lit("B1")
    )
    good = [
        completion_frame([{}] * 30).with_columns(dataset=pl.lit(f"B{i}"), prompt_id=pl.format("g{}", "prompt_id"))
        for i in range(2, 6)
    ]
    df = pl.concat([bad, *good])
    assert COMPLETION_CHECKS["error_rate"][0](df).passed  # the aggregate would hide B1
    outcomes = per_dataset(
        COMPLETION_CHECKS, {d: part for (d,), part in df.partition_by("dataset", as_dict=True).items()}
    )
    assert [d for d, o in outcomes.items() if not o["error_rate"].passed] == ["B1"]
    assert outcomes["B1"]["error_rate"].description.startswith("6 of 30 completions failed (20.0%")


def test_training_checks_pass_on_good_and_fail_on_bad_data(tmp_path):
    merged = pl.DataFrame(
        {
            "dataset": ["A1", "A2"],
            "input_ids": [[1, 2, 3], [4, 5]],
            "loss_mask": [[0, 1, 1], [0, 1]],
            "n_tokens": [3, 2],
            "completion_len": [2, 1],
        }
    )
    assert dataset_mix(merged, ["A1", "A2"]).passed and not dataset_mix(merged, ["A1", "A2", "B1"]).passed
    assert token_totals(merged).passed
    assert not token_totals(merged.with_columns(loss_mask=pl.Series([[0, 0, 0], [0, 1]]))).passed
    assert hidden_state_finite([]).passed and not hidden_state_finite(["A1/x"]).passed
    assert drafter_accept_length(2.3, 1.0).passed and not drafter_accept_length(1.2, 1.0).passed
    assert not drafter_accept_length(1.6, 1.7).passed
    assert not drafter_keys(tmp_path).passed  # no checkpoint there


# -- pilot ---------------------------------------------------------------------------------


def test_a_pilot_of_malformed_data_stops_the_partition(tmp_path, data_dir_with_standin, tok):
    # The provider renders tools differently than we do: its prompt counts are off for every prompt with tools.
    fake = FakeOpenRouter(tok, FakeSettings(api_key=KEY, prompt_token_offset=9))
    pilot, concurrency = 5, 3
    with ServerThread(fake.app) as server, dg.instance_for_test() as instance:
        result = dg.materialize(
            [raw_prompts, completions],
            partition_key="A2",
            instance=instance,
            raise_on_error=False,
            resources=resources_for(data_dir_with_standin, f"{server.base_url}/api/v1", concurrency=concurrency),
            run_config={"ops": {"completions": {"config": {"pilot_size": pilot}}}},
        )
        assert not result.success  # the blocking pilot check failed the run
        evaluations = [
            e.asset_check_evaluation_data for e in result.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"
        ]
    assert len(fake.billing.requests) <= pilot + concurrency
    pilot_check = next(e for e in evaluations if e.check_name == "pilot")
    assert not pilot_check.passed and pilot_check.description is not None and "with tools" in pilot_check.description
    journal = data_dir_with_standin / "completions" / "A2" / "journal.jsonl"
    assert [r for r in read_journal(journal).records if r.get("type") == "pilot"][0]["passed"] is False


def test_the_run_queue_holds_a_second_run_of_a_dataset_however_it_was_launched(tmp_path, monkeypatch):
    # The instance `eagle3` writes, judged by Dagster's own queue counter: the CLI and the schedule tag a
    # run with its partition, a backfill from the UI with a range (start = end for one dataset).
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    dagster_home()
    with dg.DagsterInstance.get() as instance:
        queue = instance.get_concurrency_config().run_queue_config
        assert queue is not None
        limits = queue.tag_concurrency_limits

    def run(**tags):
        return dg.DagsterRun(job_name="eagle3_pipeline", run_id=str(uuid.uuid4()), tags=tags)

    def ranged(start, end):
        return run(**{ASSET_PARTITION_RANGE_START_TAG: start, ASSET_PARTITION_RANGE_END_TAG: end})

    in_progress = [run(**{PARTITION_NAME_TAG: "A1"}), ranged("B8", "B8")]
    counter = TagConcurrencyLimitsCounter(limits, in_progress)
    assert counter.is_blocked(run(**{PARTITION_NAME_TAG: "A1"}))
    assert counter.is_blocked(ranged("B8", "B8"))
    assert not counter.is_blocked(run(**{PARTITION_NAME_TAG: "B8"}))  # left to the completions lock (tested below)
    assert not counter.is_blocked(ranged("A2", "A2")) and not counter.is_blocked(run(**{PARTITION_NAME_TAG: "B1"}))


def test_a_second_spending_run_on_a_dataset_fails_at_once_and_spends_nothing(tmp_path, data_dir_with_standin, tok):
    fake = FakeOpenRouter(tok, FakeSettings(api_key=KEY))
    journal = data_dir_with_standin / "completions" / "B7" / "journal.jsonl"
    with (
        ServerThread(fake.app) as server,
        dg.instance_for_test() as instance,
        partition_lock(journal, "run-holding-b7"),
    ):
        result = dg.materialize(
            [raw_prompts, completions],
            partition_key="B7",
            instance=instance,
            raise_on_error=False,
            resources=resources_for(data_dir_with_standin, f"{server.base_url}/api/v1"),
        )
        assert not result.success
        failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
        assert "B7 is being completed by run run-holding-b7" in step_failure_message(failure)
    assert fake.billing.requests == []


@pytest.mark.slow
@pytest.mark.parametrize("how", ["hold", "terminate"])
@pytest.mark.parametrize("pilot_size", [0, 8])
def test_a_hold_or_terminate_halts_an_in_process_run_that_no_launcher_can_stop(
    tmp_path, data_dir_with_standin, tok, how, pilot_size
):
    # `dagster asset materialize` and `eagle3 run` execute in-process: the launcher cannot signal them, so the
    # completions run polls for the hold and for its own CANCELING status (what terminate from the UI sets).
    # With a pilot the halt comes during the pilot: it gets no verdict and the rest is not started.
    reason = {
        "hold": "spending hold: account balance $0.40 < minimum $0.50",
        "terminate": "the run is being cancelled",
    }[how]
    fake = FakeOpenRouter(tok, FakeSettings(api_key=KEY, latency_s=0.3, chunk_latency_s=0.1))
    held: dict[str, float] = {}
    with ServerThread(fake.app) as server, dg.instance_for_test() as instance:

        def hold_after_a_few():
            wait_for(lambda: len(fake.billing.requests) >= 4, 300, "the first answers")
            if how == "hold":
                set_hold(
                    open_ledger(DataStore(root=str(data_dir_with_standin)).layout),
                    ["account balance $0.40 < minimum $0.50"],
                    {},
                    {},
                )
            else:
                (run,) = instance.get_runs(filters=dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED]))
                instance.report_run_canceling(run)
            held.update(t=time.monotonic(), received=len(fake.billing.requests))

        holder = threading.Thread(target=hold_after_a_few)
        holder.start()
        result = dg.materialize(
            [raw_prompts, completions],
            partition_key="B6",
            instance=instance,
            raise_on_error=False,
            resources=resources_for(data_dir_with_standin, f"{server.base_url}/api/v1", concurrency=2),
            run_config={"ops": {"completions": {"config": {"pilot_size": pilot_size, "max_tokens": 48}}}},
        )
        stopped_in = time.monotonic() - held["t"]
        holder.join()
        failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert not result.success
    assert f"halted: {reason}" in step_failure_message(failure)
    records = read_journal(data_dir_with_standin / "completions" / "B6" / "journal.jsonl").records
    assert records[-1]["type"] == "end" and records[-1]["stopped_by"] == f"halted: {reason}"
    assert [r["type"] for r in records if r.get("type") in ("start", "pilot")] == [
        "start"
    ]  # one batch, no pilot verdict
    received = len(fake.billing.requests)  # requests the server received, finished or not
    assert held["received"] <= received < 28 and received - held["received"] <= 4  # at most one poll (1 s) of new ones
    print(f"halted {stopped_in:.1f}s after the {how}; {received - held['received']} requests sent after it")
    assert stopped_in < 10


# -- alerts --------------------------------------------------------------------------------


def test_webhook_gets_one_alert_per_failed_check_with_the_figures(tmp_path, data_dir_with_standin, tok, webhook):
    fake = FakeOpenRouter(tok, FakeSettings(api_key=KEY, rate_finish_error=0.3, seed=5))
    with ServerThread(fake.app) as server, dg.instance_for_test() as instance:
        result = dg.materialize(
            [raw_prompts, completions],
            partition_key="B6",
            instance=instance,
            resources=resources_for(data_dir_with_standin, f"{server.base_url}/api/v1"),
            run_config={"ops": {"completions": {"config": {"max_tokens": 30, "pilot_size": 0}}}},
        )
        assert result.success
        failed = [
            e.asset_check_evaluation_data
            for e in result.all_events
            if e.event_type_value == "ASSET_CHECK_EVALUATION" and not e.asset_check_evaluation_data.passed
        ]
        summary = [e for e in failed if e.check_name == SUMMARY_CHECK]  # every dataset's failures in one: no alert
        failed = [e for e in failed if e.check_name != SUMMARY_CHECK]
        assert {e.check_name for e in failed} == {"error_rate", "truncated_share"} and len(summary) == 1
        sink = AlertSink(webhook_url=webhook.url)
        from eagle3_assets.definitions import defs

        repo = defs.get_repository_def()
        context = dg.build_sensor_context(instance=instance, resources={"alerts": sink}, repository_def=repo)
        first = check_failure_alert(context)
        assert isinstance(first, dg.SensorResult)
        assert len(webhook.alerts) == len(failed)
        titles = sorted(a["title"] for a in webhook.alerts)
        assert titles == ["Check failed: completions.error_rate [B6]", "Check failed: completions.truncated_share [B6]"]
        in_run_log = [
            e.message
            for e in instance.all_logs(result.run_id, of_type=dg.DagsterEventType.ENGINE_EVENT)
            if e.message.startswith("ALERT ")
        ]  # also in the log of the run that failed the check
        assert sorted(m.splitlines()[0] for m in in_run_log) == ["ALERT " + t for t in titles]
        error_alert = next(a for a in webhook.alerts if "error_rate" in a["title"])
        assert error_alert["figures"]["failed"] > 0 and "share_pct" in error_alert["figures"] and "text" in error_alert
        again = check_failure_alert(
            dg.build_sensor_context(
                instance=instance, cursor=first.cursor, resources={"alerts": sink}, repository_def=repo
            )
        )
        assert isinstance(again, dg.SensorResult)
        assert (
            len(webhook.alerts) == len(failed) and again.cursor == first.cursor
        )  # one alert per failure, not per tick

        # Two more runs fail the same checks between two ticks (re-materializing resumes: nothing is re-sent):
        # each failure is alerted, none collapsed into the latest.
        for _ in range(2):
            dg.materialize(
                [raw_prompts, completions],
                partition_key="B6",
                instance=instance,
                resources=resources_for(data_dir_with_standin, f"{server.base_url}/api/v1"),
                run_config={"ops": {"completions": {"config": {"max_tokens": 30, "pilot_size": 0}}}},
            )
        webhook.alerts.clear()
        check_failure_alert(
            dg.build_sensor_context(
                instance=instance, cursor=again.cursor, resources={"alerts": sink}, repository_def=repo
            )
        )
        assert sorted(a["title"] for a in webhook.alerts) == sorted(titles * 2)
        assert len({a["figures"]["run_id"] for a in webhook.alerts}) == 2


def test_failed_run_alert(tmp_path, data_dir_with_standin, tok, webhook):
    fake = FakeOpenRouter(tok, FakeSettings(api_key=KEY, prompt_token_offset=9))
    with ServerThread(fake.app) as server, dg.instance_for_test() as instance:
        result = dg.materialize(
            [raw_prompts, completions],
            partition_key="A2",
            instance=instance,
            raise_on_error=False,
            resources=resources_for(data_dir_with_standin, f"{server.base_url}/api/v1"),
            run_config={"ops": {"completions": {"config": {"pilot_size": 4}}}},
        )
        run = instance.get_run_by_id(result.run_id)
        failure = (
            next(e for e in result.all_events if e.event_type == dg.DagsterEventType.RUN_FAILURE)
            if any(e.event_type == dg.DagsterEventType.RUN_FAILURE for e in result.all_events)
            else instance.all_logs(result.run_id, of_type=dg.DagsterEventType.RUN_FAILURE)[0].dagster_event
        )
        assert failure is not None and run is not None
        context = dg.build_run_status_sensor_context(
            sensor_name="run_failure_alert",
            dagster_event=failure,
            dagster_instance=instance,
            dagster_run=run,
            resources={"alerts": AlertSink(webhook_url=webhook.url)},
        ).for_run_failure()
        run_failure_alert(context)
    assert len(webhook.alerts) == 1
    alert = webhook.alerts[0]
    assert alert["title"] == "Run failed: __ephemeral_asset_job__ [A2]"
    assert [c["check"] for c in alert["figures"]["failed_checks"]] == ["completions.pilot"]


# -- schedule ------------------------------------------------------------------------------


def test_schedule_requests_exactly_the_missing_partitions():
    with dg.instance_for_test() as instance:
        for done in ("A1", "B2", "B7"):
            instance.report_runless_asset_event(dg.AssetMaterialization("token_ids", partition=done))
        # In flight: a run for B5, and a UI backfill's run over B3..B4 (tagged with a range, no partition tag).
        busy = [
            {PARTITION_NAME_TAG: "B5"},
            {ASSET_PARTITION_RANGE_START_TAG: "B3", ASSET_PARTITION_RANGE_END_TAG: "B4"},
        ]
        for tags in busy:
            instance.add_run(
                dg.DagsterRun(
                    job_name="eagle3_pipeline", run_id=str(uuid.uuid4()), tags=tags, status=dg.DagsterRunStatus.STARTED
                )
            )
        context = dg.build_schedule_context(
            instance=instance, scheduled_execution_time=datetime(2026, 12, 2, 3, tzinfo=UTC)
        )
        requests = missing_partitions_nightly(context)
    assert isinstance(requests, list)
    assert sorted(r.partition_key for r in requests) == sorted(set(DATASETS) - {"A1", "B2", "B7", "B3", "B4", "B5"})
    assert len({r.run_key for r in requests}) == len(requests)


# -- the credit sensor, live ---------------------------------------------------------------


@pytest.mark.timeout(900)
# Both modes, both instance storages, in two runs (each is a minute or more): the hold mode's path does not depend on
# where the instance keeps its runs.
@pytest.mark.slow
@pytest.mark.parametrize(("storage", "hold_mode"), [("sqlite", "drain"), ("postgres", "cancel")])
def test_credit_sensor_halts_spending_and_holds_it(
    tmp_path, data_dir_with_standin, tok, monkeypatch, request, storage, hold_mode
):
    from dagster_graphql import DagsterGraphQLClient

    # With storage "postgres" the instance (runs, sensor ticks, the queue) is in a real PostgreSQL server.
    if storage == "postgres":
        monkeypatch.setenv("EAGLE3_POSTGRES_URL", request.getfixturevalue("postgres_url"))
    else:
        monkeypatch.delenv("EAGLE3_POSTGRES_URL", raising=False)

    # Credit for about 10 answers; the sensor must hold spending once less than $0.0040 remains.
    fake = FakeOpenRouter(
        tok, FakeSettings(api_key=KEY, credit_usd=0.006, latency_s=0.4, chunk_latency_s=0.1, price_completion=2.5e-5)
    )
    home = tmp_path / "home"
    home.mkdir()
    ledger = open_ledger(DataStore(root=str(data_dir_with_standin)).layout)
    journal = data_dir_with_standin / "completions" / "B6" / "journal.jsonl"
    with ServerThread(fake.app) as server:
        url = f"{server.base_url}/api/v1"
        env = dict(
            os.environ,
            DAGSTER_HOME=str(home),
            EAGLE3_DATA_DIR=str(data_dir_with_standin),
            PYTHONUNBUFFERED="1",
            EAGLE3_COMPLETIONS_BACKEND="openrouter",
            OPENROUTER_BASE_URL=url,
            OPENROUTER_API_KEY=KEY,
            EAGLE3_MIN_BALANCE_USD="0.004",
            EAGLE3_HOLD_MODE=hold_mode,
        )
        port = free_port()
        dev = subprocess.Popen(
            [sys.executable, "-m", "eagle3_assets.operations.cli", "dev", "--port", str(port)],
            cwd=REPO,
            env=env,
            stdout=open(tmp_path / "dev.log", "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        monkeypatch.setenv("DAGSTER_HOME", str(home))
        try:
            client = DagsterGraphQLClient("127.0.0.1", port_number=port, timeout=60)
            deadline = time.monotonic() + 180
            run_id = None
            while run_id is None:
                try:
                    run_id = client.submit_job_execution(
                        "eagle3_pipeline",
                        tags={"dagster/partition": "B6"},
                        run_config={"ops": {"completions": {"config": {"pilot_size": 0, "max_tokens": 48}}}},
                    )
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(2)
            with dg.DagsterInstance.get() as instance:
                wait_for(lambda: get_hold(ledger) is not None, 300, "the credit sensor's hold")
                held_at = time.monotonic()
                received_at_hold = len(fake.billing.requests)
                wait_for(lambda: stored_run(instance, run_id).is_finished, 60, "the run to stop")
                stopped_in = time.monotonic() - held_at
                run = stored_run(instance, run_id)
                if hold_mode == "cancel":  # terminated: in-flight streams cancelled
                    assert run.status == dg.DagsterRunStatus.CANCELED
                else:  # drained: admission stopped at the hold, in-flight requests finished and were kept
                    assert run.status == dg.DagsterRunStatus.FAILURE
                    failure = instance.all_logs(run_id, of_type=dg.DagsterEventType.STEP_FAILURE)[0]
                    assert failure.dagster_event is not None
                    assert "halted: spending hold: account balance" in step_failure_message(failure.dagster_event)
                    records = read_journal(
                        journal
                    ).records  # nothing in flight was cancelled (retries were refused, unpaid)
                    assert not [
                        r for r in records if r.get("status") == "aborted" and r.get("error_code") == "cancelled"
                    ]
                hold = get_hold(ledger)
                assert hold is not None
                assert (
                    "account balance" in hold["reasons"][0]
                    and hold["figures"]["account"]["limit_remaining_usd"] < 0.004
                )
                records = read_journal(journal).records
                assert records[-1]["type"] == "end"  # the journal is intact and closed
                # The hold bites in the next admission (it is read in the ledger's own transaction): the requests the
                # server saw after the sensor set it were at most those already admitted (concurrency 256 here).
                spent_requests = len(fake.billing.requests)
                print(
                    f"{hold_mode}: run stopped {stopped_in:.1f}s after the hold; "
                    f"{spent_requests - received_at_hold} requests "
                    "reached the server after it"
                )

                # While the hold stands, a new spending run does not spend.
                second = client.submit_job_execution(
                    "eagle3_pipeline",
                    tags={"dagster/partition": "B6"},
                    run_config={"ops": {"completions": {"config": {"max_tokens": 48}}}},
                )
                wait_for(lambda: stored_run(instance, second).is_finished, 120, "the second run to be stopped")
                assert stored_run(instance, second).status in (
                    dg.DagsterRunStatus.CANCELED,
                    dg.DagsterRunStatus.FAILURE,
                )
                assert len(fake.billing.requests) == spent_requests

                # Top up: the sensor lifts the hold by itself once no threshold is crossed any more.
                fake.settings.credit_usd = 10.0
                wait_for(lambda: get_hold(ledger) is None, 120, "the sensor to lift the hold after the top-up")
        finally:
            stop_group(dev)
        # Admission stops at the hold (read in every admission's own transaction): what reached the server after it
        # was at most a few requests already admitted. A cancel ends the run within seconds; a drain once in flight
        # answers end.
        assert spent_requests - received_at_hold <= 8
        assert stopped_in < (15 if hold_mode == "cancel" else 60)
        with dg.instance_for_test() as instance:
            result = dg.materialize(
                [raw_prompts, completions],
                partition_key="B6",
                instance=instance,
                resources=resources_for(data_dir_with_standin, url),
                run_config={"ops": {"completions": {"config": {"max_tokens": 400}}}},
            )
        assert result.success
        done, _ = final_results(journal)
        assert len(done) == 28
        if hold_mode == "drain":  # nothing was cancelled, so no prompt was paid twice
            assert all(len(fake.billing.bills_for(b["messages"])) == 1 for b in fake.billing.requests)
        assert bills_not_in_ledger(fake, ledger) == []
        if storage == "postgres":  # the runs and the sensor's ticks are in the server, read without Dagster
            import psycopg2

            with psycopg2.connect(os.environ["EAGLE3_POSTGRES_URL"]) as conn, conn.cursor() as cur:
                cur.execute("select status from runs where run_id = %s", (run_id,))
                assert cur.fetchone() == ("CANCELED",)
                cur.execute("select count(*) from job_ticks where type = 'SENSOR' and tick_body like '%credit_sensor%'")
                assert cur.fetchone()[0] > 0
