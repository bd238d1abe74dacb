"""What `eagle3 status` shows: the figures read per stage, and the `Status` that holds them.

`status_gather.py` fills a `Status` from the Dagster instance and the spend ledger; `status_render.py` turns it
into text (with or without colour) and JSON; `status.py` is the command. The `pipeline_status` asset
(`quality.py`) reads the same `Status`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from eagle3_assets.common.standin import STANDIN_TAG

# Stage -> the figures shown: (label, metadata keys tried in order). Per-dataset stages first.
PARTITIONED: dict[str, tuple[str, list[tuple[str, tuple[str, ...]]]]] = {
    "raw_prompts": ("prompts", [("rows", ("rows",)), ("tokens", ("tokens",))]),
    "completions": ("completions", [("rows", ("rows",)), ("tokens", ("completion_tokens",)), ("usd", ("cost_usd",))]),
    "token_ids": ("token_ids", [("rows", ("rows",)), ("tokens", ("tokens", "completion_tokens"))]),
}
# Where a stage's metadata keeps one entry per dataset (`per_dataset`), the keys that hold the same figure there.
PER_DATASET_KEYS: dict[str, dict[str, tuple[str, ...]]] = {
    "raw_prompts": {"rows": ("selected",)},
    "token_ids": {"rows": ("rows",), "tokens": ("tokens", "completion_tokens")},
}
UNPARTITIONED: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "merged_dataset": [("rows", ("rows",)), ("tokens", ("tokens",))],
    "hidden_states": [("samples", ("samples",)), ("tokens", ("tokens",)), ("bytes", ("bytes", "bytes_written"))],
    # The real accept length (lossless speculative decoding with the target) leads; the simulated one (teacher-forced
    # on the eval split, `accept_length` in materializations before it was named so) is beside it, named.
    "eagle3_drafter": [
        ("accept_length", ("accept_length_real",)),
        ("untrained", ("accept_length_real_untrained",)),
        ("simulated", ("accept_length_simulated", "accept_length")),
        ("final_loss", ("final_loss",)),
    ],
}


@dataclass
class CheckState:
    """The latest completed evaluation of one asset check for one dataset (or for an unpartitioned stage)."""

    name: str
    passed: bool
    severity: str  # WARN | ERROR
    description: str
    run_id: str
    timestamp: float
    partition: str | None  # as recorded; None: attributed to the dataset by its run's tags
    standin: bool = False  # a failure the tiny stand-in target explains (its metadata says `standin: true`)

    @property
    def label(self) -> str:
        return f"{self.severity} {self.name}"

    @property
    def shown(self) -> str:
        """The label as the text shows it: a failure of the stand-in's tagged `(stand-in)`."""
        return f"{self.label} {STANDIN_TAG}" if self.standin and not self.passed else self.label


@dataclass
class StageState:
    """One stage (of one dataset, for the per-dataset stages): its latest materialization and checks."""

    asset: str
    materialized: bool = False
    timestamp: float | None = None
    run_id: str | None = None
    figures: dict[str, Any] = field(default_factory=dict)  # label -> value (None: not in the metadata)
    shared: list[str] = field(default_factory=list)  # labels whose value is the run's total over several datasets
    checks: list[CheckState] = field(default_factory=list)

    @property
    def failing(self) -> list[CheckState]:
        return [c for c in self.checks if not c.passed]


@dataclass
class DatasetStatus:
    dataset: str
    stages: dict[str, StageState]


@dataclass
class RunState:
    run_id: str
    status: str
    job: str
    datasets: list[str]
    created: float
    started: float | None
    spends: bool
    progress: dict[str, str] = field(default_factory=dict)  # dataset -> its latest progress line, this run's


@dataclass
class Money:
    ledger: str
    day: str
    billed_usd: float = 0.0
    today_usd: float = 0.0
    in_flight: int = 0
    in_flight_worst_usd: float = 0.0
    unsettled: int = 0  # attempts with a generation id and no bill yet
    unidentified: int = 0  # attempts cut before their id arrived
    unsettled_worst_usd: float = 0.0
    expired_worst_usd: float = 0.0
    per_dataset: dict[str, dict[str, float]] = field(default_factory=dict)  # only datasets the ledger has figures for
    hold: dict[str, Any] | None = None  # since, reasons, thresholds


@dataclass
class Status:
    at: float
    dagster_home: str | None
    data_dir: str | None
    datasets: list[DatasetStatus] = field(default_factory=list)
    stages: list[StageState] = field(default_factory=list)  # the unpartitioned stages
    runs: list[RunState] = field(default_factory=list)
    money: Money | None = None
    errors: list[str] = field(default_factory=list)
