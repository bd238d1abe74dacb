"""Jobs: `eagle3_pipeline` runs every stage, prompts to drafter; `import_prompts` only the first, free one;
`eagle3_drafter_streaming` the drafter alone, streaming with its sides as Kubernetes Jobs and its step in a CPU pod."""

from __future__ import annotations

from typing import Any

import dagster as dg
from pydantic import Field

from eagle3_assets.common.k8s import orchestrator_pod_config
from eagle3_assets.common.registry import dataset_partitions
from eagle3_assets.stages.completions.asset import CompletionsConfig
from eagle3_assets.stages.eagle3_drafter.asset import DrafterTrainConfig
from eagle3_assets.stages.pipeline import PIPELINE_ASSETS
from eagle3_resources.errors import DrafterError
from eagle3_resources.storage import DataStore

# Shown in the launchpad, so a user sees the spend caps without knowing their names, at the run config's defaults
# (null: the environment's EAGLE3_MAX_RUN_USD / EAGLE3_MAX_TOTAL_USD, else no cap).
SPEND_CAPS = {
    name: CompletionsConfig.model_fields[name].default
    for name in ("max_run_usd", "max_total_usd", "max_projected_usd", "on_cap", "pilot_size")
}

eagle3_pipeline = dg.define_asset_job(
    "eagle3_pipeline",
    selection=dg.AssetSelection.assets(*PIPELINE_ASSETS),
    partitions_def=dataset_partitions,
    config={"ops": {"completions": {"config": SPEND_CAPS}}},
    description="Every stage: raw_prompts -> completions -> token_ids (per dataset) -> merged_dataset -> "
    "hidden_states -> eagle3_drafter. Launch it for one dataset, or for all of them in one run with the "
    "partition range A1...B8 (what `eagle3 run` does).",
)

import_prompts = dg.define_asset_job(
    "import_prompts",
    selection=dg.AssetSelection.assets("raw_prompts"),
    partitions_def=dataset_partitions,
    description="raw_prompts alone: read, convert, filter, sample and de-duplicate the prompts (sample files, or "
    "the real sources with `prompts: real`) and see the report before anything is spent (`eagle3 prompts`).",
)


DRAFTER = "eagle3_drafter"  # the asset, its op, and the k8s executor's per_step_k8s_config key


class DrafterStreamingConfig(DrafterTrainConfig):
    """The drafter's config (every field of `eagle3_drafter`'s), for a streaming run whose sides are Kubernetes Jobs."""

    streaming_spool_gb: float = Field(  # required here: this job only streams
        description="the spool's byte budget in GB (1e9 bytes); required: this job streams (see `eagle3_drafter`)"
    )
    streaming_sides: str = Field(
        default="kubernetes",
        description="`kubernetes` only: the capture and the training sides run as Jobs of their own while this "
        "step, in a CPU pod, orchestrates (for `local` sides launch `eagle3_drafter` as usual: the step's GPU node "
        "runs them)",
    )
    spec_eval_prompts: int = Field(
        default=0,
        description="the real decoding evaluation after training, in this step's CPU pod (no GPU, "
        "EAGLE3_K8S_ORCHESTRATOR_MEMORY): 0 = skip (measure in SGLang); the training side's `best_every` decodes on "
        "the training pods",
    )


def drafter_streaming_run_config(config: DrafterStreamingConfig, on_kubernetes: bool) -> dict[str, Any]:
    """The run config of a streaming drafter run with Kubernetes sides: the drafter's config and, under the k8s
    executor, the drafter step's pod (`orchestrator_pod_config`) as the executor's per-step override."""
    if config.streaming_sides != "kubernetes":
        raise DrafterError(
            f"streaming_sides: {config.streaming_sides!r}: this job runs the sides as Kubernetes Jobs while its step "
            "orchestrates in a CPU pod; for local sides materialize eagle3_drafter in eagle3_pipeline"
        )
    drafter = {name: getattr(config, name) for name in DrafterTrainConfig.model_fields}
    run_config: dict[str, Any] = {"ops": {DRAFTER: {"config": drafter}}}
    if on_kubernetes:
        run_config["execution"] = {"config": {"per_step_k8s_config": {DRAFTER: orchestrator_pod_config()}}}
    return run_config


def drafter_streaming_job(on_kubernetes: bool) -> dg.UnresolvedAssetJobDefinition:
    """`eagle3_drafter_streaming`; `on_kubernetes`: the code location's executor is dagster-k8s's k8s_job_executor
    (EAGLE3_EXECUTOR=k8s), whose run config carries the drafter step's pod."""

    mapping = dg.ConfigMapping(
        config_fn=lambda values: drafter_streaming_run_config(DrafterStreamingConfig(**values), on_kubernetes),
        config_schema=DrafterStreamingConfig.to_config_schema(),
    )
    return dg.define_asset_job(
        "eagle3_drafter_streaming",
        selection=dg.AssetSelection.assets(DRAFTER),
        config=mapping,
        description="The drafter alone, in streaming mode with its capture and training sides as Kubernetes Jobs "
        "(`streaming_sides: kubernetes`): the config is the drafter's, `streaming_spool_gb` required. Under "
        "EAGLE3_EXECUTOR=k8s its step, which only orchestrates, runs in a CPU pod (no GPU, no GPU node; the data "
        "and model volumes mounted), not on the GPU node the drafter's tag asks for.",
    )


@dg.op(description="Lift the spending hold set by the credit sensor (it is set again if a threshold is still crossed).")
def lift_spend_hold_op(context, store: DataStore) -> None:
    from eagle3_assets.money import lift_hold, open_ledger

    hold = lift_hold(open_ledger(store.layout), f"lifted by run {context.run_id} (lift_spend_hold)")
    context.log.info(f"hold lifted: {hold['reasons'] if hold else 'there was none'}")


@dg.job(name="lift_spend_hold", description="The operator lifts the spending hold (or run `eagle3 hold lift`).")
def lift_spend_hold():
    lift_spend_hold_op()
