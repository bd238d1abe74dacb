"""Server-sent events from OpenRouter's streaming chat completions, folded into one response.

OpenRouter frames: `: OPENROUTER PROCESSING` comment lines (keep-alives, skipped), then `data:`
events: a role chunk, reasoning deltas (`delta.reasoning`), content deltas, tool-call deltas, a
finish chunk, ONE usage chunk (its `choices` may be `[]` or an empty-delta choice with
`finish_reason: null`), then `data: [DONE]`. An error can arrive mid-stream as a chunk with an
`error` object, after which the stream ends.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from eagle3_resources.errors import StreamError


@dataclass
class StreamedResponse:
    """What the chunks of one stream add up to (the non-streaming body's fields)."""

    id: str | None = None
    provider: str | None = None
    model: str | None = None
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: str | None = None
    native_finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    choice_error: dict[str, Any] | None = None
    done: bool = False
    chunks: int = 0

    def add(self, chunk: dict[str, Any]) -> None:
        self.chunks += 1
        if chunk.get("error") and not chunk.get("choices"):
            err = chunk["error"]
            raise StreamError(
                f"error chunk mid-stream: {err.get('message', err)}", f"stream:{err.get('code', 'error')}"
            )
        self.id = self.id or chunk.get("id")
        self.provider = self.provider or chunk.get("provider")
        self.model = self.model or chunk.get("model")
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning"):
                self.reasoning.append(delta["reasoning"])
            if delta.get("content"):
                self.content.append(delta["content"])
            for call in delta.get("tool_calls") or []:
                slot = self.tool_calls.setdefault(
                    call.get("index", 0), {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
                )
                slot["id"] = call.get("id") or slot["id"]
                fn = call.get("function") or {}
                slot["function"]["name"] += fn.get("name") or ""
                slot["function"]["arguments"] += fn.get("arguments") or ""
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                self.native_finish_reason = choice.get("native_finish_reason")
            if choice.get("error"):
                self.choice_error = choice["error"]

    def as_body(self) -> dict[str, Any]:
        """The equivalent non-streaming response body."""
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(self.content),
            "reasoning": "".join(self.reasoning),
        }
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": self.finish_reason,
            "native_finish_reason": self.native_finish_reason,
        }
        if self.choice_error:
            choice["error"] = self.choice_error
        return {
            "id": self.id,
            "provider": self.provider,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage or {},
        }


class SSEDecoder:
    """Incremental SSE line decoder: feed it lines, get the JSON payload of each complete event."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def line(self, line: str) -> list[str]:
        """Returns the payloads completed by this line (at most one)."""
        line = line.rstrip("\r")
        if line.startswith(":"):  # comment / keep-alive
            return []
        if not line:  # blank line: end of event
            return self._flush()
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
            # OpenRouter sends one data line per event; dispatching at once keeps latency low.
            return self._flush()
        return []  # event:, id:, retry: carry nothing we need

    def _flush(self) -> list[str]:
        if not self._data:
            return []
        payload, self._data = "\n".join(self._data), []
        return [payload]


def fold_events(payloads, into: StreamedResponse) -> None:
    """Apply decoded payloads to the response; `[DONE]` marks a complete stream."""
    for payload in payloads:
        if payload == "[DONE]":
            into.done = True
            return
        try:
            into.add(json.loads(payload))
        except json.JSONDecodeError as e:
            raise StreamError(f"malformed event ({e.msg}): {payload[:120]!r}", "stream:bad_json") from None
