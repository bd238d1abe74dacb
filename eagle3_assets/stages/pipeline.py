"""The six pipeline assets, one module each; the logic they wire lives one package up."""

from eagle3_assets.stages.pipeline import (
    completions,
    drafter,
    hidden_states,
    merged_dataset,
    raw_prompts,
    token_ids,
)

PIPELINE_ASSETS = [
    raw_prompts.raw_prompts,
    completions.completions,
    token_ids.token_ids,
    merged_dataset.merged_dataset,
    hidden_states.hidden_states,
    drafter.eagle3_drafter,
]
