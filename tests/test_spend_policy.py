"""The credit sensor's decisions: thresholds, anomalies and their alerts, which runs spend, cancelling."""

import time
import uuid

import dagster as dg
import pytest
from aiohttp import web
from dagster._core.definitions.observe import observe
from dagster._core.execution.backfill import BulkActionStatus, PartitionBackfill
from dagster._core.remote_origin import (
    RegisteredCodeLocationOrigin,
    RemoteJobOrigin,
    RemoteRepositoryOrigin,
)
from fakes.openrouter import ServerThread
from support import Webhook

from eagle3_assets.definitions import defs
from eagle3_assets.money import (
    Caps,
    SpendPolicy,
    cancel_spending,
    get_hold,
    lift_hold,
    open_ledger,
    spends,
)
from eagle3_assets.money import ledger as L
from eagle3_assets.money.asset import spend
from eagle3_assets.money.ledger import Figures, Scope
from eagle3_assets.money.policy import Account, LedgerGap, account_moves, crossed
from eagle3_assets.operations.sensors import credit_sensor
from eagle3_resources.alerts import AlertSink
from eagle3_resources.storage import DataStore

# $12 billed in all, $3 today; two runs in flight.
LEDGER = Figures(
    total=Scope(settled_usd=12.0),
    today=Scope(settled_usd=3.0),
    day="2026-12-03",
    runs={"run-a": Scope(settled_usd=2.0), "run-b": Scope(settled_usd=7.5)},
)


def thresholds(**kw):
    return SpendPolicy(**kw).thresholds()


def test_each_threshold_is_crossed_with_its_figures(monkeypatch):
    for var in ("EAGLE3_MIN_BALANCE_USD", "EAGLE3_MAX_RUN_USD", "EAGLE3_MAX_DAY_USD", "EAGLE3_MAX_TOTAL_USD"):
        monkeypatch.delenv(var, raising=False)
    account = Account(usage_usd=12.0, limit_remaining_usd=4.0, t=0.0)
    assert crossed(thresholds(), account, LEDGER).reasons == []  # nothing set, nothing enforced
    within = crossed(
        thresholds(min_balance_usd=3.0, max_run_usd=8, max_day_usd=3.0, max_total_usd=12.0), account, LEDGER
    )
    assert within.reasons == [] and within.runs == {}
    (balance,) = crossed(thresholds(min_balance_usd=5.0), account, LEDGER).reasons
    assert "$4.00 < minimum $5.00" in balance
    # A run over its own threshold is about that run: it is not a reason to hold everything.
    over = crossed(thresholds(max_run_usd=5.0), account, LEDGER)
    assert (
        over.reasons == [] and list(over.runs) == ["run-b"] and over.runs["run-b"].startswith("run run-b spent $7.50")
    )
    assert "today $3.00 > $2.00" in crossed(thresholds(max_day_usd=2.0), account, LEDGER).reasons[0]
    assert "in all $12.00 > $10.00" in crossed(thresholds(max_total_usd=10.0), account, LEDGER).reasons[0]
    # Without the account, the ledger's thresholds still hold and the balance one cannot fire.
    assert len(crossed(thresholds(min_balance_usd=5.0, max_total_usd=10.0), None, LEDGER).reasons) == 1


def test_thresholds_fall_back_to_the_environment_field_by_field(monkeypatch):
    monkeypatch.setenv("EAGLE3_MAX_DAY_USD", "40")
    monkeypatch.setenv("EAGLE3_MAX_TOTAL_USD", "500")
    # A launchpad that sets one field does not drop the others (Dagster replaces the whole resource config).
    assert SpendPolicy(max_total_usd=90.0).thresholds() == {
        "min_balance_usd": None,
        "max_run_usd": None,
        "max_day_usd": 40.0,
        "max_total_usd": 90.0,
    }
    monkeypatch.setenv("EAGLE3_HOLD_MODE", "sideways")
    with pytest.raises(ValueError, match="hold_mode"):
        _ = SpendPolicy().hold_action  # the property raises


def test_account_moves_name_the_figures_that_moved_the_wrong_way():
    before = {"usage_usd": 12.0, "limit_remaining_usd": 4.0}
    assert account_moves(before, Account(12.5, 3.5, 0.0)) == []
    (down,) = account_moves(before, Account(11.0, 3.5, 0.0))
    assert "usage went DOWN from $12.0000 to $11.0000" in down
    (up,) = account_moves(before, Account(12.5, 9.0, 0.0))
    assert "balance went UP from $4.0000 to $9.0000" in up
    assert account_moves(None, Account(1.0, 1.0, 0.0)) == [] and account_moves(before, None) == []


def test_ledger_gap_is_drift_from_the_first_reading():
    # The key had spent $8 before this project: not an anomaly, an offset.
    first = LedgerGap.measure({}, Account(20.0, 1.0, 0.0), 12.0, tolerance=1.0)
    assert first.offset_usd == 8.0 and first.drift_usd == 0.0 and not first.open
    later = LedgerGap.measure({"offset_usd": 8.0}, Account(21.5, 1.0, 0.0), 12.0, tolerance=1.0)
    assert later.open and later.drift_usd == 1.5
    assert "drifted $+1.5000" in later.describe(Account(21.5, 1.0, 0.0), 12.0, 1.0)


def bill(ledger, usd, dataset="A1", run_id="r"):
    """One attempt reserved and settled in the ledger, as a run would."""
    (attempt,), _ = ledger.write(
        L.reserve, [L.Want("p", 1, usd, 10)], run_id=run_id, dataset=dataset, owner="test", caps=Caps(), now=time.time()
    )
    ledger.write(
        L.settle, attempt, cost_usd=usd, prompt_tokens=1, completion_tokens=1, source="response", now=time.time()
    )


class FakeAccount:
    """A loopback OpenRouter /key endpoint whose figures the test sets."""

    def __init__(self, usage, remaining):
        self.usage, self.remaining, self.down = usage, remaining, False
        self.app = web.Application()
        self.app.router.add_get("/api/v1/key", self.key)

    async def key(self, request):
        if self.down:
            return web.json_response({"error": {"code": 503, "message": "unavailable"}}, status=503)
        return web.json_response({"data": {"usage": self.usage, "limit_remaining": self.remaining}})


def test_credit_sensor_alerts_each_anomaly_once_when_it_opens_and_once_when_it_closes(tmp_path):
    hook = Webhook()
    account = FakeAccount(usage=5.0, remaining=95.0)
    ledger = open_ledger(DataStore(root=str(tmp_path)).layout)
    with (
        ServerThread(hook.app) as hook_server,
        ServerThread(account.app) as account_server,
        dg.instance_for_test() as instance,
    ):
        resources = {
            "spend_policy": SpendPolicy(account_base_url=f"{account_server.base_url}/api/v1", account_api_key="k"),
            "store": DataStore(root=str(tmp_path)),
            "alerts": AlertSink(webhook_url=f"{hook_server.base_url}/hook"),
        }
        cursor = None

        def tick():
            nonlocal cursor
            context = dg.build_sensor_context(instance=instance, cursor=cursor, resources=resources)
            result = credit_sensor(context)
            assert isinstance(result, dg.SensorResult)
            cursor = result.cursor
            titles = [a["title"] for a in hook.alerts]
            hook.alerts.clear()
            return titles, result.asset_events[0].metadata if result.asset_events else None

        titles, _ = tick()  # the key spent $5 before the project: said once, as an offset
        assert len(titles) == 1 and titles[0].startswith("Account usage and the ledger start $+5.0000 apart")
        assert tick()[0] == []
        account.usage, account.remaining = 7.5, 92.5  # $2.50 billed that no journal knows of
        titles, metadata = tick()
        assert len(titles) == 1 and "drifted $+2.5000" in titles[0] and metadata["drift_usd"].value == 2.5
        assert tick()[0] == []  # still open: not alerted again
        bill(ledger, 2.5)  # the ledger catches up (e.g. an unsettled generation's look-up)
        assert tick()[0] == ["Ledger and account agree again"]
        account.usage, account.remaining = 7.0, 93.0  # an account never un-spends
        titles, _ = tick()
        assert any("usage went DOWN" in t for t in titles) and any("balance went UP" in t for t in titles)
        account.down = True  # the balance threshold cannot be enforced: said once, and once when it is back
        titles, _ = tick()
        assert len(titles) == 1 and titles[0].startswith(
            "Spend watch degraded: could not read the account (HTTPStatusError"
        )
        assert tick()[0] == []
        account.down = False
        assert tick()[0] == ["The account can be read again"]
        assert get_hold(ledger) is None


def run_status(instance: dg.DagsterInstance, run_id: str) -> dg.DagsterRunStatus:
    run = instance.get_run_by_id(run_id)
    assert run is not None, run_id
    return run.status


def _run(instance, job_name, asset_selection=None, status=dg.DagsterRunStatus.QUEUED, tags=None):
    """A run as the UI or the CLI would queue it (a queued run must name the code location it comes from)."""
    origin = RemoteJobOrigin(
        repository_origin=RemoteRepositoryOrigin(RegisteredCodeLocationOrigin("eagle3"), "__repository__"),
        job_name=job_name,
    )
    run = dg.DagsterRun(
        job_name=job_name,
        run_id=str(uuid.uuid4()),
        status=status,
        tags=tags or {},
        remote_job_origin=origin,
        asset_selection=frozenset(asset_selection) if asset_selection is not None else None,
    )
    return instance.add_run(run)


@pytest.mark.parametrize("hold_mode", ["drain", "cancel"])
def test_spending_runs_are_matched_by_job_and_asset_selection_then_cancelled(hold_mode):
    overrides = {"run_coordinator": {"module": "dagster._core.run_coordinator", "class": "QueuedRunCoordinator"}}
    with dg.instance_for_test(overrides=overrides) as instance:
        # An asset job selecting completions (how the UI's Materialize and `dagster asset materialize` launch),
        # the pipeline job with no selection (`dagster job launch`), and runs that do not buy completions.
        materialize = _run(instance, "__ASSET_JOB", {dg.AssetKey("raw_prompts"), dg.AssetKey("completions")})
        pipeline = _run(instance, "eagle3_pipeline")
        downstream = _run(instance, "eagle3_pipeline", {dg.AssetKey("token_ids"), dg.AssetKey("merged_dataset")})
        other = _run(instance, "lift_spend_hold")
        marked = _run(instance, "some_script_job", tags={"eagle3/spends": "true"})
        finished = _run(instance, "eagle3_pipeline", status=dg.DagsterRunStatus.SUCCESS)
        # Just created by `job launch`, no process yet: there is nothing to terminate, and it must not stay CANCELING
        # (holding its dataset's queue slot) for good.
        created = _run(instance, "eagle3_pipeline", status=dg.DagsterRunStatus.NOT_STARTED)
        started = _run(instance, "eagle3_pipeline", status=dg.DagsterRunStatus.STARTED)
        assert [spends(r) for r in (materialize, pipeline, downstream, other, marked)] == [
            True,
            True,
            False,
            False,
            True,
        ]

        graph = defs.resolve_asset_graph()
        backfill = PartitionBackfill.from_asset_partitions(
            backfill_id="bf-spend",
            asset_graph=graph,
            partition_names=["A1", "B8"],
            asset_selection=[dg.AssetKey("raw_prompts"), dg.AssetKey("completions")],
            backfill_timestamp=time.time(),
            tags={},
            dynamic_partitions_store=instance,
            all_partitions=False,
            title=None,
            description=None,
            run_config=None,
        )
        harmless = PartitionBackfill.from_asset_partitions(
            backfill_id="bf-ids",
            asset_graph=graph,
            partition_names=["A1"],
            asset_selection=[dg.AssetKey("token_ids")],
            backfill_timestamp=time.time(),
            tags={},
            dynamic_partitions_store=instance,
            all_partitions=False,
            title=None,
            description=None,
            run_config=None,
        )
        instance.add_backfill(backfill)
        instance.add_backfill(harmless)

        cancelled, stopped = cancel_spending(instance, hold_mode)

        expected = [materialize.run_id, pipeline.run_id, marked.run_id, created.run_id]
        if hold_mode == "cancel":  # a started run is terminated too; with drain it stops admitting by itself
            expected.append(started.run_id)
        assert sorted(cancelled) == sorted(expected)
        assert stopped == ["bf-spend"]
        status = {
            r.run_id: run_status(instance, r.run_id)
            for r in (materialize, pipeline, downstream, other, marked, finished, created, started)
        }
        assert (
            status[materialize.run_id]
            == status[pipeline.run_id]
            == status[marked.run_id]
            == dg.DagsterRunStatus.CANCELED
        )
        assert status[created.run_id] == dg.DagsterRunStatus.CANCELED
        assert status[downstream.run_id] == status[other.run_id] == dg.DagsterRunStatus.QUEUED
        assert status[finished.run_id] == dg.DagsterRunStatus.SUCCESS
        # No process owns this test's "started" run: cancelling it must end it, not leave it CANCELING.
        assert status[started.run_id] == (
            dg.DagsterRunStatus.CANCELED if hold_mode == "cancel" else dg.DagsterRunStatus.STARTED
        )
        spend_backfill, ids_backfill = instance.get_backfill("bf-spend"), instance.get_backfill("bf-ids")
        assert spend_backfill is not None and spend_backfill.status == BulkActionStatus.CANCELING
        assert ids_backfill is not None and ids_backfill.status == BulkActionStatus.REQUESTED


def sensor_tick(instance, ledger_root, policy, hook_url, cursor=None):
    resources = {
        "spend_policy": policy,
        "store": DataStore(root=str(ledger_root)),
        "alerts": AlertSink(webhook_url=hook_url),
    }
    return credit_sensor(dg.build_sensor_context(instance=instance, cursor=cursor, resources=resources))


def test_a_run_over_its_own_threshold_is_stopped_and_old_figures_hold_nothing(tmp_path, monkeypatch):
    """A per-run threshold is about that run; a finished run's or yesterday's spend never holds today's spending."""
    for var in (
        "EAGLE3_MIN_BALANCE_USD",
        "EAGLE3_MAX_RUN_USD",
        "EAGLE3_MAX_DAY_USD",
        "EAGLE3_MAX_TOTAL_USD",
        "OPENROUTER_API_KEY",
    ):
        monkeypatch.delenv(var, raising=False)
    hook = Webhook()
    ledger = open_ledger(DataStore(root=str(tmp_path)).layout)
    overrides = {"run_coordinator": {"module": "dagster._core.run_coordinator", "class": "QueuedRunCoordinator"}}
    with ServerThread(hook.app) as hook_server, dg.instance_for_test(overrides=overrides) as instance:
        url = f"{hook_server.base_url}/hook"
        finished = _run(instance, "eagle3_pipeline", status=dg.DagsterRunStatus.SUCCESS)
        running = _run(instance, "eagle3_pipeline", status=dg.DagsterRunStatus.STARTED)
        yesterday = time.time() - 86400
        for run, usd in ((finished, 9.0), (running, 6.0)):
            bill(ledger, usd, run_id=run.run_id)
        (old,), _ = ledger.write(
            L.reserve, [L.Want("q", 1, 50.0, 10)], run_id="older", dataset="A1", owner="t", caps=Caps(), now=yesterday
        )
        ledger.write(
            L.settle, old, cost_usd=50.0, prompt_tokens=1, completion_tokens=1, source="response", now=yesterday
        )
        policy = SpendPolicy(max_run_usd=5.0, max_day_usd=20.0)  # $15 today, $50 yesterday; run over $5: only `running`

        result = sensor_tick(instance, tmp_path, policy, url)
        assert get_hold(ledger) is None  # nothing global is crossed: today's $15 < $20, the finished run is history
        assert run_status(instance, running.run_id) == dg.DagsterRunStatus.CANCELED
        assert run_status(instance, finished.run_id) == dg.DagsterRunStatus.SUCCESS
        assert [a["title"] for a in hook.alerts] == [
            f"Run over its spend threshold, cancelled: run {running.run_id[:8]} spent $6.00 > $5.00 per run"
        ]
        hook.alerts.clear()
        sensor_tick(instance, tmp_path, policy, url, result.cursor)
        assert hook.alerts == []  # said once

        # A day cap crossed holds spending; lifted while still crossed it comes back, from today's figures; a raised
        # threshold lifts it by itself.
        tight = SpendPolicy(max_day_usd=10.0)
        sensor_tick(instance, tmp_path, tight, url)
        hold = get_hold(ledger)
        assert hold is not None and hold["reasons"] == ["spent today $15.00 > $10.00 per day"]
        lift_hold(ledger)
        sensor_tick(instance, tmp_path, tight, url)
        assert get_hold(ledger) is not None
        sensor_tick(instance, tmp_path, SpendPolicy(max_day_usd=30.0), url)
        assert get_hold(ledger) is None


def test_the_sensor_settles_what_runs_left_unsettled(tmp_path, tok, monkeypatch):
    """A generation whose bill a run did not get is looked up by the sensor (the run may be long gone)."""
    from fakes.openrouter import FakeOpenRouter, FakeSettings

    fake = FakeOpenRouter(tok, FakeSettings(api_key="k", generation_404_s=0.0))
    ledger = open_ledger(DataStore(root=str(tmp_path)).layout)
    with ServerThread(fake.app) as server, dg.instance_for_test() as instance:
        import httpx

        body = {"model": "moonshotai/kimi-k2.5", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
        resp = httpx.post(
            f"{server.base_url}/api/v1/chat/completions", json=body, headers={"Authorization": "Bearer k"}
        )
        gen = resp.headers["x-generation-id"]
        (attempt,), _ = ledger.write(
            L.reserve, [L.Want("p", 1, 0.01, 50)], run_id="gone", dataset="A1", owner="t", caps=Caps(), now=time.time()
        )
        ledger.write(L.unsettle, attempt, gen, "its stream was cut", time.time())
        assert ledger.figures().unsettled == 1
        monkeypatch.setenv("OPENROUTER_API_KEY", "k")
        monkeypatch.setenv("OPENROUTER_BASE_URL", f"{server.base_url}/api/v1")
        result = sensor_tick(instance, tmp_path, SpendPolicy(), None)
    assert ledger.figures().unsettled == 0
    assert ledger.figures().total.settled_usd == pytest.approx(fake.billing.total_usd)
    assert result.asset_events[0].metadata["settled_this_tick"].value["found"] == 1


def test_the_spend_asset_is_observed_when_a_figure_changes_not_on_every_tick(tmp_path, monkeypatch):
    for var in ("EAGLE3_MIN_BALANCE_USD", "EAGLE3_MAX_RUN_USD", "EAGLE3_MAX_DAY_USD", "OPENROUTER_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("EAGLE3_MAX_TOTAL_USD", "5")
    ledger = open_ledger(DataStore(root=str(tmp_path)).layout)
    with dg.instance_for_test() as instance:
        cursor, observations = None, []
        for i in range(12):
            if i == 6:
                bill(ledger, 1.25, dataset="B6")
            result = sensor_tick(instance, tmp_path, SpendPolicy(), None, cursor)
            cursor = result.cursor
            observations += result.asset_events
        assert len(observations) == 2  # the first tick, and the bill: not one per tick
        first, second = (o.metadata for o in observations)
        assert first["spent_total_usd"].value == 0.0 and second["spent_total_usd"].value == 1.25
        assert second["spent_B6_usd"].value == 1.25 and second["spent_today_usd"].value == 1.25
        assert second["threshold_max_total_usd"].value == 5.0 and second["spending"].value == "allowed (no hold)"
        assert second["spend_over_time"].value.startswith("![plot](data:image/png;base64,")
        bill(ledger, 4.0, dataset="B7")  # crosses max_total_usd: the hold and its reasons are in the next observation
        held = sensor_tick(instance, tmp_path, SpendPolicy(), None, cursor).asset_events[0]
        assert (
            held.metadata["spending"].value.startswith("ON HOLD since")
            and "spent in all $5.25 > $5.00" in held.metadata["spending"].value
        )
        assert held.description.startswith("ON HOLD")
        # Observe in the UI reads the same figures now, without the sensor
        assert observe(
            [spend],
            instance=instance,
            resources={"store": DataStore(root=str(tmp_path)), "spend_policy": SpendPolicy()},
        ).success
        observation = instance.fetch_observations(dg.AssetKey("spend"), limit=1).records[0].asset_observation
        assert observation is not None
        observed = observation.metadata
        assert observed["spent_total_usd"].value == 5.25 and observed["spent_B7_usd"].value == 4.0
        summary = observed["summary"].value
        assert isinstance(summary, str) and summary.startswith("ON HOLD since")
