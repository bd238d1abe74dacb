"""The six pipeline assets, in lineage order; each lives in its stage's folder (`stages/<asset name>/asset.py`)."""

from eagle3_assets.stages.completions.asset import completions
from eagle3_assets.stages.eagle3_drafter.asset import eagle3_drafter
from eagle3_assets.stages.hidden_states.asset import hidden_states
from eagle3_assets.stages.merged_dataset.asset import merged_dataset
from eagle3_assets.stages.raw_prompts.asset import raw_prompts
from eagle3_assets.stages.token_ids.asset import token_ids

PIPELINE_ASSETS = [
    raw_prompts,
    completions,
    token_ids,
    merged_dataset,
    hidden_states,
    eagle3_drafter,
]
