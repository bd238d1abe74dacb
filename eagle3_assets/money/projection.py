"""What the rest of a partition will cost and take, projected from its pilot before it is sent."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, cast

import polars as pl

from eagle3_assets.money.caps import Pricing


@dataclass
class Projection:
    prompts: int
    prompt_tokens: int
    completion_tokens: int  # expected: the pilot's mean per prompt, within the token budget left
    usd: float  # expected, at the prices the pilot was actually billed
    usd_worst: float  # every prompt using max_tokens at the highest allowed price
    duration_s: float
    basis: str

    def line(self, dataset: str) -> str:
        return (
            f"{dataset}: the remaining {self.prompts:,} prompts should cost about ${self.usd:,.2f} (at most "
            f"${self.usd_worst:,.2f}) and take about {self.duration_s / 60:.1f} min ({self.basis})"
        )

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["usd"], out["usd_worst"], out["duration_s"] = (
            round(self.usd, 4),
            round(self.usd_worst, 4),
            round(self.duration_s, 1),
        )
        return out


def project(
    pilot: pl.DataFrame,
    remaining_prompt_tokens: list[int],
    *,
    pricing: Pricing,
    max_tokens: int,
    token_budget_left: int | None,
    concurrency: int,
    max_rps: float | None = None,
) -> Projection:
    """From the pilot's billed answers (tokens, cost, latency) to the rest of the partition.

    Cost: the remaining prompts' exact prompt tokens plus the pilot's mean completion tokens, at the
    listed (worst-case) prices scaled by how the pilot's bills compare with them. Duration: the
    pilot's mean latency with `concurrency` requests in flight (and the provider's rate limit, if known).
    """
    done = pilot.filter(pl.col("status").is_in(["ok", "truncated"]) & pl.col("completion_tokens").is_not_null())
    n = len(remaining_prompt_tokens)
    prompt_tokens = int(sum(remaining_prompt_tokens))
    worst_completion = n * max_tokens if token_budget_left is None else min(n * max_tokens, max(0, token_budget_left))
    usd_worst = prompt_tokens * pricing.prompt + worst_completion * pricing.completion
    if done.height == 0:
        return Projection(n, prompt_tokens, worst_completion, usd_worst, usd_worst, 0.0, "no pilot answer: worst case")
    mean_completion = float(cast(float, done["completion_tokens"].mean()))  # a numeric column: a float
    completion_tokens = int(round(n * mean_completion))
    if token_budget_left is not None:
        completion_tokens = min(completion_tokens, max(0, token_budget_left))
    listed = float(
        (done["prompt_tokens"].fill_null(0) * pricing.prompt + done["completion_tokens"] * pricing.completion).sum()
    )
    billed = float(done["cost_usd"].sum())
    ratio = billed / listed if listed > 0 else 1.0
    usd = ratio * (prompt_tokens * pricing.prompt + completion_tokens * pricing.completion)
    latency = float(cast(float, done["latency_s"].fill_null(0).mean() or 0.0))
    rate = min(concurrency, max(1, n)) / latency if latency > 0 else float("inf")
    if max_rps:
        rate = min(rate, max_rps)
    duration = n / rate if rate and rate != float("inf") else 0.0
    return Projection(
        n,
        prompt_tokens,
        completion_tokens,
        usd,
        usd_worst,
        duration,
        f"pilot of {done.height}: {mean_completion:.0f} completion tokens and {latency:.1f} s per prompt, "
        f"billed {ratio:.2f}x the listed worst-case price",
    )
