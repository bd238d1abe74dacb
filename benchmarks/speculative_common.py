"""What the two SGLang speculative-decoding benchmarks share: the eval prompts, the sampling parameters, the
per-request record of SGLang's `meta_info`, the accept-length and speed arithmetic, and the printed table.

    benchmarks/serving_speculative.py        SGLang's HTTP server (`launch_server`, native `/generate`)
    benchmarks/sglang_engine_speculative.py  SGLang's offline `Engine` in the benchmark's own process

Both send token ids and read the same `meta_info` (SGLang 0.5.23's tokenizer_manager builds it for either
entry point), so one `summarize` serves both. Standard library only at import (pyarrow only to read a Parquet
file of prompts), so the scripts run where sglang is installed without this project's extras.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

DEFAULT_DATA_DIR = Path(os.environ.get("EAGLE3_DATA_DIR") or Path(__file__).resolve().parents[1] / "var" / "data")
DEFAULT_PROMPTS = DEFAULT_DATA_DIR / "merged_dataset" / "merged.parquet"
ACCEPT_LENGTH_NOTE = (
    "accept length = completion_tokens / spec_verify_ct (SGLang's definition, meta_info.spec_accept_length): it "
    "counts the bonus token, so 1.0 means no draft token accepted; aggregated as sum(completion_tokens) / "
    "sum(spec_verify_ct) over the requests that report spec_verify_ct"
)
SPEEDUP_NOTE = "output tok/s (sum completion_tokens / batch wall time) over the baseline's at the same concurrency"
# meta_info scalars worth keeping per request (SGLang 0.5.x tokenizer_manager; the spec_* ones only with speculation).
META_KEYS = (
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "e2e_latency",
    "spec_verify_ct",
    "spec_accept_length",
    "spec_accept_rate",
    "spec_num_correct_drafts",
    "spec_num_proposed_drafts",
)


def check_draft_tree(num_steps: int, eagle_topk: int, num_draft_tokens: int) -> None:
    """SGLang's EAGLE tree holds at most num_steps * eagle_topk + 1 tokens (a chain of num_steps drafts plus the
    root when topk is 1): more draft tokens than that is refused before any engine starts."""
    if num_draft_tokens > num_steps * eagle_topk + 1:
        raise ValueError(
            f"num_draft_tokens {num_draft_tokens} > num_steps * eagle_topk + 1 = {num_steps * eagle_topk + 1}"
        )


def sampling_params(
    max_new_tokens: int, ignore_eos: bool = False, temperature: float = 0.0, top_p: float | None = None
) -> dict[str, Any]:
    """SGLang's `sampling_params`: greedy at temperature 0 (SGLang then samples top-1), otherwise sampled at
    `temperature`, with `top_p` when given."""
    params: dict[str, Any] = {
        "temperature": float(temperature),
        "max_new_tokens": int(max_new_tokens),
        "ignore_eos": bool(ignore_eos),
    }
    if temperature > 0 and top_p is not None:
        params["top_p"] = float(top_p)
    return params


def request_record(index: int, response: dict[str, Any], latency_s: float) -> dict[str, Any]:
    """What is kept of one generate response: its meta_info scalars, finish reason, client latency."""
    meta = response.get("meta_info") or {}
    rec: dict[str, Any] = {"index": index, "latency_s": latency_s}
    for key in META_KEYS:
        if key in meta:
            rec[key] = meta[key]
    fr = meta.get("finish_reason")
    rec["finish_reason"] = fr.get("type") if isinstance(fr, dict) else fr
    if "completion_tokens" not in rec:
        rec["completion_tokens"] = len(response.get("output_ids") or [])
    return rec


def summarize(
    records: Iterable[dict[str, Any]], wall_s: float, baseline_tokens_per_s: float | None = None
) -> dict[str, Any]:
    """One (server, concurrency) run: accept length (sum completion / sum spec_verify_ct), output tok/s, speed-up."""
    records = list(records)
    completion = sum(int(r["completion_tokens"]) for r in records)
    spec = [r for r in records if r.get("spec_verify_ct")]
    verify = sum(int(r["spec_verify_ct"]) for r in spec)
    spec_completion = sum(int(r["completion_tokens"]) for r in spec)
    per_request = [float(r["spec_accept_length"]) for r in spec if r.get("spec_accept_length") is not None]
    tokens_per_s = completion / wall_s if wall_s > 0 else None
    latencies = sorted(float(r["latency_s"]) for r in records if r.get("latency_s") is not None)
    return {
        "requests": len(records),
        "completion_tokens": completion,
        "prompt_tokens": sum(int(r.get("prompt_tokens") or 0) for r in records),
        "wall_s": wall_s,
        "output_tokens_per_s": tokens_per_s,
        "requests_with_spec": len(spec),
        "spec_verify_ct": verify if spec else None,
        "accept_length": spec_completion / verify if verify else None,
        "mean_request_accept_length": sum(per_request) / len(per_request) if per_request else None,
        "mean_latency_s": sum(latencies) / len(latencies) if latencies else None,
        "max_latency_s": latencies[-1] if latencies else None,
        "finish_reasons": {
            k: sum(1 for r in records if str(r.get("finish_reason")) == k)
            for k in sorted({str(r.get("finish_reason")) for r in records})
        },
        "speedup": tokens_per_s / baseline_tokens_per_s if tokens_per_s and baseline_tokens_per_s else None,
    }


def add_speedups(results: dict[str, dict[str, dict[str, Any]]], baseline: str = "baseline") -> None:
    """Fill `speedup` of every run from the baseline's output tok/s at the same concurrency."""
    base = results.get(baseline) or {}
    for by_bs in results.values():
        for bs, s in by_bs.items():
            ref = (base.get(bs) or {}).get("output_tokens_per_s")
            s["speedup"] = s["output_tokens_per_s"] / ref if ref and s.get("output_tokens_per_s") else None


def format_table(results: dict[str, dict[str, dict[str, Any]]], label_header: str = "server") -> str:
    def f(v, spec):
        return "-" if v is None else format(v, spec)

    lines = [
        f"{label_header:<10} {'conc':>5} {'reqs':>5} {'out tok':>9} {'wall s':>8} {'tok/s':>9} "
        f"{'accept len':>10} {'speed-up':>8}"
    ]
    for label, by_bs in results.items():
        for bs, s in by_bs.items():
            lines.append(
                f"{label:<10} {bs:>5} {s['requests']:>5} {s['completion_tokens']:>9} {f(s['wall_s'], '.2f'):>8} "
                f"{f(s['output_tokens_per_s'], '.1f'):>9} {f(s['accept_length'], '.3f'):>10} "
                f"{f(s['speedup'], '.2f'):>8}"
            )
    return "\n".join(lines + [ACCEPT_LENGTH_NOTE])


def temperature_key(t: float) -> str:
    """How a temperature names its results: "0", "1", "0.6"."""
    return f"{float(t):g}"


def weights_fingerprint(folder: str | Path) -> dict[str, str] | None:
    """sha256 of each `*.safetensors` in the drafter folder: which weights these figures belong to (None where the
    drafter is not a local folder, e.g. a Hub id)."""
    files = sorted(Path(folder).glob("*.safetensors")) if Path(folder).is_dir() else []
    if not files:
        return None
    out = {}
    for f in files:
        with open(f, "rb") as fh:
            out[f.name] = hashlib.file_digest(fh, "sha256").hexdigest()
    return out


def temperature_summary(
    results: dict[str, dict[str, dict[str, Any]]], records: dict[str, dict[str, list]], label: str = "eagle3"
) -> dict[str, Any]:
    """One temperature's headline: the accept length pooled over every concurrency (summarize over all of the
    speculative engine's requests), and per concurrency the two engines' output tok/s and the speed-up."""
    pooled = summarize([r for recs in (records.get(label) or {}).values() for r in recs], wall_s=0.0)
    by_bs = results.get(label) or {}
    base = results.get("baseline") or {}
    return {
        "accept_length": pooled["accept_length"],
        "completion_tokens": pooled["completion_tokens"],
        "spec_verify_ct": pooled["spec_verify_ct"],
        "accept_length_by_concurrency": {bs: s["accept_length"] for bs, s in by_bs.items()},
        "output_tokens_per_s": {
            bs: {"baseline": (base.get(bs) or {}).get("output_tokens_per_s"), label: s["output_tokens_per_s"]}
            for bs, s in by_bs.items()
        },
        "speedup": {bs: s["speedup"] for bs, s in by_bs.items()},
    }


def load_prompts(path: Path, num_prompts: int, split: str = "eval", seed: int = 0) -> list[list[int]]:
    """Prompt token ids of `num_prompts` samples of `split`, a seeded sample spread over every dataset.

    Parquet: the merged training set (`input_ids`, `prompt_len`, `split`, `sample_id`); the prompt is
    input_ids[:prompt_len]. JSONL: one prompt a line, a JSON list of ids or an object with `prompt_ids`, or
    `input_ids` (cut at `prompt_len` when given); rows with a `split` other than `split` are skipped."""
    rows: list[tuple[str, list[int]]] = []
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(
            path, columns=["sample_id", "split", "input_ids", "prompt_len"], filters=[("split", "==", split)]
        )
        for sid, ids, plen in zip(  # three columns of one table
            table["sample_id"].to_pylist(), table["input_ids"].to_pylist(), table["prompt_len"].to_pylist(), strict=True
        ):
            rows.append((sid, ids[:plen]))
    else:
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
            if not line.strip():
                continue
            obj = json.loads(line)
            if isinstance(obj, list):
                rows.append((f"{n:09d}", obj))
                continue
            if obj.get("split", split) != split:
                continue
            ids = obj.get("prompt_ids") or obj["input_ids"][: obj.get("prompt_len") or None]
            rows.append((str(obj.get("sample_id", f"{n:09d}")), ids))
    rows.sort(key=lambda r: r[0])
    if not rows:
        raise SystemExit(f"no {split!r} prompts in {path}")
    if len(rows) > num_prompts:
        rows = random.Random(seed).sample(rows, num_prompts)
    return [[int(t) for t in ids] for _, ids in rows]
