"""What a check returns, and how a stage's checks become Dagster asset-check results."""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
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


def check_description(fn: Callable[..., CheckOutcome]) -> str:
    """A check's description in the UI: its docstring's first paragraph (what it checks, what to do when it fails)."""
    paragraph = (fn.__doc__ or fn.__name__).strip().split("\n\n")[0]
    return " ".join(line.strip() for line in paragraph.splitlines())


def check_specs(asset: str, checks: Checks, blocking: Collection[str] = frozenset()) -> list[dg.AssetCheckSpec]:
    return [
        dg.AssetCheckSpec(name, asset=asset, description=check_description(fn), blocking=name in blocking)
        for name, (fn, _) in checks.items()
    ]


def metadata_value(value: Any):
    if isinstance(value, (list, dict)):
        return dg.MetadataValue.json(json.loads(json.dumps(value, default=str)))
    return value


def to_results(checks: Checks, outcomes: dict[str, CheckOutcome]) -> list[dg.AssetCheckResult]:
    return [
        dg.AssetCheckResult(
            check_name=name,
            passed=outcome.passed,
            severity=getattr(dg.AssetCheckSeverity, checks[name][1]),
            description=outcome.description,
            metadata={k: metadata_value(v) for k, v in outcome.metadata.items()},
        )
        for name, outcome in outcomes.items()
    ]


def run_checks(checks: Checks, *args, **kwargs) -> list[dg.AssetCheckResult]:
    """Run checks that all take the same arguments."""
    return to_results(checks, {name: fn(*args, **kwargs) for name, (fn, _) in checks.items()})


def per_dataset(checks: Checks, frames: dict[str, pl.DataFrame]) -> dict[str, dict[str, CheckOutcome]]:
    """Each check on each dataset (partition) of a run: `{dataset: {check: outcome}}`.

    A run may cover several partitions (a single-run backfill); an aggregate would let one bad
    dataset hide behind nine good ones, so each is judged, and recorded, on its own.
    """
    return {d: {name: fn(part) for name, (fn, _) in checks.items()} for d, part in frames.items()}
