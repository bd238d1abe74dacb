"""OpenRouter's unbilled endpoints: the key, generation look-ups, the model catalogue and its prices.

    GET /api/v1/key                                   usage, limit_remaining (a normal key works)
    GET /api/v1/generation?id=gen-...                 what one generation cost (404 for a while after it ends)
    GET /api/v1/generation/content?id=gen-...         its stored prompt and completion (with input/output logging on)
    GET /api/v1/models                                every model with its `pricing` (USD per token, as strings)
    GET /api/v1/models/{author}/{slug}/endpoints      each provider endpoint of a model, with its own pricing

Used before a run fans out (a revoked key stops it before the first paid request), to price
admission, and to settle generations whose bill the response did not carry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from eagle3_resources.errors import AccountError


@dataclass(frozen=True)
class GenerationBill:
    """What the provider says one generation cost."""

    cost_usd: float
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    cancelled: bool | None = None
    provider: str | None = None


@dataclass(frozen=True)
class KeyInfo:
    usage_usd: float
    limit_usd: float | None
    limit_remaining_usd: float | None
    label: str | None = None


def _message(resp: httpx.Response) -> str:
    try:
        err = resp.json().get("error")
        if isinstance(err, dict):
            return str(err.get("message") or resp.reason_phrase)
    except ValueError:
        pass
    return resp.reason_phrase or f"HTTP {resp.status_code}"


class OpenRouterAccount:
    """An async client for the account endpoints; `async with` it for the duration of a run or a tick."""

    def __init__(self, base_url: str, api_key: str, *, timeout_s: float = 30.0):
        self.base_url = base_url.rstrip("/")
        self._api_key = api_key
        self.timeout_s = timeout_s
        self._client: httpx.AsyncClient | None = None

    async def __aenter__(self) -> OpenRouterAccount:
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {self._api_key}"},
            timeout=self.timeout_s,
            limits=httpx.Limits(max_connections=32),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _get(self, path: str, **params: str) -> httpx.Response:
        assert self._client is not None, "use `async with OpenRouterAccount(...)`"
        return await self._client.get(path, params=params or None)

    async def key(self) -> KeyInfo:
        resp = await self._get("/key")
        if resp.status_code != 200:
            raise AccountError(resp.status_code, _message(resp))
        data = resp.json().get("data") or {}
        return KeyInfo(
            usage_usd=float(data.get("usage") or 0.0),
            limit_usd=data.get("limit"),
            limit_remaining_usd=data.get("limit_remaining"),
            label=data.get("label"),
        )

    async def generation(self, generation_id: str) -> GenerationBill | None:
        """The bill of a generation, or None while OpenRouter does not know it (404) or cannot say (429, 5xx,
        network)."""
        try:
            resp = await self._get("/generation", id=generation_id)
        except httpx.TransportError:
            return None
        if resp.status_code != 200:
            if resp.status_code in (401, 403):
                raise AccountError(resp.status_code, _message(resp))
            return None
        d = resp.json().get("data") or {}
        return GenerationBill(
            cost_usd=float(d.get("total_cost") or 0.0),
            prompt_tokens=d.get("native_tokens_prompt", d.get("tokens_prompt")),
            completion_tokens=d.get("native_tokens_completion", d.get("tokens_completion")),
            finish_reason=d.get("finish_reason"),
            cancelled=d.get("cancelled"),
            provider=d.get("provider_name"),
        )

    async def generation_content(self, generation_id: str) -> tuple[str, str] | None:
        """(reasoning, content) of a finished generation, where OpenRouter stored them (the account's logging); else
        None."""
        try:
            resp = await self._get("/generation/content", id=generation_id)
        except httpx.TransportError:
            return None
        if resp.status_code != 200:
            return None
        output = (resp.json().get("data") or {}).get("output") or {}
        if not isinstance(output, dict) or output.get("completion") is None:
            return None
        return str(output.get("reasoning") or ""), str(output["completion"])

    async def model(self, model: str) -> dict[str, Any] | None:
        """The model's catalogue entry (with `pricing`), or None if the API has no catalogue or not this model."""
        resp = await self._get("/models")
        if resp.status_code != 200:
            return None
        return next((m for m in resp.json().get("data") or [] if m.get("id") == model), None)

    async def endpoints(self, model: str) -> list[dict[str, Any]] | None:
        """Every provider endpoint serving the model, with its pricing; None where the API has no such list."""
        resp = await self._get(f"/models/{model}/endpoints")
        if resp.status_code != 200:
            return None
        return (resp.json().get("data") or {}).get("endpoints")
