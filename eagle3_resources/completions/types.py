"""What goes into a completion backend and what comes out, whatever the backend."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import dagster as dg
from pydantic import Field

# FP4-class endpoints re-quantize Kimi's INT4 experts and produce different tokens.
KIMI_QUANTIZATIONS = ["int4", "int8", "fp8", "fp16", "bf16", "fp32"]


class MaxPrice(dg.Config):
    """OpenRouter's `provider.max_price`, in USD per million tokens."""

    prompt: float | None = Field(default=None, description="USD per million prompt tokens, at most")
    completion: float | None = Field(default=None, description="USD per million completion tokens, at most")


class ProviderRouting(dg.Config):
    """OpenRouter's `provider` routing object (only the fields that are set are sent)."""

    order: list[str] | None = Field(default=None, description="providers to try, in order")
    only: list[str] | None = Field(default=None, description="allow-list of providers")
    ignore: list[str] | None = Field(default=None, description="providers never to use")
    quantizations: list[str] | None = Field(
        default_factory=lambda: list(KIMI_QUANTIZATIONS),
        description="allow-list of endpoint quantizations; the default excludes the fp4 family",
    )
    allow_fallbacks: bool | None = Field(default=None, description="OpenRouter's default is true")
    require_parameters: bool | None = Field(default=True, description="only endpoints that honour every parameter sent")
    data_collection: str | None = Field(default=None, description='"allow" or "deny"')
    sort: str | None = Field(
        default=None, description='"price", "throughput" or "latency": the order endpoints are tried in'
    )
    max_price: MaxPrice | None = Field(
        default=None,
        description="OpenRouter never routes to an endpoint priced above "
        "this; admission uses it as the worst case when it is lower than the price list",
    )

    def to_request(self) -> dict:
        out = {k: v for k, v in self.model_dump().items() if v is not None}
        if self.max_price is not None:
            out["max_price"] = {k: v for k, v in self.max_price.model_dump().items() if v is not None}
        return out


class SamplingSettings(dg.Config):
    """Request settings of one run; recorded with every materialization."""

    model: str = Field(default="moonshotai/kimi-k2.5", description="model slug (OpenRouter) or served model name")
    max_tokens: int = Field(default=160, description="completion token cap per request (reasoning included)")
    temperature: float = Field(default=1.0, description="Moonshot recommends 1.0 in thinking mode")
    top_p: float = Field(default=0.95, description="Moonshot recommends 0.95 in thinking mode")
    top_k: int | None = Field(default=None, description="top-k cut, where the backend supports it")
    seed: int | None = Field(default=0, description="sampling seed, forwarded where supported")
    reasoning_effort: str | None = Field(
        default=None, description="OpenRouter reasoning.effort (low/medium/high); unset = provider default"
    )
    provider: ProviderRouting = Field(default_factory=ProviderRouting, description="OpenRouter provider routing")
    send_tools: bool = Field(
        default=True,
        description="send tools in the request's tools field (the prompt then declares "
        "them); false: no tools field, no declaration, tool calls come back as raw markers",
    )


@dataclass
class CompletionRequest:
    prompt_id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    prompt_ids: list[int]  # the prompt as the target sees it, rendered by our chat format
    tools_in_request: str = "none"  # tools_field | omitted (the prompt had tools, none were sent) | none


@dataclass
class CompletionResult:
    prompt_id: str
    # Final outcomes: ok | truncated (finish length) | filtered (content_filter) | failed (see error).
    # "aborted": never completed because the run stopped; such a prompt is sent again on resume.
    status: str
    finish_reason: str | None = None  # stop | length | tool_calls | content_filter | error
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] | None = None
    completion_ids: list[int] | None = None  # ids the backend itself reported (local, SGLang)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    reasoning_tokens: int | None = None
    cost_usd: float = 0.0
    generation_id: str | None = None
    provider: str | None = None
    model: str | None = None
    latency_s: float = 0.0
    attempts: int = 1
    error: str | None = None
    error_code: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    attempt_id: str | None = None  # the ledger attempt that produced this result
    billed: bool = False  # the response carried its bill (usage.cost)

    def to_record(self) -> dict[str, Any]:
        return asdict(self)


FINAL_STATUSES = ("ok", "truncated", "filtered", "failed")
# Not final, sent again by a later materialization: "aborted" (the run stopped), "deferred" (retryable
# errors used up the attempts, or an earlier attempt's bill is still outstanding).
RETRY_LATER_STATUSES = ("aborted", "deferred")


@dataclass
class Attempt:
    """One admitted try at a request: reserved in the spend ledger just before it is sent, its send marked there
    first."""

    request: CompletionRequest
    attempt_id: str
    number: int
    generation_id: str | None = None
    sent: bool = (
        False  # its send is marked (the ledger's `sending`): bytes may have left, from here on it may be billed
    )
    outcome: str | None = None  # settled | released | unsettled | unidentified, once it has ended


@dataclass(frozen=True)
class Refusal:
    """Why a retry was not admitted; `status` is the request's result status (aborted or deferred)."""

    status: str
    reason: str


class RequestFeed(Protocol):
    """Admission and the money side of every attempt (eagle3_assets.money.admission.Admission).

    A backend takes a request's first attempt with `take`, and every further attempt with `retry`
    (which passes admission, the caps and the hold again), each once it is ready to send (after its
    pacing: the reservation is taken just before the send); a paid backend awaits `sending` before
    the first byte of an attempt leaves (a crash then releases only what was never sent). Each
    attempt ends with exactly one of `billed` (the response carried its cost) or `unbilled` (no
    bill: `generated=False` when nothing can have been generated, None when unknown).
    """

    async def take(self, wait: bool = True) -> Attempt | None: ...

    async def retry(
        self, previous: Attempt, why: str, pace: Callable[[], Awaitable[Any]] | None = None
    ) -> Attempt | Refusal: ...

    async def sending(self, attempt: Attempt) -> None: ...

    def started(self, attempt: Attempt, generation_id: str) -> None: ...

    def billed(
        self, attempt: Attempt, *, cost_usd: float, prompt_tokens: int | None, completion_tokens: int | None
    ) -> None: ...

    def unbilled(self, attempt: Attempt, *, generated: bool | None, why: str) -> None: ...


Emit = Callable[[CompletionResult], None]


class CompletionBackend(Protocol):
    """Pulls attempts from `feed` until it is empty or closed, and emits one result per request."""

    name: str

    async def run(self, feed: RequestFeed, settings: SamplingSettings, emit: Emit) -> None: ...

    def describe(self) -> dict[str, Any]: ...
