"""Jobs: `eagle3_pipeline` runs every stage, prompts to drafter."""

from __future__ import annotations

import dagster as dg

from eagle3_assets.assets import PIPELINE_ASSETS
from eagle3_assets.registry import dataset_partitions

eagle3_pipeline = dg.define_asset_job(
    "eagle3_pipeline",
    selection=dg.AssetSelection.assets(*PIPELINE_ASSETS),
    partitions_def=dataset_partitions,
    description="Every stage: raw_prompts -> completions -> token_ids (per dataset) -> merged_dataset -> "
    "hidden_states -> eagle3_drafter. Launch it for one dataset, or for all of them in one run with the "
    "partition range A1...B8 (what `eagle3 run` does).",
)
