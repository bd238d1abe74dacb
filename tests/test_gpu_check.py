"""`eagle3 gpu-check`: the tiny model it hands SGLang, checked against SGLang 0.5.23's own source, and the host
checks that make it the first command on a new host, driven from outside.

The tiny DeepseekV3 is what `eagle3 gpu-check --tp 1` loads into SGLang on a GPU host. This CPU host cannot
run SGLang, so the tests read the pinned release's `models/deepseek_v2.py` and its weight loader with `ast`
(never importing sglang) and ask the two questions a model build and a weight load would answer:

- every `config.<attr>` that the model, MoE, gate, attention and decoder-layer classes read without a
  `getattr` default, on the code path the tiny config selects, is in the saved config.json;
- every tensor in the saved safetensors maps, by the loader's own name rules (its stacked-params list,
  `FusedMoE.make_expert_params_mapping`, the fused-expert and fused q/kv-a rules), onto a parameter the
  built model has, and every parameter the built model has receives a tensor.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import operator
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
MODELS = "sglang/srt/models"

# ---------------------------------------------------------------- the tiny model, built once


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from eagle3_assets.operations.gpu_check import tiny_deepseek_v3

    return tiny_deepseek_v3(tmp_path_factory.mktemp("tiny") / "tiny-deepseek-v3")


@pytest.fixture(scope="module")
def deepseek_v2(sglang_release_source) -> ast.Module:
    return ast.parse((sglang_release_source / MODELS / "deepseek_v2.py").read_text())


@pytest.fixture(scope="module")
def weight_loader(sglang_release_source) -> ast.Module:
    return ast.parse((sglang_release_source / MODELS / "deepseek_common/deepseek_weight_loader.py").read_text())


def classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


# ---------------------------------------------------------------- (a) config attributes read without a default

UNKNOWN = object()
OPS = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}
# the tiny model's path: no quantization, not the NextN draft, no hash-routed or DeepSeek-V4 layers, on a CUDA
# host (SGLang's module-level platform flags: not ROCm/aiter, NPU, XPU, MUSA or CPU)
KNOWN_NAMES = {
    "quant_config": None,
    "is_nextn": False,
    "is_hash_moe": False,
    "is_deepseek_v4": False,
    "None": None,
    "_is_cuda": True,
    "_is_hip": False,
    "_use_aiter": False,
    "_is_npu": False,
    "_is_xpu": False,
    "_is_musa": False,
    "_is_cpu": False,
}
# the classes that build and run the target (DeepseekV3ForCausalLM is DeepseekV2ForCausalLM under another name)
MODEL_CLASSES = (
    "MoEGate",
    "DeepseekV2MoE",
    "DeepseekV2MLP",
    "DeepseekV2AttentionMLA",
    "DeepseekV2DecoderLayer",
    "DeepseekV2Model",
    "DeepseekV2ForCausalLM",
)


def _is_config(node: ast.AST) -> bool:
    """`config` or `self.config`: the HF config object."""
    return (isinstance(node, ast.Name) and node.id == "config") or (
        isinstance(node, ast.Attribute)
        and node.attr == "config"
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


class ConfigReads:
    """Walks methods, following only the branches the config decides (tests it cannot decide: both branches),
    and records each `config.X` read in a Load context. `getattr(config, "X", default)` and `hasattr` are not
    reads that can fail; `getattr(config, "X")` without a default is."""

    def __init__(self, config: dict):
        self.config = config
        self.reads: dict[str, int] = {}  # attribute -> first line read

    def value(self, node: ast.AST):
        """The node's value when the config and KNOWN_NAMES decide it, else UNKNOWN; records the reads on the way."""
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            return KNOWN_NAMES.get(node.id, UNKNOWN)
        if isinstance(node, ast.Attribute) and _is_config(node.value) and isinstance(node.ctx, ast.Load):
            self.reads.setdefault(node.attr, node.lineno)
            return self.config.get(node.attr, UNKNOWN)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("hasattr", "getattr")
            and len(node.args) >= 2
            and _is_config(node.args[0])
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            name = node.args[1].value
            if node.func.id == "hasattr":
                return name in self.config
            if len(node.args) == 2:
                self.reads.setdefault(name, node.lineno)
                return self.config.get(name, UNKNOWN)
            default = self.value(node.args[2])
            return self.config[name] if name in self.config else default
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            v = self.value(node.operand)
            return UNKNOWN if v is UNKNOWN else not v
        if isinstance(node, ast.BoolOp):  # short-circuit: later operands are not evaluated once one decides
            decided_by = isinstance(node.op, ast.Or)
            result = decided_by is False
            for operand in node.values:
                v = self.value(operand)
                if v is UNKNOWN:
                    result = UNKNOWN
                elif bool(v) is decided_by:
                    return v
            return result
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            a, b = self.value(node.left), self.value(node.comparators[0])
            if a is UNKNOWN or b is UNKNOWN or type(node.ops[0]) not in OPS:
                return UNKNOWN
            try:
                return OPS[type(node.ops[0])](a, b)
            except TypeError:
                return UNKNOWN
        if isinstance(node, ast.IfExp):
            t = self.value(node.test)
            if t is UNKNOWN:
                self.visit(node.body)
                self.visit(node.orelse)
                return UNKNOWN
            return self.value(node.body if t else node.orelse)
        self.visit_children(node)
        return UNKNOWN

    def visit_children(self, node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            self.visit(child)

    def visit(self, node: ast.AST | list[ast.stmt]) -> None:  # a node, or a block of statements
        if isinstance(node, list):
            for n in node:
                self.visit(n)
        elif isinstance(node, (ast.If, ast.While)):
            t = self.value(node.test)
            if t is UNKNOWN or t:
                self.visit(node.body)
            if t is UNKNOWN or not t:
                self.visit(node.orelse)
        elif isinstance(node, ast.Assert):
            self.value(node.test)
        elif isinstance(node, ast.expr):
            self.value(node)
        else:
            self.visit_children(node)


def config_reads(tree: ast.Module, config: dict) -> dict[str, int]:
    walker = ConfigReads(config)
    for name in MODEL_CLASSES:
        walker.visit(classes(tree)[name].body)
    return walker.reads


def test_tiny_config_has_every_attribute_sglang_reads(tiny_model, deepseek_v2):
    """SGLang builds DeepseekV3ForCausalLM from the saved config.json; an attribute it reads without a default
    and the config lacks is an AttributeError at model build (transformers 5's DeepseekV3Config has no
    topk_method, scoring_func or moe_layer_freq)."""
    config = json.loads((tiny_model / "config.json").read_text())
    reads = config_reads(deepseek_v2, config)
    assert {"topk_method", "scoring_func", "moe_layer_freq", "n_routed_experts", "kv_lora_rank"} <= set(reads), reads
    missing = {a: f"deepseek_v2.py:{line}" for a, line in reads.items() if a not in config}
    assert not missing, f"SGLang 0.5.23 reads these without a default; the tiny config.json lacks them: {missing}"
    # the values are those of transformers' router: sigmoid scores, the correction bias added for the choice
    assert (config["topk_method"], config["scoring_func"], config["moe_layer_freq"]) == ("noaux_tc", "sigmoid", 1)
    assert config["rope_parameters"]["rope_theta"] is not None  # DecoderLayer: rope_parameters["rope_theta"]


def test_config_reader_follows_the_selected_path(deepseek_v2):
    """The reader counts a read only on the path the config selects: with rope_parameters in the config the
    decoder layer takes rope_theta from it and never reads config.rope_theta or config.rope_scaling; without
    it, it reads both. Reads behind `hasattr` (q_lora_rank) count when the config has the key."""
    with_rope = config_reads(deepseek_v2, {"rope_parameters": {"rope_theta": 1e4}, "q_lora_rank": 8})
    assert "rope_theta" not in with_rope and "rope_scaling" not in with_rope and "q_lora_rank" in with_rope
    without = config_reads(deepseek_v2, {})
    assert {"rope_theta", "rope_scaling"} <= set(without)


# ---------------------------------------------------------------- (b) weight names against the loader


def _assigned_attrs(fn: ast.FunctionDef) -> set[str]:
    targets = [t for n in ast.walk(fn) if isinstance(n, ast.Assign) for t in n.targets]
    targets += [e for t in targets if isinstance(t, ast.Tuple) for e in t.elts]  # self.layers, self.start_layer, ... =
    return {
        t.attr
        for t in targets
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }


def _eval_source(expr: ast.expr, **names):
    """Evaluate one of SGLang's own expressions (a condition it builds the model by) on the given names."""
    return eval(compile(ast.Expression(expr), "<sglang>", "eval"), {"__builtins__": {}}, names)


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)


def _if_around(fn: ast.FunctionDef, attr: str) -> ast.If:
    """The `if` whose body assigns self.<attr>."""
    for n in ast.walk(fn):
        if isinstance(n, ast.If) and attr in {
            t.attr for s in n.body if isinstance(s, ast.Assign) for t in s.targets if isinstance(t, ast.Attribute)
        }:
            return n
    raise AssertionError(f"no `if` assigns self.{attr} in {fn.name}")


class SGLangDeepseek:
    """What SGLang 0.5.23 builds and loads for a DeepseekV3 config, read from its source."""

    def __init__(self, source: Path, model: ast.Module, loader: ast.Module):
        self.cls = classes(model)
        self.loader = loader
        self.loader_text = (source / MODELS / "deepseek_common/deepseek_weight_loader.py").read_text()
        # the unquantized FusedMoE method registers the experts' parameters
        self.fused_moe_methods = (source / "sglang/srt/layers/quantization/unquant.py").read_text()
        load = _function(loader, "do_load_weights")
        stacked = next(
            n
            for n in ast.walk(load)
            if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "stacked_params_mapping"
        )
        self.stacked = ast.literal_eval(stacked.value)
        fused = _function(loader, "_load_fused_expert_tensor")
        mappings = next(
            n for n in ast.walk(fused) if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "mappings"
        )
        self.fused_experts = ast.literal_eval(mappings.value)
        call = next(
            n
            for n in ast.walk(load)
            if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr == "make_expert_params_mapping"
        )
        self.expert_kwargs = {
            k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg is not None and k.arg != "num_experts"
        }
        moe_layer = ast.parse((source / "sglang/srt/layers/moe/fused_moe_triton/layer.py").read_text())
        fn = next(
            n
            for n in classes(moe_layer)["FusedMoE"].body
            if isinstance(n, ast.FunctionDef) and n.name == "make_expert_params_mapping"
        )
        # drop @classmethod; type_params is a field from Python 3.12 (3.11 keeps it as a plain attribute)
        fn = ast.FunctionDef(fn.name, fn.args, fn.body, [], None, type_params=[])  # type: ignore[call-arg]
        namespace: dict = {}
        exec(
            compile(ast.fix_missing_locations(ast.Module([fn], [])), "<FusedMoE>", "exec"),
            {"List": list, "Tuple": tuple, "range": range},
            namespace,
        )
        self._make_expert_params_mapping = namespace[fn.name]
        # the loader's rules mirrored below, each pinned to its text in the source
        for anchor in (
            'if ("mlp.experts." in name) and name not in params_dict:',
            '"q_a_proj", "fused_qkv_a_proj_with_mqa"',
            '"kv_a_proj_with_mqa",\n                                        "fused_qkv_a_proj_with_mqa"',
            'f"mlp.experts.{self.config.n_routed_experts}"',
            'if "rotary_emb.inv_freq" in name:',
            ">= self.config.num_hidden_layers",
        ):
            assert anchor in self.loader_text, f"the loader's rule changed: {anchor!r} is gone"

    def expert_mapping(self, num_experts: int) -> list[tuple[str, str, int, str]]:
        return self._make_expert_params_mapping(None, num_experts=num_experts, **self.expert_kwargs)  # cls unused

    # -- the parameters the built model has, each module edge checked in the class that assigns it

    def _edge(self, cls: str, attr: str) -> None:
        assert attr in _assigned_attrs(method(self.cls[cls], "__init__")), (
            f"{cls}.__init__ no longer assigns self.{attr}"
        )

    def parameters(self, config: dict, fused_shared: int) -> set[str]:
        c = SimpleNamespace(**config)
        params = set()
        for cls, attr in (
            ("DeepseekV2ForCausalLM", "model"),
            ("DeepseekV2ForCausalLM", "lm_head"),
            ("DeepseekV2Model", "embed_tokens"),
            ("DeepseekV2Model", "norm"),
            ("DeepseekV2Model", "layers"),
        ):
            self._edge(cls, attr)
        tied = _eval_source(ast.parse("config.tie_word_embeddings", mode="eval").body, config=c)
        params |= {"model.embed_tokens.weight", "model.norm.weight"} | (set() if tied else {"lm_head.weight"})
        sparse_rule = next(
            n
            for n in ast.walk(method(self.cls["DeepseekV2DecoderLayer"], "_is_layer_sparse"))
            if isinstance(n, ast.Return)
        ).value
        assert sparse_rule is not None  # _is_layer_sparse returns an expression
        gate_init = method(self.cls["MoEGate"], "__init__")
        bias_if = _if_around(gate_init, "e_score_correction_bias")
        moe_init = method(self.cls["DeepseekV2MoE"], "__init__")
        shared_if = _if_around(moe_init, "shared_experts")
        mla = method(self.cls["DeepseekV2AttentionMLA"], "__init__")
        fused_qkv_if = _if_around(mla, "fused_qkv_a_proj_with_mqa")
        for attr in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
            self._edge("DeepseekV2DecoderLayer", attr)
        for attr in ("gate", "experts"):
            self._edge("DeepseekV2MoE", attr)
        for attr in ("gate_up_proj", "down_proj"):
            self._edge("DeepseekV2MLP", attr)
        for attr in ("q_b_proj", "q_a_layernorm", "kv_a_layernorm", "kv_b_proj", "o_proj"):
            self._edge("DeepseekV2AttentionMLA", attr)
        assert (
            'register_parameter("w13_weight"' in self.fused_moe_methods
            and 'register_parameter("w2_weight"' in self.fused_moe_methods
        )
        for i in range(config["num_hidden_layers"]):
            p = f"model.layers.{i}."
            params |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
            attn = p + "self_attn."
            params |= {attn + n + ".weight" for n in ("kv_a_layernorm", "kv_b_proj", "o_proj")}
            q_lora_rank = config.get("q_lora_rank")
            if _eval_source(fused_qkv_if.test, q_lora_rank=q_lora_rank, self=SimpleNamespace(q_lora_rank=q_lora_rank)):
                params |= {attn + n + ".weight" for n in ("fused_qkv_a_proj_with_mqa", "q_a_layernorm", "q_b_proj")}
            else:
                params |= {attn + n + ".weight" for n in ("q_proj", "kv_a_proj_with_mqa")}
            if _eval_source(sparse_rule, config=c, layer_id=i, is_nextn=False):
                params |= {p + "mlp.gate.weight", p + "mlp.experts.w13_weight", p + "mlp.experts.w2_weight"}
                if _eval_source(bias_if.test, config=c, is_hash_moe=False):
                    params.add(p + "mlp.gate.e_score_correction_bias")
                shared = _eval_source(
                    shared_if.test,
                    config=c,
                    self=SimpleNamespace(num_fused_shared_experts=fused_shared),
                    _uses_per_rank_shared_slots=False,
                )
                if shared:
                    params |= {p + "mlp.shared_experts.gate_up_proj.weight", p + "mlp.shared_experts.down_proj.weight"}
            else:
                params |= {p + "mlp.gate_up_proj.weight", p + "mlp.down_proj.weight"}
        return params

    # -- the loader's name rules (do_load_weights, unquantized, not NextN)

    def target(self, name: str, config: dict, params: set[str], fused_shared: int) -> str | None:
        """The parameter `name` loads into, or None when the loader skips it (warns and drops it)."""
        if fused_shared and "mlp.shared_experts" in name:
            name = name.replace("mlp.shared_experts", f"mlp.experts.{config['n_routed_experts']}")
        if config.get("num_nextn_predict_layers", 0) > 0 and name.startswith("model.layers"):
            parts = name.split(".")
            if len(parts) >= 3 and int(parts[2]) >= config["num_hidden_layers"]:
                return None
        for source, target, _ in self.fused_experts:
            if name.endswith(source):
                param = name[: -len(source)] + target
                return param if param in params else None
        if "rotary_emb.inv_freq" in name:
            return None
        for param_name, weight_name, _ in self.stacked:
            if weight_name not in name:
                continue
            if "mlp.experts." in name and name not in params:
                continue
            return name.replace(weight_name, param_name)  # params_dict[name]: a KeyError in SGLang when absent
        for param_name, weight_name, _, _ in self.expert_mapping(config["n_routed_experts"] + fused_shared):
            if weight_name in name:
                mapped = name.replace(weight_name, param_name)
                if mapped in params:
                    return mapped
                break  # SGLang replaces the name in place and moves on to the next mapping with it
        if config.get("q_lora_rank") is not None and ("q_a_proj" in name or "kv_a_proj_with_mqa" in name):
            # loaded only once both halves have arrived (the test checks the pairs)
            if "q_a_proj" in name:
                return name.replace("q_a_proj", "fused_qkv_a_proj_with_mqa")
            return name.replace("kv_a_proj_with_mqa", "fused_qkv_a_proj_with_mqa")
        return name if name in params else None


@pytest.fixture(scope="module")
def sglang_deepseek(sglang_release_source, deepseek_v2, weight_loader) -> SGLangDeepseek:
    return SGLangDeepseek(sglang_release_source, deepseek_v2, weight_loader)


def _checkpoint_keys(folder: Path) -> list[str]:
    from safetensors import safe_open

    keys = []
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            keys += list(st.keys())
    return keys


@pytest.mark.parametrize("fused_shared", [0, 1], ids=["shared-experts-apart", "shared-experts-fused"])
def test_tiny_weights_load_into_every_sglang_parameter(tiny_model, sglang_deepseek, fused_shared):
    """Each tensor of the tiny checkpoint lands in a parameter SGLang builds, and each parameter gets a tensor.
    A tensor SGLang cannot place is dropped with a warning and its parameter keeps uninitialised memory, so a
    wrong name shows up on a GPU only as a capture that disagrees with transformers."""
    config = json.loads((tiny_model / "config.json").read_text())
    params = sglang_deepseek.parameters(config, fused_shared)
    keys = _checkpoint_keys(tiny_model)
    placed = {k: sglang_deepseek.target(k, config, params, fused_shared) for k in keys}
    dropped = sorted(k for k, p in placed.items() if p is None)
    assert not dropped, f"SGLang's loader drops these tensors of the tiny checkpoint: {dropped[:10]}"
    unknown = sorted({p for p in placed.values() if p not in params})
    assert not unknown, f"the loader would look these up and fail (KeyError): {unknown[:10]}"
    halves: dict[str, set[str]] = {}
    for k, p in placed.items():
        if p.endswith("fused_qkv_a_proj_with_mqa.weight"):
            halves.setdefault(p, set()).add(k.rsplit(".", 2)[1])
    unpaired = {p: h for p, h in halves.items() if h != {"q_a_proj", "kv_a_proj_with_mqa"}}
    assert not unpaired, f"the fused q/kv-a projection is loaded only from both halves: {unpaired}"
    unfilled = sorted(params - set(placed.values()))
    assert not unfilled, f"these SGLang parameters get no tensor from the tiny checkpoint: {unfilled[:10]}"
    # per-expert names, as SGLang's expert mapping reads them (and as a real DeepSeek/Kimi checkpoint has them)
    assert (
        "model.layers.1.mlp.experts.7.up_proj.weight" in keys
        and "model.layers.1.mlp.gate.e_score_correction_bias" in keys
    )


def test_loader_reading_catches_a_fused_checkpoint_and_a_missing_bias(tiny_model, sglang_deepseek):
    """The reading is not vacuous: a tensor under a name no rule knows is dropped; the gate bias is a parameter
    only under topk_method noaux_tc, so a config that says otherwise leaves the checkpoint's bias unplaced."""
    config = json.loads((tiny_model / "config.json").read_text())
    params = sglang_deepseek.parameters(config, 0)
    assert sglang_deepseek.target("model.layers.1.mlp.experts.3.gate.weight", config, params, 0) is None
    assert (
        sglang_deepseek.target("model.layers.1.mlp.experts.gate_up_proj", config, params, 0)
        == "model.layers.1.mlp.experts.w13_weight"
    )
    greedy = dict(config, topk_method="greedy")
    assert (
        sglang_deepseek.target(
            "model.layers.1.mlp.gate.e_score_correction_bias", greedy, sglang_deepseek.parameters(greedy, 0), 0
        )
        is None
    )


def test_per_expert_tensors_match_transformers_own_layout(tiny_model):
    """`per_expert_tensors` splits transformers 5's fused experts (held so in memory) into the names and values
    transformers' own save writes (the DeepSeek checkpoint layout): gate rows first, then up."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from eagle3_assets.operations.gpu_check import FUSED_EXPERTS, per_expert_tensors

    in_memory = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16).state_dict()
    assert any(FUSED_EXPERTS.match(k) for k in in_memory), "transformers no longer fuses experts in memory"
    saved = load_file(str(tiny_model / "model.safetensors"))
    split = per_expert_tensors(in_memory)
    assert set(split) == set(saved)
    assert all(torch.equal(split[k], saved[k]) for k in saved)


# ---------------------------------------------------------------- eagle3 gpu-check as the first command on a host


# the disk probe writes 1 MiB (0.1 s a call; 16 MiB took 0.4 s): the disk-write test asks for 16 itself
GPU_CHECK_ARGS = ("gpu-check", "--no-capture", "--disk-mib", "1")


def _report(code: int, stdout: str, json_out: bool) -> tuple[int, dict | str]:
    if not json_out:
        return code, stdout
    report = json.loads(stdout)
    assert report["exit_code"] == code
    return code, {c["name"]: c for c in report["checks"]}


def gpu_check(*args: str, env: dict | None = None, json_out: bool = True, unset: tuple[str, ...] = ()):
    """`eagle3 gpu-check --no-capture ARGS` through `main(argv)`, the function the `eagle3` script calls, in this
    process: (exit code, rows by name or the screen). `env` is added to the environment for the call, without the
    variables in `unset`, and undone after. The rows read the environment when they run (os.environ; PATH when
    they look for and run nvidia-smi, nvcc and c++; sys.path for pip's nvcc), so this is what the command sees;
    a process per call cost ~10 s of torch and Dagster imports. The process boundary (the screen, exit codes 0
    and 1, --json) is tested once each by `gpu_check_process`."""
    from eagle3_assets.operations.cli import main

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        for name in unset:
            mp.delenv(name, raising=False)
        for name, value in (env or {}).items():
            mp.setenv(name, value)
        if env and env.get("PYTHONPATH"):  # where a new interpreter would have put it: first on sys.path
            mp.setattr(sys, "path", [*env["PYTHONPATH"].split(os.pathsep), *sys.path])
        with contextlib.redirect_stdout(out):
            code = main([*GPU_CHECK_ARGS, *args, *(["--json"] if json_out else [])])
    assert code in (0, 1), out.getvalue()[-3000:]
    return _report(code, out.getvalue(), json_out)


def gpu_check_process(*args: str, env: dict | None = None, json_out: bool = True):
    """The same command as a user runs it: `python -m eagle3_assets.operations.cli`, its own process."""
    cmd = [sys.executable, "-m", "eagle3_assets.operations.cli", *GPU_CHECK_ARGS, *args]
    proc = subprocess.run(
        cmd + (["--json"] if json_out else []),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return _report(proc.returncode, proc.stdout, json_out)


def install_command() -> str:
    from eagle3_resources.hidden_states import sglang_api

    return sglang_api.INSTALL_HINT.split("  (")[0]


HAVE_GPU = shutil.which("nvidia-smi") is not None


@pytest.mark.slow
@pytest.mark.skipif(HAVE_GPU, reason="the screen of a host without a GPU")
def test_cpu_host_screen_says_no_gpu_and_how_to_install(tmp_path):
    code, screen = gpu_check_process("--data-dir", str(tmp_path), json_out=False)
    assert code == 0, screen  # nothing was asked for that a CPU host cannot do
    assert "no GPU on this host" in screen
    fixes = screen.split("to fix:")[1]
    assert f"sglang: {install_command()}" in fixes
    assert "nvidia driver: install the NVIDIA driver >= 580.65.06" in fixes
    assert len(screen.splitlines()) < 40  # one screen
    code, rows = gpu_check("--data-dir", str(tmp_path), "--tp", "2")
    assert code == 1 and rows["gpus"]["status"] == "unavailable" and rows["gpus"]["required"]
    assert rows["torch/cuda"]["fix"].endswith(install_command())


def test_disk_space_against_the_planned_capture(tmp_path):
    from eagle3_resources.hidden_states.store import token_bytes

    free = shutil.disk_usage(tmp_path).free
    too_many = 2 * free // token_bytes(7168)
    code, rows = gpu_check("--data-dir", str(tmp_path), "--tokens", str(too_many))
    row = rows["disk space"]
    assert code == 1 and row["status"] == "fail", row
    fits = row["data"]["fits_tokens"]
    assert 0 < fits < too_many / 2
    assert f'"max_tokens": {fits}' in row["fix"] and "export EAGLE3_DATA_DIR=" in row["fix"]
    # the merged dataset's tokens are the plan when --tokens is not given
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "merged_dataset").mkdir()
    pq.write_table(
        pa.table({"sample_id": ["a", "b"], "n_tokens": [1000, 234]}), tmp_path / "merged_dataset" / "merged.parquet"
    )
    code, rows = gpu_check("--data-dir", str(tmp_path))
    assert rows["disk space"]["status"] == "ok" and rows["disk space"]["data"]["tokens"] == 1234, rows["disk space"]
    assert code == 0


def test_disk_write_measured_on_the_data_root(tmp_path):
    code, rows = gpu_check("--data-dir", str(tmp_path), "--tokens", "1000", "--disk-mib", "16")
    row = rows["disk write"]
    assert row["status"] == "ok" and row["data"]["bytes"] == 16 * 2**20 and row["data"]["gb_per_s"] > 0, row
    from eagle3_resources.hidden_states.extract import StoreSettings
    from eagle3_resources.hidden_states.store import CHECKSUM

    assert (row["data"]["writers"], row["data"]["checksum"]) == (StoreSettings.writers, CHECKSUM), row  # as the store
    assert list(tmp_path.iterdir()) == []  # the measurement's files are gone
    code, rows = gpu_check("--data-dir", str(tmp_path), "--tokens", "1000", "--min-disk-gbps", "1e9")
    assert code == 1 and rows["disk write"]["status"] == "fail" and "EAGLE3_DATA_DIR=" in rows["disk write"]["fix"]
    missing = tmp_path / "not-yet"
    code, rows = gpu_check("--data-dir", str(missing), "--tokens", "1000")
    assert (
        code == 1
        and rows["disk write"]["status"] == "fail"
        and rows["disk write"]["fix"].startswith(f"mkdir -p {missing}")
    )


def test_shm_against_the_rank_hand_off(tmp_path):
    """The SGLang backend reserves its hand-off ring in /dev/shm: slabs x (a forward's rows, 3 aux + 1 final,
    bf16, at Kimi's hidden 7168, plus int64 token ids and page alignment)."""
    size = os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize
    row_bytes = (3 + 1) * 7168 * 2
    too_big = size // (2 * row_bytes) + 1  # two slabs of this many rows cannot fit, whatever the ids and alignment
    fits = (size - 2 * 3 * 4096) // (2 * (row_bytes + 8))  # two slabs fit even with ids and three pages of alignment
    code, rows = gpu_check("--data-dir", str(tmp_path), "--max-forward-tokens", str(too_big))
    assert rows["/dev/shm"]["status"] == "warn" and not rows["/dev/shm"]["required"], rows["/dev/shm"]  # not asked
    code, rows = gpu_check("--data-dir", str(tmp_path), "--max-forward-tokens", str(too_big), "--tp", "1")
    row = rows["/dev/shm"]
    assert code == 1 and row["status"] == "fail" and row["required"], row
    gib = -(-row["data"]["needed_bytes"] // 2**30)
    assert f"sudo mount -o remount,size={gib}G /dev/shm" in row["fix"] and f"--shm-size={gib}g" in row["fix"]
    assert "EAGLE3_SGLANG_MAX_FORWARD_TOKENS" in row["fix"]
    code, rows = gpu_check("--data-dir", str(tmp_path), "--max-forward-tokens", str(fits), "--tp", "1")
    assert rows["/dev/shm"]["status"] == "ok", rows["/dev/shm"]
    code, rows = gpu_check(
        "--data-dir", str(tmp_path), "--max-forward-tokens", str(fits), "--handoff-slabs", "3", "--tp", "1"
    )
    assert rows["/dev/shm"]["status"] == "fail", rows["/dev/shm"]  # a third slab of the same size does not fit


@pytest.mark.skipif(HAVE_GPU, reason="puts a stand-in nvidia-smi first on PATH")
@pytest.mark.parametrize(
    "driver,status", [("535.104.05", "fail"), ("580.65.05", "fail"), ("580.65.06", "ok"), ("590.44.01", "ok")]
)
def test_driver_against_cuda13_minimum(tmp_path, driver, status):
    """nvidia-smi is what gpu-check asks; a stand-in on PATH reports the driver an older host would have."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho {driver}\n")
    smi.chmod(0o755)
    code, rows = gpu_check("--data-dir", str(tmp_path), "--tp", "1", env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
    row = rows["nvidia driver"]
    assert row["status"] == status and row["data"]["driver"] == driver, row
    assert ("sudo apt-get install -y nvidia-driver-580" in row["fix"]) is (status == "fail")


# ---------------------------------------------------------------- the CUDA toolchain SGLang's JIT builds need

TOOLCHAIN_VARS = ("CUDA_HOME", "CUDA_PATH", "CXX", "PYTHONPATH")


def stand_in(folder: Path, name: str, script: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    exe = folder / name
    exe.write_text("#!/bin/sh\n" + script)
    exe.chmod(0o755)
    return exe


def stand_in_nvcc(folder: Path, release: str) -> Path:
    """`nvcc --version` as CUDA's nvcc prints it."""
    return stand_in(
        folder,
        "nvcc",
        'echo "nvcc: NVIDIA (R) Cuda compiler driver"\n'
        f'echo "Cuda compilation tools, release {release}, V{release}.88"\n',
    )


def torch_cuda() -> str:
    """The CUDA an nvcc is held against: torch's, or sglang's torch's (13.0) on a CPU build."""
    import torch

    from eagle3_assets.operations.gpu_check import SGLANG_TORCH_CUDA

    return torch.version.cuda or SGLANG_TORCH_CUDA


def toolchain(tmp_path: Path, env: dict, *args: str) -> tuple[int, dict]:
    """gpu-check's rows with PATH, CUDA_HOME, CXX and PYTHONPATH as `env` sets them (none from this host)."""
    code, rows = gpu_check("--data-dir", str(tmp_path), *args, env=env, unset=TOOLCHAIN_VARS)
    return code, rows["cuda toolchain"]


def test_toolchain_finds_nvcc_under_cuda_home_and_flags_the_venv_one(tmp_path):
    """SGLang and FlashInfer take nvcc from $CUDA_HOME/bin alone when CUDA_HOME is set; pip's nvcc inside the
    venv (site-packages/nvidia/cu13/bin) is where neither looks, and the row says so."""
    bin_dir, home, site = tmp_path / "bin", tmp_path / "cuda", tmp_path / "site"
    stand_in(bin_dir, "c++", "exit 0\n")
    home.mkdir()
    wheel_nvcc = stand_in_nvcc(site / "nvidia" / "cu13" / "bin", torch_cuda())
    env = {"PATH": str(bin_dir), "CUDA_HOME": str(home), "PYTHONPATH": str(site)}
    code, row = toolchain(tmp_path, env, "--tp", "1")
    assert code == 1 and row["status"] == "unavailable" and row["required"], row
    assert f"{home}/bin/nvcc, via $CUDA_HOME" in row["detail"], row
    assert f"only pip's, inside the venv: {wheel_nvcc}" in row["detail"] and row["data"]["wheel_nvcc"] == [
        str(wheel_nvcc)
    ]
    from eagle3_assets.operations.gpu_check import CUDA_TOOLKIT_FIX

    # nothing else on PATH: the fix is the toolkit, or /usr/local/cuda where this host has one there
    usr_local = Path("/usr/local/cuda/bin/nvcc")
    expected = "export CUDA_HOME=/usr/local/cuda" if os.access(usr_local, os.X_OK) else CUDA_TOOLKIT_FIX
    assert row["fix"] == expected, row
    stand_in_nvcc(home / "bin", torch_cuda())
    code, row = toolchain(tmp_path, env, "--tp", "1")
    assert row["status"] == "ok", row
    assert (row["data"]["nvcc"], row["data"]["nvcc_via"]) == (str(home / "bin" / "nvcc"), "$CUDA_HOME"), row
    assert row["data"]["nvcc_version"] == torch_cuda() and "majors match" in row["detail"] and not row["fix"], row
    # CUDA_HOME pointed into the wheel (untried with SGLang): found, and named as pip's
    code, row = toolchain(tmp_path, {**env, "CUDA_HOME": str(site / "nvidia" / "cu13")}, "--tp", "1")
    assert row["data"]["nvcc"] == str(wheel_nvcc) and "(pip's nvidia wheel, without lib64/stubs)" in row["detail"]


def test_toolchain_cuda_home_without_nvcc_hides_the_one_on_path(tmp_path):
    """A CUDA_HOME with no bin/nvcc is not fallen back from: the fix points CUDA_HOME at the nvcc on PATH."""
    bin_dir, toolkit = tmp_path / "bin", tmp_path / "cuda-13"
    stand_in(bin_dir, "c++", "exit 0\n")
    stand_in_nvcc(toolkit / "bin", torch_cuda())
    env = {"PATH": f"{toolkit / 'bin'}:{bin_dir}"}
    code, row = toolchain(tmp_path, env, "--tp", "1")
    assert row["status"] == "ok" and row["data"]["nvcc_via"] == "PATH", row  # found on PATH when CUDA_HOME is unset
    code, row = toolchain(tmp_path, {**env, "CUDA_HOME": str(tmp_path / "empty")}, "--tp", "1")
    assert row["status"] == "unavailable" and row["fix"] == f"export CUDA_HOME={toolkit}", row
    code, row = toolchain(tmp_path, {**env, "CUDA_HOME": str(toolkit)}, "--tp", "1")
    assert row["status"] == "ok" and row["data"]["nvcc_via"] == "$CUDA_HOME", row


def test_toolchain_nvcc_major_against_torch_cuda(tmp_path):
    bin_dir, home = tmp_path / "bin", tmp_path / "cuda"
    stand_in(bin_dir, "c++", "exit 0\n")
    major = int(torch_cuda().split(".")[0])
    stand_in_nvcc(home / "bin", f"{major - 1}.8")
    env = {"PATH": str(bin_dir), "CUDA_HOME": str(home)}
    code, row = toolchain(tmp_path, env, "--tp", "1")
    assert code == 1 and row["status"] == "fail" and "majors differ" in row["detail"], row
    assert "sudo apt-get install -y cuda-nvcc-13-0 cuda-cudart-dev-13-0" in row["fix"], row
    assert "nvidia/cuda:13.0.1-cudnn-devel-ubuntu24.04" in row["fix"], row
    code, row = toolchain(tmp_path, env)  # not asked for: a warning, and the command passes
    assert code == 0 and row["status"] == "warn" and not row["required"], row
    stand_in_nvcc(home / "bin", f"{major}.9")  # a newer minor of the same major is fine
    code, row = toolchain(tmp_path, env, "--tp", "1")
    assert row["status"] == "ok" and row["data"]["nvcc_version"] == f"{major}.9", row


def test_toolchain_needs_a_cxx_compiler(tmp_path):
    """nvcc hands host code to $CXX, else `c++` (SGLang's toolchain.py): gcc alone is not enough."""
    bin_dir, home = tmp_path / "bin", tmp_path / "cuda"
    stand_in_nvcc(home / "bin", torch_cuda())
    stand_in(bin_dir, "gcc", "exit 0\n")
    env = {"PATH": str(bin_dir), "CUDA_HOME": str(home)}
    code, row = toolchain(tmp_path, env, "--tp", "1")
    assert code == 1 and row["status"] == "fail" and row["fix"] == "sudo apt-get install -y g++", row
    gxx = stand_in(bin_dir, "g++", "exit 0\n")
    code, row = toolchain(tmp_path, env, "--tp", "1")
    assert row["status"] == "fail" and row["fix"] == f"export CXX={gxx}", row  # g++ without the c++ name
    code, row = toolchain(tmp_path, {**env, "CXX": str(gxx)}, "--tp", "1")
    assert row["status"] == "ok" and row["data"]["cxx"] == str(gxx) and row["data"]["cxx_via"] == "$CXX", row
    code, row = toolchain(tmp_path, {**env, "CXX": "clang++"}, "--tp", "1")
    assert row["status"] == "fail" and "$CXX=clang++ not found" in row["detail"], row
    cxx = stand_in(bin_dir, "c++", "exit 0\n")
    code, row = toolchain(tmp_path, env, "--tp", "1")
    assert row["status"] == "ok" and row["data"]["cxx"] == str(cxx), row


def test_find_nvcc_falls_back_to_usr_local_cuda(tmp_path):
    """The last place looked (/usr/local/cuda on a host), tested on a stand-in root."""
    from eagle3_assets.operations.gpu_check import find_nvcc

    root = tmp_path / "usr-local-cuda"
    lookup = find_nvcc({"PATH": str(tmp_path / "bin")}, default_home=root)
    assert (lookup.path, lookup.via) == (None, str(root))
    nvcc = stand_in_nvcc(root / "bin", "13.0")
    assert find_nvcc({"PATH": str(tmp_path / "bin")}, default_home=root).path == str(nvcc)
    # CUDA_PATH when CUDA_HOME is unset, as SGLang reads them
    other = stand_in_nvcc(tmp_path / "other" / "bin", "13.0")
    lookup = find_nvcc({"PATH": "", "CUDA_PATH": str(tmp_path / "other")}, default_home=root)
    assert (lookup.path, lookup.via) == (str(other), "$CUDA_PATH")


# ---------------------------------------------------------------- every host row failing, from outside


@pytest.mark.slow
@pytest.mark.skipif(HAVE_GPU, reason="puts a stand-in nvidia-smi first on PATH")
def test_every_host_row_fails_from_the_command_line(tmp_path):
    """One `eagle3 gpu-check --json` process on a host that fails every host row at once, each through what the
    command reads from outside: an nvidia-smi reporting a pre-CUDA-13 driver and 8 x H100, an nvcc one major
    behind under CUDA_HOME, Kimi-K2.5's index, /dev/shm and the disk against the flags. The tests below drive
    each row's cases through the same entry point in this process."""
    bin_dir, home = tmp_path / "bin", tmp_path / "cuda"
    lines = "".join('echo "NVIDIA H100 80GB HBM3, 81559"\n' for _ in range(8))
    stand_in(bin_dir, "nvidia-smi", f'case "$*" in\n*memory.total*)\n{lines};;\n*) echo 535.104.05;;\nesac\n')
    stand_in(bin_dir, "c++", "exit 0\n")
    stand_in_nvcc(home / "bin", f"{int(torch_cuda().split('.')[0]) - 1}.8")
    kimi = target_folder(tmp_path / "Kimi-K2.5", 594 * 10**9, KIMI_CONFIG)
    data = tmp_path / "data"
    data.mkdir()
    from eagle3_resources.hidden_states.store import token_bytes

    shm = os.statvfs("/dev/shm")
    too_big = shm.f_blocks * shm.f_frsize // (2 * (3 + 1) * 7168 * 2) + 1  # as in the /dev/shm test
    too_many = 2 * shutil.disk_usage(data).free // token_bytes(7168)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "CUDA_HOME": str(home)}
    flags = ["--data-dir", str(data), "--model", str(kimi), "--tp", "8", "--tokens", str(too_many)]
    flags += ["--max-forward-tokens", str(too_big), "--min-disk-gbps", "1e9"]
    code, rows = gpu_check_process(*flags, env=env)
    assert code == 1
    failing = ("nvidia driver", "cuda toolchain", "gpu memory", "/dev/shm", "disk write", "disk space")
    assert {n: (rows[n]["status"], rows[n]["required"]) for n in failing} == dict.fromkeys(failing, ("fail", True))
    assert rows["nvidia driver"]["data"]["driver"] == "535.104.05"
    assert "sudo apt-get install -y nvidia-driver-580" in rows["nvidia driver"]["fix"]
    assert "majors differ" in rows["cuda toolchain"]["detail"] and rows["cuda toolchain"]["data"]["nvcc_via"] == (
        "$CUDA_HOME"
    )
    assert "NVIDIA H100 80GB HBM3 79.6 GiB x sglang_mem_fraction 0.8" in rows["gpu memory"]["detail"]
    assert "63.7 GiB: does not fit" in rows["gpu memory"]["detail"]
    assert "/dev/shm" in rows["/dev/shm"]["fix"] and "--shm-size=" in rows["/dev/shm"]["fix"]
    assert "EAGLE3_DATA_DIR=" in rows["disk write"]["fix"]
    assert 0 < rows["disk space"]["data"]["fits_tokens"] < too_many / 2
    assert list(data.iterdir()) == []  # the disk probe's files are gone


# ---------------------------------------------------------------- the target's weights against GPU memory

GIB = 2**30
H100, H200, B200 = 81559 * 2**20, 143771 * 2**20, 183359 * 2**20
KIMI_CONFIG = {
    "model_type": "kimi_k25",
    "text_config": {
        "num_hidden_layers": 61,
        "hidden_size": 7168,
        "num_attention_heads": 64,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
    },
}


def test_memory_fit_kimi_on_h100_h200_b200():
    """Kimi-K2.5 at TP 8, sglang_mem_fraction 0.8: 69.2 GiB of weights and a 2.1 GiB KV pool a GPU; an H100's
    63.7 GiB does not hold them, and no fraction that leaves SGLang its 10 GiB does; H200 and B200 do."""
    from eagle3_assets.operations.gpu_check import (
        KIMI_K25_KV,
        KIMI_K25_WEIGHT_BYTES,
        fitting_kinds,
        memory_fit,
        smallest_tp,
    )

    pool = 32768 * KIMI_K25_KV.bytes_per_token(8)
    assert pool == 32768 * 61 * 576 * 2
    h100 = memory_fit(KIMI_K25_WEIGHT_BYTES, 8, 0.8, H100, pool)
    assert round(h100.weights_per_gpu / GIB, 1) == 69.2 and round(h100.budget / GIB, 1) == 63.7
    assert not h100.fits and h100.fraction_needed == 0.90 and h100.fraction_max == 0.87
    assert h100.fraction_to_set is None
    for gpu in (H200, B200):
        fit = memory_fit(KIMI_K25_WEIGHT_BYTES, 8, 0.8, gpu, pool)
        assert fit.fits and fit.fraction_to_set == 0.8
    assert [(k.name, f) for k, f in fitting_kinds(KIMI_K25_WEIGHT_BYTES, 8, 0.8, pool)] == [
        ("H200 141GB", 0.8),
        ("B200 180GB", 0.8),
    ]
    assert smallest_tp(KIMI_K25_WEIGHT_BYTES, 0.8, H100, KIMI_K25_KV, 32768) is None  # no TP <= 8 on H100
    on_h200 = smallest_tp(KIMI_K25_WEIGHT_BYTES, 0.8, H200, KIMI_K25_KV, 32768)
    assert on_h200 is not None and on_h200.tp == 8


def test_memory_fit_raises_the_fraction_or_the_tp():
    from eagle3_assets.operations.gpu_check import KvShape, memory_fit, smallest_tp

    # 130 GiB of bf16 weights at TP 2 on H100: 65 GiB + 1 GiB of pool needs 0.83, within the 0.87 cap
    fit = memory_fit(130 * GIB, 2, 0.8, H100, GIB)
    assert not fit.fits and fit.fraction_needed == 0.83 and fit.fraction_to_set == 0.83
    assert memory_fit(130 * GIB, 2, 0.83, H100, GIB).fits
    # a GQA cache is split over the ranks (8 KV heads: one a rank from TP 8 on)
    llama_70b = {"num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8}
    kv = KvShape.of_config(llama_70b)
    assert (kv.layers, kv.width, kv.heads) == (80, 256, 8)
    assert kv.bytes_per_token(1) == 80 * 256 * 8 * 2 and kv.bytes_per_token(16) == 80 * 256 * 1 * 2
    bigger = smallest_tp(300 * GIB, 0.8, H100, kv, 4096)
    assert bigger is not None and bigger.tp == 8 and bigger.fits  # 37.5 GiB + pool fits at TP 8, not at TP 4
    assert KvShape.of_config(KIMI_CONFIG) == KvShape(61, 576)


def test_weight_bytes_from_the_index_or_the_headers(tmp_path):
    import torch
    from safetensors.torch import save_file

    from eagle3_assets.operations.gpu_check import TargetSize, safetensors_bytes, target_size

    tensors = {"a": torch.zeros(3, 5, dtype=torch.bfloat16), "b": torch.zeros(7, dtype=torch.float32)}
    save_file(tensors, str(tmp_path / "model-00001.safetensors"))
    save_file({"c": torch.zeros(11, dtype=torch.int32)}, str(tmp_path / "model-00002.safetensors"))
    assert safetensors_bytes(tmp_path) == (3 * 5 * 2 + 7 * 4 + 11 * 4, "2 safetensors header(s)")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 12345}}))
    assert safetensors_bytes(tmp_path) == (12345, "model.safetensors.index.json total_size")
    assert safetensors_bytes(tmp_path / "nothing") is None
    (tmp_path / "config.json").write_text(json.dumps(KIMI_CONFIG))
    target = target_size(str(tmp_path))
    assert isinstance(target, TargetSize) and target.weight_bytes == 12345 and target.kv is not None
    # Kimi's hub id where no folder is: its known figures
    assert target_size("/somewhere/moonshotai/Kimi-K2.5").name == "Kimi-K2.5"  # type: ignore[union-attr]
    assert isinstance(target_size(str(tmp_path / "missing")), str)


def stand_in_smi(bin_dir: Path, name: str, mib: int, gpus: int = 8) -> None:
    """nvidia-smi answering the driver query and the memory query as a host with `gpus` of these GPUs would."""
    lines = "".join(f'echo "{name}, {mib}"\n' for _ in range(gpus))
    stand_in(bin_dir, "nvidia-smi", f'case "$*" in\n*memory.total*)\n{lines};;\n*) echo 580.95.05;;\nesac\n')


def target_folder(path: Path, total_size: int, config: dict) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    index = {"metadata": {"total_size": total_size}, "weight_map": {}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


@pytest.mark.skipif(HAVE_GPU, reason="puts a stand-in nvidia-smi first on PATH")
def test_memory_row_kimi_on_h100_then_h200(tmp_path):
    """--model asks for the row: Kimi-K2.5's checkpoint (its index's total_size) on 8 x H100 fails and names the
    GPUs that hold it; the same command on 8 x H200 passes the row."""
    kimi = target_folder(tmp_path / "Kimi-K2.5", 594 * 10**9, KIMI_CONFIG)
    bin_dir = tmp_path / "bin"
    stand_in_smi(bin_dir, "NVIDIA H100 80GB HBM3", 81559)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    code, rows = gpu_check("--data-dir", str(tmp_path), "--model", str(kimi), env=env)
    row = rows["gpu memory"]
    assert code == 1 and row["status"] == "fail" and row["required"], row
    assert row["data"]["weights_from"] == "model.safetensors.index.json total_size" and row["data"]["tp"] == 8
    assert "69.2 GiB weights + 2.1 GiB KV pool" in row["detail"] and "63.7 GiB: does not fit" in row["detail"], row
    assert "needs sglang_mem_fraction 0.90, above the 0.87" in row["detail"], row
    assert row["fix"] == (
        "8 x NVIDIA H100 80GB HBM3 is too small for Kimi-K2.5 (--model): "
        "run it on 8 x H200 141GB or 8 x B200 180GB at sglang_mem_fraction 0.8"
    ), row
    stand_in_smi(bin_dir, "NVIDIA H200", 143771)
    code, rows = gpu_check("--data-dir", str(tmp_path), "--model", str(kimi), env=env)
    row = rows["gpu memory"]
    assert row["status"] == "ok" and row["data"]["fits"] and not row["fix"], row


@pytest.mark.skipif(HAVE_GPU, reason="puts a stand-in nvidia-smi first on PATH")
def test_memory_row_plans_kimi_without_a_folder(tmp_path):
    """No --model and no EAGLE3_TARGET_DIR: Kimi-K2.5's known size at EAGLE3_SGLANG_TP_SIZE (else 8); not asked
    for, so a shortfall warns. Without nvidia-smi the row still says which nodes hold it."""
    code, rows = gpu_check("--data-dir", str(tmp_path), unset=("EAGLE3_TARGET_DIR", "EAGLE3_SGLANG_TP_SIZE"))
    row = rows["gpu memory"]
    assert code == 0 and row["status"] == "unavailable" and not row["required"], row
    assert "fits 8 x H200 141GB or 8 x B200 180GB at sglang_mem_fraction 0.8; not 8 x H100 80GB" in row["detail"]
    bin_dir = tmp_path / "bin"
    stand_in_smi(bin_dir, "NVIDIA H100 80GB HBM3", 81559)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    code, rows = gpu_check("--data-dir", str(tmp_path), env=env, unset=("EAGLE3_TARGET_DIR", "EAGLE3_SGLANG_TP_SIZE"))
    row = rows["gpu memory"]
    assert code == 0 and row["status"] == "warn" and row["data"]["target"] == "Kimi-K2.5", row
    assert "8 x H200 141GB or 8 x B200 180GB" in row["fix"], row
    stand_in_smi(bin_dir, "NVIDIA B200", 183359)
    code, rows = gpu_check("--data-dir", str(tmp_path), env=env, unset=("EAGLE3_TARGET_DIR", "EAGLE3_SGLANG_TP_SIZE"))
    assert rows["gpu memory"]["status"] == "ok", rows["gpu memory"]


@pytest.mark.skipif(HAVE_GPU, reason="puts a stand-in nvidia-smi first on PATH")
def test_memory_row_fix_is_the_fraction_or_the_tp_to_set(tmp_path):
    """A target that fits an H100 with a higher sglang_mem_fraction is told the fraction, and passes once it is
    set; one that needs more GPUs is told the TP. Its size here is summed from the safetensors headers."""
    import torch
    from safetensors.torch import save_file

    folder = tmp_path / "dense"
    folder.mkdir()
    config = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4}
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"w": torch.zeros(2**20, dtype=torch.uint8)}, str(folder / "model.safetensors"))  # 1 MiB
    bin_dir = tmp_path / "bin"
    stand_in_smi(bin_dir, "Small GPU", 14)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "EAGLE3_SGLANG_MAX_FORWARD_TOKENS": "4096"}
    # a forward's KV pool: 4096 tokens x 2 layers x (2 x 16) x 4 heads x 2 B = 2 MiB at TP 1: 3 MiB of 0.8 x 14 fit
    code, rows = gpu_check("--data-dir", str(tmp_path), "--model", str(folder), "--tp", "1", env=env)
    row = rows["gpu memory"]
    assert row["status"] == "ok" and row["data"]["weights_from"] == "1 safetensors header(s)", row
    assert row["data"]["weight_bytes"] == 2**20 and row["data"]["kv_pool_bytes"] == 2 * 2**20, row
    # 30 MiB of weights on 32 MiB GPUs: too much for TP 1 at any fraction, TP 2 fits at 0.8 (SGLang's 10 GiB
    # reserve is larger than these GPUs, so a raised fraction is never offered here)
    save_file({"w": torch.zeros(30 * 2**20, dtype=torch.uint8)}, str(folder / "model.safetensors"))
    stand_in_smi(bin_dir, "Small GPU", 32)
    code, rows = gpu_check("--data-dir", str(tmp_path), "--model", str(folder), "--tp", "1", env=env)
    row = rows["gpu memory"]
    assert code == 1 and row["status"] == "fail", row
    assert row["fix"].startswith("TP 2: export EAGLE3_SGLANG_TP_SIZE=2"), row
    code, rows = gpu_check("--data-dir", str(tmp_path), "--model", str(folder), "--tp", "2", env=env)
    assert rows["gpu memory"]["status"] == "ok", rows["gpu memory"]
    # H100s and a 130 GiB index at TP 2: the fraction to set, then the same command with it set
    big = target_folder(tmp_path / "big", 130 * GIB, config)
    stand_in_smi(bin_dir, "NVIDIA H100 80GB HBM3", 81559)
    code, rows = gpu_check("--data-dir", str(tmp_path), "--model", str(big), "--tp", "2", env=env)
    row = rows["gpu memory"]
    assert row["status"] == "fail" and row["fix"].startswith("export EAGLE3_SGLANG_MEM_FRACTION=0.82 "), row
    env["EAGLE3_SGLANG_MEM_FRACTION"] = "0.82"
    code, rows = gpu_check("--data-dir", str(tmp_path), "--model", str(big), "--tp", "2", env=env)
    row = rows["gpu memory"]
    assert row["status"] == "ok" and row["data"]["mem_fraction"] == 0.82, row


def test_mem_fraction_is_a_resource_setting(monkeypatch):
    """EAGLE3_SGLANG_MEM_FRACTION, the fraction gpu-check plans with, is the one the pipeline's backend gets."""
    from eagle3_assets.definitions import hidden_states_resource
    from eagle3_assets.operations.gpu_check import planned_mem_fraction

    monkeypatch.delenv("EAGLE3_SGLANG_MEM_FRACTION", raising=False)
    assert hidden_states_resource().process_config_and_initialize().sglang_mem_fraction == 0.8
    assert planned_mem_fraction() == (0.8, "sglang_mem_fraction's default")
    monkeypatch.setenv("EAGLE3_SGLANG_MEM_FRACTION", "0.86")
    assert hidden_states_resource().process_config_and_initialize().sglang_mem_fraction == 0.86
    assert planned_mem_fraction() == (0.86, "EAGLE3_SGLANG_MEM_FRACTION")
