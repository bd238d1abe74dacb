"""JSON Lines read the way the format defines it: records end at `\\n` and nowhere else.

`str.splitlines()` also breaks at U+2028, U+2029, U+0085, form feeds and more; all of them are
valid raw inside a JSON string (JSON escapes only controls below U+0020), so a prompt quoting
text with a line separator would be cut in two. Here lines are split on the byte `\\n` (a `\\r`
before it is dropped), and the problems a file really has get their own messages: a byte-order
mark, NUL bytes (a binary or truncated file), invalid UTF-8 (a file saved in another encoding).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

UTF8_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class JsonLine:
    """One non-blank line: its 1-based number and either its object or what is wrong with it."""

    line: int
    value: dict[str, Any] | None
    problem: str | None = None


def _decode(raw: bytes, lineno: int) -> tuple[str | None, str | None]:
    if lineno == 1 and raw.startswith(UTF8_BOM):
        return None, (
            "starts with a UTF-8 byte-order mark (EF BB BF); JSON Lines files have none: "
            "save the file as UTF-8 without BOM"
        )
    nul = raw.find(b"\x00")
    if nul >= 0:
        return None, (
            f"NUL byte (0x00) at byte {nul + 1} of the line: this is binary data or a "
            "file cut short and padded, not JSON text"
        )
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError as e:
        bad = raw[e.start : e.start + 4].hex(" ")
        return None, (
            f"not valid UTF-8 at byte {e.start + 1} of the line (bytes {bad}: {e.reason}); "
            "the file was probably saved in another encoding (Latin-1, GBK, UTF-16?)"
        )


def iter_json_lines(data: bytes) -> Iterator[JsonLine]:
    """Every non-blank line of a JSON Lines document, in order, parsed or with its problem."""
    pos, lineno = 0, 0
    while pos < len(data):
        end = data.find(b"\n", pos)
        end = len(data) if end < 0 else end
        raw = data[pos:end]
        pos, lineno = end + 1, lineno + 1
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        if not raw.strip():
            continue
        text, problem = _decode(raw, lineno)
        if text is None:  # _decode gives the text or its problem
            yield JsonLine(lineno, None, problem)
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            yield JsonLine(lineno, None, f"malformed JSON ({e.msg} at column {e.colno})")
            continue
        if not isinstance(value, dict):
            yield JsonLine(lineno, None, f"expected a JSON object, got {type(value).__name__}")
            continue
        yield JsonLine(lineno, value)
