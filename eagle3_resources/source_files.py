"""Rows of a public dataset, read from the Hugging Face Hub or from a local copy laid out the same way.

A dataset is named by its hub id, a revision and a glob of its files (`data/train_sft-*.parquet`),
which is how the hub stores a subset and split. Without network, or for in-house sets, the same
paths are read under a local folder: `<sources dir>/<hub id>/<glob>` (what
`huggingface-cli download <id> --repo-type dataset --local-dir <sources dir>/<id>` leaves), or
`<sources dir>/<glob>` for a set with no hub id. Files are read as the hub serves them: Parquet,
JSON Lines, or one JSON array (glaive-function-calling-v2 is a single `.json` array).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_resources.errors import SourceError
from eagle3_resources.jsonl import iter_json_lines

PARQUET_BATCH_ROWS = 1024


@dataclass(frozen=True)
class SourceRow:
    """One row of a source file: where it is, and its value or why it could not be read."""

    file: str  # path inside the dataset, as on the hub
    row: int  # 1-based: the line of a JSON Lines file, the row of a Parquet file or JSON array
    value: dict[str, Any] | None
    problem: str | None = None

    @property
    def where(self) -> str:
        return f"{self.file}:{self.row}"


def resolve_files(
    repo: str | None, pattern: str, revision: str = "main", local_root: str | os.PathLike[str] | None = None
) -> list[tuple[str, Path]]:
    """(name inside the dataset, local path) of every file the glob matches, sorted by name."""
    if local_root is not None:
        base = Path(local_root).expanduser() / repo if repo else Path(local_root).expanduser()
        found = sorted(p for p in base.glob(pattern) if p.is_file())
        if not found:
            raise SourceError(f"no file matches {base / pattern}")
        return [(p.relative_to(base).as_posix(), p) for p in found]
    if not repo:
        raise SourceError(f"no hub dataset id and no local sources folder to find {pattern!r} in")
    from huggingface_hub import snapshot_download  # the hub only when it is used

    # Only the files the glob names, in parallel, into the Hugging Face cache (HF_HOME): resumable,
    # shared with `datasets`, and read from there again with HF_HUB_OFFLINE=1.
    folder = Path(snapshot_download(repo, repo_type="dataset", revision=revision, allow_patterns=[pattern]))
    found = sorted(p for p in folder.glob(pattern) if p.is_file())
    if not found:
        raise SourceError(f"no file of hf://datasets/{repo}@{revision} matches {pattern!r}")
    return [(p.relative_to(folder).as_posix(), p) for p in found]


def _parquet_rows(name: str, path: Path, columns: Sequence[str], required: Sequence[str]) -> Iterator[SourceRow]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    present = set(pf.schema_arrow.names)
    missing = [c for c in required if c not in present]
    if missing:
        raise SourceError(f"{name}: no column(s) {missing}; the file has {sorted(present)}")
    n = 0
    # Only the columns the conversion reads: OpenCodeInstruct's answers and tests stay on disk.
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[c for c in columns if c in present]):
        for value in batch.to_pylist():
            n += 1
            yield SourceRow(name, n, value)


def _json_rows(name: str, path: Path) -> Iterator[SourceRow]:
    data = path.read_bytes()
    if data.lstrip()[:1] == b"[":
        try:
            values = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SourceError(f"{name}: a JSON array that does not parse ({e})") from None
        for i, value in enumerate(values, start=1):
            ok = isinstance(value, dict)
            yield SourceRow(
                name, i, value if ok else None, None if ok else f"expected a JSON object, got {type(value).__name__}"
            )
        return
    for line in iter_json_lines(data):
        yield SourceRow(name, line.line, line.value, line.problem)


def iter_rows(name: str, path: Path, columns: Sequence[str], required: Sequence[str] = ()) -> Iterator[SourceRow]:
    """Every row of one file; a row that cannot be read comes with its problem instead of raising.

    `required` columns are checked once per Parquet file (a wrong file or schema); in JSON every
    row is its own object, so a missing field is that row's problem, found by its conversion.
    """
    if path.suffix == ".parquet":
        yield from _parquet_rows(name, path, columns, required)
    elif path.suffix in (".jsonl", ".json", ".ndjson"):
        yield from _json_rows(name, path)
    else:
        raise SourceError(f"{name}: not Parquet (.parquet) or JSON (.json, .jsonl, .ndjson)")
