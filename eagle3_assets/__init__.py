"""The pipeline's stages (plain functions), Dagster assets, job, definitions and command."""

import warnings

# Single-run backfills over the dataset partitions are how one run covers every dataset; Dagster
# still labels the parameter beta and warns on every import.
warnings.filterwarnings("ignore", message=r"Parameter `backfill_policy` of function `asset` is currently in beta")
