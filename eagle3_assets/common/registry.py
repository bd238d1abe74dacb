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

from eagle3_resources.errors import RegistryError
from eagle3_resources.storage import PROJECT_ROOT

DEFAULT_REGISTRY = PROJECT_ROOT / "data" / "datasets.yaml"
FORMATS = ("messages", "glaive")
KINDS = ("chat", "reasoning", "function-calling", "code")
NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,31}$")


SCHEMAS = ("glaive", "instruction", "messages", "sharegpt")
IMPORT_FIELDS = {
    "schema",
    "repo",
    "revision",
    "subset",
    "split",
    "files",
    "instruction_column",
    "system",
    "seed",
    "languages",
    "min_prompt_tokens",
    "max_prompt_tokens",
    "min_turns",
    "max_turns",
    "max_reject_rate",
}


@dataclass(frozen=True)
class ImportSpec:
    """Where a dataset's real prompts come from and how they are selected (`import:` in the registry).

    Read from the Hugging Face dataset `repo` at `revision` (the files matching `files`, which
    hold the `subset`/`split` named), or from the same paths under a local sources folder.
    """

    schema: str
    files: str
    repo: str | None = None
    revision: str = "main"
    subset: str = "default"
    split: str = "train"
    instruction_column: str = "input"  # schema `instruction`: the column holding the user's request
    system: str = "keep"  # keep | drop the source's own system prompt
    seed: int = 0
    languages: tuple[str, ...] = ()  # ISO 639-1 codes of the user text; empty: any language
    min_prompt_tokens: int | None = None
    max_prompt_tokens: int | None = None
    min_turns: int | None = None  # user turns
    max_turns: int | None = None
    max_reject_rate: float = 0.05  # above it the raw_prompts reject-rate check fails (blocking)

    @property
    def source(self) -> str:
        name = self.repo or "local"
        return f"{name} [{self.subset}/{self.split}]"

    def settings(self) -> dict:
        """Everything that decides which prompts are selected (recorded with the materialization)."""
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


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
    real: ImportSpec | None = None  # how to import the full-size dataset, when it has one

    def imported(self) -> ImportSpec:
        """How to import the full-size dataset; a RegistryError when the registry names no source."""
        if self.real is None:
            raise RegistryError(
                f"no `import:` source in the registry for {self.name}; "
                "add one or build them from their sample files (prompts: sample)"
            )
        return self.real


def _positive_or_none(value, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise RegistryError(f"{where} must be a positive integer or null, got {value!r}")
    return value


def _import_spec(entry, where: str) -> ImportSpec:
    if not isinstance(entry, dict):
        raise RegistryError(f"{where}: expected a mapping")
    unknown = set(entry) - IMPORT_FIELDS
    if unknown:
        raise RegistryError(f"{where}: unknown field(s) {sorted(unknown)} (known: {', '.join(sorted(IMPORT_FIELDS))})")
    if entry.get("schema") not in SCHEMAS:
        raise RegistryError(f"{where}: schema {entry.get('schema')!r} is not one of {SCHEMAS}")
    if not isinstance(entry.get("files"), str) or not entry["files"]:
        raise RegistryError(f"{where}: missing field 'files' (a glob of the source's files, e.g. data/train-*.parquet)")
    for name in ("repo", "revision", "subset", "split", "instruction_column"):
        if name in entry and not isinstance(entry[name], str | None):
            raise RegistryError(f"{where}: {name} must be a string")
    if entry.get("system", "keep") not in ("keep", "drop"):
        raise RegistryError(f"{where}: system must be keep or drop, got {entry['system']!r}")
    seed = entry.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise RegistryError(f"{where}: seed must be an integer, got {seed!r}")
    languages = entry.get("languages") or []
    if not isinstance(languages, list) or not all(isinstance(x, str) and len(x) in (2, 3) for x in languages):
        raise RegistryError(f"{where}: languages must be a list of ISO 639-1 codes such as [en, zh]")
    rate = entry.get("max_reject_rate", 0.05)
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate <= 1:
        raise RegistryError(f"{where}: max_reject_rate must be a fraction between 0 and 1, got {rate!r}")
    bounds = {
        k: _positive_or_none(entry.get(k), f"{where}: {k}")
        for k in ("min_prompt_tokens", "max_prompt_tokens", "min_turns", "max_turns")
    }
    for low, high in (("min_prompt_tokens", "max_prompt_tokens"), ("min_turns", "max_turns")):
        least, most = bounds[low], bounds[high]
        if least and most and least > most:
            raise RegistryError(f"{where}: {low} {least} is above {high} {most}")
    return ImportSpec(
        schema=entry["schema"],
        files=entry["files"],
        repo=entry.get("repo"),
        revision=entry.get("revision") or "main",
        subset=entry.get("subset") or "default",
        split=entry.get("split") or "train",
        instruction_column=entry.get("instruction_column") or "input",
        system=entry.get("system", "keep"),
        seed=seed,
        languages=tuple(languages),
        max_reject_rate=float(rate),
        **bounds,
    )


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
        unknown = set(entry) - {
            "description",
            "prompt_file",
            "format",
            "kind",
            "token_budget",
            "sample_cap",
            "source",
            "import",
        }
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
            real=_import_spec(entry["import"], f"{where}: import") if entry.get("import") is not None else None,
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
        raise RegistryError(f"unknown dataset {name!r}: {REGISTRY_PATH} lists {', '.join(registry)}") from None


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
    return keys[keys.index(start) : keys.index(end) + 1]
