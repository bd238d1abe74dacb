"""The `spend` observation while a run spends: the run's own dollars, as the ledger holds them now.

The credit sensor records an observation only when a figure changes (view.fingerprint). The per-run
figures used to stay out of that comparison, so the latest observation kept a running run at $0 after it
had been billed (docs/images/spend_while_running.png, shown in docs/paid-runs.md: `spent_by_run_usd` 0 for the run
that had spent).
The oracle is the bills this test writes into the ledger, as a spending run's process does.
"""

import time
import uuid

import dagster as dg
import pytest
from dagster._core.remote_origin import (
    RegisteredCodeLocationOrigin,
    RemoteJobOrigin,
    RemoteRepositoryOrigin,
)

from eagle3_assets.money import SpendPolicy, open_ledger
from eagle3_assets.money import ledger as L
from eagle3_assets.money.caps import Caps
from eagle3_assets.operations.sensors import credit_sensor
from eagle3_resources.alerts import AlertSink
from eagle3_resources.storage import DataStore


def started_run(instance) -> dg.DagsterRun:
    """A spending run (eagle3_pipeline over one dataset) as the daemon records it once its process has started."""
    origin = RemoteJobOrigin(
        repository_origin=RemoteRepositoryOrigin(RegisteredCodeLocationOrigin("eagle3"), "__repository__"),
        job_name="eagle3_pipeline",
    )
    return instance.add_run(
        dg.DagsterRun(
            job_name="eagle3_pipeline",
            run_id=str(uuid.uuid4()),
            status=dg.DagsterRunStatus.STARTED,
            tags={"dagster/partition": "B4"},
            remote_job_origin=origin,
        )
    )


def tick(instance, root, cursor):
    resources = {"spend_policy": SpendPolicy(), "store": DataStore(root=str(root)), "alerts": AlertSink()}
    return credit_sensor(dg.build_sensor_context(instance=instance, cursor=cursor, resources=resources))


def observed(result) -> dict | None:
    events = result.asset_events
    return {k: v.value for k, v in events[-1].metadata.items()} if events else None


@pytest.mark.timeout(300)
def test_a_running_run_that_has_spent_is_observed_with_its_spend(tmp_path, monkeypatch):
    for var in (
        "EAGLE3_MIN_BALANCE_USD",
        "EAGLE3_MAX_RUN_USD",
        "EAGLE3_MAX_DAY_USD",
        "EAGLE3_MAX_TOTAL_USD",
        "OPENROUTER_API_KEY",
    ):
        monkeypatch.delenv(var, raising=False)
    ledger = open_ledger(DataStore(root=str(tmp_path)).layout)
    with dg.instance_for_test() as instance:
        earlier = "an-earlier-run"
        (a,), _ = ledger.write(
            L.reserve,
            [L.Want("p0", 1, 0.05, 100)],
            run_id=earlier,
            dataset="B4",
            owner="t",
            caps=Caps(),
            now=time.time(),
        )
        ledger.write(
            L.settle, a, cost_usd=0.0079, prompt_tokens=10, completion_tokens=20, source="response", now=time.time()
        )
        run = started_run(instance)

        result = tick(instance, tmp_path, None)  # the run has started; nothing of it is in the ledger yet
        first, cursor = observed(result), result.cursor
        assert first is not None
        assert first["spent_by_run_usd"] == {run.run_id: 0} and first["spent_total_usd"] == 0.0079

        # The run's pilot: three requests, $0.0018 billed in all; the totals move by less than a cent.
        costs = [0.0005, 0.0006, 0.0007]
        wants = [L.Want(f"p{i}", 1, 0.04, 100) for i in range(1, 4)]
        ids, _ = ledger.write(
            L.reserve, wants, run_id=run.run_id, dataset="B4", owner="t", caps=Caps(), now=time.time()
        )
        for attempt, cost in zip(ids, costs, strict=True):  # an attempt per want
            ledger.write(
                L.settle,
                attempt,
                cost_usd=cost,
                prompt_tokens=10,
                completion_tokens=20,
                source="response",
                now=time.time(),
            )

        now = observed(tick(instance, tmp_path, cursor))
        assert now is not None, "no observation: the last one still shows the running run at $0"
        assert now["spent_by_run_usd"] == {run.run_id: pytest.approx(sum(costs), abs=1e-9)}
        assert now["committed_by_run_usd"] == {run.run_id: pytest.approx(sum(costs), abs=1e-9)}  # nothing in flight
        assert now["spent_total_usd"] == pytest.approx(0.0079 + sum(costs), abs=1e-9)
