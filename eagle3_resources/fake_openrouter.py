"""A fake OpenRouter server on loopback: for the tests, and to rehearse a run before paying.

    python -m eagle3_resources.fake_openrouter --port 8089 [--rate-429 0.15] [--latency 0.2]
    OPENROUTER_BASE_URL=http://127.0.0.1:8089/api/v1 OPENROUTER_API_KEY=fake-key \\
        EAGLE3_COMPLETIONS_BACKEND=openrouter eagle3 run

It answers `POST /api/v1/chat/completions` like OpenRouter: reasoning and content made of
whole tokens of the (stand-in or real) tokenizer, so the billed `completion_tokens` is exactly
len(enc(reasoning)) + 1 (`</think>`) + len(enc(content)) + 1 (`<|im_end|>`); `usage.cost` at a
fixed price; a `gen-...` id in the body and the `X-Generation-Id` header; `finish_reason`
`length` when `max_tokens` cuts the answer. Faults are settings: a share of 429s with
`Retry-After`, 401 for a wrong key, 402 when the fake balance runs out. It records every
request it received and everything it billed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from eagle3_resources.tokenizer.kimi import KimiTokenizer

PRICE_PER_PROMPT_TOKEN = 0.6e-6
PRICE_PER_COMPLETION_TOKEN = 2.5e-6


@dataclass
class FakeSettings:
    api_key: str = "fake-key"
    rate_429: float = 0.0
    retry_after_s: float = 0.05
    latency_s: float = 0.0
    balance_usd: float = 1e9
    seed: int = 0
    provider: str = "FakeProvider"


@dataclass
class Billing:
    requests: list[dict[str, Any]] = field(default_factory=list)
    billed: list[dict[str, Any]] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)

    @property
    def total_usd(self) -> float:
        return sum(b["cost"] for b in self.billed)


class FakeOpenRouter:
    def __init__(self, tokenizer: KimiTokenizer, settings: FakeSettings | None = None):
        self.tokenizer = tokenizer
        self.settings = settings or FakeSettings()
        self.billing = Billing()
        self.rng = random.Random(self.settings.seed)
        self.app = web.Application()
        self.app.router.add_post("/api/v1/chat/completions", self.chat_completions)

    def _answer(self, messages: list[dict[str, Any]]) -> tuple[str, str]:
        last = next((m.get("content") or "" for m in reversed(messages) if m.get("role") in ("user", "tool")), "")
        words = last.split()[:12] or ["something"]
        reasoning = "The user asks about " + " ".join(words) + ". I will answer step by step."
        content = "Here is the answer about " + " ".join(words[:6]) + "."
        return reasoning, content

    async def chat_completions(self, request: web.Request) -> web.Response:
        s = self.settings
        body = await request.json()
        self.billing.requests.append(body)
        if request.headers.get("Authorization") != f"Bearer {s.api_key}":
            return self._error(401, "No auth credentials found")
        if s.latency_s:
            await asyncio.sleep(s.latency_s)
        if self.rng.random() < s.rate_429:
            return self._error(429, "Provider returned error: rate limited", {"Retry-After": f"{s.retry_after_s}"})
        reasoning, content = self._answer(body.get("messages") or [])
        r_ids, c_ids = self.tokenizer.encode(reasoning), self.tokenizer.encode(content)
        full = len(r_ids) + 1 + len(c_ids) + 1
        max_tokens = int(body.get("max_tokens") or 1 << 30)
        finish = "stop"
        if full > max_tokens:  # cut like the model would be cut: whole tokens, no end marker
            finish = "length"
            if max_tokens <= len(r_ids):
                reasoning, content = self.tokenizer.decode(r_ids[:max_tokens]), ""
                completion_tokens = max_tokens
            else:
                content = self.tokenizer.decode(c_ids[: max_tokens - len(r_ids) - 1])
                completion_tokens = max_tokens
        else:
            completion_tokens = full
        prompt_tokens = sum(len(self.tokenizer.encode(m.get("content") or "")) for m in body.get("messages") or [])
        cost = prompt_tokens * PRICE_PER_PROMPT_TOKEN + completion_tokens * PRICE_PER_COMPLETION_TOKEN
        if cost > s.balance_usd - self.billing.total_usd:
            return self._error(402, "Insufficient credits")
        gen_id = f"gen-{uuid.uuid4().hex[:24]}"
        self.billing.billed.append({"id": gen_id, "cost": cost, "completion_tokens": completion_tokens})
        self.billing.statuses.append(200)
        data = {
            "id": gen_id,
            "provider": s.provider,
            "model": body.get("model"),
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": finish,
                    "native_finish_reason": finish,
                    "message": {"role": "assistant", "content": content, "reasoning": reasoning},
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "completion_tokens_details": {"reasoning_tokens": len(r_ids)},
                "cost": cost,
            },
        }
        return web.json_response(data, headers={"X-Generation-Id": gen_id})

    def _error(self, status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
        self.billing.statuses.append(status)
        return web.json_response({"error": {"code": status, "message": message}}, status=status, headers=headers)


class ServerThread:
    """Run an aiohttp app on 127.0.0.1 in a thread of this process (nothing to leave behind)."""

    def __init__(self, app: web.Application, port: int = 0):
        self.app, self.port = app, port
        self._started = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        self._loop = asyncio.new_event_loop()
        runner = web.AppRunner(self.app)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", self.port)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ServerThread":
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("fake server did not start")
        return self

    def __exit__(self, *exc) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def main() -> None:
    from eagle3_resources.storage import default_data_dir
    from eagle3_resources.tokenizer.resource import TokenizerResource

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=8089)
    parser.add_argument("--api-key", default="fake-key")
    parser.add_argument("--rate-429", type=float, default=0.0)
    parser.add_argument("--latency", type=float, default=0.0)
    parser.add_argument("--tokenizer", default=None, help="Kimi tokenizer folder (default: the stand-in)")
    args = parser.parse_args()
    tok = TokenizerResource(path=args.tokenizer, standin_dir=str(default_data_dir() / "standin")).load()
    fake = FakeOpenRouter(tok, FakeSettings(api_key=args.api_key, rate_429=args.rate_429, latency_s=args.latency))
    print(json.dumps({"listening": f"http://127.0.0.1:{args.port}/api/v1"}))
    web.run_app(fake.app, host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
