"""The target model resource: a Hugging Face model folder, or the stand-in tiny DeepseekV3."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import dagster as dg
from pydantic import Field

from eagle3_resources.target.standin import ensure_standin_target
from eagle3_resources.tokenizer.resource import TokenizerResource, standin_corpus_files
from eagle3_resources.tokenizer.standin import corpus_strings

_models: dict[tuple[str, str, str], object] = {}
_lock = threading.Lock()


class TargetModelResource(dg.ConfigurableResource):
    """Where the target model's weights are, and how the CPU (transformers) backends load them.

    `path` is a local Hugging Face model folder (config.json + safetensors). Unset, the stand-in
    tiny DeepseekV3 is built (once) under `standin_dir`, fitted to the stand-in tokenizer.
    The SGLang backends do not load weights here: they talk to a server that has them.
    """

    path: Optional[str] = Field(default=None, description="HF model folder; unset = stand-in")
    standin_dir: str = Field(description="where the stand-in target is built and cached")
    device: str = Field(default="cpu", description="torch device for the transformers backends")
    dtype: str = Field(default="float32", description="torch dtype for the transformers backends")

    def folder(self, tokenizer: TokenizerResource, log: Callable[[str], None] = print) -> Path:
        if self.path:
            return Path(self.path)
        tok = tokenizer.load()
        return ensure_standin_target(
            Path(self.standin_dir), tok, lambda: corpus_strings(standin_corpus_files(tokenizer.standin_corpus)), log=log
        )

    def load_model(self, tokenizer: TokenizerResource, log: Callable[[str], None] = print):
        """The model in eval mode, loaded once per process."""
        import torch
        from transformers import AutoModelForCausalLM

        folder = self.folder(tokenizer, log)
        key = (str(folder.resolve()), self.device, self.dtype)
        with _lock:
            if key not in _models:
                model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, self.dtype))
                _models[key] = model.to(self.device).eval()
            return _models[key]
