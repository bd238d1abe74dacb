"""The whole pipeline through Dagster on the stand-ins: the README's main command, a real instance."""

import json
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
from safetensors import safe_open

from eagle3_assets.assets.completions import completions
from eagle3_assets.assets.raw_prompts import raw_prompts
from eagle3_assets.definitions import resources
from eagle3_assets.registry import DatasetSpec
from eagle3_resources.storage import DataStore

REPO = Path(__file__).resolve().parents[1]
ASSETS = ["raw_prompts", "completions", "token_ids", "merged_dataset", "hidden_states", "eagle3_drafter"]


def env_for(tmp_path, data_dir):
    env = dict(os.environ, DAGSTER_HOME=str(tmp_path / "dagster_home"), EAGLE3_DATA_DIR=str(data_dir), PYTHONUNBUFFERED="1")
    for var in ("EAGLE3_COMPLETIONS_BACKEND", "EAGLE3_TOKENIZER_DIR", "EAGLE3_TARGET_DIR", "OPENROUTER_API_KEY"):
        env.pop(var, None)
    return env


@pytest.mark.timeout(1800)
def test_eagle3_run_leaves_a_finished_run_and_a_loadable_drafter(tmp_path, data_dir_with_standin):
    env = env_for(tmp_path, data_dir_with_standin)
    proc = subprocess.run([sys.executable, "-m", "eagle3_assets.cli", "run", "--datasets", "B6,B7"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1700)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "SUCCESS" in proc.stdout

    os.environ["DAGSTER_HOME"] = env["DAGSTER_HOME"]
    try:
        with dg.DagsterInstance.get() as instance:
            runs = instance.get_runs()
            assert [r.job_name for r in runs] == ["eagle3_pipeline"] and runs[0].status == dg.DagsterRunStatus.SUCCESS
            for key in ASSETS:
                assert instance.get_latest_materialization_event(dg.AssetKey(key)) is not None, key
            for ds in ("B6", "B7"):
                assert ds in instance.get_materialized_partitions(dg.AssetKey("token_ids"))
            meta = instance.get_latest_materialization_event(dg.AssetKey("eagle3_drafter")).asset_materialization.metadata
    finally:
        os.environ.pop("DAGSTER_HOME", None)

    trained, untrained = meta["accept_length"].value, meta["accept_length_untrained"].value
    print(f"accept length on the eval split: trained {trained}, untrained {untrained}")
    assert trained > untrained
    assert meta["sglang_key_check"].value == "ok"
    ckpt = data_dir_with_standin / "eagle3_drafter"
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        assert len(set(f.keys())) == 15
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["vocab_size"] == 163840 and cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    for ds in ("B6", "B7"):
        assert (data_dir_with_standin / "completions" / ds / "journal.jsonl").stat().st_size > 0
        assert (data_dir_with_standin / "token_ids" / f"{ds}.parquet").exists()


def test_definitions_validate(tmp_path):
    env = env_for(tmp_path, tmp_path / "data")
    os.makedirs(env["DAGSTER_HOME"])
    proc = subprocess.run([str(Path(sys.executable).with_name("dagster")), "definitions", "validate", "-w", "workspace.yaml"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "All code locations passed validation" in proc.stderr + proc.stdout


def test_bad_prompt_file_fails_raw_prompts_before_anything_downstream(tmp_path, monkeypatch):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n{"id": "b", "messages": [{"role": "robot", "content": "x"}]}\n')
    spec = DatasetSpec(name="A1", prompt_file=bad, format="messages", kind="chat")
    monkeypatch.setattr("eagle3_assets.assets.raw_prompts.DATASETS", {"A1": spec})
    with dg.instance_for_test() as instance:
        result = dg.materialize([raw_prompts, completions], partition_key="A1", instance=instance,
                                resources={**resources(), "store": DataStore(root=str(tmp_path / "data"))}, raise_on_error=False,
                                selection=[raw_prompts, completions])
    assert not result.success
    failure = result.failure_data_for_node("raw_prompts")
    assert f"{bad}:2: b: message 1: unknown role 'robot'" in failure.user_failure_data.description
    assert "completions" not in [e.step_key for e in result.get_step_success_events()]
    assert not (tmp_path / "data" / "raw_prompts" / "A1.parquet").exists()
