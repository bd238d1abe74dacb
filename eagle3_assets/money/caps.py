"""What a request may cost at worst, and the caps every admission is checked against.

One model for limits: `Limits` holds the dollar limits of one source (a run's config, or the environment's
spend policy); `run_caps` is the one place where two sources meet: each limit is the tighter of the two.
"""

from __future__ import annotations

from dataclasses import dataclass

CAP_MODES = ("finish", "cancel")


@dataclass(frozen=True)
class Pricing:
    """USD per token: the highest price the request's routing allows (worst case for admission).

    The ledger records what was billed; this only sizes reservations. `source` says where the
    figures came from (the API's endpoint list, the model list, or the run config).
    """

    prompt: float = 0.0
    completion: float = 0.0
    source: str = "none"

    def worst_case(self, prompt_tokens: int, max_tokens: int) -> float:
        return prompt_tokens * self.prompt + max_tokens * self.completion

    @property
    def free(self) -> bool:
        """A backend that bills nothing (local model, own SGLang server)."""
        return self.prompt == 0.0 and self.completion == 0.0


@dataclass(frozen=True)
class Caps:
    """Limits checked, together, against settled + reserved spend of every process on the data root.

    token_budget: completion tokens of this dataset, all runs together (billed + worst case in flight)
    run_usd: dollars of this Dagster run, across all its datasets and its pilots
    day_usd: dollars of the current UTC day;  total_usd: dollars of the whole ledger
    on_cap: what happens to requests in flight when a cap is reached: "finish" or "cancel"
    """

    token_budget: int | None = None
    run_usd: float | None = None
    total_usd: float | None = None
    day_usd: float | None = None
    on_cap: str = "finish"

    def __post_init__(self) -> None:
        if self.on_cap not in CAP_MODES:
            raise ValueError(f'on_cap must be "finish" or "cancel", not {self.on_cap!r}')


@dataclass(frozen=True)
class Limits:
    """Dollar limits from one source (None = no limit): a run's config, or the spend policy (EAGLE3_MAX_*_USD)."""

    run_usd: float | None = None
    day_usd: float | None = None
    total_usd: float | None = None


def tighter(a: float | None, b: float | None) -> float | None:
    """The stricter of two optional limits (None = no limit)."""
    return b if a is None else a if b is None else min(a, b)


def run_caps(run: Limits, environment: Limits, *, token_budget: int | None = None, on_cap: str = "finish") -> Caps:
    """The caps every admission of a run checks: each dollar limit the tighter of the run's config and the environment's
    (the client enforces the policy itself, so spending stops even when no sensor daemon runs)."""
    return Caps(
        token_budget=token_budget,
        run_usd=tighter(run.run_usd, environment.run_usd),
        total_usd=tighter(run.total_usd, environment.total_usd),
        day_usd=tighter(run.day_usd, environment.day_usd),
        on_cap=on_cap,
    )
