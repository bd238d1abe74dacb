"""Paid completions under real Dagster runs: terminate, kill -9, resume, and the key kept secret.

A fake OpenRouter runs on loopback in this process; Dagster runs in real instances (a temporary
SQLite DAGSTER_HOME), `dagster dev` and run subprocesses in their own process groups, stopped by id.
"""

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pytest
from fakes.openrouter import FakeOpenRouter, FakeSettings, ServerThread
from support import bills_not_in_ledger, free_port, port_open, stop_group, wait_for

from eagle3_assets.money import SpendPolicy, open_ledger
from eagle3_assets.stages.completions.asset import completions
from eagle3_assets.stages.completions.run import final_results
from eagle3_assets.stages.raw_prompts.asset import raw_prompts
from eagle3_resources.completions.resource import BackendKind, CompletionsResource
from eagle3_resources.journal import read_journal
from eagle3_resources.storage import DataStore
from eagle3_resources.target.resource import TargetModelResource
from eagle3_resources.tokenizer.resource import TokenizerResource

REPO = Path(__file__).resolve().parents[1]
SECRET = "sk-or-v1-SECRET-must-never-be-stored-0123456789"


@pytest.fixture
def slow_fake(tok):
    fake = FakeOpenRouter(
        tok, FakeSettings(api_key=SECRET, latency_s=0.5, chunk_latency_s=0.15, mean_reasoning_words=30)
    )
    with ServerThread(fake.app) as server:
        fake.url = f"{server.base_url}/api/v1"
        yield fake


def env_for(tmp_path, data_dir, fake):
    env = dict(
        os.environ,
        DAGSTER_HOME=str(tmp_path / "home"),
        EAGLE3_DATA_DIR=str(data_dir),
        PYTHONUNBUFFERED="1",
        EAGLE3_COMPLETIONS_BACKEND="openrouter",
        OPENROUTER_BASE_URL=fake.url,
        OPENROUTER_API_KEY=SECRET,
    )
    Path(env["DAGSTER_HOME"]).mkdir(parents=True, exist_ok=True)
    return env


def resources_for(data_dir, fake):
    standin = str(data_dir / "standin")
    return {
        "store": DataStore(root=str(data_dir)),
        "tokenizer": TokenizerResource(standin_dir=standin),
        "target": TargetModelResource(standin_dir=standin),
        "completions_backend": CompletionsResource(
            backend=BackendKind.OPENROUTER,
            openrouter_base_url=fake.url,
            openrouter_api_key=dg.EnvVar("OPENROUTER_API_KEY"),
        ),
        "spend_policy": SpendPolicy(),
    }


def materialize_b6(data_dir, fake, instance):
    return dg.materialize(
        [raw_prompts, completions], partition_key="B6", instance=instance, resources=resources_for(data_dir, fake)
    )


def recovered(journal: Path) -> int:
    """Answers billed but lost at the stop, fetched from the provider's stored content instead of bought again."""
    return sum(
        1
        for r in read_journal(journal).records
        if r.get("type") == "result" and (r.get("extra") or {}).get("recovered_from") == "generation/content"
    )


def ok_count(journal: Path) -> int:
    return journal.read_bytes().count(b'"status":"ok"') if journal.exists() else 0


def requests_per_prompt(fake) -> collections.Counter:
    return collections.Counter(json.dumps(b["messages"], sort_keys=True) for b in fake.billing.requests)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_terminating_the_run_through_dagster_stops_within_2s_cuts_the_streams_and_resumes(
    tmp_path, data_dir_with_standin, slow_fake, monkeypatch
):
    from dagster_graphql import DagsterGraphQLClient

    monkeypatch.setenv("OPENROUTER_API_KEY", SECRET)
    env = env_for(tmp_path, data_dir_with_standin, slow_fake)
    port = free_port()
    dev = subprocess.Popen(
        [sys.executable, "-m", "eagle3_assets.operations.cli", "dev", "--port", str(port)],
        cwd=REPO,
        env=env,
        stdout=open(tmp_path / "dev.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    journal = data_dir_with_standin / "completions" / "B6" / "journal.jsonl"
    try:
        client = DagsterGraphQLClient("127.0.0.1", port_number=port, timeout=60)

        wait_for(lambda: port_open(port), 180, "dagster dev")
        run_id = None
        deadline = time.monotonic() + 120
        while run_id is None:  # the code location may still be loading
            try:
                run_id = client.submit_job_execution("eagle3_pipeline", tags={"dagster/partition": "B6"})
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(2)
        wait_for(lambda: ok_count(journal) >= 3, 300, "the first paid responses")
        asked = time.monotonic()
        client.terminate_run(run_id)
        # The end of this run's stop, not the pilot's normal end (which once passed for it).
        wait_for(lambda: read_journal(journal).records[-1].get("stopped_by"), 30, "the journal's end record")
        stopped_in = time.monotonic() - asked
        monkeypatch.setenv("DAGSTER_HOME", env["DAGSTER_HOME"])
        with dg.DagsterInstance.get() as instance:

            def the_run() -> dg.DagsterRun:
                run = instance.get_run_by_id(run_id)
                assert run is not None, run_id
                return run

            wait_for(lambda: the_run().is_finished, 60, "the run to end")
            assert the_run().status == dg.DagsterRunStatus.CANCELED
    finally:
        stop_group(dev)

    print(f"stopped {stopped_in:.2f}s after the terminate request")
    assert stopped_in < 2.0  # issue 3's acceptance: a Dagster terminate stops the partition within 2 s
    records = read_journal(journal).records
    end = records[-1]
    # Dagster signals the step with SIGINT; the run's CANCELING status, polled each second, may be seen first.
    assert end["type"] == "end" and end["stopped_by"] in ("SIGINT received", "halted: the run is being cancelled"), end
    aborted = [r for r in records if r.get("status") == "aborted"]
    assert aborted and all(r["error_code"] == "cancelled" for r in aborted)
    done_before = {r["prompt_id"] for r in records if r.get("type") == "result" and r["status"] == "ok"}
    assert 3 <= len(done_before) < 28
    wait_for(lambda: not slow_fake.inflight_worst, 60, "the fake to bill the streams it saw cancelled")
    sent_before = len(slow_fake.billing.requests)

    with dg.instance_for_test() as instance:
        result = materialize_b6(data_dir_with_standin, slow_fake, instance)
    assert result.success
    done, _ = final_results(journal)
    ledger = open_ledger(DataStore(root=str(data_dir_with_standin)).layout)
    blocked = (
        ledger.figures().unidentified
    )  # cancelled before their generation id arrived: not re-sent before the horizon
    assert len(done) + blocked == 28 and {r["status"] for r in done.values()} == {"ok"}
    # No finished answer was bought twice; the streams the terminate cancelled were billed for what they had generated
    # (looked up), and their prompts were sent again: the price of cancelling rather than draining (on_terminate).
    assert len(slow_fake.billing.requests) - sent_before == 28 - len(done_before) - blocked - recovered(journal)
    assert bills_not_in_ledger(slow_fake, ledger) == []


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kill_9_then_resume_never_resends_a_journaled_prompt(tmp_path, data_dir_with_standin, slow_fake, monkeypatch):
    monkeypatch.setenv("OPENROUTER_API_KEY", SECRET)
    env = env_for(tmp_path, data_dir_with_standin, slow_fake)
    journal = data_dir_with_standin / "completions" / "B6" / "journal.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "eagle3_assets.operations.cli",
        "dagster",
        "asset",
        "materialize",
        "-m",
        "eagle3_assets.definitions",
        "--select",
        "raw_prompts,completions",
        "--partition",
        "B6",
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=open(tmp_path / "run.log", "w"), stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        wait_for(lambda: ok_count(journal) >= 4, 300, "the first paid responses")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        stop_group(proc)
    wait_for(lambda: not slow_fake.inflight_worst, 60, "the fake to bill the streams it saw cut")
    before = read_journal(journal)
    done_before = {r["prompt_id"] for r in before.records if r.get("type") == "result" and r["status"] == "ok"}
    inflight = {r["generation_id"] for r in before.records if r.get("type") == "inflight"}
    assert done_before and inflight
    sent_before = requests_per_prompt(slow_fake)

    with dg.instance_for_test() as instance:
        result = materialize_b6(data_dir_with_standin, slow_fake, instance)
    assert result.success
    done, _ = final_results(journal)
    ledger = open_ledger(DataStore(root=str(data_dir_with_standin)).layout)
    # The resume put right what the killed process left in the ledger (from its journal), looked up the cut streams'
    # bills, and sent their prompts again; a stream cut before its generation id arrived cannot be looked up: its prompt
    # waits for the horizon rather than risk paying twice.
    blocked = ledger.figures().unidentified
    assert len(done) + blocked == 28
    sent_after = requests_per_prompt(slow_fake)
    for pid in done_before:  # a prompt with a journaled outcome is never sent again
        assert done[pid]["generation_id"] in {r["generation_id"] for r in before.records if r.get("type") == "result"}
    assert sum(sent_after.values()) - sum(sent_before.values()) == 28 - len(done_before) - blocked - recovered(journal)
    assert bills_not_in_ledger(slow_fake, ledger) == []  # every bill the fake wrote, cut streams included


def test_api_key_never_reaches_storage_logs_or_run_config(tmp_path, data_dir_with_standin, tok, monkeypatch, capfd):
    fake = FakeOpenRouter(tok, FakeSettings(api_key=SECRET))
    monkeypatch.setenv("OPENROUTER_API_KEY", SECRET)
    home = tmp_path / "instance"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    with ServerThread(fake.app) as server:
        fake.url = f"{server.base_url}/api/v1"
        with dg.instance_for_test(temp_dir=str(home)) as instance:
            result = materialize_b6(data_dir_with_standin, fake, instance)
            assert result.success and fake.billing.bills
            run = instance.get_run_by_id(result.run_id)
            assert run is not None
            assert SECRET not in json.dumps(run.run_config, default=str)
            for record in instance.get_event_records(
                dg.EventRecordsFilter(event_type=dg.DagsterEventType.ASSET_MATERIALIZATION)
            ):
                assert SECRET not in str(record.event_log_entry)
            for entry in instance.all_logs(result.run_id):
                assert SECRET not in (entry.message or "") and SECRET not in str(entry.dagster_event)
    stored = [p for p in home.rglob("*") if p.is_file()]
    assert any(b"request_settings" in p.read_bytes() for p in stored)  # the scan does read the event storage
    leaks = [p for p in stored if SECRET.encode() in p.read_bytes()]
    leaks += [
        p
        for p in data_dir_with_standin.rglob("*")
        if p.is_file() and p.stat().st_size < 50e6 and SECRET.encode() in p.read_bytes()
    ]
    assert leaks == []
    out, err = capfd.readouterr()
    assert SECRET not in out and SECRET not in err
