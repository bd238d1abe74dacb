"""Benchmark: hidden-state extraction tokens/s against a bare forward pass of the same model (the limit).

    python benchmarks/hidden_states_throughput.py                      # CPU: a stand-in-shaped DeepseekV3
    python benchmarks/hidden_states_throughput.py --model DIR          # any HF folder (e.g. the built stand-in)
    python benchmarks/hidden_states_throughput.py --device cuda --hidden 2048 --layers 8   # a GPU host

Both sides run the same model on the same device over the same batches (the store's own grouping
by `--batch-tokens`, right-padded with an attention mask):
  bare forward   `model.model(ids, attention_mask)`, nothing kept: what any extraction must pay;
  extraction     `extract_to_store`: hooks on the EAGLE-3 layers, per-sample slicing, bf16 copy
                 to the host, the finite check, shards serialized, checksummed, fsynced and
                 committed by background writers into a temporary directory on `--dir`'s disk.
The ratio extraction / bare is the figure the goal (>= 0.8) is about. Without `--model` the target
is a DeepseekV3 with random weights, of the stand-in's shape on CPU (hidden 64, 8 layers) or of
the given `--hidden` / `--layers` (mid-size, MLA + MoE like Kimi-K2.5). Needs torch, transformers
and safetensors only (no Dagster, no polars), so it runs as is on a bare GPU machine.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a plain checkout, installed or not

from eagle3_resources.hidden_states.extract import (  # noqa: E402
    StoreSettings,
    batches,
    extract_to_store,
    store_figures,
)
from eagle3_resources.hidden_states.store import StoredSample  # noqa: E402
from eagle3_resources.hidden_states.transformers_backend import (  # noqa: E402
    TransformersHiddenStates,
)


def random_deepseek_v3(hidden: int, layers: int, vocab: int):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    heads = max(4, hidden // 128)
    cfg = DeepseekV3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=max(32, hidden // 4),
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads, first_k_dense_replace=1,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        q_lora_rank=max(32, hidden // 4), kv_lora_rank=max(16, hidden // 8), qk_nope_head_dim=max(8, hidden // heads // 2),
        qk_rope_head_dim=max(8, hidden // heads // 4), v_head_dim=max(16, hidden // heads // 2),
        max_position_embeddings=16384, pad_token_id=0,
    )
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(cfg)


def sequences(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[StoredSample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        L = rng.randint(lo, hi)
        out.append(StoredSample(f"bench/{i}", "train", [rng.randrange(1, vocab) for _ in range(L)], [1] * L))
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def bare_forward(backend: TransformersHiddenStates, samples: list[StoredSample], batch_tokens: int) -> float:
    """Seconds for the same batches through the model, outputs dropped."""
    device = backend.device
    sync(device)
    start = time.perf_counter()
    for group in batches([len(s.input_ids) for s in samples], batch_tokens):
        ids, mask = backend.padded([list(samples[i].input_ids) for i in group])
        backend.model.model(input_ids=ids, attention_mask=mask, use_cache=False)
    sync(device)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="an HF model folder; unset = random DeepseekV3")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=163840)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--min-len", type=int, default=200)
    p.add_argument("--max-len", type=int, default=1200)
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--shard-gb", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of each side; the best of each is reported")
    p.add_argument("--dir", default=None, help="where the temporary store is written (default: the system temp dir)")
    a = p.parse_args()

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device)
    dtype = getattr(torch, ("bfloat16" if device.type == "cuda" else "float32") if a.dtype == "auto" else a.dtype)
    if a.model:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype)
        name = Path(a.model).name
    else:
        model = random_deepseek_v3(a.hidden, a.layers, a.vocab).to(dtype)
        name = f"random DeepseekV3 hidden {a.hidden}, {a.layers} layers"
    model = model.to(device).eval()
    backend = TransformersHiddenStates(model)
    samples = sequences(a.samples, a.min_len, a.max_len, model.config.vocab_size)
    tokens = sum(len(s.input_ids) for s in samples)
    settings = StoreSettings(shard_bytes=int(a.shard_gb * 1e9), batch_tokens=a.batch_tokens)
    print(f"{name} on {device} ({str(dtype).removeprefix('torch.')}), {torch.get_num_threads()} CPU threads; "
          f"{len(samples)} samples, {tokens:,} tokens, batch budget {a.batch_tokens:,} tokens, layers {backend.layer_ids}")

    bare_forward(backend, samples[:4], a.batch_tokens)  # warm-up: allocator, kernels, page cache
    bare_s, extract_s, figures = [], [], {}
    for _ in range(a.rounds):
        bare_s.append(bare_forward(backend, samples, a.batch_tokens))
        with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
            sync(device)
            start = time.perf_counter()
            extract_to_store(samples, backend, Path(tmp), settings, identity={"bench": name}, log=lambda m: None,
                             progress_every_s=3600)
            sync(device)
            extract_s.append(time.perf_counter() - start)
            figures = store_figures(Path(tmp))
    bare, extract = tokens / min(bare_s), tokens / min(extract_s)
    print(f"bare forward   {bare:12,.0f} tok/s   (best of {a.rounds}: {min(bare_s):.2f} s)")
    print(f"extraction     {extract:12,.0f} tok/s   (best of {a.rounds}: {min(extract_s):.2f} s, "
          f"{figures['bytes'] / 1e6:,.1f} MB in {figures['shards']} shard(s))")
    print(f"ratio extraction / bare forward: {extract / bare:.3f}   (goal >= 0.8)")
    print(f"bytes per token {figures['bytes_per_token']:,.1f} vs minimum {figures['min_bytes_per_token']:,} "
          f"((3 + 1) x H x 2): overhead {figures['overhead_pct']:.2f}%   (goal <= 2%)")


if __name__ == "__main__":
    main()
