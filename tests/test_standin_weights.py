"""The stand-in target's shipped weights (`data/standin/target.safetensors`): what a first run unpacks instead of
fitting for a minute or more.

Unpacked, they must be the fit's weights bit for bit (checked against a fit made here and packed, not against the
shipped file's own contents); the shipped file must have been fitted for the tokenizer and builder this checkout
makes, or every first run silently falls back to fitting; a file fitted for another one must not be used.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_resources.errors import StandinWeightsMismatch
from eagle3_resources.storage import PROJECT_ROOT
from eagle3_resources.target.resource import TargetModelResource
from eagle3_resources.target.standin import (
    build_standin_target,
    fingerprint,
    fitting_token_ids,
)
from eagle3_resources.target.standin_weights import (
    SHIPPED,
    ensure_standin_target,
    main,
    pack,
    shipped_fingerprint,
    unpack,
)
from eagle3_resources.tokenizer.resource import standin_corpus_files
from eagle3_resources.tokenizer.standin import corpus_strings

STEPS = 6


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return list(corpus_strings(standin_corpus_files("data/prompts")))


@pytest.fixture(scope="module")
def fitted(tok, texts, tmp_path_factory):
    """A short fit's folder, made as a first run without shipped weights makes it."""
    return build_standin_target(tmp_path_factory.mktemp("fit") / "target", tok, texts, steps=STEPS, log=print)


def test_packed_and_unpacked_weights_are_the_fit_bit_for_bit(tok, texts, fitted, tmp_path):
    fit_state = load_file(str(fitted / "model.safetensors"))
    shipped = tmp_path / "target.safetensors"
    packed = pack(fit_state, fitting_token_ids(tok, texts))
    save_file(packed, str(shipped), metadata={"fingerprint": "for-this-test", "fit": "{}"})
    # what ships is a fraction of the folder: the used rows, not 163,840 of each matrix
    assert shipped.stat().st_size < (fitted / "model.safetensors").stat().st_size / 5
    folder = unpack(shipped, tok, tmp_path / "unpacked", expect="for-this-test")
    state = load_file(str(folder / "model.safetensors"))
    assert state.keys() == fit_state.keys() and len(state) > 100
    assert [k for k in state if not torch.equal(state[k], fit_state[k])] == []
    assert (folder / "generation_config.json").read_text() == (fitted / "generation_config.json").read_text()


def test_pack_refuses_weights_whose_unused_head_rows_differ(tok, texts, fitted):
    state = load_file(str(fitted / "model.safetensors"))
    used = fitting_token_ids(tok, texts)
    state["lm_head.weight"][-1] += 1.0  # the last id is never a fitting token (the padding ranks are unreachable)
    assert int(used[-1]) < state["lm_head.weight"].shape[0] - 1
    with pytest.raises(ValueError, match="not one shared row"):
        pack(state, used)


def test_the_shipped_weights_were_fitted_for_this_checkouts_tokenizer_and_builder(tok):
    regenerate = "python -m eagle3_resources.target.standin_weights"
    assert (PROJECT_ROOT / SHIPPED).is_file(), f"{SHIPPED} is missing: {regenerate}"
    assert shipped_fingerprint(PROJECT_ROOT / SHIPPED) == fingerprint(tok.folder), (
        "the stand-in's builder, fit settings or tokenizer changed since the shipped weights were fitted: every first "
        "run would fit them again; regenerate: python -m eagle3_resources.target.standin_weights"
    )


def test_a_first_run_unpacks_the_shipped_weights(tok, tokenizer_resource, tmp_path):
    logs: list[str] = []
    folder = TargetModelResource(standin_dir=str(tmp_path)).folder(tokenizer_resource, log=logs.append)
    assert folder.name == f"target-{fingerprint(tok.folder)}"
    assert any("unpacking the stand-in target's shipped weights" in m for m in logs), logs
    assert not any("fit step" in m for m in logs), logs
    assert '"shipped"' in (folder / "standin.json").read_text()


def test_weights_fitted_for_another_tokenizer_or_builder_are_not_used(tok, texts, fitted, tmp_path):
    wrong = tmp_path / "target.safetensors"
    packed = pack(load_file(str(fitted / "model.safetensors")), fitting_token_ids(tok, texts))
    save_file(packed, str(wrong), metadata={"fingerprint": "another-tokenizer", "fit": "{}"})
    with pytest.raises(StandinWeightsMismatch, match="regenerate"):
        unpack(wrong, tok, tmp_path / "refused", expect=fingerprint(tok.folder))
    logs: list[str] = []
    folder = ensure_standin_target(tmp_path / "cache", tok, lambda: texts, log=logs.append, shipped=wrong, steps=STEPS)
    assert any("fitted for another tokenizer or builder" in m for m in logs), logs
    assert any(f"fit step {STEPS}/{STEPS}" in m for m in logs), logs
    assert folder.name == f"target-{fingerprint(tok.folder, STEPS)}" and (folder / "config.json").is_file()


@pytest.mark.slow
def test_the_regeneration_command_writes_weights_a_run_unpacks(tok, tmp_path):
    out = tmp_path / "target.safetensors"
    main(["--out", str(out), "--steps", "3"])
    assert shipped_fingerprint(out) == fingerprint(tok.folder, steps=3)
    folder = unpack(out, tok, tmp_path / "target", expect=fingerprint(tok.folder, steps=3))
    assert (folder / "config.json").is_file()
