"""`token_ids`: exact target ids and loss mask per completion, with per-sample proof."""


import dagster as dg
import polars as pl
from pydantic import Field

from eagle3_assets.assets.completions import completions
from eagle3_assets.checks.outcome import check_specs, per_dataset, to_results
from eagle3_assets.checks.tokens import TOKEN_CHECKS
from eagle3_assets.metadata import json_value, markdown_table, path_value
from eagle3_assets.registry import dataset_partitions
from eagle3_assets.token_ids import build_token_ids, token_ids_summary
from eagle3_resources.storage import DataStore
from eagle3_resources.tokenizer.resource import TokenizerResource


class TokenIdsConfig(dg.Config):
    mask_im_end: bool = Field(default=True, description="train the drafter to predict the final <|im_end|>")
    billed_includes_im_end: bool = Field(default=True, description="the provider's completion_tokens counts the final "
                                         "<|im_end|> (measure on a pilot: the billed-count check is 0 with the right value)")


@dg.asset(
    check_specs=check_specs("token_ids", TOKEN_CHECKS),
    partitions_def=dataset_partitions,
    deps=[completions],
    backfill_policy=dg.BackfillPolicy.single_run(),
    group_name="token_ids",
    kinds={"parquet"},
    description="Prompt ids (chat template) + completion ids (reasoning, </think>, content, <|im_end|>) and a loss "
    "mask over the completion; backend ids kept where returned and checked against the text.",
)
def token_ids(context: dg.AssetExecutionContext, config: TokenIdsConfig, store: DataStore, tokenizer: TokenizerResource) -> dg.MaterializeResult:
    tok = tokenizer.load()
    frames, summaries = [], {}
    for key in context.partition_keys:
        df = build_token_ids(pl.read_parquet(store.layout.completions(key)), tok, mask_im_end=config.mask_im_end,
                             billed_includes_im_end=config.billed_includes_im_end)
        df.write_parquet(store.layout.ensure(store.layout.token_ids(key)))
        summaries[key] = token_ids_summary(df)
        context.log.info(f"{key}: {summaries[key]}")
        frames.append(df)
    df = pl.concat(frames)
    summary = token_ids_summary(df)
    return dg.MaterializeResult(
        check_results=to_results(TOKEN_CHECKS, per_dataset(TOKEN_CHECKS, df)),
        metadata={
            **{k: v for k, v in summary.items() if v is not None},
            "per_dataset": json_value(summaries),
            "path": path_value(store.layout.token_ids(context.partition_keys[0])),
            "preview": markdown_table(df, ["prompt_id", "prompt_len", "completion_len", "ids_source", "ids_match", "n_separators", "has_end"]),
        }
    )
