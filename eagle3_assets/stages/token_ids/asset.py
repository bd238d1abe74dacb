"""`token_ids`: exact target ids and loss mask per completion, with per-sample proof."""

import dagster as dg
import polars as pl
from pydantic import Field

from eagle3_assets.common.failures import failure_for_operator
from eagle3_assets.common.k8s import K8S_CONFIG_TAG, api_pod_config
from eagle3_assets.common.metadata import markdown_table, path_value, png_markdown
from eagle3_assets.common.outcome import per_dataset
from eagle3_assets.common.per_dataset import dataset_check_specs, per_dataset_results
from eagle3_assets.common.registry import dataset_partitions
from eagle3_assets.common.standin import explained, is_standin_target
from eagle3_assets.stages.completions.asset import completions
from eagle3_assets.stages.token_ids.checks import TOKEN_CHECKS
from eagle3_assets.stages.token_ids.reconstruct import build_token_ids, token_ids_summary
from eagle3_resources.completions.resource import CompletionsResource
from eagle3_resources.storage import DataStore
from eagle3_resources.target.resource import TargetModelResource
from eagle3_resources.tokenizer.resource import TokenizerResource


def proof_plot(dataset: str, df: pl.DataFrame):
    """Per sample: our completion length against the one the backend billed or reported (the diagonal is agreement)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    billed = df.filter(pl.col("billed_completion_tokens").is_not_null())
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3))
    if billed.height:
        x, y = billed["billed_completion_tokens"].to_list(), billed["completion_len"].to_list()
        ax1.scatter(x, y, s=8)
        top = max(max(x), max(y))
        ax1.plot([0, top], [0, top], color="grey", lw=0.8, ls=":")
        ax2.hist(billed["completion_len_diff"].to_list(), bins=30)
    else:
        for ax in (ax1, ax2):
            ax.text(0.5, 0.5, "no billed counts", ha="center", va="center", transform=ax.transAxes)
    ax1.set_xlabel("billed completion tokens")
    ax1.set_ylabel("reconstructed ids")
    ax1.set_title(f"{dataset}: ids vs bill, per sample")
    ax2.set_xlabel("reconstructed - billed")
    ax2.set_title(f"{billed.height} samples")
    plt.close(fig)
    return fig


class TokenIdsConfig(dg.Config):
    mask_im_end: bool = Field(default=True, description="train the drafter to predict the final `<|im_end|>`")
    billed_includes_im_end: bool = Field(
        default=True,
        description="the provider's completion_tokens counts the final "
        "`<|im_end|>` (measure on a pilot: the billed-count check is 0 with the right value)",
    )


@dg.asset(
    check_specs=dataset_check_specs("token_ids", TOKEN_CHECKS),
    partitions_def=dataset_partitions,
    deps=[completions],
    backfill_policy=dg.BackfillPolicy.single_run(),
    group_name="token_ids",
    kinds={"parquet"},
    op_tags={K8S_CONFIG_TAG: api_pod_config()},  # a small CPU pod under the k8s executor
    description="Prompt ids (chat template) + completion ids (reasoning, `</think>`, content, `<|im_end|>`) and a loss "
    "mask over the completion; backend ids kept where returned and checked against the text.",
)
@failure_for_operator
def token_ids(
    context: dg.AssetExecutionContext,
    config: TokenIdsConfig,
    store: DataStore,
    tokenizer: TokenizerResource,
    target: TargetModelResource,
    completions_backend: CompletionsResource,
):
    tok = tokenizer.load()
    # The completions came from the tiny stand-in (this run's resources say so): its failures are said to be its own.
    standin = is_standin_target(completions_backend, target)
    metadata, frames = {}, {}
    for key in context.partition_keys:
        df = build_token_ids(
            pl.read_parquet(store.layout.completions(key)),
            tok,
            mask_im_end=config.mask_im_end,
            billed_includes_im_end=config.billed_includes_im_end,
        )
        path = store.layout.ensure(store.layout.token_ids(key))
        df.write_parquet(path)
        summary = token_ids_summary(df)
        context.log.info(f"{key}: {summary}")
        frames[key] = df
        metadata[key] = {
            **{k: v for k, v in summary.items() if v is not None},
            "token_count_proof": png_markdown(proof_plot(key, df)),
            "path": path_value(path),
            "preview": markdown_table(
                df, ["prompt_id", "prompt_len", "completion_len", "ids_source", "ids_match", "n_separators", "has_end"]
            ),
        }
    outcomes = explained(per_dataset(TOKEN_CHECKS, frames), standin)
    yield from per_dataset_results(context, metadata, TOKEN_CHECKS, outcomes)
