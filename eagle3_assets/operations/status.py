"""`eagle3 status`: the operator's picture in a terminal (over SSH, no UI needed).

What it reads, and nothing else (it never builds the code location, so it answers in a second or two):

- the Dagster instance: each stage's latest materialization (per dataset for the partitioned
  ones) and its metadata; the latest evaluation of each asset check per dataset; the runs that are
  queued, starting, started or being cancelled;
- the data root's spend ledger: billed in all and today, in flight, unsettled, per dataset; the
  spending hold.

`gather_status` returns a `Status`; `render_text` and `as_json` turn it into what the command
prints. Every section is read on its own: one that cannot be read is reported in `errors` and the
others are still shown.

    status_model.py   what is shown: the figures read per stage, the `Status` dataclasses
    status_gather.py  reading the instance and the ledger into a `Status`
    status_render.py  a `Status` as text (colour where wanted) and as JSON
    status.py         the command (and the names `quality.py` and the tests read, from the three above)

How check evaluations, figures of runs over several datasets and dollars are attributed to a dataset:
status_gather.py's docstring.
"""

from __future__ import annotations

import json
import os
import sys

import dagster as dg

from eagle3_assets.money import open_data_root_ledger
from eagle3_assets.operations.status_gather import gather_status, run_progress
from eagle3_assets.operations.status_model import (
    PARTITIONED,
    UNPARTITIONED,
    CheckState,
    DatasetStatus,
    Money,
    RunState,
    StageState,
    Status,
)
from eagle3_assets.operations.status_render import as_json, colour_wanted, count, render_text
from eagle3_resources.storage import default_data_dir

__all__ = [  # the command, and the names quality.py (the `pipeline_status` asset) and the tests read from here
    "PARTITIONED",
    "UNPARTITIONED",
    "CheckState",
    "DatasetStatus",
    "Money",
    "RunState",
    "StageState",
    "Status",
    "as_json",
    "count",
    "gather_status",
    "render_text",
    "run_progress",
    "status_command",
]


def status_command(as_json_output: bool = False) -> int:
    """`eagle3 status`: DAGSTER_HOME must be set (cli.dagster_home())."""
    ledger, ledger_error = None, None
    try:
        ledger = open_data_root_ledger()
    except Exception as e:
        ledger_error = f"spend ledger: {type(e).__name__}: {e}"
    try:
        instance = dg.DagsterInstance.get()
    except Exception as e:
        status = gather_status(None, ledger, data_dir=str(default_data_dir()))
        status.errors.insert(0, f"Dagster instance at {os.environ.get('DAGSTER_HOME')}: {type(e).__name__}: {e}")
    else:
        with instance:
            status = gather_status(instance, ledger, data_dir=str(default_data_dir()))
    if ledger_error:
        status.errors.append(ledger_error)
    if as_json_output:
        print(json.dumps(as_json(status), indent=2, default=str))
    else:
        sys.stdout.write(render_text(status, colour=colour_wanted()))
    return 1 if status.errors else 0
