"""Benchmark: the drafter's training-time-test attention, fused against written out (the peer).

    .venv/bin/python benchmarks/ttt_attention.py [--device cpu|cuda] [--shape standin|kimi] [--lengths 354,2048,4096]

One TTT unroll's attention (steps 0..6, as `ttt_steps: 7`), forward and backward, at one window
length. Fused: `eagle3_assets.stages.eagle3_drafter.model.ttt_attention` (one causal scaled_dot_product_attention
per step, the chain keys merged through a sink; never holds [heads, L, L]). Peer: the same
attention with every score materialized, [heads, L, L + steps] per step, as this project's drafter
computed it before (and kept for backward). Prints seconds per unroll, the bytes autograd keeps
for backward (`saved_tensors_hooks`: what a training step holds per layer), on CUDA the allocator's
peak, and the ratios.
Shapes: `standin` 8 heads x 8 (H = 64, the stand-in), `kimi` 56 heads x 128 (a Kimi-K2.5 drafter).
Figures: docs/pipeline.md, "The drafter: training, and what it buys".
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3_assets.stages.eagle3_drafter.model import ttt_attention  # noqa: E402

SHAPES = {"standin": (8, 8), "kimi": (56, 128)}


def written_out(q, k0, v0, chain_k, chain_v, scale):
    """The peer: all scores materialized (the drafter's attention before the fused one)."""
    L = q.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    scores = [(q @ k0.transpose(1, 2) * scale).masked_fill(~causal, float("-inf"))]
    scores += [(q * k).sum(-1, keepdim=True) * scale for k in chain_k]
    probs = torch.softmax(torch.cat(scores, -1).float(), -1).to(q.dtype)
    out = probs[..., :L] @ v0
    for i, v in enumerate(chain_v):
        out = out + probs[..., L + i : L + i + 1] * v
    return out


def unroll(attn, h, L, d, steps, device, dtype) -> tuple[float, float, float]:
    """(seconds, MiB saved for backward, CUDA peak MiB above the inputs or nan) of forward + backward over
    `steps` TTT steps, each with fresh q and its own step's k, v (as the drafter's layer produces them)."""
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        [torch.randn(h, L, d, generator=g, device=device, dtype=dtype, requires_grad=True) for _ in range(steps)]
        for _ in range(3)
    )
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device == "cuda" else 0
    t = time.perf_counter()
    total = 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for s in range(steps):
            out = attn(q[s], k[0], v[0], k[1 : s + 1], v[1 : s + 1], 1 / math.sqrt(d))
            total = total + out.float().square().mean()
    assert isinstance(total, torch.Tensor)  # steps >= 1
    total.backward()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device == "cuda" else float("nan")
    return seconds, sum(saved) / 2**20, peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), default="standin")
    p.add_argument("--lengths", default="354,2048")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the figures here, as JSON")
    a = p.parse_args()
    figures = {
        "device": a.device,
        "shape": a.shape,
        "heads": SHAPES[a.shape][0],
        "head_dim": SHAPES[a.shape][1],
        "steps": a.steps,
        "lengths": {},
    }
    h, d = SHAPES[a.shape]
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    print(
        f"{a.device}, {a.shape} ({h} heads x {d}), {dtype}, {a.steps} TTT steps, forward + backward, "
        f"best of {a.repeats}" + (f", {torch.get_num_threads()} threads" if a.device == "cpu" else "")
    )
    for L in (int(x) for x in a.lengths.split(",")):
        rows = {}
        for name, attn in (("fused", ttt_attention), ("written out", written_out)):
            runs = [unroll(attn, h, L, d, a.steps, a.device, dtype) for _ in range(a.repeats)]
            rows[name] = (min(r[0] for r in runs), runs[0][1], max(r[2] for r in runs))
        (tf, sf, pf), (tw, sw, pw) = rows["fused"], rows["written out"]
        peak = f", CUDA peak {pf:,.0f} vs {pw:,.0f} MiB" if a.device == "cuda" else ""
        print(
            f"L {L:>5}: fused {tf * 1e3:8.1f} ms, {sf:7,.0f} MiB kept for backward | "
            f"written out (peer) {tw * 1e3:8.1f} ms, "
            f"{sw:7,.0f} MiB | {tw / tf:5.2f}x faster, {sw / sf:5.1f}x less kept{peak}"
        )
        figures["lengths"][L] = {
            "fused_ms": round(tf * 1e3, 2),
            "written_out_ms": round(tw * 1e3, 2),
            "fused_saved_mib": round(sf, 1),
            "written_out_saved_mib": round(sw, 1),
            "fused_cuda_peak_mib": None if pf != pf else round(pf, 1),
            "written_out_cuda_peak_mib": None if pw != pw else round(pw, 1),
        }
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
