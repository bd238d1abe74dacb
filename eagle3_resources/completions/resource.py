"""The completions resource: which backend generates completions, and how to reach it."""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Optional

import dagster as dg
from pydantic import Field

from eagle3_resources.completions.local import TransformersBackend
from eagle3_resources.completions.openrouter import OpenRouterBackend
from eagle3_resources.completions.sglang import SGLangBackend
from eagle3_resources.completions.types import CompletionBackend
from eagle3_resources.tokenizer.kimi import KimiTokenizer

OPENROUTER_DEFAULT_URL = "https://openrouter.ai/api/v1"


class BackendKind(str, Enum):
    LOCAL = "local"  # the target in-process with transformers (CPU default, stand-in)
    OPENROUTER = "openrouter"  # OpenRouter or any OpenAI-compatible chat completions API
    SGLANG = "sglang"  # an SGLang server's native /generate (returns token ids)


class CompletionsResource(dg.ConfigurableResource):
    """Where completions come from. Choose with `EAGLE3_COMPLETIONS_BACKEND` or run config."""

    backend: BackendKind = Field(default=BackendKind.LOCAL, description="local | openrouter | sglang")
    openrouter_base_url: str = Field(default=OPENROUTER_DEFAULT_URL, description="OPENROUTER_BASE_URL")
    openrouter_api_key: Optional[str] = Field(default=None, description="OPENROUTER_API_KEY (bound with EnvVar, never shown)")
    sglang_url: str = Field(default="http://127.0.0.1:30000", description="SGLang server base URL (EAGLE3_SGLANG_URL)")
    sglang_api_key: Optional[str] = Field(default=None, description="SGLang --api-key, if the server has one")
    concurrency: int = Field(default=256, description="requests in flight, at most (API backends; up to 2,000 tested)")
    openrouter_stream: bool = Field(default=True, description="SSE streaming (a stop cancels generation where supported)")
    max_attempts: int = Field(default=6, description="attempts per request for retryable errors")
    local_batch_size: int = Field(default=8, description="prompts per generate() call (local backend)")

    def make_backend(self, tokenizer: KimiTokenizer, load_model: Callable[[], object]) -> CompletionBackend:
        if self.backend is BackendKind.LOCAL:
            return TransformersBackend(load_model(), tokenizer, batch_size=self.local_batch_size)
        if self.backend is BackendKind.OPENROUTER:
            if not self.openrouter_api_key:
                raise ValueError("the openrouter backend needs OPENROUTER_API_KEY to be set")
            return OpenRouterBackend(
                self.openrouter_base_url, self.openrouter_api_key, concurrency=self.concurrency, max_attempts=self.max_attempts,
                stream=self.openrouter_stream,
            )
        return SGLangBackend(
            self.sglang_url, tokenizer, concurrency=self.concurrency, max_attempts=self.max_attempts, api_key=self.sglang_api_key
        )
