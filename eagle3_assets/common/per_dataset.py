"""One result per dataset, even when one run covers several.

A run over a partition range (`eagle3 run`, a single-run backfill) is one step. Returned as one
`MaterializeResult`, Dagster copies the same metadata onto every partition and records the checks
without a partition, so each dataset's page would show the figures, path and preview of all of
them and none of its own checks. Here each dataset gets its own metadata (partition-scoped
`add_asset_metadata`) and its own check evaluations, recorded against its own materialization.

Dagster's "Latest check results" on the asset's page are one dataset's (the latest evaluation of each check is the
last dataset's that was recorded), so a failure on another dataset showed nowhere but that check's Partitions tab.
Each such asset therefore has one more check, `all_datasets`, not partitioned: evaluated with every materialization,
it reads every dataset's latest evaluation of the other checks and fails naming each dataset and check that fails,
so the asset's page, the catalog and the lineage show it. It is a summary: `eagle3 status` and the alerts leave it
out, as they report each dataset's own evaluations (`is_summary`).
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import dagster as dg
from dagster._core.definitions.asset_checks.asset_check_evaluation import (
    AssetCheckEvaluation,
    AssetCheckEvaluationTargetMaterializationData,
)
from dagster._core.event_api import PartitionKeyFilter
from dagster._core.storage.asset_check_execution_record import COMPLETED_ASSET_CHECK_EXECUTION_RECORD_STATUSES

from eagle3_assets.common.outcome import (
    CheckOutcome,
    Checks,
    check_description,
    metadata_value,
)
from eagle3_assets.common.registry import DATASETS, dataset_partitions
from eagle3_assets.common.standin import STANDIN_KEY, STANDIN_TAG

SUMMARY_CHECK = "all_datasets"
SUMMARY_DESCRIPTION = (
    "Every dataset's latest evaluation of this asset's other checks, in one result: the asset's page shows one "
    "dataset's check results (the latest materialized), this one shows a failure on any dataset. When it fails it "
    "names each dataset and check that fails, with that check's own words: open that check (Checks tab), its "
    "Partitions tab, the dataset, for the evaluation and what to do. Evaluated again with every materialization."
)


def is_summary(key: dg.AssetCheckKey) -> bool:
    """The `all_datasets` check of a per-dataset asset: a summary of the others, not a check of its own."""
    return key.name == SUMMARY_CHECK


def dataset_check_specs(asset: str, checks: Checks, blocking: Collection[str] = frozenset()) -> list[dg.AssetCheckSpec]:
    """Check specs partitioned like the asset: a dataset's page lists its own check results."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dg.PreviewWarning)  # partitioned checks are "preview" in 1.13; they work
        return [
            dg.AssetCheckSpec(
                name,
                asset=asset,
                description=check_description(fn),
                blocking=name in blocking,
                partitions_def=dataset_partitions,
            )
            for name, (fn, _) in checks.items()
        ] + [dg.AssetCheckSpec(SUMMARY_CHECK, asset=asset, description=SUMMARY_DESCRIPTION)]


def _latest_materialization(instance: dg.DagsterInstance, asset_key: dg.AssetKey, partition: str | None):
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=asset_key, asset_partitions=[partition] if partition else None), limit=1
    )
    if not records.records:
        return None
    record = records.records[0]
    return AssetCheckEvaluationTargetMaterializationData(
        storage_id=record.storage_id, run_id=record.run_id, timestamp=record.timestamp
    )


def per_dataset_results(
    context: dg.AssetExecutionContext,
    metadata: Mapping[str, Mapping[str, Any]],
    checks: Checks,
    outcomes: Mapping[str, Mapping[str, CheckOutcome]],
) -> Iterator[Any]:
    """Yield the materialization of every dataset in `metadata` with its own figures, then its checks.

    `outcomes[dataset][check]`. Yield from this at the end of the asset's body (the asset is a
    generator). A failed blocking ERROR check fails the step after every result is recorded, as a
    returned `AssetCheckResult` would.
    """
    for dataset, figures in metadata.items():
        context.add_asset_metadata(dict(figures), partition_key=dataset)
    yield dg.MaterializeResult()
    asset_key = context.assets_def.key
    selected = {k.name for k in context.selected_asset_check_keys if k.asset_key == asset_key}
    for name in sorted(selected):  # each check's output, once; its evaluations follow, one per dataset
        yield dg.Output(
            None, output_name=context.assets_def.get_output_name_for_asset_check_key(dg.AssetCheckKey(asset_key, name))
        )
    specs = {spec.name: spec for spec in context.assets_def.check_specs}
    for dataset, by_check in outcomes.items():
        target = _latest_materialization(context.instance, asset_key, dataset)
        for name, outcome in by_check.items():
            if name not in selected:
                continue
            yield AssetCheckEvaluation(
                asset_key=asset_key,
                check_name=name,
                passed=outcome.passed,
                partition=dataset,
                severity=getattr(dg.AssetCheckSeverity, checks[name][1]),
                blocking=specs[name].blocking,
                description=f"{dataset}: {outcome.description}",
                target_materialization_data=target,
                metadata={k: metadata_value(v) for k, v in outcome.metadata.items()},
            )
    if SUMMARY_CHECK in selected:
        mine = {
            ds: {n: _verdict(o, checks[n][1], ds) for n, o in by.items() if n in selected}
            for ds, by in outcomes.items()
        }
        yield summary_evaluation(context.instance, asset_key, [n for n in checks if n in selected], mine)


@dataclass(frozen=True)
class Verdict:
    """One dataset's latest evaluation of one check, as the summary reads it."""

    passed: bool
    severity: str  # WARN | ERROR
    description: str  # starts with the dataset
    standin: bool = False  # a failure the stand-in target explains


def _verdict(outcome: CheckOutcome, severity: str, dataset: str) -> Verdict:
    standin = outcome.metadata.get(STANDIN_KEY) is True
    return Verdict(outcome.passed, severity, f"{dataset}: {outcome.description}", standin and not outcome.passed)


def stored_verdicts(
    instance: dg.DagsterInstance, asset_key: dg.AssetKey, names: Collection[str], datasets: Collection[str]
) -> dict[str, dict[str, Verdict]]:
    """`{dataset: {check: verdict}}`: each dataset's latest completed evaluation of each check, as recorded (one
    evaluated now by another run, planned, leaves the one before it)."""
    storage = instance.event_log_storage
    keys = [dg.AssetCheckKey(asset_key, n) for n in names]
    out: dict[str, dict[str, Verdict]] = {}
    for dataset in datasets:
        only = PartitionKeyFilter(key=dataset)
        for key, record in storage.get_latest_asset_check_execution_by_key(keys, partition_filter=only).items():
            if record.status not in COMPLETED_ASSET_CHECK_EXECUTION_RECORD_STATUSES:
                done = storage.get_asset_check_execution_history(
                    key, limit=1, status=COMPLETED_ASSET_CHECK_EXECUTION_RECORD_STATUSES, partition_filter=only
                )
                if not done:
                    continue
                record = done[0]
            ev = record.evaluation
            if ev is None:
                continue
            standin = not ev.passed and getattr(ev.metadata.get(STANDIN_KEY), "value", None) is True
            out.setdefault(dataset, {})[key.name] = Verdict(ev.passed, ev.severity.value, ev.description or "", standin)
    return out


def summary_evaluation(
    instance: dg.DagsterInstance,
    asset_key: dg.AssetKey,
    names: Sequence[str],
    this_run: Mapping[str, Mapping[str, Verdict]],
) -> AssetCheckEvaluation:
    """The `all_datasets` check: this run's verdicts for its datasets, the recorded ones for every other dataset."""
    verdicts = stored_verdicts(instance, asset_key, names, [d for d in DATASETS if d not in this_run])
    verdicts.update({d: dict(v) for d, v in this_run.items()})
    failing = [(d, n, verdicts[d][n]) for d in DATASETS if d in verdicts for n in names if n in verdicts[d]]
    failing = [(d, n, v) for d, n, v in failing if not v.passed]
    evaluated = [d for d in DATASETS if verdicts.get(d)]
    unevaluated = [d for d in DATASETS if d not in evaluated]
    failed_datasets = sorted({d for d, _, _ in failing}, key=list(DATASETS).index)
    if failing:
        head = (
            f"{len(failing)} check{'s' if len(failing) > 1 else ''} failing on {', '.join(failed_datasets)} "
            f"({len(evaluated)} dataset{'s' if len(evaluated) != 1 else ''} evaluated)"
        )
        lines = [
            f"{d} `{n}` {v.severity}{' ' + STANDIN_TAG if v.standin else ''}: " + v.description.removeprefix(f"{d}: ")
            for d, n, v in failing
        ]
        description = head + ":\n" + "\n".join(f"- {line}" for line in lines)
    else:
        description = (
            f"every check passes on all {len(evaluated)} datasets evaluated"
            if len(evaluated) != 1
            else f"every check passes on {evaluated[0]}, the one dataset evaluated"
        )
    if unevaluated:
        description += f"\n\n(not evaluated yet: {', '.join(unevaluated)})"  # a paragraph of its own, not the list's
    return AssetCheckEvaluation(
        asset_key=asset_key,
        check_name=SUMMARY_CHECK,
        passed=not failing,
        severity=dg.AssetCheckSeverity.ERROR
        if any(v.severity == "ERROR" for _, _, v in failing)
        else dg.AssetCheckSeverity.WARN,
        description=description,
        target_materialization_data=_latest_materialization(instance, asset_key, None),
        metadata={
            "failing": "; ".join(f"{d} {n}" for d, n, _ in failing) or "none",
            "failed_datasets": dg.MetadataValue.json(failed_datasets),
            "datasets_evaluated": len(evaluated),
            **({STANDIN_KEY: True} if failing and all(v.standin for _, _, v in failing) else {}),
        },
    )
