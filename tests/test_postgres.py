"""The instance in a real PostgreSQL server (started by the tests, conftest.postgres_server): the team's
dagster.yaml, the pipeline on the stand-ins, two `eagle3 dev` on one instance (one daemon), the run queue's
per-dataset limit and the `gpu` pool across run workers. The credit sensor on PostgreSQL is in
test_operator_controls.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from itertools import combinations
from pathlib import Path

import dagster as dg
import psycopg2
import pytest
from support import QUICK_UNGATED_DRAFTER, eagle3_run, free_port, port_open, stop_group, wait_for

from eagle3_assets.operations.instance import INSTANCE_YAML, POSTGRES_INSTANCE_YAML, dagster_home

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def query(url: str, sql: str) -> list[tuple]:
    """Read the database directly, not through Dagster: what is stored is what the server says."""
    with psycopg2.connect(url) as conn, conn.cursor() as cur:
        cur.execute(sql)
        return cur.fetchall()


def clean_env(home: Path, url: str | None) -> dict[str, str]:
    env = dict(os.environ, DAGSTER_HOME=str(home), PYTHONUNBUFFERED="1")
    for var in (
        "EAGLE3_POSTGRES_URL",
        "EAGLE3_COMPLETIONS_BACKEND",
        "EAGLE3_TOKENIZER_DIR",
        "EAGLE3_TARGET_DIR",
        "OPENROUTER_API_KEY",
        "EAGLE3_EXECUTOR",
    ):
        env.pop(var, None)
    if url:
        env["EAGLE3_POSTGRES_URL"] = url
    return env


@pytest.fixture
def postgres_home(tmp_path, postgres_url, monkeypatch) -> Path:
    monkeypatch.setenv("EAGLE3_POSTGRES_URL", postgres_url)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster_home"))
    return dagster_home()


def test_the_team_instance_keeps_runs_events_schedules_and_slots_in_postgres(postgres_home, postgres_url):
    from dagster._core.run_coordinator import QueuedRunCoordinator
    from dagster_postgres import (
        PostgresEventLogStorage,
        PostgresRunStorage,
        PostgresScheduleStorage,
    )

    assert (postgres_home / "dagster.yaml").read_text() == POSTGRES_INSTANCE_YAML
    assert (REPO / "deploy" / "dagster.yaml").read_text() == POSTGRES_INSTANCE_YAML  # the checked-in file is this one
    assert postgres_url not in POSTGRES_INSTANCE_YAML  # the URL (and its password) stays in the environment
    with dg.DagsterInstance.get() as instance:
        assert isinstance(instance.run_storage, PostgresRunStorage)
        assert isinstance(instance.event_log_storage, PostgresEventLogStorage)
        assert isinstance(instance.schedule_storage, PostgresScheduleStorage)
        assert isinstance(instance.run_coordinator, QueuedRunCoordinator)
        queue = instance.get_concurrency_config().run_queue_config
        assert queue is not None
        assert queue.max_concurrent_runs == 4
        assert {limit["key"] for limit in queue.tag_concurrency_limits} == {
            "dagster/partition",
            "dagster/asset_partition_range_start",
        }
        instance.add_run(dg.DagsterRun(job_name="probe", run_id="0" * 36))
    # What the server holds: the gpu pool's limit (shown on the UI's Concurrency page) and the run just added.
    assert query(postgres_url, 'select concurrency_key, "limit" from concurrency_limits') == [("gpu", 1)]
    assert query(postgres_url, "select concurrency_key, run_id from concurrency_slots") == [("gpu", None)]
    assert query(postgres_url, "select run_id, pipeline_name from runs") == [("0" * 36, "probe")]


def test_a_home_that_disagrees_with_the_variable_is_refused(tmp_path, postgres_url, monkeypatch):
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "sqlite_home"))
    monkeypatch.delenv("EAGLE3_POSTGRES_URL", raising=False)
    dagster_home()
    assert (tmp_path / "sqlite_home" / "dagster.yaml").read_text() == INSTANCE_YAML
    monkeypatch.setenv("EAGLE3_POSTGRES_URL", postgres_url)
    with pytest.raises(SystemExit, match="keeps the instance in SQLite, but EAGLE3_POSTGRES_URL is set"):
        dagster_home()
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "postgres_home"))
    dagster_home()
    monkeypatch.delenv("EAGLE3_POSTGRES_URL")
    with pytest.raises(SystemExit, match="keeps the instance in PostgreSQL, but EAGLE3_POSTGRES_URL is unset"):
        dagster_home()
    for bad in ("mysql://u@h/db", "postgresql+psycopg://u@h/db", "postgresql://u@h/"):
        monkeypatch.setenv("EAGLE3_POSTGRES_URL", bad)
        with pytest.raises(SystemExit, match="expected postgresql://user:password@host:port/database"):
            dagster_home()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_eagle3_run_on_postgres_records_its_run_and_assets_there(tmp_path, data_dir_with_standin, postgres_url):
    env = clean_env(tmp_path / "dagster_home", postgres_url) | {"EAGLE3_DATA_DIR": str(data_dir_with_standin)}
    proc = eagle3_run("B6", QUICK_UNGATED_DRAFTER, env, tmp_path)
    [(run_id, status)] = query(postgres_url, "select run_id, status from runs")
    assert status == "SUCCESS" and run_id in proc.stdout
    stored = query(postgres_url, "select asset_key from asset_keys")
    assert {json.loads(key)[0] for (key,) in stored} >= {
        "raw_prompts",
        "completions",
        "token_ids",
        "merged_dataset",
        "hidden_states",
        "eagle3_drafter",
    }
    # The GPU stages took the pool's one slot in the database and gave it back.
    assert query(postgres_url, "select count(*) from concurrency_slots where concurrency_key = 'gpu'") == [(1,)]
    assert query(postgres_url, "select count(*) from concurrency_slots where run_id is not null") == [(0,)]
    assert (data_dir_with_standin / "eagle3_drafter" / "model.safetensors").exists()


WORKSPACE = REPO / "tests" / "pool_workspace.yaml"


def launch(env: dict, job: str, tags: dict | None = None) -> subprocess.Popen:
    cmd = [str(BIN / "dagster"), "job", "launch", "-w", str(WORKSPACE), "-j", job]
    if tags:
        cmd += ["--tags", json.dumps(tags)]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def daemons_of(home: Path) -> list[int]:
    """Pids of the Dagster daemons running against this DAGSTER_HOME, read from /proc."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"dagster._daemon" in cmdline and f"DAGSTER_HOME={home}".encode() in environ:
            found.append(int(proc.name))
    return found


def intervals(log: Path) -> dict[tuple[str, str], tuple[float, float, str | None]]:
    events: dict[tuple[str, str], dict[str, float]] = {}
    partitions = {}
    for line in log.read_text().splitlines():
        item = json.loads(line)
        key = (item["run"], item["step"])
        assert item["event"] not in events.setdefault(key, {}), f"{key} {item['event']} twice: a step ran twice"
        events[key][item["event"]] = item["t"]
        partitions[key] = item["partition"]
    return {key: (e["start"], e["end"], partitions[key]) for key, e in events.items()}


def overlap(a: tuple[float, float, str | None], b: tuple[float, float, str | None]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_eagle3_dev_on_one_instance_run_one_daemon_that_keeps_the_dataset_queue_and_the_gpu_pool(
    tmp_path, postgres_url
):
    # Dagster runs one daemon per instance: two dequeue the same queued run, which is then launched twice (measured:
    # a run marked failed while its step ran). So a second `eagle3 dev` on a team's instance serves the UI only.
    home = tmp_path / "dagster_home"
    env = clean_env(home, postgres_url) | {
        "EAGLE3_TEST_STEP_LOG": str(tmp_path / "steps.jsonl"),
        "EAGLE3_TEST_STEP_SECONDS": "15",
    }
    devs = []

    def dev(name: str) -> subprocess.Popen:
        port = free_port()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "eagle3_assets.operations.cli",
                "dev",
                "--port",
                str(port),
                "--workspace",
                str(WORKSPACE),
            ],
            cwd=REPO,
            env=env,
            stdout=open(tmp_path / f"{name}.log", "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        devs.append(proc)
        wait_for(lambda: port_open(port), 180, f"{name}'s UI", every=0.5)
        return proc

    try:
        dev("first")
        wait_for(
            lambda: query(postgres_url, "select count(*) from daemon_heartbeats") != [(0,)],
            180,
            "the daemon's heartbeat",
        )
        dev("second")
        assert "starting the UI only" in (tmp_path / "second.log").read_text()
        assert len(daemons_of(home)) == 1, daemons_of(home)
        # Queued at once: three GPU runs, two runs of B6, one of B7 (more than the queue's 4 concurrent runs).
        launches = [launch(env, "gpu_job") for _ in range(3)]
        launches += [launch(env, "dataset_job", {"dagster/partition": ds}) for ds in ("B6", "B6", "B7")]
        for proc in launches:
            out, _ = proc.communicate(timeout=300)
            assert proc.returncode == 0, out[-3000:]
        assert query(postgres_url, "select count(*) from runs") == [(6,)]

        def all_done() -> bool:
            states = query(postgres_url, "select status from runs")
            assert not {"FAILURE", "CANCELED"} & {s for (s,) in states}, states
            return all(s == "SUCCESS" for (s,) in states)

        wait_for(all_done, 600, "the six runs to succeed", every=1)
        assert all(proc.poll() is None for proc in devs), "an `eagle3 dev` stopped early"
        assert len(daemons_of(home)) == 1
        # Stopping the UI-only one leaves the daemon's heartbeats; stopping the daemon's drops them, so that the
        # next `eagle3 dev` starts a daemon at once.
        stop_group(devs[1])
        assert query(postgres_url, "select count(*) from daemon_heartbeats") != [(0,)]
        stop_group(devs[0])
        assert query(postgres_url, "select count(*) from daemon_heartbeats") == [(0,)] and daemons_of(home) == []
    finally:
        for proc in devs:
            stop_group(proc)
    steps = intervals(tmp_path / "steps.jsonl")
    assert len(steps) == 6, steps  # every run's step ran, and only once
    gpu = [span for (_, step), span in steps.items() if step == "gpu_stage"]
    b6 = [span for (_, step), span in steps.items() if step == "dataset_stage" and span[2] == "B6"]
    assert len(gpu) == 3 and len(b6) == 2
    assert not any(overlap(a, b) for a, b in combinations(gpu, 2)), f"two GPU steps at once: {sorted(gpu)}"
    assert not overlap(*b6), f"two runs of one dataset at once: {b6}"
