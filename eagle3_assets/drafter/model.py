"""The EAGLE-3 drafter, written to match SGLang's `LlamaForCausalLMEagle3` weight for weight.

    fc:        [3H_t] -> [H]           the target's three auxiliary hidden states, fused
    midlayer:  one Llama decoder layer whose attention reads cat[input_layernorm(embed(token)),
               hidden_norm(h)] (2H wide); residual = h
    norm, lm_head: [H] -> draft vocabulary; d2t maps a draft id to a target id (offset), t2d marks
               which target ids are in the draft vocabulary
The token embedding is the target's, frozen, and not part of the checkpoint (SGLang shares the
target's). The hidden state handed to the next draft step is the pre-norm residual sum, as in
SGLang's draft decode.

Training-time test (TTT) unrolls k draft steps. Step k at position t drafts the token k+2 places
ahead of t: its query sits at rope position t+k and attends to every step-0 key at positions
<= t (the verified context) plus its own chain's keys from steps 1..k at position t, exactly the
keys an inference-time chain rooted at t would have in its KV cache.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class DrafterConfig:
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096

    def to_dict(self) -> dict:
        return asdict(self)


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


def default_learning_rate(hidden_size: int) -> float:
    """AdamW peak rate by drafter width: SpecForge trains 4096-7168-wide drafters at 5e-5 to 1e-4; the
    narrow CPU stand-in learns in minutes at 2e-3."""
    if hidden_size >= 4096:
        return 1e-4
    if hidden_size >= 1024:
        return 3e-4
    return 2e-3


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (Llama's rotate-half layout) of x [..., L, D] at `positions` [L]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angles, angles], -1).cos().to(x.dtype), torch.cat([angles, angles], -1).sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


SINK_CHANNELS = 8  # extra head channels carrying the sink (8 keeps GPU flash kernels' head-dim multiple of 8)


def fused_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of [h, L, d] tensors by a fused kernel. 4-D on purpose: given 3-D tensors, torch's
    CPU dispatch falls back to the math kernel, which materializes the scores (6x slower at L = 2048)."""
    return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale)[0]


def ttt_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, chain_k: Sequence[torch.Tensor],
                  chain_v: Sequence[torch.Tensor], scale: float) -> torch.Tensor:
    """Attention of one TTT step: query t sees the step-0 keys at positions <= t (causal) and, from each
    earlier chain step i >= 1, only its own position's key chain_k[i][t]. q, k0, v0, chain_* are [h, L, d].

    Never materializes the [h, L, L] scores (at Kimi width, 56 heads x 4096^2 fp32 is 3.7 GB a step, kept
    for backward): the causal part is one fused `scaled_dot_product_attention` and the chain part is
    [h, L, steps]. They are merged exactly through a sink: a key prepended to the causal keys whose
    score is a constant sigma (carried by an extra channel of q) and whose value is a one-hot extra
    channel. The fused call then returns A = Z_c out_c / (Z_c + e^sigma) and u = e^sigma / (Z_c +
    e^sigma), and with the chain's own sum Z_d out_d and r = Z_d e^-sigma, the softmax over all keys is
    (A + u r out_d) / ((1 - u) + u r), for any sigma. sigma ~ log Z_d keeps every term near 1 (so bf16
    is enough); it is a constant, so gradients flow through A, u, Z_d and out_d as they should.
    A dummy query row keeps the causal square aligned (query t sees the sink and keys 0..t).
    """
    if not chain_k:
        return fused_causal(q, k0, v0, scale)
    h, L, d = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)  # the merge in fp32 at least
    chain_scores = torch.stack([(q * k).sum(-1) for k in chain_k], -1).to(acc) * scale  # [h, L, steps]
    lse_d = torch.logsumexp(chain_scores, -1)  # log Z_d
    out_d = (torch.softmax(chain_scores, -1).to(q.dtype)[..., None] * torch.stack(list(chain_v), -2)).sum(-2)
    carried = (lse_d.detach() / scale).to(q.dtype)  # what the kernel will see, rounded to q's dtype
    sigma = carried.to(acc) * scale

    extra = q.new_zeros(h, L + 1, SINK_CHANNELS)
    q_x, k_x, v_x = extra.clone(), extra.clone(), extra.clone()
    q_x[:, 1:, 0] = carried
    k_x[:, 0, 0] = 1
    v_x[:, 0, 0] = 1
    pad = q.new_zeros(h, 1, d)
    out = fused_causal(torch.cat([torch.cat([pad, q], 1), q_x], -1), torch.cat([torch.cat([pad, k0], 1), k_x], -1),
                       torch.cat([torch.cat([pad, v0], 1), v_x], -1), scale)[:, 1:]
    a, u = out[..., :d].to(acc), out[..., d].to(acc)
    ur = u * torch.exp(lse_d - sigma)
    return ((a + ur[..., None] * out_d.to(acc)) / ((1 - u) + ur)[..., None]).to(q.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """x [L, 2H] at one TTT step; `cache` holds (k, v) of earlier steps and receives this one's."""
        cfg = self.cfg
        L = x.shape[0]
        h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q = rope(self.q_proj(x).view(L, h, d).transpose(0, 1), positions, cfg.rope_theta)  # [h, L, d]
        k = rope(self.k_proj(x).view(L, kv, d).transpose(0, 1), positions, cfg.rope_theta)
        v = self.v_proj(x).view(L, kv, d).transpose(0, 1)
        if kv != h:
            k, v = k.repeat_interleave(h // kv, 0), v.repeat_interleave(h // kv, 0)
        cache.append((k, v))
        k0, v0 = cache[0]
        out = ttt_attention(q, k0, v0, [c[0] for c in cache[1:]], [c[1] for c in cache[1:]], 1.0 / math.sqrt(d))
        return self.o_proj(out.transpose(0, 1).reshape(L, h * d))


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
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, embeds, hidden, positions, cache):
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], -1)
        residual = self.self_attn(x, positions, cache) + residual
        return self.mlp(self.post_attention_layernorm(residual)) + residual


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, embed_weight: torch.Tensor, draft_ids: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
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

    def forward(self, aux: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """`unroll`, as a module call: DistributedDataParallel syncs gradients of what goes through `forward`."""
        return self.unroll(aux, tokens, positions, steps)

    def unroll(self, aux: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Draft logits of TTT steps 0..steps-1 for one sequence.

        aux [L, 3H_t] target aux hidden states; tokens [L] the sequence; step k at position t
        reads token t+1+k (teacher forcing) and returns logits over the draft vocabulary for the
        token at t+2+k. Positions whose inputs would run past the end are fed padding (id 0)
        and must be masked by the caller.
        """
        L = tokens.shape[0]
        hidden = self.fc(aux)
        cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        logits = []
        for k in range(steps):
            nxt = torch.zeros(L, dtype=torch.long, device=tokens.device)
            if L - 1 - k > 0:
                nxt[: L - 1 - k] = tokens[1 + k :]
            hidden = self.midlayer(self.embed(nxt), hidden, positions + k, cache)
            logits.append(self.lm_head(self.norm(hidden)))
        return logits
