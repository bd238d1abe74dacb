"""A schedule that completes the pipeline for datasets that have never finished: never re-runs done ones.

(`build_schedule_from_partitioned_job` on static partitions re-runs every partition each tick,
which with a paid API is wrong.) Off by default; turn it on in the UI.
"""

import dagster as dg

from eagle3_assets.common.registry import DATASETS, run_datasets
from eagle3_assets.money import ACTIVE_STATUSES
from eagle3_assets.operations.jobs import eagle3_pipeline

DONE_ASSET = dg.AssetKey("token_ids")  # the last per-dataset stage: a dataset is done when it has token ids


def missing_partitions(instance: dg.DagsterInstance) -> list[str]:
    """Datasets without token ids and without a run for them already queued or running."""
    done = instance.get_materialized_partitions(DONE_ASSET)
    busy = {d for r in instance.get_runs(filters=dg.RunsFilter(statuses=ACTIVE_STATUSES)) for d in run_datasets(r.tags)}
    return [d for d in DATASETS if d not in done and d not in busy]


@dg.schedule(
    job=eagle3_pipeline,
    cron_schedule="0 3 * * *",
    default_status=dg.DefaultScheduleStatus.STOPPED,
    name="missing_partitions_nightly",
    description="Each night, runs the pipeline for every dataset not done yet.",
)
def missing_partitions_nightly(context: dg.ScheduleEvaluationContext):
    missing = missing_partitions(context.instance)
    if not missing:
        return dg.SkipReason("every dataset has token ids")
    stamp = context.scheduled_execution_time.strftime("%Y%m%d%H%M")
    # The dataset as a tag too: the schedule's preview lists run requests by their tags, not their partition.
    return [dg.RunRequest(run_key=f"{d}-{stamp}", partition_key=d, tags={"eagle3/dataset": d}) for d in missing]
