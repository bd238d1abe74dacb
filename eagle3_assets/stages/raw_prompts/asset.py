"""`raw_prompts`: each dataset's prompts, validated, selected and de-duplicated, as Parquet.

Two sources per dataset (data/datasets.yaml): the shipped sample file (the embedded default), or
the real public dataset its `import:` block names (`prompts: real`, or EAGLE3_PROMPTS=real).
"""

import functools
import os
from pathlib import Path
from typing import Any, cast

import dagster as dg
import polars as pl
from pydantic import Field

from eagle3_assets.common.failures import failure_for_operator, operator_failure
from eagle3_assets.common.k8s import K8S_CONFIG_TAG, api_pod_config
from eagle3_assets.common.metadata import json_value, markdown_table, path_value
from eagle3_assets.common.per_dataset import dataset_check_specs, per_dataset_results
from eagle3_assets.common.registry import DATASETS, dataset_partitions
from eagle3_assets.stages.raw_prompts.checks import PROMPT_CHECKS, reject_rate
from eagle3_assets.stages.raw_prompts.importers.build import DatasetPrompts, build_prompt_sets
from eagle3_assets.stages.raw_prompts.importers.importer import PromptLength
from eagle3_assets.stages.raw_prompts.prompts import prompts_frame, with_prompt_tokens
from eagle3_resources.errors import PromptFileError, RegistryError, SourceError
from eagle3_resources.storage import DataStore
from eagle3_resources.tokenizer.chat_format import render_messages
from eagle3_resources.tokenizer.resource import TokenizerResource


class RawPromptsConfig(dg.Config):
    prompts: str | None = Field(
        default=None,
        description='"sample": the shipped sample files; "real": import each '
        "dataset's public source (its `import:` block in data/datasets.yaml). Unset: "
        "EAGLE3_PROMPTS, else sample",
    )
    sources_dir: str | None = Field(
        default=None,
        description="a local copy of the sources, laid out "
        "<dir>/<hub id>/<files>; unset: EAGLE3_SOURCES_DIR, else download from the Hugging Face Hub",
    )

    def mode(self) -> str:
        return self.prompts or os.environ.get("EAGLE3_PROMPTS") or "sample"

    def local_sources(self) -> str | None:
        return self.sources_dir or os.environ.get("EAGLE3_SOURCES_DIR") or None


def _built_keys(store: DataStore):
    def read(name: str) -> list[str] | None:
        path = store.layout.raw_prompts(name)
        if not path.exists():
            return None
        df = pl.read_parquet(path)
        return df["prompt_key"].to_list() if "prompt_key" in df.columns else None

    return read


@dg.asset(
    check_specs=dataset_check_specs("raw_prompts", PROMPT_CHECKS, blocking={"reject_rate"}),
    partitions_def=dataset_partitions,
    backfill_policy=dg.BackfillPolicy.single_run(),
    group_name="prompts",
    kinds={"parquet"},
    op_tags={K8S_CONFIG_TAG: api_pod_config()},  # a small CPU pod under the k8s executor
    description="Prompts of one dataset, from its sample file in data/ or imported from its public source "
    "(data/datasets.yaml), validated, filtered, sampled with a seed and de-duplicated across datasets. A malformed "
    "line of a sample file fails the partition with the file, the line and what is wrong; a source row that does not "
    "convert is skipped into `<ds>.rejects.jsonl`, and the reject-rate check blocks above the dataset's limit.",
)
@failure_for_operator
def raw_prompts(
    context: dg.AssetExecutionContext, config: RawPromptsConfig, store: DataStore, tokenizer: TokenizerResource
):
    load = functools.cache(tokenizer.load)  # only once the input is known to be good

    length = PromptLength(
        render=lambda messages, tools: render_messages(
            messages, tools, version=tokenizer.template_version, thinking=tokenizer.thinking
        ),
        count=lambda text: len(load().encode(text, allow_special=True)),
    )

    mode = config.mode()
    try:
        sets = build_prompt_sets(
            context.partition_keys,
            DATASETS,
            mode=mode,
            length=length,
            sources_dir=config.local_sources(),
            built_keys=_built_keys(store),
            log=context.log.info,
            rejects_path=lambda name: store.layout.raw_prompts(name).with_suffix(".rejects.jsonl"),
        )
    except (PromptFileError, RegistryError, SourceError) as e:
        raise operator_failure(e, before=f"Bad prompt input ({mode} prompts); nothing downstream ran.\n\n") from e
    metadata, outcomes = {}, {}
    for key, result in sets.items():
        if not result.prompts:
            raise dg.Failure(description=f"{key}: no prompt selected ({result.report.summary()})")
        df = with_prompt_tokens(
            prompts_frame(result.prompts, key), load(), tokenizer.template_version, tokenizer.thinking
        )
        path = store.layout.ensure(store.layout.raw_prompts(key))
        df.write_parquet(path)
        context.log.info(f"{key}: {df.height} prompts -> {path}")
        limit = DATASETS[key].imported().max_reject_rate if mode == "real" else 0.0
        outcomes[key] = {"reject_rate": reject_rate(result.report, limit)}
        metadata[key] = prompt_set_metadata(df, result, mode, path)
    yield from per_dataset_results(context, metadata, PROMPT_CHECKS, outcomes)


def prompt_set_metadata(df: pl.DataFrame, result: DatasetPrompts, mode: str, path: Path) -> dict[str, Any]:
    """One dataset's figures: what was read, what was dropped and why, what was kept."""
    report = result.report
    return {
        "rows": df.height,
        "prompts_source": mode,
        "source": result.source,
        "tokens": int(df["prompt_tokens"].sum()),
        "max_prompt_tokens": int(cast(int, df["prompt_tokens"].max())),  # an integer column, never empty here
        "source_rows": report.rows,
        "rejected": report.rejected,
        "duplicates": report.duplicates + sum(report.duplicates_of.values()),
        "with_tools": int(df["has_tools"].sum()),
        "multi_turn": int((df["n_user_turns"] > 1).sum()),
        "with_system": int(df["has_system"].sum()),
        "chars": int(df["chars"].sum()),
        "import_report": json_value({**report.to_dict(), "not_checked_against": result.not_checked_against}),
        "settings": json_value(result.settings),
        **({"rejects_file": path_value(result.rejects_path)} if result.rejects_path else {}),
        "path": path_value(path),
        "preview": markdown_table(
            df, ["prompt_id", "n_messages", "has_tools", "last_role", "prompt_tokens", "source_row", "messages_json"]
        ),
    }
