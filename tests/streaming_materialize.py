"""Materialize `eagle3_drafter` in streaming mode in this process, for tests that kill the step (kill -9):

    python tests/streaming_materialize.py DATA_ROOT CONFIG_JSON OUT_JSON

CONFIG_JSON: the drafter's run config (tests/test_streaming_drafter.py's `run_config`); OUT_JSON: {"success",
"metadata"} once the materialization has ended (an ephemeral instance: nothing else is kept)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import dagster as dg
from test_streaming_drafter import resources_for

from eagle3_assets.stages.eagle3_drafter.asset import eagle3_drafter


def main(root: str, config_path: str, out: str) -> int:
    config = json.loads(Path(config_path).read_text())
    result = dg.materialize(
        [eagle3_drafter],
        instance=dg.DagsterInstance.ephemeral(),
        raise_on_error=False,
        run_config={"ops": {"eagle3_drafter": {"config": config}}},
        resources=resources_for(Path(root)),
    )
    meta = {}
    if result.success:
        meta = {k: v.value for k, v in result.asset_materializations_for_node("eagle3_drafter")[0].metadata.items()}
    Path(out).write_text(json.dumps({"success": result.success, "metadata": meta}, default=str))
    return 0 if result.success else 1


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:4]))
