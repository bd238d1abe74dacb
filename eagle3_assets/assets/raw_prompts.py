"""`raw_prompts`: each dataset's prompt file, validated, as Parquet."""


import dagster as dg
import polars as pl

from eagle3_assets.metadata import markdown_table, path_value
from eagle3_assets.prompts import (
    PromptFileError,
    prompts_frame,
    read_prompts,
    with_prompt_tokens,
)
from eagle3_assets.registry import RegistryError, dataset_partitions, dataset_spec
from eagle3_resources.storage import DataStore
from eagle3_resources.tokenizer.resource import TokenizerResource


@dg.asset(
    partitions_def=dataset_partitions,
    backfill_policy=dg.BackfillPolicy.single_run(),
    group_name="prompts",
    kinds={"parquet"},
    description="Prompts of one dataset read from its file in data/ (see data/datasets.yaml), validated: "
    "any malformed line fails the partition with the file, the line and what is wrong.",
)
def raw_prompts(context: dg.AssetExecutionContext, store: DataStore, tokenizer: TokenizerResource) -> dg.MaterializeResult:
    problems, frames = [], {}
    for key in context.partition_keys:
        try:
            spec = dataset_spec(key)
            frames[key] = prompts_frame(read_prompts(spec), key)
        except (PromptFileError, RegistryError) as e:
            problems.append(str(e))
    if problems:
        raise dg.Failure(description="Bad prompt input; nothing downstream ran.\n\n" + "\n\n".join(problems))
    tok = tokenizer.load()
    for key, df in frames.items():
        df = with_prompt_tokens(df, tok, tokenizer.template_version, tokenizer.thinking)
        frames[key] = df
        path = store.layout.ensure(store.layout.raw_prompts(key))
        df.write_parquet(path)
        context.log.info(f"{key}: {df.height} prompts -> {path}")
    total = pl.concat(list(frames.values()))
    return dg.MaterializeResult(
        metadata={
            "rows": total.height,
            "tokens": int(total["prompt_tokens"].sum()),
            "max_prompt_tokens": int(total["prompt_tokens"].max()),
            "datasets": ", ".join(frames),
            "with_tools": int(total["has_tools"].sum()),
            "multi_turn": int((total["n_user_turns"] > 1).sum()),
            "with_system": int(total["has_system"].sum()),
            "chars": int(total["chars"].sum()),
            "path": path_value(store.layout.raw_prompts(next(iter(frames)))),
            "preview": markdown_table(total, ["prompt_id", "n_messages", "has_tools", "last_role", "prompt_tokens", "messages_json"]),
        }
    )
