"""A fake OpenRouter on loopback, reproducing the behaviours the client must survive.

What it does, each a setting (`FakeSettings`):
- chat completions, streaming (SSE with `: OPENROUTER PROCESSING` keep-alives, a role chunk,
  reasoning and content deltas, a finish chunk, a separate usage chunk, `[DONE]`) or not;
- reasoning and content built from whole tokens of the tokenizer it is given (the stand-in or the
  real Kimi), so `completion_tokens` = len(enc(reasoning)) + 1 + len(enc(content)) + 1 exactly,
  and `prompt_tokens` = the chat-template rendering of the messages; `cost` at a fixed price;
- `gen-...` ids in the body and the `X-Generation-Id` header; `finish_reason` `length` at `max_tokens`;
- faults at configurable rates: 429 with `Retry-After` (and periodic 429 storms), 503, 408, 500,
  errors inside HTTP 200 and mid-stream, connection resets, truncated bodies and streams,
  `content_filter`, `finish_reason: error`, empty completions; 401 for a wrong key; 402 when the
  credit runs out; the in-flight 402 (with Retry-After) when the worst-case cost of running
  requests exceeds the remaining credit; 404 when provider filters leave no endpoint;
- billing like OpenRouter's: a non-streaming request is finished and billed even after its
  client disconnects; an aborted stream is billed for the tokens sent so far;
- `/api/v1/key` (usage and `limit_remaining`, lagging by `key_lag_s`, once non-monotonic),
  `/api/v1/credits` (management key only), `/api/v1/generation?id=` (404 for
  `generation_404_s` after completion).
Everything billed is kept in `billing` (and printed as JSON lines with `--log-billing`).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from aiohttp import web

from eagle3_resources.tokenizer.chat_format import render_messages
from eagle3_resources.tokenizer.kimi import KimiTokenizer

KNOWN_PROVIDERS = {"FakeProvider", "Moonshot AI", "Fireworks", "Together", "Baseten"}
WORDS = (
    "the model thinks about each step before it answers so the reply stays short clear and correct "
    "first we check the question then we compute the result and finally we explain why it holds "
    "数据 模型 推理 答案 检查 步骤 结果 清楚 简短"
).split()


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


@dataclass
class Bill:
    id: str
    prompt_tokens: int
    completion_tokens: int
    cost: float
    finish_reason: str | None
    t_done: float
    kind: str  # complete | aborted_stream | after_disconnect


@dataclass
class Billing:
    requests: list[dict[str, Any]] = field(default_factory=list)
    bills: list[Bill] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)

    @property
    def total_usd(self) -> float:
        return sum(b.cost for b in self.bills)

    def billed_ids(self) -> set[str]:
        return {b.id for b in self.bills}


class _Answer:
    def __init__(self, reasoning: str, content: str, r_ids: list[int], c_ids: list[int]):
        self.reasoning, self.content, self.r_ids, self.c_ids = reasoning, content, r_ids, c_ids


class FakeOpenRouter:
    def __init__(self, tokenizer: KimiTokenizer, settings: FakeSettings | None = None, log_billing=None):
        self.tokenizer = tokenizer
        self.settings = settings or FakeSettings()
        self.billing = Billing()
        self.rng = random.Random(self.settings.seed)
        self.started = time.monotonic()
        self.inflight_worst: dict[str, float] = {}
        self.key_calls = 0
        self._log_billing = log_billing
        self.app = web.Application()
        self.app.router.add_post("/api/v1/chat/completions", self.chat_completions)
        self.app.router.add_get("/api/v1/key", self.key)
        self.app.router.add_get("/api/v1/credits", self.credits)
        self.app.router.add_get("/api/v1/generation", self.generation)

    # -- helpers ---------------------------------------------------------------------------

    def _authorized(self, request: web.Request, key: str) -> bool:
        return request.headers.get("Authorization") == f"Bearer {key}"

    def _error(self, status: int, message: str, headers: dict[str, str] | None = None, **extra) -> web.Response:
        self.billing.statuses.append(status)
        return web.json_response({"error": {"code": status, "message": message, **extra}}, status=status, headers=headers)

    def _roll(self, rate: float) -> bool:
        return rate > 0 and self.rng.random() < rate

    def _in_storm(self) -> bool:
        s = self.settings
        if not (s.storm_every_s and s.storm_len_s):
            return False
        return (time.monotonic() - self.started) % s.storm_every_s < s.storm_len_s

    def _answer(self, seed: int) -> _Answer:
        rng = random.Random(seed)
        s = self.settings

        def text(n: int) -> str:
            words = [rng.choice(WORDS) for _ in range(max(1, int(rng.gauss(n, n / 4))))]
            return " ".join(words).capitalize() + "."

        reasoning, content = text(s.mean_reasoning_words), text(s.mean_content_words)
        return _Answer(reasoning, content, self.tokenizer.encode(reasoning), self.tokenizer.encode(content))

    def _bill(self, gen_id: str, prompt_tokens: int, completion_tokens: int, finish: str | None, kind: str) -> Bill:
        s = self.settings
        bill = Bill(gen_id, prompt_tokens, completion_tokens, prompt_tokens * s.price_prompt + completion_tokens * s.price_completion,
                    finish, time.monotonic(), kind)
        self.billing.bills.append(bill)
        if self._log_billing:
            self._log_billing(asdict(bill))
        return bill

    def _usage(self, lagged: bool) -> float:
        cutoff = time.monotonic() - (self.settings.key_lag_s if lagged else 0.0)
        return sum(b.cost for b in self.billing.bills if b.t_done <= cutoff)

    # -- chat completions --------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        s = self.settings
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return self._error(400, "invalid JSON body")
        self.billing.requests.append(body)
        if not self._authorized(request, s.api_key):
            return self._error(401, "No auth credentials found")
        provider = body.get("provider") or {}
        if provider.get("only") and not set(provider["only"]) & KNOWN_PROVIDERS:
            return self._error(404, "No endpoints found matching your data policy and provider filters")
        messages = body.get("messages") or []
        prompt_tokens = len(self.tokenizer.encode(render_messages(messages, body.get("tools")), allow_special=True))
        if body.get("tools"):
            prompt_tokens += s.prompt_token_offset
        max_tokens = int(body.get("max_tokens") or 1 << 30)
        if prompt_tokens + min(max_tokens, 1 << 30) > s.context_limit and body.get("max_tokens"):
            return self._error(400, f"This endpoint's maximum context length is {s.context_limit} tokens")
        worst = prompt_tokens * s.price_prompt + max_tokens * s.price_completion
        remaining = s.credit_usd - self.billing.total_usd
        if remaining <= 0:
            return self._error(402, "Insufficient credits. Add more using https://openrouter.ai/credits")
        if sum(self.inflight_worst.values()) + worst > remaining:
            return self._error(402, "Request cost exceeds the remaining in-flight budget", {"Retry-After": f"{s.retry_after_s}"})
        if self._in_storm() or self._roll(s.rate_429):
            return self._error(429, "Provider returned error: rate limited upstream", {"Retry-After": f"{s.retry_after_s}"})
        if self._roll(s.rate_503):
            return self._error(503, "No available provider", {"Retry-After": f"{s.retry_after_s}"})
        if self._roll(s.rate_408):
            return self._error(408, "Request timed out upstream")
        if self._roll(s.rate_500):
            return self._error(500, "Internal Server Error")
        if self._roll(s.rate_reset):
            request.transport.abort()
            self.billing.statuses.append(0)
            return web.Response(status=500)

        gen_id = f"gen-{uuid.uuid4().hex[:24]}"
        self.inflight_worst[gen_id] = worst
        try:
            answer = self._answer(self.rng.randrange(1 << 30))
            finish = "stop"
            if self._roll(s.rate_content_filter):
                finish = "content_filter"
            elif self._roll(s.rate_finish_error):
                finish = "error"
            elif self._roll(s.rate_empty):
                answer = _Answer("", "", [], [])
                finish = None
            reasoning, content, completion_tokens = answer.reasoning, answer.content, len(answer.r_ids) + len(answer.c_ids) + 2
            if finish == "stop" and completion_tokens > max_tokens:  # cut at whole tokens, no end marker
                finish = "length"
                if max_tokens <= len(answer.r_ids):
                    reasoning, content = self.tokenizer.decode(answer.r_ids[:max_tokens]), ""
                else:
                    content = self.tokenizer.decode(answer.c_ids[: max_tokens - len(answer.r_ids) - 1])
                completion_tokens = max_tokens
            if finish is None or finish == "error":
                completion_tokens = 0  # not charged
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": min(len(answer.r_ids), completion_tokens)},
                "cost": prompt_tokens * s.price_prompt + completion_tokens * s.price_completion if completion_tokens else 0.0,
                "is_byok": False,
            }
            if body.get("stream"):
                return await self._stream(request, gen_id, body, reasoning, content, finish, usage)
            return await self._respond(request, gen_id, body, reasoning, content, finish, usage)
        finally:
            self.inflight_worst.pop(gen_id, None)

    async def _respond(self, request, gen_id, body, reasoning, content, finish, usage) -> web.StreamResponse:
        s = self.settings
        await asyncio.sleep(s.latency_s)  # the client may leave meanwhile: billed all the same
        if self._roll(s.rate_error_200):  # the provider failed: nothing generated, nothing billed
            self.billing.statuses.append(200)
            return web.json_response({"error": {"code": 502, "message": "Provider returned error"}},
                                     headers={"X-Generation-Id": gen_id})
        disconnected = request.transport is None or request.transport.is_closing()
        self._bill(gen_id, usage["prompt_tokens"], usage["completion_tokens"], finish, "after_disconnect" if disconnected else "complete")
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "native_finish_reason": finish,
                                  "message": {"role": "assistant", "content": content, "reasoning": reasoning}}
        if finish == "error":
            choice["error"] = {"code": 502, "message": "Provider disconnected mid-generation"}
        data = {"id": gen_id, "provider": s.provider, "model": body.get("model"), "object": "chat.completion",
                "created": int(time.time()), "choices": [choice], "usage": usage}
        payload = json.dumps(data).encode()
        self.billing.statuses.append(200)
        if self._roll(s.rate_truncate):
            resp = web.StreamResponse(headers={"X-Generation-Id": gen_id, "Content-Type": "application/json"})
            resp.content_length = len(payload)
            await resp.prepare(request)
            await resp.write(payload[: len(payload) // 2])
            request.transport.abort()
            return resp
        return web.Response(body=payload, content_type="application/json", headers={"X-Generation-Id": gen_id})

    async def _stream(self, request, gen_id, body, reasoning, content, finish, usage) -> web.StreamResponse:
        s = self.settings
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Generation-Id": gen_id})
        await resp.prepare(request)
        base = {"id": gen_id, "provider": s.provider, "model": body.get("model"), "object": "chat.completion.chunk",
                "created": int(time.time())}
        sent = {"reasoning": "", "content": ""}

        def sent_tokens() -> int:  # what an aborted stream is billed for
            return len(self.tokenizer.encode(sent["reasoning"])) + len(self.tokenizer.encode(sent["content"]))

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
            await send({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
            cut_at, midstream_error = None, False
            if self._roll(s.rate_truncate) or self._roll(s.rate_error_midstream):
                cut_at, midstream_error = self.rng.randrange(1, 4), self.rng.random() < 0.5
            for i, (kind, piece) in enumerate([("reasoning", p) for p in pieces(reasoning)] + [("content", p) for p in pieces(content)]):
                if i == cut_at:
                    if midstream_error:
                        await send({**base, "error": {"code": 502, "message": "Provider disconnected"}})
                    self._bill(gen_id, usage["prompt_tokens"], sent_tokens(), None, "aborted_stream")
                    request.transport.abort()
                    return resp
                await send({**base, "choices": [{"index": 0, "delta": {kind: piece}, "finish_reason": None}]})
                sent[kind] += piece
            final = {"index": 0, "delta": {}, "finish_reason": finish, "native_finish_reason": finish}
            if finish == "error":
                final["error"] = {"code": 502, "message": "Provider disconnected mid-generation"}
            await send({**base, "choices": [final]})
            # Billed when the usage (with its cost) is sent, before the client can see [DONE].
            self._bill(gen_id, usage["prompt_tokens"], usage["completion_tokens"], finish, "complete")
            sent["billed"] = True
            await send({**base, "choices": [], "usage": usage})
            await send(b"[DONE]")
            self.billing.statuses.append(200)
        except (ConnectionError, asyncio.CancelledError) as e:
            # The client went away mid-stream: this fake stops generating and bills what it sent.
            if not sent.get("billed"):
                self._bill(gen_id, usage["prompt_tokens"], sent_tokens(), None, "aborted_stream")
            if isinstance(e, asyncio.CancelledError):
                raise
        return resp

    # -- account endpoints -------------------------------------------------------------------

    async def key(self, request: web.Request) -> web.Response:
        if not self._authorized(request, self.settings.api_key):
            return self._error(401, "No auth credentials found")
        self.key_calls += 1
        usage = self._usage(lagged=True)
        if self.key_calls == self.settings.nonmonotonic_on_key_call:
            usage = max(0.0, usage - self.settings.refund_usd)  # seen once in the history: the balance rose
        limit = None if self.settings.credit_usd == float("inf") else self.settings.credit_usd
        return web.json_response({"data": {"label": "fake", "limit": limit, "usage": usage, "usage_daily": usage,
                                           "usage_weekly": usage, "usage_monthly": usage,
                                           "limit_remaining": None if limit is None else limit - usage, "is_free_tier": False}})

    async def credits(self, request: web.Request) -> web.Response:
        if not self._authorized(request, self.settings.management_key):
            return self._error(403, "Only management keys can fetch credits")
        limit = self.settings.credit_usd
        return web.json_response({"data": {"total_credits": None if limit == float("inf") else limit,
                                           "total_usage": self._usage(lagged=True)}})

    async def generation(self, request: web.Request) -> web.Response:
        if not self._authorized(request, self.settings.api_key):
            return self._error(401, "No auth credentials found")
        gen = request.query.get("id", "")
        bill = next((b for b in self.billing.bills if b.id == gen), None)
        if bill is None or time.monotonic() - bill.t_done < self.settings.generation_404_s:
            return self._error(404, f"Generation {gen} not found")
        return web.json_response({"data": {
            "id": bill.id, "total_cost": bill.cost, "tokens_prompt": bill.prompt_tokens, "tokens_completion": bill.completion_tokens,
            "native_tokens_prompt": bill.prompt_tokens, "native_tokens_completion": bill.completion_tokens,
            "finish_reason": bill.finish_reason, "cancelled": bill.kind == "aborted_stream", "provider_name": self.settings.provider,
        }})
