"""The six pipeline assets, one module each; the logic they wire lives one package up."""

from eagle3_assets.assets.completions import completions
from eagle3_assets.assets.drafter import eagle3_drafter
from eagle3_assets.assets.hidden_states import hidden_states
from eagle3_assets.assets.merged_dataset import merged_dataset
from eagle3_assets.assets.raw_prompts import raw_prompts
from eagle3_assets.assets.token_ids import token_ids

PIPELINE_ASSETS = [raw_prompts, completions, token_ids, merged_dataset, hidden_states, eagle3_drafter]
