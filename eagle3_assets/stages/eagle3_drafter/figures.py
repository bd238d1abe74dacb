"""Where each of the drafter's accept-length and speed figures came from, and the step that records SGLang's own.

Four sources, each named on the figure it produced (`*_source` metadata beside it):

  simulated       the trainer's eval pass, teacher-forced: each draft step scored against the target's next token
                  on the eval split, no decoding (materialization: `accept_length_simulated`)
  transformers    this project's lossless speculative-decoding loop, the target in transformers
                  (drafter/speculative.py), greedy; SGLang's definition, but not SGLang's engine; only where the
                  target fits here (materialization: `accept_length_real`, `speculative_decoding`)
  sglang_server   SGLang's HTTP server, benchmarks/serving_speculative.py (greedy)
  sglang_engine   SGLang's offline Engine, benchmarks/sglang_engine_speculative.py (greedy and sampled)

The two SGLang benchmarks run on a GPU host after the drafter is materialized, so their figures cannot be part of
that materialization. This step records a benchmark's JSON on the `eagle3_drafter` asset as an observation (no
run, no retraining), once it has checked that the weights the benchmark measured are the ones on disk now:

    .venv/bin/python -m eagle3_assets.operations.record_figures sglang_engine_speculative.json

(the instance `eagle3` uses: DAGSTER_HOME if set, else the project's default, as
eagle3_assets/operations/instance.py decides).

The observation shows under the asset's Observations in the UI, newest first, with the latest materialization's
run id beside it, so which drafter the figures belong to is plain.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import dagster as dg

from eagle3_resources.errors import FiguresRefused

DRAFTER_ASSET = dg.AssetKey("eagle3_drafter")
SOURCES = {
    "simulated": "simulated: the trainer's eval pass on the eval split, teacher-forced (each draft step scored "
    "against the target's own next token); no decoding, not a serving figure",
    "transformers": "measured: this project's lossless speculative decoding in transformers "
    "(eagle3_assets/stages/eagle3_drafter/speculative.py), greedy, checked token for token against greedy "
    "decoding; SGLang's definition (completion_tokens / verify passes), not SGLang's engine",
    "best_checkpoint": "measured during training: every `best_every` steps the drafter as exported, decoded by this "
    "project's lossless loop (speculative.py, greedy, top-1 chains of `spec_draft_steps`) on the eval split's first "
    "`best_prompts_per_kind` prompts of each kind; SGLang's definition (generated tokens / verify passes); the step "
    "with the highest is the one exported",
    "sglang_server": "measured: SGLang's HTTP server (benchmarks/serving_speculative.py, native /generate), greedy; "
    "accept length = sum(completion_tokens) / sum(spec_verify_ct) from SGLang's meta_info",
    "sglang_engine": "measured: SGLang's offline Engine (benchmarks/sglang_engine_speculative.py), greedy and sampled; "
    "accept length = sum(completion_tokens) / sum(spec_verify_ct) from SGLang's meta_info",
}


def sha256_of(folder: Path, names: Sequence[str]) -> dict[str, str | None]:
    """The files' sha256 now (None for a file that is gone), as the benchmarks record them."""
    out: dict[str, str | None] = {}
    for name in names:
        if (folder / name).is_file():
            with open(folder / name, "rb") as fh:
                out[name] = hashlib.file_digest(fh, "sha256").hexdigest()
        else:
            out[name] = None
    return out


def drafter_identity(report: dict[str, Any]) -> dict[str, Any]:
    """Which weights were measured, checked against the folder now: refused when they differ."""
    drafter = report.get("drafter")
    if not drafter or not drafter.get("weights_sha256"):
        return {
            "drafter_weights": "not recorded by the benchmark (servers started by hand, or a drafter that is not "
            "a local folder): these figures are not tied to particular weights"
        }
    folder = Path(drafter["path"])
    recorded = drafter["weights_sha256"]
    now = sha256_of(folder, sorted(recorded))
    if now != recorded:
        changed = [n for n in sorted(recorded) if now.get(n) != recorded[n]]
        raise FiguresRefused(
            f"the drafter at {folder} is not the one benchmarked ({', '.join(changed)} changed or "
            f"missing since): run the benchmark again on this drafter"
        )
    return {
        "drafter_path": dg.MetadataValue.path(str(folder)),
        "drafter_weights_sha256": dg.MetadataValue.json(recorded),
        "drafter_weights": "the benchmarked weights are the ones in drafter_path now (sha256 checked)",
    }


def figures_table(source: str, summary: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| temperature | concurrency | accept length | baseline tok/s | EAGLE-3 tok/s | speed-up |",
        "|---|---|---|---|---|---|",
    ]

    def f(v, spec):
        return "-" if v is None else format(v, spec)

    for tk, s in summary.items():
        for bs, speeds in s["output_tokens_per_s"].items():
            lines.append(
                f"| {tk} | {bs} | {f(s['accept_length_by_concurrency'].get(bs), '.3f')} | "
                f"{f(speeds.get('baseline'), '.1f')} | {f(speeds.get('eagle3'), '.1f')} | "
                f"{f(s['speedup'].get(bs), '.2f')} |"
            )
    return f"{SOURCES[source]}\n\n" + "\n".join(lines)


def observation_metadata(report: dict[str, Any], report_path: Path) -> dict[str, Any]:
    """The figures of one SGLang benchmark JSON, each key prefixed by its source, the source's description beside."""
    source = report.get("source")
    if source not in ("sglang_server", "sglang_engine") or "summary" not in report:
        raise FiguresRefused(
            f"{report_path}: not a report of benchmarks/serving_speculative.py or "
            f"sglang_engine_speculative.py (source {source!r})"
        )
    settings = report.get("settings") or {}
    target = settings.get("target") or settings.get("model_path") or settings.get("url")
    steps = [
        settings.get(k)
        for k in (
            ("num_steps", "topk", "num_draft_tokens")
            if source == "sglang_engine"
            else ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
        )
    ]
    how = (
        f"{SOURCES[source]}. Target {target}, EAGLE-3 steps/topk/draft tokens {steps[0]}/{steps[1]}/{steps[2]}, "
        f"{report.get('num_prompts')} {settings.get('split', 'eval')} prompts, max_new_tokens "
        f"{settings.get('max_new_tokens')}"
        + (f", top_p {settings.get('top_p')} when sampled" if source == "sglang_engine" else "")
        + (f", sglang {report['sglang_version']}" if report.get("sglang_version") else "")
    )
    meta: dict[str, Any] = {f"{source}_source": how}
    for tk, s in report["summary"].items():
        if s.get("accept_length") is not None:
            meta[f"{source}_accept_length_t{tk}"] = float(s["accept_length"])
        for bs, speedup in s["speedup"].items():
            if speedup is not None:
                meta[f"{source}_speedup_t{tk}_c{bs}"] = float(speedup)
    meta[f"{source}_figures"] = dg.MetadataValue.md(figures_table(source, report["summary"]))
    meta[f"{source}_report"] = dg.MetadataValue.path(str(report_path))
    return meta | drafter_identity(report)


def record_figures(report_path: Path, instance: dg.DagsterInstance) -> dg.AssetObservation:
    """Report the benchmark's figures as an observation of `eagle3_drafter`, beside its latest materialization."""
    report = json.loads(Path(report_path).read_text())
    metadata = observation_metadata(report, Path(report_path).resolve())
    latest = instance.get_latest_materialization_event(DRAFTER_ASSET)
    if latest is not None:
        metadata["latest_materialization_run_id"] = latest.run_id
    source = report["source"]
    heads = [
        f"accept length {v:.3f} at temperature {k.rsplit('_t', 1)[1]}"
        for k, v in metadata.items()
        if k.startswith(f"{source}_accept_length_t")
    ]
    observation = dg.AssetObservation(
        asset_key=DRAFTER_ASSET, metadata=metadata, description=f"{source}: " + ("; ".join(heads) or "no accept length")
    )
    instance.report_runless_asset_event(observation)
    return observation


def best_checkpoint_plot(summary: dict[str, Any]):
    """The best-checkpoint keeper's curve: real accept length per prompt kind and over all, against the optimizer
    step, the exported (best) step marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve, best = summary["curve"], summary["best"]
    steps = [r["step"] for r in curve]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    kinds = sorted({k for r in curve for k in r["by_kind"]})
    for kind in kinds:
        values = [r["by_kind"].get(kind) for r in curve]
        ax.plot(steps, [v if v is not None else float("nan") for v in values], marker=".", lw=1, label=kind)
    overall = [r["accept_length"] if r["accept_length"] is not None else float("nan") for r in curve]
    ax.plot(steps, overall, color="black", lw=2, marker="o", label="all prompts")
    if best is not None:
        ax.axvline(best["step"], color="grey", ls=":")
        ax.plot([best["step"]], [best["accept_length"]], marker="*", ms=14, color="red", ls="none", label="exported")
    ax.set_title("real accept length during training (lossless speculative decoding)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("accept length")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes, off the curves
    plt.close(fig)
    return fig
