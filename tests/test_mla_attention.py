"""`mla.MLAAttention`, the attention of SGLang 0.5.23's Kimi-K2.x EAGLE-3 draft (`Eagle3DeepseekV2ForCausalLM`,
`models/kimi_k25_eagle3.py`), against the pinned release's own source, read with `ast` and never imported
(tests/sglang_source.py):

- layout: SGLang's constructors, run by a small interpreter on the draft's config (`Eagle3MLADecoderLayer.__init__`
  builds `DeepseekV2AttentionMLA` and replaces its fused down projection by one over the doubled input), give the
  layer's parameters and their shapes; the draft's own `load_weights` and `post_load_weights`, executed on plain
  tensors, take MLAAttention's state_dict as a checkpoint's `layers.0.self_attn.*` and must fill every parameter and
  drop nothing. At the CPU stand-in's shape and at Kimi-K2.5's (on the meta device).
- numbers: the softmax scale SGLang's constructor computes (`self.scaling`, through `compute_mla_mscale_scaling`),
  its rope style (`is_neox_style` from `rope_interleave`) and its rope tables (`DeepseekScalingRotaryEmbedding`'s
  inv_freq and cos/sin multiplier, with the YaRN helpers of `yarn.py`), for the same config;
- forward: a reference written here in SGLang's absorbed form (queries against the latent cache through w_kc, the
  output back through w_vc; both split by SGLang's own `post_load_weights`), dense with an explicit mask, on the
  weights SGLang's loader made of MLAAttention's, for 3 TTT steps over two packed documents.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import logging
import math
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from eagle3_assets.stages.eagle3_drafter.mla import (
    MLAAttention,
    MLAShape,
    YarnScaling,
    llama_kv_bytes_per_token,
    rope_inv_freq,
)
from eagle3_assets.stages.eagle3_drafter.model import DocLayout

SRT = "sglang/srt"
LINEARS = {"ReplicatedLinear", "ColumnParallelLinear", "RowParallelLinear"}  # (input_size, output_size, bias=True)
PARAMETER_FREE = {"RadixAttention"}  # the attention kernels: no parameters in an unquantized draft
ATTN = "model.midlayer.self_attn."  # where load_weights puts a checkpoint's layers.0.self_attn.*


class Unknown:
    """A value the interpreter did not compute (an SGLang helper it does not stand in for)."""


UNKNOWN = Unknown()


class SourceError(AssertionError):
    pass


class MissingKey(AttributeError):
    """config.<key> read without a default, absent from the config: an AttributeError in SGLang's model build."""


class Config(SimpleNamespace):
    def __getattr__(self, name: str) -> Any:  # only for attributes the config lacks (hasattr and getattr(.., default)
        raise MissingKey(name)  # catch it as SGLang would)


@dataclasses.dataclass
class Layer:
    """A layer SGLang builds, with its parameters' shapes (unquantized, TP 1: the checkpoint's)."""

    kind: str
    params: dict[str, tuple[int, ...]]


@dataclasses.dataclass
class Opaque:
    kind: str  # a class the interpreter does not build (the draft's MLP, the attention kernels)


def classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


def define(scope: ast.Module | ast.ClassDef, names: tuple[str, ...], namespace: dict[str, Any]) -> dict[str, Any]:
    """Execute SGLang's functions `names` (module functions, or methods as plain functions of `self`) into namespace;
    decorators and annotations dropped, so nothing but their bodies' own names is needed."""
    found = [n for n in scope.body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {n.name for n in found} == set(names), f"not in SGLang's source: {set(names) - {n.name for n in found}}"
    for node in found:
        fn = copy.deepcopy(node)
        fn.decorator_list, fn.returns = [], None
        for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs, fn.args.vararg, fn.args.kwarg]:
            if a is not None:
                a.annotation = None
        exec(compile(ast.fix_missing_locations(ast.Module([fn], [])), f"<sglang {fn.name}>", "exec"), namespace)
    return namespace


class Interpreter:
    """Runs constructors from SGLang's source on stand-in values: an assignment is evaluated by Python's `eval` on the
    names in scope (UNKNOWN when it calls a helper not stood in for), an `if` takes the branch its test selects, a
    `raise` reached fails, linear and RMSNorm layers record their parameter shapes, and the classes in `constructors`
    are built by running their own `__init__`. Other statements (calls like super().__init__()) are skipped."""

    def __init__(self, constructors: dict[str, ast.FunctionDef], names: dict[str, Any]):
        self.constructors, self.names = constructors, names

    def eval(self, node: ast.expr, scope: dict[str, Any]) -> Any:
        return eval(compile(ast.Expression(node), "<sglang>", "eval"), {**self.names, **scope})

    def value(self, node: ast.expr, scope: dict[str, Any]) -> Any:
        try:
            return self.construct(node, scope) if isinstance(node, ast.Call) else self.eval(node, scope)
        except (SourceError, MissingKey):
            raise
        except Exception:
            return UNKNOWN

    def construct(self, call: ast.Call, scope: dict[str, Any]) -> Any:
        name = call.func.id if isinstance(call.func, ast.Name) else ""
        if name in LINEARS:  # layers/linear.py; weight [sum(output sizes), input size] (quantization/unquant.py:557)
            size = dict(zip(("input_size", "output_size"), call.args, strict=False))
            size |= {k.arg: k.value for k in call.keywords if k.arg in ("input_size", "output_size")}
            n_in, n_out = (int(self.eval(size[k], scope)) for k in ("input_size", "output_size"))
            bias = next((self.eval(k.value, scope) for k in call.keywords if k.arg == "bias"), True)
            return Layer(name, {"weight": (n_out, n_in)} | ({"bias": (n_out,)} if bias else {}))
        if name == "RMSNorm":  # layers/layernorm.py:481: weight = torch.ones(hidden_size)
            return Layer(name, {"weight": (int(self.eval(call.args[0], scope)),)})
        if name in self.constructors:
            return self.instance(name, call, scope)
        if name[:1].isupper():
            return Opaque(name)
        return self.eval(call, scope)

    def instance(self, name: str, call: ast.Call, scope: dict[str, Any]) -> SimpleNamespace:
        fn = self.constructors[name]
        params = [a.arg for a in fn.args.args[1:]]
        bound: dict[str, Any] = {}
        for p, d in zip(params[len(params) - len(fn.args.defaults) :], fn.args.defaults, strict=True):
            bound[p] = self.eval(d, {})
        for a, kw_default in zip(fn.args.kwonlyargs, fn.args.kw_defaults, strict=True):
            if kw_default is not None:
                bound[a.arg] = self.eval(kw_default, {})
        for p, arg in zip(params, call.args, strict=False):
            bound[p] = self.value(arg, scope)
        for kw in call.keywords:
            if kw.arg is None:
                bound |= self.eval(kw.value, scope)
            else:
                bound[kw.arg] = self.value(kw.value, scope)
        me = SimpleNamespace(sglang_args=dict(bound))
        self.run(fn.body, {**bound, "self": me})
        return me

    def run(self, body: list[ast.stmt], scope: dict[str, Any]) -> None:
        for st in body:
            if isinstance(st, ast.If):
                try:
                    test = self.eval(st.test, scope)
                except MissingKey:
                    raise
                except Exception as e:
                    raise SourceError(f"cannot decide line {st.lineno}: `if {ast.unparse(st.test)}` ({e!r})") from e
                if isinstance(test, Unknown):
                    raise SourceError(f"line {st.lineno}: `if {ast.unparse(st.test)}` on a value not computed")
                self.run(st.body if test else st.orelse, scope)
            elif isinstance(st, ast.Raise):
                raise SourceError(f"SGLang raises on this config, line {st.lineno}: {ast.unparse(st)}")
            elif isinstance(st, ast.Assign | ast.AnnAssign) and st.value is not None:
                targets = st.targets if isinstance(st, ast.Assign) else [st.target]
                value = self.value(st.value, scope)
                for t in targets:
                    self.assign(t, value, scope)

    def assign(self, target: ast.expr, value: Any, scope: dict[str, Any]) -> None:
        if isinstance(target, ast.Name):
            scope[target.id] = value
        elif isinstance(target, ast.Attribute):
            owner = self.value(target.value, scope)
            if isinstance(owner, SimpleNamespace):
                setattr(owner, target.attr, value)
        elif isinstance(target, ast.Subscript):
            owner = self.value(target.value, scope)
            if isinstance(owner, dict):
                owner[self.eval(target.slice, scope)] = value


@dataclasses.dataclass
class Loaded:
    params: dict[str, torch.Tensor]  # SGLang's parameters after load_weights, by their full names
    filled: list[str]  # the parameters default_weight_loader wrote, in order
    warnings: list[str]  # what load_weights logged (an unexpected checkpoint tensor is skipped with a warning)
    w_kc: torch.Tensor  # post_load_weights' split of kv_b_proj: [heads, nope, kv_lora_rank]
    w_vc: torch.Tensor  # and [heads, kv_lora_rank, v_head_dim]


class SGLangMLADraft:
    """What SGLang 0.5.23 builds, computes and loads for the EAGLE-3 MLA draft's attention, read from its source."""

    def __init__(self, root: Path):
        def tree(rel: str) -> ast.Module:
            return ast.parse((root / SRT / rel).read_text())

        self.text = {
            rel: (root / SRT / rel).read_text()
            for rel in (
                "models/deepseek_common/attention_forward_methods/forward_mha.py",
                "mem_cache/memory_pool.py",
                "layers/rotary_embedding/base.py",
                "configs/model_config.py",
            )
        }
        self.eagle3 = classes(tree("models/kimi_k25_eagle3.py"))
        deepseek = classes(tree("models/deepseek_v2.py"))
        rope_variant = classes(tree("layers/rotary_embedding/rope_variant.py"))
        base = classes(tree("layers/rotary_embedding/base.py"))
        factory = tree("layers/rotary_embedding/factory.py")
        log = logging.getLogger("sglang-source")
        helpers = define(tree("configs/model_config.py"), ("yarn_get_mscale", "compute_mla_mscale_scaling"), {})
        helpers |= {"math": math, "logger": log}
        yarn = define(
            tree("layers/rotary_embedding/yarn.py"),
            ("yarn_find_correction_dim", "yarn_find_correction_range", "yarn_linear_ramp_mask", "yarn_get_mscale"),
            {"math": math, "torch": torch},
        )
        self.deepseek_inv_freq = define(rope_variant["DeepseekScalingRotaryEmbedding"], ("_compute_inv_freq",), yarn)[
            "_compute_inv_freq"
        ]
        self.plain_inv_freq = define(base["RotaryEmbedding"], ("_compute_inv_freq",), {"torch": torch})[
            "_compute_inv_freq"
        ]
        self.weight_loader = define(tree("model_loader/weight_utils.py"), ("default_weight_loader",), {})[
            "default_weight_loader"
        ]
        get_rope_wrapper = next(
            n for n in factory.body if isinstance(n, ast.FunctionDef) and n.name == "get_rope_wrapper"
        )
        wrapper_params = [a.arg for a in get_rope_wrapper.args.args]
        get_rope = next(n for n in factory.body if isinstance(n, ast.FunctionDef) and n.name == "get_rope")
        self.deepseek_yarn_branch = next(
            n
            for n in ast.walk(get_rope)
            if isinstance(n, ast.If)
            and isinstance(n.test, ast.Compare)
            and isinstance(n.test.comparators[0], ast.Constant)
            and n.test.comparators[0].value == "deepseek_yarn"
        )
        define(factory, ("_get_rope_param",), helpers)
        dsa = next(n for n in ast.walk(tree("configs/model_config.py")) if getattr(n, "name", "") == "is_deepseek_dsa")
        assert "Eagle3DeepseekV2ForCausalLM" not in ast.unparse(dsa)  # so is_deepseek_dsa(draft config) is False
        self.interpreter = Interpreter(
            {
                "DeepseekV2AttentionMLA": method(deepseek["DeepseekV2AttentionMLA"], "__init__"),
                "DeepseekScalingRotaryEmbedding": method(rope_variant["DeepseekScalingRotaryEmbedding"], "__init__"),
            },
            helpers
            | {
                "yarn_get_mscale": yarn["yarn_get_mscale"],
                "get_parallel": lambda: SimpleNamespace(attn_tp_size=1, attn_dcp_size=1),  # TP 1: whole tensors
                "is_deepseek_dsa": lambda config: False,
                # the rotary embedding's arguments, by get_rope_wrapper's own parameter names
                "get_rope_wrapper": lambda *a, **kw: dict(zip(wrapper_params, a, strict=False)) | kw,
                "get_device": lambda: SimpleNamespace(device="cuda"),
                "_is_hip": False,
                "_is_npu": False,
                "_is_cuda": True,
                "torch": torch,
            },
        )

    def attention(self, config: dict[str, Any]) -> SimpleNamespace:
        """The draft layer's `self_attn` (its `self`, as SGLang's constructors leave it) for a draft config.json."""
        layer = SimpleNamespace()
        scope = {"self": layer, "config": Config(**copy.deepcopy(config)), "layer_id": 0, "quant_config": None}
        self.interpreter.run(method(self.eagle3["Eagle3MLADecoderLayer"], "__init__").body, scope | {"prefix": ""})
        return layer.self_attn

    @staticmethod
    def parameters(attn: SimpleNamespace) -> dict[str, tuple[int, ...]]:
        params: dict[str, tuple[int, ...]] = {}
        for name, m in vars(attn).items():
            assert not isinstance(m, Opaque) or m.kind in PARAMETER_FREE, f"self_attn.{name}: an unknown {m.kind}"
            if isinstance(m, Layer):
                params |= {f"{name}.{p}": shape for p, shape in m.params.items()}
        return params

    def load(self, attn: SimpleNamespace, checkpoint: dict[str, torch.Tensor], device: str = "cpu") -> Loaded:
        """Run the draft's load_weights (then its post_load_weights) on `checkpoint` into the parameters `attn` has."""
        params = {ATTN + n: torch.zeros(shape, device=device) for n, shape in self.parameters(attn).items()}
        names = {id(p): n for n, p in params.items()}
        filled: list[str] = []
        warnings: list[str] = []

        def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
            filled.append(names[id(param)])
            self.weight_loader(param, loaded_weight)  # SGLang's: asserts equal sizes, copies

        logger = SimpleNamespace(warning=lambda msg, *args: warnings.append(msg % args))
        fns = define(
            self.eagle3["Eagle3DeepseekV2ForCausalLM"],
            ("load_weights", "post_load_weights"),
            {"torch": torch, "re": re, "default_weight_loader": default_weight_loader, "logger": logger},
        )
        self_attn = SimpleNamespace(**vars(attn))
        self_attn.kv_b_proj = SimpleNamespace(weight=params[ATTN + "kv_b_proj.weight"])
        model = SimpleNamespace(
            named_parameters=lambda: iter(params.items()),
            model=SimpleNamespace(midlayer=SimpleNamespace(self_attn=self_attn)),
            hot_token_id=None,
        )
        model.post_load_weights = lambda: fns["post_load_weights"](model)
        with torch.no_grad():
            fns["load_weights"](model, iter(checkpoint.items()))
        return Loaded(params, filled, warnings, self_attn.w_kc, self_attn.w_vc)

    def rope(self, attn: SimpleNamespace) -> tuple[torch.Tensor, float, bool]:
        """(inv_freq [rope / 2], cos/sin multiplier, neox style) of the rotary embedding `attn` asked for."""
        r = attn.rotary_emb  # get_rope_wrapper's arguments, as DeepseekV2AttentionMLA passed them
        if r["rope_scaling"] is None:  # factory.get_rope: a plain RotaryEmbedding
            plain = SimpleNamespace(rotary_dim=r["rotary_dim"], _force_native=False)
            return self.plain_inv_freq(plain, r["base"]), 1.0, r["is_neox_style"]
        scope = {
            "rope_scaling": r["rope_scaling"],
            "scaling_type": r["rope_scaling"]["rope_type"],
            "max_position": r["max_position"],
            "head_size": r["head_size"],
            "rotary_dim": r["rotary_dim"],
            "base": r["base"],
            "is_neox_style": r["is_neox_style"],
            "dtype": torch.float32,
        }
        assert scope["scaling_type"] == "deepseek_yarn"  # DeepseekV2AttentionMLA rewrites any rope scaling to it
        self.interpreter.run(self.deepseek_yarn_branch.body, scope)
        emb = scope["rotary_emb"]
        for anchor in ("self.rotary_dim = rotary_dim", "self.base = base"):  # RotaryEmbedding.__init__ (base.py)
            assert anchor in self.text["layers/rotary_embedding/base.py"]
        emb.rotary_dim, emb.base = emb.sglang_args["rotary_dim"], emb.sglang_args["base"]
        emb.max_position_embeddings = emb.sglang_args["max_position_embeddings"]
        emb.device = "cpu"
        return self.deepseek_inv_freq(emb, emb.scaling_factor), emb.mscale, emb.sglang_args["is_neox_style"]


@pytest.fixture(scope="module")
def sglang(sglang_release_source: Path) -> SGLangMLADraft:
    return SGLangMLADraft(sglang_release_source)


def draft_config(hidden: int, shape: MLAShape, form: str = "config.json") -> dict[str, Any]:
    """The attention part of the draft's config as SGLang sees it: the config.json fields as written (transformers 4
    passes them through), or as transformers 5 (SGLang 0.5.23 pins 5.19) turns them into `rope_parameters`."""
    fields = {"hidden_size": hidden, "rms_norm_eps": 1e-5, "max_position_embeddings": 262144, **shape.to_config()}
    if form == "config.json":
        return fields
    from transformers import DeepseekV3Config

    return DeepseekV3Config.from_dict(fields).to_dict()


YARN_KIMI = MLAShape.kimi_k25().rope_scaling
SHAPES = {
    "stand-in": (64, MLAShape.of_width(64)),
    "Kimi-K2.5": (7168, MLAShape.kimi_k25()),
}
# narrow shapes for the forward: Kimi's rope (theta, YaRN) on 16 rope channels (the ramp spans dims 2..5 of 8);
# YaRN whose mscale differs from mscale_all_dim (cos and sin scaled too); rotate-half rope; values wider than keys
FORWARD_SHAPES = {
    "stand-in": MLAShape.of_width(64),
    "kimi-rope": dataclasses.replace(
        MLAShape.of_width(64), qk_rope_head_dim=16, rope_theta=50000.0, rope_scaling=YARN_KIMI
    ),
    "uneven-mscale": dataclasses.replace(
        MLAShape.of_width(64),
        qk_rope_head_dim=16,
        rope_scaling=YarnScaling(factor=40.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=0.5),
    ),
    "neox": dataclasses.replace(MLAShape.of_width(64), rope_interleave=False),
    "wide-values": dataclasses.replace(MLAShape.of_width(64), v_head_dim=16, rope_scaling=YARN_KIMI),
}


def test_source_anchors_the_reference_relies_on(sglang):
    """The orders SGLang's forward uses, which the reference below follows (forward_mha.py, forward_normal_prepare):
    the fused down projection's output is q's latent then the kv latent with the rope key last; q's rope channels
    are the last of each head; kv_b_proj's rows per head are the nope key then the value. Its KV cache is one latent
    row per token per layer (memory_pool.py, MLATokenToKVPool)."""
    forward = re.sub(r"\s+", " ", sglang.text["models/deepseek_common/attention_forward_methods/forward_mha.py"])
    for anchor in (
        ".split( [self.q_lora_rank, self.kv_lora_rank + self.qk_rope_head_dim], dim=-1, )",
        "_, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)",
        "kv_a, _ = latent_cache.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)",
        "kv_a = self.kv_a_layernorm(kv_a)",
        "k_pe = latent_cache[:, :, self.kv_lora_rank :]",
        "q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe)",
        "kv = kv.view(-1, self.num_local_heads, self.qk_nope_head_dim + self.v_head_dim)",
        "k_nope = kv[..., : self.qk_nope_head_dim]",
        "v = kv[..., self.qk_nope_head_dim :]",
    ):
        assert anchor in forward, f"SGLang's MLA forward changed: {anchor!r} is gone"
    pool = re.sub(r"\s+", " ", sglang.text["mem_cache/memory_pool.py"])
    assert "else (kv_lora_rank + qk_rope_head_dim)" in pool
    kimi = MLAShape.kimi_k25()
    assert kimi.kv_bytes_per_token(2) == (512 + 64) * 2 == 1152
    assert llama_kv_bytes_per_token(8, 128, 2) == 2 * 8 * 128 * 2 == 4096  # the project's Kimi Llama draft
    assert kimi.kv_bytes_per_token(1, layers=1) == 576  # fp8 cache


@pytest.mark.parametrize("form", ["config.json", "transformers-5"])
@pytest.mark.parametrize("which", list(SHAPES))
def test_parameters_are_the_checkpoint_tensors_sglang_loads(sglang, which, form):
    hidden, shape = SHAPES[which]
    attn = sglang.attention(draft_config(hidden, shape, form))
    built = sglang.parameters(attn)
    assert set(built) == {  # the names themselves, written out: what a Kimi MLA draft's layer holds in SGLang
        "fused_qkv_a_proj_with_mqa.weight",
        "q_a_layernorm.weight",
        "q_b_proj.weight",
        "kv_a_layernorm.weight",
        "kv_b_proj.weight",
        "o_proj.weight",
    }
    assert built["fused_qkv_a_proj_with_mqa.weight"] == (
        shape.q_lora_rank + shape.kv_lora_rank + shape.qk_rope_head_dim,
        2 * hidden,
    )
    with torch.device("meta"):  # Kimi's is 0.3 B parameters: nothing allocated
        module = MLAAttention(hidden, shape)
    state = module.state_dict()
    loaded = sglang.load(attn, {f"layers.0.self_attn.{k}": v for k, v in state.items()}, device="meta")
    assert loaded.warnings == []  # nothing skipped as unexpected
    assert sorted(loaded.filled) == sorted(ATTN + n for n in built)  # each parameter once, sizes checked by SGLang
    assert set(state) == {n for n in built if "fused" not in n} | {"q_a_proj.weight", "kv_a_proj_with_mqa.weight"}
    # load_weights fuses cat([q_a_proj, kv_a_proj_with_mqa]); the forward splits q_lora_rank rows off first
    assert state["q_a_proj.weight"].shape == (attn.q_lora_rank, 2 * hidden)
    assert state["kv_a_proj_with_mqa.weight"].shape == (attn.kv_lora_rank + attn.qk_rope_head_dim, 2 * hidden)
    h = attn.num_heads
    assert loaded.w_kc.shape == (h, attn.qk_nope_head_dim, attn.kv_lora_rank)
    assert loaded.w_vc.shape == (h, attn.kv_lora_rank, attn.v_head_dim)


@pytest.mark.parametrize("form", ["config.json", "transformers-5"])
@pytest.mark.parametrize("which", list(dict.fromkeys([*SHAPES, *FORWARD_SHAPES])))
def test_scale_and_rope_are_sglangs(sglang, which, form):
    hidden, shape = SHAPES[which] if which in SHAPES else (64, FORWARD_SHAPES[which])
    attn = sglang.attention(draft_config(hidden, shape, form))
    assert attn.scaling == pytest.approx(shape.softmax_scale, rel=1e-12)
    inv_freq, mscale, neox = sglang.rope(attn)
    assert neox is (not shape.rope_interleave)
    assert attn.rotary_emb["rotary_dim"] == attn.rotary_emb["head_size"] == shape.qk_rope_head_dim  # rope part only
    assert attn.rotary_emb["base"] == shape.rope_theta
    assert mscale == pytest.approx(shape.rope_mscale, rel=1e-12)
    torch.testing.assert_close(rope_inv_freq(shape), inv_freq, rtol=1e-6, atol=0)
    if which == "Kimi-K2.5":  # YaRN x64 with mscale_all_dim 1: the softmax scale is 2.005x 1/sqrt(192)
        assert shape.softmax_scale == pytest.approx(192**-0.5 * (0.1 * math.log(64) + 1) ** 2)
        assert not neox and mscale == 1.0


def test_shapes_from_and_to_config():
    kimi = MLAShape.kimi_k25()
    assert MLAShape.from_config(kimi.to_config() | {"max_position_embeddings": 262144}) == kimi
    v5 = draft_config(7168, kimi, "transformers-5")
    assert v5["rope_parameters"]["rope_theta"] == 50000.0 and MLAShape.from_config(v5) == kimi
    assert MLAShape.from_config(draft_config(64, MLAShape.of_width(64), "transformers-5")) == MLAShape.of_width(64)
    wide = MLAShape.of_width(7168)
    assert dataclasses.replace(wide, rope_theta=50000.0, rope_scaling=YARN_KIMI) == kimi  # Kimi's proportions
    s = MLAShape.of_width(64)  # every path at CPU size: q and kv LoRA below 2H, rope and nope parts, v != qk
    assert s.q_lora_rank < 128 and s.kv_lora_rank < 128 and s.qk_rope_head_dim > 0 and s.qk_nope_head_dim > 0
    assert s.v_head_dim != s.qk_head_dim and s.num_attention_heads % 8 == 0


# ---------------------------------------------------------------- the forward, against a reference written here


def ref_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def ref_rotate(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, mscale: float, neox: bool) -> torch.Tensor:
    """x [T, ..., d] at positions [T], as SGLang's rotary embedding: cos and sin of pos * inv_freq times mscale; neox
    rotates channel i with i + d/2, otherwise (DeepSeek, GPT-J) channel 2i with 2i + 1."""
    angle = torch.outer(pos.float(), inv_freq)
    cos, sin = angle.cos() * mscale, angle.sin() * mscale
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    d = x.shape[-1]
    if neox:
        a, b = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
    pairs = x.unflatten(-1, (d // 2, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)


def reference_ttt(
    attn: SimpleNamespace,
    loaded: Loaded,
    rope: tuple[torch.Tensor, float, bool],
    xs: list[torch.Tensor],
    positions: torch.Tensor,
    lengths: list[int],
    eps: float,
) -> list[torch.Tensor]:
    """SGLang's MLA in its absorbed form, one TTT step per x: each step caches a latent row (c, rotated k_pe) per
    token; step k's query at t attends to step 0's rows at positions <= t of its own document and to steps 1..k's rows
    at t; scores q_nope w_kc . c + q_pe . k_pe times SGLang's scaling; the output's latent mix goes out through w_vc."""
    P = loaded.params
    h, nope, qr, kvr = attn.num_heads, attn.qk_nope_head_dim, attn.q_lora_rank, attn.kv_lora_rank
    T = len(positions)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    seen = (doc[:, None] == doc[None, :]) & (torch.arange(T)[None, :] <= torch.arange(T)[:, None])  # [query, key]
    inv_freq, mscale, neox = rope
    latents: list[torch.Tensor] = []
    rope_keys: list[torch.Tensor] = []
    outs = []
    for step, x in enumerate(xs):
        pos = positions + step
        down = x @ P[ATTN + "fused_qkv_a_proj_with_mqa.weight"].T
        q_lat, kv_lat = down[:, :qr], down[:, qr:]
        q = (ref_rms_norm(q_lat, P[ATTN + "q_a_layernorm.weight"], eps) @ P[ATTN + "q_b_proj.weight"].T).view(T, h, -1)
        latents.append(ref_rms_norm(kv_lat[:, :kvr], P[ATTN + "kv_a_layernorm.weight"], eps))
        rope_keys.append(ref_rotate(kv_lat[:, kvr:], pos, inv_freq, mscale, neox))
        q_pe = ref_rotate(q[..., nope:], pos, inv_freq, mscale, neox)  # [T, h, rope]
        q_abs = torch.einsum("thn,hnc->thc", q[..., :nope], loaded.w_kc)  # [T, h, kv_lora_rank]
        context = torch.einsum("thc,sc->hts", q_abs, latents[0]) + torch.einsum("thr,sr->hts", q_pe, rope_keys[0])
        context = context.masked_fill(~seen, float("-inf"))
        own = [
            ((q_abs * latents[j][:, None]).sum(-1) + (q_pe * rope_keys[j][:, None]).sum(-1)).T  # [h, T]
            for j in range(1, step + 1)
        ]
        scores = torch.cat([context, *(s[..., None] for s in own)], -1) * attn.scaling  # [h, T, T + step]
        p = scores.softmax(-1)
        mix = torch.einsum("hts,sc->htc", p[..., :T], latents[0])
        for j in range(1, step + 1):
            mix = mix + p[..., T + j - 1, None] * latents[j][None]
        out = torch.einsum("htc,hcv->thv", mix, loaded.w_vc).reshape(T, -1)
        outs.append(out @ P[ATTN + "o_proj.weight"].T)
    return outs


@pytest.mark.parametrize("which", list(FORWARD_SHAPES))
def test_forward_equals_sglangs_absorbed_mla_over_three_ttt_steps(sglang, which):
    shape, hidden, eps = FORWARD_SHAPES[which], 64, 1e-5
    torch.manual_seed(0)
    module = MLAAttention(hidden, shape, rms_norm_eps=eps)
    with torch.no_grad():
        for norm in (module.q_a_layernorm, module.kv_a_layernorm):  # not ones: a dropped norm weight shows
            norm.weight.copy_(1 + 0.5 * torch.randn_like(norm.weight))
    attn = sglang.attention(draft_config(hidden, shape) | {"rms_norm_eps": eps})
    loaded = sglang.load(attn, {f"layers.0.self_attn.{k}": v.detach() for k, v in module.state_dict().items()})
    assert loaded.warnings == []

    lengths = [7, 5]  # two packed documents, each from position 0, far along the context for the YaRN shapes
    start = 3000 if shape.rope_scaling else 0
    positions = torch.cat([start + torch.arange(n) for n in lengths])
    xs = [torch.randn(sum(lengths), 2 * hidden) for _ in range(3)]
    layout = DocLayout(lengths)
    cache: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        got = [module(x, positions + step, cache, layout) for step, x in enumerate(xs)]
    want = reference_ttt(attn, loaded, sglang.rope(attn), xs, positions, lengths, eps)
    assert len(cache) == 3
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-5, atol=1e-5)  # [step, token, H]
    # the documents do not see each other: the second one's outputs are its own alone
    alone: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        second = [module(x[7:], positions[7:] + step, alone) for step, x in enumerate(xs)]
    for g, w in zip(got, second, strict=True):
        torch.testing.assert_close(g[7:], w, rtol=1e-5, atol=1e-5)


def test_bf16_autocast_runs_close_to_fp32_and_trains_every_parameter():
    """GPU training runs under bf16 autocast (here the CPU's): the norms' fp32 weights, the rope tables and the padded
    values meet bf16 activations without a dtype error, and every parameter gets a gradient."""
    shape = FORWARD_SHAPES["kimi-rope"]
    torch.manual_seed(0)
    module = MLAAttention(64, shape)
    xs = [torch.randn(12, 128) for _ in range(3)]
    positions, layout = torch.cat([torch.arange(7), torch.arange(5)]), DocLayout([7, 5])
    cache: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        fp32 = [module(x, positions + step, cache, layout) for step, x in enumerate(xs)]
    cache = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = [module(x, positions + step, cache, layout) for step, x in enumerate(xs)]
    for lo, hi in zip(bf16, fp32, strict=True):
        assert lo.dtype == torch.bfloat16
        assert (lo.float() - hi).abs().max() <= 3e-2 * hi.abs().max()
    sum(o.float().square().sum() for o in bf16).backward()
    for name, p in module.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
