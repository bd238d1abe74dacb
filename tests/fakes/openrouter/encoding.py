"""The fake provider's own Kimi tokenizer, read straight from a tokenizer folder.

Written from Moonshot's public `tokenization_kimi.py` (Kimi-K2 / K2.5 Hugging Face repos), not
from this project's tokenizer code, so that the fake's bill is an independent oracle:

- `tiktoken.model`: one `<base64 bytes> <rank>` per line, the BPE ranks;
- `tokenizer_config.json`: `added_tokens_decoder` names special ids; the 256 ids right after the
  ranks are special, those without a name are `<|reserved_token_{id}|>` (as Moonshot names them);
- the pre-tokenizer regex below (tiktoken syntax: `&&` is a class intersection);
- `encode` first cuts the text into 400,000-character chunks and cuts every run of whitespace or
  non-whitespace (`str.isspace`) longer than 25,000 characters, then runs BPE on each piece.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import tiktoken

RESERVED_SPECIALS = 256
CHUNK_CHARS = 400_000  # tiktoken panics on longer inputs
RUN_CHARS = 25_000  # tiktoken issue #195: very long runs are cut

_LETTERS_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_LETTERS_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
SPLIT_PATTERN = "|".join(
    (
        r"[\p{Han}]+",  # runs of CJK ideographs
        rf"[^\r\n\p{{L}}\p{{N}}]?{_LETTERS_UPPER}*{_LETTERS_LOWER}+{_CONTRACTION}",  # words, lower-case tail
        rf"[^\r\n\p{{L}}\p{{N}}]?{_LETTERS_UPPER}+{_LETTERS_LOWER}*{_CONTRACTION}",  # words, upper-case head
        r"\p{N}{1,3}",  # numbers, up to three digits a token
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",  # punctuation and symbols
        r"\s*[\r\n]+",  # line breaks
        r"\s+(?!\S)",  # trailing whitespace
        r"\s+",
    )
)


def _cut_long_runs(chunk: str) -> Iterator[str]:
    """Cut `chunk` before the 25,001st, 50,001st... character of every (non-)whitespace run."""
    start = pos = 0
    for _, run in itertools.groupby(chunk, str.isspace):
        n = sum(1 for _ in run)
        for cut in range(pos + RUN_CHARS, pos + n, RUN_CHARS):
            yield chunk[start:cut]
            start = cut
        pos += n
    yield chunk[start:]


def pieces(text: str) -> Iterator[str]:
    """The substrings Kimi's `encode` hands to tiktoken, in order."""
    for offset in range(0, len(text), CHUNK_CHARS):
        chunk = text[offset : offset + CHUNK_CHARS]
        if len(chunk) <= RUN_CHARS:  # no run can be too long
            yield chunk
        else:
            yield from _cut_long_runs(chunk)


class KimiEncoding:
    """BPE ranks + special tokens of one Kimi tokenizer folder, and Kimi's encode."""

    def __init__(self, folder: str | os.PathLike[str]):
        self.folder = Path(folder)
        ranks: dict[bytes, int] = {}
        with open(self.folder / "tiktoken.model", "rb") as f:
            for line in f:
                if line.strip():
                    token, rank = line.split()
                    ranks[base64.b64decode(token)] = int(rank)
        config: dict[str, Any] = json.loads((self.folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        names = {int(i): entry["content"] for i, entry in (config.get("added_tokens_decoder") or {}).items()}
        first = len(ranks)
        self.specials = {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(first, first + RESERVED_SPECIALS)}
        self.encoding = tiktoken.Encoding(
            name=f"fake-openrouter:{self.folder.name}",
            pat_str=SPLIT_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=self.specials,
        )

    def encode(self, text: str, *, specials: bool = False) -> list[int]:
        """Kimi's encode. `specials=True`: special-token strings become their ids (a rendered prompt);
        False: they are ordinary text (what a model wrote in prose)."""
        out: list[int] = []
        for piece in pieces(text):
            out += (
                self.encoding.encode(piece, allowed_special="all") if specials else self.encoding.encode_ordinary(piece)
            )
        return out

    def count(self, text: str, *, specials: bool = False) -> int:
        return len(self.encode(text, specials=specials))

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode(ids)


_loaded: dict[tuple[str, int, int], KimiEncoding] = {}
_lock = threading.Lock()


def load_encoding(tokenizer: Any) -> KimiEncoding:
    """A folder path, or any object with a `.folder` (a tokenizer object that knows its folder).

    Loaded once per folder and file version: many fakes in one test session share it."""
    folder = getattr(tokenizer, "folder", tokenizer)
    if callable(folder):  # a resource whose folder() builds or locates it
        folder = folder()
    folder = Path(folder)
    stats = [(folder / name).stat() for name in ("tiktoken.model", "tokenizer_config.json")]
    key = (str(folder.resolve()), stats[0].st_mtime_ns, stats[1].st_mtime_ns)
    with _lock:
        if key not in _loaded:
            _loaded[key] = KimiEncoding(folder)
        return _loaded[key]
