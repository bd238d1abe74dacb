"""What a check returns, and how a stage's checks become Dagster asset-check results."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import dagster as dg
import polars as pl

OUTLIERS_SHOWN = 20


@dataclass
class CheckOutcome:
    passed: bool
    description: str
    metadata: dict[str, Any] = field(default_factory=dict)


# name -> (check function, severity when it fails)
Checks = dict[str, tuple[Callable[..., CheckOutcome], str]]


def sample_ids(df: pl.DataFrame, n: int = OUTLIERS_SHOWN) -> list[str]:
    return (df["dataset"] + "/" + df["prompt_id"]).head(n).to_list()


def check_specs(asset: str, checks: Checks, blocking: set[str] = frozenset()) -> list[dg.AssetCheckSpec]:
    return [
        dg.AssetCheckSpec(name, asset=asset, description=(fn.__doc__ or name).strip().splitlines()[0], blocking=name in blocking)
        for name, (fn, _) in checks.items()
    ]


def _metadata_value(value: Any):
    if isinstance(value, (list, dict)):
        return dg.MetadataValue.json(json.loads(json.dumps(value, default=str)))
    return value


def to_results(checks: Checks, outcomes: dict[str, CheckOutcome]) -> list[dg.AssetCheckResult]:
    return [
        dg.AssetCheckResult(
            check_name=name, passed=outcome.passed, severity=getattr(dg.AssetCheckSeverity, checks[name][1]),
            description=outcome.description, metadata={k: _metadata_value(v) for k, v in outcome.metadata.items()},
        )
        for name, outcome in outcomes.items()
    ]


def run_checks(checks: Checks, *args, **kwargs) -> list[dg.AssetCheckResult]:
    """Run checks that all take the same arguments."""
    return to_results(checks, {name: fn(*args, **kwargs) for name, (fn, _) in checks.items()})


def combine(by_dataset: dict[str, CheckOutcome]) -> CheckOutcome:
    """One outcome from one per dataset: it fails when any dataset fails, and says which and why."""
    failed = [d for d, o in by_dataset.items() if not o.passed]
    if len(by_dataset) == 1:
        return next(iter(by_dataset.values()))
    shown = failed or list(by_dataset)
    description = "; ".join(f"{d}: {by_dataset[d].description}" for d in shown)
    if failed:
        description += f" ({len(by_dataset) - len(failed)} of {len(by_dataset)} datasets pass)"
    else:
        description = f"all {len(by_dataset)} datasets pass. {description}"
    return CheckOutcome(not failed, description,
                        {"failed_datasets": failed, **{d: o.metadata for d, o in by_dataset.items()}})


def per_dataset(checks: Checks, df: pl.DataFrame) -> dict[str, CheckOutcome]:
    """Each check on each dataset (partition) of a run's frame.

    A run may cover several partitions (a single-run backfill); an aggregate would let one bad
    dataset hide behind nine good ones, so each is judged on its own.
    """
    parts = {key[0]: part for key, part in df.partition_by("dataset", as_dict=True, maintain_order=True).items()}
    return {name: combine({d: fn(part) for d, part in parts.items()}) for name, (fn, _) in checks.items()}
