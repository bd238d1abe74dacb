"""Build the stand-in tokenizer: a Kimi-layout tokenizer folder made offline, deterministically.

A byte-level BPE is trained with Hugging Face `tokenizers` on text the project ships (the prompt
files), pre-split with Kimi's own regex, and written as a Kimi folder: `tiktoken.model` with
exactly 163,584 ranks and `tokenizer_config.json` naming the special tokens at their Kimi ids.
It then loads through `KimiTokenizer`, the same code that loads the real Kimi-K2.5 folder.

Ranks the small corpus cannot fill are padded with tokens that start with bytes 0xFE 0xFF,
which never occur in UTF-8 text, so BPE can never produce them.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import regex
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from eagle3_resources.atomic_files import published_folder
from eagle3_resources.tokenizer.kimi import (
    KIMI_PAT_STR,
    KimiTokenizer,
    write_tiktoken_ranks,
)
from eagle3_resources.tokenizer.special_tokens import (
    BOS,
    EOS,
    KIMI_SPECIAL_TOKENS,
    NUM_BPE_RANKS,
    PAD,
    UNK,
)

BUILDER_VERSION = "1"
TRAINED_VOCAB = 24_000  # upper bound; a small corpus stops earlier
MIN_PAIR_FREQUENCY = 2
UNREACHABLE_PREFIX = b"\xfe\xff"


def corpus_strings(files: Iterable[Path]) -> Iterable[str]:
    """Every string value in the given JSON Lines files (contents, tool schemas, names)."""

    def walk(value):
        if isinstance(value, str):
            yield value
        elif isinstance(value, dict):
            for k, v in value.items():
                yield k
                yield from walk(v)
        elif isinstance(value, list):
            for v in value:
                yield from walk(v)

    for path in files:
        for line in Path(path).read_text(encoding="utf-8").split("\n"):
            line = line.strip()
            if not line:
                continue
            try:
                yield from walk(json.loads(line))
            except json.JSONDecodeError:
                yield line  # bad lines still carry text; the prompt stage reports them


def corpus_fingerprint(files: list[Path]) -> str:
    h = hashlib.sha256(BUILDER_VERSION.encode())
    for path in sorted(files):
        h.update(Path(path).name.encode())
        h.update(Path(path).read_bytes())
    return h.hexdigest()[:12]


def _byte_decoder() -> dict[str, int]:
    """Inverse of the GPT-2 byte-to-unicode table that byte-level BPE vocabularies use."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}  # appended in pairs


def train_ranks(texts: Iterable[str]) -> list[bytes]:
    """Byte-level BPE tokens in merge order: 256 single bytes, then every learned merge."""
    splitter = regex.compile(KIMI_PAT_STR, flags=regex.V1)
    words: Counter[str] = Counter()
    for text in texts:
        words.update(splitter.findall(text))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TRAINED_VOCAB,
        min_frequency=MIN_PAIR_FREQUENCY,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Sorted, repeated by count: the trainer sees the same input on every machine.
    tok.train_from_iterator((w for w, c in sorted(words.items()) for _ in range(c)), trainer=trainer)
    decoder = _byte_decoder()
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    tokens = [bytes(decoder[ch] for ch in piece) for piece, _ in vocab]
    singles = {t for t in tokens if len(t) == 1}
    # Every byte must be a rank of its own or some text would be unencodable.
    tokens = [bytes([b]) for b in range(256) if bytes([b]) not in singles] + tokens
    return tokens


def build_standin_tokenizer(out_dir: Path, corpus_files: list[Path]) -> Path:
    """Write a Kimi-layout tokenizer folder at `out_dir` (atomically) and return it."""
    tokens = train_ranks(corpus_strings(corpus_files))
    if len(tokens) > NUM_BPE_RANKS:
        tokens = tokens[:NUM_BPE_RANKS]
    filler = NUM_BPE_RANKS - len(tokens)
    tokens += [UNREACHABLE_PREFIX + str(i).encode() for i in range(filler)]
    assert len(set(tokens)) == NUM_BPE_RANKS

    config = {
        "tokenizer_class": "TikTokenTokenizer",
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "special": True,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
            }
            for t, i in sorted(KIMI_SPECIAL_TOKENS.items(), key=lambda kv: kv[1])
        },
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "model_max_length": 262144,
        "standin": {
            "what": "stand-in for the Kimi-K2.5 tokenizer: Kimi's special ids and regex, a small trained BPE",
            "trained_ranks": NUM_BPE_RANKS - filler,
            "unreachable_filler_ranks": filler,
            "corpus_files": [Path(p).name for p in sorted(corpus_files)],
        },
    }
    out_dir = Path(out_dir)
    with published_folder(out_dir, replace=False, marker="tiktoken.model") as tmp:  # a concurrent build may win
        write_tiktoken_ranks(tmp / "tiktoken.model", tokens)
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        KimiTokenizer(tmp)  # refuse to publish a folder that does not load
    return out_dir


def ensure_standin_tokenizer(cache_root: Path, corpus_files: list[Path]) -> Path:
    """The stand-in folder for this corpus, built on first use and reused afterwards."""
    if not corpus_files:
        raise FileNotFoundError("no corpus files to build the stand-in tokenizer from")
    folder = Path(cache_root) / f"tokenizer-{corpus_fingerprint(corpus_files)}"
    if not (folder / "tiktoken.model").is_file():
        build_standin_tokenizer(folder, corpus_files)
    return folder
