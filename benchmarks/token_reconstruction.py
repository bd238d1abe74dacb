"""Benchmark: tokens/s of the full token-id reconstruction vs a raw encode of the same text.

    .venv/bin/python benchmarks/token_reconstruction.py [--rows 2000] [--tokenizer DIR]

Both sides use the same tokenizer (the stand-in by default, or a real Kimi folder) and the same
texts: N synthetic completions shaped like Kimi's (reasoning ~1,000 tokens, content ~600, mixed
English/Chinese/code/emoji). "raw encode" is `encode_batch` of the reasoning and content texts,
the floor any reconstruction pays. "reconstruction" is `build_token_ids`: both encodes, the
completion and prompt ids, the loss mask, the per-sample proof (separator count, end token,
billed-count and prompt-count differences, decode round trip) and the Parquet-ready frame.
The ratio (reconstruction / raw) is the figure the goal (>= 0.7 on 2 cores) is about.
"""

from __future__ import annotations

import argparse
import os
import random
import time

import polars as pl

from eagle3_assets.stages.completions.run import COMPLETION_COLUMNS
from eagle3_assets.stages.token_ids.reconstruct import build_token_ids
from eagle3_resources.storage import default_data_dir
from eagle3_resources.tokenizer.resource import TokenizerResource

PIECES = [
    "Let me think about this step by step.",
    "First, we compute the sum of the series.",
    "数据模型推理答案检查步骤结果",
    "def f(x):\n    return x * 2\n",
    "The answer is 42.",
    "😀 emoji 👩‍💻 and flags 🇯🇵",
    "    indented   whitespace\t\trun",
    "Therefore the result holds for every n ≥ 1.",
    "我们首先检查条件，然后计算结果。",
    "```python\nprint('hi')\n```",
]


def synthetic(n: int, seed: int = 0) -> pl.DataFrame:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        reasoning = " ".join(rng.choice(PIECES) for _ in range(120))
        content = " ".join(rng.choice(PIECES) for _ in range(70))
        rows.append(
            {
                "prompt_id": f"p{i}",
                "dataset": "bench",
                "status": "ok",
                "finish_reason": "stop",
                "reasoning": reasoning,
                "content": content,
                "prompt_ids": list(range(1000, 1400)),
                "cost_usd": 0.0,
                "attempts": 1,
                "completion_tokens": None,
                "prompt_tokens": 400,
                "messages_json": "[]",
            }
        )
    return pl.DataFrame(rows, schema=COMPLETION_COLUMNS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    tok = TokenizerResource(path=args.tokenizer, standin_dir=str(default_data_dir() / "standin")).load()
    df = synthetic(args.rows)
    texts = df["reasoning"].to_list() + df["content"].to_list()
    n_tokens = sum(len(ids) for ids in tok.encode_batch(texts))
    raw, full = [], []
    for _ in range(args.repeat):
        t = time.perf_counter()
        tok.encode_batch(texts)
        raw.append(time.perf_counter() - t)
        t = time.perf_counter()
        out = build_token_ids(df, tok)
        full.append(time.perf_counter() - t)
    raw_tps, full_tps = n_tokens / min(raw), n_tokens / min(full)
    print(f"{args.rows} completions, {n_tokens:,} completion tokens, {os.cpu_count()} cores, best of {args.repeat}")
    print(f"raw encode_batch:          {raw_tps:>12,.0f} tokens/s")
    print(f"full reconstruction:       {full_tps:>12,.0f} tokens/s   ({out.height} rows)")
    print(f"ratio reconstruction/raw:  {full_tps / raw_tps:.2f}")


if __name__ == "__main__":
    main()
