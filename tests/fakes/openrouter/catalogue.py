"""The fake's model catalogue, endpoints with prices, and OpenRouter-style provider routing.

Shapes follow OpenRouter's API reference: `GET /api/v1/models` -> `{"data": [Model]}` (prices are
USD per token as strings) and `GET /api/v1/models/{author}/{slug}/endpoints` ->
`{"data": {"id", "name", ..., "endpoints": [PublicEndpoint]}}`.

Routing (the request's `provider` object): `only` / `ignore` match a provider's display name or
slug, case- and punctuation-insensitively, and a base slug matches all its variants
(`fireworks` matches `fireworks/fast`); `quantizations` is an allow-list where `fp4` covers the
fp4 family; `max_price` (USD per million tokens) drops endpoints advertised above it; `sort`
("price", or `{"by": "price"}`) puts the cheapest first; `order` puts the named providers first
and, unless `allow_fallbacks` is false, the others after them. The first endpoint left serves.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

SUPPORTED_PARAMETERS = [
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "reasoning",
    "include_reasoning",
    "tools",
    "tool_choice",
    "stop",
    "response_format",
]
FP4_FAMILY = {"fp4", "mxfp4", "nvfp4"}


@dataclass(frozen=True)
class Endpoint:
    provider_name: str
    quantization: str
    price_prompt: float  # USD per token, as advertised
    price_completion: float
    context_length: int
    max_completion_tokens: int | None = None

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-z0-9/]+", "", self.provider_name.lower())


def usd_string(x: float) -> str:
    """0.6e-6 -> "0.0000006" (OpenRouter's pricing strings, no exponent)."""
    text = format(Decimal(repr(float(x))), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def parse_endpoints(spec: str, settings: Any) -> list[Endpoint]:
    """`""`: one endpoint, `settings.provider` (int4) at the settings' prices; else a JSON list of
    {provider_name, quantization, price_prompt, price_completion[, context_length]}."""
    if not spec.strip():
        return [
            Endpoint(
                settings.provider, "int4", settings.price_prompt, settings.price_completion, settings.context_limit
            )
        ]
    out = []
    for e in json.loads(spec):
        out.append(
            Endpoint(
                provider_name=e["provider_name"],
                quantization=e.get("quantization", "int4"),
                price_prompt=float(e.get("price_prompt", settings.price_prompt)),
                price_completion=float(e.get("price_completion", settings.price_completion)),
                context_length=int(e.get("context_length", settings.context_limit)),
                max_completion_tokens=e.get("max_completion_tokens"),
            )
        )
    if not out:
        raise ValueError("endpoints: an empty list (leave the setting empty for the default endpoint)")
    return out


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9/]+", "", str(name).lower())


def matches(endpoint: Endpoint, name: str) -> bool:
    want, have = _norm(name), endpoint.slug
    return want == have or want == have.split("/")[0]


def _quantization_allowed(q: str, allowed: list[str]) -> bool:
    allowed = [a.lower() for a in allowed]
    return q.lower() in allowed or (q.lower() in FP4_FAMILY and "fp4" in allowed)


def route(
    endpoints: list[Endpoint], provider: dict[str, Any], *, legacy_names: set[str] | None = None
) -> list[Endpoint]:
    """The endpoints that may serve the request, best first (empty: 404 for the request).

    `legacy_names`: with the default single endpoint, an `only` naming any of these providers is
    still served by it (the fake's behaviour before endpoints were declarable)."""
    candidates = list(endpoints)
    only = provider.get("only")
    if only:
        if (
            legacy_names is not None
            and len(endpoints) == 1
            and {_norm(n) for n in only} & {_norm(n) for n in legacy_names}
        ):
            pass
        else:
            candidates = [e for e in candidates if any(matches(e, n) for n in only)]
    if provider.get("ignore"):
        candidates = [e for e in candidates if not any(matches(e, n) for n in provider["ignore"])]
    if provider.get("quantizations"):
        candidates = [e for e in candidates if _quantization_allowed(e.quantization, provider["quantizations"])]
    max_price = provider.get("max_price") or {}
    if max_price.get("prompt") is not None:
        candidates = [e for e in candidates if e.price_prompt * 1e6 <= float(max_price["prompt"]) * (1 + 1e-9)]
    if max_price.get("completion") is not None:
        candidates = [e for e in candidates if e.price_completion * 1e6 <= float(max_price["completion"]) * (1 + 1e-9)]
    sort = provider.get("sort")
    if isinstance(sort, dict):
        sort = sort.get("by")
    if sort == "price":
        candidates.sort(key=lambda e: e.price_prompt + e.price_completion)  # stable: ties keep their order
    order = provider.get("order") or []
    if order:
        first = [e for name in order for e in candidates if matches(e, name)]
        first = list(dict.fromkeys(first))
        rest = [e for e in candidates if e not in first]
        candidates = first + ([] if provider.get("allow_fallbacks") is False else rest)
    return candidates


def model_entry(model: str, ep: Endpoint, created: int) -> dict[str, Any]:
    author, _, slug = model.partition("/")
    return {
        "id": model,
        "canonical_slug": model,
        "name": f"{author}: {slug}",
        "created": created,
        "description": f"{model}, served by the fake OpenRouter",
        "context_length": ep.context_length,
        "architecture": {
            "modality": "text->text",
            "input_modalities": ["text"],
            "output_modalities": ["text"],
            "tokenizer": "Other",
            "instruct_type": None,
        },
        "pricing": {
            "prompt": usd_string(ep.price_prompt),
            "completion": usd_string(ep.price_completion),
            "request": "0",
            "image": "0",
            "web_search": "0",
            "internal_reasoning": "0",
        },
        "top_provider": {
            "context_length": ep.context_length,
            "max_completion_tokens": ep.max_completion_tokens,
            "is_moderated": False,
        },
        "per_request_limits": None,
        "supported_parameters": SUPPORTED_PARAMETERS,
    }


def endpoint_entry(model: str, ep: Endpoint) -> dict[str, Any]:
    return {
        "name": f"{ep.provider_name} | {model}",
        "model_id": model,
        "model_name": model,
        "context_length": ep.context_length,
        "pricing": {
            "prompt": usd_string(ep.price_prompt),
            "completion": usd_string(ep.price_completion),
            "request": "0",
            "image": "0",
        },
        "provider_name": ep.provider_name,
        "tag": f"{ep.slug}/{ep.quantization}",
        "quantization": ep.quantization,
        "max_completion_tokens": ep.max_completion_tokens,
        "max_prompt_tokens": None,
        "supported_parameters": SUPPORTED_PARAMETERS,
        "status": 0,
        "uptime_last_30m": 100.0,
        "supports_implicit_caching": False,
        "latency_last_30m": None,
        "throughput_last_30m": None,
    }
