"""benchmarks/drafter_kinds.py end to end on the stand-in, quick: two kinds trained on one small store with the same
budget, each exported, re-read and decoded in the lossless loop, each of its own kind (its architecture, its KV bytes
at the stand-in's shape and at Kimi-K2.5's); the speculators peer skipped, saying so, when its environment is absent.
With `.venv-speculators` made (the benchmark's docstring), a slow test runs the peer too: its weights mapped onto
`eagle3_llama`, the logits proof passed, decoded losslessly."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
import torch
from support import extract_merged, load_benchmark

REPO = Path(__file__).resolve().parents[1]
TEXT_LINES = REPO / "tests" / "data" / "text_lines.txt"
# the kinds' draft KV cache per token, bf16: GQA 8 KV heads x head dim 8 (stand-in) or 128 (Kimi), keys and values;
# MLA its latent and rope key (16 + 8 on the stand-in, 512 + 64 for Kimi)
KV_BYTES = {"eagle3_llama": (2 * 8 * 8 * 2, 4096), "eagle3_1_mla": ((16 + 8) * 2, 1152)}
ARCHITECTURES = {"eagle3_llama": "LlamaForCausalLMEagle3", "eagle3_1_mla": "Eagle3DeepseekV2ForCausalLM"}


def merged_set(tok, n: int = 16) -> pl.DataFrame:
    """Samples of real text in the stand-in tokenizer, a prompt and a completion, from two registered datasets."""
    lines = TEXT_LINES.read_text().splitlines()[: 3 * n]
    rows = []
    for i in range(n):
        prompt, answer = tok.encode(lines[3 * i][:120]), tok.encode(" ".join(lines[3 * i + 1 : 3 * i + 3]))
        ids, mask = (prompt + answer)[:150], ([0] * len(prompt) + [1] * len(answer))[:150]
        dataset = ("A1", "B1")[i % 2]
        split = "eval" if i % 4 == 3 else "train"
        row = {"sample_id": f"{dataset}/{i:03d}", "split": split, "dataset": dataset, "input_ids": ids}
        rows.append(row | {"loss_mask": mask, "n_tokens": len(ids)})
    return pl.DataFrame(rows, schema_overrides={"input_ids": pl.List(pl.Int32), "loss_mask": pl.List(pl.Int8)})


@pytest.fixture
def store(data_dir_with_standin: Path, tok, target_model) -> Path:
    """A data store as the first command leaves one: the stand-in, a merged set and its hidden states."""
    root = data_dir_with_standin
    merged = merged_set(tok)
    (root / "merged_dataset").mkdir()
    merged.write_parquet(root / "merged_dataset" / "merged.parquet")
    extract_merged(merged, target_model, root / "hidden_states")
    return root


@pytest.fixture
def one_thread(monkeypatch):
    """The benchmark sets torch's threads and EAGLE3_TORCH_THREADS (the trainer's choice) to 1: both set back after."""
    monkeypatch.setenv("EAGLE3_TORCH_THREADS", "1")
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_each_kind_trains_as_itself_on_the_same_windows_and_decodes_losslessly(
    store: Path, tmp_path: Path, capsys, one_thread
) -> None:
    kinds = list(KV_BYTES)
    absent = tmp_path / "no-venv" / "python"
    out = tmp_path / "kinds.json"
    bench = load_benchmark("drafter_kinds")
    figures = bench.main(
        ["--data", str(store), "--kinds", ",".join(kinds), "--quick", "--peer-python", str(absent)]
        + ["--work", str(tmp_path / "work"), "--json", str(out)]
    )
    printed = capsys.readouterr()
    assert json.loads(out.read_text())["summary"] == figures["summary"]

    # the peer is skipped, and says why, where the figures and the output show it
    assert figures["peer"] is None and "not found" in figures["peer_skipped"] and str(absent) in figures["peer_skipped"]
    assert figures["peer_skipped"] in printed.out and bench.PEER not in figures["summary"]

    runs = {r["drafter"]: r for r in figures["runs"]}
    assert list(runs) == kinds
    for kind, r in runs.items():
        exported = json.loads((tmp_path / "work" / f"{kind}-seed0" / "config.json").read_text())
        assert exported["eagle3_pipeline"]["drafter_kind"] == kind  # trained as the kind asked for
        assert exported["architectures"] == [ARCHITECTURES[kind]] == [r["extra"]["architecture"]]
        assert (r["kv_bytes_standin"], r["kv_bytes_kimi"]) == KV_BYTES[kind]
        assert r["lossless"] and 1.0 <= r["accept_length"] <= bench.QUICK_DECODE.draft_steps + 1
        assert r["by_kind"] and sum(r["prompts_by_kind"].values()) == bench.QUICK_DECODE.prompts
        assert r["tokens_per_s"] > 0 and r["final_loss"] is not None
    assert exported["fc_norm"] is True  # the last kind is EAGLE 3.1
    # the same windows and budget: the same tokens trained, the same steps
    assert len({(r["train_tokens"], r["extra"]["steps"]) for r in runs.values()}) == 1
    assert figures["budget"]["train_samples"] == bench.QUICK_BUDGET.train_samples and figures["threads"] == 1
    for kind in kinds:
        assert f"| `{kind}` |" in figures["table"] and f"| `{kind}` |" in printed.out


@pytest.mark.slow
@pytest.mark.skipif(not (REPO / ".venv-speculators" / "bin" / "python").is_file(), reason="no .venv-speculators")
def test_the_speculators_peer_trains_maps_onto_eagle3_llama_and_decodes(
    store: Path, tmp_path: Path, one_thread
) -> None:
    bench = load_benchmark("drafter_kinds")
    figures = bench.main(["--data", str(store), "--kinds", "eagle3_llama", "--quick", "--work", str(tmp_path / "w")])
    peer = next(r for r in figures["runs"] if r["drafter"] == bench.PEER)
    ours = next(r for r in figures["runs"] if r["drafter"] == "eagle3_llama")
    assert peer["extra"]["logits_max_difference"] <= bench.LOGITS_TOLERANCE  # the mapping proved
    assert peer["train_tokens"] == ours["train_tokens"] and peer["extra"]["steps"] == ours["extra"]["steps"]
    assert peer["lossless"] and (peer["kv_bytes_standin"], peer["kv_bytes_kimi"]) == KV_BYTES["eagle3_llama"]
    assert "lm_head.weight" not in peer["extra"]["trainable_parameters"]  # speculators freezes the target's rows
