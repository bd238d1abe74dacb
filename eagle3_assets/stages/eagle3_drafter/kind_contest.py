"""Several drafter kinds trained on the same states in one materialization, the best by real accept length exported.

`DrafterTrainConfig.drafter_kinds` names them. Each trains as the asset trains one (the same windows, draft
vocabulary, seed and budget: only `drafter_kind` differs) into a candidate folder `eagle3_drafter.kinds/<kind>/`, its
training checkpoint beside it (a stopped contest resumes kind by kind); each candidate is decoded through its exported
files with the target (the lossless loop); the one with the highest real accept length is copied to the export
folder, and every kind's figures are recorded: real accept length overall and per prompt kind, the simulated one,
training tokens/s and the draft's KV cache bytes per token.
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import polars as pl

from eagle3_resources.atomic_files import published_folder

CANDIDATES = "eagle3_drafter.kinds"


@dataclass(frozen=True)
class KindResult:
    """One kind's showing: `real` its real accept length (None: not decoded, e.g. a target too large to run here),
    `by_prompt_kind` the real one per prompt kind."""

    kind: str
    checkpoint: Path
    real: float | None
    real_untrained: float | None
    by_prompt_kind: dict[str, float | None]
    simulated: float
    tokens_per_s: float
    train_seconds: float
    kv_bytes_per_token: int

    def to_metadata(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}


def candidate_dir(drafter_dir: Path, kind: str) -> Path:
    """Where `kind`'s candidate is exported, beside the export folder (its training checkpoint: `<it>.training`)."""
    return Path(drafter_dir).parent / CANDIDATES / kind


def choose(results: list[KindResult]) -> tuple[KindResult, str]:
    """The kind to export and why: the highest real accept length (the first listed on a tie); when no kind was
    decoded, the highest simulated one, said so."""
    if not results:
        raise ValueError("no drafter kinds to choose from")
    decoded = [r for r in results if r.real is not None]
    if decoded:
        best = max(decoded, key=lambda r: r.real or 0.0)  # max keeps the first of equals
        return best, f"the highest real accept length ({best.real}) of {len(decoded)} decoded kinds"
    best = max(results, key=lambda r: r.simulated)
    return best, f"no kind was decoded: the highest simulated accept length ({best.simulated}), teacher-forced"


def publish(chosen: KindResult, drafter_dir: Path) -> Path:
    """The chosen candidate's files copied to the export folder, replacing what was there in one rename."""
    with published_folder(Path(drafter_dir)) as staging:
        for f in sorted(Path(chosen.checkpoint).iterdir()):
            if f.is_file():
                shutil.copy2(f, staging / f.name)
    return Path(drafter_dir)


def contest_frame(results: list[KindResult], chosen: KindResult) -> pl.DataFrame:
    """A row per kind, the exported one marked; the real accept length per prompt kind in columns of their own."""
    prompt_kinds = sorted({p for r in results for p in r.by_prompt_kind})
    return pl.DataFrame(
        {
            "kind": [f"**{r.kind}** (exported)" if r is chosen else r.kind for r in results],
            "real accept length": [r.real for r in results],
            "untrained": [r.real_untrained for r in results],
            **{p: [r.by_prompt_kind.get(p) for r in results] for p in prompt_kinds},
            "simulated": [r.simulated for r in results],
            "tokens/s": [round(r.tokens_per_s) for r in results],
            "draft KV B/token": [r.kv_bytes_per_token for r in results],
        }
    )
