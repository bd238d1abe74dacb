"""The completions resource: which backend generates completions, and how to reach it."""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from functools import partial

import dagster as dg
from pydantic import Field

from eagle3_resources.completions.local import TransformersBackend
from eagle3_resources.completions.openrouter import OpenRouterBackend
from eagle3_resources.completions.openrouter_account import OpenRouterAccount
from eagle3_resources.completions.sglang import SGLangBackend
from eagle3_resources.completions.types import CompletionBackend
from eagle3_resources.env import setting, source
from eagle3_resources.tokenizer.kimi import KimiTokenizer

OPENROUTER_DEFAULT_URL = "https://openrouter.ai/api/v1"


class BackendKind(str, Enum):  # noqa: UP042  (StrEnum would change str() and f-strings of its members)
    LOCAL = "local"  # the target in-process with transformers (CPU default, stand-in)
    OPENROUTER = "openrouter"  # OpenRouter or any OpenAI-compatible chat completions API
    SGLANG = "sglang"  # an SGLang server's native /generate (returns token ids)


class CompletionsResource(dg.ConfigurableResource):
    """Where completions come from. Fields left unset are read from the environment at use time
    (EAGLE3_COMPLETIONS_BACKEND, OPENROUTER_BASE_URL, OPENROUTER_API_KEY, EAGLE3_SGLANG_URL), so a
    launchpad that sets only `concurrency` keeps the backend the environment chose."""

    backend: BackendKind | None = Field(
        default=None, description="local | openrouter | sglang (unset: $EAGLE3_COMPLETIONS_BACKEND, else local)"
    )
    openrouter_base_url: str | None = Field(
        default=None, description=f"unset: $OPENROUTER_BASE_URL, else {OPENROUTER_DEFAULT_URL}"
    )
    openrouter_api_key: str | None = Field(
        default=None, description="unset: $OPENROUTER_API_KEY (bound with EnvVar, never shown)"
    )
    sglang_url: str | None = Field(
        default=None, description="SGLang server base URL (unset: $EAGLE3_SGLANG_URL, else http://127.0.0.1:30000)"
    )
    sglang_api_key: str | None = Field(default=None, description="SGLang --api-key, if the server has one")
    concurrency: int = Field(default=256, description="requests in flight, at most (API backends; up to 2,000 tested)")
    openrouter_stream: bool = Field(
        default=True, description="SSE streaming (a stop cancels generation where supported)"
    )
    max_attempts: int = Field(
        default=6,
        description="attempts per request for retryable errors; then the prompt is deferred "
        "to the next materialization",
    )
    local_batch_size: int = Field(
        default=16,
        description="prompts per generate() call and lane (local backend); the stand-in on one thread decoded 16 "
        "prompts 17-29 % faster in one call than in two of 8 (A1, B4), 5 % slower for B8's thousand-token prompts",
    )
    local_lanes: int | None = Field(
        default=None,
        description="local backend on a CPU: processes generating side by side, one torch thread each (unset: one "
        "per CPU free at the start of each run; 1: this process only)",
    )

    def backend_kind(self) -> BackendKind:
        return BackendKind(setting(self.backend, "EAGLE3_COMPLETIONS_BACKEND", BackendKind.LOCAL, BackendKind))

    def sources(self) -> dict[str, str]:
        """Where each environment-backed setting came from (config, $VAR or default): for the run's metadata."""
        return {
            "backend": source(self.backend, "EAGLE3_COMPLETIONS_BACKEND"),
            "openrouter_base_url": source(self.openrouter_base_url, "OPENROUTER_BASE_URL"),
            "sglang_url": source(self.sglang_url, "EAGLE3_SGLANG_URL"),
        }

    def make_backend(
        self, tokenizer: KimiTokenizer, load_model: Callable[[], object], log: Callable[[str], None] | None = None
    ) -> CompletionBackend:
        kind = self.backend_kind()
        if kind is BackendKind.LOCAL:
            return TransformersBackend(
                load_model(), tokenizer, batch_size=self.local_batch_size, log=log, lanes=self.local_lanes
            )
        if kind is BackendKind.OPENROUTER:
            url, key = self._openrouter_endpoint()
            return OpenRouterBackend(
                url,
                key,
                concurrency=self.concurrency,
                max_attempts=self.max_attempts,
                stream=self.openrouter_stream,
            )
        return SGLangBackend(
            setting(self.sglang_url, "EAGLE3_SGLANG_URL", "http://127.0.0.1:30000"),
            tokenizer,
            concurrency=self.concurrency,
            max_attempts=self.max_attempts,
            api_key=self.sglang_api_key,
        )

    def make_account(self) -> Callable[[], OpenRouterAccount] | None:
        """The OpenRouter account's unbilled endpoints (prices, key, bills) with the backend's URL and key, as
        `OpenRouterBackend.account` makes them (`async with` each); None for a backend that bills nothing."""
        if self.backend_kind() is not BackendKind.OPENROUTER:
            return None
        url, key = self._openrouter_endpoint()
        return partial(OpenRouterAccount, url.rstrip("/"), key)

    def _openrouter_endpoint(self) -> tuple[str, str]:
        key = setting(self.openrouter_api_key, "OPENROUTER_API_KEY")
        if not key:
            raise ValueError("the openrouter backend needs OPENROUTER_API_KEY to be set")
        return setting(self.openrouter_base_url, "OPENROUTER_BASE_URL", OPENROUTER_DEFAULT_URL), key
