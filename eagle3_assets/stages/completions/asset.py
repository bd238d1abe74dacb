"""`completions`: the target's answer to every prompt, journaled as it arrives."""

from contextlib import contextmanager
from pathlib import Path

import dagster as dg
import polars as pl
from pydantic import Field

from eagle3_assets.common.failures import failure_for_operator, operator_failure
from eagle3_assets.common.k8s import K8S_CONFIG_TAG, api_pod_config
from eagle3_assets.common.metadata import json_value, markdown_table, path_value
from eagle3_assets.common.outcome import per_dataset
from eagle3_assets.common.per_dataset import dataset_check_specs, per_dataset_results
from eagle3_assets.common.registry import dataset_partitions, dataset_spec
from eagle3_assets.common.standin import explained, is_standin_target
from eagle3_assets.money import SpendPolicy, cancelling, get_hold, open_ledger
from eagle3_assets.money import ledger as L
from eagle3_assets.money.admission import HALTED
from eagle3_assets.money.caps import Caps, Limits, run_caps
from eagle3_assets.money.ledger import SpendLedger
from eagle3_assets.money.prices import PriceSheet
from eagle3_assets.money.settle import partition_lock
from eagle3_assets.stages.completions.checks import COMPLETION_CHECKS
from eagle3_assets.stages.completions.pilot import (
    Means,
    Partition,
    PartitionPilot,
    PilotRules,
    pilot_outcome,
    price_sheet,
    recorded_prices,
    worst_case_pricing,
)
from eagle3_assets.stages.completions.run import (
    RunOptions,
    RunReport,
    build_requests,
    completions_frame,
)
from eagle3_assets.stages.raw_prompts.asset import raw_prompts
from eagle3_resources.completions.resource import BackendKind, CompletionsResource
from eagle3_resources.completions.types import SamplingSettings
from eagle3_resources.errors import DatasetBusy, RunFatalError
from eagle3_resources.storage import DataLayout, DataStore
from eagle3_resources.target.resource import TargetModelResource
from eagle3_resources.tokenizer.resource import TokenizerResource

LOCAL_MAX_TOKENS = 160  # the stand-in answers in ~40-60 tokens
REMOTE_MAX_TOKENS = 16384
STOP_MODES = ("drain", "cancel")


class CompletionsConfig(SamplingSettings):
    """Request settings and spend limits of this run (recorded with the materialization)."""

    max_tokens: int | None = Field(  # type: ignore[assignment]  # unset here: the backend's default (`settings`)
        default=None, description=f"unset: {LOCAL_MAX_TOKENS} on the local backend, {REMOTE_MAX_TOKENS} otherwise"
    )
    max_run_usd: float | None = Field(
        default=None,
        description="dollar cap for this run, all its datasets and pilots "
        "together (with EAGLE3_MAX_RUN_USD, the tighter holds): never overshot",
    )
    max_total_usd: float | None = Field(
        default=None, description="dollar cap for the whole ledger: every partition, every run"
    )
    on_cap: str = Field(default="finish", description='in-flight requests when a cap is reached: "finish" or "cancel"')
    on_terminate: str = Field(
        default="cancel",
        description="in-flight requests when the run is terminated (UI, SIGTERM, "
        'Ctrl-C): "cancel" (their streams stop; the prompts are sent again later, partial bills '
        'included) or "drain" (they finish and are kept; a second stop cancels)',
    )
    pilot_size: int = Field(
        default=8,
        description="prompts of a partition sent first; the rest waits for the pilot's "
        "blocking checks (shape, billed counts, prices) and its cost projection (0: no pilot)",
    )
    usd_per_m_prompt_tokens: float | None = Field(
        default=None,
        description="price override; unset: read from the API "
        "(/models/{model}/endpoints, the highest price the routing allows)",
    )
    usd_per_m_completion_tokens: float | None = Field(
        default=None, description="price override (see usd_per_m_prompt_tokens)"
    )
    price_tolerance: float = Field(
        default=0.05,
        description="the pilot's bills may differ from the listed prices by this "
        "share; beyond it the run stops before the rest is sent",
    )
    max_projected_usd: float | None = Field(
        default=None,
        description="stop after the pilot when the rest of a partition is projected to cost more than this",
    )
    resend_unsettled: bool = Field(
        default=False,
        description="send a prompt again although an earlier attempt of it has no bill yet (it may be paid twice)",
    )
    unsettled_wait_s: float = Field(
        default=60.0,
        description="how long a retry waits for the bill of the attempt before it "
        "(a cut stream) before the prompt is deferred to a later run",
    )

    def settings(self, backend: BackendKind) -> SamplingSettings:
        max_tokens = self.max_tokens or (LOCAL_MAX_TOKENS if backend is BackendKind.LOCAL else REMOTE_MAX_TOKENS)
        fields = {k: v for k, v in self.model_dump().items() if k in SamplingSettings.model_fields}
        return SamplingSettings(**{**fields, "max_tokens": max_tokens})

    def caps(self, token_budget: int | None, environment: Limits) -> Caps:
        """This run's caps: its limits against the spend policy's, whichever is tighter (money.caps.run_caps)."""
        if self.on_terminate not in STOP_MODES:
            raise ValueError(f'on_terminate must be "drain" or "cancel", not {self.on_terminate!r}')
        limits = Limits(run_usd=self.max_run_usd, total_usd=self.max_total_usd)
        return run_caps(limits, environment, token_budget=token_budget, on_cap=self.on_cap)

    def pilot_rules(self) -> PilotRules:
        return PilotRules(self.pilot_size, self.price_tolerance, self.max_projected_usd)

    def price_sheet(self, backend: BackendKind, make_account, settings: SamplingSettings) -> PriceSheet | None:
        """Where admission's prices come from: the run config, else the API; None for a backend that bills nothing."""
        listed = (self.usd_per_m_prompt_tokens, self.usd_per_m_completion_tokens)
        return price_sheet(listed, backend is BackendKind.OPENROUTER, make_account, settings)


PILOT_CHECK = "pilot"
CHECKS = {**COMPLETION_CHECKS, PILOT_CHECK: (pilot_outcome, "ERROR")}


@dg.asset(
    check_specs=dataset_check_specs("completions", CHECKS, blocking={PILOT_CHECK}),
    partitions_def=dataset_partitions,
    deps=[raw_prompts],
    backfill_policy=dg.BackfillPolicy.single_run(),
    group_name="completions",
    kinds={"parquet"},
    op_tags={K8S_CONFIG_TAG: api_pod_config()},  # a small CPU pod under the k8s executor
    description="Completions from the configured backend (local transformers, OpenRouter or SGLang). A pilot batch "
    "is checked (shape, billed counts, prices) and the rest's cost projected before it is sent; every attempt is "
    "reserved and settled in the spend ledger shared by every run; every result is journaled on arrival; "
    "re-materializing resumes and never re-sends a prompt with a final outcome or an unsettled bill. Refuses to start "
    "while spending is on hold.",
)
@failure_for_operator
def completions(
    context: dg.AssetExecutionContext,
    config: CompletionsConfig,
    store: DataStore,
    tokenizer: TokenizerResource,
    target: TargetModelResource,
    completions_backend: CompletionsResource,
    spend_policy: SpendPolicy,
):
    ledger = open_ledger(store.layout)
    refuse_while_on_hold(ledger)
    tok = tokenizer.load()
    kind = completions_backend.backend_kind()
    settings = config.settings(kind)
    backend = completions_backend.make_backend(
        tok, lambda: target.load_model(tokenizer, context.log.info), context.log.info
    )
    sheet = config.price_sheet(kind, completions_backend.make_account(), settings)
    pricing = worst_case_pricing(sheet, context.log.info)
    means = Means(
        backend,
        settings,
        sheet,
        recorded_prices(sheet),
        ledger,
        tok,
        completions_backend.concurrency,
        context.run_id,
        context.log.info,
    )
    environment = spend_policy.limits()
    metadata, outcomes = {}, {}
    try:
        for key in context.partition_keys:
            spec = dataset_spec(key)
            prompts = read_prompts(store.layout, key, spec.sample_cap, context.log.info)
            requests = build_requests(
                prompts, tok, tokenizer.template_version, tokenizer.thinking, send_tools=config.send_tools
            )
            options = RunOptions(
                caps=config.caps(spec.token_budget, environment),
                pricing=pricing,
                run_id=context.run_id,
                halt=lambda: cancelling(context.instance, context.run_id),
                hold_mode=spend_policy.hold_action,
                on_terminate=config.on_terminate,
                resend_unsettled=config.resend_unsettled,
                unsettled_wait_s=config.unsettled_wait_s,
                horizon_s=spend_policy.horizon_s,
                on_progress=live_progress(context, key),
            )
            journal = store.layout.completions_journal(key)
            pilot = PartitionPilot(Partition(key, prompts, requests, journal, options), means, config.pilot_rules())
            with dataset_lock(journal, context.run_id):
                try:
                    pilot.run()
                except RunFatalError as e:
                    raise operator_failure(
                        e,
                        before=f"{key}: ",
                        after=f". Every finished response is in {journal}; fix the cause and re-materialize to resume.",
                    ) from e
            metadata[key], outcomes[key] = partition_results(
                store.layout, pilot, completions_backend, kind, standin=is_standin_target(completions_backend, target)
            )
    finally:
        close = getattr(backend, "close", None)  # the local backend's lane processes
        if close is not None:
            close()
    yield from per_dataset_results(context, metadata, CHECKS, outcomes)


def refuse_while_on_hold(ledger: SpendLedger) -> None:
    hold = get_hold(ledger)
    if hold:
        raise dg.Failure(
            description="spending is on hold: " + "; ".join(hold["reasons"]) + ". Lift it with `eagle3 hold lift` "
            "(or the lift_spend_hold job), or raise the threshold.",
            metadata={"hold": json_value(hold)},
        )


def read_prompts(layout: DataLayout, key: str, sample_cap: int | None, log) -> pl.DataFrame:
    prompts = pl.read_parquet(layout.raw_prompts(key))
    if sample_cap is not None and prompts.height > sample_cap:
        log(f"{key}: sample cap {sample_cap} of {prompts.height} prompts")
        prompts = prompts.head(sample_cap)
    return prompts


def partition_results(
    layout: DataLayout, pilot: PartitionPilot, resource: CompletionsResource, kind: BackendKind, *, standin: bool
) -> tuple[dict, dict]:
    """The partition's Parquet file (from its journal), its metadata and its checks' outcomes; a halted run fails.
    `standin`: the answers are the tiny stand-in target's (a failure it explains says so)."""
    part, means = pilot.partition, pilot.means
    key, journal = part.key, part.journal
    df = completions_frame(key, part.requests, journal, part.prompts)
    path = layout.ensure(layout.completions(key))
    df.write_parquet(path)
    run = pilot.last
    if run is not None and (run.stopped_by or "").startswith(HALTED):
        raise dg.Failure(
            description=f"{key}: {run.stopped_by}. {run.sent} requests were sent; every finished response "
            f"is in {journal}; re-materialize to resume once the hold is lifted."
        )
    summary = run_summary(key, pilot.batches, pilot.stopped_by)
    outcome = {**explained(per_dataset(COMPLETION_CHECKS, {key: df}), standin)[key], PILOT_CHECK: pilot.outcome()}
    metadata = {
        **completions_figures(df, summary, means.ledger.read(L.scope, f"dataset:{key}")),
        "backend": json_value({**pilot.backend_description(), "settings_from": resource.sources()}),
        "request_settings": json_value(recorded_settings(means.settings, kind)),
        "prices": json_value(means.prices),
        **({"projection": json_value(pilot.projection.as_dict())} if pilot.projection is not None else {}),
        "run": json_value(summary),
        "path": path_value(path),
        "journal": path_value(journal),
        "preview": markdown_table(
            df, ["prompt_id", "status", "finish_reason", "completion_tokens", "reasoning", "content"]
        ),
    }
    return metadata, outcome


def run_summary(dataset: str, sent: list[tuple[str, RunReport]], stopped_by: str | None) -> dict:
    """What this run did for a dataset, pilot and rest together (each batch's own summary kept beside)."""
    parts = {name: run.summary(dataset) for name, run in sent}
    last = list(parts.values())[-1] if parts else {}
    return {
        "dataset": dataset,
        "sent": sum(p["sent"] for p in parts.values()),
        "duration_s": round(sum(p["duration_s"] for p in parts.values()), 1),
        "billed_usd": L.usd(sum(p["billed_usd"] for p in parts.values())),
        "stopped_by": stopped_by or last.get("stopped_by"),
        "batches": parts,
    }


def live_progress(context: dg.AssetExecutionContext, dataset: str):
    """Progress as it happens, on the asset's page: an observation of the partition at each progress report."""

    def observe(figures: dict) -> None:
        eta = "-" if figures["eta_s"] is None else f"{figures['eta_s'] / 60:.1f} min"
        line = (
            f"{figures['done']}/{figures['total']} done, {figures['requests_per_s']:.2f} req/s, "
            f"{figures['completion_tokens']:,} completion tokens, ${figures['billed_usd']:.4f}, ETA {eta}"
        )
        context.log_event(
            dg.AssetObservation(
                asset_key=context.assets_def.key,
                partition=dataset,
                description=f"progress of run {context.run_id[:8]}",
                metadata={
                    "progress": line,
                    **{k: v for k, v in figures.items() if v is not None},
                    "run_id": context.run_id,
                },
            )
        )

    return observe


def completions_figures(df: pl.DataFrame, run: dict, dataset_scope) -> dict:
    """One dataset's figures: every prompt's outcome (this run's and earlier ones'), tokens and dollars."""
    counts = dict(df["status"].value_counts().rows())
    return {
        "rows": df.height,
        **{f"status_{s}": int(counts.get(s, 0)) for s in ("ok", "truncated", "filtered", "failed", "pending")},
        "completion_tokens": int(df["completion_tokens"].fill_null(0).sum()),
        "prompt_tokens": int(df["prompt_tokens"].fill_null(0).sum()),
        "cost_usd": L.usd(float(df["cost_usd"].sum())),  # what the kept answers cost
        "this_run_sent": run["sent"],
        "this_run_billed_usd": L.usd(run["billed_usd"]),
        "this_run_duration_s": round(run["duration_s"], 1),
        "this_run_requests_per_s": round(run["sent"] / run["duration_s"], 3) if run["duration_s"] else 0.0,
        "dataset_billed_usd": L.usd(dataset_scope.settled_usd),  # every attempt of every run, answers kept or not
        "dataset_unsettled_worst_usd": L.usd(dataset_scope.stuck_usd),
        "stopped_by": run["stopped_by"] or "not stopped",
    }


def recorded_settings(settings: SamplingSettings, kind: BackendKind) -> dict:
    """The request settings that apply to this backend (OpenRouter's routing means nothing to a local model)."""
    out = settings.model_dump()
    if kind is not BackendKind.OPENROUTER:
        out.pop("provider")
        out.pop("reasoning_effort")
    if kind is BackendKind.LOCAL:
        out["model"] = "the local target (EAGLE3_TARGET_DIR, else the stand-in)"
    return out


@contextmanager
def dataset_lock(journal: Path, run_id: str):
    try:
        with partition_lock(journal, run_id):
            yield
    except DatasetBusy as e:
        raise operator_failure(e) from e
