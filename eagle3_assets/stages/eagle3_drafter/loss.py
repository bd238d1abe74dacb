"""Soft cross-entropy of draft logits against the teacher's distribution, in row chunks.

    loss = sum_t w_t * ( -sum_v p[j_t, v] * log_softmax(z_t)_v )
         = sum_t w_t * (lse(z_t) * sum_v p[j_t, v] - p[j_t] . z_t)

The plain autograd form (`-(p[j] * log_softmax(z.float())).sum(-1)`) holds several fp32 [tokens,
vocab] tensors per TTT step for backward (z in fp32, its log-softmax, the gathered p, the product):
~2 GB a step at Kimi width (4,096 tokens x 32,000). This one keeps only the logits (already held by
the lm_head) and one fp32 log-sum-exp per row; forward and backward work on `chunk_rows` rows at a
time, the backward recomputing softmax(z) - p per chunk (d loss / d z_t = w_t * (softmax(z_t) * sum p - p)).
"""

from __future__ import annotations

import torch


class _SoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, logits: torch.Tensor, target_p: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, chunk_rows: int
    ) -> torch.Tensor:
        n, acc = logits.shape[0], torch.promote_types(logits.dtype, torch.float32)
        lse = torch.empty(n, dtype=acc, device=logits.device)
        total = torch.zeros((), dtype=acc, device=logits.device)
        # autocast off: it would run vecdot (on its lower-precision list, CPU's and CUDA's) in bf16, whatever `acc`
        with torch.autocast(logits.device.type, enabled=False):
            for a in range(0, n, chunk_rows):
                z = logits[a : a + chunk_rows].to(acc)
                p = target_p.index_select(0, rows[a : a + chunk_rows]).to(acc)
                lse[a : a + chunk_rows] = lz = torch.logsumexp(z, -1)
                ce = lz * p.sum(-1) - torch.linalg.vecdot(p, z)
                total = total + (weight[a : a + chunk_rows] * ce).sum()
        ctx.save_for_backward(logits, target_p, rows, weight, lse)
        ctx.chunk_rows = chunk_rows
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, target_p, rows, weight, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        step = ctx.chunk_rows
        for a in range(0, logits.shape[0], step):
            z = logits[a : a + step].to(lse.dtype)
            p = target_p.index_select(0, rows[a : a + step]).to(lse.dtype)
            c = (weight[a : a + step] * grad_out)[:, None]
            g = torch.exp(z - lse[a : a + step, None]).mul_(c * p.sum(-1, keepdim=True)).addcmul_(p, c, value=-1)
            grad[a : a + step] = g.to(grad.dtype)
        return grad, None, None, None, None


def soft_cross_entropy(
    logits: torch.Tensor,
    target_p: torch.Tensor,
    rows: torch.Tensor,
    weight: torch.Tensor,
    chunk_elements: int = 1 << 26,
) -> torch.Tensor:
    """sum_t weight[t] * CE(target_p[rows[t]], softmax(logits[t])): logits [N, V] (any float dtype), target_p
    [M, V] probabilities, rows [N] long, weight [N] float (no gradient). A scalar, in fp32 (fp64 for fp64 logits)."""
    chunk_rows = max(1, chunk_elements // max(1, logits.shape[-1]))
    return _SoftCrossEntropy.apply(
        logits, target_p, rows, weight.to(torch.promote_types(logits.dtype, torch.float32)), chunk_rows
    )
