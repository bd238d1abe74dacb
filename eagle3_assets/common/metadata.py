"""Materialization metadata helpers: previews, tables and plots a person can read in the UI."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import dagster as dg
import polars as pl

PREVIEW_ROWS = 5
CELL_CHARS = 80


def _cell(value: Any) -> str:
    if isinstance(value, (list, dict)):
        value = json.dumps(value, ensure_ascii=False)
    text = "" if value is None else str(value)
    text = text.replace("\n", "⏎").replace("|", "\\|")
    return text if len(text) <= CELL_CHARS else text[: CELL_CHARS - 1] + "…"


def markdown_table(
    df: pl.DataFrame, columns: Sequence[str] | None = None, rows: int = PREVIEW_ROWS
) -> dg.MetadataValue:
    cols = list(columns or df.columns)
    head = df.select(cols).head(rows)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in head.rows()]
    if df.height > rows:
        lines.append(f"\n{df.height - rows} more rows")
    return dg.MetadataValue.md("\n".join(lines))


def png_markdown(fig) -> dg.MetadataValue:
    """A matplotlib figure embedded in markdown (Dagster has no image metadata type)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    encoded = base64.b64encode(buf.getvalue()).decode()
    return dg.MetadataValue.md(f"![plot](data:image/png;base64,{encoded})")


def path_value(path: Path) -> dg.MetadataValue:
    return dg.MetadataValue.path(str(path))


def json_value(obj: Any) -> dg.MetadataValue:
    return dg.MetadataValue.json(json.loads(json.dumps(obj, default=str)))
