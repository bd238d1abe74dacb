"""`completions`: the target's answer to every prompt, journaled as it arrives."""


from typing import Optional

import dagster as dg
import polars as pl
from pydantic import Field

from eagle3_assets.assets.raw_prompts import raw_prompts
from eagle3_assets.completions import build_requests, completions_frame, run_completions
from eagle3_assets.metadata import json_value, markdown_table, path_value
from eagle3_assets.registry import dataset_partitions, dataset_spec
from eagle3_resources.completions.resource import BackendKind, CompletionsResource
from eagle3_resources.completions.types import RunFatalError, SamplingSettings
from eagle3_resources.storage import DataStore
from eagle3_resources.target.resource import TargetModelResource
from eagle3_resources.tokenizer.resource import TokenizerResource

LOCAL_MAX_TOKENS = 160  # the stand-in answers in ~40-60 tokens
REMOTE_MAX_TOKENS = 16384


class CompletionsConfig(SamplingSettings):
    """Request settings of this run (recorded with the materialization)."""

    max_tokens: Optional[int] = Field(default=None, description=f"unset: {LOCAL_MAX_TOKENS} on the local backend, {REMOTE_MAX_TOKENS} otherwise")

    def settings(self, backend: BackendKind) -> SamplingSettings:
        max_tokens = self.max_tokens or (LOCAL_MAX_TOKENS if backend is BackendKind.LOCAL else REMOTE_MAX_TOKENS)
        return SamplingSettings(**{**self.model_dump(), "max_tokens": max_tokens})


@dg.asset(
    partitions_def=dataset_partitions,
    deps=[raw_prompts],
    backfill_policy=dg.BackfillPolicy.single_run(),
    group_name="completions",
    kinds={"parquet"},
    description="Completions from the configured backend (local transformers, OpenRouter or SGLang). Every result "
    "is journaled on arrival; re-materializing resumes and never re-sends a prompt with a final outcome.",
)
def completions(
    context: dg.AssetExecutionContext,
    config: CompletionsConfig,
    store: DataStore,
    tokenizer: TokenizerResource,
    target: TargetModelResource,
    completions_backend: CompletionsResource,
) -> dg.MaterializeResult:
    tok = tokenizer.load()
    settings = config.settings(completions_backend.backend)
    backend = completions_backend.make_backend(tok, lambda: target.load_model(tokenizer, context.log.info))
    summaries, frames = [], []
    for key in context.partition_keys:
        spec = dataset_spec(key)
        prompts = pl.read_parquet(store.layout.raw_prompts(key))
        if spec.sample_cap is not None and prompts.height > spec.sample_cap:
            context.log.info(f"{key}: sample cap {spec.sample_cap} of {prompts.height} prompts")
            prompts = prompts.head(spec.sample_cap)
        requests = build_requests(prompts, tok, tokenizer.template_version, tokenizer.thinking)
        journal = store.layout.completions_journal(key)
        try:
            run = run_completions(key, requests, backend, settings, journal, token_budget=spec.token_budget,
                                  log=context.log.info, run_id=context.run_id)
        except RunFatalError as e:
            raise dg.Failure(description=f"{key}: {e}. Every finished response is in {journal}; fix the cause and "
                             "re-materialize to resume.") from None
        df = completions_frame(key, requests, journal, prompts)
        path = store.layout.ensure(store.layout.completions(key))
        df.write_parquet(path)
        frames.append(df)
        summaries.append({"dataset": key, "sent": run.sent, "stopped_by": run.stopped_by, "resumed_done": run.resumed_done,
                          "duration_s": round(run.duration_s, 1), "results": dict(run.results), "errors": dict(run.errors)})
    df = pl.concat(frames)
    counts = df["status"].value_counts()
    duration = sum(s["duration_s"] for s in summaries)
    return dg.MaterializeResult(
        metadata={
            "rows": df.height,
            **{f"status_{s}": int(n) for s, n in counts.rows()},
            "completion_tokens": int(df["completion_tokens"].fill_null(0).sum()),
            "prompt_tokens": int(df["prompt_tokens"].fill_null(0).sum()),
            "cost_usd": round(float(df["cost_usd"].sum()), 6),
            "duration_s": duration,
            "requests_per_s": round(sum(s["sent"] for s in summaries) / duration, 3) if duration else 0.0,
            "stopped_by": "; ".join(f"{s['dataset']}: {s['stopped_by']}" for s in summaries if s["stopped_by"]) or "not stopped",
            "backend": json_value(backend.describe()),
            "request_settings": json_value(settings.model_dump()),
            "runs": json_value(summaries),
            "path": path_value(store.layout.completions(context.partition_keys[0])),
            "journal": path_value(store.layout.completions_journal(context.partition_keys[0])),
            "preview": markdown_table(df, ["prompt_id", "status", "finish_reason", "completion_tokens", "reasoning", "content"]),
        }
    )
