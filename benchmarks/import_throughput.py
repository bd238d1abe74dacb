"""Benchmark: importing a real-size prompt set, and what the rank-first filters save.

    .venv/bin/python benchmarks/import_throughput.py [--rows 200000] [--cap 15000] [--answer-chars 1500]

Writes an ultrachat_200k-shaped Parquet source (`prompt`, `prompt_id`, `messages` with 1-3 user
turns and answers of `--answer-chars` characters, English with some French, as B6 has) and imports
it with B6's settings (languages [en], max_prompt_tokens 16384) through the project's importer and
the stand-in Kimi-layout tokenizer (same tiktoken engine, Kimi's split regex, 163,584 ranks).

Peer, in the same run: the same import with the filters applied to every row before sampling (the
obvious way: filter, then sample), which must select exactly the same prompts. Also printed: a bare
polars read of the same file, the floor any importer pays. The figures give docs/real-prompts.md's estimates
for the full-size sets (rows per second x rows of each source).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable from a plain checkout, installed or not

from eagle3_assets.common.registry import DatasetSpec, ImportSpec  # noqa: E402
from eagle3_assets.stages.raw_prompts.importers.build import source_rows  # noqa: E402
from eagle3_assets.stages.raw_prompts.importers.importer import PromptLength, import_prompts  # noqa: E402
from eagle3_resources.source_files import SourceRow  # noqa: E402
from eagle3_resources.tokenizer.chat_format import render_messages  # noqa: E402
from eagle3_resources.tokenizer.resource import TokenizerResource  # noqa: E402

WORDS = [
    "the",
    "history",
    "of",
    "printing",
    "changed",
    "how",
    "people",
    "read",
    "and",
    "wrote",
    "letters",
    "about",
    "science",
    "art",
    "music",
    "travel",
    "food",
    "cities",
    "rivers",
    "mountains",
    "energy",
    "climate",
    "markets",
    "code",
    "data",
    "systems",
    "design",
    "health",
    "sport",
    "language",
]
FRENCH = [
    "la",
    "mer",
    "est",
    "calme",
    "ce",
    "soir",
    "et",
    "nous",
    "parlons",
    "de",
    "la",
    "musique",
    "des",
    "livres",
    "et",
    "des",
    "villes",
    "anciennes",
]


def text(rng: random.Random, n_words: int, words=WORDS) -> str:
    return " ".join(rng.choice(words) for _ in range(n_words)).capitalize() + "?"


def make_source(path: Path, rows: int, answer_chars: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    batch: list[dict[str, Any]] = []
    writer: pq.ParquetWriter | None = None
    for i in range(rows):
        words = FRENCH if rng.random() < 0.05 else WORDS
        messages = []
        for _ in range(rng.choice((1, 1, 2, 3))):
            messages.append({"content": text(rng, rng.randint(8, 60), words), "role": "user"})
            messages.append({"content": (text(rng, answer_chars // 6) + " ")[:answer_chars], "role": "assistant"})
        batch.append({"prompt": messages[0]["content"], "prompt_id": f"{i:064x}", "messages": messages})
        if len(batch) == 20_000 or i == rows - 1:
            table = pa.Table.from_pylist(batch)
            writer = writer or pq.ParquetWriter(path, table.schema)
            writer.write_table(table)
            batch = []
    assert writer is not None  # the last row wrote a batch
    writer.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--cap", type=int, default=15_000)
    ap.add_argument("--answer-chars", type=int, default=1500)
    args = ap.parse_args()

    tok_res = TokenizerResource(standin_dir=str(REPO / "var" / "data" / "standin"))
    tok = tok_res.load()

    length = PromptLength(
        render=lambda m, t: render_messages(m, t, version=tok_res.template_version, thinking=True),
        count=lambda text: len(tok.encode(text, allow_special=True)),
    )

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src" / "HuggingFaceH4" / "ultrachat_200k" / "data" / "train_sft-00000-of-00001.parquet"
        src.parent.mkdir(parents=True)
        t = time.perf_counter()
        make_source(src, args.rows, args.answer_chars)
        print(
            f"source: {args.rows:,} rows, {src.stat().st_size / 1e6:.0f} MB Parquet "
            f"(written in {time.perf_counter() - t:.0f} s)"
        )
        spec = ImportSpec(
            schema="messages",
            repo="HuggingFaceH4/ultrachat_200k",
            split="train_sft",
            files="data/train_sft-*.parquet",
            languages=("en",),
            max_prompt_tokens=16384,
        )
        reg = {
            "B6": DatasetSpec(
                name="B6",
                prompt_file=Path(tmp) / "x.jsonl",
                format="messages",
                kind="chat",
                sample_cap=args.cap,
                real=spec,
            )
        }

        t = time.perf_counter()
        pl.read_parquet(src)
        read_s = time.perf_counter() - t

        def rows_of() -> Iterator[SourceRow]:
            return source_rows(reg["B6"], Path(tmp) / "src")

        def timed(cap):
            t = time.perf_counter()
            selected, report = import_prompts("B6", spec, rows_of(), cap=cap, length=length)
            return time.perf_counter() - t, selected[: args.cap], report

        ours_s, ours, report = timed(args.cap)
        # The peer: every row measured and kept, then the first `cap` by rank (filter, then sample).
        peer_s, peer, peer_report = timed(None)

    same = [p.prompt_id for p in ours] == [p.prompt_id for p in peer]
    r = report
    print(
        f"selected {r.selected:,} of {r.rows:,} rows (filtered {dict(r.filtered)}); "
        f"the peer selects the same prompts: {same}"
    )
    print(f"polars read only:                   {read_s:7.1f} s  ({args.rows / read_s:10,.0f} rows/s)")
    print(
        f"import, filters on ranked rows:     {ours_s:7.1f} s  ({args.rows / ours_s:10,.0f} rows/s), "
        f"measured {r.measured:,} prompts"
    )
    print(
        f"peer: filters on every row first:   {peer_s:7.1f} s  ({args.rows / peer_s:10,.0f} rows/s), "
        f"measured {peer_report.measured:,}"
    )
    print(f"ratio peer / ours: {peer_s / ours_s:.2f}x")


if __name__ == "__main__":
    main()
