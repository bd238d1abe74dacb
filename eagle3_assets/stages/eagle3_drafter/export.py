"""Write and verify the drafter checkpoint SGLang loads as `LlamaForCausalLMEagle3`.

SGLang silently skips weight names it does not know (`layers.0.*`, `input_norm.*`): the drafter
then runs with random weights and an accept length of ~1.0, the history's "zero acceptance".
So the export writes exactly the names SGLang's loader maps, and `check_checkpoint` verifies
the written files key by key, shape by shape, before the asset reports success. vLLM loads the
same checkpoint (it renames `midlayer.` to `layers.0.`) and reads its own layer-id key (see
`vllm_layer_ids`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3_assets.stages.eagle3_drafter.model import (
    TP_SIZES,
    DrafterConfig,
    Eagle3Drafter,
    loads_at_tp,
)
from eagle3_resources.atomic_files import published_folder

WEIGHTS_FILE = "model.safetensors"
# The names SGLang's LlamaForCausalLMEagle3.load_weights maps (../shared/reference/eagle3.md).
SGLANG_EAGLE3_KEYS = frozenset(
    [
        "midlayer.self_attn.q_proj.weight",
        "midlayer.self_attn.k_proj.weight",
        "midlayer.self_attn.v_proj.weight",
        "midlayer.self_attn.o_proj.weight",
        "midlayer.mlp.gate_proj.weight",
        "midlayer.mlp.up_proj.weight",
        "midlayer.mlp.down_proj.weight",
        "midlayer.input_layernorm.weight",
        "midlayer.hidden_norm.weight",
        "midlayer.post_attention_layernorm.weight",
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
    ]
)


def sglang_layer_ids(aux_layer_ids: list[int]) -> list[int]:
    """`eagle_config.eagle_aux_hidden_state_layer_ids` as SGLang (0.5.23, after sglang#25454) reads it for our ids
    (outputs of 0-based layers): a list starting with 1 gets SGLang's +1; any other list is read as layer inputs."""
    from eagle3_resources.hidden_states.sglang_api import CaptureRule, capture_argument

    return capture_argument(list(aux_layer_ids), max(aux_layer_ids) + 2, CaptureRule.PLUS_ONE_IF_FIRST_IS_1)


def vllm_layer_ids(aux_layer_ids: list[int]) -> list[int]:
    """Top-level `eagle_aux_hidden_state_layer_ids` as vLLM reads it: the target captures `hidden_states + residual`
    at the INPUT of each listed layer, with no offset added, so the output of layer i is id i + 1. (Without the key
    vLLM uses (2, N//2, N-3), the same layers as our [1, N//2-1, N-4]; written anyway so a custom choice holds.)"""
    return [i + 1 for i in aux_layer_ids]


def trained_layer_ids(config: dict[str, Any]) -> list[int]:
    """The layers (outputs, 0-based) a checkpoint was trained on, from vLLM's key (layer inputs: id - 1)."""
    return [i - 1 for i in config["eagle_aux_hidden_state_layer_ids"]]


def config_json(cfg: DrafterConfig, aux_layer_ids: list[int], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """SGLang reads the ids under `eagle_config`, vLLM at the top level, each in its own convention."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": sglang_layer_ids(aux_layer_ids),
            "use_aux_hidden_state": True,
        },
        "eagle_aux_hidden_state_layer_ids": vllm_layer_ids(aux_layer_ids),
        "torch_dtype": "bfloat16",
        **(extra or {}),
    }


def expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    H, Ht, inter = cfg.hidden_size, cfg.target_hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {
        "midlayer.self_attn.q_proj.weight": (q, 2 * H),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, q),
        "midlayer.mlp.gate_proj.weight": (inter, H),
        "midlayer.mlp.up_proj.weight": (inter, H),
        "midlayer.mlp.down_proj.weight": (H, inter),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        "fc.weight": (H, 3 * Ht),
        "norm.weight": (H,),
        "lm_head.weight": (cfg.draft_vocab_size, H),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
    }


def checkpoint_tensors(model: Eagle3Drafter) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    out = {}
    for name, t in state.items():
        if name in ("d2t", "t2d"):
            out[name] = t.clone()  # int64 offsets and a bool mask, as SGLang reads them
        else:
            out[name] = t.detach().to(torch.bfloat16).contiguous()
    return out


def check_checkpoint(folder: Path) -> list[str]:
    """Every way the checkpoint differs from what SGLang's loader needs (empty list: loadable)."""
    folder = Path(folder)
    problems = []
    try:
        cfg_json = json.loads((folder / "config.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError) as e:
        return [f"config.json unreadable: {e}"]
    for key in ("architectures", "vocab_size", "draft_vocab_size", "hidden_size", "eagle_config"):
        if key not in cfg_json:
            problems.append(f"config.json lacks {key!r}")
    if cfg_json.get("architectures") != ["LlamaForCausalLMEagle3"]:
        problems.append(f"architectures is {cfg_json.get('architectures')}, not ['LlamaForCausalLMEagle3']")
    sglang_ids = (cfg_json.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not sglang_ids:
        problems.append("eagle_config.eagle_aux_hidden_state_layer_ids is missing")
    vllm_ids = cfg_json.get("eagle_aux_hidden_state_layer_ids")
    if sglang_ids and vllm_ids is not None:
        from eagle3_resources.hidden_states.sglang_api import (
            CaptureRule,
            layers_to_capture,
        )

        # Both servers capture at layer inputs: SGLang after its own offset, vLLM as listed.
        if layers_to_capture(list(sglang_ids), CaptureRule.PLUS_ONE_IF_FIRST_IS_1) != list(vllm_ids):
            problems.append(f"SGLang's layer ids {sglang_ids} and vLLM's {vllm_ids} name different target layers")
    for key in ("num_attention_heads", "num_key_value_heads"):
        if not isinstance(cfg_json.get(key), int):
            problems.append(f"config.json lacks {key!r}")
    if not problems:
        bad = [
            tp
            for tp in TP_SIZES
            if not loads_at_tp(cfg_json["num_attention_heads"], cfg_json["num_key_value_heads"], tp)
        ]
        if bad:
            problems.append(
                f"{cfg_json['num_attention_heads']} heads / {cfg_json['num_key_value_heads']} KV heads "
                f"do not split at --tp {bad}"
            )
    with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as f:
        keys = set(f.keys())
        tensors = {k: f.get_tensor(k) for k in keys}
    for k in sorted(keys - SGLANG_EAGLE3_KEYS):
        problems.append(f"unexpected key {k!r}: SGLang would silently skip it")
    for k in sorted(SGLANG_EAGLE3_KEYS - keys):
        problems.append(f"missing key {k!r}: SGLang would leave it randomly initialised")
    try:
        cfg = DrafterConfig(**{f: cfg_json[f] for f in DrafterConfig.__dataclass_fields__ if f in cfg_json})
        for k, shape in expected_shapes(cfg).items():
            if k in tensors and tuple(tensors[k].shape) != shape:
                problems.append(f"{k} has shape {tuple(tensors[k].shape)}, expected {shape}")
    except TypeError as e:
        problems.append(f"config.json cannot describe the drafter: {e}")
    for k, t in tensors.items():
        want = torch.int64 if k == "d2t" else torch.bool if k == "t2d" else torch.bfloat16
        if t.dtype != want:
            problems.append(f"{k} is {t.dtype}, expected {want}")
    if "d2t" in tensors and "t2d" in tensors:
        target_ids = tensors["d2t"] + torch.arange(len(tensors["d2t"]))
        if not bool(tensors["t2d"][target_ids].all()) or int(tensors["t2d"].sum()) != len(target_ids):
            problems.append("d2t and t2d disagree on the draft vocabulary")
    return problems


def export_checkpoint(
    model: Eagle3Drafter, out_dir: Path, aux_layer_ids: list[int], extra: dict[str, Any] | None = None
) -> Path:
    """Write config.json + model.safetensors to `out_dir`, replacing it only once verified."""
    out_dir = Path(out_dir)
    with published_folder(out_dir) as tmp:  # a kill leaves the previous drafter; the next export sweeps the rest
        (tmp / "config.json").write_text(json.dumps(config_json(model.cfg, aux_layer_ids, extra), indent=2) + "\n")
        save_file(checkpoint_tensors(model), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        problems = check_checkpoint(tmp)
        if problems:
            raise ValueError("the exported drafter would not load correctly in SGLang:\n  " + "\n  ".join(problems))
    return out_dir


@dataclass
class DrafterCheckpoint:
    """An exported drafter read back, to warm-start training from it."""

    folder: Path
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    @property
    def draft_ids(self) -> torch.Tensor:
        d2t = self.tensors["d2t"].long()
        return d2t + torch.arange(len(d2t))

    def load_into(self, model: Eagle3Drafter) -> None:
        """Copy every weight; a shape that differs (another target width, another vocabulary) is an error, not a
        skip."""
        own = model.state_dict()
        missing = []
        for name, t in self.tensors.items():
            if name in ("d2t", "t2d"):
                continue
            if name not in own:
                missing.append(name)
                continue
            if tuple(own[name].shape) != tuple(t.shape):
                raise ValueError(
                    f"{self.folder}: {name} is {tuple(t.shape)}, the drafter being trained has {tuple(own[name].shape)}"
                )
            own[name].copy_(t.to(own[name].dtype))
        if missing:
            raise ValueError(f"{self.folder}: weights the drafter does not have: {missing}")


def read_checkpoint(folder: Path) -> DrafterCheckpoint:
    problems = check_checkpoint(folder)
    if problems:
        raise ValueError(f"{folder} is not a drafter this project can warm-start from: {problems[0]}")
    with safe_open(str(Path(folder) / WEIGHTS_FILE), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return DrafterCheckpoint(Path(folder), json.loads((Path(folder) / "config.json").read_text()), tensors)
