"""Quality at a glance in the UI: the `pipeline_status` asset, one table of every dataset and stage.

The same picture as `eagle3 status` (it reads the same `Status`), observed by a sensor when
something in it changes, or now with Observe (an observable asset: its page shows the latest
observation, not "Never materialized"): per dataset and stage, materialized or not, its rows, and
the checks that fail (ok / warn / FAIL: plain words, no emoji, which a server's browser may lack);
the training stages beside. `datasets_complete` and `failing_checks` are numbers in each observation.
The board is plain markdown tables (the UI drops HTML such as `<br>`: cells ran together), the
failing checks of a dataset in a column of their own.
"""

from __future__ import annotations

import hashlib
import json

import dagster as dg

from eagle3_assets.common.standin import STANDIN_TAG, STANDIN_TARGET
from eagle3_assets.money import open_ledger
from eagle3_assets.operations.status import (
    PARTITIONED,
    UNPARTITIONED,
    StageState,
    Status,
    count,
    gather_status,
)
from eagle3_resources.storage import DataStore

STATUS_ASSET = dg.AssetKey("pipeline_status")
NBSP = "\u00a0"  # a space the table does not wrap at
LAST_STAGE = "token_ids"  # a dataset is complete when its token ids are materialized with no failing ERROR check

PIPELINE_STATUS_DESCRIPTION = (
    "Every dataset and stage at a glance (the `board` entry), observed by the `status_board` sensor when something "
    "changes, or now with Observe: "
    "materialized or not (—), rows, ok / warn / **FAIL** and the names of the checks that fail (ERROR first; "
    f"{STANDIN_TAG} where the tiny stand-in target explains the failure); "
    "the training stages' figures "
    "(the drafter's real accept length, from lossless speculative decoding, then the simulated one). The same as "
    "`eagle3 status` in a terminal. A dataset is complete when its "
    "`token_ids` are materialized with no failing ERROR check: materialize the missing ones (the nightly schedule "
    "does) and open a failing check for what to do."
)


@dg.observable_source_asset(  # type: ignore[call-overload]  # `kinds` goes through **kwargs, which dagster 1.13's overloads leave out
    key=STATUS_ASSET, group_name="training", kinds={"dagster"}, description=PIPELINE_STATUS_DESCRIPTION
)
def pipeline_status(context, store: DataStore) -> dg.ObserveResult:
    """The board now (the sensor records the same observation when something changes)."""
    status = gather_status(context.instance, open_ledger(store.layout), data_dir=store.root)
    return dg.ObserveResult(metadata=board_metadata(status))


def _failing(stage: StageState) -> str:
    failing = sorted(stage.failing, key=lambda c: c.severity != "ERROR")
    return ", ".join(f"`{c.name}`" + (f" {STANDIN_TAG}" if c.standin else "") for c in failing)


def _cell(stage: StageState) -> str:
    if not stage.materialized:
        return "—"
    rows = stage.figures.get("rows")
    mark = "**FAIL**" if any(c.severity == "ERROR" for c in stage.failing) else "warn" if stage.failing else "ok"
    return f"{mark},{NBSP}{count(rows)}{NBSP}rows" if rows is not None else mark  # one line, whatever the width


def _failing_of(stages: dict[str, StageState]) -> str:
    """A dataset's failing checks, per stage: `completions: `truncated_share` (stand-in); token_ids: ...`."""
    parts = [f"{asset}: {_failing(stages[asset])}" for asset in PARTITIONED if stages[asset].failing]
    return "; ".join(parts) or "none"


def complete(stages: dict[str, StageState]) -> bool:
    last = stages[LAST_STAGE]
    return last.materialized and not any(c.severity == "ERROR" for c in last.failing)


def board_markdown(status: Status) -> str:
    head = ["dataset", *PARTITIONED, "failing checks", "complete"]
    lines = ["**Datasets**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for ds in status.datasets:
        cells = [ds.dataset, *(_cell(ds.stages[a]) for a in PARTITIONED), _failing_of(ds.stages)]
        lines.append("| " + " | ".join([*cells, "yes" if complete(ds.stages) else "no"]) + " |")
    stages = [*(s for d in status.datasets for s in d.stages.values()), *status.stages]
    if any(c.standin for s in stages for c in s.failing):
        lines += ["", f"{STANDIN_TAG}: expected of {STANDIN_TARGET}, not a fault; each check's description says why."]
    lines += ["", "**Training stages**", "", "| stage | figures | checks |", "|---|---|---|"]
    for stage in status.stages:
        labels = dict(UNPARTITIONED)[stage.asset]
        figures = ", ".join(
            f"{label} {stage.figures.get(label)}" for label, _ in labels if stage.figures.get(label) is not None
        )
        checks = _failing(stage) if stage.failing else "ok" if stage.materialized else "—"
        lines.append(f"| {stage.asset} | {figures if stage.materialized else 'not materialized'} | {checks} |")
    return "\n".join(lines)


def board_metadata(status: Status) -> dict:
    failing = [c for ds in status.datasets for s in ds.stages.values() for c in s.failing] + [
        c for s in status.stages for c in s.failing
    ]
    drafter = next((s for s in status.stages if s.asset == "eagle3_drafter"), None)
    out = {
        "datasets_complete": sum(complete(ds.stages) for ds in status.datasets),
        "datasets": len(status.datasets),
        "failing_checks": len(failing),
        "failing_error_checks": sum(c.severity == "ERROR" for c in failing),
        "board": dg.MetadataValue.md(board_markdown(status)),
    }
    # The real accept length (lossless speculative decoding) under the plain name; the simulated one named so.
    for key, label in (("drafter_accept_length", "accept_length"), ("drafter_accept_length_simulated", "simulated")):
        if drafter is not None and drafter.figures.get(label) is not None:
            out[key] = float(drafter.figures[label])
    return out


def _fingerprint(metadata: dict) -> str:
    plain = {k: (v.value if hasattr(v, "value") else v) for k, v in metadata.items()}
    return hashlib.sha1(json.dumps(plain, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dg.sensor(
    name="status_board",
    minimum_interval_seconds=30,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Observes `pipeline_status` (every dataset and stage, complete or not, failing checks) when it "
    "changes. Turning it off only freezes that table; nothing else depends on it.",
)
def status_board(context: dg.SensorEvaluationContext, store: DataStore):
    status = gather_status(context.instance, open_ledger(store.layout), data_dir=store.root)
    metadata = board_metadata(status)
    fingerprint = _fingerprint(metadata)
    if fingerprint == context.cursor:
        return dg.SkipReason("nothing changed")
    complete_n, total = metadata["datasets_complete"], metadata["datasets"]
    description = f"{complete_n} of {total} datasets complete; {metadata['failing_checks']} failing checks"
    return dg.SensorResult(
        asset_events=[dg.AssetObservation(asset_key=STATUS_ASSET, description=description, metadata=metadata)],
        cursor=fingerprint,
    )
