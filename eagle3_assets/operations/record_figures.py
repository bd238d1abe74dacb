"""`python -m eagle3_assets.operations.record_figures REPORT`: an SGLang benchmark's JSON recorded on `eagle3_drafter`.

The figures' sources, the identity check and the observation are the drafter stage's (stages/eagle3_drafter/figures.py);
this is the command around them, on the instance `eagle3` uses (DAGSTER_HOME if set, else the project's default, as
operations/instance.py decides).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import dagster as dg

from eagle3_assets.operations.instance import dagster_home
from eagle3_assets.stages.eagle3_drafter.figures import record_figures
from eagle3_resources.errors import FiguresRefused


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m eagle3_assets.operations.record_figures",
        description="Record an SGLang benchmark's JSON on the eagle3_drafter asset (an observation).",
    )
    p.add_argument(
        "report", type=Path, help="the JSON of benchmarks/sglang_engine_speculative.py or serving_speculative.py"
    )
    args = p.parse_args(argv)
    dagster_home()  # this project's instance (DAGSTER_HOME, set from the default if unset)
    try:
        with dg.DagsterInstance.get() as instance:
            observation = record_figures(args.report, instance)
    except FiguresRefused as e:
        print(f"not recorded: {e}", file=sys.stderr)
        return 1
    print(f"recorded on eagle3_drafter: {observation.description}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
