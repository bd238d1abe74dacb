"""What an operator sees while things run: live progress on the asset's page, the pool on the Concurrency page,
the datasets in the schedule's preview, the spend caps in the launchpad."""

import asyncio
from datetime import UTC, datetime
from typing import Any

import dagster as dg
import polars as pl
import pytest
from dagster._core.definitions.partitions.context import partition_loading_context
from fakes.openrouter import FakeOpenRouter, FakeSettings, ServerThread
from test_operator_controls import KEY, resources_for

from eagle3_assets.definitions import defs
from eagle3_assets.operations.instance import dagster_home
from eagle3_assets.operations.quality import status_board
from eagle3_assets.operations.schedules import missing_partitions_nightly
from eagle3_assets.operations.status import run_progress
from eagle3_assets.stages.completions import run as completions_logic
from eagle3_assets.stages.completions.asset import completions
from eagle3_assets.stages.raw_prompts.asset import raw_prompts
from eagle3_resources.storage import DataStore


@pytest.mark.timeout(900)
def test_progress_is_observed_on_the_partition_while_it_runs(data_dir_with_standin, tok, monkeypatch):
    monkeypatch.setattr(completions_logic, "PROGRESS_EVERY_S", 0.0)  # a report per result
    fake = FakeOpenRouter(tok, FakeSettings(api_key=KEY, latency_s=0.05))
    with ServerThread(fake.app) as server, dg.instance_for_test() as instance:
        result = dg.materialize(
            [raw_prompts, completions],
            partition_key="B6",
            instance=instance,
            resources=resources_for(data_dir_with_standin, f"{server.base_url}/api/v1"),
            run_config={"ops": {"completions": {"config": {"pilot_size": 0}}}},
        )
        assert result.success
        observations = instance.fetch_observations(dg.AssetKey("completions"), limit=1000).records
        materialized = instance.fetch_materializations(dg.AssetKey("completions"), limit=1).records[0]
        progress_lines = run_progress(instance, result.run_id)
        board = status_board(
            dg.build_sensor_context(instance=instance, resources={"store": DataStore(root=str(data_dir_with_standin))})
        )
        assert isinstance(board, dg.SensorResult)  # the first tick observes the board
        again = status_board(
            dg.build_sensor_context(
                instance=instance, cursor=board.cursor, resources={"store": DataStore(root=str(data_dir_with_standin))}
            )
        )
    rows = pl.read_parquet(data_dir_with_standin / "completions" / "B6.parquet").height
    table = board.asset_events[0].metadata["board"].value
    assert isinstance(table, str)
    table = table.replace("\u00a0", " ")  # a cell's figures are joined by no-break spaces
    b6 = next(line for line in table.splitlines() if line.startswith("| B6 |"))
    assert f"{rows} rows" in b6 and b6.endswith("| no |")  # token_ids not built: not complete
    assert next(line for line in table.splitlines() if line.startswith("| A1 |")).count("—") == 3
    assert board.asset_events[0].metadata["datasets_complete"].value == 0
    assert isinstance(again, dg.SkipReason)  # nothing changed: no second observation
    total = len(fake.billing.requests)
    figures = [observed_figures(r) for r in reversed(observations)]
    assert all(r.partition_key == "B6" for r in observations)
    assert figures[0]["done"] == 0 and figures[-1]["done"] == figures[-1]["total"] == total
    partway = [f for f in figures if 0 < f["done"] < f["total"]]
    assert partway, "no observation while the partition was running"
    assert all(r.timestamp <= materialized.timestamp for r in observations)
    assert {"requests_per_s", "completion_tokens", "billed_usd", "eta_s"} <= set(partway[0])
    assert f"{partway[0]['done']}/{total} done" in partway[0]["progress"]
    assert progress_lines["B6"].startswith(f"{total}/{total} done")  # what `eagle3 status` shows under a running run


def observed_figures(record: dg.EventLogRecord) -> dict[str, Any]:
    observation = record.asset_observation
    assert observation is not None, record
    return {k: v.value for k, v in observation.metadata.items()}


def test_the_gpu_pool_has_a_stored_limit_so_the_ui_lists_it(tmp_path, monkeypatch):
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    dagster_home()
    with dg.DagsterInstance.get() as instance:
        assert [(p.name, p.limit) for p in instance.event_log_storage.get_pool_limits()] == [("gpu", 1)]
    dagster_home()  # idempotent
    with dg.DagsterInstance.get() as instance:
        assert len(instance.event_log_storage.get_pool_limits()) == 1


def test_the_schedule_names_each_dataset_it_requests():
    with (
        dg.instance_for_test() as instance,
        dg.build_schedule_context(
            instance=instance, scheduled_execution_time=datetime(2026, 12, 2, 3, tzinfo=UTC)
        ) as context,
    ):
        requests = missing_partitions_nightly(context)  # a context left open keeps the instance current for later tests
    assert isinstance(requests, list)
    assert [r.tags["eagle3/dataset"] for r in requests] == [r.partition_key for r in requests] and len(requests) == 10


def test_the_launchpad_offers_the_spend_caps():
    with dg.instance_for_test() as instance, partition_loading_context(dynamic_partitions_store=instance):
        job = defs.resolve_job_def("eagle3_pipeline")
        assert job.partitioned_config is not None
        config = job.partitioned_config.get_run_config_for_partition_key("B6")
    offered = config["ops"]["completions"]["config"]
    assert {"max_run_usd", "max_total_usd", "max_projected_usd"} <= set(offered)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_pilot_then_the_rest_against_a_provider_that_caps_requests_per_second(data_dir_with_standin, tok):
    # Found taking the screenshots for the issue: the rate limit learnt in the pilot's event loop was awaited
    # in the rest's, and the run died ("Lock ... is bound to a different event loop").
    fake = FakeOpenRouter(tok, FakeSettings(api_key=KEY, max_rps=1.0))
    with ServerThread(fake.app) as server, dg.instance_for_test() as instance:
        result = dg.materialize(
            [raw_prompts, completions],
            partition_key="B6",
            instance=instance,
            raise_on_error=False,
            resources=resources_for(data_dir_with_standin, f"{server.base_url}/api/v1"),
            run_config={"ops": {"completions": {"config": {"pilot_size": 8}}}},
        )
    assert result.success, [e.message for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    assert fake.billing.statuses.count(429) > 0  # the cap was met, so the limiter learnt it in the pilot
    statuses = pl.read_parquet(data_dir_with_standin / "completions" / "B6.parquet")["status"].to_list()
    assert (
        statuses.count("ok")
        == len(statuses)
        == pl.read_parquet(data_dir_with_standin / "raw_prompts" / "B6.parquet").height
    )


def test_progress_is_reported_while_no_answer_arrives(monkeypatch):
    # A slow provider or a rate cap: no result for a while, yet the page must not freeze at the last arrival.
    monkeypatch.setattr(completions_logic, "PROGRESS_EVERY_S", 0.3)
    seen: list[dict[str, Any]] = []
    progress = completions_logic.Progress("B6", 28, 8, log=lambda line: None, on_report=seen.append)

    async def wait_a_while():
        # Until two reports came (a fixed 1.8 s would see one if the loop stalled most of it), bounded against a hang.
        ticker = asyncio.create_task(completions_logic.report_while_waiting(progress))
        deadline = asyncio.get_running_loop().time() + 60
        while len(seen) < 2 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        ticker.cancel()

    asyncio.run(wait_a_while())
    assert len(seen) >= 2 and all(f["done"] == 8 and f["total"] == 28 for f in seen)
    assert seen[-1]["elapsed_s"] > seen[0]["elapsed_s"]
