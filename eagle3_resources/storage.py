"""Where every asset's files live: one data root, one documented path per asset and partition.

    <root>/raw_prompts/<dataset>.parquet
    <root>/completions/<dataset>/journal.jsonl     append-only, written as responses arrive
    <root>/completions/<dataset>.parquet           derived from the journal, one row per prompt
    <root>/token_ids/<dataset>.parquet
    <root>/merged_dataset/merged.parquet
    <root>/hidden_states/<dataset>-NNNNN.safetensors  shards of many samples + manifest.json (checksums)
    <root>/eagle3_drafter/                          config.json + model.safetensors (SGLang format)
    <root>/standin/                                 the stand-in tokenizer and target, built once
    <root>/ledger/spend.sqlite                      the spend ledger every process shares (SQLite, WAL)

The root is `EAGLE3_DATA_DIR`, by default `var/data` inside the checkout (git-ignored).
"""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg
from pydantic import Field

PROJECT_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA_DIR = PROJECT_ROOT / "var" / "data"


def default_data_dir() -> Path:
    return Path(os.environ.get("EAGLE3_DATA_DIR") or DEFAULT_DATA_DIR)


class DataLayout:
    """Paths under one data root. Creating a path's parent is the caller's job (`ensure`)."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).resolve()

    @staticmethod
    def ensure(path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def raw_prompts(self, dataset: str) -> Path:
        return self.root / "raw_prompts" / f"{dataset}.parquet"

    def completions_journal(self, dataset: str) -> Path:
        return self.root / "completions" / dataset / "journal.jsonl"

    def all_completion_journals(self) -> list[Path]:
        return sorted((self.root / "completions").glob("*/journal.jsonl"))

    def ledger(self) -> Path:
        return self.root / "ledger" / "spend.sqlite"

    def completions(self, dataset: str) -> Path:
        return self.root / "completions" / f"{dataset}.parquet"

    def token_ids(self, dataset: str) -> Path:
        return self.root / "token_ids" / f"{dataset}.parquet"

    def merged_dataset(self) -> Path:
        return self.root / "merged_dataset" / "merged.parquet"

    def hidden_states(self) -> Path:
        return self.root / "hidden_states"

    def drafter(self) -> Path:
        return self.root / "eagle3_drafter"

    def standin(self) -> Path:
        return self.root / "standin"


class DataStore(dg.ConfigurableResource):
    """The data root every asset reads and writes under (`EAGLE3_DATA_DIR`)."""

    root: str = Field(
        description="the data root: every asset's files, the stand-ins and the spend ledger live under it "
        "(EAGLE3_DATA_DIR, default var/data in the checkout)"
    )

    @property
    def layout(self) -> DataLayout:
        return DataLayout(self.root)
