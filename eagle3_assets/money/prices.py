"""Prices from the API, not typed by hand, and checked against what the pilot was billed.

The worst case a reservation holds is the highest price among the provider endpoints the request's
routing allows (`only`, `ignore`, `quantizations`, `max_price`): OpenRouter may route to any of
them. The pilot's bills are then compared with what its tokens cost at the serving provider's
listed price; a disagreement beyond `price_tolerance` stops the run before the rest is sent (a
price list that is wrong makes every cap wrong).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from eagle3_assets.money.caps import Pricing
from eagle3_resources.completions.openrouter_account import OpenRouterAccount

PER_MILLION = 1e6


@dataclass(frozen=True)
class EndpointPrice:
    provider: str
    quantization: str | None
    prompt: float  # USD per token
    completion: float


@dataclass
class PriceSheet:
    """The prices a run may be billed at: the endpoints its routing allows (or one configured price)."""

    model: str
    endpoints: list[EndpointPrice]
    source: str
    excluded: list[str] = field(default_factory=list)

    def pricing(self) -> Pricing:
        if not self.endpoints:
            return Pricing(source=self.source)
        return Pricing(
            prompt=max(e.prompt for e in self.endpoints),
            completion=max(e.completion for e in self.endpoints),
            source=self.source,
        )

    def for_provider(self, provider: str | None) -> list[EndpointPrice]:
        name = _norm(provider or "")
        return [e for e in self.endpoints if _norm(e.provider) == name]

    def describe(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "source": self.source,
            "endpoints": [
                {
                    "provider": e.provider,
                    "quantization": e.quantization,
                    "usd_per_m_prompt": round(e.prompt * PER_MILLION, 6),
                    "usd_per_m_completion": round(e.completion * PER_MILLION, 6),
                }
                for e in self.endpoints
            ],
            "excluded_by_routing": self.excluded,
        }


def _usd(value: Any) -> float:
    return float(value or 0.0)


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _named(endpoint: dict[str, Any], names: set[str]) -> bool:
    """OpenRouter matches a provider by display name or slug, loosely; a base slug matches all its variants."""
    candidates = {_norm(str(endpoint.get("provider_name") or ""))}
    tag = str(endpoint.get("tag") or "")
    if tag:
        candidates |= {_norm(tag), _norm(tag.split("/")[0])}
    return bool(candidates & names)


def allowed(endpoints: list[dict[str, Any]], routing: dict[str, Any]) -> tuple[list[EndpointPrice], list[str]]:
    """The endpoints OpenRouter may route this request to, by its `provider` object; and those it may not."""
    only = {_norm(p) for p in routing.get("only") or []}
    ignore = {_norm(p) for p in routing.get("ignore") or []}
    order = {_norm(p) for p in routing.get("order") or []}
    quantizations = set(routing.get("quantizations") or [])
    max_price = routing.get("max_price") or {}
    keep, excluded = [], []
    for e in endpoints:
        name = str(e.get("provider_name") or "")
        price = EndpointPrice(
            name,
            e.get("quantization"),
            _usd((e.get("pricing") or {}).get("prompt")),
            _usd((e.get("pricing") or {}).get("completion")),
        )
        why = None
        if only and not _named(e, only):
            why = "not in only"
        elif ignore and _named(e, ignore):
            why = "ignored"
        elif order and routing.get("allow_fallbacks") is False and not _named(e, order):
            why = "not in order (no fallbacks)"
        elif (
            quantizations
            and price.quantization
            and price.quantization not in quantizations
            and not ("fp4" in quantizations and "fp4" in price.quantization)
        ):
            why = f"quantization {price.quantization}"
        elif max_price.get("prompt") is not None and price.prompt * PER_MILLION > max_price["prompt"] + 1e-12:
            why = "above max_price.prompt"
        elif (
            max_price.get("completion") is not None and price.completion * PER_MILLION > max_price["completion"] + 1e-12
        ):
            why = "above max_price.completion"
        if why:
            excluded.append(f"{name} ({price.quantization}): {why}")
        else:
            keep.append(price)
    return keep, excluded


async def fetch_prices(account: OpenRouterAccount, model: str, routing: dict[str, Any]) -> PriceSheet | None:
    """The model's price sheet under this routing, from the endpoint list (else the model list); None if the API has
    neither."""
    endpoints = await account.endpoints(model)
    if endpoints:
        keep, excluded = allowed(endpoints, routing)
        return PriceSheet(model, keep, f"{account.base_url}/models/{model}/endpoints", excluded)
    entry = await account.model(model)
    if entry and entry.get("pricing"):
        p = entry["pricing"]
        return PriceSheet(
            model,
            [EndpointPrice("*", None, _usd(p.get("prompt")), _usd(p.get("completion")))],
            f"{account.base_url}/models",
        )
    return None


def configured(model: str, usd_per_m_prompt: float, usd_per_m_completion: float) -> PriceSheet:
    return PriceSheet(
        model,
        [EndpointPrice("*", None, usd_per_m_prompt / PER_MILLION, usd_per_m_completion / PER_MILLION)],
        "run config (usd_per_m_prompt_tokens, usd_per_m_completion_tokens)",
    )


@dataclass
class PriceCheck:
    passed: bool
    problems: list[str]
    observed_usd: float
    expected_low_usd: float
    expected_high_usd: float

    def figures(self) -> dict[str, Any]:
        return {
            "observed_usd": round(self.observed_usd, 6),
            "expected_usd": [round(self.expected_low_usd, 6), round(self.expected_high_usd, 6)],
        }


def check_billed(frame: pl.DataFrame, sheet: PriceSheet, tolerance: float) -> PriceCheck:
    """Bills (cost_usd, with provider and token counts) against the sheet's prices of the provider that served each."""
    billed = frame.filter((pl.col("cost_usd") > 0) & pl.col("prompt_tokens").is_not_null())
    observed = lo = hi = 0.0
    problems: list[str] = []
    unknown: set[str] = set()
    for provider, prompt, completion, cost in billed.select(
        "provider", "prompt_tokens", "completion_tokens", "cost_usd"
    ).rows():
        prices = sheet.for_provider(provider) or ([e for e in sheet.endpoints if e.provider == "*"])
        if not prices:
            unknown.add(str(provider))
            continue
        costs = [prompt * e.prompt + (completion or 0) * e.completion for e in prices]
        observed += cost
        lo += min(costs)
        hi += max(costs)
    if unknown:
        problems.append(f"billed by provider(s) {sorted(unknown)} that the price list ({sheet.source}) does not allow")
    if observed and (observed > hi * (1 + tolerance) or observed < lo * (1 - tolerance)):
        problems.append(
            f"the pilot was billed ${observed:.6f}, its tokens cost ${lo:.6f}-${hi:.6f} at the listed prices "
            f"({sheet.source}): more than {tolerance:.0%} apart, so every cap would be priced wrong"
        )
    return PriceCheck(not problems, problems, observed, lo, hi)
