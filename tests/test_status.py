"""`eagle3 status`: the terminal picture, on a fresh instance and after real runs.

The oracle never reads what the status reads: figures are compared with the Parquet files on disk
(read with polars here), check verdicts with the events `dg.materialize` returned, money with the
bills the fake API wrote.
"""

import json
import math
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import dagster as dg
import polars as pl
import pytest
from dagster._core.remote_origin import (
    RegisteredCodeLocationOrigin,
    RemoteJobOrigin,
    RemoteRepositoryOrigin,
)
from dagster._core.storage.tags import (
    ASSET_PARTITION_RANGE_END_TAG,
    ASSET_PARTITION_RANGE_START_TAG,
    PARTITION_NAME_TAG,
)
from fakes.openrouter import FakeOpenRouter, FakeSettings, ServerThread
from support import drafter_report

from eagle3_assets.common.per_dataset import SUMMARY_CHECK
from eagle3_assets.common.registry import DATASETS
from eagle3_assets.money import SpendLedger, SpendPolicy, open_ledger, set_hold
from eagle3_assets.money import ledger as L
from eagle3_assets.money.caps import Caps
from eagle3_assets.operations.instance import INSTANCE_YAML
from eagle3_assets.operations.quality import board_markdown, board_metadata
from eagle3_assets.operations.status import as_json, gather_status, render_text
from eagle3_assets.stages.completions.asset import completions
from eagle3_assets.stages.eagle3_drafter.asset import accept_length_metadata
from eagle3_assets.stages.raw_prompts.asset import raw_prompts
from eagle3_assets.stages.token_ids.asset import token_ids
from eagle3_resources.completions.resource import CompletionsResource
from eagle3_resources.storage import DataStore
from eagle3_resources.target.resource import TargetModelResource
from eagle3_resources.tokenizer.resource import TokenizerResource

REPO = Path(__file__).resolve().parents[1]
KEY = "k-status"
STAGES = ("raw_prompts", "completions", "token_ids")


def home_with_yaml(tmp_path) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text(INSTANCE_YAML)
    return home


def cli_status(home: Path, data_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, DAGSTER_HOME=str(home), EAGLE3_DATA_DIR=str(data_dir), PYTHONUNBUFFERED="1")
    env.pop("NO_COLOR", None)
    return subprocess.run(
        [sys.executable, "-m", "eagle3_assets.operations.cli", "status", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def resources_for(data_dir: Path, fake_url: str) -> dict:
    standin = str(data_dir / "standin")
    return {
        "store": DataStore(root=str(data_dir)),
        "tokenizer": TokenizerResource(standin_dir=standin),
        "target": TargetModelResource(standin_dir=standin),
        "completions_backend": CompletionsResource(
            # the config value as Dagster passes it; pydantic makes it a BackendKind
            backend="openrouter",  # type: ignore[arg-type]
            openrouter_base_url=fake_url,
            openrouter_api_key=KEY,
        ),
        "spend_policy": SpendPolicy(),
    }


def widest(text: str) -> int:
    """The widest line, paths aside (a path is as long as it is)."""
    return max(
        len(line) for line in text.splitlines() if not line.startswith(("DAGSTER_HOME ", "data root ", "ledger "))
    )


@pytest.fixture
def data_dir_with_tokenizer(tmp_path, standin_dir, tok) -> Path:
    """A fresh data root holding the session's stand-in tokenizer: all these stages need (completions come from the
    fake API, so the stand-in target, whose fitting is the slow part of `data_dir_with_standin`, is never built)."""
    root = tmp_path / "data"
    shutil.copytree(standin_dir, root / "standin")
    return root


def dataset_line(text: str, ds: str) -> str:
    return next(line for line in text.splitlines() if line.split()[:1] == [ds])


# -- a fresh instance ------------------------------------------------------------------------------


@pytest.mark.timeout(600)
@pytest.mark.parametrize("home_state", ["dagster.yaml only", "no directory yet"])
def test_fresh_instance_prints_every_dataset_not_materialized_and_exits_0(tmp_path, home_state):
    home = home_with_yaml(tmp_path) if home_state == "dagster.yaml only" else tmp_path / "nothing" / "home"
    data_dir = tmp_path / "data"
    data_dir.mkdir()

    proc = cli_status(home, data_dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    print(out)
    assert "\033[" not in out  # not a terminal: no colour codes
    assert widest(out) <= 120
    for ds in DATASETS:
        assert dataset_line(out, ds).split()[1:] == ["not", "materialized"] * 3
    assert "no runs in progress" in out
    assert "billed $0.0000 in all, $0.0000 today" in out and "spending hold: none" in out
    for stage in ("merged_dataset", "hidden_states", "eagle3_drafter"):
        assert f"{stage}  " in out

    proc = cli_status(home, data_dir, "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert list(doc["datasets"]) == list(DATASETS)
    assert not any(s["materialized"] for d in doc["datasets"].values() for s in d.values())
    assert all(v is None for d in doc["datasets"].values() for s in d.values() for v in s["figures"].values())
    assert doc["runs"] == [] and doc["errors"] == []
    assert doc["money"]["billed_usd"] == 0 and doc["money"]["unsettled"] == 0 and doc["money"]["hold"] is None


# -- runs in progress, the ledger, the hold, checks recorded without a partition -------------------


def _add_run(instance, status, job="eagle3_pipeline", **tags):
    """A run as the UI or the CLI would record it (a queued run must name the code location it comes from)."""
    origin = RemoteJobOrigin(
        repository_origin=RemoteRepositoryOrigin(RegisteredCodeLocationOrigin("eagle3"), "__repository__"), job_name=job
    )
    run = dg.DagsterRun(job_name=job, run_id=str(uuid.uuid4()), status=status, tags=tags, remote_job_origin=origin)
    instance.add_run(run)
    return run


def _report_check(instance, run_id, asset, name, passed, partition=None, metadata=None, severity="WARN"):
    from dagster._core.definitions.asset_checks.asset_check_evaluation import (
        AssetCheckEvaluation,
    )
    from dagster._core.events import DagsterEvent, DagsterEventType

    evaluation = AssetCheckEvaluation(
        asset_key=dg.AssetKey(asset),
        check_name=name,
        passed=passed,
        partition=partition,
        severity=getattr(dg.AssetCheckSeverity, severity),
        metadata=metadata or {},
        description=f"{name} {'passed' if passed else 'failed'}",
    )
    event = DagsterEvent(
        event_type_value=DagsterEventType.ASSET_CHECK_EVALUATION.value,
        job_name="eagle3_pipeline",
        event_specific_data=evaluation,
    )
    instance.report_dagster_event(event, run_id)


def _report_materialization(instance, run_id, asset, partition, metadata):
    from dagster._core.events import (
        DagsterEvent,
        DagsterEventType,
        StepMaterializationData,
    )

    mat = dg.AssetMaterialization(asset_key=asset, partition=partition, metadata=metadata)
    event = DagsterEvent(
        event_type_value=DagsterEventType.ASSET_MATERIALIZATION.value,
        job_name="eagle3_pipeline",
        event_specific_data=StepMaterializationData(mat),
    )
    instance.report_dagster_event(event, run_id)


@pytest.mark.timeout(300)
def test_status_shows_runs_money_hold_and_attributes_checks_without_a_partition(tmp_path, monkeypatch):
    monkeypatch.setenv("DAGSTER_HOME", str(home_with_yaml(tmp_path)))
    ledger = SpendLedger(tmp_path / "ledger" / "spend.sqlite")
    now = time.time()
    # B1: one attempt billed $0.25; B2: one in flight (worst $0.5) and one cut with a generation id (unsettled,
    # worst $0.125)
    (billed,), _ = ledger.write(
        L.reserve, [L.Want("p1", 1, 0.75, 100)], run_id="r1", dataset="B1", owner="t", caps=Caps(), now=now
    )
    ledger.write(L.settle, billed, cost_usd=0.25, prompt_tokens=10, completion_tokens=40, source="test", now=now)
    ledger.write(L.reserve, [L.Want("p2", 1, 0.5, 100)], run_id="r2", dataset="B2", owner="t", caps=Caps(), now=now)
    (cut,), _ = ledger.write(
        L.reserve, [L.Want("p3", 1, 0.125, 100)], run_id="r2", dataset="B2", owner="t", caps=Caps(), now=now
    )
    ledger.write(L.unsettle, cut, "gen-1", "stream cut", now)
    set_hold(ledger, ["daily spend $0.25 above max_day_usd $0.20"], {}, {"max_day_usd": 0.2})

    with dg.DagsterInstance.get() as instance:
        queued = _add_run(
            instance,
            dg.DagsterRunStatus.QUEUED,
            **{ASSET_PARTITION_RANGE_START_TAG: "B1", ASSET_PARTITION_RANGE_END_TAG: "B3"},
        )
        started = _add_run(instance, dg.DagsterRunStatus.STARTED, **{PARTITION_NAME_TAG: "B6"})
        _add_run(instance, dg.DagsterRunStatus.SUCCESS, **{PARTITION_NAME_TAG: "B7"})  # finished: not shown
        # A run over B1...B3 recorded one combined verdict with no partition (older instances): it failed for B2 only.
        # A later evaluation that names its partition (B1) is B1's latest.
        # Its completions metadata hold the same dollars for B1 and B2 (what made `eagle3 status` star them as the run's
        # total); the dollars shown are each dataset's own, from the ledger: B1 $0.25 billed, B2 nothing billed yet.
        _report_materialization(instance, queued.run_id, "completions", "B1", {"rows": 3, "cost_usd": 0.25})
        _report_materialization(instance, queued.run_id, "completions", "B2", {"rows": 4, "cost_usd": 0.25})
        _report_check(instance, queued.run_id, "completions", "error_rate", False, metadata={"failed_datasets": ["B2"]})
        _report_check(instance, queued.run_id, "completions", "complete", True)
        later = _add_run(instance, dg.DagsterRunStatus.SUCCESS, **{PARTITION_NAME_TAG: "B1"})
        _report_check(instance, later.run_id, "completions", "complete", False, partition="B1", severity="ERROR")
        # The drafter: lossless speculative decoding measured 3.21, the teacher-forced simulation says 5.09.
        _report_materialization(
            instance,
            later.run_id,
            "eagle3_drafter",
            None,
            {
                "accept_length_real": 3.21,
                "accept_length_real_untrained": 1.52,
                "accept_length_simulated": 5.09,
                "accept_length_simulated_untrained": 1.8,
                "final_loss": 2.5,
            },
        )
        check_keys = [dg.AssetCheckKey(dg.AssetKey("completions"), n) for n in ("complete", "error_rate")]
        status = gather_status(instance, ledger, check_keys=check_keys, now=now + 90)

    assert status.errors == []
    assert [(r.run_id, r.status, r.datasets) for r in status.runs] == [
        (queued.run_id, "QUEUED", ["B1", "B2", "B3"]),
        (started.run_id, "STARTED", ["B6"]),
    ]
    m = status.money
    assert m is not None
    assert (m.billed_usd, m.today_usd, m.in_flight, m.in_flight_worst_usd, m.unsettled, m.unsettled_worst_usd) == (
        0.25,
        0.25,
        1,
        0.5,
        1,
        0.125,
    )
    assert m.per_dataset["B1"]["billed_usd"] == 0.25 and m.per_dataset["B2"]["unsettled_worst_usd"] == 0.125
    assert m.hold is not None and m.hold["reasons"] == ["daily spend $0.25 above max_day_usd $0.20"]

    checks = {d.dataset: {c.name: c.passed for c in d.stages["completions"].checks} for d in status.datasets}
    assert checks["B1"] == {"complete": False, "error_rate": True}  # partitioned evaluation is newer than the run's
    assert checks["B2"] == {"complete": True, "error_rate": False}
    assert checks["B3"] == {"complete": True, "error_rate": True}
    assert checks["B4"] == {}
    b1 = status.datasets[list(DATASETS).index("B1")].stages["completions"]
    assert b1.materialized and b1.figures == {"rows": 3, "tokens": None, "usd": 0.25} and b1.shared == []
    b2 = status.datasets[list(DATASETS).index("B2")].stages["completions"]
    assert b2.figures == {"rows": 4, "tokens": None, "usd": 0.0} and b2.shared == []
    drafter = next(s for s in status.stages if s.asset == "eagle3_drafter")
    assert list(drafter.figures.items())[:3] == [("accept_length", 3.21), ("untrained", 1.52), ("simulated", 5.09)]

    text = render_text(status)
    print(text)
    assert widest(text) <= 120
    assert "B1...B3" in text and "QUEUED" in text and "STARTED" in text and "spends" in text
    assert "SPENDING HELD since" in text and "daily spend $0.25 above max_day_usd $0.20" in text
    assert (
        "billed $0.2500 in all" in text
        and "in flight 1 (worst $0.5000)" in text
        and "unsettled 1 (worst $0.1250)" in text
    )
    b1_line = dataset_line(text, "B1")
    assert " 3 " in b1_line and "1 ERROR" in b1_line and " 0.2500 " in b1_line
    assert " 0.0000 " in dataset_line(text, "B2") and "*" not in text  # each its own dollars, none a run total
    drafter_line = next(line for line in text.splitlines() if line.startswith("eagle3_drafter"))
    assert drafter_line.index("accept_length 3.21") < drafter_line.index("simulated 5.09")  # the real figure leads
    board = board_markdown(status)  # `pipeline_status` in the UI
    board_line = next(line for line in board.splitlines() if line.startswith("| eagle3_drafter"))
    assert board_line.index("accept_length 3.21") < board_line.index("simulated 5.09")
    board_meta = board_metadata(status)
    assert (board_meta["drafter_accept_length"], board_meta["drafter_accept_length_simulated"]) == (3.21, 5.09)
    assert "failing: completions: ERROR complete" in text and "completions: WARN error_rate" in text
    assert render_text(status, colour=True).count("\033[") > 0
    doc = json.loads(json.dumps(as_json(status)))
    assert doc["datasets"]["B2"]["completions"]["failing"] == ["WARN error_rate"]
    assert doc["runs"][0]["datasets"] == ["B1", "B2", "B3"]


# -- after a real run ------------------------------------------------------------------------------


@pytest.mark.timeout(1800)
def test_status_after_a_real_run_shows_the_dataset_figures_and_checks(
    tmp_path, data_dir_with_tokenizer, tok, monkeypatch
):
    ds = "B6"
    home = home_with_yaml(tmp_path)
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    # Some answers end in an error or are cut by max_tokens: completions' error_rate and truncated_share checks fail.
    fake = FakeOpenRouter(tok, FakeSettings(api_key=KEY, rate_finish_error=0.3, seed=5))
    with ServerThread(fake.app) as server, dg.DagsterInstance.get() as instance:
        result = dg.materialize(
            [raw_prompts, completions, token_ids],
            partition_key=ds,
            instance=instance,
            resources=resources_for(data_dir_with_tokenizer, f"{server.base_url}/api/v1"),
            run_config={"ops": {"completions": {"config": {"max_tokens": 30, "pilot_size": 0}}}},
        )
        assert result.success
        recorded = [
            e.asset_check_evaluation_data for e in result.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"
        ]
        # Each dataset's own evaluations; `all_datasets` sums them up for the UI, and status leaves it out.
        evaluations = [e for e in recorded if e.check_name != SUMMARY_CHECK]
        summaries = {e.asset_key.to_user_string(): e for e in recorded if e.check_name == SUMMARY_CHECK}
        assert set(summaries) == set(STAGES) and not summaries["completions"].passed
        assert "on B6" in str(summaries["completions"].description)
        started = time.monotonic()
        status = gather_status(instance, open_ledger(DataStore(root=str(data_dir_with_tokenizer)).layout))
        print(f"gather_status: {time.monotonic() - started:.2f} s")
    billed = sum(b.cost for b in fake.billing.bills)

    # What is on disk, read here.
    prompts = pl.read_parquet(data_dir_with_tokenizer / "raw_prompts" / f"{ds}.parquet")
    answers = pl.read_parquet(data_dir_with_tokenizer / "completions" / f"{ds}.parquet")
    ids = pl.read_parquet(data_dir_with_tokenizer / "token_ids" / f"{ds}.parquet")
    expected = {
        "raw_prompts": {"rows": prompts.height, "tokens": int(prompts["prompt_tokens"].sum())},
        "completions": {"rows": answers.height, "tokens": int(answers["completion_tokens"].fill_null(0).sum())},
        "token_ids": {"rows": ids.height, "tokens": int((ids["prompt_len"] + ids["completion_len"]).sum())},
    }
    failing = {
        stage: sorted(
            f"{e.severity.value} {e.check_name}"
            for e in evaluations
            if e.asset_key == dg.AssetKey(stage) and not e.passed
        )
        for stage in STAGES
    }
    names = {stage: {e.check_name for e in evaluations if e.asset_key == dg.AssetKey(stage)} for stage in STAGES}
    assert {"WARN error_rate", "WARN truncated_share"} <= set(failing["completions"])

    assert status.errors == [] and status.runs == []
    row = status.datasets[list(DATASETS).index(ds)]
    for stage in STAGES:
        shown = row.stages[stage]
        assert shown.materialized and shown.run_id == result.run_id
        assert {k: shown.figures[k] for k in ("rows", "tokens")} == expected[stage], stage
        assert sorted(c.label for c in shown.failing) == failing[stage], stage
        assert {c.name for c in shown.checks} == names[stage], stage
    assert math.isclose(row.stages["completions"].figures["usd"], billed, abs_tol=1e-6)  # every bill of the dataset
    assert status.money is not None
    assert math.isclose(status.money.billed_usd, billed, abs_tol=1e-6) and billed > 0
    assert status.money.per_dataset[ds]["billed_usd"] == status.money.billed_usd
    for other in DATASETS:
        if other != ds:
            assert not any(s.materialized for s in status.datasets[list(DATASETS).index(other)].stages.values())
    assert not any(s.materialized for s in status.stages)

    # The command, in another process, prints the same.
    proc = cli_status(home, data_dir_with_tokenizer)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(proc.stdout)
    assert widest(proc.stdout) <= 120
    cells = dataset_line(proc.stdout, ds).split()
    for stage in STAGES:
        for figure in ("rows", "tokens"):
            assert f"{expected[stage][figure]:,}" in cells, (stage, figure)
    assert "failing: completions: " in proc.stdout and all(label in proc.stdout for label in failing["completions"])
    for other in DATASETS:
        if other != ds:
            assert dataset_line(proc.stdout, other).split()[1:] == ["not", "materialized"] * 3
    assert f"billed ${billed:.4f} in all" in proc.stdout and "no runs in progress" in proc.stdout

    proc = cli_status(home, data_dir_with_tokenizer, "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    for stage in STAGES:
        shown = doc["datasets"][ds][stage]
        assert {k: shown["figures"][k] for k in ("rows", "tokens")} == expected[stage]
        assert sorted(shown["failing"]) == failing[stage]
    assert not doc["datasets"]["A1"]["raw_prompts"]["materialized"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_status_after_a_run_over_two_datasets_gives_each_its_own_rows(tmp_path, data_dir_with_tokenizer):
    # `eagle3 prompts` builds raw_prompts for A1 and A2 in one run (one step, two partitions).
    home = home_with_yaml(tmp_path)
    env = dict(os.environ, DAGSTER_HOME=str(home), EAGLE3_DATA_DIR=str(data_dir_with_tokenizer), PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "eagle3_assets.operations.cli", "prompts", "--datasets", "A1,A2"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    proc = cli_status(home, data_dir_with_tokenizer, "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    frames = {ds: pl.read_parquet(data_dir_with_tokenizer / "raw_prompts" / f"{ds}.parquet") for ds in ("A1", "A2")}
    total_tokens = sum(int(f["prompt_tokens"].sum()) for f in frames.values())
    for ds, frame in frames.items():
        shown = doc["datasets"][ds]["raw_prompts"]
        assert shown["materialized"] and shown["figures"]["rows"] == frame.height
        # Its own token count, or (metadata holding the run's total for every partition) marked as shared.
        if "tokens" in shown["shared"]:
            assert shown["figures"]["tokens"] == total_tokens
        else:
            assert shown["figures"]["tokens"] == int(frame["prompt_tokens"].sum())
        assert shown["failing"] == [] and set(shown["checks"]) == {"reject_rate"}
    assert doc["datasets"]["A1"]["raw_prompts"]["run_id"] == doc["datasets"]["A2"]["raw_prompts"]["run_id"]
    assert not doc["datasets"]["B1"]["raw_prompts"]["materialized"]
    text = cli_status(home, data_dir_with_tokenizer).stdout
    print(text)
    for ds, frame in frames.items():
        assert dataset_line(text, ds).split()[2] == f"{frame.height:,}"


def test_the_drafter_metadata_leads_with_the_real_accept_length():
    """The drafter's materialization: lossless decoding's figure first, the simulated one beside it, named."""
    report = drafter_report(
        trained={"accept_length": 5.09, "acc": [0.9] * 7}, untrained={"accept_length": 1.8, "acc": [0.1] * 7}
    )
    real = {"accept_length_real": 3.21, "accept_length_real_untrained": 1.52, "label": "target", "draft_steps": 3}
    meta = accept_length_metadata(report, real, {"accept_length": 4.9, "accept_length_real": 3.0})
    assert list(meta)[:2] == ["accept_length_real", "accept_length_real_untrained"]
    assert meta["accept_length_real"] == 3.21 and meta["accept_length_simulated"] == 5.09
    assert meta["accept_length_real_change"] == 0.21 and meta["accept_length_simulated_change"] == 0.19
    assert "accept_length" not in meta  # no unnamed figure
    # Each with its scale: 3.21 of a ceiling of 4 (3 draft steps decoded), 5.09 of 8 (the 7-step unroll, simulated).
    assert (meta["accept_length_real_draft_steps"], meta["accept_length_real_ceiling"]) == (3, 4)
    assert (meta["accept_length_simulated_draft_steps"], meta["accept_length_simulated_ceiling"]) == (7, 8)
    assert meta["accept_length_real_label"].endswith("3 draft steps, ceiling 4")
    assert meta["accept_length_simulated_label"].startswith("simulated, teacher-forced")
    assert "7 draft steps, ceiling 8" in meta["accept_length_simulated_label"]
    assert "the real figure's: 3 draft steps, ceiling 4" in meta["accept_length_simulated_label"]
    without = accept_length_metadata(report, None, None)  # a target too big to decode with here: simulated only, named
    assert list(without) == [
        "accept_length_simulated",
        "accept_length_simulated_untrained",
        "accept_length_simulated_draft_steps",
        "accept_length_simulated_ceiling",
        "accept_length_simulated_label",
        "accept_length_simulated_source",
    ]
    assert "real" not in without["accept_length_simulated_label"]
