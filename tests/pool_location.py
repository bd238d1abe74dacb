"""A code location for the queue and pool tests (tests/test_postgres.py): steps shaped like the pipeline's (a
per-dataset stage, a stage in the `gpu` pool) that only write when they start and end, so several daemons and
run workers can be watched sharing one instance without the pipeline's minutes of work.

Each step appends one line per event to $EAGLE3_TEST_STEP_LOG: {"run", "step", "partition", "pid", "event", "t"}.
"""

import json
import os
import time

import dagster as dg

DATASETS = dg.StaticPartitionsDefinition(["B6", "B7"])
STEP_SECONDS = float(os.environ.get("EAGLE3_TEST_STEP_SECONDS", "2"))


def record(context: dg.AssetExecutionContext, event: str) -> None:
    line = {
        "run": context.run_id,
        "step": context.op.name,
        "partition": context.partition_key if context.has_partition_key else None,
        "pid": os.getpid(),
        "event": event,
        "t": time.time(),
    }
    with open(os.environ["EAGLE3_TEST_STEP_LOG"], "a") as f:  # one short append per line: whole lines, any writers
        f.write(json.dumps(line) + "\n")


def timed(context: dg.AssetExecutionContext) -> None:
    record(context, "start")
    time.sleep(STEP_SECONDS)
    record(context, "end")


@dg.asset(partitions_def=DATASETS)
def dataset_stage(context: dg.AssetExecutionContext) -> None:
    timed(context)


@dg.asset(pool="gpu")
def gpu_stage(context: dg.AssetExecutionContext) -> None:
    timed(context)


defs = dg.Definitions(
    assets=[dataset_stage, gpu_stage],
    jobs=[
        dg.define_asset_job("dataset_job", [dataset_stage], partitions_def=DATASETS),
        dg.define_asset_job("gpu_job", [gpu_stage]),
    ],
)
