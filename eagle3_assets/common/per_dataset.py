"""One result per dataset, even when one run covers several.

A run over a partition range (`eagle3 run`, a single-run backfill) is one step. Returned as one
`MaterializeResult`, Dagster copies the same metadata onto every partition and records the checks
without a partition, so each dataset's page would show the figures, path and preview of all of
them and none of its own checks. Here each dataset gets its own metadata (partition-scoped
`add_asset_metadata`) and its own check evaluations, recorded against its own materialization.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Iterator, Mapping
from typing import Any

import dagster as dg
from dagster._core.definitions.asset_checks.asset_check_evaluation import (
    AssetCheckEvaluation,
    AssetCheckEvaluationTargetMaterializationData,
)

from eagle3_assets.common.outcome import (
    CheckOutcome,
    Checks,
    check_description,
    metadata_value,
)
from eagle3_assets.common.registry import dataset_partitions


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
        ]


def _latest_materialization(instance: dg.DagsterInstance, asset_key: dg.AssetKey, partition: str):
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=asset_key, asset_partitions=[partition]), limit=1
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
