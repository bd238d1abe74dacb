"""`completions`: the target's answer to every prompt, journaled as it arrives."""


import fcntl
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import dagster as dg
import polars as pl
from pydantic import Field

from eagle3_assets.assets.raw_prompts import raw_prompts
from eagle3_assets.checks.completions import COMPLETION_CHECKS
from eagle3_assets.checks.outcome import (
    CheckOutcome,
    check_specs,
    combine,
    per_dataset,
    to_results,
)
from eagle3_assets.completions import (
    HALTED,
    Caps,
    Ledger,
    Pricing,
    build_requests,
    completions_frame,
    final_results,
    read_ledger,
    run_completions,
)
from eagle3_assets.metadata import json_value, markdown_table, path_value
from eagle3_assets.pilot import pilot_outcome, pilot_passed
from eagle3_assets.registry import dataset_partitions, dataset_spec
from eagle3_assets.spend import SpendPolicy, get_hold, halt_reason
from eagle3_assets.token_ids import build_token_ids
from eagle3_resources.completions.resource import BackendKind, CompletionsResource
from eagle3_resources.completions.types import RunFatalError, SamplingSettings
from eagle3_resources.journal import Journal
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
    pilot_size: int = Field(default=8, description="prompts of a partition sent first; the rest waits for the pilot's "
                            "blocking checks (0: no pilot)")
    usd_per_m_prompt_tokens: float = Field(default=0.60, description="model price for worst-case admission (check /api/v1/models)")
    usd_per_m_completion_tokens: float = Field(default=2.50, description="model price for worst-case admission (check /api/v1/models)")

    def settings(self, backend: BackendKind) -> SamplingSettings:
        max_tokens = self.max_tokens or (LOCAL_MAX_TOKENS if backend is BackendKind.LOCAL else REMOTE_MAX_TOKENS)
        fields = {k: v for k, v in self.model_dump().items() if k in SamplingSettings.model_fields}
        return SamplingSettings(**{**fields, "max_tokens": max_tokens})

    def caps(self, token_budget: Optional[int], policy: SpendPolicy, ledger: Ledger) -> Caps:
        """This run's caps and the spend policy's, whichever is tighter: the client enforces the
        policy before every request, so spending stops even when no sensor daemon runs."""
        if self.on_cap not in ("finish", "cancel"):
            raise ValueError(f'on_cap must be "finish" or "cancel", not {self.on_cap!r}')

        def tighter(a, b):
            return b if a is None else a if b is None else min(a, b)

        return Caps(token_budget=token_budget, run_usd=tighter(self.max_run_usd, policy.max_run_usd),
                    total_usd=tighter(self.max_total_usd, policy.max_total_usd), day_usd=policy.max_day_usd, on_cap=self.on_cap)

    def pricing(self) -> Pricing:
        return Pricing(prompt=self.usd_per_m_prompt_tokens / 1e6, completion=self.usd_per_m_completion_tokens / 1e6)


PILOT_CHECK = "pilot"
CHECKS = {**COMPLETION_CHECKS, PILOT_CHECK: (pilot_outcome, "ERROR")}


@contextmanager
def partition_lock(journal: Path, run_id: str):
    """One spending run per dataset at a time: an exclusive lock next to the journal."""
    path = journal.with_name("lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            raise dg.Failure(description=f"{journal.parent.name} is being completed by run {f.read().strip() or '?'}: "
                             "one spending run per dataset at a time") from None
        f.seek(0)
        f.truncate()
        f.write(run_id)
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@dg.asset(
    check_specs=check_specs("completions", CHECKS, blocking={PILOT_CHECK}),
    partitions_def=dataset_partitions,
    deps=[raw_prompts],
    backfill_policy=dg.BackfillPolicy.single_run(),
    group_name="completions",
    kinds={"parquet"},
    description="Completions from the configured backend (local transformers, OpenRouter or SGLang). A pilot batch "
    "is checked before the rest is sent; every result is journaled on arrival; re-materializing resumes and never "
    "re-sends a prompt with a final outcome. Refuses to start while the credit sensor holds spending.",
)
def completions(
    context: dg.AssetExecutionContext,
    config: CompletionsConfig,
    store: DataStore,
    tokenizer: TokenizerResource,
    target: TargetModelResource,
    completions_backend: CompletionsResource,
    spend_policy: SpendPolicy,
) -> dg.MaterializeResult:
    hold = get_hold(context.instance)
    if hold:
        raise dg.Failure(description="spending is on hold: " + "; ".join(hold["reasons"]) + ". Lift it with `eagle3 hold lift` "
                         "(or the lift_spend_hold job), or raise the threshold.", metadata={"hold": json_value(hold)})
    tok = tokenizer.load()
    settings = config.settings(completions_backend.backend)
    backend = completions_backend.make_backend(tok, lambda: target.load_model(tokenizer, context.log.info))
    summaries, frames, pilots = [], [], {}
    for key in context.partition_keys:
        spec = dataset_spec(key)
        prompts = pl.read_parquet(store.layout.raw_prompts(key))
        if spec.sample_cap is not None and prompts.height > spec.sample_cap:
            context.log.info(f"{key}: sample cap {spec.sample_cap} of {prompts.height} prompts")
            prompts = prompts.head(spec.sample_cap)
        requests = build_requests(prompts, tok, tokenizer.template_version, tokenizer.thinking, send_tools=config.send_tools)
        journal = store.layout.completions_journal(key)

        def complete(batch, key=key, spec=spec, journal=journal):
            ledger = read_ledger(store.layout.all_completion_journals())
            return run_completions(key, batch, backend, settings, journal, caps=config.caps(spec.token_budget, spend_policy, ledger),
                                   pricing=config.pricing(), total_spent_usd=ledger.total_usd, day_spent_usd=ledger.day_usd,
                                   log=context.log.info, run_id=context.run_id,
                                   halt=lambda: halt_reason(context.instance, context.run_id))

        with partition_lock(journal, context.run_id):
            try:
                run = None  # what was sent and why it stopped; None when a failed pilot sent the rest nowhere
                if config.pilot_size and not pilot_passed(journal):
                    done, _ = final_results(journal)
                    batch = [r for r in requests if r.prompt_id not in done][: config.pilot_size]
                    context.log.info(f"{key}: pilot of {len(batch)} prompts before the rest")
                    pilot_run = complete(batch)
                    if pilot_run.stopped_by:  # a hold, a cap: no verdict on a part of the pilot, and nothing more is sent
                        run = pilot_run
                        pilots[key] = CheckOutcome(False, f"pilot cut short ({run.stopped_by}); it runs again on the next "
                                                   "materialization", {"sent": run.sent})
                    else:
                        pilot_frame = completions_frame(key, batch, journal, prompts)
                        pilots[key] = pilot_outcome(pilot_frame, build_token_ids(pilot_frame, tok))
                        with Journal(journal) as j:
                            j.append({"type": "pilot", "run_id": context.run_id, "t": time.time(), "passed": pilots[key].passed,
                                      "description": pilots[key].description, "n": len(batch)})
                    context.log.info(f"{key}: {pilots[key].description}")
                if key not in pilots or pilots[key].passed:
                    run = complete(requests)
            except RunFatalError as e:
                raise dg.Failure(description=f"{key}: {e}. Every finished response is in {journal}; fix the cause and "
                                 "re-materialize to resume.") from None
        df = completions_frame(key, requests, journal, prompts)
        df.write_parquet(store.layout.ensure(store.layout.completions(key)))
        if run is not None and (run.stopped_by or "").startswith(HALTED):
            raise dg.Failure(description=f"{key}: {run.stopped_by}. {run.sent} requests were sent; every finished response "
                             f"is in {journal}; re-materialize to resume once the hold is lifted.")
        frames.append(df)
        if run is not None:
            summaries.append({"dataset": key, "sent": run.sent, "stopped_by": run.stopped_by, "resumed_done": run.resumed_done,
                              "duration_s": round(run.duration_s, 1), "results": dict(run.results), "errors": dict(run.errors),
                              "cost_usd": round(run.cost_usd, 6), "inflight_found": run.inflight_found,
                              "inflight_cost_usd": round(run.inflight_cost_usd, 6), "possible_double_spend": run.possible_double_spend})
        else:
            summaries.append({"dataset": key, "sent": config.pilot_size, "stopped_by": "pilot failed", "duration_s": 0.0,
                              "cost_usd": 0.0, "possible_double_spend": 0})
    df = pl.concat(frames)
    outcomes = per_dataset(COMPLETION_CHECKS, df)
    outcomes[PILOT_CHECK] = combine(pilots) if pilots else CheckOutcome(
        True, "no pilot needed: " + ("pilots disabled" if not config.pilot_size else "passed in an earlier run"))
    counts = df["status"].value_counts()
    duration = sum(s["duration_s"] for s in summaries)
    return dg.MaterializeResult(
        check_results=to_results(CHECKS, outcomes),
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
