"""The real prompt sets through Dagster and the `eagle3 prompts` command, from local copies of the sources."""

import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import polars as pl
import pytest
from support import build_source_tree

from eagle3_assets.definitions import resources
from eagle3_assets.stages.completions.asset import completions
from eagle3_assets.stages.raw_prompts.asset import raw_prompts
from eagle3_resources.storage import DataStore

REPO = Path(__file__).resolve().parents[1]


def eagle3(args, tmp_path, data_dir):
    env = dict(os.environ, DAGSTER_HOME=str(tmp_path / "dagster_home"), EAGLE3_DATA_DIR=str(data_dir))
    for var in ("EAGLE3_PROMPTS", "EAGLE3_SOURCES_DIR", "EAGLE3_TOKENIZER_DIR", "HF_HUB_OFFLINE"):
        env.pop(var, None)
    env["HF_HUB_OFFLINE"] = "1"  # a test must never reach the hub
    return subprocess.run(
        [sys.executable, "-m", "eagle3_assets.operations.cli", "prompts", *args],
        check=False,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_eagle3_prompts_real_builds_every_dataset_and_reports_rejects(tmp_path, data_dir_with_standin):
    sources = build_source_tree(tmp_path / "sources")
    proc = eagle3(["--real", "--sources", str(sources)], tmp_path, data_dir_with_standin)
    # the fixtures carry a bad row or two in a handful: far above the 5% limit, so the blocking check fails
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "check reject_rate FAILED" in proc.stderr and "B5: 2 of 4 rows rejected (50.00%, limit 5.0%)" in proc.stderr
    table = {
        line.split()[0]: line.split()[1:6]
        for line in proc.stdout.splitlines()
        if line[:2] in ("A1", "A2") or line[:1] == "B"
    }
    assert table["B3"] == ["9", "3", "5", "0", "1"]  # rows, rejected, duplicates (4 of them B1's), filtered, selected
    assert table["B1"] == ["9", "3", "1", "1", "4"]
    raw = data_dir_with_standin / "raw_prompts"
    for name in ("A1", "A2", "B1", "B2", "B3", "B4", "B5", "B6", "B7", "B8"):
        df = pl.read_parquet(raw / f"{name}.parquet")
        fewest_tokens, shortest_row = df["prompt_tokens"].min(), df["source_row"].str.len_chars().min()
        assert isinstance(fewest_tokens, int) and isinstance(shortest_row, int), name  # None: no rows
        assert df.height >= 1 and fewest_tokens > 0 and shortest_row > 0
    assert (raw / "B5.rejects.jsonl").read_text().count("\n") == 2
    b3 = pl.read_parquet(raw / "B3.parquet")["prompt_id"].to_list()

    # B3 alone: de-duplicated against B1's materialization, the same selection as in the full run
    again = eagle3(["--real", "--sources", str(sources), "--datasets", "B3"], tmp_path, data_dir_with_standin)
    assert again.returncode == 1 and "3 of 9 rows rejected (33.33%" in again.stderr, again.stderr[-2000:]
    assert pl.read_parquet(raw / "B3.parquet")["prompt_id"].to_list() == b3


@pytest.mark.timeout(1200)
def test_a_reject_rate_above_the_limit_blocks_the_paid_stage(tmp_path, data_dir_with_standin):
    sources = build_source_tree(tmp_path / "sources")
    with dg.instance_for_test() as instance:
        result = dg.materialize(
            [raw_prompts, completions],
            partition_key="B2",
            instance=instance,
            raise_on_error=False,
            resources={**resources(), "store": DataStore(root=str(data_dir_with_standin))},
            run_config={"ops": {"raw_prompts": {"config": {"prompts": "real", "sources_dir": str(sources)}}}},
        )
        checks = result.get_asset_check_evaluations()
    # the dataset's own check, then `all_datasets` (every dataset's evaluations in one, for the asset's page)
    assert [(c.check_name, c.passed) for c in checks] == [("reject_rate", False), ("all_datasets", False)]
    assert checks[0].description is not None
    assert "1 of 5 rows rejected (20.00%, limit 5.0%)" in checks[0].description
    assert "completions" not in [e.step_key for e in result.get_step_success_events()]
    assert not (data_dir_with_standin / "completions" / "B2").exists()
    meta = result.asset_materializations_for_node("raw_prompts")[0].metadata
    assert meta["prompts_source"].value == "real" and meta["rejected"].value == 1
    settings = meta["settings"].value
    assert isinstance(settings, dict) and settings["repo"] == "nvidia/OpenCodeInstruct"


@pytest.mark.parametrize(
    "arg, code, said",
    [
        ("B3...B1", 2, "B3 comes after B1"),
        ("B1...B9", 2, "unknown dataset(s) ['B9']"),
        ("A1,B2", 2, "must be a contiguous range"),
    ],
)
def test_dataset_ranges_are_checked_before_anything_runs(tmp_path, monkeypatch, capsys, arg, code, said):
    from eagle3_assets.operations.cli import main

    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dg"))
    monkeypatch.chdir(tmp_path)
    assert main(["prompts", "--datasets", arg]) == code
    assert said in capsys.readouterr().err
