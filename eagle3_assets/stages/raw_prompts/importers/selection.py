"""What makes two prompts the same, the seeded order prompts are sampled in, and the filters.

- The de-duplication key is a hash of the prompt's normalised text: every message (role, text,
  tool calls) and the tools, NFKC-normalised, case-folded, whitespace collapsed. Prompt ids of
  imported sets are derived from it, so the same prompt gets the same id whatever file or row
  it came from, and a resumed or re-imported run never buys it twice.
- Sampling is bottom-k on a keyed hash: a prompt's rank is `blake2b(seed, key)` and the sample
  is the `cap` lowest ranks among the prompts that pass the filters. The same seed gives the
  same ids whatever the row order, a larger cap keeps every prompt of a smaller one, and it
  streams in memory bounded by the cap.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from typing import Any

import py3langid

LANGUAGE_SAMPLE_CHARS = 2000


def normalized_text(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    parts = []
    for m in messages:
        calls = (
            json.dumps([c["function"] for c in m["tool_calls"]], sort_keys=True, ensure_ascii=False)
            if m.get("tool_calls")
            else ""
        )
        parts.append(f"{m['role']}: {m.get('content') or ''} {calls}")
    if tools:
        parts.append(json.dumps(tools, sort_keys=True, ensure_ascii=False))
    return " ".join(unicodedata.normalize("NFKC", "\n".join(parts)).casefold().split())


def prompt_key(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    return hashlib.sha256(normalized_text(messages, tools).encode()).hexdigest()


def sample_rank(seed: int, key: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest(), "big")


def user_turns(messages: list[dict[str, Any]]) -> int:
    return sum(m["role"] == "user" for m in messages)


def language(messages: list[dict[str, Any]]) -> str:
    """ISO 639-1 code of the user's text (langid's model; code-only text is often misread)."""
    text = "\n".join(m.get("content") or "" for m in messages if m["role"] == "user")
    return py3langid.classify(text[:LANGUAGE_SAMPLE_CHARS])[0]
