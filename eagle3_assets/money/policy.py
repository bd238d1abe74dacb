"""The spend policy: thresholds from the environment (or resource config), the account, and what crossed them.

The credit sensor compares the account (`/api/v1/key`) and the ledger with these thresholds; the
client enforces the run, day and total thresholds itself in every admission (so they hold with no
daemon running). Each field left unset falls back to its environment variable at use time, so a
launchpad that sets one field does not drop the others.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import dagster as dg
import httpx
from pydantic import Field

from eagle3_assets.money.caps import Limits
from eagle3_assets.money.ledger import DEFAULT_HORIZON_S, Figures
from eagle3_resources.completions.resource import OPENROUTER_DEFAULT_URL
from eagle3_resources.env import setting

HOLD_MODES = ("drain", "cancel")
THRESHOLD_ENV = {
    "min_balance_usd": "EAGLE3_MIN_BALANCE_USD",
    "max_run_usd": "EAGLE3_MAX_RUN_USD",
    "max_day_usd": "EAGLE3_MAX_DAY_USD",
    "max_total_usd": "EAGLE3_MAX_TOTAL_USD",
}


class SpendPolicy(dg.ConfigurableResource):
    """Thresholds the credit sensor and the client enforce (each unset here: its environment variable; none: not
    enforced)."""

    min_balance_usd: float | None = Field(
        default=None, description="hold when the account's remaining credit falls below (EAGLE3_MIN_BALANCE_USD)"
    )
    max_run_usd: float | None = Field(
        default=None,
        description="dollars one Dagster run may spend, all its datasets and pilots together (EAGLE3_MAX_RUN_USD)",
    )
    max_day_usd: float | None = Field(
        default=None, description="dollars per UTC day, every run together (EAGLE3_MAX_DAY_USD)"
    )
    max_total_usd: float | None = Field(
        default=None, description="dollars the whole ledger may reach (EAGLE3_MAX_TOTAL_USD)"
    )
    ledger_tolerance_usd: float | None = Field(
        default=None,
        description="warn when ledger and account usage drift apart by more (EAGLE3_LEDGER_TOLERANCE_USD, default 1.0)",
    )
    hold_mode: str | None = Field(
        default=None,
        description='what a hold does to requests in flight: "drain" (finish and '
        'keep them, the default) or "cancel" (EAGLE3_HOLD_MODE)',
    )
    unsettled_horizon_s: float | None = Field(
        default=None,
        description="how long a started generation with no bill is "
        "looked up and blocks its prompt (EAGLE3_UNSETTLED_HORIZON_S, default 900)",
    )
    account_base_url: str | None = Field(
        default=None, description="OpenRouter API base URL for /key and look-ups (OPENROUTER_BASE_URL)"
    )
    account_api_key: str | None = Field(
        default=None, description="OPENROUTER_API_KEY (read from the environment when unset)"
    )

    def thresholds(self) -> dict[str, float | None]:
        return {name: setting(getattr(self, name), env, None, float) for name, env in THRESHOLD_ENV.items()}

    def limits(self) -> Limits:
        """The environment's side of every cap a run checks (`caps.run_caps` takes the tighter of it and the run's)."""
        t = self.thresholds()
        return Limits(run_usd=t["max_run_usd"], day_usd=t["max_day_usd"], total_usd=t["max_total_usd"])

    @property
    def tolerance_usd(self) -> float:
        return setting(self.ledger_tolerance_usd, "EAGLE3_LEDGER_TOLERANCE_USD", 1.0, float)

    @property
    def hold_action(self) -> str:
        mode = setting(self.hold_mode, "EAGLE3_HOLD_MODE", "drain")
        if mode not in HOLD_MODES:
            raise ValueError(f'hold_mode must be "drain" or "cancel", not {mode!r}')
        return mode

    @property
    def horizon_s(self) -> float:
        return setting(self.unsettled_horizon_s, "EAGLE3_UNSETTLED_HORIZON_S", DEFAULT_HORIZON_S, float)

    def account_endpoint(self) -> tuple[str, str] | None:
        """(base URL, key) of the account, or None where there is no key."""
        key = setting(self.account_api_key, "OPENROUTER_API_KEY")
        if not key:
            return None
        return setting(self.account_base_url, "OPENROUTER_BASE_URL", OPENROUTER_DEFAULT_URL).rstrip("/"), key

    def read_account(self) -> Account | None:
        endpoint = self.account_endpoint()
        if endpoint is None:
            return None
        url, key = endpoint
        resp = httpx.get(f"{url}/key", headers={"Authorization": f"Bearer {key}"}, timeout=15)
        resp.raise_for_status()
        data = resp.json()["data"]
        return Account(
            usage_usd=float(data.get("usage") or 0.0), limit_remaining_usd=data.get("limit_remaining"), t=time.time()
        )


@dataclass
class Account:
    usage_usd: float
    limit_remaining_usd: float | None
    t: float


@dataclass
class Crossing:
    """Thresholds crossed: the global ones hold all spending; a run's own is about that run only."""

    reasons: list[str]
    runs: dict[str, str]  # run id -> why that run is over its threshold


def crossed(thresholds: dict[str, float | None], account: Account | None, ledger: Figures) -> Crossing:
    """Every threshold the figures cross. Per-run figures are those of runs in flight (`ledger.runs`)."""
    out: list[str] = []
    runs: dict[str, str] = {}
    min_balance, max_run = thresholds.get("min_balance_usd"), thresholds.get("max_run_usd")
    max_day, max_total = thresholds.get("max_day_usd"), thresholds.get("max_total_usd")
    if min_balance is not None and account is not None and account.limit_remaining_usd is not None:
        if account.limit_remaining_usd < min_balance:
            out.append(f"account balance ${account.limit_remaining_usd:.2f} < minimum ${min_balance:.2f}")
    if max_run is not None:
        for run_id, scope in ledger.runs.items():
            if scope.settled_usd > max_run:
                runs[run_id] = f"run {run_id[:8]} spent ${scope.settled_usd:.2f} > ${max_run:.2f} per run"
    if max_day is not None and ledger.today.settled_usd > max_day:
        out.append(f"spent today ${ledger.today.settled_usd:.2f} > ${max_day:.2f} per day")
    if max_total is not None and ledger.total.settled_usd > max_total:
        out.append(f"spent in all ${ledger.total.settled_usd:.2f} > ${max_total:.2f}")
    return Crossing(out, runs)


def account_moves(previous: dict[str, Any] | None, account: Account | None) -> list[str]:
    """Moves an account never makes between two readings: usage going down, balance going up."""
    out: list[str] = []
    if not previous or account is None:
        return out
    if account.usage_usd < previous["usage_usd"] - 1e-9:
        out.append(f"account usage went DOWN from ${previous['usage_usd']:.4f} to ${account.usage_usd:.4f}")
    if (
        account.limit_remaining_usd is not None
        and previous.get("limit_remaining_usd") is not None
        and account.limit_remaining_usd > previous["limit_remaining_usd"] + 1e-9
    ):
        out.append(
            f"account balance went UP from ${previous['limit_remaining_usd']:.4f} to ${account.limit_remaining_usd:.4f}"
        )
    return out


@dataclass
class LedgerGap:
    """How far the account's usage has drifted from the ledger since the first reading.

    A key may have spent before this project (or for others), so the account and the ledger start
    apart; that offset is taken at the first reading and said once, and drift from it is what is
    watched. A gap is a level, not an event: it is alerted when it opens and when it closes.
    """

    offset_usd: float  # account usage - ledger at the first reading
    drift_usd: float
    open: bool

    @classmethod
    def measure(
        cls, previous: dict[str, Any] | None, account: Account, ledger_usd: float, tolerance: float
    ) -> LedgerGap:
        offset = (
            previous["offset_usd"]
            if previous and previous.get("offset_usd") is not None
            else account.usage_usd - ledger_usd
        )
        drift = account.usage_usd - ledger_usd - offset
        return cls(offset_usd=offset, drift_usd=drift, open=abs(drift) > tolerance)

    def describe(self, account: Account, ledger_usd: float, tolerance: float) -> str:
        return (
            f"ledger ${ledger_usd:.4f} and account usage ${account.usage_usd:.4f} have drifted ${self.drift_usd:+.4f} "
            f"apart (more than ${tolerance:.2f}) since the first reading (offset ${self.offset_usd:.4f})"
        )


def figures(account: Account | None, ledger: Figures) -> dict[str, Any]:
    return {"account": asdict(account) if account else None, "ledger": ledger.as_dict()}
