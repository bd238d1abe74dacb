"""`benchmarks/drafter_step_memory.py` estimates a GPU training step's memory without a GPU: its figures must be the
ones the trainer's CUDA step has. The oracle is EAGLE-3's layout counted by hand (one decoder layer over the fused
3H inputs, a draft-vocabulary head), not the model's own parameter list: the fp32 master weights, AdamW's two fp32
moments, the frozen embedding in bf16 (as `Trainer` keeps it on CUDA), the teacher's bf16 head and its
draft-vocabulary rows; and the activations grow with the step's tokens.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import drafter_step_memory as memory  # noqa: E402

SMALL = ["--hidden", "256", "--intermediate", "640", "--draft-vocab", "1024", "--target-vocab", "4096"]


def eagle3_parameters(H: int, I: int, heads: int, kv: int, d: int, draft_vocab: int) -> int:  # noqa: E741
    fc = 3 * H * H  # the target's three hidden states, fused to one
    attention = 2 * H * heads * d + 2 * (2 * H * kv * d) + heads * d * H  # q, k, v over [embedding, hidden]; o
    mlp = 3 * H * I
    norms = 4 * H  # input, hidden, post-attention, final
    return fc + attention + mlp + norms + draft_vocab * H


@pytest.mark.timeout(600)
def test_the_estimate_holds_what_a_cuda_step_holds():
    a = memory.parse_args([*SMALL, "--batch-tokens", "1024", "--min-len", "128", "--max-len", "512"])
    cfg = memory.drafter_config(a)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (8, 8, 32)
    lengths = memory.document_lengths(a.batch_tokens, a.min_len, a.max_len)
    assert sum(lengths) == 1024 and min(lengths[:-1]) >= 128 and max(lengths) <= 512
    found = memory.step_memory(cfg, lengths)
    n = eagle3_parameters(256, 640, 8, 8, 32, 1024)
    assert found["trainable_parameters"] == n
    peak = found["peak_bytes"]
    assert peak["Parameter"] == 4 * n  # fp32 master weights
    assert 8 * n <= peak["Optstate"] <= 8 * n + 64 * 16  # AdamW's two fp32 moments (+ its step counters)
    # the frozen embedding in bf16, and the draft <-> target id maps
    assert peak["Buffer"] == 4096 * 256 * 2 + 1024 * 8 + 4096
    assert peak["Other"] >= (4096 + 1024) * 256 * 2  # the teacher's bf16 head and its draft rows
    assert peak["Total"] == sum(v for k, v in peak.items() if k != "Total")


@pytest.mark.timeout(600)
def test_the_activations_grow_with_the_steps_tokens():
    a = memory.parse_args(SMALL)
    cfg = memory.drafter_config(a)
    one = memory.step_memory(cfg, [512, 512])["peak_bytes"]
    two = memory.step_memory(cfg, [512] * 4)["peak_bytes"]
    assert 1.7 < two["Activation"] / one["Activation"] < 2.3
    assert two["Parameter"] == one["Parameter"] and two["Optstate"] == one["Optstate"]


@pytest.mark.timeout(600)
def test_the_script_says_whether_it_fits(tmp_path, capsys, monkeypatch):
    out = tmp_path / "memory.json"
    argv = ["drafter_step_memory.py", *SMALL, "--batch-tokens", "512", "--gpu-gib", "79.1", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    memory.main()
    printed = capsys.readouterr().out
    assert "trainable parameters, a 512-token step: peak" in printed and "GiB left of 79.1" in printed
    figures = json.loads(out.read_text())
    assert figures["headroom_gib"] == pytest.approx(79.1 - figures["peak_gib"], abs=0.011)
    assert figures["peak_gib"] == pytest.approx(sum(figures["peak_gib_by_kind"].values()), abs=0.05)


def test_a_norm_keeps_what_cudas_fused_kernel_keeps():
    """On CUDA, RMSNorm with input and weight of one dtype is one fused kernel whose backward keeps the input, the
    weight and an fp32 rstd per row; the CPU's composite would keep fp32 copies of the whole input."""
    torch_rms_norm = F.rms_norm
    x = torch.randn(6, 64, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.rand(64) + 0.5).to(torch.bfloat16)
    kept: list[tuple[torch.dtype, tuple[int, ...]]] = []

    def keep(t):
        kept.append((t.dtype, tuple(t.shape)))
        return t

    with memory.cuda_rms_norm(), torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        y = F.rms_norm(x, [64], w, 1e-6)
    assert kept == [(torch.bfloat16, (6, 64)), (torch.bfloat16, (64,)), (torch.float32, (6, 1))]
    torch.testing.assert_close(y, F.rms_norm(x.detach(), [64], w, 1e-6), atol=0.02, rtol=0.02)  # torch's own
    kept.clear()
    with memory.cuda_rms_norm(), torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch says it cannot use the fused kernel: that is the case tested
        F.rms_norm(x, [64], w.float(), 1e-6)  # dtypes differ: CUDA falls back to the composite, and so does this
    assert (torch.float32, (6, 64)) in kept
    assert F.rms_norm is torch_rms_norm  # the context put torch's own back


@pytest.mark.timeout(600)
def test_the_step_runs_its_norms_as_cuda_does(monkeypatch):
    calls: list[torch.dtype] = []
    fused = memory.CudaRmsNorm.apply

    def counted(*args):
        calls.append(args[0].dtype)
        return fused(*args)

    monkeypatch.setattr(memory.CudaRmsNorm, "apply", counted)
    cfg = memory.drafter_config(memory.parse_args(SMALL))
    memory.step_memory(cfg, [256, 256], ttt_steps=3)
    # per TTT step: the embedding's, the hidden state's and the post-attention norm, and the final one; two steps
    assert calls == [torch.bfloat16] * (4 * 3 * 2)
