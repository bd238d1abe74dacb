"""Estimate: the GPU memory a drafter training step needs at any width, computed on a CPU without a GPU.

    .venv/bin/python benchmarks/drafter_step_memory.py                  # Kimi-K2.5 width, a 4,096-token step
    .venv/bin/python benchmarks/drafter_step_memory.py --batch-tokens 8192 --gpu-gib 79.1

Before a GPU is lent (or a card bought), whether a step of a given width and size fits. The step is the trainer's
on CUDA (`Trainer.step`): the frozen target embedding and the teacher's head in bf16, the teacher's draft-vocabulary
distribution in fp32, bf16 autocast over fp32 master weights, `packed_loss` over 7 TTT steps, backward, gradient
clipping and fused AdamW; two steps, so the second runs with the optimizer's state. It runs on fake tensors
(`FakeTensorMode`: shapes and dtypes, no data, no arithmetic) on the CPU, and torch's `MemTracker` follows every
storage alive and reports the peak by kind (parameters, buffers, gradients, activations, optimizer state, other).

An estimate, not a measurement: the CUDA caching allocator's rounding and fragmentation, cuBLAS workspaces and the
CUDA context (about 0.5-1 GiB) come on top; autocast's CPU op list stands in for CUDA's (the matmuls and attention
are on both); the attention kernel is the CPU's fused one (CUDA's flash kernel keeps the same output and log-sum-exp
for backward); RMSNorm is CUDA's fused kernel (`CudaRmsNorm`: the CPU's composite would keep fp32 copies of its
input, 4.1 GiB more at Kimi width); torch.compile's MLP, which may keep less, is not modelled.
`drafter_training_speed.py --device cuda` reports the real `peak_gpu_mib`. Needs torch only (and this project's
drafter modules).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3_assets.stages.eagle3_drafter.data import PackedBatch  # noqa: E402
from eagle3_assets.stages.eagle3_drafter.model import DocLayout, DrafterConfig, Eagle3Drafter  # noqa: E402
from eagle3_assets.stages.eagle3_drafter.train import TrainSettings, packed_loss  # noqa: E402

GIB = 2**30


class CudaRmsNorm(torch.autograd.Function):
    """`F.rms_norm` as CUDA runs it when the input and the weight share a dtype (the drafter's `rms_norm` sees to
    that): one fused kernel (`_fused_rms_norm`) whose backward keeps the input, the weight and an fp32 rstd
    [..., 1]. On the CPU the same call decomposes into fp32 steps that autograd keeps, several [tokens, hidden]
    fp32 tensors a norm, which a CUDA step never holds. The backward's values do not matter here (fake tensors):
    only what it keeps and allocates."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (x.float() * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, _ = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(weight), None


@contextmanager
def cuda_rms_norm():
    """`F.rms_norm` dispatched as on CUDA for as long as the context lasts: the fused kernel where input and weight
    share a dtype, the composite where they differ (CUDA falls back so too, with a warning). A norm over several
    dimensions also takes the composite: the drafter has none, and `CudaRmsNorm` keeps one rstd per last-axis row."""
    composite = torch.nn.functional.rms_norm

    def rms_norm(x, normalized_shape, weight=None, eps=None):
        if weight is None or weight.dtype != x.dtype or len(normalized_shape) != 1:
            return composite(x, normalized_shape, weight, eps)
        return CudaRmsNorm.apply(x, weight, torch.finfo(x.dtype).eps if eps is None else eps)

    with mock.patch.object(torch.nn.functional, "rms_norm", rms_norm):
        yield


def drafter_config(a: argparse.Namespace) -> DrafterConfig:
    return DrafterConfig.of_width(
        a.hidden,
        intermediate_size=a.intermediate or 2 * a.hidden,
        vocab_size=a.target_vocab,
        draft_vocab_size=a.draft_vocab,
        max_position_embeddings=max(4096, a.max_len),
    )


def document_lengths(batch_tokens: int, min_len: int, max_len: int, seed: int = 0) -> list[int]:
    """Windows of random length filling the step exactly (the last one cut), as a packed step holds them."""
    rng, lengths = random.Random(seed), list[int]()
    while sum(lengths) < batch_tokens:
        lengths.append(min(rng.randint(min_len, max_len), batch_tokens - sum(lengths)))
    return lengths


def fake_batch(cfg: DrafterConfig, lengths: list[int], layout: DocLayout) -> PackedBatch:
    """A packed step as the trainer receives it on the GPU (bf16 hidden states), on fake tensors; `layout`, built
    from the lengths on the host, is real (its index tensors depend on the lengths, which fake tensors cannot)."""
    T = sum(lengths)
    return PackedBatch(
        tokens=torch.randint(0, cfg.vocab_size, (T,)),
        positions=torch.arange(T),
        mask=torch.ones(T, dtype=torch.long),
        aux=torch.empty(T, 3 * cfg.target_hidden_size, dtype=torch.bfloat16),
        final=torch.empty(T, cfg.target_hidden_size, dtype=torch.bfloat16),
        layout=layout,
        keys=[(f"w{i}", 0, n) for i, n in enumerate(lengths)],
    )


def step_memory(cfg: DrafterConfig, lengths: list[int], ttt_steps: int = 7) -> dict:
    """The peak of two training steps' live storages, by kind, in bytes (and the trainable parameter count)."""
    tracker = MemTracker()
    layout = DocLayout(lengths, waste=2.0)  # as the trainer packs a GPU step
    with FakeTensorMode(allow_non_fake_inputs=True):  # the layout's host-built index tensors are real ones
        embed = torch.empty(cfg.vocab_size, cfg.hidden_size)  # fp32, as the target folder gives it
        draft_ids = torch.arange(cfg.draft_vocab_size)
        model = Eagle3Drafter(cfg, embed, draft_ids)
        model.embed_weight = model.embed_weight.to(torch.bfloat16)  # as `Trainer` on CUDA: frozen, bf16
        # the teacher's: the target's head (for the argmax of windows not cached yet) and its draft-vocabulary rows
        head = torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=torch.bfloat16)
        head_draft = head[draft_ids]
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, betas=(0.9, 0.95), fused=True)
        settings = TrainSettings(ttt_steps=ttt_steps, batch_tokens=sum(lengths), max_len=max(lengths))
        tracker.track_external(model, opt, head, head_draft)
        with tracker, cuda_rms_norm():
            for step in range(2):
                if step:
                    tracker.reset_mod_stats()  # the tracker's per-module figures are per forward; the peak stays
                batch = fake_batch(cfg, lengths, layout)
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=torch.bfloat16):  # CUDA's autocast, on the CPU's op list
                    teacher_p = torch.softmax((batch.final @ head_draft.T).float(), -1)
                    teacher_argmax = torch.randint(0, cfg.vocab_size, (batch.tokens.shape[0],))
                    loss, _ = packed_loss(model, model, batch, teacher_p, teacher_argmax, settings, len(lengths))
                    loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 0.5)
                opt.step()
    peak = {
        str(getattr(kind, "value", kind)): n
        for kind, n in next(iter(tracker.get_tracker_snapshot("peak").values())).items()
    }
    return {"peak_bytes": peak, "trainable_parameters": sum(p.numel() for p in params)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # the defaults: the device check's train_kimi section
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--intermediate", type=int, default=18432, help="0: 2 x hidden")
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--target-vocab", type=int, default=163840)
    p.add_argument("--batch-tokens", type=int, default=4096, help="tokens in one optimizer step")
    p.add_argument("--min-len", type=int, default=512, help="the shortest window in the step")
    p.add_argument("--max-len", type=int, default=2048, help="the longest window in the step")
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--gpu-gib", type=float, default=None, help="also say whether the estimate fits this many GiB")
    p.add_argument("--json", default=None, help="also write the figures here")
    return p.parse_args(argv)


def estimate(a: argparse.Namespace) -> dict:
    cfg = drafter_config(a)
    lengths = document_lengths(a.batch_tokens, a.min_len, a.max_len)
    found = step_memory(cfg, lengths, a.ttt_steps)
    peak = found["peak_bytes"]
    figures = {
        "config": cfg.to_dict(),
        "window_lengths": lengths,
        "trainable_parameters": found["trainable_parameters"],
        "peak_gib_by_kind": {k: round(v / GIB, 2) for k, v in peak.items() if k != "Total"},
        "peak_gib": round(peak["Total"] / GIB, 2),
        "note": "live storages under fake tensors; the CUDA allocator's caching, cuBLAS workspaces and the context "
        "(~0.5-1 GiB) come on top",
    }
    if a.gpu_gib is not None:
        figures["gpu_gib"] = a.gpu_gib
        figures["headroom_gib"] = round(a.gpu_gib - figures["peak_gib"], 2)
    return figures


def main() -> None:
    a = parse_args()
    figures = estimate(a)
    print(
        f"drafter width {a.hidden}, {figures['trainable_parameters'] / 1e9:.3f} B trainable parameters, a "
        f"{a.batch_tokens:,}-token step: peak {figures['peak_gib']} GiB of live tensors ("
        + ", ".join(f"{k.lower()} {v}" for k, v in figures["peak_gib_by_kind"].items())
        + ")"
        + ("" if a.gpu_gib is None else f"; {figures['headroom_gib']} GiB left of {a.gpu_gib}")
    )
    print(json.dumps(figures))
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
