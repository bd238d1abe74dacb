"""Money that cannot leak, driven from outside: the real client and ledger against the loopback fake OpenRouter.

The fake counts and bills with its own code, so its billing is the oracle: every bill it wrote must be in the
ledger (settled at its cost, or still held at a worst case no smaller), caps are checked against what it billed,
and no finished answer is bought twice. Several tests run spending processes (tests/spend_worker.py) and kill them.
"""

import collections
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG
from fakes.openrouter import FakeOpenRouter, FakeSettings, ServerThread
from support import bills_not_in_ledger, ledger_rows, stop_group, wait_for

from eagle3_assets.money import Caps, SpendPolicy, open_ledger, set_hold
from eagle3_assets.money import ledger as L
from eagle3_assets.money.settle import settle_due
from eagle3_assets.money.writer import LedgerWriter
from eagle3_assets.stages.completions.asset import completions
from eagle3_assets.stages.completions.run import final_results, run_completions
from eagle3_assets.stages.raw_prompts.asset import raw_prompts
from eagle3_resources.completions.openrouter import OpenRouterBackend
from eagle3_resources.completions.resource import BackendKind, CompletionsResource
from eagle3_resources.completions.types import SamplingSettings
from eagle3_resources.journal import read_journal
from eagle3_resources.storage import DataLayout, DataStore
from eagle3_resources.target.resource import TargetModelResource
from eagle3_resources.tokenizer.resource import TokenizerResource

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("spend_worker.py")
KEY = "k-money"
sys.path.insert(0, str(Path(__file__).parent))
from spend_worker import PRICING, synthetic  # noqa: E402


@pytest.fixture
def serve(tok):
    started = []

    def make(**settings):
        fake = FakeOpenRouter(tok, FakeSettings(api_key=KEY, **settings))
        thread = ServerThread(fake.app)
        thread.__enter__()
        started.append(thread)
        fake.url = f"{thread.base_url}/api/v1"
        return fake

    yield make
    for thread in started:
        thread.__exit__(None, None, None)


def step_failure_message(event: dg.DagsterEvent) -> str:
    error = event.step_failure_data.error
    assert error is not None, event
    return error.message


def backend(fake, **kw):
    kw.setdefault("backoff_base_s", 0.02)
    kw.setdefault("backoff_cap_s", 0.3)
    return OpenRouterBackend(fake.url, KEY, **kw)


def complete(fake, tok, layout, dataset, n, **kw):
    settings = kw.pop("settings", SamplingSettings(max_tokens=400))
    options = {k: kw.pop(k) for k in list(kw) if k not in ("concurrency", "stream", "max_attempts")}
    options.setdefault("pricing", PRICING)
    return run_completions(
        dataset,
        synthetic(tok, dataset, n),
        backend(fake, **kw),
        settings,
        layout.completions_journal(dataset),
        ledger=open_ledger(layout),
        log=print,
        **options,
    )


def complete_bills_per_prompt(fake) -> collections.Counter:
    return collections.Counter(b.prompt_key for b in fake.billing.bills if b.kind == "complete")


# -- caps ---------------------------------------------------------------------------------------------------------


def test_a_two_dataset_run_with_a_run_cap_stays_within_it_pilots_included(tmp_path, data_dir_with_standin, serve):
    """The run cap is the Dagster run's, across its datasets and their pilots (it used to restart at $0 for each)."""
    fake = serve(latency_s=0.05)
    cap = 0.004  # about a third of what B6 + B7 cost; 13 worst cases of 400 completion tokens
    resources = {
        "store": DataStore(root=str(data_dir_with_standin)),
        "tokenizer": TokenizerResource(standin_dir=str(data_dir_with_standin / "standin")),
        "target": TargetModelResource(standin_dir=str(data_dir_with_standin / "standin")),
        "completions_backend": CompletionsResource(
            backend=BackendKind.OPENROUTER, openrouter_base_url=fake.url, openrouter_api_key=KEY
        ),
        "spend_policy": SpendPolicy(),
    }
    with dg.instance_for_test() as instance:
        result = dg.materialize(
            [raw_prompts, completions],
            instance=instance,
            resources=resources,
            raise_on_error=False,
            tags={ASSET_PARTITION_RANGE_START_TAG: "B6", ASSET_PARTITION_RANGE_END_TAG: "B7"},
            run_config={"ops": {"completions": {"config": {"max_tokens": 400, "pilot_size": 4, "max_run_usd": cap}}}},
        )
    ledger = open_ledger(DataStore(root=str(data_dir_with_standin)).layout)
    run_scope = ledger.read(L.scope, f"run:{result.run_id}")
    print(f"billed ${fake.billing.total_usd:.6f} of a ${cap} run cap in {len(fake.billing.bills)} bills")
    assert fake.billing.total_usd <= cap  # the fake's own count of what it billed
    assert run_scope.settled_usd == pytest.approx(fake.billing.total_usd, rel=1e-9)
    assert 0 < len(fake.billing.bills) < 28 + 32
    journals = [read_journal(data_dir_with_standin / "completions" / d / "journal.jsonl").records for d in ("B6", "B7")]
    ends = [r for records in journals for r in records if r.get("type") == "end"]
    assert any("run dollar cap $0.00" in (e["stopped_by"] or "") for e in ends), ends
    assert bills_not_in_ledger(fake, ledger) == []


def worker(tmp_path, fake, tok, data_dir, run_id, datasets, *, name, **kw):
    args = [
        sys.executable,
        str(WORKER),
        "--url",
        fake.url,
        "--key",
        KEY,
        "--tokenizer",
        str(tok.folder),
        "--data",
        str(data_dir),
        "--run-id",
        run_id,
        "--datasets",
        datasets,
    ]
    for k, v in kw.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return subprocess.Popen(
        args,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=open(tmp_path / f"{name}.log", "w"),
        text=True,
        start_new_session=True,
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("ledger_in", ["sqlite", "postgres"], indirect=True)
def test_two_processes_started_together_on_one_total_cap_stay_within_it(tmp_path, tok, serve, ledger_in):
    fake = serve(latency_s=0.3, chunk_latency_s=0.02)
    data = tmp_path / "data"
    cap = 0.01  # about 31 answers, or 9 worst cases of 400 completion tokens
    start = time.time() + 15.0  # both import, load the tokenizer, then start in the same instant
    procs = [
        worker(
            tmp_path,
            fake,
            tok,
            data,
            f"run-{i}",
            f"D{i}",
            name=f"w{i}",
            prompts=60,
            total_usd=cap,
            start_at=start,
            concurrency=4,
        )
        for i in range(2)
    ]
    try:
        outs = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs]
    finally:
        for p in procs:
            stop_group(p)
    print(outs, f"billed ${fake.billing.total_usd:.6f}")
    assert fake.billing.total_usd <= cap  # together, not each
    assert all(o["sent"] > 0 for o in outs)  # both really spent, at the same time
    assert all("total dollar cap" in (o["stopped_by"] or "") for o in outs)
    ledger = open_ledger(DataLayout(data))
    assert (data / "ledger").exists() == (ledger_in == "sqlite")  # the processes shared the server's ledger, not a file
    assert ledger.figures().total.settled_usd == pytest.approx(fake.billing.total_usd, rel=1e-9)
    assert bills_not_in_ledger(fake, ledger) == []


def test_the_token_budget_holds_with_tokens_in_flight(tmp_path, tok, serve):
    fake = serve(latency_s=0.05, mean_reasoning_words=60, mean_content_words=40)
    layout = DataLayout(tmp_path / "data")
    budget = 3000  # tokens; 32 requests in flight of up to 400 each would have overshot it by ~12,000
    run = complete(fake, tok, layout, "T", 200, concurrency=32, caps=Caps(token_budget=budget))
    billed = sum(b.completion_tokens for b in fake.billing.bills)
    print(f"{billed} completion tokens billed of a {budget} budget, {run.sent} requests")
    assert billed <= budget and run.sent > 5
    assert "token budget" in run.stopped_by


# -- retries, the hold ---------------------------------------------------------------------------------------------


def test_retries_under_a_hold_send_nothing(tmp_path, tok, serve):
    fake = serve(rate_429=1.0, retry_after_s=1.5)  # every attempt is refused: every worker sits in its backoff
    layout = DataLayout(tmp_path / "data")
    ledger = open_ledger(layout)
    at_hold = {}

    def hold_when_all_refused():
        wait_for(lambda: len(fake.billing.requests) >= 4, 60, "the first refusals")
        set_hold(ledger, ["account balance $0.40 < minimum $0.50"], {}, {})
        at_hold["requests"] = len(fake.billing.requests)

    thread = threading.Thread(target=hold_when_all_refused)
    thread.start()
    run = complete(fake, tok, layout, "T", 8, concurrency=4, max_attempts=50)
    thread.join()
    assert len(fake.billing.requests) == at_hold["requests"]  # not one retry went out after the hold
    assert run.stopped_by.startswith("halted: spending hold") and run.results["aborted"] == 4
    done, _ = final_results(layout.completions_journal("T"))
    assert done == {}  # nothing final: sent again once the hold is lifted


@pytest.mark.slow
def test_a_provider_capping_requests_per_second_gets_every_prompt_answered(tmp_path, tok, serve):
    fake = serve(max_rps=50.0)  # 429 with X-RateLimit-Limit/Remaining/Reset (epoch ms), no Retry-After
    layout = DataLayout(tmp_path / "data")
    started = time.monotonic()
    run = complete(fake, tok, layout, "T", 400, concurrency=256, max_attempts=6)
    took = time.monotonic() - started
    refused = fake.billing.statuses.count(429)
    print(f"400 prompts in {took:.1f}s under a 50 req/s cap: {refused} refusals (429)")
    assert run.results["ok"] == 400 and run.results["deferred"] == 0 and run.results["failed"] == 0
    assert refused > 0  # the cap was met, and paced (the old client failed 90 of 400 after 6 attempts)
    assert max(complete_bills_per_prompt(fake).values()) == 1


# -- unsettled generations -----------------------------------------------------------------------------------------


LATE_BILL_S = 10.0  # after the cancelled run has ended and a resume right away has run (1 s settle window)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_generation_billed_after_the_run_stopped_looking_is_in_the_ledger_and_its_prompt_is_not_paid_twice(
    tmp_path, tok, serve
):
    # This provider keeps generating after a stream is cancelled and bills the whole answer LATE_BILL_S later: after
    # the cancelled run has stopped looking for it, and after a resume right away.
    fake = serve(latency_s=0.3, chunk_latency_s=0.2, late_bill_s=LATE_BILL_S, generation_404_s=0.0)
    layout = DataLayout(tmp_path / "data")
    ledger = open_ledger(layout)
    stop = threading.Event()

    def terminate_after_a_few():
        wait_for(lambda: len(fake.billing.requests) >= 6, 60, "requests in flight")
        stop.set()

    threading.Thread(target=terminate_after_a_few, daemon=True).start()
    first = complete(
        fake,
        tok,
        layout,
        "T",
        12,
        concurrency=6,
        halt=lambda: "terminated by the operator" if stop.is_set() else None,
        halt_poll_s=0.1,
        on_terminate="cancel",
    )
    cancelled_at = time.monotonic()
    assert first.attempt_outcomes.get("unsettled", 0) > 0, first.attempt_outcomes
    unsettled = {r["prompt_id"] for r in ledger_rows(ledger) if r["state"] == "unsettled"}
    assert fake.billing.bills == [] or all(b.kind != "late" for b in fake.billing.bills)  # nothing late billed yet

    # A resume right away: those prompts are not sent again while their bills are outstanding.
    second = complete(fake, tok, layout, "T", 12, concurrency=6, settle_window_s=1.0)
    assert second.blocked == len(unsettled)
    sent = collections.Counter(json.dumps(b["messages"], sort_keys=True) for b in fake.billing.requests)
    assert max(sent.values()) == 1  # no prompt sent twice

    # The sensor (or `eagle3 ledger settle`) keeps looking: the late bills are found once they exist.
    wait_for(lambda: len([b for b in fake.billing.bills if b.kind == "late"]) == len(unsettled), 60, "the late bills")
    assert time.monotonic() - cancelled_at >= LATE_BILL_S - 1  # billed after both runs ended

    async def settle():
        with LedgerWriter(ledger) as writer:
            async with backend(fake).account() as account:
                return await settle_due(writer, account.generation, deadline_s=10.0, horizon_s=900.0)

    import asyncio

    report = asyncio.run(settle())
    assert len(report.found_ids) == len(unsettled)
    assert bills_not_in_ledger(fake, ledger) == []
    late = [b for b in fake.billing.bills if b.kind == "late"]
    assert all(b.completion_tokens > 0 for b in late)  # the full answers, paid for once each
    assert ledger.figures().unsettled == 0


def test_a_never_found_generation_stays_unsettled_and_blocks_its_prompt_until_the_horizon(tmp_path, tok, serve):
    fake = serve(rate_truncate=0.5, rate_never_found=1.0, seed=3)
    layout = DataLayout(tmp_path / "data")
    ledger = open_ledger(layout)
    first = complete(fake, tok, layout, "T", 16, concurrency=4, unsettled_wait_s=1.0, settle_window_s=0.5)
    deferred = first.results["deferred"]
    assert deferred > 0 and first.results["ok"] + deferred == 16
    assert ledger.figures().unsettled == deferred  # held at their worst case, with their generation ids
    sent = collections.Counter(json.dumps(b["messages"], sort_keys=True) for b in fake.billing.requests)
    assert max(sent.values()) == 1  # the cut streams' prompts were not sent again

    second = complete(fake, tok, layout, "T", 16, concurrency=4, settle_window_s=0.5)
    assert second.sent == 0 and second.blocked == deferred
    assert len(fake.billing.requests) == 16

    # Past the horizon the reservation is given back and the prompt may be sent again.
    fake.settings.rate_truncate = 0.0
    third = complete(fake, tok, layout, "T", 16, concurrency=4, settle_window_s=0.5, horizon_s=0.0)
    assert third.sent == deferred and third.results["ok"] == deferred
    assert ledger.figures().total.expired_usd > 0


# -- kill -9 ---------------------------------------------------------------------------------------------------------


# When the kill lands, seconds after the provider's first request: a moment drawn at random in each window every run
# (printed with the figures), so the runs of the suite together cover the whole two-dataset run (about 10 s), where
# six fixed moments covered six points of it twice as slowly: the first requests' streams, the middle, the end.
KILL_WINDOWS_S = {"early": (0.1, 1.0), "middle": (1.0, 4.0), "late": (4.0, 10.0)}


@pytest.mark.timeout(1200)
@pytest.mark.parametrize(
    ("ledger_in", "window"),
    [*(("sqlite", w) for w in KILL_WINDOWS_S), ("postgres", "middle")],
    indirect=["ledger_in"],
)
@pytest.mark.slow
def test_kill_9_at_any_moment_of_a_two_dataset_run_loses_no_bill_and_pays_no_answer_twice(
    tmp_path, tok, serve, ledger_in, window
):
    kill_after_s = round(random.uniform(*KILL_WINDOWS_S[window]), 2)
    fake = serve(latency_s=0.2, chunk_latency_s=0.05, mean_reasoning_words=30)
    data = tmp_path / "data"
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    cap = 0.08  # more than both datasets cost: the kill, not the cap, ends the first process
    proc = worker(tmp_path, fake, tok, data, run_id, "K1,K2", name="killed", prompts=80, run_usd=cap, concurrency=24)
    try:  # the moment is counted from the first request the provider sees (the process takes seconds to import)
        wait_for(lambda: fake.billing.requests, 120, "the first request")
        time.sleep(kill_after_s)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        stop_group(proc)
    wait_for(lambda: not fake.inflight_worst, 60, "the fake to bill the streams it saw cut")
    ledger = open_ledger(DataLayout(data))
    assert (data / "ledger").exists() == (ledger_in == "sqlite")
    killed_bills = len(fake.billing.bills)

    # Resume under the same run id: the run cap spans both processes.
    resume = worker(tmp_path, fake, tok, data, run_id, "K1,K2", name="resume", prompts=80, run_usd=cap, concurrency=24)
    out, _ = resume.communicate(timeout=600)
    assert resume.returncode == 0, (tmp_path / "resume.log").read_text()[-3000:]
    problems = bills_not_in_ledger(fake, ledger)
    print(
        f"killed {kill_after_s}s in with {killed_bills} bills; {len(fake.billing.bills)} after the resume; "
        f"{ledger.figures().unidentified} cut before their id; {problems}"
    )
    assert problems == []  # every bill the fake wrote is in the ledger
    assert max(complete_bills_per_prompt(fake).values()) == 1  # no finished answer bought twice
    assert fake.billing.total_usd <= cap  # the run cap held across the two processes
    figures = ledger.figures([run_id])
    # Settled at the exact bill, or (an attempt killed before its generation id reached the client)
    # still held at a worst case that covers it: the two together are what the provider billed.
    rows = ledger_rows(ledger)
    by_generation = {r["generation_id"]: r for r in rows if r["generation_id"]}
    by_attempt = {r["attempt_id"]: r for r in rows}
    held = sum(
        b.cost
        for b in fake.billing.bills
        if (by_generation.get(b.id) or by_attempt.get(getattr(b, "attempt", None) or "", {})).get("state") != "settled"
    )
    assert figures.runs[run_id].settled_usd + held == pytest.approx(fake.billing.total_usd, rel=1e-9)
    done = sum(len(final_results(DataLayout(data).completions_journal(d))[0]) for d in ("K1", "K2"))
    assert done + figures.unidentified == 160  # all answered, but prompts cut before their generation id was known


# -- prices, projection, configuration ---------------------------------------------------------------------------------

ENDPOINTS = json.dumps(
    [
        {"provider_name": "Moonshot AI", "quantization": "int4", "price_prompt": 0.60e-6, "price_completion": 2.50e-6},
        {"provider_name": "Fireworks", "quantization": "fp8", "price_prompt": 0.90e-6, "price_completion": 3.00e-6},
        {"provider_name": "Cheap FP4", "quantization": "fp4", "price_prompt": 0.30e-6, "price_completion": 9.00e-6},
    ]
)


def test_prices_come_from_the_api_for_the_endpoints_the_routing_allows(serve):
    import asyncio

    from eagle3_assets.money.prices import fetch_prices
    from eagle3_resources.completions.types import MaxPrice, ProviderRouting

    fake = serve(endpoints=ENDPOINTS)

    async def sheet(routing):
        async with backend(fake).account() as account:
            return await fetch_prices(account, "moonshotai/kimi-k2.5", routing.to_request())

    default = asyncio.run(sheet(ProviderRouting()))  # the default routing excludes the fp4 family
    assert {e.provider for e in default.endpoints} == {"Moonshot AI", "Fireworks"}
    assert default.pricing().prompt == pytest.approx(0.90e-6) and default.pricing().completion == pytest.approx(3.00e-6)
    capped = ProviderRouting(max_price=MaxPrice(prompt=0.7, completion=2.6), sort="price")
    assert (
        capped.to_request()["max_price"] == {"prompt": 0.7, "completion": 2.6}
        and capped.to_request()["sort"] == "price"
    )
    cheap = asyncio.run(sheet(capped))  # what OpenRouter may route to under max_price: the worst case admission uses
    assert [e.provider for e in cheap.endpoints] == ["Moonshot AI"] and cheap.pricing().completion == pytest.approx(
        2.50e-6
    )
    assert any("Fireworks" in x and "max_price" in x for x in cheap.excluded)


def materialize_b6(data_dir, fake, config, **resource):
    resources = {
        "store": DataStore(root=str(data_dir)),
        "tokenizer": TokenizerResource(standin_dir=str(data_dir / "standin")),
        "target": TargetModelResource(standin_dir=str(data_dir / "standin")),
        "completions_backend": CompletionsResource(
            backend=BackendKind.OPENROUTER, openrouter_base_url=fake.url, openrouter_api_key=KEY, **resource
        ),
        "spend_policy": SpendPolicy(),
    }
    with dg.instance_for_test() as instance:
        result = dg.materialize(
            [raw_prompts, completions],
            partition_key="B6",
            instance=instance,
            resources=resources,
            raise_on_error=False,
            run_config={"ops": {"completions": {"config": config}}},
        )
        failure = next(
            (step_failure_message(e) for e in result.all_events if e.event_type_value == "STEP_FAILURE"),
            None,
        )
        materialization = result.asset_materializations_for_node("completions")
        return result, failure, (materialization[0].metadata if materialization else None)


def test_a_pilot_billed_above_the_listed_prices_stops_the_run_before_the_rest(data_dir_with_standin, serve):
    fake = serve(billed_price_factor=1.3)  # this provider bills 30% above what the endpoint list advertises
    result, failure, _ = materialize_b6(data_dir_with_standin, fake, {"pilot_size": 4, "max_tokens": 400})
    assert not result.success and "pilot" in failure
    checks = [
        e.asset_check_evaluation_data for e in result.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"
    ]
    pilot = next(c for c in checks if c.check_name == "pilot")
    assert not pilot.passed and "every cap would be priced wrong" in pilot.description
    assert len(fake.billing.requests) == 4  # only the pilot was bought


def test_the_projection_is_recorded_and_stops_a_partition_that_would_cost_too_much(data_dir_with_standin, serve):
    fake = serve(latency_s=0.05)
    result, failure, _ = materialize_b6(
        data_dir_with_standin, fake, {"pilot_size": 4, "max_tokens": 400, "max_projected_usd": 0.001}
    )
    assert not result.success and "more than max_projected_usd $0.00" in failure and "should cost about $" in failure
    assert len(fake.billing.requests) == 4
    # Raised: the rest is sent, and the projection made after the pilot is close to what it then cost.
    result, _, metadata = materialize_b6(
        data_dir_with_standin, fake, {"pilot_size": 4, "max_tokens": 400, "max_projected_usd": 1.0}
    )
    assert result.success
    rest = sum(b.cost for b in fake.billing.bills[4:])
    assert "projection" not in metadata  # the pilot passed in the first run: no new pilot, no new projection
    ledger = open_ledger(DataStore(root=str(data_dir_with_standin)).layout)
    first_projection = [
        r
        for r in read_journal(data_dir_with_standin / "completions" / "B6" / "journal.jsonl").records
        if r.get("type") == "projection"
    ]
    assert first_projection and first_projection[0]["usd"] == pytest.approx(rest, rel=0.35)
    assert bills_not_in_ledger(fake, ledger) == []


def test_a_partial_launchpad_config_keeps_the_backend_the_environment_chose(monkeypatch, serve):
    # Dagster replaces a resource's whole configuration when run config sets any of it: {concurrency: 2000} used to
    # drop the environment-derived backend and fall back, silently, to the local model.
    fake = serve()
    monkeypatch.setenv("EAGLE3_COMPLETIONS_BACKEND", "openrouter")
    monkeypatch.setenv("OPENROUTER_BASE_URL", fake.url)
    monkeypatch.setenv("OPENROUTER_API_KEY", KEY)
    seen: dict[str, object] = {}

    @dg.asset
    def probe(completions_backend: CompletionsResource) -> None:
        seen.update(
            kind=completions_backend.backend_kind(),
            concurrency=completions_backend.concurrency,
            # the OpenRouter backend reads no tokenizer
            backend=type(completions_backend.make_backend(None, lambda: None)).__name__,  # type: ignore[arg-type]
            sources=completions_backend.sources(),
        )

    defs = dg.Definitions(
        assets=[probe], resources={"completions_backend": CompletionsResource(backend=BackendKind.OPENROUTER)}
    )
    job = defs.get_implicit_global_asset_job_def()
    assert job.execute_in_process(
        run_config={"resources": {"completions_backend": {"config": {"concurrency": 2000}}}}
    ).success
    assert seen == {
        "kind": "openrouter",
        "concurrency": 2000,
        "backend": "OpenRouterBackend",
        "sources": {
            "backend": "$EAGLE3_COMPLETIONS_BACKEND",
            "openrouter_base_url": "$OPENROUTER_BASE_URL",
            "sglang_url": "default",
        },
    }
