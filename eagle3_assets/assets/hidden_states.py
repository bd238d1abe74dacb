"""`hidden_states`: the target's EAGLE-3 auxiliary layers and final hidden state per sample."""


import dagster as dg
import polars as pl

from eagle3_assets.assets.merged_dataset import merged_dataset
from eagle3_assets.checks.outcome import check_specs, to_results
from eagle3_assets.checks.training import HIDDEN_STATE_CHECKS, hidden_state_finite
from eagle3_assets.hidden_states import (
    extract_hidden_states,
    read_sample,
    sample_path,
    write_manifest,
)
from eagle3_assets.metadata import json_value, markdown_table, path_value
from eagle3_resources.hidden_states.resource import HiddenStatesResource
from eagle3_resources.storage import DataStore
from eagle3_resources.target.resource import TargetModelResource
from eagle3_resources.tokenizer.resource import TokenizerResource


def sample_preview(root, merged: pl.DataFrame, n: int = 5) -> pl.DataFrame:
    rows = []
    for sample_id, split in merged.select("sample_id", "split").head(n).rows():
        t = read_sample(sample_path(root, split, sample_id))
        rows.append({"sample_id": sample_id, "split": split, "tokens": t["input_ids"].shape[0],
                     "loss_tokens": int(t["loss_mask"].sum()), "aux_shape": str(tuple(t["aux_hidden_states"].shape)),
                     "aux_rms": round(float(t["aux_hidden_states"].float().pow(2).mean().sqrt()), 4),
                     "final_rms": round(float(t["final_hidden_state"].float().pow(2).mean().sqrt()), 4)})
    return pl.DataFrame(rows)


@dg.asset(
    check_specs=check_specs("hidden_states", HIDDEN_STATE_CHECKS, blocking=set(HIDDEN_STATE_CHECKS)),
    deps=[merged_dataset],
    group_name="training",
    pool="gpu",
    kinds={"pytorch", "safetensors"},
    description="Aux hidden states of layers [1, N//2-1, N-4] (outputs, 0-based) and the post-norm final hidden "
    "state of every merged sample, one safetensors file each; existing files are kept (resume). Not partitioned: a backfill dialog's preview lists it under \"No partitions available to materialize\", yet a run over datasets builds it once, after their `token_ids`.",
)
def hidden_states(
    context: dg.AssetExecutionContext,
    store: DataStore,
    tokenizer: TokenizerResource,
    target: TargetModelResource,
    hidden_states_backend: HiddenStatesResource,
) -> dg.MaterializeResult:
    merged = pl.read_parquet(store.layout.merged_dataset())
    backend = hidden_states_backend.make_backend(target, tokenizer, context.log.info)
    root = store.layout.hidden_states()
    def observe(figures: dict) -> None:  # live progress on the asset's page
        context.log_event(dg.AssetObservation(asset_key=context.assets_def.key, description=f"progress of run {context.run_id[:8]}",
                                              metadata={k: v for k, v in figures.items() if v is not None}))

    report = extract_hidden_states(merged, backend, root, log=context.log.info, on_progress=observe)
    manifest = write_manifest(root, merged, backend, str(target.folder(tokenizer, context.log.info)))
    outcomes = {name: fn(root, merged) for name, (fn, _) in HIDDEN_STATE_CHECKS.items() if name != "finite"}
    outcomes["finite"] = hidden_state_finite(report.nan_samples)
    return dg.MaterializeResult(
        check_results=to_results(HIDDEN_STATE_CHECKS, outcomes),
        metadata={
            "samples": merged.height,
            "written": report.written,
            "skipped_existing": report.skipped,
            "tokens": manifest["tokens"],
            "bytes_written": report.bytes_written,
            "tokens_per_s": round(report.tokens / report.seconds, 1) if report.seconds else 0.0,
            "aux_layer_ids": json_value(manifest["aux_layer_ids"]),
            "layer_convention": manifest["layer_convention"],
            "final_hidden_state": manifest["final_hidden_state"],
            "hidden_size": manifest["hidden_size"],
            "path": path_value(root),
            "manifest": json_value(manifest),
            "preview": markdown_table(sample_preview(root, merged), rows=5),
        }
    )
