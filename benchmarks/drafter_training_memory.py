"""Benchmark: peak memory of drafter training at 1x and 4x the samples (it must not grow with them).

    .venv/bin/python benchmarks/drafter_training_memory.py [--samples 64] [--tokens 600] [--hidden 256]

Builds a random DeepseekV3-layout target folder and a hidden-state store of N synthetic samples
(random bf16 states; the trainer does not care what they mean), then trains one epoch in a fresh
process (`eagle3_assets.stages.eagle3_drafter.train_cli`) for N and for 4N samples and prints each process's
peak RSS and the ratio. Training streams windows from the store, so the ratio should stay near
1; a trainer that loads every sample first (this project's until issue 11) grows with N: its
resident sample tensors alone are printed as the peer figure ("all samples in memory").

Peak RSS is the kernel's high-water mark of the training process's address space (VmHWM in
/proc/self/status, read as it exits); beside it, the peaks of its two parts, sampled every 50 ms:
anonymous memory (the process's own: tensors, allocator, Python) and file-backed pages (mapped
files). Not `ru_maxrss`: Linux carries it across fork+exec, so a child's figure includes the RSS
its parent had when it forked (here the benchmark itself, which grows with N as it builds the data:
that read 1,638 MiB at 4x against a VmHWM of 862). The store is read with positional reads, not
mapped, so its pages stay out of the process (a mapped store grew RssFile by the pages read: 208 MiB
at 1x, 434 MiB at 4x). Figures: docs/pipeline.md, "The drafter: training, and what it buys".
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import polars as pl
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eagle3_assets.stages.eagle3_drafter.train import TrainSettings  # noqa: E402
from eagle3_assets.stages.eagle3_drafter.train_cli import write_spec  # noqa: E402
from eagle3_resources.hidden_states.extract import StoreSettings, extract_to_store  # noqa: E402
from eagle3_resources.hidden_states.store import StoredSample  # noqa: E402

PEAK = """
import runpy, sys, threading, time
peaks = {"VmHWM": 0, "RssAnon": 0, "RssFile": 0}
def read():
    for line in open("/proc/self/status"):
        key = line.split(":")[0]
        if key in peaks:
            peaks[key] = max(peaks[key], int(line.split()[1]))
def sample():
    while True:
        read()
        time.sleep(0.05)
threading.Thread(target=sample, daemon=True).start()
sys.argv = ["train_cli", "--spec", sys.argv[1]]
try:
    runpy.run_module("eagle3_assets.stages.eagle3_drafter.train_cli", run_name="__main__")
except SystemExit:
    pass
read()
print("PEAK_RSS_KB", peaks["VmHWM"], peaks["RssAnon"], peaks["RssFile"], flush=True)
"""


class RandomStates:
    """A backend that returns random states of the right shapes: what the store holds does not matter here."""

    name = "random"
    layer_ids = [1, 2, 3]

    def __init__(self, hidden: int, layers: int):
        self.hidden_size, self.num_layers = hidden, layers
        self.g = torch.Generator().manual_seed(0)

    def describe(self) -> dict:
        return {"backend": self.name}

    def extract_batch(self, sequences):
        H = self.hidden_size
        return [
            (
                torch.randn(len(s), 3 * H, generator=self.g).to(torch.bfloat16),
                torch.randn(len(s), H, generator=self.g).to(torch.bfloat16),
            )
            for s in sequences
        ]


def target_folder(root: Path, hidden: int, vocab: int) -> Path:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=32,
        first_k_dense_replace=1,
    )
    torch.manual_seed(0)
    DeepseekV3ForCausalLM(cfg).save_pretrained(root / "target")
    return root / "target"


def dataset(root: Path, n: int, tokens: int, hidden: int, vocab: int) -> tuple[Path, Path]:
    g = torch.Generator().manual_seed(n)
    rows: list[dict[str, Any]] = []
    for i in range(n):
        ids = torch.randint(0, vocab, (tokens,), generator=g).tolist()
        rows.append(
            {
                "sample_id": f"S1/{i:05d}",
                "split": "eval" if i % 16 == 15 else "train",
                "dataset": "S1",
                "input_ids": ids,
                "loss_mask": [0] * (tokens // 4) + [1] * (tokens - tokens // 4),
                "n_tokens": tokens,
            }
        )
    merged = pl.DataFrame(rows)
    merged.write_parquet(root / "merged.parquet")
    samples = [StoredSample(r["sample_id"], r["split"], r["input_ids"], r["loss_mask"], "S1") for r in rows]
    extract_to_store(
        samples,
        RandomStates(hidden, 6),
        root / "hidden_states",
        StoreSettings(free_bytes=10**13, reserve_bytes=0),
        identity={},
        log=lambda m: None,
    )
    return root / "merged.parquet", root / "hidden_states"


def peak_rss_mb(spec: Path) -> tuple[float, float, float]:
    """(peak RSS, peak anonymous, peak file-backed), MiB, of one training process."""
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", PEAK, str(spec)], cwd=REPO, capture_output=True, text=True, env=env)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("PEAK_RSS_KB")]
    if out.returncode != 0 or not line:
        raise RuntimeError(out.stdout[-3000:] + out.stderr[-3000:])
    rss, anon, file = (int(x) / 1024 for x in line[0].split()[1:])
    return rss, anon, file


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--tokens", type=int, default=600)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4000)
    a = p.parse_args()
    settings = TrainSettings(ttt_steps=3, epochs=1, batch_tokens=2400, max_len=1024, checkpoint_every=0)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        folder = target_folder(tmp, a.hidden, a.vocab)
        results = {}
        for factor in (1, 4):
            root = tmp / f"x{factor}"
            root.mkdir()
            merged, store = dataset(root, factor * a.samples, a.tokens, a.hidden, a.vocab)
            spec = write_spec(
                root / "spec.json",
                hidden_root=store,
                merged_path=merged,
                target_folder=folder,
                out_dir=root / "drafter",
                settings=settings,
                draft_vocab_size=512,
                report_path=root / "report.json",
                device="cpu",
            )
            rss, anon, file = peak_rss_mb(spec)
            report = json.loads((root / "report.json").read_text())
            tokens = factor * a.samples * a.tokens
            # What the old trainer kept resident: per token aux fp32 (3H) + teacher over the draft vocabulary (fp32)
            # + ids.
            resident = tokens * (3 * a.hidden * 4 + report["draft_vocab_size"] * 4 + 3 * 8) / 2**20
            results[factor] = rss
            print(
                f"{factor}x: {factor * a.samples} samples, {tokens:,} tokens, store "
                f"{sum(f.stat().st_size for f in store.glob('*.safetensors')) / 2**20:,.0f} MiB: "
                f"peak RSS {rss:,.0f} MiB "
                f"(anonymous {anon:,.0f}, file-backed {file:,.0f}) "
                f"(all samples in memory, the peer: {resident:,.0f} MiB of tensors alone)"
            )
        print(f"peak RSS 4x / 1x: {results[4] / results[1]:.3f}   (streaming: about 1)")


if __name__ == "__main__":
    main()
