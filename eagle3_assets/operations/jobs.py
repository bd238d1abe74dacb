"""Jobs: `eagle3_pipeline` runs every stage, prompts to drafter; `import_prompts` only the first, free one."""

from __future__ import annotations

import dagster as dg

from eagle3_assets.common.registry import dataset_partitions
from eagle3_assets.stages.completions.asset import CompletionsConfig
from eagle3_assets.stages.pipeline import PIPELINE_ASSETS
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


@dg.op(description="Lift the spending hold set by the credit sensor (it is set again if a threshold is still crossed).")
def lift_spend_hold_op(context, store: DataStore) -> None:
    from eagle3_assets.money import lift_hold, open_ledger

    hold = lift_hold(open_ledger(store.layout), f"lifted by run {context.run_id} (lift_spend_hold)")
    context.log.info(f"hold lifted: {hold['reasons'] if hold else 'there was none'}")


@dg.job(name="lift_spend_hold", description="The operator lifts the spending hold (or run `eagle3 hold lift`).")
def lift_spend_hold():
    lift_spend_hold_op()
