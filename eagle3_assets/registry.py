"""The dataset registry (`data/datasets.yaml`): datasets, and the partitions built from them."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import yaml
from dagster._core.storage.tags import (
    ASSET_PARTITION_RANGE_END_TAG,
    ASSET_PARTITION_RANGE_START_TAG,
    PARTITION_NAME_TAG,
)

from eagle3_resources.storage import PROJECT_ROOT

DEFAULT_REGISTRY = PROJECT_ROOT / "data" / "datasets.yaml"
FORMATS = ("messages", "glaive")
KINDS = ("chat", "reasoning", "function-calling", "code")
NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,31}$")


class RegistryError(ValueError):
    """The registry file is malformed, or names a dataset it does not hold."""


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    prompt_file: Path
    format: str
    kind: str
    description: str = ""
    token_budget: int | None = None
    sample_cap: int | None = None
    source: str = ""


def _positive_or_none(value, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise RegistryError(f"{where} must be a positive integer or null, got {value!r}")
    return value


def load_registry(path: str | os.PathLike[str]) -> dict[str, DatasetSpec]:
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RegistryError(f"{path}: registry file not found") from None
    except yaml.YAMLError as e:
        raise RegistryError(f"{path}: not valid YAML ({e})") from None
    entries = (doc or {}).get("datasets") if isinstance(doc, dict) else None
    if not isinstance(entries, dict) or not entries:
        raise RegistryError(f"{path}: expected a non-empty `datasets:` mapping")
    out = {}
    for name, entry in entries.items():
        where = f"{path}: dataset {name!r}"
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise RegistryError(f"{where}: names are a letter then letters, digits or _ (at most 32)")
        if not isinstance(entry, dict):
            raise RegistryError(f"{where}: expected a mapping")
        unknown = set(entry) - {"description", "prompt_file", "format", "kind", "token_budget", "sample_cap", "source"}
        if unknown:
            raise RegistryError(f"{where}: unknown field(s) {sorted(unknown)}")
        for field in ("prompt_file", "format", "kind"):
            if not entry.get(field):
                raise RegistryError(f"{where}: missing field {field!r}")
        if entry["format"] not in FORMATS:
            raise RegistryError(f"{where}: format {entry['format']!r} is not one of {FORMATS}")
        if entry["kind"] not in KINDS:
            raise RegistryError(f"{where}: kind {entry['kind']!r} is not one of {KINDS}")
        prompt_file = Path(entry["prompt_file"])
        out[name] = DatasetSpec(
            name=name,
            prompt_file=prompt_file if prompt_file.is_absolute() else (path.parent / prompt_file).resolve(),
            format=entry["format"],
            kind=entry["kind"],
            description=str(entry.get("description") or ""),
            token_budget=_positive_or_none(entry.get("token_budget"), f"{where}: token_budget"),
            sample_cap=_positive_or_none(entry.get("sample_cap"), f"{where}: sample_cap"),
            source=str(entry.get("source") or ""),
        )
    return out


REGISTRY_PATH = Path(os.environ.get("EAGLE3_REGISTRY") or DEFAULT_REGISTRY)
DATASETS: dict[str, DatasetSpec] = load_registry(REGISTRY_PATH)

dataset_partitions = dg.StaticPartitionsDefinition(list(DATASETS))


def dataset_spec(name: str, registry: dict[str, DatasetSpec] | None = None) -> DatasetSpec:
    registry = DATASETS if registry is None else registry
    try:
        return registry[name]
    except KeyError:
        raise RegistryError(
            f"unknown dataset {name!r}: {REGISTRY_PATH} lists {', '.join(registry)}"
        ) from None


def run_datasets(tags: Mapping[str, str]) -> list[str]:
    """The datasets a run covers: its `dagster/partition` tag, or the range its tags give.

    A backfill launched from the UI tags its runs with a range (start and end), even for one
    partition, and no `dagster/partition` at all.
    """
    if tags.get(PARTITION_NAME_TAG):
        return [tags[PARTITION_NAME_TAG]]
    start, end = tags.get(ASSET_PARTITION_RANGE_START_TAG), tags.get(ASSET_PARTITION_RANGE_END_TAG)
    keys = list(DATASETS)
    if start not in keys or end not in keys:
        return []
    return keys[keys.index(start): keys.index(end) + 1]
