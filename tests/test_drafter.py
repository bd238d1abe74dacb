import json
from collections import Counter

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3_assets.stages.eagle3_drafter.export import (
    SGLANG_EAGLE3_KEYS,
    check_checkpoint,
    export_checkpoint,
)
from eagle3_assets.stages.eagle3_drafter.model import DrafterConfig, Eagle3Drafter
from eagle3_assets.stages.eagle3_drafter.vocab import build_draft_vocab, effective_draft_vocab_size

# ../shared/reference/eagle3.md, written out here on purpose
REFERENCE_KEYS = {
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
}


def tiny_drafter(vocab=1000, draft=64, H=32):
    cfg = DrafterConfig(
        hidden_size=H,
        target_hidden_size=H,
        intermediate_size=64,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=4,
        vocab_size=vocab,
        draft_vocab_size=draft,
    )
    torch.manual_seed(0)
    return Eagle3Drafter(cfg, torch.randn(vocab, H), torch.arange(0, 2 * draft, 2))


def test_export_has_exactly_the_sglang_keys(tmp_path):
    model = tiny_drafter()
    out = export_checkpoint(model, tmp_path / "ckpt", [1, 29, 57])
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        tensors = {k: f.get_tensor(k) for k in keys}
    assert keys == REFERENCE_KEYS == SGLANG_EAGLE3_KEYS
    assert tensors["fc.weight"].dtype == torch.bfloat16 and tensors["fc.weight"].shape == (32, 96)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert (tensors["d2t"] + torch.arange(64)).tolist() == list(range(0, 128, 2))
    cfg = json.loads((out / "config.json").read_text())
    assert (
        cfg["architectures"] == ["LlamaForCausalLMEagle3"]
        and cfg["vocab_size"] == 1000
        and cfg["draft_vocab_size"] == 64
    )
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 29, 57], "use_aux_hidden_state": True}
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]  # vLLM: the inputs of the layers after
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert check_checkpoint(out) == []


# Written out from the models' own config.json files (text part), not derived from our code.
TARGET_CONFIGS = {
    "stand-in": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8, "vocab_size": 163840},
    "Kimi-K2.5": {"hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61, "vocab_size": 163840},
    "DeepSeek-V3": {"hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61, "vocab_size": 129280},
    "2048-wide": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 8, "vocab_size": 32000},
    "Qwen3-8B": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "vocab_size": 151936},
    "5120-wide": {"hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40, "vocab_size": 152064},
}


def kv_split_ok(heads: int, kv_heads: int, tp: int) -> bool:
    """SGLang's QKVParallelLinear / vLLM's attention: heads divide by TP; KV heads divide by it, or it by them."""
    return heads % tp == 0 and (kv_heads % tp == 0 if kv_heads >= tp else tp % kv_heads == 0)


def test_every_target_gets_a_drafter_that_loads_at_tp_1_2_4_8():
    from eagle3_assets.stages.eagle3_drafter.model import default_learning_rate, loads_at_tp
    from eagle3_assets.stages.eagle3_drafter.pipeline import drafter_config

    for name, target in TARGET_CONFIGS.items():
        cfg = drafter_config(target, target["hidden_size"], 32000, target["vocab_size"])
        for tp in (1, 2, 4, 8):
            assert kv_split_ok(cfg.num_attention_heads, cfg.num_key_value_heads, tp), (name, tp, cfg)
            assert loads_at_tp(cfg.num_attention_heads, cfg.num_key_value_heads, tp)
    kimi = drafter_config(TARGET_CONFIGS["Kimi-K2.5"], 7168, 32000, 163840)
    assert (kimi.num_attention_heads, kimi.num_key_value_heads, kimi.head_dim) == (
        56,
        8,
        128,
    )  # SpecForge's DeepSeek-V3 draft
    assert not loads_at_tp(56, 7, 8) and not kv_split_ok(56, 7, 8)  # the old Kimi shape
    assert default_learning_rate(7168) == 1e-4 and default_learning_rate(64) == 2e-3


def test_layer_ids_are_written_in_each_servers_convention(tmp_path):
    out = export_checkpoint(tiny_drafter(), tmp_path / "a", [2, 4, 6])  # not starting at 1: SGLang adds nothing
    cfg = json.loads((out / "config.json").read_text())
    assert (
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [3, 5, 7] == cfg["eagle_aux_hidden_state_layer_ids"]
    )
    cfg["eagle_aux_hidden_state_layer_ids"] = [1, 29, 57]  # vLLM's ids copied from SGLang's: off by one
    (out / "config.json").write_text(json.dumps(cfg))
    assert any("name different target layers" in p for p in check_checkpoint(out))
    cfg.update(eagle_aux_hidden_state_layer_ids=[3, 5, 7], num_key_value_heads=7, num_attention_heads=56)
    (out / "config.json").write_text(json.dumps(cfg))
    assert any("do not split at --tp [2, 4, 8]" in p for p in check_checkpoint(out))


def test_key_check_catches_what_sglang_would_skip(tmp_path):
    out = export_checkpoint(tiny_drafter(), tmp_path / "ckpt", [1, 3, 4])
    tensors = load_file(str(out / "model.safetensors"))
    tensors["layers.0.self_attn.q_proj.weight"] = tensors.pop("midlayer.self_attn.q_proj.weight")
    save_file(tensors, str(out / "model.safetensors"))
    problems = check_checkpoint(out)
    assert any("unexpected key 'layers.0.self_attn.q_proj.weight'" in p for p in problems)
    assert any("missing key 'midlayer.self_attn.q_proj.weight'" in p for p in problems)


def test_draft_vocab_is_most_frequent_and_padded():
    counts = Counter({7: 50, 3: 50, 9: 10, 2: 1})
    assert build_draft_vocab(counts, 2, 100).tolist() == [3, 7]
    assert build_draft_vocab(counts, 6, 100).tolist() == [0, 1, 2, 3, 7, 9]  # padded with the lowest unused ids
    assert effective_draft_vocab_size(32000, 490) == 512 and effective_draft_vocab_size(32000, 10**6) == 32000


def test_ttt_step_k_at_t_sees_nothing_after_its_own_input():
    """Step k at position t reads token t+1+k; nothing later may change its logits."""
    model = tiny_drafter()
    L, steps = 12, 3
    aux = torch.randn(L, 96)
    tokens = torch.randint(0, 1000, (L,))
    pos = torch.arange(L)
    with torch.no_grad():
        base = model.unroll(aux, tokens, pos, steps)
        t = 4
        aux2, tokens2 = aux.clone(), tokens.clone()
        aux2[t + 1 :] = torch.randn(L - t - 1, 96)
        for k in range(steps):
            tokens3 = tokens2.clone()
            tokens3[t + 2 + k :] = torch.randint(0, 1000, (L - t - 2 - k,))
            changed = model.unroll(aux2, tokens3, pos, steps)
            for j in range(k + 1):  # steps 0..k at position t only read tokens up to t+1+j <= t+1+k
                torch.testing.assert_close(changed[j][t], base[j][t])


def _reference_ttt_attention(q, k0, v0, chain_k, chain_v, scale):
    """Written out: every score materialized, query t sees k0[:t+1] and chain_k[i][t] for each i."""
    h, L, d = q.shape
    scores = torch.full((h, L, L + len(chain_k)), float("-inf"), dtype=q.dtype)
    for t in range(L):
        scores[:, t, : t + 1] = torch.einsum("hd,hjd->hj", q[:, t], k0[:, : t + 1]) * scale
        for i, k in enumerate(chain_k):
            scores[:, t, L + i] = (q[:, t] * k[:, t]).sum(-1) * scale
    p = torch.softmax(scores, -1)
    out = p[..., :L] @ v0
    for i, v in enumerate(chain_v):
        out = out + p[..., L + i : L + i + 1] * v
    return out


def test_fused_ttt_attention_equals_the_written_out_softmax_and_its_gradients():
    from eagle3_assets.stages.eagle3_drafter.model import ttt_attention

    g = torch.Generator().manual_seed(3)
    h, L, d, scale = 4, 23, 8, 8**-0.5
    for steps, spread in ((0, 1.0), (1, 1.0), (3, 1.0), (6, 1.0), (3, 12.0), (3, 0.05)):
        # spread 12: scores of hundreds, where one side's sum swamps the other's; 0.05: nearly uniform
        q, k0, v0 = (torch.randn(h, L, d, generator=g, dtype=torch.float64) * s for s in (spread, spread, 1.0))
        chain_k = [torch.randn(h, L, d, generator=g, dtype=torch.float64) * spread for _ in range(steps)]
        chain_v = [torch.randn(h, L, d, generator=g, dtype=torch.float64) for _ in range(steps)]
        leaves = [q, k0, v0, *chain_k, *chain_v]
        for x in leaves:
            x.requires_grad_(True)
        weights = torch.randn(h, L, d, generator=g, dtype=torch.float64)
        got = ttt_attention(q, k0, v0, chain_k, chain_v, scale)
        want = _reference_ttt_attention(q, k0, v0, chain_k, chain_v, scale)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
        grads_got = torch.autograd.grad((got * weights).sum(), leaves)
        grads_want = torch.autograd.grad((want * weights).sum(), leaves)
        for a, b in zip(grads_got, grads_want, strict=True):  # a gradient per leaf
            torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9)
    # bf16, as under CUDA autocast: the sink's constant is rounded to bf16, and the merge stays as close to
    # the exact softmax (on the same bf16 inputs) as the written-out attention computed in bf16 is
    q, k0, v0, *chain = (torch.randn(h, L, d, generator=g).mul(3).bfloat16() for _ in range(7))
    exact = _reference_ttt_attention(
        q.float(), k0.float(), v0.float(), [x.float() for x in chain[:2]], [x.float() for x in chain[2:]], scale
    )
    in_bf16 = _reference_ttt_attention(q, k0, v0, chain[:2], chain[2:], scale).float()
    got = ttt_attention(q, k0, v0, chain[:2], chain[2:], scale).float()
    assert (got - exact).abs().max() <= 2 * (in_bf16 - exact).abs().max()


def test_tiled_vocab_argmax_equals_argmax_over_all_logits_ties_included():
    from eagle3_assets.stages.eagle3_drafter.data import vocab_argmax

    g = torch.Generator().manual_seed(1)
    head = torch.randn(1000, 16, generator=g)
    head[700] = head[300]  # the same logit in two tiles: the lower id wins, as argmax picks it
    head[301] = head[300]  # and twice in one tile
    x = torch.cat([torch.randn(37, 16, generator=g), head[300:301] * 5])
    want = (x @ head.T).argmax(-1)
    assert want[-1] == 300
    for rows, cols in ((8, 64), (512, 4096), (5, 300), (1, 1000)):
        assert torch.equal(vocab_argmax(x, head, rows, cols), want)
