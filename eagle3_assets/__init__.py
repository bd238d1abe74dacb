"""The pipeline's code location: `definitions.py` over four layers, imports pointing down only.

    operations/  the `eagle3` command, status, instance, GPU check, job, sensors, schedule
    stages/      one folder per asset (raw_prompts, completions, token_ids, merged_dataset, hidden_states,
                 eagle3_drafter): its asset, logic and checks
    money/       every dollar and every cap, and the `spend` asset
    common/      plumbing the stages share; below it, `eagle3_resources` (external systems)

tests/test_import_direction.py fails on an upward import or an import cycle.
"""

import warnings

# Single-run backfills over the dataset partitions are how one run covers every dataset; Dagster
# still labels the parameter beta and warns on every import.
warnings.filterwarnings("ignore", message=r"Parameter `backfill_policy` of function `asset` is currently in beta")
