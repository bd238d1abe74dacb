"""Multi-latent attention (MLA) for an EAGLE-3 drafter, written to match SGLang 0.5.23's Kimi-K2.x draft
`Eagle3DeepseekV2ForCausalLM` (`models/kimi_k25_eagle3.py`), whose decoder layer runs DeepSeek-V2's
`DeepseekV2AttentionMLA` (`models/deepseek_v2.py`) over the EAGLE-3 input cat[input_layernorm(embed), hidden_norm(h)].

Per token x [2H] (names are the checkpoint's tensors under `layers.0.self_attn.`):

    q      = q_b_proj(q_a_layernorm(q_a_proj(x)))            [heads, nope + rope]
    latent = kv_a_proj_with_mqa(x)                           [kv_lora_rank + rope]
    c, k_r = latent[:kv_lora_rank], latent[kv_lora_rank:]     the compressed KV, and one rope key for all heads
    k_n, v = kv_b_proj(kv_a_layernorm(c)) per head          [heads, nope] and [heads, v_head_dim]
    k      = cat[k_n, rope(k_r)] per head;  q = cat[q_nope, rope(q_rope)]
    out    = o_proj(softmax(q k^T * scale) v)                [H]

SGLang fuses q_a_proj and kv_a_proj_with_mqa at load into one `fused_qkv_a_proj_with_mqa` (rows: q's first), and
splits kv_b_proj after load into per-head w_kc (the nope-key rows) and w_vc (the value rows) for its absorbed
decode; its KV cache holds only c and rope(k_r) per token (`MLAShape.kv_bytes_per_token`). Rope is DeepSeek's:
on the last qk_rope_head_dim channels only, interleaved pairs (2i, 2i+1) unless the config says
`rope_interleave: false`, with DeepSeek YaRN whenever the config has any rope scaling (`YarnScaling`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eagle3_assets.stages.eagle3_drafter.attention import DocLayout, QueryRows, rms_norm, ttt_attention


def yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class YarnScaling:
    """A config's rope scaling as SGLang's MLA reads it: any non-empty `rope_scaling` (or `rope_parameters` whose
    rope_type is not "default") is run as "deepseek_yarn", whatever type it names. Defaults are SGLang's."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    extrapolation_factor: float = 1.0
    attn_factor: float = 1.0
    scale_softmax: bool = True  # False when the config sets apply_yarn_scaling or apply_scale to false

    @classmethod
    def from_config(cls, rope_scaling: dict[str, Any] | None, max_position_embeddings: int) -> YarnScaling | None:
        """From a config's rope scaling dict (None or {} for none); original_max_position_embeddings falls back to
        max_position_embeddings, as SGLang's rope factory does."""
        if not rope_scaling:
            return None
        r = rope_scaling
        return cls(
            factor=float(r.get("factor", 1.0)),
            original_max_position_embeddings=int(r.get("original_max_position_embeddings", max_position_embeddings)),
            beta_fast=float(r.get("beta_fast", 32.0)),
            beta_slow=float(r.get("beta_slow", 1.0)),
            mscale=float(r.get("mscale", 1.0)),
            mscale_all_dim=float(r.get("mscale_all_dim", 0.0)),
            extrapolation_factor=float(r.get("extrapolation_factor", 1.0)),
            attn_factor=float(r.get("attn_factor", 1.0)),
            scale_softmax=bool(r.get("apply_yarn_scaling", True)) and bool(r.get("apply_scale", True)),
        )

    def to_config(self) -> dict[str, Any]:
        return {
            "type": "yarn",
            "factor": self.factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
            "beta_fast": self.beta_fast,
            "beta_slow": self.beta_slow,
            "mscale": self.mscale,
            "mscale_all_dim": self.mscale_all_dim,
        }


@dataclass(frozen=True)
class MLAShape:
    """The numbers of one MLA attention (the config.json fields of the same names)."""

    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None
    rope_interleave: bool = True  # DeepSeek's pairs (2i, 2i+1); False: rotate-half (neox), as Llama's

    @classmethod
    def kimi_k25(cls) -> MLAShape:
        """Kimi-K2.5's own attention (its text config: DeepSeek-V3's MLA with 64 heads, rope_theta 50000 and
        YaRN x64 over 4096 original positions, max_position_embeddings 262144)."""
        return cls(
            num_attention_heads=64,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            rope_theta=50000.0,
            rope_scaling=YarnScaling(
                factor=64.0,
                original_max_position_embeddings=4096,
                beta_fast=32.0,
                beta_slow=1.0,
                mscale=1.0,
                mscale_all_dim=1.0,
            ),
        )

    @classmethod
    def of_width(
        cls,
        hidden_size: int,
        rope_theta: float = 10000.0,
        rope_scaling: YarnScaling | None = None,
        rope_interleave: bool = True,
    ) -> MLAShape:
        """An MLA in Kimi's proportions for a drafter `hidden_size` wide: Kimi's head dims from 1024 wide on (narrower:
        nope = v = hidden / 8, rope half that), heads a multiple of 8 near hidden / 112, q rank near 3 hidden / 14,
        kv rank near hidden / 14 (both multiples of 8, at least 16). 7168 wide gives Kimi-K2.5's numbers; 64 wide
        gives 8 heads of 8 + 4 channels, values 8 wide, ranks 16: every path (q and kv LoRA, rope and nope parts,
        values narrower than keys) at CPU size."""
        nope = 128 if hidden_size >= 1024 else max(8, hidden_size // 8)
        return cls(
            num_attention_heads=max(8, 8 * round(hidden_size / 112 / 8)),
            q_lora_rank=max(16, 8 * round(3 * hidden_size / 14 / 8)),
            kv_lora_rank=max(16, 8 * round(hidden_size / 14 / 8)),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=nope // 2,
            v_head_dim=nope,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rope_interleave=rope_interleave,
        )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> MLAShape:
        """From a (text) config.json as SGLang's draft layer reads it: rope from `rope_parameters` when present (its
        rope_type "default" meaning no scaling), else `rope_theta` and `rope_scaling`."""
        params = config.get("rope_parameters")
        if params is not None:
            theta = float(params.get("rope_theta", 10000.0))
            scaling = params if params.get("rope_type") != "default" else None
        else:
            theta, scaling = float(config.get("rope_theta", 10000.0)), config.get("rope_scaling")
        return cls(
            num_attention_heads=config["num_attention_heads"],
            q_lora_rank=config["q_lora_rank"],
            kv_lora_rank=config["kv_lora_rank"],
            qk_nope_head_dim=config["qk_nope_head_dim"],
            qk_rope_head_dim=config["qk_rope_head_dim"],
            v_head_dim=config["v_head_dim"],
            rope_theta=theta,
            rope_scaling=YarnScaling.from_config(scaling, config.get("max_position_embeddings", 8192)),
            rope_interleave=bool(config.get("rope_interleave", True)),
        )

    def to_config(self) -> dict[str, Any]:
        """The draft config.json's attention fields (SGLang reads each; transformers' DeepseekV3Config would fill a
        missing one with DeepSeek-V3's value, so all are written). `rope_theta`/`rope_scaling` in the form both
        transformers 4 and 5 (which moves them into `rope_parameters`) read."""
        return {
            "num_attention_heads": self.num_attention_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling.to_config() if self.rope_scaling else None,
            "rope_interleave": self.rope_interleave,
        }

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times yarn_mscale(factor, mscale_all_dim)^2 under YaRN (SGLang's MLA scaling)."""
        scale = self.qk_head_dim**-0.5
        y = self.rope_scaling
        if y is not None and y.scale_softmax:
            scale *= yarn_mscale(y.factor, y.mscale_all_dim) ** 2
        return scale

    @property
    def rope_mscale(self) -> float:
        """What YaRN multiplies cos and sin by: mscale(mscale) / mscale(mscale_all_dim) * attn_factor (1 for Kimi)."""
        y = self.rope_scaling
        if y is None:
            return 1.0
        return yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim) * y.attn_factor

    def kv_bytes_per_token(self, dtype_bytes: int = 2, layers: int = 1) -> int:
        """The draft's KV cache per token as SGLang's MLA pool stores it: the latent c and the rope key,
        kv_lora_rank + qk_rope_head_dim values per layer (Kimi-K2.5's shape in bf16: 1,152 bytes)."""
        return (self.kv_lora_rank + self.qk_rope_head_dim) * dtype_bytes * layers


def llama_kv_bytes_per_token(num_key_value_heads: int, head_dim: int, dtype_bytes: int = 2, layers: int = 1) -> int:
    """A Llama-style (GQA) draft's KV cache per token: a key and a value per KV head (the query heads do not count).
    The project's Kimi Llama draft (8 KV heads of 128) in bf16: 4,096 bytes, 3.6x the MLA draft's."""
    return 2 * num_key_value_heads * head_dim * dtype_bytes * layers


def rope_inv_freq(shape: MLAShape, device: torch.device | None = None) -> torch.Tensor:
    """[qk_rope_head_dim / 2] fp32 angular frequencies; under YaRN, DeepSeek's blend of the interpolated
    (1 / (factor * base^(2i/d))) and the original frequencies, ramping between the dims whose wavelengths fit
    beta_fast and beta_slow rotations in the original context."""
    d = shape.qk_rope_head_dim
    pos_freqs = shape.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d)
    y = shape.rope_scaling
    if y is None:
        return 1.0 / pos_freqs

    def correction_dim(rotations: float, context: int) -> float:  # the dim whose wavelength fits `rotations`
        return d * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(shape.rope_theta))

    low = max(math.floor(correction_dim(y.beta_fast, y.original_max_position_embeddings)), 0)
    high = min(math.ceil(correction_dim(y.beta_slow, y.original_max_position_embeddings)), d - 1)
    span = high - low if high != low else 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device=device) - low) / span).clamp(0, 1)
    keep = (1 - ramp) * y.extrapolation_factor  # 1: the original frequency (fast dims), 0: interpolated
    return (1.0 / (y.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate x [..., L, d] by the angles whose cos and sin are [L, d / 2]: pairs (2i, 2i+1) when `interleave`
    (DeepSeek, GPT-J), else (i, i + d/2) (neox, rotate-half)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)
    x1, x2 = x.chunk(2, -1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


class MLAAttention(nn.Module):
    """The attention of the EAGLE-3 MLA draft layer, its parameters named and shaped as the checkpoint tensors
    SGLang's `Eagle3DeepseekV2ForCausalLM.load_weights` reads under `layers.0.self_attn.` (weights [out, in])."""

    def __init__(self, hidden_size: int, shape: MLAShape, rms_norm_eps: float = 1e-6):
        super().__init__()
        self.shape = shape
        s, h = shape, shape.num_attention_heads
        self.q_a_proj = nn.Linear(2 * hidden_size, s.q_lora_rank, bias=False)
        self.q_a_layernorm = nn.RMSNorm(s.q_lora_rank, eps=rms_norm_eps)
        self.q_b_proj = nn.Linear(s.q_lora_rank, h * s.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * hidden_size, s.kv_lora_rank + s.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(s.kv_lora_rank, eps=rms_norm_eps)
        self.kv_b_proj = nn.Linear(s.kv_lora_rank, h * (s.qk_nope_head_dim + s.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * s.v_head_dim, hidden_size, bias=False)

    @property
    def scale(self) -> float:
        return self.shape.softmax_scale

    @property
    def cache_dims(self) -> tuple[int, int]:
        """(key, value) channels per head of what `project` returns (the incremental decoder caches them)."""
        return self.shape.qk_head_dim, self.shape.v_head_dim

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q and k [h, L, nope + rope] (rope applied to the last rope channels; one rope key shared by every head) and
        v [h, L, v_head_dim] of the rows x [L, 2H] at `positions` [L]: the decompressed form of SGLang's latent cache
        (c and the rope key per token), whose scores and outputs are the same."""
        s = self.shape
        L, h = x.shape[0], s.num_attention_heads
        nope, rot, vd = s.qk_nope_head_dim, s.qk_rope_head_dim, s.v_head_dim

        q = self.q_b_proj(rms_norm(self.q_a_layernorm, self.q_a_proj(x))).view(L, h, s.qk_head_dim).transpose(0, 1)
        c, k_rot = self.kv_a_proj_with_mqa(x).split([s.kv_lora_rank, rot], -1)
        kv = self.kv_b_proj(rms_norm(self.kv_a_layernorm, c)).view(L, h, nope + vd).transpose(0, 1)
        k_nope, v = kv.split([nope, vd], -1)  # per head: the nope-key rows, then the value rows

        angles = positions.to(torch.float32)[:, None] * rope_inv_freq(s, x.device)[None, :]
        cos, sin = angles.cos() * s.rope_mscale, angles.sin() * s.rope_mscale
        q_nope, q_rot = q.split([nope, rot], -1)
        q = torch.cat([q_nope, apply_rope(q_rot, cos, sin, s.rope_interleave)], -1)  # [h, L, nope + rope]
        k_rot = apply_rope(k_rot, cos, sin, s.rope_interleave)  # [L, rope]: one rope key shared by every head
        k = torch.cat([k_nope, k_rot[None].expand(h, L, rot)], -1)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache: list[tuple[torch.Tensor, torch.Tensor]],
        layout: DocLayout | None = None,
        rows: QueryRows | None = None,
    ) -> torch.Tensor:
        """x [L, 2H] at one TTT step; `cache` holds (k, v) of earlier steps and receives this one's. At a step >= 1
        given `rows`, x and positions are those rows' ([K, 2H], [K]); step 0's cache entry covers every position."""
        s = self.shape
        L, h, vd = x.shape[0], s.num_attention_heads, s.v_head_dim
        q, k, v = self.project(x, positions)
        # ttt_attention takes q, k and v of one width: zero channels added to v (or to q and k, when values are the
        # wider) change neither the scores nor the kept part of the output, sliced back below.
        width = max(s.qk_head_dim, vd)
        q, k, v = (F.pad(t, (0, width - t.shape[-1])) if t.shape[-1] < width else t for t in (q, k, v))
        cache.append((k, v))
        k0, v0 = cache[0]
        chain_k, chain_v = [e[0] for e in cache[1:]], [e[1] for e in cache[1:]]
        out = ttt_attention(q, k0, v0, chain_k, chain_v, s.softmax_scale, layout, rows)[..., :vd]
        return self.o_proj(out.transpose(0, 1).reshape(L, h * vd))
