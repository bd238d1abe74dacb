"""`hidden_states`: the target's EAGLE-3 auxiliary layers and final hidden state, in shards."""

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import dagster as dg
import polars as pl
from pydantic import Field

from eagle3_assets.common.failures import failure_for_operator
from eagle3_assets.common.k8s import K8S_CONFIG_TAG, gpu_node_config
from eagle3_assets.common.metadata import json_value, markdown_table, path_value, png_markdown
from eagle3_assets.common.outcome import CheckOutcome, check_specs, to_results
from eagle3_assets.stages.hidden_states.checks import HIDDEN_STATE_CHECKS, RUN_CHECKS, hidden_state_finite
from eagle3_assets.stages.hidden_states.selection import (
    sample_preview,
    select_samples,
    stored_samples,
    target_identity,
    tokens_by_dataset,
    tokens_picture,
)
from eagle3_assets.stages.merged_dataset.asset import merged_dataset
from eagle3_resources.cpu import apply_torch_threads
from eagle3_resources.hidden_states.resource import HiddenStatesBackendKind, HiddenStatesResource
from eagle3_resources.storage import DataStore
from eagle3_resources.target.resource import TargetModelResource
from eagle3_resources.tokenizer.resource import TokenizerResource

if TYPE_CHECKING:
    from eagle3_resources.hidden_states.extract import ExtractionReport, StoreSettings


class HiddenStatesConfig(dg.Config):
    """What to extract and how the store is cut. Every figure is checked against the disk before the first byte."""

    max_tokens: int | None = Field(
        default=None,
        description="extract at most this many tokens, shared among the "
        "datasets by `dataset_weights` (or by their own sizes); unset = all of the merged set. "
        "The disk check's error says how many tokens fit",
    )
    dataset_weights: dict[str, float] | None = Field(
        default=None,
        description="keep only these datasets, e.g. "
        '{"A1": 2, "B3": 1}; with `max_tokens` their token shares follow the weights',
    )
    shard_gb: float = Field(
        default=1.0,
        description="size of one shard in GB (1e9 bytes); an interrupted run loses at most "
        "the shards being computed, and reading needs no more memory than one sample",
    )
    writers: int = Field(
        default=4,
        description="background threads writing finished shards while the next batches run "
        "(writers + 1 shard-sized host buffers)",
    )
    verify_on_resume: bool = Field(
        default=False,
        description="re-hash every committed shard against its recorded checksum "
        "(xxh3_128; sha256 in older stores) before trusting it (reads the whole store); off, a shard is "
        "trusted by its manifest entry and size",
    )
    capture_check_samples: int = Field(
        default=2,
        description="stored samples whose first 32 tokens the `matches_forward` check runs through a plain forward "
        "of the target and compares with what was stored (blocking; the transformers backend; 0 = off)",
    )
    free_bytes: int | None = Field(
        default=None,
        description="the free space to plan against, in bytes; unset = what "
        "the data volume reports. For a volume shared with other writers, give what is yours",
    )
    disk_margin_pct: float = Field(
        default=5.0, description="free space to leave beyond what the store needs, in percent of it"
    )
    disk_reserve_gb: float = Field(default=1.0, description="and this many GB on top")
    discard_stale_shards: bool = Field(
        default=False,
        description="delete committed shards this run's plan no longer "
        "wants (another target, layer rule, `shard_gb` or selection) and compute their "
        "samples again; off, such a run stops before deleting anything and says why",
    )


@dg.asset(
    check_specs=check_specs("hidden_states", HIDDEN_STATE_CHECKS, blocking=set(HIDDEN_STATE_CHECKS)),
    deps=[merged_dataset],
    group_name="training",
    pool="gpu",
    op_tags={K8S_CONFIG_TAG: gpu_node_config()},  # a whole GPU node under the k8s executor
    kinds={"pytorch", "safetensors"},
    description="Aux hidden states of layers [1, N//2-1, N-4] (outputs, 0-based) and the post-norm final hidden "
    "state of the merged samples, in shards of many samples (bf16 states, int32 ids, int8 loss mask) with a manifest "
    "of their checksums. Committed shards are kept (resume); the disk is checked before the first byte. Not "
    'partitioned: a backfill dialog\'s preview lists it under "No partitions available to materialize", yet a run '
    "over datasets builds it once, after their `token_ids`.",
)
@failure_for_operator
def hidden_states(
    context: dg.AssetExecutionContext,
    config: HiddenStatesConfig,
    store: DataStore,
    tokenizer: TokenizerResource,
    target: TargetModelResource,
    hidden_states_backend: HiddenStatesResource,
) -> dg.MaterializeResult:
    # torch-using: imported when the asset runs, so loading the definitions stays torch-free
    from eagle3_resources.hidden_states.extract import ExtractionOptions, extract_to_store

    merged = pl.read_parquet(store.layout.merged_dataset())
    selected = select_samples(merged, config.max_tokens, config.dataset_weights)
    context.log.info(
        f"hidden states for {selected.height:,} of {merged.height:,} merged samples "
        f"({int(selected['n_tokens'].sum() or 0):,} of {int(merged['n_tokens'].sum() or 0):,} tokens)"
    )
    root = store.layout.hidden_states()
    folder = target.folder(tokenizer, context.log.info)
    settings = store_settings(config, hidden_states_backend.batch_tokens)
    options = ExtractionOptions(
        identity=target_identity(folder),
        notes={"target": str(folder)},
        log=context.log.info,
        on_progress=progress_observer(context),
    )
    apply_torch_threads("hidden-state extraction", context.log.info)
    backend = hidden_states_backend.make_backend(target, tokenizer, context.log.info)
    try:
        report = extract_to_store(stored_samples(selected), backend, root, settings, options)
    finally:
        backend.close()
    outcomes = {name: fn(root, selected) for name, (fn, _) in HIDDEN_STATE_CHECKS.items() if name not in RUN_CHECKS}
    outcomes["finite"] = hidden_state_finite(report.nan_samples)
    resources = (hidden_states_backend, target, tokenizer)
    outcomes["matches_forward"] = capture_against_forward(context, config, root, resources)
    return dg.MaterializeResult(
        check_results=to_results(HIDDEN_STATE_CHECKS, outcomes),
        metadata=store_metadata(root, report, selected, merged),
    )


def capture_against_forward(
    context: dg.AssetExecutionContext,
    config: HiddenStatesConfig,
    root: Path,
    resources: tuple[HiddenStatesResource, TargetModelResource, TokenizerResource],
) -> CheckOutcome:
    """`capture_check.capture_matches_forward` where the target is already loaded here (the transformers backend);
    an SGLang capture, whose target this process does not hold, is not checked yet, and the outcome says so."""
    from eagle3_assets.stages.hidden_states.capture_check import capture_matches_forward

    backend, target, tokenizer = resources
    if config.capture_check_samples <= 0:
        return CheckOutcome(True, "not run: capture_check_samples is 0", {"ran": False})
    if backend.backend != HiddenStatesBackendKind.TRANSFORMERS:
        return CheckOutcome(
            True,
            f"not run: the {backend.backend.value} backend's capture needs a plain forward on the GPU host, which this "
            "check does not run yet",
            {"ran": False},
        )
    model = target.load_model(tokenizer, context.log.info)
    outcome = capture_matches_forward(model, root, config.capture_check_samples)
    return CheckOutcome(outcome.passed, outcome.description, outcome.metadata | {"ran": True})


def store_settings(config: HiddenStatesConfig, batch_tokens: int) -> "StoreSettings":
    """The store's figures from the asset's config (GB to bytes) and the backend's batch budget."""
    from eagle3_resources.hidden_states.extract import StoreSettings

    return StoreSettings(
        shard_bytes=int(config.shard_gb * 1e9),
        batch_tokens=batch_tokens,
        writers=config.writers,
        verify_on_resume=config.verify_on_resume,
        free_bytes=config.free_bytes,
        margin_pct=config.disk_margin_pct,
        reserve_bytes=int(config.disk_reserve_gb * 1e9),
        discard_stale=config.discard_stale_shards,
    )


def progress_observer(context: dg.AssetExecutionContext) -> Callable[[dict[str, Any]], None]:
    """The extraction's progress figures as observations: live progress on the asset's page."""

    def observe(figures: dict[str, Any]) -> None:
        context.log_event(
            dg.AssetObservation(
                asset_key=context.assets_def.key,
                description=f"progress of run {context.run_id[:8]}",
                metadata={k: v for k, v in figures.items() if v is not None},
            )
        )

    return observe


def store_metadata(
    root: Path, report: "ExtractionReport", selected: pl.DataFrame, merged: pl.DataFrame
) -> dict[str, Any]:
    """The materialization's metadata: the store's totals from its manifest, what this run wrote, a preview."""
    from eagle3_resources.hidden_states.extract import store_figures
    from eagle3_resources.hidden_states.store import HiddenStateStore, read_manifest, token_bytes

    manifest, figures = read_manifest(root), store_figures(root)
    by_dataset = tokens_by_dataset(selected, merged)
    reader = HiddenStateStore(root)
    return {
        "samples": figures["samples"],
        "tokens": figures["tokens"],
        "merged_samples": merged.height,
        "shards": figures["shards"],
        "shards_written": report.shards_written,
        "shards_kept": report.shards_skipped,
        "bytes": figures["bytes"],
        "bytes_written": report.bytes_written,
        "bytes_per_token": figures["bytes_per_token"],
        "min_bytes_per_token": figures["min_bytes_per_token"],
        "overhead_over_min_pct": figures["overhead_pct"],
        "tokens_per_s": round(report.tokens_per_s, 1),
        "aux_layer_ids": json_value(manifest["aux_layer_ids"]),
        "layer_convention": manifest["layer_convention"],
        "final_hidden_state": manifest["final_hidden_state"],
        "hidden_size": manifest["hidden_size"],
        "path": path_value(root),
        "backend": json_value(manifest["backend"]),
        "tokens_by_dataset": markdown_table(by_dataset, rows=len(by_dataset)),
        "tokens_by_dataset_picture": png_markdown(tokens_picture(by_dataset, token_bytes(manifest["hidden_size"]))),
        "preview": markdown_table(sample_preview(reader, selected["sample_id"].to_list()), rows=5),
    }
