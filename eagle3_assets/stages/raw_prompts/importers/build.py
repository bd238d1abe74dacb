"""Each dataset's prompts for the `raw_prompts` asset: the shipped sample file, or the real source imported.

Datasets are built in registry order, and a prompt belongs to the first dataset that selects it:
a later dataset never imports a prompt an earlier one holds (glaive feeds both B1 and B3). So a
dataset's selection depends only on the registry and the sources of the datasets before it, and
is the same whether it is built alone or in a run over all ten. An earlier dataset outside the
run is read from its last materialization; one never built is reported as not checked against.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_assets.common.registry import DatasetSpec
from eagle3_assets.stages.raw_prompts.importers.importer import ImportReport, PromptLength, import_prompts
from eagle3_assets.stages.raw_prompts.importers.schemas import columns
from eagle3_assets.stages.raw_prompts.importers.selection import prompt_key
from eagle3_assets.stages.raw_prompts.prompts import Prompt, read_prompts
from eagle3_resources.errors import RegistryError, SourceError
from eagle3_resources.source_files import SourceRow, iter_rows, resolve_files

MODES = ("sample", "real")
REJECT_ROW_CHARS = 4000  # a rejected row is kept this long in the rejects file


@dataclass
class DatasetPrompts:
    name: str
    prompts: list[Prompt]
    report: ImportReport
    source: str  # where the prompts came from, in words
    settings: dict[str, Any] = field(default_factory=dict)
    not_checked_against: list[str] = field(default_factory=list)  # earlier datasets never built
    rejects_path: Path | None = None


def source_rows(spec: DatasetSpec, sources_dir: str | os.PathLike[str] | None) -> Iterator[SourceRow]:
    real = spec.imported()
    read, required = columns(real)
    if real.repo is None and sources_dir is None:
        raise SourceError(
            f"{spec.name} is an in-house set (no hub id): set EAGLE3_SOURCES_DIR (or `--sources`) to the "
            f"folder that holds {real.files}, or build {spec.name} from its sample file"
        )
    try:
        files = resolve_files(real.repo, real.files, real.revision, sources_dir)
    except SourceError as e:
        raise SourceError(f"{spec.name}: {e}") from None
    for name, path in files:
        try:
            yield from iter_rows(name, path, read, required)
        except SourceError as e:
            raise SourceError(f"{spec.name}: {e}") from None


class _RejectsFile:
    """Rejected rows streamed to `<ds>.rejects.jsonl` (written whole, then moved into place)."""

    def __init__(self, path: Path):
        self.path, self.tmp = path, path.with_suffix(".jsonl.tmp")
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(self.tmp, "w", encoding="utf-8")  # noqa: SIM115 (closed in close())

    def write(self, row: SourceRow, reason: str) -> None:
        text = json.dumps(row.value, ensure_ascii=False, default=str) if row.value is not None else None
        rec = {
            "source_row": row.where,
            "reason": reason,
            "row": text[:REJECT_ROW_CHARS] if text else None,
            "row_truncated": bool(text and len(text) > REJECT_ROW_CHARS),
        }
        self.f.write(json.dumps(rec, ensure_ascii=False) + "\n")

    def close(self) -> None:
        self.f.close()
        os.replace(self.tmp, self.path)


def _sample_prompts(spec: DatasetSpec, claimed: dict[str, str]) -> tuple[list[Prompt], ImportReport]:
    """The hand-written file: strictly validated (any bad line fails), then de-duplicated like an import."""
    prompts = read_prompts(spec)
    report = ImportReport(rows=len(prompts))
    kept: list[Prompt] = []
    seen: set[str] = set()
    for p in prompts:
        p.key = prompt_key(p.messages, p.tools)
        p.source_row = f"{spec.prompt_file.name}:{p.line}"
        if p.key in seen:
            report.duplicates += 1
        elif p.key in claimed:
            report.duplicates_of[claimed[p.key]] += 1
        else:
            seen.add(p.key)
            kept.append(p)
    report.selected = len(kept)
    return kept, report


def _imported_prompts(
    spec: DatasetSpec,
    sources_dir: str | os.PathLike[str] | None,
    length: PromptLength,
    claimed: dict[str, str],
    rejects: _RejectsFile | None,
) -> DatasetPrompts:
    """The real source of `spec` imported; rejected rows go to `rejects` (closed here)."""
    real = spec.imported()
    try:
        prompts, report = import_prompts(
            spec.name,
            real,
            source_rows(spec, sources_dir),
            cap=spec.sample_cap,
            length=length,
            claimed=claimed,
            on_reject=rejects.write if rejects else (lambda row, reason: None),
        )
    finally:
        if rejects:
            rejects.close()
    where = f"local copy under {sources_dir}" if sources_dir else "the Hugging Face Hub"
    return DatasetPrompts(
        spec.name,
        prompts,
        report,
        f"{real.source} from {where}",
        real.settings(),
        rejects_path=rejects.path if rejects else None,
    )


def build_prompt_sets(  # eight parameters: what to build, then keyword-only settings and hooks with defaults
    names: Sequence[str],
    registry: dict[str, DatasetSpec],
    *,
    mode: str,
    length: PromptLength,
    sources_dir: str | os.PathLike[str] | None = None,
    built_keys: Callable[[str], list[str] | None] = lambda name: None,
    rejects_path: Callable[[str], Path] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, DatasetPrompts]:
    """The prompts of `names`, in registry order. `built_keys(name)` gives the prompt keys of an
    earlier dataset's last materialization (None if never built)."""
    if mode not in MODES:
        raise RegistryError(f"prompts mode {mode!r}: expected one of {MODES}")
    order = list(registry)
    wanted = sorted(names, key=order.index)
    missing = [n for n in wanted if mode == "real" and registry[n].real is None]
    if missing:
        raise RegistryError(
            f"no `import:` source in the registry for {', '.join(missing)}; "
            "add one or build them from their sample files (prompts: sample)"
        )
    claimed: dict[str, str] = {}
    unchecked: list[str] = []
    out: dict[str, DatasetPrompts] = {}
    for name in order[: order.index(wanted[-1]) + 1]:
        spec = registry[name]
        if name not in wanted:
            keys = built_keys(name)
            if keys is None:
                unchecked.append(name)
            for k in keys or []:
                claimed.setdefault(k, name)
            continue
        if mode == "sample":
            prompts, report = _sample_prompts(spec, claimed)
            result = DatasetPrompts(name, prompts, report, f"sample file {spec.prompt_file}")
        else:
            rejects = _RejectsFile(rejects_path(name)) if rejects_path else None
            result = _imported_prompts(spec, sources_dir, length, claimed, rejects)
        result.not_checked_against = list(unchecked)
        log(f"{name}: {result.report.summary()} [{result.source}]")
        for p in result.prompts:
            claimed.setdefault(p.key, name)
        out[name] = result
    return out
