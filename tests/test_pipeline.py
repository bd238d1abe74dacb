"""The whole pipeline through Dagster on the stand-ins: the README's main command, a real instance."""

import json
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import polars as pl
import pytest
from safetensors import safe_open
from support import QUICK_UNGATED_DRAFTER, eagle3_run
from test_descriptions import unquoted_special_tokens

from eagle3_assets.common.registry import DatasetSpec
from eagle3_assets.definitions import resources
from eagle3_assets.operations.cli import workspace_job_origin
from eagle3_assets.stages.completions.asset import completions
from eagle3_assets.stages.raw_prompts.asset import raw_prompts
from eagle3_resources.storage import DataStore

REPO = Path(__file__).resolve().parents[1]
ASSETS = ["raw_prompts", "completions", "token_ids", "merged_dataset", "hidden_states", "eagle3_drafter"]


def env_for(tmp_path, data_dir):
    env = dict(
        os.environ, DAGSTER_HOME=str(tmp_path / "dagster_home"), EAGLE3_DATA_DIR=str(data_dir), PYTHONUNBUFFERED="1"
    )
    for var in ("EAGLE3_COMPLETIONS_BACKEND", "EAGLE3_TOKENIZER_DIR", "EAGLE3_TARGET_DIR", "OPENROUTER_API_KEY"):
        env.pop(var, None)
    return env


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_eagle3_run_leaves_a_finished_run_and_a_loadable_drafter(tmp_path, data_dir_with_standin):
    env = env_for(tmp_path, data_dir_with_standin)
    proc = eagle3_run("B6,B7", QUICK_UNGATED_DRAFTER, env, tmp_path)
    assert "SUCCESS" in proc.stdout

    os.environ["DAGSTER_HOME"] = env["DAGSTER_HOME"]
    try:
        with dg.DagsterInstance.get() as instance:
            runs = instance.get_runs()
            assert [r.job_name for r in runs] == ["eagle3_pipeline"] and runs[0].status == dg.DagsterRunStatus.SUCCESS
            # the origin a launched run has, so the UI's landing page (the timeline) shows it (test_run_origin.py)
            assert runs[0].remote_job_origin == workspace_job_origin("eagle3_pipeline")
            # `--config` reached the drafter: the gate measured the gain and said it was not required
            checked = instance.all_logs(runs[0].run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION)
            [gain] = [e.message for e in checked if "'speculative_gain'" in e.message]
            assert "passed" in gain and "gain not required" in gain, gain
            for key in ASSETS:
                assert instance.get_latest_materialization_event(dg.AssetKey(key)) is not None, key
            for ds in ("B6", "B7"):
                assert ds in instance.get_materialized_partitions(dg.AssetKey("token_ids"))
            drafter_event = instance.get_latest_materialization_event(dg.AssetKey("eagle3_drafter"))
            assert drafter_event is not None and drafter_event.asset_materialization is not None
            meta = drafter_event.asset_materialization.metadata
            assert_each_dataset_has_its_own_figures_and_checks(instance, data_dir_with_standin, ("B6", "B7"))
    finally:
        os.environ.pop("DAGSTER_HOME", None)

    trained, untrained = meta["accept_length_simulated"].value, meta["accept_length_simulated_untrained"].value
    print(f"accept length on the eval split: trained {trained}, untrained {untrained}")
    assert isinstance(trained, int | float) and isinstance(untrained, int | float)
    assert trained > untrained
    assert meta["sglang_key_check"].value == "ok"
    steps = [k for k in meta if k.startswith("acceptance_step_")]  # numbers, plotted by Dagster across materializations
    fractions = [meta[k].value for k in steps]
    assert len(steps) == 7 and all(isinstance(a, int | float) and 0.0 <= a <= 1.0 for a in fractions)
    plot = meta["quality_over_materializations"].value
    assert isinstance(plot, str) and plot.startswith("![plot](data:image/png;base64,")
    ckpt = data_dir_with_standin / "eagle3_drafter"
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    cfg = json.loads((ckpt / "config.json").read_text())
    # the stand-in target has MLA, so `auto` trains the MLA draft: 18 tensors as SGLang lays it out
    assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and len(keys) == 18
    assert {
        "layers.0.self_attn.kv_a_proj_with_mqa.weight",
        "layers.0.self_attn.kv_b_proj.weight",
        "lm_head.weight",
    } <= keys
    assert cfg["vocab_size"] == 163840 and cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM's key: inputs of the next layers
    assert str(data_dir_with_standin) not in json.dumps(cfg)  # no machine path in a checkpoint that travels
    for ds in ("B6", "B7"):
        assert (data_dir_with_standin / "completions" / ds / "journal.jsonl").stat().st_size > 0
        assert (data_dir_with_standin / "token_ids" / f"{ds}.parquet").exists()


def assert_each_dataset_has_its_own_figures_and_checks(instance, data_dir, datasets):
    """One run over several datasets: each dataset's page shows its own rows, path, preview and checks."""
    for asset, file in (
        ("raw_prompts", "raw_prompts/{}.parquet"),
        ("completions", "completions/{}.parquet"),
        ("token_ids", "token_ids/{}.parquet"),
    ):
        rows = {ds: pl.read_parquet(data_dir / file.format(ds)).height for ds in datasets}
        assert len(set(rows.values())) > 1, rows  # else equal figures could not tell the datasets apart
        for ds in datasets:
            records = instance.fetch_materializations(
                dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[ds]), limit=1
            )
            meta = records.records[0].asset_materialization.metadata
            assert meta["rows"].value == rows[ds], (asset, ds)
            assert meta["path"].value == str(data_dir / file.format(ds)), (asset, ds)
            others = [d for d in datasets if d != ds]
            assert f"{ds}-" in meta["preview"].value and not any(f"{d}-" in meta["preview"].value for d in others), (
                asset,
                ds,
            )
        if asset == "completions":  # the local backend's settings, not OpenRouter's routing
            settings = meta["request_settings"].value
            assert "provider" not in settings and "kimi" not in settings["model"], settings
            assert len(repr(meta["this_run_duration_s"].value).split(".")[-1]) <= 1
        for name in CHECK_NAMES[asset]:
            history = instance.event_log_storage.get_asset_check_execution_history(
                dg.AssetCheckKey(dg.AssetKey(asset), name), limit=20
            )
            by_partition = {r.event.dagster_event.asset_check_evaluation_data.partition: r for r in history if r.event}
            assert set(datasets) <= set(by_partition), (asset, name, list(by_partition))
            for ds in datasets:
                description = by_partition[ds].event.dagster_event.asset_check_evaluation_data.description
                assert description.startswith(f"{ds}: ") and not unquoted_special_tokens(description), description


CHECK_NAMES = {
    "raw_prompts": ["reject_rate"],
    "completions": ["complete", "pilot", "error_rate"],
    "token_ids": ["billed_completion_tokens_match", "separator_and_end_token", "no_leaked_special_tokens"],
}


def test_definitions_validate(tmp_path):
    env = env_for(tmp_path, tmp_path / "data")
    os.makedirs(env["DAGSTER_HOME"])
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("dagster")), "definitions", "validate", "-w", "workspace.yaml"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "All code locations passed validation" in proc.stderr + proc.stdout


def test_bad_prompt_file_fails_raw_prompts_before_anything_downstream(tmp_path, monkeypatch):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n'
        '{"id": "b", "messages": [{"role": "robot", "content": "x"}]}\n'
    )
    spec = DatasetSpec(name="A1", prompt_file=bad, format="messages", kind="chat")
    monkeypatch.setattr("eagle3_assets.stages.raw_prompts.asset.DATASETS", {"A1": spec})
    with dg.instance_for_test() as instance:
        result = dg.materialize(
            [raw_prompts, completions],
            partition_key="A1",
            instance=instance,
            resources={**resources(), "store": DataStore(root=str(tmp_path / "data"))},
            raise_on_error=False,
            selection=[raw_prompts, completions],
        )
    assert not result.success
    failure = result.failure_data_for_node("raw_prompts")
    assert failure is not None and failure.user_failure_data is not None
    description = failure.user_failure_data.description
    assert description is not None and f"{bad}:2: b: message 1: unknown role 'robot'" in description
    assert "completions" not in [e.step_key for e in result.get_step_success_events()]
    assert not (tmp_path / "data" / "raw_prompts" / "A1.parquet").exists()
