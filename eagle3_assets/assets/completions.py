"""`completions`: the target's answer to every prompt, journaled as it arrives."""


from typing import Optional

import dagster as dg
import polars as pl
from pydantic import Field

from eagle3_assets.assets.raw_prompts import raw_prompts
from eagle3_assets.completions import Caps, Pricing, build_requests, completions_frame, ledger_usd, run_completions
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
    max_run_usd: Optional[float] = Field(default=None, description="dollar cap for this run (worst-case admission: never overshot)")
    max_total_usd: Optional[float] = Field(default=None, description="dollar cap for the whole ledger: every partition, every run")
    on_cap: str = Field(default="finish", description='in-flight requests when a cap is reached: "finish" or "cancel"')
    usd_per_m_prompt_tokens: float = Field(default=0.60, description="model price for worst-case admission (check /api/v1/models)")
    usd_per_m_completion_tokens: float = Field(default=2.50, description="model price for worst-case admission (check /api/v1/models)")

    def settings(self, backend: BackendKind) -> SamplingSettings:
        max_tokens = self.max_tokens or (LOCAL_MAX_TOKENS if backend is BackendKind.LOCAL else REMOTE_MAX_TOKENS)
        fields = {k: v for k, v in self.model_dump().items() if k in SamplingSettings.model_fields}
        return SamplingSettings(**{**fields, "max_tokens": max_tokens})

    def caps(self, token_budget: Optional[int]) -> Caps:
        if self.on_cap not in ("finish", "cancel"):
            raise ValueError(f'on_cap must be "finish" or "cancel", not {self.on_cap!r}')
        return Caps(token_budget=token_budget, run_usd=self.max_run_usd, total_usd=self.max_total_usd, on_cap=self.on_cap)

    def pricing(self) -> Pricing:
        return Pricing(prompt=self.usd_per_m_prompt_tokens / 1e6, completion=self.usd_per_m_completion_tokens / 1e6)


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
        requests = build_requests(prompts, tok, tokenizer.template_version, tokenizer.thinking, send_tools=config.send_tools)
        journal = store.layout.completions_journal(key)
        try:
            run = run_completions(key, requests, backend, settings, journal, caps=config.caps(spec.token_budget),
                                  pricing=config.pricing(), total_spent_usd=ledger_usd(store.layout.all_completion_journals()),
                                  log=context.log.info, run_id=context.run_id)
        except RunFatalError as e:
            raise dg.Failure(description=f"{key}: {e}. Every finished response is in {journal}; fix the cause and "
                             "re-materialize to resume.") from None
        df = completions_frame(key, requests, journal, prompts)
        path = store.layout.ensure(store.layout.completions(key))
        df.write_parquet(path)
        frames.append(df)
        summaries.append({"dataset": key, "sent": run.sent, "stopped_by": run.stopped_by, "resumed_done": run.resumed_done,
                          "duration_s": round(run.duration_s, 1), "results": dict(run.results), "errors": dict(run.errors),
                          "cost_usd": round(run.cost_usd, 6), "inflight_found": run.inflight_found,
                          "inflight_cost_usd": round(run.inflight_cost_usd, 6), "possible_double_spend": run.possible_double_spend})
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
            "run_cost_usd": round(sum(s["cost_usd"] for s in summaries), 6),
            "possible_double_spend": sum(s["possible_double_spend"] for s in summaries),
            "stopped_by": "; ".join(f"{s['dataset']}: {s['stopped_by']}" for s in summaries if s["stopped_by"]) or "not stopped",
            "backend": json_value(backend.describe()),
            "request_settings": json_value(settings.model_dump()),
            "runs": json_value(summaries),
            "path": path_value(store.layout.completions(context.partition_keys[0])),
            "journal": path_value(store.layout.completions_journal(context.partition_keys[0])),
            "preview": markdown_table(df, ["prompt_id", "status", "finish_reason", "completion_tokens", "reasoning", "content"]),
        }
    )
