"""Several drafter kinds in one materialization (`drafter_kinds`): each trained and decoded, the best exported.

The choice is checked against figures written here (not computed by the code under test), the export against the
candidate's own bytes, and the whole contest through `eagle3 run` as a user runs it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from support import eagle3_run

from eagle3_assets.stages.eagle3_drafter.asset import DrafterTrainConfig, refuse_kinds_contest
from eagle3_assets.stages.eagle3_drafter.kind_contest import KindResult, candidate_dir, choose, contest_frame, publish
from eagle3_resources.errors import DrafterError

REPO = Path(__file__).resolve().parents[1]


def result(kind: str, real: float | None, simulated: float = 2.0, tmp: Path = Path("/nonexistent")) -> KindResult:
    return KindResult(kind, tmp / kind, real, 1.0, {"chat": real, "code": None}, simulated, 1000.0, 1.0, 1152)


def test_the_highest_real_accept_length_is_chosen_the_first_listed_on_a_tie():
    chosen, why = choose([result("eagle3_llama", 2.1), result("eagle3_mla", 2.4), result("eagle3_1_mla", 2.4)])
    assert chosen.kind == "eagle3_mla" and "real accept length (2.4)" in why
    # a kind that was not decoded never beats one that was, whatever its simulated figure
    chosen, _ = choose([result("eagle3_llama", None, simulated=7.0), result("eagle3_mla", 1.2)])
    assert chosen.kind == "eagle3_mla"


def test_without_any_decoding_the_simulated_figure_decides_and_says_so():
    chosen, why = choose([result("eagle3_llama", None, 3.0), result("eagle3_mla", None, 3.5)])
    assert chosen.kind == "eagle3_mla" and "no kind was decoded" in why and "simulated" in why


def test_the_table_has_a_row_per_kind_and_a_column_per_prompt_kind():
    results = [result("eagle3_llama", 2.1), result("eagle3_mla", 2.4)]
    frame = contest_frame(results, results[1])
    assert frame.height == 2 and {"chat", "code", "real accept length", "draft KV B/token"} <= set(frame.columns)
    assert frame["kind"].to_list() == ["eagle3_llama", "**eagle3_mla** (exported)"]


def test_publish_replaces_the_export_with_the_chosen_candidates_files(tmp_path):
    export = tmp_path / "eagle3_drafter"
    export.mkdir()
    (export / "stale.safetensors").write_bytes(b"old")
    chosen = candidate_dir(export, "eagle3_mla")
    chosen.mkdir(parents=True)
    (chosen / "config.json").write_text("{}")
    (chosen / "model.safetensors").write_bytes(b"new")
    publish(result("eagle3_mla", 2.0, tmp=chosen.parent), export)
    assert sorted(p.name for p in export.iterdir()) == ["config.json", "model.safetensors"]
    assert (export / "model.safetensors").read_bytes() == b"new"


@pytest.mark.parametrize(
    "clash", [{"processes": 2}, {"streaming_spool_gb": 10.0}, {"init_from": "/some/drafter"}, {}], ids=str
)
def test_a_contest_refuses_what_it_cannot_do_in_one_process(clash):
    kinds = ["eagle3_llama", "eagle3_mla"] if clash else ["eagle3_llama", "eagle3_llama"]  # {}: a kind twice
    with pytest.raises(DrafterError, match="drafter_kinds"):
        refuse_kinds_contest(DrafterTrainConfig(drafter_kinds=kinds, **clash))
    with pytest.raises(DrafterError, match="each once"):
        refuse_kinds_contest(DrafterTrainConfig(drafter_kinds=["eagle3_gqa"]))
    refuse_kinds_contest(DrafterTrainConfig(drafter_kinds=["eagle3_llama", "eagle3_mla"]))


CONTEST = """ops:
  eagle3_drafter:
    config:
      drafter_kinds: [eagle3_llama, eagle3_mla]
      epochs: 1
      spec_eval_prompts: 2
      spec_eval_new_tokens: 24
      min_accept_gain: null
"""


@pytest.mark.slow
def test_eagle3_run_trains_each_kind_and_exports_the_best(tmp_path, data_dir_with_standin):
    env = dict(os.environ, DAGSTER_HOME=str(tmp_path / "home"), EAGLE3_DATA_DIR=str(data_dir_with_standin))
    for var in ("EAGLE3_COMPLETIONS_BACKEND", "EAGLE3_TOKENIZER_DIR", "EAGLE3_TARGET_DIR", "OPENROUTER_API_KEY"):
        env.pop(var, None)
    eagle3_run("B6", CONTEST, env, tmp_path)
    os.environ["DAGSTER_HOME"] = env["DAGSTER_HOME"]
    try:
        with dg.DagsterInstance.get() as instance:
            event = instance.get_latest_materialization_event(dg.AssetKey("eagle3_drafter"))
            assert event is not None and event.asset_materialization is not None
            meta: dict[str, Any] = {k: v.value for k, v in event.asset_materialization.metadata.items()}
    finally:
        os.environ.pop("DAGSTER_HOME", None)
    results = meta["kinds_results"]
    assert [r["kind"] for r in results] == ["eagle3_llama", "eagle3_mla"]
    assert all(isinstance(r["real"], float) and r["real"] >= 1.0 and r["tokens_per_s"] > 0 for r in results)
    best = max(results, key=lambda r: r["real"])
    assert meta["kinds_exported"] == best["kind"]
    export = data_dir_with_standin / "eagle3_drafter"
    exported_kind = json.loads((export / "config.json").read_text())["eagle3_pipeline"]["drafter_kind"]
    assert exported_kind == best["kind"]
    candidate = Path(best["checkpoint"])
    assert hashlib.sha256((export / "model.safetensors").read_bytes()).digest() == (
        hashlib.sha256((candidate / "model.safetensors").read_bytes()).digest()
    )
    # the MLA draft's KV cache is the smaller one, as its kind promises
    by_kind = {r["kind"]: r for r in results}
    assert by_kind["eagle3_mla"]["kv_bytes_per_token"] < by_kind["eagle3_llama"]["kv_bytes_per_token"]
    assert "eagle3_llama" in meta["kinds_compared"] and "(exported)" in meta["kinds_compared"]
