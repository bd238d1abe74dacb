"""Load a Kimi-style tiktoken tokenizer folder: the real Kimi-K2.5 one or the stand-in.

A Kimi tokenizer folder holds `tiktoken.model` (`<base64 bytes> <rank>` per line, 163,584 BPE
ranks) and `tokenizer_config.json` (`added_tokens_decoder` names the 256 reserved ids above the
ranks). Moonshot's `tokenization_kimi.py` needs `trust_remote_code` and fails through
`AutoTokenizer` on some transformers versions; this module reads the same two files with
tiktoken directly and reproduces that tokenizer's behaviour (split regex, long-input splitting,
special tokens), so the stand-in and the real tokenizer go through one code path.
"""

from __future__ import annotations

import base64
import json
import os
import re
from collections.abc import Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import tiktoken

from eagle3_resources.errors import TokenizerFolderError
from eagle3_resources.tokenizer.special_tokens import (
    KIMI_SPECIAL_TOKENS,
    NUM_RESERVED_SPECIAL,
    REQUIRED_SPECIAL_TOKENS,
    reserved_token_name,
)

# Kimi's pre-tokenizer, in tiktoken's regex syntax (its `&&` class intersection is not
# available in Python's `re`; tiktoken's fancy-regex supports it).
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

# Kimi's `encode` cuts its input before BPE: tiktoken panics beyond ~400k chars, and runs of
# whitespace or non-whitespace longer than 25k chars are cut (tiktoken issue #195). Long runs
# tokenize differently unless this is reproduced exactly.
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000

TIKTOKEN_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"


_LONG_RUN = re.compile(rf"\s{{{MAX_RUN_CHARS + 1},}}|\S{{{MAX_RUN_CHARS + 1},}}")


def split_long_runs(text: str, max_run: int = MAX_RUN_CHARS) -> Iterator[str]:
    """Cut `text` so no piece has more than `max_run` consecutive (non-)whitespace characters.

    Same cut points as Kimi's `_split_whitespaces_or_nonwhitespaces` (whose `str.isspace` is what
    `re`'s `\\s` matches). Text without such a run, nearly all of it, is found so by one regex scan
    and returned whole; only the rest walks character by character.
    """
    if max_run == MAX_RUN_CHARS and not _LONG_RUN.search(text):
        yield text
        return
    run_len = 0
    run_is_space = text[0].isspace() if text else False
    start = 0
    for i, ch in enumerate(text):
        is_space = ch.isspace()
        if is_space != run_is_space:
            run_len = 1
            run_is_space = is_space
        else:
            run_len += 1
            if run_len > max_run:
                yield text[start:i]
                start = i
                run_len = 1
    yield text[start:]


def kimi_pieces(text: str) -> list[str]:
    """The substrings Kimi's `encode` hands to tiktoken one by one."""
    return [
        piece
        for i in range(0, len(text), MAX_ENCODE_CHARS)
        for piece in split_long_runs(text[i : i + MAX_ENCODE_CHARS])
    ]


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """Parse a `tiktoken.model` file, naming the line of any malformed entry."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                token_b64, rank = line.split()
                ranks[base64.b64decode(token_b64, validate=True)] = int(rank)
            except ValueError as e:
                raise TokenizerFolderError(f"{path}:{lineno}: malformed rank line ({e})") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerFolderError(f"{path}: ranks are not exactly 0..{len(ranks) - 1}")
    return ranks


def write_tiktoken_ranks(path: Path, tokens: Sequence[bytes]) -> None:
    """Write tokens in rank order as a `tiktoken.model` file."""
    with open(path, "wb") as f:
        for rank, token in enumerate(tokens):
            f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")


@dataclass(frozen=True)
class SpecialTokenMismatch:
    token: str
    expected: int
    actual: int | None

    def __str__(self) -> str:
        got = "missing" if self.actual is None else f"id {self.actual}"
        return f"{self.token!r}: expected id {self.expected}, tokenizer has {got}"


class KimiTokenizer:
    """A Kimi-K2.x tokenizer read from a folder, with its special ids verified at load."""

    def __init__(self, folder: str | os.PathLike[str], *, expected_special: dict[str, int] | None = None):
        self.folder = Path(folder)
        ranks_path = self.folder / TIKTOKEN_FILE
        config_path = self.folder / CONFIG_FILE
        for p in (ranks_path, config_path):
            if not p.is_file():
                raise TokenizerFolderError(f"{self.folder}: no {p.name} (is this a Kimi tokenizer folder?)")
        ranks = read_tiktoken_ranks(ranks_path)
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise TokenizerFolderError(f"{config_path}: not valid JSON ({e})") from None
        self.config = config
        named = {int(i): entry["content"] for i, entry in config.get("added_tokens_decoder", {}).items()}
        n_ranks = len(ranks)
        self.special_tokens = {
            named.get(i, reserved_token_name(i)): i for i in range(n_ranks, n_ranks + NUM_RESERVED_SPECIAL)
        }
        self.encoding = tiktoken.Encoding(
            name=f"kimi:{self.folder.name}",
            pat_str=KIMI_PAT_STR,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )
        self.vocab_size = self.encoding.n_vocab
        expected = KIMI_SPECIAL_TOKENS if expected_special is None else expected_special
        mismatches = self.check_special_tokens(expected)
        if mismatches:
            lines = "\n  ".join(str(m) for m in mismatches)
            raise TokenizerFolderError(f"{self.folder}: special tokens do not match the Kimi-K2.x layout:\n  {lines}")

    def check_special_tokens(self, expected: dict[str, int]) -> list[SpecialTokenMismatch]:
        """Every expected token that is absent or at another id (media tokens only if present)."""
        out = []
        for token, want in expected.items():
            got = self.special_tokens.get(token)
            if got is None and token not in REQUIRED_SPECIAL_TOKENS:
                continue
            if got != want:
                out.append(SpecialTokenMismatch(token, want, got))
        return out

    # -- ids -----------------------------------------------------------------------------

    def token_id(self, special: str) -> int:
        """Id of a special token, from the loaded tokenizer (never a constant)."""
        try:
            return self.special_tokens[special]
        except KeyError:
            raise KeyError(f"{special!r} is not a special token of {self.folder}") from None

    @cached_property
    def special_ids(self) -> frozenset[int]:
        return frozenset(self.special_tokens.values())

    # -- encode / decode -------------------------------------------------------------------

    @staticmethod
    def _special_kwargs(allow_special: bool | AbstractSet[str]) -> dict:
        if allow_special is True:
            return {"allowed_special": "all"}
        if allow_special:
            return {"allowed_special": set(allow_special), "disallowed_special": ()}
        return {"disallowed_special": ()}

    def encode(self, text: str, *, allow_special: bool | AbstractSet[str] = False) -> list[int]:
        """Encode text exactly as Kimi's tokenizer does.

        With `allow_special=False` (the default) special-token strings in the text are encoded as
        ordinary text, which is what a model quoting "</think>" in prose generated. `True` maps
        every special-token string to its id (how the serving stack tokenizes a rendered prompt);
        a set maps only those.
        """
        special = self._special_kwargs(allow_special)
        return [t for piece in kimi_pieces(text) for t in self.encoding.encode(piece, **special)]

    def encode_batch(
        self, texts: Sequence[str], *, allow_special: bool | AbstractSet[str] = False, num_threads: int | None = None
    ) -> list[list[int]]:
        """Encode many texts in parallel (tiktoken's Rust threads), identical to `encode` each."""
        pieces: list[str] = []
        bounds: list[tuple[int, int]] = []
        for text in texts:
            start = len(pieces)
            pieces.extend(kimi_pieces(text))
            bounds.append((start, len(pieces)))
        threads = num_threads or os.cpu_count() or 1
        if allow_special:
            encoded = self.encoding.encode_batch(pieces, num_threads=threads, **self._special_kwargs(allow_special))
        else:  # no special token recognised at all: tiktoken's faster ordinary path, same ids
            encoded = self.encoding.encode_ordinary_batch(pieces, num_threads=threads)
        # Nearly every text is one piece: hand its list over instead of copying it.
        return [encoded[a] if b - a == 1 else [t for ids in encoded[a:b] for t in ids] for a, b in bounds]

    def decode(self, ids: Sequence[int]) -> str:
        return self.encoding.decode(list(ids))

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return self.encoding.decode_bytes(list(ids))
