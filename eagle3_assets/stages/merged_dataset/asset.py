"""`merged_dataset`: every dataset's complete samples, deduplicated, with a train/eval split."""

import dagster as dg
import polars as pl
from pydantic import Field

from eagle3_assets.common.failures import failure_for_operator
from eagle3_assets.common.k8s import K8S_CONFIG_TAG, api_pod_config
from eagle3_assets.common.metadata import markdown_table, path_value, png_markdown
from eagle3_assets.common.outcome import check_specs, run_checks
from eagle3_assets.common.registry import DATASETS
from eagle3_assets.stages.merged_dataset.checks import MERGED_CHECKS
from eagle3_assets.stages.merged_dataset.merge import merge_token_ids
from eagle3_assets.stages.token_ids.asset import token_ids
from eagle3_resources.storage import DataStore


class MergeConfig(dg.Config):
    eval_fraction: float = Field(
        default=0.05, description="share of samples in the eval split (by a stable hash of the id)"
    )


def mix_plot(accounting: pl.DataFrame):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 2.8))
    names = accounting["dataset"].to_list()
    ax.bar(names, accounting["train"].to_list(), label="train")
    ax.bar(names, accounting["eval"].to_list(), bottom=accounting["train"].to_list(), label="eval")
    ax.set_ylabel("samples")
    ax.set_title("merged dataset: samples per dataset")
    ax.legend()
    plt.close(fig)
    return fig


@dg.asset(
    check_specs=check_specs("merged_dataset", MERGED_CHECKS),
    deps=[dg.AssetDep(token_ids, partition_mapping=dg.AllPartitionMapping())],
    group_name="training",
    kinds={"polars", "parquet"},
    op_tags={K8S_CONFIG_TAG: api_pod_config()},  # a small CPU pod under the k8s executor
    description="All datasets' token ids: failed and truncated samples dropped, exact duplicates removed, a "
    "deterministic train/eval split. Not partitioned: a backfill dialog's preview lists it under "
    '"No partitions available to materialize", yet a run over datasets builds it once, after their `token_ids`.',
)
@failure_for_operator
def merged_dataset(context: dg.AssetExecutionContext, config: MergeConfig, store: DataStore) -> dg.MaterializeResult:
    frames, missing = {}, []
    for name in DATASETS:
        path = store.layout.token_ids(name)
        if path.exists():
            frames[name] = pl.read_parquet(path)
        else:
            missing.append(name)
    if missing:
        context.log.warning(f"token_ids not materialized for {', '.join(missing)}: merging the others")
    if not frames:
        raise dg.Failure(description="no dataset has token_ids yet: materialize token_ids first")
    merged, accounting = merge_token_ids(frames, config.eval_fraction)
    path = store.layout.ensure(store.layout.merged_dataset())
    merged.write_parquet(path)
    return dg.MaterializeResult(
        check_results=run_checks(MERGED_CHECKS, merged, list(DATASETS)),
        metadata={
            "rows": merged.height,
            "train_rows": int((merged["split"] == "train").sum()),
            "eval_rows": int((merged["split"] == "eval").sum()),
            "tokens": int(merged["n_tokens"].sum()),
            "loss_tokens": int(merged["completion_len"].sum()),
            "datasets_missing": ", ".join(missing) or "none",
            "mix": markdown_table(accounting, rows=len(DATASETS)),
            "mix_plot": png_markdown(mix_plot(accounting)),
            "path": path_value(path),
            "preview": markdown_table(merged, ["sample_id", "split", "prompt_len", "completion_len"]),
        },
    )
