"""Write and verify the drafter checkpoint SGLang 0.5.23 loads, one layout per drafter kind (`model.DRAFTER_KINDS`):

- `eagle3_llama`: `LlamaForCausalLMEagle3` (models/llama_eagle3.py), tensors under `midlayer.`;
- `eagle3_mla`, `eagle3_1_mla`: `Eagle3DeepseekV2ForCausalLM` (models/kimi_k25_eagle3.py), the Kimi-K2.x MLA draft,
  tensors under `layers.0.` (its loader maps them to `midlayer.`; `midlayer.` would load too), the attention as
  `mla.MLAAttention` names it (SGLang fuses q_a_proj and kv_a_proj_with_mqa at load), every MLA field in config.json
  (transformers' DeepseekV3Config would fill a missing one with DeepSeek-V3's value), and for EAGLE 3.1 `fc_norm`
  and `norm_output` true with the three `fc_norm.{i}.weight`.

SGLang silently skips weight names it does not know (`layers.0.*` in the Llama draft, `input_norm.*`): the drafter
then runs with random weights and an accept length of ~1.0, the history's "zero acceptance". So the export writes
exactly the names each loader maps, and `check_checkpoint` verifies the written files key by key, shape by shape,
before the asset reports success. d2t (draft id -> target id offsets) is read the same way by both SGLang drafts;
t2d is skipped by both. vLLM loads the same checkpoints: `LlamaForCausalLMEagle3` (it renames `midlayer.` to
`layers.0.`) and, for the MLA kinds, its own `Eagle3DeepseekV2ForCausalLM` (vllm/model_executor/models/
deepseek_eagle3.py: `midlayer.` -> `layers.0.`, q_a_proj and kv_a_proj_with_mqa stacked into fused_qkv_a_proj, d2t
-> draft_id_to_target_id, t2d skipped, `fc_norm`/`norm_output` read from the config); both read their own layer-id
key (see `vllm_layer_ids`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3_assets.stages.eagle3_drafter.mla import MLAShape
from eagle3_assets.stages.eagle3_drafter.model import (
    MLA_FIELDS,
    TP_SIZES,
    DrafterConfig,
    Eagle3Drafter,
    loads_at_tp,
    mla_loads_at_tp,
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
LLAMA_ARCHITECTURE = "LlamaForCausalLMEagle3"
MLA_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"  # SGLang's and vLLM's class of the Kimi-K2.x MLA draft
MLA_MODEL_TYPES = ("deepseek_v3", "kimi_k2")  # both read as DeepseekV3Config by SGLang (kimi_k2: its alias)
MLA_LAYER = "layers.0."  # the MLA draft checkpoint's decoder-layer prefix (the module's is `midlayer.`)
MLA_ATTENTION = (
    "q_a_proj",
    "q_a_layernorm",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_a_layernorm",
    "kv_b_proj",
    "o_proj",
)
# The names Eagle3DeepseekV2ForCausalLM.load_weights maps (its EAGLE 3.1 variant adds `fc_norm.{i}.weight`).
SGLANG_MLA_KEYS = frozenset(
    [f"{MLA_LAYER}self_attn.{n}.weight" for n in MLA_ATTENTION]
    + [f"{MLA_LAYER}mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
    + [f"{MLA_LAYER}{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")]
    + ["fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"]
)
FC_NORM_KEYS = frozenset(f"fc_norm.{i}.weight" for i in range(3))


def architecture(kind: str) -> str:
    return LLAMA_ARCHITECTURE if kind == "eagle3_llama" else MLA_ARCHITECTURE


def checkpoint_keys(kind: str) -> frozenset[str]:
    """The tensor names a checkpoint of `kind` holds: exactly those its SGLang loader maps."""
    if kind == "eagle3_llama":
        return SGLANG_EAGLE3_KEYS
    return SGLANG_MLA_KEYS | (FC_NORM_KEYS if kind == "eagle3_1_mla" else frozenset())


def drafter_kind_of(config: dict[str, Any]) -> str:
    """The drafter kind a config.json describes: by its architecture and, for the MLA draft, EAGLE 3.1's flags (both
    on: eagle3_1_mla; both off: eagle3_mla). ValueError for anything else (another architecture, one flag alone)."""
    arch = config.get("architectures")
    if arch == [LLAMA_ARCHITECTURE]:
        return "eagle3_llama"
    if arch != [MLA_ARCHITECTURE]:
        raise ValueError(f"architectures is {arch}, not [{LLAMA_ARCHITECTURE!r}] or [{MLA_ARCHITECTURE!r}]")
    fc_norm = bool(config.get("fc_norm") or config.get("use_aux_norm"))  # SGLang reads either
    norm_output = bool(config.get("norm_output"))
    if fc_norm != norm_output:
        raise ValueError(f"fc_norm {fc_norm} with norm_output {norm_output}: neither EAGLE 3 nor EAGLE 3.1's MLA draft")
    return "eagle3_1_mla" if fc_norm else "eagle3_mla"


def drafter_config_from_json(config: dict[str, Any]) -> DrafterConfig:
    """The `DrafterConfig` an exported config.json describes (KeyError/ValueError/TypeError when it cannot)."""
    kind = drafter_kind_of(config)
    if kind == "eagle3_llama":
        fields = {f: config[f] for f in DrafterConfig.__dataclass_fields__ if f in config}
        return DrafterConfig(**{k: v for k, v in fields.items() if k not in MLA_FIELDS and k != "rope_scaling"})
    return DrafterConfig.mla_of(
        kind,
        config["hidden_size"],
        MLAShape.from_config(config),
        target_hidden_size=config.get("target_hidden_size") or config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        draft_vocab_size=config["draft_vocab_size"],
        rms_norm_eps=config["rms_norm_eps"],
        max_position_embeddings=config["max_position_embeddings"],
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


def vocabulary_and_eagle_fields(cfg: DrafterConfig, aux_layer_ids: list[int]) -> dict[str, Any]:
    """The fields every kind's config.json ends with: the vocabularies, untied head, the aux layer ids (SGLang's under
    `eagle_config`, vLLM's at the top level, each in its own convention) and the dtype."""
    return {
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
    }


def config_json(cfg: DrafterConfig, aux_layer_ids: list[int], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """SGLang reads the ids under `eagle_config`, vLLM at the top level, each in its own convention."""
    if cfg.is_mla:
        return mla_config_json(cfg, aux_layer_ids, extra)
    return {
        "architectures": [LLAMA_ARCHITECTURE],
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
        **vocabulary_and_eagle_fields(cfg, aux_layer_ids),
        **(extra or {}),
    }


def mla_config_json(cfg: DrafterConfig, aux_layer_ids: list[int], extra: dict[str, Any] | None) -> dict[str, Any]:
    """The MLA draft's config.json: what SGLang's Eagle3DeepseekV2ForCausalLM (and its DeepseekV2AttentionMLA and
    model config) read, every MLA field written out, rope as the draft was trained (`MLAShape.to_config`)."""
    shape = cfg.mla_shape()
    return {
        "architectures": [MLA_ARCHITECTURE],
        "model_type": "deepseek_v3",
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": "silu",  # DeepseekV2MLP serves silu only
        **shape.to_config(),
        "num_key_value_heads": shape.num_attention_heads,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        **vocabulary_and_eagle_fields(cfg, aux_layer_ids),
        **(extra or {}),
    }


def expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor's shape, by its name in the checkpoint of `cfg.drafter_kind`."""
    if cfg.is_mla:
        return mla_expected_shapes(cfg)
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


def mla_expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    s, H, Ht, inter = cfg.mla_shape(), cfg.hidden_size, cfg.target_hidden_size, cfg.intermediate_size
    h, a = s.num_attention_heads, f"{MLA_LAYER}self_attn."
    shapes = {
        f"{a}q_a_proj.weight": (s.q_lora_rank, 2 * H),
        f"{a}q_a_layernorm.weight": (s.q_lora_rank,),
        f"{a}q_b_proj.weight": (h * s.qk_head_dim, s.q_lora_rank),
        f"{a}kv_a_proj_with_mqa.weight": (s.kv_lora_rank + s.qk_rope_head_dim, 2 * H),
        f"{a}kv_a_layernorm.weight": (s.kv_lora_rank,),
        f"{a}kv_b_proj.weight": (h * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank),
        f"{a}o_proj.weight": (H, h * s.v_head_dim),
        f"{MLA_LAYER}mlp.gate_proj.weight": (inter, H),
        f"{MLA_LAYER}mlp.up_proj.weight": (inter, H),
        f"{MLA_LAYER}mlp.down_proj.weight": (H, inter),
        f"{MLA_LAYER}input_layernorm.weight": (H,),
        f"{MLA_LAYER}hidden_norm.weight": (H,),
        f"{MLA_LAYER}post_attention_layernorm.weight": (H,),
        "fc.weight": (H, 3 * Ht),
        "norm.weight": (H,),
        "lm_head.weight": (cfg.draft_vocab_size, H),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
    }
    if cfg.fc_norm:
        shapes |= {k: (Ht,) for k in sorted(FC_NORM_KEYS)}
    return shapes


def checkpoint_name(cfg: DrafterConfig, module_name: str) -> str:
    """A drafter module's state_dict name as its kind's checkpoint names it (MLA kinds: `midlayer.` -> `layers.0.`)."""
    if cfg.is_mla and module_name.startswith("midlayer."):
        return MLA_LAYER + module_name.removeprefix("midlayer.")
    return module_name


def module_name(cfg: DrafterConfig, checkpoint_name: str) -> str:
    """The inverse of `checkpoint_name` (a checkpoint's `midlayer.X` is read as SGLang reads it, as `layers.0.X`)."""
    if cfg.is_mla and checkpoint_name.startswith(MLA_LAYER):
        return "midlayer." + checkpoint_name.removeprefix(MLA_LAYER)
    return checkpoint_name


def checkpoint_tensors(model: Eagle3Drafter) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    out = {}
    for name, t in state.items():
        if name in ("d2t", "t2d"):
            out[name] = t.clone()  # int64 offsets and a bool mask, as SGLang reads them
        else:
            out[checkpoint_name(model.cfg, name)] = t.detach().to(torch.bfloat16).contiguous()
    return out


def tp_problem(cfg_json: dict[str, Any], kind: str) -> str | None:
    """Which TP sizes of TP_SIZES the config cannot load at (None: all): SGLang's and vLLM's splits. The Llama
    draft's heads and KV heads; the MLA draft's heads (q_b_proj, kv_b_proj and o_proj split by head; its fused down
    projection is a ReplicatedLinear, its latent one row per token on every rank), its MLP's intermediate size
    (MergedColumnParallelLinear) and its fc's output, the hidden size (SGLang's fc is a ColumnParallelLinear)."""
    heads = cfg_json["num_attention_heads"]
    if kind == "eagle3_llama":
        kv = cfg_json["num_key_value_heads"]
        bad = [tp for tp in TP_SIZES if not loads_at_tp(heads, kv, tp)]
        return f"{heads} heads / {kv} KV heads do not split at --tp {bad}" if bad else None
    hidden, inter = cfg_json["hidden_size"], cfg_json["intermediate_size"]
    bad = [tp for tp in TP_SIZES if not mla_loads_at_tp(heads, hidden, inter, tp)]
    return f"{heads} MLA heads, hidden {hidden}, intermediate {inter} do not split at --tp {bad}" if bad else None


def mla_config_problems(cfg_json: dict[str, Any]) -> list[str]:
    """What SGLang's MLA draft needs of its config and the exported one must say: every MLA field written (a missing
    one is filled with DeepSeek-V3's by transformers), q_lora_rank set, one layer, silu."""
    problems = []
    for key in (*MLA_FIELDS, "intermediate_size", "rms_norm_eps", "max_position_embeddings"):
        if not isinstance(cfg_json.get(key), int | float) or isinstance(cfg_json.get(key), bool):
            problems.append(f"config.json lacks {key!r} (SGLang's MLA draft reads it; DeepseekV3Config would fill it)")
    if cfg_json.get("model_type") not in MLA_MODEL_TYPES:
        problems.append(f"model_type is {cfg_json.get('model_type')!r}, not one of {list(MLA_MODEL_TYPES)}")
    if cfg_json.get("num_hidden_layers") != 1:
        problems.append(f"num_hidden_layers is {cfg_json.get('num_hidden_layers')}: the EAGLE-3 MLA draft has 1")
    if cfg_json.get("hidden_act") != "silu":
        problems.append(f"hidden_act is {cfg_json.get('hidden_act')!r}: DeepseekV2MLP serves silu only")
    if cfg_json.get("tie_word_embeddings"):
        problems.append("tie_word_embeddings is true: SGLang would use the embedding as the draft head")
    return problems


def check_checkpoint(folder: Path) -> list[str]:
    """Every way the checkpoint differs from what SGLang's loader of its kind needs (empty list: loadable)."""
    folder = Path(folder)
    problems = []
    try:
        cfg_json = json.loads((folder / "config.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError) as e:
        return [f"config.json unreadable: {e}"]
    for key in ("architectures", "vocab_size", "draft_vocab_size", "hidden_size", "eagle_config"):
        if key not in cfg_json:
            problems.append(f"config.json lacks {key!r}")
    try:
        kind = drafter_kind_of(cfg_json)
    except ValueError as e:
        return [*problems, str(e)]
    if kind != "eagle3_llama":
        problems += mla_config_problems(cfg_json)
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
    heads_keys = ("num_attention_heads", "num_key_value_heads") if kind == "eagle3_llama" else ("num_attention_heads",)
    for key in heads_keys:
        if not isinstance(cfg_json.get(key), int):
            problems.append(f"config.json lacks {key!r}")
    if not problems:
        bad_tp = tp_problem(cfg_json, kind)
        if bad_tp:
            problems.append(bad_tp)
    with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as f:
        keys = set(f.keys())
        tensors = {k: f.get_tensor(k) for k in keys}
    wanted = checkpoint_keys(kind)
    for k in sorted(keys - wanted):
        problems.append(f"unexpected key {k!r}: SGLang would silently skip it")
    for k in sorted(wanted - keys):
        problems.append(f"missing key {k!r}: SGLang would leave it randomly initialised")
    try:
        cfg = drafter_config_from_json(cfg_json)
        for k, shape in expected_shapes(cfg).items():
            if k in tensors and tuple(tensors[k].shape) != shape:
                problems.append(f"{k} has shape {tuple(tensors[k].shape)}, expected {shape}")
    except (TypeError, KeyError, ValueError) as e:
        problems.append(f"config.json cannot describe the drafter: {e!r}")
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
    """An exported drafter read back, to warm-start training from it (or decode with it)."""

    folder: Path
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    @property
    def draft_ids(self) -> torch.Tensor:
        d2t = self.tensors["d2t"].long()
        return d2t + torch.arange(len(d2t))

    @property
    def drafter_config(self) -> DrafterConfig:
        return drafter_config_from_json(self.config)

    @property
    def drafter_kind(self) -> str:
        return drafter_kind_of(self.config)

    def load_into(self, model: Eagle3Drafter) -> None:
        """Copy every weight (bf16 values, exact in an fp32 model); a shape that differs (another target width, another
        vocabulary), a weight of another kind, or a model weight the checkpoint lacks is an error, not a skip."""
        if model.cfg.drafter_kind != self.drafter_kind:
            raise ValueError(
                f"{self.folder} is a {self.drafter_kind} drafter, the one being trained {model.cfg.drafter_kind}"
            )
        own = model.state_dict()
        missing, filled = [], set()
        for name, t in self.tensors.items():
            if name in ("d2t", "t2d"):
                continue
            mine = module_name(model.cfg, name)
            if mine not in own:
                missing.append(name)
                continue
            if tuple(own[mine].shape) != tuple(t.shape):
                raise ValueError(
                    f"{self.folder}: {name} is {tuple(t.shape)}, the drafter being trained has {tuple(own[mine].shape)}"
                )
            own[mine].copy_(t.to(own[mine].dtype))
            filled.add(mine)
        if missing:
            raise ValueError(f"{self.folder}: weights the drafter does not have: {missing}")
        unfilled = sorted(set(own) - filled - {"d2t", "t2d"})
        if unfilled:
            raise ValueError(f"{self.folder}: lacks weights of the drafter: {unfilled}")


def read_checkpoint(folder: Path) -> DrafterCheckpoint:
    problems = check_checkpoint(folder)
    if problems:
        raise ValueError(f"{folder} is not a drafter this project can warm-start from: {problems[0]}")
    with safe_open(str(Path(folder) / WEIGHTS_FILE), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return DrafterCheckpoint(Path(folder), json.loads((Path(folder) / "config.json").read_text()), tensors)
