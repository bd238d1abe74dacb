"""The release gate (issue 41, deliverable 3): the drafter's blocking checks, run on the exported files re-read from
disk, pass a drafter trained on the stand-in and fail every broken export the field has shipped: a missing `lm_head`
(sglang PR #27908's accept length 1.00), aux layer ids off by one (sglang #32226), d2t off by one, a wrong MLA rank,
and a drafter trained on shuffled targets that accepts nothing."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import polars as pl
import pytest
from safetensors.torch import load_file, save_file
from test_best_checkpoint import SETTINGS, stored_corpus

from eagle3_assets.definitions import defs
from eagle3_assets.stages.eagle3_drafter.checks import drafter_beats_floor, drafter_keys, drafter_matches_capture
from eagle3_assets.stages.eagle3_drafter.data import Teacher
from eagle3_assets.stages.eagle3_drafter.export import sglang_layer_ids, trained_layer_ids, vllm_layer_ids
from eagle3_assets.stages.eagle3_drafter.pipeline import DrafterJob, DrafterReport, run_drafter_job
from eagle3_assets.stages.eagle3_drafter.quality import DecodeEval, measure_speculative
from eagle3_assets.stages.eagle3_drafter.speculative import SpecDecodeReport

MARGIN = 0.1  # the asset's default `min_accept_gain`
# the best-checkpoint tests' small drafter, trained long enough that its gain stands clear of the prompts' spread
GATE_SETTINGS = dataclasses.replace(SETTINGS, epochs=8)
NEW_TOKENS = 32


def with_eval_half(merged: pl.DataFrame) -> pl.DataFrame:
    """The corpus' last 8 samples held out (the datasets cycle, so two of each kind): prompts enough for the gain's
    standard error and for every kind."""
    half = merged.height // 2
    return merged.with_columns(pl.Series("split", ["eval" if i >= half else "train" for i in range(merged.height)]))


def train(merged: pl.DataFrame, hidden_root: Path, target_folder: Path, out: Path) -> DrafterReport:
    job = DrafterJob(hidden_root, merged, target_folder, out / "drafter", GATE_SETTINGS, 512, lambda m: None, "cpu")
    report = run_drafter_job(job)
    assert report is not None
    return report


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tok, target_model, target_resource, tokenizer_resource):
    stored, store = stored_corpus(tmp_path_factory, tok, target_model)
    merged = with_eval_half(stored)  # the splits are the merged set's: the store's states serve any split
    hidden_root, root = store / "hidden_states", tmp_path_factory.mktemp("gate")
    folder = target_resource.folder(tokenizer_resource)
    report = train(merged, hidden_root, folder, root)
    captured = json.loads((hidden_root / "manifest.json").read_text())["aux_layer_ids"]
    # the untrained drafter's decodes (and the target's greedy ones), by config and draft ids (d2t): the untrained
    # drafter is built from those alone, whatever was trained, so decoded once a module (`floor=`)
    floors: dict[tuple[str, tuple[int, ...]], SpecDecodeReport] = {}
    return {
        "report": report,
        "merged": merged,
        "captured": captured,
        "folder": folder,
        "hidden_root": hidden_root,
        "floors": floors,
    }


def gate(folder: Path, trained, target_model, draft_ids=None, decode: bool = True) -> dict:
    """Each gate check's outcome on the export in `folder`, decoded from the files as the asset decodes them
    (`decode=False`: the checks of the files alone, for a test that asserts nothing of the decoding: it costs a
    minute on 2 cores)."""
    outcomes = {
        "sglang_keys": drafter_keys(folder),
        "matches_capture": drafter_matches_capture(
            folder, trained["captured"], trained["report"].draft_ids if draft_ids is None else draft_ids
        ),
    }
    if decode and outcomes["sglang_keys"].passed:
        cfg = json.loads((folder / "config.json").read_text())
        how = DecodeEval(8, NEW_TOKENS, 3, 0, trained_layer_ids(cfg), True)
        key = (json.dumps(cfg, sort_keys=True), tuple(load_file(str(folder / "model.safetensors"))["d2t"].tolist()))
        quality = measure_speculative(
            target_model, folder, trained["merged"], how, lambda m: None, trained["floors"].get(key)
        )
        trained["floors"][key] = quality.untrained
        outcomes["speculative_gain"] = drafter_beats_floor(quality.figures(), MARGIN)
    return outcomes


def mutated(trained, tmp_path: Path, config=None, tensors=None) -> Path:
    folder = tmp_path / "mutated"
    shutil.copytree(trained["report"].checkpoint, folder)
    if config is not None:
        cfg = json.loads((folder / "config.json").read_text())
        config(cfg)
        (folder / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        weights = load_file(str(folder / "model.safetensors"))
        tensors(weights)
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.slow
def test_the_trained_export_passes_every_gate_check(trained, target_model):
    outcomes = gate(trained["report"].checkpoint, trained, target_model)
    assert all(o.passed for o in outcomes.values()), {k: o.description for k, o in outcomes.items()}
    figures = outcomes["speculative_gain"].metadata
    assert set(figures["accept_length_real_by_kind"]) == {"chat", "code", "function-calling", "reasoning"}
    assert figures["accept_length_real_gain_standard_error"] is not None
    print({k: o.description for k, o in outcomes.items()})


def test_the_gate_blocks_the_assets_downstream():
    specs = {spec.name: spec for spec in defs.get_assets_def("eagle3_drafter").check_specs}
    assert {name for name, spec in specs.items() if spec.blocking} == {
        "sglang_keys",
        "matches_capture",
        "speculative_gain",
    }


@pytest.mark.slow
def test_a_missing_lm_head_fails_the_gate(trained, target_model, tmp_path):
    outcomes = gate(mutated(trained, tmp_path, tensors=lambda w: w.pop("lm_head.weight")), trained, target_model)
    assert not outcomes["sglang_keys"].passed and "lm_head.weight" in str(outcomes["sglang_keys"].metadata)


@pytest.mark.slow
def test_aux_layer_ids_shifted_by_one_fail_the_gate(trained, target_model, tmp_path):
    def shift(cfg):  # both servers' keys name the next layers, so the two still agree with each other
        shifted = [i + 1 for i in trained["captured"]]
        cfg["eagle_aux_hidden_state_layer_ids"] = vllm_layer_ids(shifted)
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = sglang_layer_ids(shifted)

    outcomes = gate(mutated(trained, tmp_path, config=shift), trained, target_model, decode=False)
    assert outcomes["sglang_keys"].passed  # a loadable file: only the comparison with the capture sees it
    assert not outcomes["matches_capture"].passed
    assert "trained on" in outcomes["matches_capture"].description


@pytest.mark.slow
def test_d2t_off_by_one_fails_the_gate(trained, target_model, tmp_path):
    def off_by_one(w):
        w["d2t"] = w["d2t"] + 1

    outcomes = gate(mutated(trained, tmp_path, tensors=off_by_one), trained, target_model, decode=False)
    assert not outcomes["matches_capture"].passed and "d2t" in outcomes["matches_capture"].description


@pytest.mark.slow
def test_a_wrong_mla_rank_fails_the_gate(trained, target_model, tmp_path):
    def rank(cfg):
        cfg["kv_lora_rank"] = cfg["kv_lora_rank"] // 2

    outcomes = gate(mutated(trained, tmp_path, config=rank), trained, target_model)
    assert not outcomes["sglang_keys"].passed


@pytest.mark.slow
def test_a_drafter_trained_on_shuffled_targets_fails_the_gate(trained, tmp_path, target_model, monkeypatch):
    # EAGLE-3 learns the target's own next-token distribution (the teacher, from the stored final hidden states), not
    # the data's tokens: every teacher distribution's draft ids rolled by one teaches a well-formed drafter to propose,
    # wherever the target would write token i of the draft vocabulary, token i + 1.
    packed = Teacher.packed

    def shuffled(self, batch):
        p, argmax = packed(self, batch)
        return p.roll(1, dims=-1), argmax

    monkeypatch.setattr(Teacher, "packed", shuffled)
    report = train(trained["merged"], trained["hidden_root"], trained["folder"], tmp_path)
    outcomes = gate(report.checkpoint, trained, target_model, draft_ids=report.draft_ids)
    assert outcomes["sglang_keys"].passed and outcomes["matches_capture"].passed  # well-formed: only decoding tells
    gain = outcomes["speculative_gain"]
    assert not gain.passed, gain.description
    print(gain.description)


def test_the_margin_grows_with_the_prompts_spread():
    """The overall margin is the configured one or twice the per-prompt gain's standard error, whichever is larger;
    a kind under the configured margin fails on its own."""
    base = {
        "accept_length_real": 1.5,
        "accept_length_real_untrained": 1.0,
        "lossless": True,
        "lossless_up_to_ties": True,
        "mismatched_at_ties": 0,
        "label": "proxy (stand-in target)",
    }
    assert drafter_beats_floor({**base, "accept_length_real_gain_standard_error": 0.1}, 0.1).passed
    noisy = drafter_beats_floor({**base, "accept_length_real_gain_standard_error": 0.3}, 0.1)
    assert not noisy.passed and noisy.metadata["margin_needed"] == pytest.approx(0.6)
    kinds = {"chat": {"trained": 2.0, "untrained": 1.0, "prompts": 2}, "code": {"trained": 1.0, "untrained": 1.0}}
    one_kind = drafter_beats_floor({**base, "accept_length_real_by_kind": kinds}, 0.1)
    assert not one_kind.passed and one_kind.metadata["kinds_under_margin"] == ["code"]
