"""The tokenizer resource: the real Kimi-K2.5 tokenizer folder, or the stand-in built locally."""

from __future__ import annotations

import threading
from pathlib import Path

import dagster as dg
from pydantic import Field

from eagle3_resources.storage import PROJECT_ROOT
from eagle3_resources.tokenizer.chat_format import TemplateVersion
from eagle3_resources.tokenizer.kimi import KimiTokenizer
from eagle3_resources.tokenizer.standin import ensure_standin_tokenizer

_cache: dict[str, KimiTokenizer] = {}
_lock = threading.Lock()


def standin_corpus_files(corpus_dir: str) -> list[Path]:
    folder = Path(corpus_dir)
    if not folder.is_absolute():
        folder = PROJECT_ROOT / folder
    return sorted(folder.glob("*.jsonl"))


def load_tokenizer(folder: Path) -> KimiTokenizer:
    """Load (once per process) and verify a Kimi tokenizer folder."""
    key = str(Path(folder).resolve())
    with _lock:
        if key not in _cache:
            _cache[key] = KimiTokenizer(folder)
        return _cache[key]


class TokenizerResource(dg.ConfigurableResource):
    """Kimi-K2.x tokenizer and chat-template settings.

    `path` is a local Kimi tokenizer folder (`tiktoken.model` + `tokenizer_config.json`, e.g. a
    download of moonshotai/Kimi-K2.5); unset, a stand-in with Kimi's special ids and chat format is
    built under `standin_dir` from the shipped prompt files. Either way every special token is
    checked against its Kimi id at load.
    """

    path: str | None = Field(default=None, description="Kimi tokenizer folder; unset = stand-in")
    standin_dir: str = Field(description="where the stand-in tokenizer is built and cached")
    standin_corpus: str = Field(default="data/prompts", description="JSON Lines files the stand-in BPE is trained on")
    template_version: TemplateVersion = Field(
        default=TemplateVersion.K2_5,
        description="k2.5 (TypeScript tool declaration, K2.5/K2.6) or k2 (JSON, K2/K2-Thinking)",
    )
    thinking: bool = Field(
        default=True, description="generation prompt ends in `<think>` (on) or `<think></think>` (off)"
    )

    def folder(self) -> Path:
        if self.path:
            return Path(self.path)
        return ensure_standin_tokenizer(Path(self.standin_dir), standin_corpus_files(self.standin_corpus))

    def load(self) -> KimiTokenizer:
        return load_tokenizer(self.folder())

    @property
    def is_standin(self) -> bool:
        return not self.path
