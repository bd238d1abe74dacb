"""The attention primitives every drafter kind trains with: rotary embedding, packed documents (`DocLayout`), the
rows later TTT steps run over (`QueryRows`, `loss_rows`), fused causal attention inside documents and the TTT
attention that merges the chain keys through a sink (`ttt_attention`). `model.py` builds the Llama-style drafter on
them, `mla.py` the multi-latent attention; both import from here, so neither imports the other at load.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def rope(
    x: torch.Tensor, positions: torch.Tensor, theta: float, cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
) -> torch.Tensor:
    """Rotary embedding (Llama's rotate-half layout) of x [..., L, D] at `positions` [L] (or at the angles
    `rope_angles` gave for them)."""
    d = x.shape[-1]
    cos, sin = cos_sin if cos_sin is not None else rope_angles(positions, d, theta)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def rope_angles(positions: torch.Tensor, d: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [L, d] fp32 of the rotary angles at `positions`: computed once per TTT step, used by q and k."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=positions.device) / d))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], -1)
    return angles.cos(), angles.sin()


def rms_norm(norm: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """`norm(x)` with the weight in x's dtype: under bf16 autocast an fp32 weight against a bf16 input misses
    the fused kernel ("Mismatch dtype between input and weight"); a no-op cast in fp32."""
    return F.rms_norm(x, norm.normalized_shape, norm.weight.to(x.dtype), norm.eps)


class DocLayout:
    """Documents (training windows) packed into one sequence of T = sum(lengths) tokens.

    Attention stays inside a document. Documents are grouped by length (longest first; a document joins
    a group while padding every member to the group's longest costs at most `waste` x the group's own
    causal work) and each group is one fused causal call over [docs, heads, longest, d], its documents
    padded at the END: under a causal mask no real query ever sees a padded key, so padding changes
    nothing. One document (or none given) is the plain, unpadded call. Built on the host from the
    lengths alone (no device value is read); `to` moves the index tensors (non_blocking from pinned
    memory on CUDA).
    """

    def __init__(self, lengths: Sequence[int], waste: float = 2.0, pin: bool = False):
        self.lengths = tuple(int(n) for n in lengths)
        T = sum(self.lengths)
        starts = [0]
        for n in self.lengths[:-1]:
            starts.append(starts[-1] + n)
        self.starts = tuple(starts)
        doc = torch.repeat_interleave(torch.arange(len(self.lengths)), torch.tensor(self.lengths, dtype=torch.long))
        self.doc_id = doc  # [T] the document of each token
        self.end = (
            torch.tensor(starts, dtype=torch.long)[doc] + torch.tensor(self.lengths, dtype=torch.long)[doc]
        )  # [T]
        order = sorted(range(len(self.lengths)), key=lambda i: -self.lengths[i])
        groups: list[list[int]] = []
        for i in order:
            g = groups[-1] if groups else None
            if g is not None:
                longest = self.lengths[g[0]]
                work = sum(self.lengths[j] ** 2 for j in g) + self.lengths[i] ** 2
                if (len(g) + 1) * longest**2 <= waste * work:
                    g.append(i)
                    continue
            groups.append([i])
        self.groups: list[
            tuple[int, int, torch.Tensor]
        ] = []  # (docs, longest, gather index [docs * longest] into T + 1)
        back = torch.empty(T, dtype=torch.long)
        offset = 0
        for g in groups:
            longest = self.lengths[g[0]]
            idx = torch.full((len(g), longest), T, dtype=torch.long)  # T: the zero row appended for padding
            for r, i in enumerate(g):
                a, n = self.starts[i], self.lengths[i]
                idx[r, :n] = torch.arange(a, a + n)
                back[a : a + n] = offset + r * longest + torch.arange(n)
            offset += len(g) * longest
            self.groups.append((len(g), longest, idx.reshape(-1)))
        self.back = back  # [T] where each token's row sits in the groups' outputs, concatenated
        if pin:
            self._map(lambda t: t.pin_memory())

    @property
    def single(self) -> bool:
        return len(self.lengths) <= 1

    def _map(self, fn) -> DocLayout:
        self.doc_id, self.end, self.back = fn(self.doc_id), fn(self.end), fn(self.back)
        self.groups = [(n, longest, fn(idx)) for n, longest, idx in self.groups]
        return self

    def to(self, device: torch.device, non_blocking: bool = False) -> DocLayout:
        """A copy on `device` (as `Tensor.to`: this layout keeps its own tensors where they are)."""
        return copy.copy(self)._map(lambda t: t.to(device, non_blocking=non_blocking))

    def padded_cost(self) -> int:
        """Query-key pairs the grouped calls compute (the useful causal work is about sum(L^2) / 2)."""
        return sum(n * longest * longest for n, longest, _ in self.groups)


class QueryRows:
    """The rows of a packed sequence (`DocLayout`) that TTT steps >= 1 run over: in each document, the suffix from
    `starts[i]` (an offset inside document i; its length for none) to its end.

    Their attention reads every step-0 key of the document up to the row (`fused_rows`): documents are grouped as
    `DocLayout` groups them (by the padded cost of their query rows times their keys against `waste` x the useful
    work), each group one fused call over [docs, heads, rows, keys] with an explicit mask (queries and keys padded
    at the end and masked out; column 0 the sink, seen by every row). Built on the host from lengths alone."""

    def __init__(self, lengths: Sequence[int], starts: Sequence[int], waste: float = 2.0, pin: bool = False):
        if len(starts) != len(lengths) or any(not 0 <= a <= n for a, n in zip(starts, lengths, strict=True)):
            raise ValueError(f"query-row starts {list(starts)} do not fit documents of lengths {list(lengths)}")
        doc_starts = [0]
        for n in lengths[:-1]:
            doc_starts.append(doc_starts[-1] + n)
        T = sum(lengths)
        self.index = torch.cat(
            [torch.arange(d + a, d + n) for d, a, n in zip(doc_starts, starts, lengths, strict=True)]
            or [torch.zeros(0, dtype=torch.long)]
        )  # [K] the rows, ascending
        K = len(self.index)
        row_starts = [0]
        for a, n in zip(starts[:-1], lengths[:-1], strict=True):
            row_starts.append(row_starts[-1] + n - a)
        docs = [i for i in range(len(lengths)) if starts[i] < lengths[i]]
        order = sorted(docs, key=lambda i: (-lengths[i], -(lengths[i] - starts[i])))
        groups: list[list[int]] = []
        for i in order:
            g = groups[-1] if groups else None
            if g is not None:
                rows = max(lengths[j] - starts[j] for j in [*g, i])
                work = sum((lengths[j] - starts[j]) * lengths[j] for j in [*g, i])
                if (len(g) + 1) * rows * lengths[g[0]] <= waste * work:
                    g.append(i)
                    continue
            groups.append([i])
        # (docs, rows M, keys N, query index [docs * M] into K + 1, key index [docs * N] into T + 1, mask)
        self.groups: list[tuple[int, int, int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        back = torch.empty(K, dtype=torch.long)
        offset = 0
        for g in groups:
            M, N = max(lengths[i] - starts[i] for i in g), lengths[g[0]]
            q_idx = torch.full((len(g), M), K, dtype=torch.long)  # K: the zero row appended for padding
            k_idx = torch.full((len(g), N), T, dtype=torch.long)
            mask = torch.zeros(len(g), 1, M, 1 + N, dtype=torch.bool)
            mask[..., 0] = True  # the sink, for padded rows too (a row that sees nothing would be NaN)
            for r, i in enumerate(g):
                a, n, m = starts[i], lengths[i], lengths[i] - starts[i]
                q_idx[r, :m] = torch.arange(row_starts[i], row_starts[i] + m)
                k_idx[r, :n] = torch.arange(doc_starts[i], doc_starts[i] + n)
                # row a + j of the document sees its keys 0..a + j
                mask[r, 0, :m, 1 : 1 + n] = torch.ones(m, n, dtype=torch.bool).tril(diagonal=a)
                back[row_starts[i] : row_starts[i] + m] = offset + r * M + torch.arange(m)
            offset += len(g) * M
            self.groups.append((len(g), M, N, q_idx.reshape(-1), k_idx.reshape(-1), mask))
        self.back = back  # [K] where each row's output sits in the groups' outputs, concatenated
        if pin:
            self._map(lambda t: t.pin_memory())

    def __len__(self) -> int:
        return len(self.index)

    def _map(self, fn) -> QueryRows:
        self.index, self.back = fn(self.index), fn(self.back)
        self.groups = [(n, M, N, fn(q), fn(k), fn(m)) for n, M, N, q, k, m in self.groups]
        return self

    def to(self, device: torch.device, non_blocking: bool = False) -> QueryRows:
        """A copy on `device` (this one keeps its tensors where they are)."""
        return copy.copy(self)._map(lambda t: t.to(device, non_blocking=non_blocking))


def loss_rows(
    lengths: Sequence[int], mask: torch.Tensor, steps: int, waste: float = 2.0, pin: bool = False
) -> QueryRows | None:
    """The `QueryRows` TTT steps 1..steps-1 need for a packed sequence of documents `lengths` with loss `mask` [T]
    (host tensor): row t of a document feeds the loss at step k >= 1 when token t+2+k is a completion token, so each
    document's suffix starts `steps + 1` rows before its first completion token at offset >= 3 (none: no rows). None
    when every row is needed (the plain causal path does the same work faster) or there is no step >= 1."""
    if steps < 2:
        return None
    starts, offset = [], 0
    for n in lengths:
        hits = (mask[offset + 3 : offset + n] != 0).nonzero()
        starts.append(max(0, int(hits[0, 0]) + 3 - 1 - steps) if len(hits) else n)
        offset += n
    if not any(starts):
        return None
    return QueryRows(lengths, starts, waste, pin)


SINK_CHANNELS = 8  # extra head channels carrying the sink (8 keeps GPU flash kernels' head-dim multiple of 8)


def fused_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, layout: DocLayout | None = None, sink: bool = False
) -> torch.Tensor:
    """Causal attention of [h, L, D] tensors by a fused kernel, inside each document of `layout`.

    4-D on purpose: given 3-D tensors, torch's CPU dispatch falls back to the math kernel, which
    materializes the scores (6x slower at L = 2048). `sink`: a key/value row is put before each
    document (key and value one-hot in channel D - SINK_CHANNELS, which the caller reserved) with a
    dummy query row, so query t sees the sink and its document's keys up to t; the sink rows are
    dropped from the output.
    """
    h, L, D = q.shape

    def call(qq, kk, vv):  # [n, h, l, D]
        if sink:
            row = qq.new_zeros(qq.shape[0], h, 1, D)
            one = row.clone()
            one[..., D - SINK_CHANNELS] = 1
            qq, kk, vv = torch.cat([row, qq], 2), torch.cat([one, kk], 2), torch.cat([one, vv], 2)
        out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale)
        return out[:, :, 1:] if sink else out

    if layout is None or layout.single:
        return call(q[None], k[None], v[None])[0]
    pad = q.new_zeros(h, 1, D)
    qp, kp, vp = torch.cat([q, pad], 1), torch.cat([k, pad], 1), torch.cat([v, pad], 1)
    outs = []
    for n, longest, idx in layout.groups:
        qg, kg, vg = (x.index_select(1, idx).view(h, n, longest, D).transpose(0, 1) for x in (qp, kp, vp))
        outs.append(call(qg, kg, vg).transpose(0, 1).reshape(h, n * longest, D))
    return torch.cat(outs, 1).index_select(1, layout.back)


def fused_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, rows: QueryRows) -> torch.Tensor:
    """`fused_causal(..., sink=True)` for the query rows `rows` only: q [h, K, D] (the rows), k and v [h, T, D] (every
    position); row t sees the sink and its document's keys up to t. Returns [h, K, D]."""
    h, K, D = q.shape
    pad = q.new_zeros(h, 1, D)
    qp, kp, vp = torch.cat([q, pad], 1), torch.cat([k, pad], 1), torch.cat([v, pad], 1)
    outs = []
    for n, M, N, q_idx, k_idx, mask in rows.groups:
        qg = qp.index_select(1, q_idx).view(h, n, M, D).transpose(0, 1)
        kg, vg = (x.index_select(1, k_idx).view(h, n, N, D).transpose(0, 1) for x in (kp, vp))
        one = q.new_zeros(n, h, 1, D)
        one[..., D - SINK_CHANNELS] = 1
        out = F.scaled_dot_product_attention(qg, torch.cat([one, kg], 2), torch.cat([one, vg], 2), mask, scale=scale)
        outs.append(out.transpose(0, 1).reshape(h, n * M, D))
    if not outs:
        return q
    return torch.cat(outs, 1).index_select(1, rows.back)


def ttt_attention(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    chain_k: Sequence[torch.Tensor],
    chain_v: Sequence[torch.Tensor],
    scale: float,
    layout: DocLayout | None = None,
    rows: QueryRows | None = None,
) -> torch.Tensor:
    """Attention of one TTT step: query t sees the step-0 keys at positions <= t of its document (causal)
    and, from each earlier chain step i >= 1, only its own position's key chain_k[i][t]. q, k0, v0,
    chain_* are [h, L, d]; `layout` the documents packed in L (None: one). Given `rows` (steps >= 1 only), q and
    chain_* hold those rows only, [h, K, d], and so does the result.

    Never materializes the [h, L, L] scores (at Kimi width, 56 heads x 4096^2 fp32 is 3.7 GB a step, kept
    for backward): the causal part is one fused `scaled_dot_product_attention` per document group and
    the chain part is [h, L, steps]. They are merged exactly through a sink: a key prepended to the
    causal keys whose score is a constant sigma (carried by an extra channel of q) and whose value is a
    one-hot extra channel. The fused call then returns A = Z_c out_c / (Z_c + e^sigma) and u = e^sigma /
    (Z_c + e^sigma), and with the chain's own sum Z_d out_d and r = Z_d e^-sigma, the softmax over all
    keys is (A + u r out_d) / ((1 - u) + u r), for any sigma. sigma ~ log Z_d keeps every term near 1
    (so bf16 is enough); it is a constant, so gradients flow through A, u, Z_d and out_d as they should.
    """
    if not chain_k:
        return fused_causal(q, k0, v0, scale, layout)
    h, L, d = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)  # the merge in fp32 at least
    chain_scores = torch.stack([(q * k).sum(-1) for k in chain_k], -1).to(acc) * scale  # [h, L, steps]
    lse_d = torch.logsumexp(chain_scores, -1)  # log Z_d
    out_d = (torch.softmax(chain_scores, -1).to(q.dtype)[..., None] * torch.stack(list(chain_v), -2)).sum(-2)
    carried = (lse_d.detach() / scale).to(q.dtype)  # what the kernel will see, rounded to q's dtype
    sigma = carried.to(acc) * scale

    zeros = q.new_zeros(h, L, SINK_CHANNELS)
    q_x = torch.cat([carried[..., None], zeros[..., 1:]], -1)
    pad0 = k0.new_zeros(*k0.shape[:-1], SINK_CHANNELS)
    q_in, k_in, v_in = torch.cat([q, q_x], -1), torch.cat([k0, pad0], -1), torch.cat([v0, pad0], -1)
    if rows is not None:
        out = fused_rows(q_in, k_in, v_in, scale, rows)
    else:
        out = fused_causal(q_in, k_in, v_in, scale, layout, sink=True)
    a, u = out[..., :d].to(acc), out[..., d].to(acc)
    ur = u * torch.exp(lse_d - sigma)
    return ((a + ur[..., None] * out_d.to(acc)) / ((1 - u) + ur)[..., None]).to(q.dtype)
