"""The drafter kinds (issue 41): `eagle3_llama` (SGLang's LlamaForCausalLMEagle3), `eagle3_mla` and `eagle3_1_mla`
(SGLang 0.5.23's Kimi-K2.x MLA draft `Eagle3DeepseekV2ForCausalLM`, EAGLE 3 and EAGLE 3.1).

- each kind trains a few steps on tiny synthetic data, resumes exactly, exports, passes `check_checkpoint` and reads
  back into the same kind with bit-equal weights; its FLOPs formula equals the matmuls counted in a forward and
  backward;
- the MLA kinds against the pinned SGLang source, read by `ast` and never imported (tests/test_mla_attention.py's
  interpreter, extended to the whole draft model): SGLang's constructors (`Eagle3DeepseekV2ForCausalLM`,
  `Eagle3MLAModel`, `Eagle3MLADecoderLayer`, `DeepseekV2AttentionMLA`, `DeepseekV2MLP`) run on the exported
  config.json give every parameter and its shape; the draft's own `load_weights` run over the exported tensors must
  fill each once and skip none; a reference forward written here (SGLang's absorbed MLA, its fc_norm and norm_output
  as its source reads them) on the weights SGLang's loader made agrees with the drafter's TTT logits;
- the Kimi shape (hidden 7168, Kimi-K2.5's MLA, draft vocabulary 32000), built on the meta device, exports the names
  and shapes SGLang's loader fills, and its config builds at TP 1, 2, 4 and 8 (DeepseekV2AttentionMLA's head assert,
  the column- and row-parallel splits of linear.py); a config that does not split fails there and in
  `check_checkpoint` alike;
- mutations of each export (no lm_head, a wrong MLA rank in config.json, the wrong architecture) fail.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_drafter_packed_training import synthetic_run
from test_mla_attention import (
    LINEARS,
    Config,
    Interpreter,
    Layer,
    Opaque,
    SGLangMLADraft,
    SourceError,
    classes,
    define,
    method,
    ref_rms_norm,
    reference_ttt,
)
from torch.utils.flop_counter import FlopCounterMode

from eagle3_assets.stages.eagle3_drafter.export import (
    FC_NORM_KEYS,
    SGLANG_EAGLE3_KEYS,
    check_checkpoint,
    checkpoint_keys,
    checkpoint_tensors,
    config_json,
    expected_shapes,
    export_checkpoint,
    read_checkpoint,
    tp_problem,
)
from eagle3_assets.stages.eagle3_drafter.mla import MLAShape, llama_kv_bytes_per_token
from eagle3_assets.stages.eagle3_drafter.model import (
    DRAFTER_KINDS,
    MLA_KINDS,
    DocLayout,
    DrafterConfig,
    Eagle3Drafter,
    QueryRows,
    loss_rows,
    train_flops_per_token,
)
from eagle3_assets.stages.eagle3_drafter.pipeline import default_drafter_kind, drafter_config
from eagle3_assets.stages.eagle3_drafter.quality import drafter_from_checkpoint
from eagle3_assets.stages.eagle3_drafter.train import TrainSettings, train

SRT = "sglang/srt"
# built by SGLang's constructors, no checkpoint tensor: the target's embedding (shared by set_embed), the logits
# processor, the activation, the attention kernels
PARAMETER_FREE = {"VocabParallelEmbedding", "LogitsProcessor", "SiluAndMul", "RadixAttention"}
AUX_IDS = [1, 3, 4]
# Kimi-K2.5's text config, the fields a drafter is built from (its config.json; the MLA part as MLAShape.kimi_k25)
KIMI_TEXT = {
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "num_hidden_layers": 61,
    "vocab_size": 163840,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 262144,
    **MLAShape.kimi_k25().to_config(),
    "num_attention_heads": 64,
}


def tiny_config(kind: str, H: int = 32, vocab: int = 300, draft: int = 40) -> DrafterConfig:
    common: dict[str, Any] = {"intermediate_size": 48, "vocab_size": vocab, "draft_vocab_size": draft}
    if kind == "eagle3_llama":
        return DrafterConfig(
            hidden_size=H, target_hidden_size=H, num_attention_heads=8, num_key_value_heads=4, head_dim=4, **common
        )
    # 8 heads of 8 nope + 4 rope key channels and 8 value channels, both LoRA ranks 16: every MLA path, tiny
    return DrafterConfig.mla_of(kind, H, MLAShape.of_width(H), **common)


def tiny_drafter(kind: str, seed: int = 0, norms: bool = False) -> Eagle3Drafter:
    """A drafter of `kind` for synthetic_run's data (H 32, vocabulary 300, draft 40); `norms`: every RMSNorm weight
    random, so that a norm dropped or applied twice shows."""
    cfg = tiny_config(kind)
    torch.manual_seed(seed)
    model = Eagle3Drafter(
        cfg, torch.randn(cfg.vocab_size, cfg.hidden_size), torch.arange(0, 2 * cfg.draft_vocab_size, 2)
    )
    if norms:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(1 + 0.5 * torch.randn_like(p))
    return model


def test_kinds_have_their_own_layouts():
    assert DRAFTER_KINDS == ("eagle3_llama", "eagle3_mla", "eagle3_1_mla")
    llama, mla, mla31 = (tiny_drafter(k) for k in DRAFTER_KINDS)
    assert llama.fc_norm is None and mla.fc_norm is None and mla31.fc_norm is not None
    assert (mla.cfg.norm_output, mla31.cfg.norm_output, llama.cfg.norm_output) == (False, True, False)
    assert "midlayer.self_attn.kv_b_proj.weight" in mla.state_dict() and "fc_norm.2.weight" in mla31.state_dict()
    assert "midlayer.self_attn.k_proj.weight" in llama.state_dict()
    assert DrafterConfig(**mla31.cfg.to_dict()) == mla31.cfg  # serialized and back, kind and MLA shape included
    with pytest.raises(ValueError, match="needs its MLA shape"):
        DrafterConfig(**{**mla.cfg.to_dict(), "kv_lora_rank": None})
    with pytest.raises(ValueError, match="is not one of"):
        DrafterConfig(**{**mla.cfg.to_dict(), "drafter_kind": "eagle4"})
    with pytest.raises(ValueError, match="is not 'auto'"):
        TrainSettings(drafter_kind="mla")


def test_auto_picks_mla_for_mla_targets_and_the_shape_is_the_targets_own():
    standin: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "q_lora_rank": 32}
    standin |= {"kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 16}
    standin |= {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "max_position_embeddings": 16384}
    qwen = {"hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8}
    assert default_drafter_kind(KIMI_TEXT) == default_drafter_kind(standin) == "eagle3_mla"
    assert default_drafter_kind(qwen) == "eagle3_llama"
    kimi = drafter_config(KIMI_TEXT, 7168, 32000, 163840)
    assert kimi.drafter_kind == "eagle3_mla" and kimi.mla_shape() == MLAShape.kimi_k25()  # Kimi's own attention
    assert kimi.kv_bytes_per_token() == 1152
    assert drafter_config(KIMI_TEXT, 7168, 32000, 163840, "eagle3_llama").kv_bytes_per_token() == 4096
    assert llama_kv_bytes_per_token(8, 128) == 4096
    small = drafter_config(standin, 64, 64, 163840)
    s = small.mla_shape()
    assert (s.num_attention_heads, s.q_lora_rank, s.kv_lora_rank, s.qk_rope_head_dim, s.v_head_dim) == (
        8,
        32,
        16,
        8,
        16,
    )
    assert small.max_position_embeddings == 16384 and s.rope_scaling is None  # 4 heads raised to 8: loads at TP 8
    assert drafter_config(qwen, 4096, 32000, 151936, "eagle3_1_mla").mla_shape() == MLAShape.of_width(4096)


# ------------------------------------------------------------------------------- training, export, read back


def synthetic(kind: str, seed: int = 0):
    _, source, windows, head, settings = synthetic_run(seed)
    return tiny_drafter(kind, seed), source, windows, head, dataclasses.replace(settings, drafter_kind=kind)


@pytest.mark.parametrize("kind", DRAFTER_KINDS)
def test_each_kind_trains_exports_and_reads_back_bit_equal(kind, tmp_path):
    model, source, windows, head, settings = synthetic(kind)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    history = train(
        model, source, windows, [], settings, head=head, device=torch.device("cpu"), log=print, stop_after_steps=3
    )
    assert len(history.step_loss) == 3 and all(torch.isfinite(torch.tensor(history.step_loss)))
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert set(changed) == {k for k, p in model.named_parameters()}  # every weight trained (fc_norm included)

    out = export_checkpoint(model, tmp_path / kind, AUX_IDS)
    assert check_checkpoint(out) == []
    cfg = json.loads((out / "config.json").read_text())
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert keys == checkpoint_keys(kind)
    if kind == "eagle3_llama":
        assert keys == SGLANG_EAGLE3_KEYS and cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    else:
        assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and cfg["model_type"] == "deepseek_v3"
        assert all(k.startswith(("layers.0.", "fc", "norm", "lm_head", "d2t", "t2d")) for k in keys)
        assert (cfg["fc_norm"], cfg["norm_output"]) == ((True, True) if kind == "eagle3_1_mla" else (False, False))
        assert (FC_NORM_KEYS <= keys) == (kind == "eagle3_1_mla")
        shape = model.cfg.mla_shape()
        assert {k: cfg[k] for k in shape.to_config()} == shape.to_config()  # every MLA field written out
        assert cfg["q_lora_rank"] and cfg["num_hidden_layers"] == 1 and cfg["hidden_act"] == "silu"
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4] and cfg["draft_vocab_size"] == 40

    back, back_cfg = drafter_from_checkpoint(out, model.embed_weight)
    assert back_cfg == model.cfg and back.cfg.drafter_kind == kind
    mine, theirs = checkpoint_tensors(model), checkpoint_tensors(back)
    assert mine.keys() == theirs.keys() == keys
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)  # bit-equal: bf16 in the file, exact in fp32
    other = tiny_drafter("eagle3_llama" if kind != "eagle3_llama" else "eagle3_mla")
    with pytest.raises(ValueError, match="is a"):
        read_checkpoint(out).load_into(other)


@pytest.mark.parametrize("kind", MLA_KINDS)
def test_a_killed_run_of_each_kind_resumes_to_the_uninterrupted_weights(kind, tmp_path):
    runs = []
    for stop in (None, 2):
        model, source, windows, head, settings = synthetic(kind, seed=1)
        settings = dataclasses.replace(settings, checkpoint_every=1)
        kw = {"head": head, "device": torch.device("cpu"), "log": print, "checkpoint_dir": tmp_path / str(stop)}
        if stop is not None:
            train(model, source, windows, [], settings, stop_after_steps=stop, **kw)
            model, *_ = synthetic(kind, seed=1)  # a fresh process: the weights come from the checkpoint
        history = train(model, source, windows, [], settings, **kw)
        runs.append((model.state_dict(), history))
    (whole, h_whole), (resumed, h_resumed) = runs
    assert h_resumed.resumed_from_step == 2 and h_resumed.step_loss == h_whole.step_loss
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


@pytest.mark.parametrize("kind", MLA_KINDS)
def test_flops_formula_equals_the_counted_matmuls_of_each_kind(kind):
    """As test_drafter_packed_training's test for the Llama kind: the MLA projections (q and kv LoRA down and up,
    o) counted per TTT step, fc once, backward twice the forward but for fc (whose input gradient only EAGLE 3.1's
    fc_norm needs); steps >= 1 over some rows."""
    model = tiny_drafter(kind)
    cfg, steps, L = model.cfg, 3, 29
    aux, tokens = torch.randn(L, 96), torch.randint(0, 300, (L,))

    def counted(rows: QueryRows | None, backward: bool = True) -> int:
        counter = FlopCounterMode(display=False)
        with counter, torch.set_grad_enabled(backward):
            logits = model.unroll(
                aux, tokens, torch.arange(L), steps, DocLayout([L]) if rows is not None else None, rows
            )
            if backward:
                torch.stack([lg.sum() for lg in logits]).sum().backward()
        return sum(v for op, v in counter.get_flop_counts()["Global"].items() if "mm" in str(op))

    matmuls = counted(None)
    formula = train_flops_per_token(cfg, steps, L)
    assert matmuls == formula["linear"] * L
    fc = 2 * 3 * cfg.target_hidden_size * cfg.hidden_size * L
    fc_backward = 2 if kind == "eagle3_1_mla" else 1  # fc's input gradient too: fc_norm's weights train
    assert 3 * (counted(None, backward=False) - fc) + (1 + fc_backward) * fc == matmuls
    pruned = train_flops_per_token(cfg, steps, L, later_share=9 / L)["linear"] * L
    assert counted(QueryRows([L], [L - 9])) == pytest.approx(pruned, rel=1e-12) and pruned < matmuls
    s = cfg.mla_shape()  # attention: QK^T over nope + rope channels, PV over v_head_dim, per head
    pairs = sum((L + 1) / 2 + k for k in range(steps))
    assert formula["attention"] == 2 * s.num_attention_heads * (s.qk_head_dim + s.v_head_dim) * pairs * 3.5


# ------------------------------------------------------------------ the MLA kinds against SGLang's own source


class DraftInterpreter(Interpreter):
    """test_mla_attention's interpreter for the whole draft model at a TP size: also MergedColumnParallelLinear and
    ParallelLMHead (their weights), `assert` statements (DeepseekV2AttentionMLA asserts the heads split), and the
    column- and row-parallel splits of layers/linear.py (`divide` asserts each part's size is whole)."""

    def __init__(self, constructors, names, tp: int):
        super().__init__(constructors, names)
        self.tp = tp

    def run(self, body: list[ast.stmt], scope: dict[str, Any]) -> None:
        for st in body:
            if isinstance(st, ast.Assert):
                if self.eval(st.test, scope) is False:
                    raise SourceError(f"SGLang asserts at TP {self.tp}, line {st.lineno}: {ast.unparse(st.test)}")
            else:
                super().run([st], scope)

    def construct(self, call: ast.Call, scope: dict[str, Any]) -> Any:
        name = call.func.id if isinstance(call.func, ast.Name) else ""
        args: list[Any] = []
        if name in (*LINEARS, "MergedColumnParallelLinear"):  # (input_size, output_size(s)), by position or keyword
            given = dict(zip(("input_size", "output_size"), call.args, strict=False))
            given |= {k.arg: k.value for k in call.keywords if k.arg in ("input_size", "output_size", "output_sizes")}
            given.setdefault("output_size", given.get("output_sizes"))  # type: ignore[arg-type]
            args = [self.eval(given["input_size"], scope), self.eval(given["output_size"], scope)]
        if name == "MergedColumnParallelLinear":  # (input_size, output_sizes): weight [sum(output_sizes), input]
            self.split(name, list(args[1]), scope, call)
            return Layer(name, {"weight": (sum(args[1]), int(args[0]))})
        if name == "ColumnParallelLinear":
            self.split(name, [args[1]], scope, call)
        if name == "RowParallelLinear":
            self.split(name, [args[0]], scope, call)
        if name == "ParallelLMHead":  # (num_embeddings, embedding_dim); padded per rank, so no split rule
            return Layer(name, {"weight": tuple(int(self.eval(a, scope)) for a in call.args[:2])})
        return super().construct(call, scope)

    def split(self, name: str, sizes: list[int], scope: dict[str, Any], call: ast.Call) -> None:
        if any(int(n) % self.tp for n in sizes):
            raise SourceError(f"{name} of sizes {sizes} does not split at TP {self.tp}: {ast.unparse(call)[:80]}")


class SGLangDraftModel(SGLangMLADraft):
    """The whole Eagle3DeepseekV2ForCausalLM as SGLang 0.5.23 builds and loads it, read from its source."""

    def __init__(self, root: Path):
        super().__init__(root)
        source = root / SRT / "models/kimi_k25_eagle3.py"
        self.source = source.read_text()
        self.tree = ast.parse(self.source)
        self.model_config = (root / SRT / "configs/model_config.py").read_text()
        deepseek = classes(ast.parse((root / SRT / "models/deepseek_v2.py").read_text()))
        linear = (root / SRT / "layers/linear.py").read_text()
        for rule in (  # the splits DraftInterpreter.split models
            "self.output_size_per_partition = divide(self.output_size, tp_size)",
            "divide(output_size, tp_size) for output_size in self.output_sizes",
            "self.input_size_per_partition = divide(input_size, tp_size)",
        ):
            assert rule in linear, f"layers/linear.py changed: {rule!r} is gone"
        self.constructors = dict(self.interpreter.constructors) | {
            "Eagle3DeepseekV2ForCausalLM": method(self.eagle3["Eagle3DeepseekV2ForCausalLM"], "__init__"),
            "Eagle3MLAModel": method(self.eagle3["Eagle3MLAModel"], "__init__"),
            "Eagle3MLADecoderLayer": method(self.eagle3["Eagle3MLADecoderLayer"], "__init__"),
            "DeepseekV2MLP": method(deepseek["DeepseekV2MLP"], "__init__"),
        }
        self.names = dict(self.interpreter.names) | define(self.tree, ("_get_eagle_aux_layer_count",), {})
        self.names |= {
            "nn": SimpleNamespace(ModuleList=list),  # fc_norm's list of norms
            "RMSNorm": lambda size, eps=None: Layer("RMSNorm", {"weight": (int(size),)}),
        }

    def entry_class(self) -> str:
        """The architecture name the draft's module registers (`EntryClass = [...]`), the one config.json names."""
        entry = next(
            n for n in self.tree.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "EntryClass"
        )
        assert isinstance(entry.value, ast.List) and len(entry.value.elts) == 1
        return ast.unparse(entry.value.elts[0])

    def build(self, config: dict[str, Any], tp: int = 1) -> SimpleNamespace:
        names = self.names | {"get_parallel": lambda: SimpleNamespace(attn_tp_size=tp, attn_dcp_size=1)}
        interpreter = DraftInterpreter(self.constructors, names, tp)
        scope = {"config": Config(**copy.deepcopy(config)), "quant_config": None, "prefix": ""}
        interpreter.run([ast.parse("model = Eagle3DeepseekV2ForCausalLM(config, quant_config, prefix)").body[0]], scope)
        return cast(SimpleNamespace, scope["model"])

    @staticmethod
    def params(module: Any, prefix: str = "") -> dict[str, tuple[int, ...]]:
        """Every parameter's full name and shape (SGLang's `named_parameters` of the module built)."""
        out: dict[str, tuple[int, ...]] = {}
        for name, m in vars(module).items():
            if isinstance(m, Layer):
                out |= {f"{prefix}{name}.{p}": shape for p, shape in m.params.items()}
            elif isinstance(m, list) and m and all(isinstance(x, Layer) for x in m):
                for i, x in enumerate(m):
                    out |= {f"{prefix}{name}.{i}.{p}": shape for p, shape in x.params.items()}
            elif isinstance(m, SimpleNamespace) and name != "config":
                out |= SGLangDraftModel.params(m, f"{prefix}{name}.")
            elif isinstance(m, Opaque):
                assert m.kind in PARAMETER_FREE, f"{prefix}{name}: an unknown {m.kind}"
        return out

    def load_model(
        self, model: SimpleNamespace, checkpoint: dict[str, torch.Tensor], device: str = "cpu"
    ) -> SimpleNamespace:
        """SGLang's load_weights and post_load_weights over `checkpoint` into zeroed parameters of `model` (the merged
        gate_up_proj's weight_loader writes shard i at rows i x intermediate); returns the parameters, the ones
        filled, the warnings, hot_token_id, w_kc and w_vc."""
        shapes = self.params(model)
        params = {n: torch.zeros(s, device=device) for n, s in shapes.items()}
        names = {id(p): n for n, p in params.items()}
        filled: list[str] = []
        warnings: list[str] = []

        def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
            filled.append(names[id(param)])
            self.weight_loader(param, loaded)  # SGLang's own: asserts equal sizes, copies

        for name, param in params.items():
            if name.endswith("gate_up_proj.weight"):
                half = param.shape[0] // 2

                def merged(param: torch.Tensor, loaded: torch.Tensor, shard: int, half: int = half) -> None:
                    filled.append(f"{names[id(param)]}[{shard}]")
                    assert loaded.shape == (half, param.shape[1]), (loaded.shape, param.shape)
                    param[shard * half : (shard + 1) * half].copy_(loaded)

                param.weight_loader = merged  # type: ignore[attr-defined]
        logger = SimpleNamespace(warning=lambda msg, *args: warnings.append(msg % args))
        fns = define(
            self.eagle3["Eagle3DeepseekV2ForCausalLM"],
            ("load_weights", "post_load_weights"),
            {"torch": torch, "re": re, "default_weight_loader": default_weight_loader, "logger": logger},
        )
        attn = model.model.midlayer.self_attn
        self_attn = SimpleNamespace(**vars(attn))
        self_attn.kv_b_proj = SimpleNamespace(weight=params["model.midlayer.self_attn.kv_b_proj.weight"])
        me = SimpleNamespace(
            named_parameters=lambda: iter(params.items()),
            model=SimpleNamespace(midlayer=SimpleNamespace(self_attn=self_attn)),
            hot_token_id=None,
        )
        me.post_load_weights = lambda: fns["post_load_weights"](me)
        with torch.no_grad():
            fns["load_weights"](me, iter(checkpoint.items()))
        return SimpleNamespace(
            params=params,
            filled=filled,
            warnings=warnings,
            hot_token_id=me.hot_token_id,
            w_kc=self_attn.w_kc,
            w_vc=self_attn.w_vc,
            attn=attn,
        )


@pytest.fixture(scope="module")
def sglang(sglang_release_source: Path) -> SGLangDraftModel:
    return SGLangDraftModel(sglang_release_source)


def config_forms(cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The exported config.json as SGLang sees it: as written (transformers 4 passes it through) and as transformers 5
    (SGLang 0.5.23 pins 5.19) rebuilds it as DeepseekV3Config (model_type deepseek_v3), rope in rope_parameters."""
    from transformers import DeepseekV3Config

    return {"config.json": cfg, "transformers-5": DeepseekV3Config.from_dict(cfg).to_dict()}


def expected_sglang_parameters(kind: str, cfg: DrafterConfig) -> set[str]:
    """Written out: what the MLA draft holds in SGLang (embed_tokens shared with the target, not in the checkpoint)."""
    attn = "model.midlayer.self_attn."
    names = {
        f"{attn}{n}.weight"
        for n in ("fused_qkv_a_proj_with_mqa", "q_a_layernorm", "q_b_proj", "kv_a_layernorm", "kv_b_proj", "o_proj")
    }
    names |= {"model.midlayer.mlp.gate_up_proj.weight", "model.midlayer.mlp.down_proj.weight"}
    names |= {f"model.midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")}
    names |= {"model.fc.weight", "model.norm.weight", "lm_head.weight"}
    return names | ({f"model.fc_norm.{i}.weight" for i in range(3)} if kind == "eagle3_1_mla" else set())


def exported(kind: str, folder: Path, norms: bool = True) -> tuple[Eagle3Drafter, Path]:
    model = tiny_drafter(kind, norms=norms)
    return model, export_checkpoint(model, folder, AUX_IDS)


@pytest.mark.parametrize("form", ["config.json", "transformers-5"])
@pytest.mark.parametrize("kind", MLA_KINDS)
def test_the_exported_checkpoint_fills_every_parameter_sglang_builds(sglang, kind, form, tmp_path):
    model, out = exported(kind, tmp_path / "ckpt")
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == [sglang.entry_class()]  # the class SGLang registers for this file
    assert f'"{raw["architectures"][0]}" in self.hf_config.architectures' in sglang.model_config  # served as MLA
    assert raw["model_type"] in ("deepseek_v3", "kimi_k2")  # DeepseekV3Config, or SGLang's alias of it
    config = config_forms(raw)[form]
    built = sglang.build(config)
    shapes = sglang.params(built)
    assert set(shapes) == expected_sglang_parameters(kind, model.cfg)
    assert built.model.norm_output is (kind == "eagle3_1_mla")
    assert built.model.num_aux_hidden_states == 3
    tensors = load_file(str(out / "model.safetensors"))
    loaded = sglang.load_model(built, tensors)
    assert loaded.warnings == []  # nothing skipped as unexpected
    merged = [f"model.midlayer.mlp.gate_up_proj.weight[{i}]" for i in (0, 1)]
    assert sorted(loaded.filled) == sorted((set(shapes) - {"model.midlayer.mlp.gate_up_proj.weight"}) | set(merged))
    assert len(loaded.filled) == len(set(loaded.filled))  # each once
    assert torch.equal(loaded.hot_token_id, model.draft_ids)  # d2t read as draft -> target offsets
    P = loaded.params
    a = "layers.0.self_attn."
    fused = torch.cat([tensors[a + "q_a_proj.weight"], tensors[a + "kv_a_proj_with_mqa.weight"]]).float()
    assert torch.equal(P["model.midlayer.self_attn.fused_qkv_a_proj_with_mqa.weight"], fused)
    gate_up = torch.cat([tensors["layers.0.mlp.gate_proj.weight"], tensors["layers.0.mlp.up_proj.weight"]]).float()
    assert torch.equal(P["model.midlayer.mlp.gate_up_proj.weight"], gate_up)
    for name, shape in expected_shapes(model.cfg).items():  # export's own table agrees with the files
        assert tuple(tensors[name].shape) == shape


def sglang_reference(sglang, kind: str, config: dict[str, Any], loaded, aux, tokens, embed, steps: int):
    """The MLA draft's TTT logits [steps][L, V] as SGLang's source computes them, on the weights its loader made:
    fc over the aux states (each normed first under fc_norm: `hidden_states.chunk(...)`), then per step
    cat[input_layernorm(embed), hidden_norm(h)] -> MLA (test_mla_attention's absorbed reference) + h -> post norm ->
    MLP (SiLU(gate) * up) + residual; logits = lm_head(norm(out)); the next step's h is out, or norm(out) under
    norm_output. Written from the source, not from the model."""
    src = re.sub(r"\s+", " ", sglang.source)
    for anchor in (
        "chunks = hidden_states.chunk(self.num_aux_hidden_states, dim=-1)",
        "[norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)]",
        "aux = hidden_states_to_logits if self.norm_output else hidden_states_to_aux",
        "attn_input = torch.cat([embeds, hidden_states], dim=-1)",
    ):
        assert anchor in src, f"SGLang's MLA draft changed: {anchor!r} is gone"
    P, eps = loaded.params, config["rms_norm_eps"]
    L = len(tokens)
    x = aux
    if kind == "eagle3_1_mla":
        x = torch.cat(
            [ref_rms_norm(c, P[f"model.fc_norm.{i}.weight"], eps) for i, c in enumerate(aux.chunk(3, -1))], -1
        )
    h = x @ P["model.fc.weight"].T
    inter = P["model.midlayer.mlp.down_proj.weight"].shape[1]
    xs, logits = [], []
    rope = sglang.rope(loaded.attn)
    for k in range(steps):
        t = torch.arange(L)
        nxt = torch.where(t + 1 + k < L, tokens[(t + 1 + k).clamp(max=L - 1)], 0)
        e = ref_rms_norm(embed[nxt], P["model.midlayer.input_layernorm.weight"], eps)
        xs.append(torch.cat([e, ref_rms_norm(h, P["model.midlayer.hidden_norm.weight"], eps)], -1))
        attn = reference_ttt(loaded.attn, loaded, rope, xs, torch.arange(L), [L], eps)[-1]
        resid = attn + h
        gu = (
            ref_rms_norm(resid, P["model.midlayer.post_attention_layernorm.weight"], eps)
            @ P["model.midlayer.mlp.gate_up_proj.weight"].T
        )
        out = (torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]) @ P["model.midlayer.mlp.down_proj.weight"].T
        out = out + resid
        normed = ref_rms_norm(out, P["model.norm.weight"], eps)
        logits.append(normed @ P["lm_head.weight"].T)
        h = normed if config.get("norm_output") else out
    return logits


@pytest.mark.parametrize("kind", MLA_KINDS)
def test_a_reference_forward_on_the_weights_sglang_loads_equals_the_drafters_logits(sglang, kind, tmp_path):
    _, out = exported(kind, tmp_path / "ckpt")
    config = json.loads((out / "config.json").read_text())
    torch.manual_seed(3)
    embed = torch.randn(300, 32)
    drafter, _ = drafter_from_checkpoint(out, embed)  # the exported files, read back
    built = sglang.build(config)
    loaded = sglang.load_model(built, load_file(str(out / "model.safetensors")))
    L, steps = 13, 3
    aux, tokens = torch.randn(L, 96), torch.randint(0, 300, (L,))
    with torch.no_grad():
        got = drafter.unroll(aux, tokens, torch.arange(L), steps)
    want = sglang_reference(sglang, kind, config, loaded, aux, tokens, embed, steps)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    if kind == "eagle3_1_mla":  # the 3.1 flags matter: read as EAGLE 3, the same weights give other logits
        plain = sglang_reference(sglang, "eagle3_mla", {**config, "norm_output": False}, loaded, aux, tokens, embed, 3)
        assert not torch.allclose(plain[0], got[0], atol=1e-3) and not torch.allclose(plain[2], got[2], atol=1e-3)


@pytest.mark.parametrize("kind", MLA_KINDS)
def test_the_kimi_shape_exports_what_sglang_fills_and_builds_at_tp_1_2_4_8(sglang, kind):
    cfg = drafter_config(KIMI_TEXT, 7168, 32000, 163840, kind)
    assert cfg.mla_shape() == MLAShape.kimi_k25()
    with torch.device("meta"):  # 1.5 B parameters with the frozen embedding: nothing allocated
        model = Eagle3Drafter(cfg, torch.empty(163840, 7168), torch.arange(32000))
    tensors = checkpoint_tensors(model)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected_shapes(cfg)
    assert set(tensors) == checkpoint_keys(kind)
    assert tensors["layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (512 + 64, 2 * 7168)
    assert tensors["layers.0.self_attn.q_b_proj.weight"].shape == (64 * 192, 1536)
    assert tensors["layers.0.self_attn.kv_b_proj.weight"].shape == (64 * 256, 512)
    assert tensors["lm_head.weight"].shape == (32000, 7168) and tensors["fc.weight"].shape == (7168, 3 * 7168)
    config = config_json(cfg, [1, 29, 57])
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 29, 57]
    for form, c in config_forms(config).items():
        built = sglang.build(c)
        assert set(sglang.params(built)) == expected_sglang_parameters(kind, cfg), form
        on_host = {"d2t": torch.zeros(32000, dtype=torch.long), "t2d": torch.zeros(163840, dtype=torch.bool)}
        loaded = sglang.load_model(built, tensors | on_host, device="meta")  # SGLang adds d2t to a host arange
        assert loaded.warnings == [] and len(loaded.filled) == len(sglang.params(built)) + 1  # gate_up: two shards
        for tp in (2, 4, 8):
            sglang.build(c, tp)  # raises SourceError where SGLang would not build it
    assert tp_problem(config, kind) is None
    # a draft with 60 heads (Kimi's width otherwise) does not build at TP 8: SGLang's assert, and our check, agree
    bad = {**config, "num_attention_heads": 60}
    with pytest.raises(SourceError, match="asserts at TP 8"):
        sglang.build(bad, 8)
    sglang.build(bad, 4)
    assert "--tp [8]" in (tp_problem(bad, kind) or "")
    odd = {**config, "intermediate_size": 18436}  # the MLP's merged column split
    with pytest.raises(SourceError, match="MergedColumnParallelLinear"):
        sglang.build(odd, 8)
    assert "--tp [8]" in (tp_problem(odd, kind) or "")


# ------------------------------------------------------------------------------------ mutations of the export


def mutate(out: Path, config: dict[str, Any] | None = None, drop: str | None = None) -> list[str]:
    if config is not None:
        (out / "config.json").write_text(json.dumps(config))
    if drop is not None:
        tensors = load_file(str(out / "model.safetensors"))
        del tensors[drop]
        save_file(tensors, str(out / "model.safetensors"))
    return check_checkpoint(out)


@pytest.mark.parametrize("kind", DRAFTER_KINDS)
def test_each_mutation_of_an_export_fails_the_check(kind, tmp_path):
    def fresh(name: str) -> tuple[Path, dict[str, Any]]:
        out = export_checkpoint(tiny_drafter(kind), tmp_path / name, AUX_IDS)
        return out, json.loads((out / "config.json").read_text())

    out, _ = fresh("head")
    assert any("missing key 'lm_head.weight'" in p for p in mutate(out, drop="lm_head.weight"))
    out, cfg = fresh("arch")
    other = "LlamaForCausalLMEagle3" if kind != "eagle3_llama" else "Eagle3DeepseekV2ForCausalLM"
    assert mutate(out, {**cfg, "architectures": [other]}) != []
    assert mutate(out, {**cfg, "architectures": ["DeepseekV3ForCausalLM"]}) != []
    if kind == "eagle3_llama":
        return
    out, cfg = fresh("rank")
    problems = mutate(out, {**cfg, "kv_lora_rank": cfg["kv_lora_rank"] * 2})
    assert any("kv_a_proj_with_mqa.weight has shape" in p for p in problems)
    out, cfg = fresh("missing")
    assert any("lacks 'q_lora_rank'" in p for p in mutate(out, {k: v for k, v in cfg.items() if k != "q_lora_rank"}))
    out, cfg = fresh("flag")  # one EAGLE 3.1 flag alone: neither kind
    assert any("neither EAGLE 3" in p for p in mutate(out, {**cfg, "norm_output": not cfg["norm_output"]}))
    out, cfg = fresh("fc_norm")
    if kind == "eagle3_1_mla":
        assert any("missing key 'fc_norm.0.weight'" in p for p in mutate(out, drop="fc_norm.0.weight"))
    else:
        assert any("missing key 'fc_norm" in p for p in mutate(out, {**cfg, "fc_norm": True, "norm_output": True}))


@pytest.mark.parametrize("kind", DRAFTER_KINDS)
def test_a_step_of_prompt_only_windows_has_no_later_rows_and_trains(kind):
    """A step whose windows hold no completion token (a long prompt cut into windows, the first command's data) gives
    `loss_rows` no row for TTT steps >= 1: each kind runs them on zero rows (the Llama attention's reshape could not
    infer its width from 0 elements) and the loss still back-propagates through step 0."""
    model = tiny_drafter(kind)
    lengths = [12, 9]
    mask = torch.zeros(sum(lengths), dtype=torch.long)
    rows = loss_rows(lengths, mask, 3)
    assert rows is not None and rows.index.numel() == 0
    L, H = sum(lengths), model.cfg.target_hidden_size
    aux = torch.randn(L, 3 * H)
    positions = torch.cat([torch.arange(n) for n in lengths])
    logits = model.unroll(aux, torch.randint(0, 300, (L,)), positions, 3, DocLayout(lengths), rows)
    assert [x.shape[0] for x in logits] == [L, 0, 0]
    torch.stack([x.sum() for x in logits]).sum().backward()
    assert model.fc.weight.grad is not None
