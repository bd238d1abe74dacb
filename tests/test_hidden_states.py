import json

import polars as pl
import pytest
import torch

from eagle3_assets.checks.training import HIDDEN_STATE_CHECKS
from eagle3_assets.hidden_states import (
    MANIFEST,
    extract_hidden_states,
    read_manifest,
    read_sample,
    sample_path,
    write_manifest,
    write_sample,
)
from eagle3_resources.hidden_states.layers import eagle3_aux_layers
from eagle3_resources.hidden_states.transformers_backend import TransformersHiddenStates


def two_samples() -> pl.DataFrame:
    return pl.DataFrame({
        "sample_id": ["A1/x", "A1/y"], "split": ["train", "eval"], "input_ids": [[5, 6, 7], [8, 9]],
        "loss_mask": [[0, 1, 1], [0, 1]], "n_tokens": [3, 2],
    }, schema_overrides={"input_ids": pl.List(pl.Int32), "loss_mask": pl.List(pl.Int8)})


def test_layer_rule():
    assert eagle3_aux_layers(61) == [1, 29, 57]  # Kimi-K2.x
    assert eagle3_aux_layers(8) == [1, 3, 4]  # the stand-in
    with pytest.raises(ValueError):
        eagle3_aux_layers(6)


def test_captured_layers_are_layer_outputs(target_model):
    backend = TransformersHiddenStates(target_model)
    ids = list(range(100, 140))
    aux, final = backend.extract(ids)
    H = target_model.config.hidden_size
    assert aux.shape == (40, 3 * H) and final.shape == (40, H)
    with torch.no_grad():
        out = target_model.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    for j, layer in enumerate(backend.layer_ids):  # HF hidden_states[i + 1] is the output of layer i
        torch.testing.assert_close(aux[:, j * H:(j + 1) * H], out.hidden_states[layer + 1][0])
    torch.testing.assert_close(final, out.last_hidden_state[0])  # after the final norm


def test_files_manifest_and_resume(target_model, tmp_path):
    merged = two_samples()
    backend = TransformersHiddenStates(target_model)
    reports = []
    report = extract_hidden_states(merged, backend, tmp_path, log=print, progress_every_s=0.0, on_progress=reports.append)
    assert report.written == 2 and not report.nan_samples
    assert [(r["samples_done"], r["samples"], r["tokens_written"]) for r in reports] == [(1, 2, 3), (2, 2, 3 + len(merged["input_ids"][1]))]
    assert reports[-1]["eta_s"] == 0.0 and reports[-1]["bytes_written"] == report.bytes_written
    sample = read_sample(sample_path(tmp_path, "train", "A1/x"))
    assert sample["input_ids"].tolist() == [5, 6, 7] and sample["loss_mask"].tolist() == [0, 1, 1]
    assert sample["aux_hidden_states"].dtype == torch.bfloat16 and sample["aux_hidden_states"].shape == (3, 3 * 64)
    assert sample["final_hidden_state"].shape == (3, 64)
    manifest = write_manifest(tmp_path, merged, backend, "standin")
    assert read_manifest(tmp_path)["aux_layer_ids"] == [1, 3, 4] == manifest["aux_layer_ids"]
    assert "hidden_states[i+1]" in manifest["layer_convention"] and manifest["samples"] == {"train": 1, "eval": 1}
    again = extract_hidden_states(merged, backend, tmp_path, log=print)
    assert again.written == 0 and again.skipped == 2


def test_hidden_state_checks_pass_on_good_and_fail_on_bad_files(target_model, tmp_path):
    merged = two_samples()
    backend = TransformersHiddenStates(target_model)
    extract_hidden_states(merged, backend, tmp_path, log=print)
    write_manifest(tmp_path, merged, backend, "standin")
    file_checks = {name: fn for name, (fn, _) in HIDDEN_STATE_CHECKS.items() if name != "finite"}
    for name, fn in file_checks.items():
        assert fn(tmp_path, merged).passed, name

    # A sample whose aux states lost a layer: the shape check names it.
    path = sample_path(tmp_path, "train", "A1/x")
    s = read_sample(path)
    write_sample(path, s["input_ids"].tolist(), s["loss_mask"].tolist(), s["aux_hidden_states"][:, :128], s["final_hidden_state"])
    shapes = file_checks["shapes"](tmp_path, merged)
    assert not shapes.passed and shapes.metadata["bad"][0]["sample"] == "A1/x"

    # A manifest claiming layers off the EAGLE-3 rule.
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    (tmp_path / MANIFEST).write_text(json.dumps({**manifest, "aux_layer_ids": [2, 3, 4]}))
    assert not file_checks["layer_ids"](tmp_path, merged).passed

    # One sample missing, and (separately) one file too many.
    assert not file_checks["record_count"](tmp_path, merged.head(1)).passed
    path.unlink()
    count = file_checks["record_count"](tmp_path, merged)
    assert not count.passed and count.metadata["missing"] == ["A1/x"]
