"""Safe first use: commands started together on a new DAGSTER_HOME all work.

Dagster's SQLite storage creates its tables without a lock: two `eagle3 dagster asset materialize` started
together on a new home failed with "table secondary_indexes already exists". `eagle3` makes the home, the
instance's storage, the data root and the spend ledger under an OS lock (instance.first_use).

The oracle opens what the commands made with sqlite3 and a fresh DagsterInstance here, never through `eagle3`.
Measured without the lock (a 2-core machine): commands gated to start together (as below) failed in 10 of 12
pairs, and this file's gated test failed 3 times in 3; pairs released together after their imports by polling a
file failed 1 time in 6, and the two real materializations below 1 time in 3. With the lock: none failed.
"""

import fcntl
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import polars as pl
import pytest
from dagster import DagsterInstance
from dagster._core.instance.ref import InstanceRef

from eagle3_assets.operations.instance import INSTANCE_YAML

REPO = Path(__file__).resolve().parents[1]
PAIRS = 3  # homes, each given two commands at once

# `eagle3 env` (which makes the home like every command) in a process that has loaded everything first and then
# waits at a gate: the test lifts the gate once all are ready, so the commands meet in the storage's creation
# instead of being spread over seconds of imports.
GATED = r"""
import fcntl, sys
from pathlib import Path
import alembic.command, sqlalchemy, dagster
import dagster._core.storage.runs.sqlite.sqlite_run_storage, dagster._core.storage.event_log.sqlite.sqlite_event_log
import dagster._core.storage.schedules.sqlite.sqlite_schedule_storage
from eagle3_assets.operations.cli import main
gate, ready = sys.argv[1], Path(sys.argv[2])
ready.touch()
with open(gate) as g:
    fcntl.flock(g, fcntl.LOCK_SH)  # blocks while the test holds the gate exclusively
sys.exit(main(sys.argv[3:]))
"""


def env_for(home: Path, data_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("EAGLE3_POSTGRES_URL", "EAGLE3_LEDGER_URL")}
    return dict(env, DAGSTER_HOME=str(home), EAGLE3_DATA_DIR=str(data_dir), PYTHONUNBUFFERED="1")


def assert_made(home: Path, data_dir: Path, runs: int = 0) -> None:
    """The home's instance and the data root's ledger, as a later command finds them (read without `eagle3`)."""
    assert (home / "dagster.yaml").read_text() == INSTANCE_YAML
    with sqlite3.connect(home / "history" / "runs.db") as db:  # stamped once, at Dagster's head revision
        assert len(db.execute("select version_num from alembic_version").fetchall()) == 1
    with DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
        assert len(instance.get_runs()) == runs
    with sqlite3.connect(data_dir / "ledger" / "spend.sqlite") as db:
        tables = {r[0] for r in db.execute("select name from sqlite_master where type = 'table'")}
        assert {"attempts", "scopes", "hold", "meta"} <= tables
        assert db.execute("select count(*) from meta where key = 'legacy_import'").fetchone() == (1,)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_commands_started_together_on_fresh_homes_all_work(tmp_path):
    gate = tmp_path / "gate"
    gate.touch()
    procs = []
    with open(gate) as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        for p in range(PAIRS):
            env = env_for(tmp_path / f"home{p}", tmp_path / f"data{p}")
            for k in range(2):
                procs.append(
                    (
                        p,
                        subprocess.Popen(
                            [sys.executable, "-c", GATED, str(gate), str(tmp_path / f"ready{p}-{k}"), "env"],
                            cwd=REPO,
                            env=env,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            text=True,
                            start_new_session=True,
                        ),
                    )
                )
        try:
            deadline = time.monotonic() + 600
            while len(list(tmp_path.glob("ready*"))) < len(procs) and time.monotonic() < deadline:
                assert all(proc.poll() is None for _, proc in procs), "a command exited before the gate opened"
                time.sleep(0.1)
            fcntl.flock(held, fcntl.LOCK_UN)  # every command starts now
            outputs = [(p, *proc.communicate(timeout=600)) for p, proc in procs]
            results = [(p, proc.returncode, out, err) for (p, out, err), (_, proc) in zip(outputs, procs, strict=True)]
        finally:
            for _, proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, 9)
                    proc.wait()
    failed = [f"home{p}: exit {rc}\n{err[-1500:]}" for p, rc, _, err in results if rc != 0]
    assert not failed, "\n".join(failed)
    for p in range(PAIRS):
        home, data_dir = tmp_path / f"home{p}", tmp_path / f"data{p}"
        for _, _, out, _ in (r for r in results if r[0] == p):
            assert f"export DAGSTER_HOME={home}" in out
        assert_made(home, data_dir)


@pytest.fixture
def data_dir_with_tokenizer(tmp_path, standin_dir, tok) -> Path:
    """A fresh data root holding the session's stand-in tokenizer (raw_prompts counts tokens with it)."""
    root = tmp_path / "data"
    shutil.copytree(standin_dir, root / "standin")
    return root


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_materializations_started_together_on_a_fresh_home(tmp_path, data_dir_with_tokenizer):
    """The issue's case as a user runs it: two `eagle3 dagster asset materialize` at once, one dataset each."""
    home = tmp_path / "home"
    env = env_for(home, data_dir_with_tokenizer)
    eagle3 = str(Path(sys.executable).with_name("eagle3"))
    procs = {
        ds: subprocess.Popen(
            [
                eagle3,
                "dagster",
                "asset",
                "materialize",
                "-m",
                "eagle3_assets.definitions",
                "--select",
                "raw_prompts",
                "--partition",
                ds,
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for ds in ("A1", "A2")
    }
    try:
        outputs = {ds: proc.communicate(timeout=800)[0] for ds, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    for ds, proc in procs.items():
        assert proc.returncode == 0, f"{ds}:\n{outputs[ds][-3000:]}"
    assert_made(home, data_dir_with_tokenizer, runs=2)
    with DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
        for ds in ("A1", "A2"):
            records = instance.fetch_materializations(
                dg.AssetRecordsFilter(asset_key=dg.AssetKey("raw_prompts"), asset_partitions=[ds]), limit=5
            ).records
            assert len(records) == 1, ds
            rows = pl.read_parquet(data_dir_with_tokenizer / "raw_prompts" / f"{ds}.parquet").height
            materialization = records[0].asset_materialization
            assert materialization is not None
            assert rows > 0 and materialization.metadata["rows"].value == rows
