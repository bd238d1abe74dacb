"""The EAGLE-3 drafter, written to match SGLang's `LlamaForCausalLMEagle3` weight for weight (kind `eagle3_llama`),
or its Kimi-K2.x MLA draft `Eagle3DeepseekV2ForCausalLM` (kinds `eagle3_mla`, `eagle3_1_mla`: see DRAFTER_KINDS).

    fc:        [3H_t] -> [H]           the target's three auxiliary hidden states, fused
    midlayer:  one Llama decoder layer whose attention reads cat[input_layernorm(embed(token)),
               hidden_norm(h)] (2H wide); residual = h
    norm, lm_head: [H] -> draft vocabulary; d2t maps a draft id to a target id (offset), t2d marks
               which target ids are in the draft vocabulary
The token embedding is the target's, frozen, and not part of the checkpoint (SGLang shares the
target's). The hidden state handed to the next draft step is the pre-norm residual sum, as in
SGLang's draft decode (EAGLE 3.1's `norm_output`: the normed one). The MLA kinds replace the attention by
`mla.MLAAttention` (q and kv LoRA projections, one rope key shared by the heads); EAGLE 3.1 adds `fc_norm`.

Training-time test (TTT) unrolls k draft steps. Step k at position t drafts the token k+2 places
ahead of t: its query sits at rope position t+k and attends to every step-0 key at positions
<= t (the verified context) plus its own chain's keys from steps 1..k at position t, exactly the
keys an inference-time chain rooted at t would have in its KV cache.

Steps 1..k-1 are read by the loss only near completion tokens: given `QueryRows`, they run over each
document's suffix from a few tokens before its first completion token (step 0 still runs over every
position: its keys are the context of every later step). On prompt-heavy data most of the work goes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from eagle3_assets.stages.eagle3_drafter.attention import (
    SINK_CHANNELS as SINK_CHANNELS,
)
from eagle3_assets.stages.eagle3_drafter.attention import (
    DocLayout as DocLayout,
)
from eagle3_assets.stages.eagle3_drafter.attention import (
    QueryRows as QueryRows,
)
from eagle3_assets.stages.eagle3_drafter.attention import (
    fused_causal as fused_causal,
)
from eagle3_assets.stages.eagle3_drafter.attention import (
    fused_rows as fused_rows,
)
from eagle3_assets.stages.eagle3_drafter.attention import (
    loss_rows as loss_rows,
)
from eagle3_assets.stages.eagle3_drafter.attention import (
    rms_norm as rms_norm,
)
from eagle3_assets.stages.eagle3_drafter.attention import (
    rope as rope,
)
from eagle3_assets.stages.eagle3_drafter.attention import (
    rope_angles as rope_angles,
)
from eagle3_assets.stages.eagle3_drafter.attention import (
    ttt_attention as ttt_attention,
)

if TYPE_CHECKING:
    from eagle3_assets.stages.eagle3_drafter.mla import MLAAttention, MLAShape


# The drafter kinds (`DrafterConfig.drafter_kind`), each the checkpoint layout of one SGLang 0.5.23 draft model:
#   eagle3_llama  LlamaForCausalLMEagle3: a Llama decoder layer (GQA attention); for Llama/Qwen-style targets
#   eagle3_mla    Eagle3DeepseekV2ForCausalLM (models/kimi_k25_eagle3.py): the same layer with DeepSeek-V2
#                 multi-latent attention (`mla.MLAAttention`), the draft KV cache as small as an MLA target's
#   eagle3_1_mla  the same with EAGLE 3.1's two flags: `fc_norm` (an RMSNorm per aux state before fc) and
#                 `norm_output` (the post-norm hidden, not the pre-norm residual sum, goes to the next draft step)
DRAFTER_KINDS = ("eagle3_llama", "eagle3_mla", "eagle3_1_mla")
MLA_KINDS = ("eagle3_mla", "eagle3_1_mla")
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@dataclass
class DrafterConfig:
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int  # MLA kinds: the heads (each has its own decompressed key)
    head_dim: int  # MLA kinds: qk_nope_head_dim + qk_rope_head_dim
    vocab_size: int  # the target's
    draft_vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    drafter_kind: str = "eagle3_llama"  # one of DRAFTER_KINDS
    # MLA kinds only (None otherwise): `mla.MLAShape`'s fields, named as in config.json
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    rope_scaling: dict[str, Any] | None = None  # `YarnScaling.to_config()`'s form (MLA kinds; None: no scaling)
    rope_interleave: bool = True  # DeepSeek's rope pairs (2i, 2i+1); False: rotate-half

    def __post_init__(self) -> None:
        if self.drafter_kind not in DRAFTER_KINDS:
            raise ValueError(f"drafter_kind {self.drafter_kind!r} is not one of {list(DRAFTER_KINDS)}")
        missing = [f for f in MLA_FIELDS if getattr(self, f) is None]
        if self.is_mla and missing:
            raise ValueError(f"a {self.drafter_kind} drafter needs its MLA shape: {missing} unset")

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def is_mla(self) -> bool:
        return self.drafter_kind in MLA_KINDS

    @property
    def fc_norm(self) -> bool:
        """EAGLE 3.1: an RMSNorm over each aux state before fc."""
        return self.drafter_kind == "eagle3_1_mla"

    @property
    def norm_output(self) -> bool:
        """EAGLE 3.1: the next draft step (and TTT step) gets the post-norm hidden, not the pre-norm residual sum."""
        return self.drafter_kind == "eagle3_1_mla"

    def mla_shape(self) -> MLAShape:
        from eagle3_assets.stages.eagle3_drafter.mla import MLAShape, YarnScaling

        if not self.is_mla:
            raise ValueError(f"a {self.drafter_kind} drafter has no MLA shape")
        return MLAShape(
            num_attention_heads=self.num_attention_heads,
            q_lora_rank=int(self.q_lora_rank or 0),
            kv_lora_rank=int(self.kv_lora_rank or 0),
            qk_nope_head_dim=int(self.qk_nope_head_dim or 0),
            qk_rope_head_dim=int(self.qk_rope_head_dim or 0),
            v_head_dim=int(self.v_head_dim or 0),
            rope_theta=self.rope_theta,
            rope_scaling=YarnScaling.from_config(self.rope_scaling, self.max_position_embeddings),
            rope_interleave=self.rope_interleave,
        )

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """The draft's KV cache per token in the server (one layer): MLA's latent and rope key, or GQA's keys and
        values."""
        from eagle3_assets.stages.eagle3_drafter.mla import llama_kv_bytes_per_token

        if self.is_mla:
            return self.mla_shape().kv_bytes_per_token(dtype_bytes)
        return llama_kv_bytes_per_token(self.num_key_value_heads, self.head_dim, dtype_bytes)

    @classmethod
    def of_width(cls, hidden_size: int, **fields: Any) -> DrafterConfig:
        """A drafter as wide as its target (`hidden_size`), with `default_shape`'s heads; `fields`: the rest."""
        heads, kv_heads, head_dim = default_shape(hidden_size)
        return cls(
            hidden_size=hidden_size,
            target_hidden_size=hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            **fields,
        )

    @classmethod
    def mla_of(cls, kind: str, hidden_size: int, shape: MLAShape, **fields: Any) -> DrafterConfig:
        """An MLA-kind drafter (`kind` in MLA_KINDS) `hidden_size` wide with attention `shape`; `fields`: the rest."""
        return cls(
            hidden_size=hidden_size,
            target_hidden_size=fields.pop("target_hidden_size", hidden_size),
            num_attention_heads=shape.num_attention_heads,
            num_key_value_heads=shape.num_attention_heads,
            head_dim=shape.qk_head_dim,
            drafter_kind=kind,
            q_lora_rank=shape.q_lora_rank,
            kv_lora_rank=shape.kv_lora_rank,
            qk_nope_head_dim=shape.qk_nope_head_dim,
            qk_rope_head_dim=shape.qk_rope_head_dim,
            v_head_dim=shape.v_head_dim,
            rope_theta=shape.rope_theta,
            rope_scaling=shape.rope_scaling.to_config() if shape.rope_scaling else None,
            rope_interleave=shape.rope_interleave,
            **fields,
        )


TP_SIZES = (1, 2, 4, 8)  # the tensor-parallel sizes a drafter must load at (Kimi-K2.5 serves at --tp 8)


def default_shape(hidden_size: int) -> tuple[int, int, int]:
    """(heads, kv heads, head dim) for a drafter of the target's width.

    Heads a multiple of 8 and 8 KV heads, so SGLang's and vLLM's attention split them at every
    TP size in `TP_SIZES` (see `loads_at_tp`); head dim 128 from 1024 wide on. A 7168-wide Kimi
    drafter gets 56 heads and 8 KV heads, as SpecForge's DeepSeek-V3 draft config has.
    """
    head_dim = 128 if hidden_size >= 1024 else max(8, hidden_size // 8)
    heads = max(8, 8 * round(hidden_size / head_dim / 8))
    return heads, 8, head_dim


def loads_at_tp(num_attention_heads: int, num_key_value_heads: int, tp: int) -> bool:
    """SGLang's and vLLM's rule: heads split evenly over TP ranks; KV heads split evenly, or are replicated
    when fewer than the ranks (then the rank count must be a multiple of them)."""
    if num_attention_heads % tp:
        return False
    return num_key_value_heads % tp == 0 if num_key_value_heads >= tp else tp % num_key_value_heads == 0


def mla_loads_at_tp(num_attention_heads: int, hidden_size: int, intermediate_size: int, tp: int) -> bool:
    """SGLang's rule for the EAGLE-3 MLA draft (models/kimi_k25_eagle3.py): DeepseekV2AttentionMLA asserts the heads
    split evenly over the attention TP ranks (q_b_proj, kv_b_proj and o_proj are split by head; the fused down
    projection is replicated); the dense MLP's intermediate size and the fc's output (the hidden size, a
    ColumnParallelLinear) split evenly too."""
    return num_attention_heads % tp == 0 and intermediate_size % tp == 0 and hidden_size % tp == 0


def default_learning_rate(hidden_size: int) -> float:
    """AdamW peak rate by drafter width: SpecForge trains 4096-7168-wide drafters at 5e-5 to 1e-4; the
    narrow CPU stand-in learns in minutes at 2e-3."""
    if hidden_size >= 4096:
        return 1e-4
    if hidden_size >= 1024:
        return 3e-4
    return 2e-3


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.cfg.head_dim)

    @property
    def cache_dims(self) -> tuple[int, int]:
        """(key, value) channels per head of what `project` returns (the incremental decoder caches them)."""
        return self.cfg.head_dim, self.cfg.head_dim

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [h, L, d] of the rows x [L, 2H] at `positions` [L]: rope on q and k, the KV heads repeated."""
        cfg = self.cfg
        L = x.shape[0]
        h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        cos_sin = rope_angles(positions, d, cfg.rope_theta)
        q = rope(self.q_proj(x).view(L, h, d).transpose(0, 1), positions, cfg.rope_theta, cos_sin)  # [h, L, d]
        k = rope(self.k_proj(x).view(L, kv, d).transpose(0, 1), positions, cfg.rope_theta, cos_sin)
        v = self.v_proj(x).view(L, kv, d).transpose(0, 1)
        if kv != h:
            k, v = k.repeat_interleave(h // kv, 0), v.repeat_interleave(h // kv, 0)
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
        L = x.shape[0]
        q, k, v = self.project(x, positions)
        cache.append((k, v))
        k0, v0 = cache[0]
        chain_k, chain_v = [c[0] for c in cache[1:]], [c[1] for c in cache[1:]]
        out = ttt_attention(q, k0, v0, chain_k, chain_v, self.scale, layout, rows)
        # the width written out: a step with no loss rows (L = 0, `loss_rows` of prompt-only windows) cannot infer -1
        return self.o_proj(out.transpose(0, 1).reshape(L, self.cfg.num_attention_heads * self.cfg.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn: Attention | MLAAttention
        if cfg.is_mla:
            from eagle3_assets.stages.eagle3_drafter.mla import MLAAttention

            self.self_attn = MLAAttention(cfg.hidden_size, cfg.mla_shape(), cfg.rms_norm_eps)
        else:
            self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, embeds, hidden, positions, cache, layout: DocLayout | None = None, rows: QueryRows | None = None):
        residual = hidden
        x = torch.cat([rms_norm(self.input_layernorm, embeds.to(hidden.dtype)), rms_norm(self.hidden_norm, hidden)], -1)
        residual = self.self_attn(x, positions, cache, layout, rows) + residual
        return self.mlp(rms_norm(self.post_attention_layernorm, residual)) + residual


class Eagle3Drafter(nn.Module):
    # buffers (registered in __init__), typed for the checker: nn.Module's attribute lookup says Tensor | Module
    embed_weight: torch.Tensor
    d2t: torch.Tensor
    t2d: torch.Tensor

    def __init__(self, cfg: DrafterConfig, embed_weight: torch.Tensor, draft_ids: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        # EAGLE 3.1: one RMSNorm per aux state, before fc (SGLang's `fc_norm.{i}.weight`)
        self.fc_norm = (
            nn.ModuleList(nn.RMSNorm(cfg.target_hidden_size, eps=cfg.rms_norm_eps) for _ in range(3))
            if cfg.fc_norm
            else None
        )
        self.midlayer = DecoderLayer(cfg)
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        # Frozen target embedding: used, never trained, never saved.
        self.register_buffer("embed_weight", embed_weight.detach().clone(), persistent=False)
        draft_ids = draft_ids.to(torch.long)
        self.register_buffer("d2t", draft_ids - torch.arange(len(draft_ids)))
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[draft_ids] = True
        self.register_buffer("t2d", t2d)

    @property
    def draft_ids(self) -> torch.Tensor:
        """Target id of every draft id."""
        return self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed_weight)

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """Step 0's hidden [L, H] from the target's aux states [L, 3H_t]: fc, after each state's norm (EAGLE 3.1)."""
        if self.fc_norm is not None:
            norms = [n for n in self.fc_norm if isinstance(n, nn.RMSNorm)]
            aux = torch.cat([rms_norm(n, a) for n, a in zip(norms, aux.chunk(len(norms), -1), strict=True)], -1)
        return self.fc(aux)

    def head(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits over the draft vocabulary, the hidden handed to the next draft step) of the layer's output `out`
        (the pre-norm residual sum): that sum itself, or under `norm_output` (EAGLE 3.1) its normed form."""
        normed = rms_norm(self.norm, out)
        return self.lm_head(normed), normed if self.cfg.norm_output else out

    def forward(
        self,
        aux: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        steps: int,
        layout: DocLayout | None = None,
        rows: QueryRows | None = None,
    ) -> list[torch.Tensor]:
        """`unroll`, as a module call: DistributedDataParallel syncs gradients of what goes through `forward`."""
        return self.unroll(aux, tokens, positions, steps, layout, rows)

    def unroll(
        self,
        aux: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        steps: int,
        layout: DocLayout | None = None,
        rows: QueryRows | None = None,
    ) -> list[torch.Tensor]:
        """Draft logits of TTT steps 0..steps-1 for one sequence, or for several packed into one (`layout`).

        aux [L, 3H_t] target aux hidden states; tokens [L] the sequence; step k at position t
        reads token t+1+k (teacher forcing) and returns logits over the draft vocabulary for the
        token at t+2+k. Positions whose inputs would run past the end of their document are fed
        padding (id 0) and must be masked by the caller. Given `rows` (`loss_rows`), steps >= 1 run over those
        rows only and their logits are [K, V] in the rows' order (step 0's stay [L, V]).
        """
        L = tokens.shape[0]
        hidden = self.project(aux)
        cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        logits = []
        t = torch.arange(L, device=tokens.device)
        end = layout.end if layout is not None else torch.full_like(t, L)
        for k in range(steps):
            if k == 1 and rows is not None:  # from here on, only the rows a later step's loss reads
                hidden, t, end, positions = (x.index_select(0, rows.index) for x in (hidden, t, end, positions))
            src = t + 1 + k
            nxt = torch.where(src < end, tokens[src.clamp(max=L - 1)], 0) if L else tokens
            at = rows if k >= 1 else None
            step_logits, hidden = self.head(self.midlayer(self.embed(nxt), hidden, positions + k, cache, layout, at))
            logits.append(step_logits)
        return logits


def train_flops_per_token(
    cfg: DrafterConfig, ttt_steps: int, mean_window: float, later_share: float = 1.0
) -> dict[str, float]:
    """Model FLOPs per trained token of one TTT unroll, forward and backward (the MFU numerator).

    Matmuls (2 FLOPs per multiply-add): forward fc 3H_t x H, then per TTT step the attention's projections
    (`attention_projection_macs`: q/k/v on 2H and o; MLA kinds their LoRA down and up projections and o), the gated
    MLP (3 x H x I) and lm_head H x V_draft; backward twice each forward matmul (input and weight gradients) except
    fc, whose input (the target's states) needs no gradient unless EAGLE 3.1's fc_norm weights come before it.
    Attention per step k, useful work only: a query averages (L + 1) / 2 causal keys in a window of L tokens plus k
    chain keys, 2 x heads x (key dim + value dim) FLOPs per query-key pair forward (QK^T and PV; MLA: nope + rope key
    channels, v_head_dim value channels), 2.5x that backward (FlashAttention's convention). Steps >= 1 run over
    `later_share` of the positions (`loss_rows`; 1: every one), each counted as an average query. Not counted: the
    frozen embedding, norms, elementwise work, the teacher (the target's head), the channels padded for the fused
    kernel, and padding. Returns {"linear", "attention", "total"}.
    """
    H, Ht, inter, V = cfg.hidden_size, cfg.target_hidden_size, cfg.intermediate_size, cfg.draft_vocab_size
    per_step = attention_projection_macs(cfg) + 3 * H * inter + H * V  # multiply-adds
    fc = 3 * Ht * H
    steps_run = min(1, ttt_steps) + max(0, ttt_steps - 1) * later_share  # step 0 everywhere, the rest on the share
    fc_backward = 2 if cfg.fc_norm else 1  # its weight's gradient; its input's too when fc_norm's weights train
    linear = 2 * (fc + steps_run * per_step) + 2 * 2 * (steps_run * per_step) + 2 * fc_backward * fc
    pairs = sum(((mean_window + 1) / 2 + k) * (1.0 if k == 0 else later_share) for k in range(ttt_steps))
    if cfg.is_mla:
        s = cfg.mla_shape()
        key_dim, value_dim = s.qk_head_dim, s.v_head_dim
    else:
        key_dim = value_dim = cfg.head_dim
    attention = 2 * cfg.num_attention_heads * (key_dim + value_dim) * pairs * (1 + 2.5)
    return {"linear": float(linear), "attention": float(attention), "total": float(linear + attention)}


def attention_projection_macs(cfg: DrafterConfig) -> int:
    """Multiply-adds per token of the attention's projections at one TTT step (its input is 2H wide)."""
    H = cfg.hidden_size
    if cfg.is_mla:
        s = cfg.mla_shape()
        h = s.num_attention_heads
        down = 2 * H * (s.q_lora_rank + s.kv_lora_rank + s.qk_rope_head_dim)  # q_a_proj and kv_a_proj_with_mqa
        up = s.q_lora_rank * h * s.qk_head_dim + s.kv_lora_rank * h * (s.qk_nope_head_dim + s.v_head_dim)
        return down + up + h * s.v_head_dim * H  # and o_proj
    qd, kvd = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return 2 * H * (qd + 2 * kvd) + qd * H
