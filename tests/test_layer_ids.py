"""The target layers an EAGLE-3 drafter reads, agreed on by every side, derived here and watched from outside.

The drafter is trained on the outputs of three target layers, captured by the hidden-states backend (SGLang or
transformers) and recorded in the store; its checkpoint tells SGLang (`eagle_config`) and vLLM (top level) which
layers to hand it; the speculative decoding loop that measures it takes them from the target again. A shift on
any one side trains or serves a drafter on the wrong features and nothing crashes. So here the expected layers are
derived independently: the EAGLE-3 rule `[1, N//2 - 1, N - 4]` and each server's reading of its id list are
written in this file, and the layers actually fed are identified by hooks on the target's decoder layers, not by
the project's own indexing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import polars as pl
import pytest
import torch

from eagle3_assets.stages.eagle3_drafter import quality
from eagle3_assets.stages.eagle3_drafter.export import config_json, export_checkpoint, trained_layer_ids
from eagle3_assets.stages.eagle3_drafter.model import Eagle3Drafter
from eagle3_assets.stages.eagle3_drafter.pipeline import drafter_config
from eagle3_assets.stages.eagle3_drafter.quality import DecodeEval, measure_speculative
from eagle3_resources.hidden_states import sglang_api, sglang_backend
from eagle3_resources.hidden_states.extract import StoreSettings, extract_to_store
from eagle3_resources.hidden_states.sglang_api import CaptureRule
from eagle3_resources.hidden_states.sglang_backend import SGLangHiddenStates, server_args_kwargs
from eagle3_resources.hidden_states.store import HiddenStateStore, StoredSample, read_manifest
from eagle3_resources.hidden_states.transformers_backend import TransformersHiddenStates


def eagle3_rule(n: int) -> list[int]:
    """EAGLE-3's layers for an n-layer target (SpecForge, Model-Optimizer): outputs of 0-based decoder layers."""
    return [1, n // 2 - 1, n - 4]


# SGLang's DeepseekV2ForCausalLM.set_eagle3_layers_to_capture(ids), by release (the project's names for the rules).
SGLANG = {"before sglang#25454": CaptureRule.ALWAYS_PLUS_ONE, "0.5.23": CaptureRule.PLUS_ONE_IF_FIRST_IS_1}


def sglang_reads(ids: list[int], release: str) -> list[int]:
    """The layers (outputs, 0-based) SGLang captures for `ids`, as its source reads: `layers_to_capture` is
    `[v + 1 for v in ids]` (before sglang#25454 always; from it on only when ids[0] == 1, else `ids` as given), and
    it captures `hidden_states + residual` at the INPUT of each of those layers, the output of the one before."""
    inputs = [v + 1 for v in ids] if release == "before sglang#25454" or ids[0] == 1 else list(ids)
    return [j - 1 for j in inputs]


def vllm_reads(ids: list[int]) -> list[int]:
    """vLLM's top-level `eagle_aux_hidden_state_layer_ids`: inputs of the listed layers, no offset."""
    return [j - 1 for j in ids]


# ---------------------------------------------------------------- watching the target's layers


@contextmanager
def layer_tap(model) -> Iterator[list[dict[int, torch.Tensor]]]:
    """Per forward of `model` (a DeepseekV3 causal LM: `model.model.layers`), batch row 0 of every decoder layer's
    output by 0-based layer id, and of layer 0's input (the embeddings) as id -1."""
    forwards: list[dict[int, torch.Tensor]] = []
    layers = model.model.layers

    def first_input(_module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        forwards.append({-1: x[0].detach().clone()})

    def output_of(i: int):
        def hook(_module, _args, out):
            forwards[-1][i] = (out[0] if isinstance(out, tuple) else out)[0].detach().clone()

        return hook

    handles = [layers[0].register_forward_pre_hook(first_input, with_kwargs=True)]
    handles += [layer.register_forward_hook(output_of(i)) for i, layer in enumerate(layers)]
    try:
        yield forwards
    finally:
        for h in handles:
            h.remove()


def layers_in(aux: torch.Tensor, forward: dict[int, torch.Tensor], hidden: int) -> list[int | str]:
    """Which layer's output each `hidden`-wide block of `aux` [rows, k * hidden] is, exactly (in aux's dtype), over
    the first `rows` positions of `forward`; a block that is none of them reads as "?"."""
    rows = aux.shape[0]
    found: list[int | str] = []
    for block in aux.split(hidden, dim=-1):
        same = [i for i, t in sorted(forward.items()) if torch.equal(t[:rows].to(block.dtype), block)]
        found.append(same[0] if len(same) == 1 else "?")
    return found


# ---------------------------------------------------------------- 1. decode: the layers the drafter was trained on


@pytest.mark.parametrize("trained_on", ["the rule", [2, 4, 6]], ids=["rule-layers", "layers-2-4-6"])
def test_the_decode_loop_feeds_the_drafter_the_layers_it_was_trained_on(
    target_model, tmp_path, monkeypatch, trained_on
):
    """An exported drafter, decoded as the eagle3_drafter asset decodes it (`measure_speculative` with the layers
    read back from its config): every aux row its `fc` receives is the output of the layers it was trained on, at
    the target forward just run, for the trained and the untrained drafter alike. Layers other than the rule's
    catch a loop that falls back to the default."""
    cfg_t = target_model.config
    n, hidden = cfg_t.num_hidden_layers, cfg_t.hidden_size
    layers = eagle3_rule(n) if trained_on == "the rule" else trained_on
    embed = target_model.get_input_embeddings().weight.detach().float().cpu()
    torch.manual_seed(0)
    drafter = Eagle3Drafter(drafter_config(cfg_t.to_dict(), hidden, 64, embed.shape[0]), embed, torch.arange(64))
    folder = export_checkpoint(drafter, tmp_path / "drafter", layers)  # training exports the store's layers
    config = json.loads((folder / "config.json").read_text())
    assert sglang_reads(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"], "0.5.23") == layers
    assert vllm_reads(config["eagle_aux_hidden_state_layer_ids"]) == layers

    fed: list[tuple[int, torch.Tensor, dict[int, torch.Tensor]]] = []  # (drafter, fc input, target forward)
    forwards: list[dict[int, torch.Tensor]] = []

    class Watched(Eagle3Drafter):  # both drafters measure_speculative builds; fc is where the target's aux enters
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            me = id(self)
            self.fc.register_forward_pre_hook(lambda _m, inputs: fed.append((me, inputs[0].detach(), forwards[-1])))

    monkeypatch.setattr(quality, "Eagle3Drafter", Watched)
    prompt = [101, 2002, 3003, 404, 5005, 66, 707]
    merged = pl.DataFrame({"split": ["eval"], "input_ids": [prompt + [12, 13]], "loss_mask": [[0] * 7 + [1, 1]]})
    how = DecodeEval(
        prompts=1, max_new_tokens=4, draft_steps=2, seed=0, aux_layer_ids=trained_layer_ids(config), proxy=True
    )
    with layer_tap(target_model) as tapped:
        forwards = tapped
        result = measure_speculative(target_model, folder, merged, how, lambda m: None)
    assert len({me for me, _, _ in fed}) == 2 and len(fed) > 2  # trained and untrained: prefill, then verifies
    seen = [layers_in(aux, forward, hidden) for _, aux, forward in fed]
    assert all(s == layers for s in seen), f"trained on {layers}, decoded with {sorted(set(map(tuple, seen)))}"
    assert result.trained.lossless and result.untrained.lossless


# ---------------------------------------------------------------- 2. capture and export: the rule's layers everywhere


class _Started(Exception):
    """Raised where the SGLang backend would start its ranks: carries the backend and its ServerArgs."""


@pytest.mark.parametrize("release", list(SGLANG))
@pytest.mark.parametrize("n", [8, 12, 27, 40, 61])  # the stand-in, small and odd targets, Kimi-K2.5's 61
def test_capture_store_and_drafter_config_ask_for_the_eagle3_rule_layers(n, release, tmp_path, monkeypatch):
    """For an n-layer target, independently of the project's rule: the SGLang capture backend records the rule's
    layers and hands SGLang an argument SGLang reads as them; the transformers backend takes them; the drafter
    config written for them tells SGLang and vLLM the same layers; the decode eval reads them back."""
    want = eagle3_rule(n)
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": n, "hidden_size": 64}}))
    monkeypatch.setattr(sglang_backend, "preflight", lambda tp_size: None)  # no GPU, no sglang needed
    monkeypatch.setattr(sglang_api, "capture_rule", lambda: SGLANG[release])  # as read from that release's source

    def start(self):
        raise _Started(self, server_args_kwargs(self._engine_spec()))

    monkeypatch.setattr(SGLangHiddenStates, "_rank_pool", start)
    with pytest.raises(_Started) as started:
        SGLangHiddenStates(str(tmp_path), tp_size=1)
    backend, server_args = started.value.args
    assert backend.layer_ids == want  # what the store's manifest records
    assert sglang_reads(server_args["return_aux_hidden_state_layer_ids"], release) == want  # what SGLang captures

    lm = SimpleNamespace(model=SimpleNamespace(layers=[None] * n), config=SimpleNamespace(hidden_size=64))
    assert TransformersHiddenStates(lm).layer_ids == want

    cfg = config_json(drafter_config({}, 64, 64, 163840), backend.layer_ids)
    assert sglang_reads(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"], release) == want  # serving
    assert vllm_reads(cfg["eagle_aux_hidden_state_layer_ids"]) == want
    assert trained_layer_ids(cfg) == want  # what the speculative-decoding eval decodes with


def test_the_store_holds_the_outputs_of_the_rule_layers_seen_from_outside(target_model, tmp_path: Path):
    """The transformers capture on the stand-in, watched by hooks on its decoder layers: the store records the
    rule's layers and holds exactly their outputs."""
    n, hidden = target_model.config.num_hidden_layers, target_model.config.hidden_size
    ids = [17, 3030, 444, 50505, 6, 707, 8080, 99, 1000, 20202, 303]
    sample = StoredSample("A1/0000", "train", ids, [0] * 4 + [1] * 7)
    settings = StoreSettings(shard_bytes=60_000, batch_tokens=64, free_bytes=10**12, reserve_bytes=0)
    with layer_tap(target_model) as forwards:
        extract_to_store(
            [sample],
            TransformersHiddenStates(target_model),
            tmp_path,
            settings,
            identity={"t": 1},
            progress_every_s=1e6,
        )
    assert len(forwards) == 1
    assert read_manifest(tmp_path)["aux_layer_ids"] == eagle3_rule(n)
    aux = HiddenStateStore(tmp_path)[sample.sample_id]["aux_hidden_states"]
    assert layers_in(aux, forwards[0], hidden) == eagle3_rule(n)
