"""A fake OpenRouter on loopback, reproducing the behaviours the client must survive.

It is an independent oracle: it imports nothing from the rest of the project. It counts tokens
with its own Kimi tokenizer (`encoding.py`, built from the tokenizer folder it is given) and
renders prompts with its own reading of Kimi's chat template (`template.py`), so a test that
compares the project's reconstruction with this bill can fail.

What it does, each a setting (`FakeSettings`; every one is also a CLI flag):
- chat completions, streaming (SSE with `: OPENROUTER PROCESSING` keep-alives, a role chunk,
  reasoning and content deltas, a finish chunk, a separate usage chunk, `[DONE]`) or not;
- `prompt_tokens` = Kimi's encoding, special tokens allowed, of the request's `messages` and
  `tools` rendered with the `template_version` ("k2.5": TypeScript-style tool declaration, "k2":
  compact deep-sorted JSON) and `thinking` (the prompt ends in `<think>`, or `<think></think>`);
  `prompt_token_offset` is added when the request has tools (a provider whose template differs);
- reasoning and content made of whole words (WORDS), and `completion_tokens` =
  len(enc(reasoning)) + 1 (`</think>`) + len(enc(content)) + 1 (`<|im_end|>`) (no reasoning and no
  `</think>` with thinking off); `finish_reason` `length` at `max_tokens`, cut at whole tokens;
- tool calls, as Kimi answers a request that declares `tools` (`rate_tool_calls` of them): reasoning,
  no content, `message.tool_calls` [{id `functions.{name}:{i}`, type `function`, function {name,
  arguments (a JSON string)}}] (`tool_calls_per_answer` calls to the request's first tool; streamed
  as `delta.tool_calls` chunks: id and name first, then the arguments in pieces), `finish_reason`
  `tool_calls`; billed as generated: enc(reasoning) + `</think>` + `<|tool_calls_section_begin|>` and per
  call `<|tool_call_begin|>` enc(id) `<|tool_call_argument_begin|>` enc(arguments) `<|tool_call_end|>`,
  then `<|tool_calls_section_end|>` `<|im_end|>`, or without the `</think>` for `rate_implicit_think_end`
  of them (the reasoning ended by the section itself); an answer that would not fit `max_tokens` is
  a text answer instead; `completion_token_offset` is added to every nonzero completion count (a
  provider that counts completions otherwise);
- `gen-...` ids in the body and the `X-Generation-Id` header;
- faults at configurable rates: 429 with `Retry-After` (and periodic 429 storms), 503, 408, 500,
  errors inside HTTP 200 and mid-stream, connection resets, truncated bodies and streams,
  `content_filter`, `finish_reason: error`, empty completions; 401 for a wrong key; 400 beyond the
  endpoint's context; 402 when the credit runs out; the in-flight 402 (with Retry-After) when the
  worst-case cost of running requests exceeds the remaining credit;
- a requests-per-second cap (`max_rps` per fixed `rate_window_s` window): beyond it 429
  "Rate limit exceeded" with `X-RateLimit-Limit`, `X-RateLimit-Remaining: 0`, `X-RateLimit-Reset`
  (epoch milliseconds) and, only with `rate_limit_retry_after`, `Retry-After`; accepted requests
  carry the same three headers;
- a model catalogue (`models`) at `/api/v1/models` and per-model endpoints at
  `/api/v1/models/{author}/{slug}/endpoints` (`endpoints`: empty = one `provider` endpoint, int4,
  at `price_prompt`/`price_completion`; or a JSON list of {provider_name, quantization,
  price_prompt, price_completion}); requests are routed by their `provider` object (only, ignore,
  quantizations, order, allow_fallbacks, sort, max_price; nothing left: 404); the response's
  `provider` is the serving endpoint, billed at its prices times `billed_price_factor` (a provider
  that bills other than it advertises). With the default single endpoint, `only` naming any of
  KNOWN_PROVIDERS is served by it (unknown names: 404);
- billing like OpenRouter's: a non-streaming request is finished and billed even after its
  client disconnects ("after_disconnect"); a stream the client abandons is billed for the tokens
  sent ("aborted_stream"), or, with `late_bill_s` > 0, the provider keeps generating and the FULL
  completion is billed `late_bill_s` seconds after the disconnect ("late"; /generation says 404
  until then); failed generations (an error inside HTTP 200, `finish_reason: error`, an empty
  completion) get a zero-cost record ("failed") that /generation finds; `rate_never_found` of the
  generations are billed but /generation never finds them;
- `/api/v1/key` (usage, `usage_daily`... and `limit_remaining`, lagging by `key_lag_s`, once
  non-monotonic, and rising by itself at `foreign_spend_usd_per_s`: another app on the same key,
  which also eats the credit), `/api/v1/credits` (management key only),
  `/api/v1/generation?id=` (404 for `generation_404_s` after the bill), and
  `/api/v1/generation/content?id=` (a finished answer's stored prompt and completion; 404 with
  `store_content` off, as when the account's input/output logging is off).
`/_fake/stats` says what it has received, is generating (with the attempt ids) and has answered, for
a test that drives it in another process. Every request body is kept in `billing.requests`, with
its `X-Eagle3-Attempt` header and prompt key (`json.dumps(messages, sort_keys=True)`) in
`billing.request_info`; everything billed is in `billing.bills` (each bill with its attempt and
prompt key too) and printed as JSON lines with `--log-billing`.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from aiohttp import web

from fakes.openrouter.catalogue import (
    Endpoint,
    endpoint_entry,
    model_entry,
    parse_endpoints,
    route,
)
from fakes.openrouter.encoding import load_encoding
from fakes.openrouter.template import render_prompt

KNOWN_PROVIDERS = {"FakeProvider", "Moonshot AI", "Fireworks", "Together", "Baseten"}
WORDS = (
    "the model thinks about each step before it answers so the reply stays short clear and correct "
    "first we check the question then we compute the result and finally we explain why it holds "
    "数据 模型 推理 答案 检查 步骤 结果 清楚 简短"
).split()
ATTEMPT_HEADER = "X-Eagle3-Attempt"
RATE_HEADERS = web.RequestKey("rate_limit_headers", dict)


@dataclass
class FakeSettings:
    api_key: str = "fake-key"
    management_key: str = "fake-management-key"
    price_prompt: float = 0.60e-6  # USD per token
    price_completion: float = 2.50e-6
    latency_s: float = 0.0  # before the first byte
    chunk_latency_s: float = 0.0  # between streamed chunks
    mean_reasoning_words: int = 40
    mean_content_words: int = 25
    retry_after_s: float = 0.2
    rate_429: float = 0.0
    storm_every_s: float = 0.0  # every N seconds ...
    storm_len_s: float = 0.0  # ... every request 429s for this long
    rate_503: float = 0.0
    rate_408: float = 0.0
    rate_500: float = 0.0
    rate_reset: float = 0.0
    rate_truncate: float = 0.0
    rate_error_200: float = 0.0
    rate_error_midstream: float = 0.0
    rate_content_filter: float = 0.0
    rate_finish_error: float = 0.0
    rate_empty: float = 0.0
    credit_usd: float = float("inf")
    prompt_token_offset: int = 0  # a provider whose template differs from ours (e.g. tools declared another way)
    context_limit: int = 262144  # prompt + max_tokens beyond it: 400, as for a too-long context
    key_lag_s: float = 0.0
    nonmonotonic_on_key_call: int = 3  # that /key call reports usage lower than the previous one
    refund_usd: float = 3.68
    generation_404_s: float = 0.5
    seed: int = 0
    provider: str = "FakeProvider"
    template_version: str = "k2.5"  # "k2.5" (TypeScript tool declaration) or "k2" (JSON)
    thinking: bool = True  # the prompt ends in <think>; off: <think></think> and no reasoning
    late_bill_s: float = 0.0  # > 0: an abandoned stream is billed in full this long after the disconnect
    store_content: bool = True  # /generation/content serves finished answers (OpenRouter's input/output logging on)
    rate_never_found: float = 0.0  # share of generations /generation never finds (billed all the same)
    foreign_spend_usd_per_s: float = 0.0  # another app spending on the same key
    max_rps: float = 0.0  # chat requests per second accepted (0: no cap) ...
    rate_window_s: float = 1.0  # ... counted in fixed windows of this length
    rate_limit_retry_after: bool = False  # the rate-limit 429 also carries Retry-After
    models: str = "moonshotai/kimi-k2.5,moonshotai/kimi-k2-thinking"  # the catalogue (comma-separated)
    endpoints: str = ""  # JSON list of {provider_name, quantization, price_prompt, price_completion}; "" = `provider`
    billed_price_factor: float = 1.0  # what an endpoint bills, relative to what it advertises
    rate_tool_calls: float = 0.0  # share of requests with `tools` answered with tool calls (finish "tool_calls")
    tool_calls_per_answer: int = 1  # calls in such an answer, each to the request's first tool
    rate_implicit_think_end: float = 0.0  # share of tool-call answers with no </think> (billed without it)
    completion_token_offset: int = 0  # added to every nonzero completion_tokens (a provider that counts otherwise)


@dataclass
class Bill:
    id: str
    prompt_tokens: int
    completion_tokens: int
    cost: float
    finish_reason: str | None
    t_done: float
    kind: str  # complete | aborted_stream | after_disconnect | late | failed
    attempt: str | None = None  # the request's X-Eagle3-Attempt header
    prompt_key: str = ""  # json.dumps(messages, sort_keys=True)
    provider: str = ""
    never_found: bool = False  # /generation answers 404 for it forever


@dataclass
class RequestInfo:
    attempt: str | None
    prompt_key: str
    t: float
    generation_id: str | None = None


@dataclass
class Billing:
    requests: list[dict[str, Any]] = field(default_factory=list)
    request_info: list[RequestInfo] = field(default_factory=list)  # one per entry of `requests`
    bills: list[Bill] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)
    late_pending: dict[str, float] = field(default_factory=dict)  # generation id -> when its late bill posts

    @property
    def total_usd(self) -> float:
        return sum(b.cost for b in self.bills)

    def billed_ids(self) -> set[str]:
        return {b.id for b in self.bills}

    def bills_for(self, messages: list[dict[str, Any]]) -> list[Bill]:
        key = prompt_key(messages)
        return [b for b in self.bills if b.prompt_key == key]


def prompt_key(messages: Any) -> str:
    return json.dumps(messages, sort_keys=True)


@dataclass
class _Gen:
    """One generation: who asked, where it runs, what it costs per token."""

    id: str
    attempt: str | None
    prompt_key: str
    endpoint: Endpoint
    price_prompt: float  # billed, USD per token
    price_completion: float
    never_found: bool
    model: Any
    answer: tuple[str, str] = ("", "")  # (reasoning, content) as generated: what /generation/content returns
    tool_calls: list[dict[str, Any]] | None = None  # as answered (message.tool_calls)
    think_end: bool = True  # whether the reasoning ended with </think> (False: implicitly, by the tool calls)


@dataclass(frozen=True)
class Generated:
    """What one generation answered, as the provider generated it (for a test's expected ids)."""

    reasoning: str
    content: str
    tool_calls: list[dict[str, Any]] | None
    think_end: bool  # False: the reasoning ended implicitly (no </think> generated nor billed)


class _Answer:
    def __init__(self, reasoning: str, content: str, r_ids: list[int], c_ids: list[int]):
        self.reasoning, self.content, self.r_ids, self.c_ids = reasoning, content, r_ids, c_ids


class FakeOpenRouter:
    url: str  # where it is served: set by the test that starts its server (ServerThread)

    def __init__(self, tokenizer: Any, settings: FakeSettings | None = None, log_billing=None):
        """`tokenizer`: a Kimi tokenizer folder, or any object with a `.folder` (attribute or method)."""
        self.encoding = load_encoding(tokenizer)
        self.tokenizer = tokenizer
        self.settings = settings or FakeSettings()
        self.billing = Billing()
        self.rng = random.Random(self.settings.seed)
        self.started = time.monotonic()
        self.inflight_worst: dict[str, float] = {}
        self.key_calls = 0
        self._log_billing = log_billing
        self._by_id: dict[str, Bill] = {}
        self._gens: dict[str, _Gen] = {}
        self._window = (-1, 0)  # (window index, requests accepted in it)
        self._endpoints_cache: tuple[tuple, list[Endpoint]] | None = None
        self.app = web.Application()
        self.app.on_response_prepare.append(self._extra_headers)
        self.app.router.add_post("/api/v1/chat/completions", self.chat_completions)
        self.app.router.add_get("/api/v1/key", self.key)
        self.app.router.add_get("/api/v1/credits", self.credits)
        self.app.router.add_get("/api/v1/generation", self.generation)
        self.app.router.add_get("/api/v1/generation/content", self.generation_content)
        self.app.router.add_get("/api/v1/models", self.models)
        self.app.router.add_get("/api/v1/models/{author}/{slug}/endpoints", self.model_endpoints)
        self.app.router.add_get("/_fake/stats", self.stats)

    # -- helpers ---------------------------------------------------------------------------

    def _authorized(self, request: web.Request, key: str) -> bool:
        return request.headers.get("Authorization") == f"Bearer {key}"

    def _error(self, status: int, message: str, headers: dict[str, str] | None = None, **extra) -> web.Response:
        self.billing.statuses.append(status)
        return web.json_response(
            {"error": {"code": status, "message": message, **extra}}, status=status, headers=headers
        )

    def _roll(self, rate: float) -> bool:
        return rate > 0 and self.rng.random() < rate

    def _in_storm(self) -> bool:
        s = self.settings
        if not (s.storm_every_s and s.storm_len_s):
            return False
        return (time.monotonic() - self.started) % s.storm_every_s < s.storm_len_s

    @staticmethod
    async def _extra_headers(request: web.Request, response: web.StreamResponse) -> None:
        for k, v in (request.get(RATE_HEADERS) or {}).items():
            response.headers.setdefault(k, v)

    def endpoints(self) -> list[Endpoint]:
        s = self.settings
        key = (s.endpoints, s.provider, s.price_prompt, s.price_completion, s.context_limit)
        if self._endpoints_cache is None or self._endpoints_cache[0] != key:
            self._endpoints_cache = (key, parse_endpoints(s.endpoints, s))
        return self._endpoints_cache[1]

    def model_ids(self) -> list[str]:
        return [m.strip() for m in self.settings.models.split(",") if m.strip()]

    def count_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
        """The provider's `prompt_tokens` for these messages and tools (before `prompt_token_offset`)."""
        s = self.settings
        text = render_prompt(messages, tools, version=s.template_version, thinking=s.thinking)
        return self.encoding.count(text, specials=True)

    def _answer(self, seed: int) -> _Answer:
        rng = random.Random(seed)
        s = self.settings

        def text(n: int) -> str:
            words = [rng.choice(WORDS) for _ in range(max(1, int(rng.gauss(n, n / 4))))]
            return " ".join(words).capitalize() + "."

        reasoning, content = text(s.mean_reasoning_words), text(s.mean_content_words)
        if not s.thinking:
            reasoning = ""
        return _Answer(reasoning, content, self.encoding.encode(reasoning), self.encoding.encode(content))

    def _tool_calls(self, seed: int, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`tool_calls_per_answer` calls to the first declared tool, arguments of whole words for its first
        parameter (`query` if it declares none), ids as Kimi writes them: `functions.{name}:{i}`."""
        rng = random.Random(seed)
        fn = tools[0].get("function") or {}
        name = str(fn.get("name") or "tool")
        params = list((fn.get("parameters") or {}).get("properties") or {})
        key = params[0] if params else "query"
        calls = []
        for i in range(max(1, self.settings.tool_calls_per_answer)):
            value = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))
            arguments = json.dumps({key: value}, ensure_ascii=False)
            calls.append(
                {"id": f"functions.{name}:{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
            )
        return calls

    def _section_tokens(self, calls: list[dict[str, Any]]) -> int:
        """Tokens of the tool-call section Kimi generates for `calls` (markers are single special tokens)."""
        text = "<|tool_calls_section_begin|>"
        for call in calls:
            text += f"<|tool_call_begin|>{call['id']}<|tool_call_argument_begin|>{call['function']['arguments']}"
            text += "<|tool_call_end|>"
        return self.encoding.count(text + "<|tool_calls_section_end|>", specials=True)

    def generated(self, generation_id: str) -> Generated:
        """What a generation answered (KeyError for an id it never generated)."""
        gen = self._gens[generation_id]
        return Generated(gen.answer[0], gen.answer[1], gen.tool_calls, gen.think_end)

    def _bill(self, gen: _Gen, prompt_tokens: int, completion_tokens: int, finish: str | None, kind: str) -> Bill:
        cost = 0.0 if kind == "failed" else prompt_tokens * gen.price_prompt + completion_tokens * gen.price_completion
        bill = Bill(
            gen.id,
            prompt_tokens,
            completion_tokens,
            cost,
            finish,
            time.monotonic(),
            kind,
            gen.attempt,
            gen.prompt_key,
            gen.endpoint.provider_name,
            gen.never_found,
        )
        self.billing.bills.append(bill)
        self._by_id[bill.id] = bill
        if self._log_billing:
            self._log_billing(asdict(bill))
        return bill

    def _bill_late(self, gen: _Gen, usage: dict[str, Any], finish: str | None) -> None:
        """The client left mid-stream; the provider finishes the answer and posts its bill later."""
        delay = self.settings.late_bill_s
        self.billing.late_pending[gen.id] = time.monotonic() + delay

        def post() -> None:
            self.billing.late_pending.pop(gen.id, None)
            failed = usage["completion_tokens"] == 0 and finish in (None, "error")
            self._bill(gen, usage["prompt_tokens"], usage["completion_tokens"], finish, "failed" if failed else "late")

        asyncio.get_running_loop().call_later(delay, post)

    def _foreign(self, at: float) -> float:
        return self.settings.foreign_spend_usd_per_s * max(0.0, at - self.started)

    def _usage(self, lagged: bool) -> float:
        cutoff = time.monotonic() - (self.settings.key_lag_s if lagged else 0.0)
        return sum(b.cost for b in self.billing.bills if b.t_done <= cutoff) + self._foreign(cutoff)

    def _rate_limit(self) -> tuple[bool, dict[str, str]]:
        """Fixed-window request cap: (accepted, the X-RateLimit-* headers to send)."""
        s = self.settings
        if s.max_rps <= 0:
            return True, {}
        window = s.rate_window_s if s.rate_window_s > 0 else 1.0
        limit = max(1, int(s.max_rps * window + 1e-9))
        now = time.time()
        index = math.floor(now / window)
        if self._window[0] != index:
            self._window = (index, 0)
        ends = (index + 1) * window
        headers = {"X-RateLimit-Limit": str(limit), "X-RateLimit-Reset": str(int(round(ends * 1000)))}
        if self._window[1] >= limit:
            headers["X-RateLimit-Remaining"] = "0"
            if s.rate_limit_retry_after:
                headers["Retry-After"] = str(max(1, math.ceil(ends - now)))
            return False, headers
        self._window = (index, self._window[1] + 1)
        headers["X-RateLimit-Remaining"] = str(limit - self._window[1])
        return True, headers

    # -- chat completions --------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        s = self.settings
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return self._error(400, "invalid JSON body")
        if not isinstance(body, dict):
            return self._error(400, "the body must be a JSON object")
        messages = body.get("messages") or []
        info = RequestInfo(request.headers.get(ATTEMPT_HEADER), prompt_key(messages), time.monotonic())
        self.billing.requests.append(body)
        self.billing.request_info.append(info)
        if not self._authorized(request, s.api_key):
            return self._error(401, "No auth credentials found")
        accepted, rate_headers = self._rate_limit()
        if not accepted:
            return self._error(
                429,
                f"Rate limit exceeded: {rate_headers['X-RateLimit-Limit']} requests per {s.rate_window_s:g} s",
                rate_headers,
            )
        request[RATE_HEADERS] = rate_headers
        candidates = route(
            self.endpoints(),
            body.get("provider") or {},
            legacy_names=KNOWN_PROVIDERS if not s.endpoints.strip() else None,
        )
        if not candidates:
            return self._error(404, "No endpoints found matching your data policy and provider filters")
        endpoint = candidates[0]
        try:
            prompt_tokens = self.count_prompt(messages, body.get("tools"))
        except (AttributeError, TypeError, ValueError, KeyError) as e:
            return self._error(400, f"invalid messages or tools: {e}")
        if body.get("tools"):
            prompt_tokens += s.prompt_token_offset
        max_tokens = int(body.get("max_tokens") or 1 << 30)
        if prompt_tokens + min(max_tokens, 1 << 30) > endpoint.context_length and body.get("max_tokens"):
            return self._error(400, f"This endpoint's maximum context length is {endpoint.context_length} tokens")
        price_prompt = endpoint.price_prompt * s.billed_price_factor
        price_completion = endpoint.price_completion * s.billed_price_factor
        worst = prompt_tokens * price_prompt + max_tokens * price_completion
        if s.credit_usd != float("inf"):  # (sums over every bill: skipped when there is no limit, as in the benchmark)
            remaining = s.credit_usd - self.billing.total_usd - self._foreign(time.monotonic())
            if remaining <= 0:
                return self._error(402, "Insufficient credits. Add more using https://openrouter.ai/credits")
            if sum(self.inflight_worst.values()) + worst > remaining:
                return self._error(
                    402, "Request cost exceeds the remaining in-flight budget", {"Retry-After": f"{s.retry_after_s}"}
                )
        if self._in_storm() or self._roll(s.rate_429):
            return self._error(
                429, "Provider returned error: rate limited upstream", {"Retry-After": f"{s.retry_after_s}"}
            )
        if self._roll(s.rate_503):
            return self._error(503, "No available provider", {"Retry-After": f"{s.retry_after_s}"})
        if self._roll(s.rate_408):
            return self._error(408, "Request timed out upstream")
        if self._roll(s.rate_500):
            return self._error(500, "Internal Server Error")
        if self._roll(s.rate_reset):
            assert request.transport is not None  # a request being handled has its connection
            request.transport.abort()
            self.billing.statuses.append(0)
            return web.Response(status=500)

        gen = _Gen(
            f"gen-{uuid.uuid4().hex[:24]}",
            info.attempt,
            info.prompt_key,
            endpoint,
            price_prompt,
            price_completion,
            self._roll(s.rate_never_found),
            body.get("model"),
        )
        info.generation_id = gen.id
        self.inflight_worst[gen.id] = worst
        try:
            answer = self._answer(self.rng.randrange(1 << 30))
            finish: str | None = "stop"
            if self._roll(s.rate_content_filter):
                finish = "content_filter"
            elif self._roll(s.rate_finish_error):
                finish = "error"
            elif self._roll(s.rate_empty):
                answer = _Answer("", "", [], [])
                finish = None
            separator = 1 if s.thinking else 0  # </think> (with thinking off it is in the prompt)
            reasoning, content = answer.reasoning, answer.content
            completion_tokens = len(answer.r_ids) + separator + len(answer.c_ids) + 1
            tool_calls = None
            if finish == "stop" and body.get("tools") and self._roll(s.rate_tool_calls):
                calls = self._tool_calls(self.rng.randrange(1 << 30), body["tools"])
                implicit = s.thinking and self._roll(s.rate_implicit_think_end)
                needed = len(answer.r_ids) + (0 if implicit else separator) + self._section_tokens(calls) + 1
                if needed <= max_tokens:  # else a text answer (cut as usual)
                    tool_calls, content, finish, completion_tokens = calls, "", "tool_calls", needed
                    gen.think_end = not implicit
            if finish == "stop" and completion_tokens > max_tokens:  # cut at whole tokens, no end marker
                finish = "length"
                if s.thinking and max_tokens <= len(answer.r_ids):
                    reasoning, content = self.encoding.decode(answer.r_ids[:max_tokens]), ""
                else:
                    content = self.encoding.decode(answer.c_ids[: max_tokens - len(answer.r_ids) - separator])
                completion_tokens = max_tokens
            if finish is None or finish == "error":
                completion_tokens = 0  # not charged
            if completion_tokens:
                completion_tokens += s.completion_token_offset
            gen.answer, gen.tool_calls = (reasoning, content), tool_calls
            self._gens[gen.id] = gen
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": min(len(answer.r_ids), completion_tokens)},
                "cost": prompt_tokens * price_prompt + completion_tokens * price_completion
                if completion_tokens
                else 0.0,
                "is_byok": False,
            }
            if body.get("stream"):
                return await self._stream(request, gen, reasoning, content, finish, usage, tool_calls)
            return await self._respond(request, gen, reasoning, content, finish, usage, tool_calls)
        finally:
            self.inflight_worst.pop(gen.id, None)

    @staticmethod
    def _failed(finish: str | None, usage: dict[str, Any]) -> bool:
        return finish in (None, "error") and usage["completion_tokens"] == 0

    async def _respond(self, request, gen: _Gen, reasoning, content, finish, usage, tool_calls) -> web.StreamResponse:
        s = self.settings
        await asyncio.sleep(s.latency_s)  # the client may leave meanwhile: billed all the same
        if self._roll(s.rate_error_200):  # the provider failed: nothing generated, nothing charged, but recorded
            self._bill(gen, usage["prompt_tokens"], 0, None, "failed")
            self.billing.statuses.append(200)
            return web.json_response(
                {"error": {"code": 502, "message": "Provider returned error"}}, headers={"X-Generation-Id": gen.id}
            )
        disconnected = request.transport is None or request.transport.is_closing()
        kind = "failed" if self._failed(finish, usage) else "after_disconnect" if disconnected else "complete"
        self._bill(gen, usage["prompt_tokens"], usage["completion_tokens"], finish, kind)
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": finish,
            "native_finish_reason": finish,
            "message": {"role": "assistant", "content": content, "reasoning": reasoning},
        }
        if tool_calls:  # as OpenAI's shape has it: no content is null
            choice["message"].update(content=content or None, tool_calls=tool_calls)
        if finish == "error":
            choice["error"] = {"code": 502, "message": "Provider disconnected mid-generation"}
        data = {
            "id": gen.id,
            "provider": gen.endpoint.provider_name,
            "model": gen.model,
            "object": "chat.completion",
            "created": int(time.time()),
            "choices": [choice],
            "usage": usage,
        }
        payload = json.dumps(data).encode()
        self.billing.statuses.append(200)
        if self._roll(s.rate_truncate):
            resp = web.StreamResponse(headers={"X-Generation-Id": gen.id, "Content-Type": "application/json"})
            resp.content_length = len(payload)
            await resp.prepare(request)
            await resp.write(payload[: len(payload) // 2])
            request.transport.abort()
            return resp
        return web.Response(body=payload, content_type="application/json", headers={"X-Generation-Id": gen.id})

    async def _stream(self, request, gen: _Gen, reasoning, content, finish, usage, tool_calls) -> web.StreamResponse:
        s = self.settings
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Generation-Id": gen.id}
        )
        await resp.prepare(request)
        base = {
            "id": gen.id,
            "provider": gen.endpoint.provider_name,
            "model": gen.model,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
        }
        sent: dict[str, Any] = {"reasoning": "", "content": ""}  # the text sent so far, and "billed" once it is

        def sent_tokens() -> int:  # what an aborted stream is billed for
            return len(self.encoding.encode(sent["reasoning"])) + len(self.encoding.encode(sent["content"]))

        def connection_lost() -> None:  # the stream ended before its usage: billed now, or in full later
            if s.late_bill_s > 0:
                self._bill_late(gen, usage, finish)
            else:
                self._bill(gen, usage["prompt_tokens"], sent_tokens(), None, "aborted_stream")

        async def send(obj) -> None:
            await resp.write(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")
            if s.chunk_latency_s:
                await asyncio.sleep(s.chunk_latency_s)

        def pieces(text: str, size: int = 8) -> list[str]:  # whole characters, never a split UTF-8 sequence
            return [text[i : i + size] for i in range(0, len(text), size)]

        try:
            await resp.write(b": OPENROUTER PROCESSING\n\n")
            waited = 0.0
            while waited < s.latency_s:  # keep-alives while the provider "thinks"
                step = min(0.5, s.latency_s - waited)
                await asyncio.sleep(step)
                waited += step
                await resp.write(b": OPENROUTER PROCESSING\n\n")
            await send(
                {
                    **base,
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
                }
            )
            cut_at, midstream_error = None, False
            if self._roll(s.rate_truncate) or self._roll(s.rate_error_midstream):
                cut_at, midstream_error = self.rng.randrange(1, 4), self.rng.random() < 0.5
            deltas: list[tuple[str, Any]] = [("reasoning", p) for p in pieces(reasoning)]
            deltas += [("content", p) for p in pieces(content)]
            for n, call in enumerate(tool_calls or []):  # OpenAI's chunks: id, type and name first, then arguments
                head = {"index": n, "id": call["id"], "type": "function"}
                deltas.append(
                    ("tool_calls", [{**head, "function": {"name": call["function"]["name"], "arguments": ""}}])
                )
                deltas += [
                    ("tool_calls", [{"index": n, "function": {"arguments": p}}])
                    for p in pieces(call["function"]["arguments"])
                ]
            for i, (kind, piece) in enumerate(deltas):
                if i == cut_at:
                    if midstream_error:  # the provider failed: billed for what it sent
                        await send({**base, "error": {"code": 502, "message": "Provider disconnected"}})
                        sent["billed"] = True
                        self._bill(gen, usage["prompt_tokens"], sent_tokens(), None, "aborted_stream")
                    else:  # the connection dropped
                        sent["billed"] = True
                        connection_lost()
                    request.transport.abort()
                    return resp
                await send({**base, "choices": [{"index": 0, "delta": {kind: piece}, "finish_reason": None}]})
                if kind == "tool_calls":
                    sent["content"] += piece[0]["function"]["arguments"]  # (billed like text if the stream is cut)
                else:
                    sent[kind] += piece
            final = {"index": 0, "delta": {}, "finish_reason": finish, "native_finish_reason": finish}
            if finish == "error":
                final["error"] = {"code": 502, "message": "Provider disconnected mid-generation"}
            await send({**base, "choices": [final]})
            # Billed when the usage (with its cost) is sent, before the client can see [DONE].
            self._bill(
                gen,
                usage["prompt_tokens"],
                usage["completion_tokens"],
                finish,
                "failed" if self._failed(finish, usage) else "complete",
            )
            sent["billed"] = True
            await send({**base, "choices": [], "usage": usage})
            await send(b"[DONE]")
            self.billing.statuses.append(200)
        except (ConnectionError, asyncio.CancelledError) as e:
            # The client went away mid-stream.
            if not sent.get("billed"):
                connection_lost()
            if isinstance(e, asyncio.CancelledError):
                raise
        return resp

    async def stats(self, request: web.Request) -> web.Response:
        """Chat requests received, those generating now (their X-Eagle3-Attempt), answers by status, bills by kind."""
        statuses: dict[str, int] = {}
        for status in self.billing.statuses:
            statuses[str(status)] = statuses.get(str(status), 0) + 1
        kinds: dict[str, int] = {}
        for bill in self.billing.bills:
            kinds[bill.kind] = kinds.get(bill.kind, 0) + 1
        generating = [self._gens[g].attempt for g in list(self.inflight_worst) if g in self._gens]
        return web.json_response(
            {"received": len(self.billing.requests), "generating": generating, "answered": statuses, "bills": kinds}
        )

    # -- catalogue ---------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        first = self.endpoints()[0]
        created = int(time.time()) - 86400
        return web.json_response({"data": [model_entry(m, first, created) for m in self.model_ids()]})

    async def model_endpoints(self, request: web.Request) -> web.Response:
        model = f"{request.match_info['author']}/{request.match_info['slug']}"
        if model not in self.model_ids():
            return self._error(404, f"Model {model} not found")
        entry = model_entry(model, self.endpoints()[0], int(time.time()) - 86400)
        return web.json_response(
            {
                "data": {
                    "id": model,
                    "name": entry["name"],
                    "created": entry["created"],
                    "description": entry["description"],
                    "architecture": entry["architecture"],
                    "endpoints": [endpoint_entry(model, e) for e in self.endpoints()],
                }
            }
        )

    # -- account endpoints -------------------------------------------------------------------

    async def key(self, request: web.Request) -> web.Response:
        if not self._authorized(request, self.settings.api_key):
            return self._error(401, "No auth credentials found")
        self.key_calls += 1
        usage = self._usage(lagged=True)
        if self.key_calls == self.settings.nonmonotonic_on_key_call:
            usage = max(0.0, usage - self.settings.refund_usd)  # seen once in the history: the balance rose
        limit = None if self.settings.credit_usd == float("inf") else self.settings.credit_usd
        return web.json_response(
            {
                "data": {
                    "label": "fake",
                    "limit": limit,
                    "usage": usage,
                    "usage_daily": usage,
                    "usage_weekly": usage,
                    "usage_monthly": usage,
                    "limit_remaining": None if limit is None else limit - usage,
                    "is_free_tier": False,
                }
            }
        )

    async def credits(self, request: web.Request) -> web.Response:
        if not self._authorized(request, self.settings.management_key):
            return self._error(403, "Only management keys can fetch credits")
        limit = self.settings.credit_usd
        return web.json_response(
            {
                "data": {
                    "total_credits": None if limit == float("inf") else limit,
                    "total_usage": self._usage(lagged=True),
                }
            }
        )

    async def generation_content(self, request: web.Request) -> web.Response:
        """Stored prompt and completion of a finished generation (only with the account's logging on:
        `store_content`)."""
        if not self._authorized(request, self.settings.api_key):
            return self._error(401, "No auth credentials found")
        gen_id = request.query.get("id", "")
        bill, gen = self._by_id.get(gen_id), self._gens.get(gen_id)
        if (
            not self.settings.store_content
            or bill is None
            or gen is None
            or bill.never_found
            or bill.kind not in ("complete", "late", "after_disconnect")
            or time.monotonic() - bill.t_done < self.settings.generation_404_s
        ):
            return self._error(404, f"No stored content for generation {gen_id}")
        reasoning, content = gen.answer
        return web.json_response(
            {
                "data": {
                    "input": {"messages": json.loads(gen.prompt_key)},
                    "output": {"completion": content, "reasoning": reasoning or None},
                }
            }
        )

    async def generation(self, request: web.Request) -> web.Response:
        if not self._authorized(request, self.settings.api_key):
            return self._error(401, "No auth credentials found")
        gen = request.query.get("id", "")
        bill = self._by_id.get(gen)
        if bill is None or bill.never_found or time.monotonic() - bill.t_done < self.settings.generation_404_s:
            return self._error(404, f"Generation {gen} not found")
        return web.json_response(
            {
                "data": {
                    "id": bill.id,
                    "total_cost": bill.cost,
                    "tokens_prompt": bill.prompt_tokens,
                    "tokens_completion": bill.completion_tokens,
                    "native_tokens_prompt": bill.prompt_tokens,
                    "native_tokens_completion": bill.completion_tokens,
                    "finish_reason": bill.finish_reason,
                    "cancelled": bill.kind in ("aborted_stream", "late"),
                    "provider_name": bill.provider,
                }
            }
        )
