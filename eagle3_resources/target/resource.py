"""The target model resource: a Hugging Face model folder, or the stand-in tiny DeepseekV3."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import dagster as dg
from pydantic import Field

from eagle3_resources.storage import PROJECT_ROOT
from eagle3_resources.tokenizer.resource import TokenizerResource, standin_corpus_files
from eagle3_resources.tokenizer.standin import corpus_strings

_models: dict[tuple[str, str, str], object] = {}
_lock = threading.Lock()


class TargetModelResource(dg.ConfigurableResource):
    """Where the target model's weights are, and how the CPU (transformers) backends load them.

    `path` is a local Hugging Face model folder (config.json + safetensors). Unset, the stand-in
    tiny DeepseekV3 is made (once) under `standin_dir`: unpacked from the weights the project ships
    (`standin_weights`) when they were fitted for this stand-in tokenizer, else fitted to it there.
    The SGLang backends do not load weights here: they talk to a server that has them.
    """

    path: str | None = Field(default=None, description="HF model folder; unset = stand-in")
    standin_dir: str = Field(description="where the stand-in target is built and cached")
    standin_weights: str = Field(
        default="data/standin/target.safetensors",
        description="the stand-in's fitted weights as shipped (eagle3_resources/target/standin_weights.py; relative: "
        "to the project root); used when fitted for the stand-in tokenizer in use, else the stand-in is fitted "
        "(1,000 steps on one thread: ~7 min on a 2-core AVX2 machine)",
    )
    device: str = Field(
        default="auto",
        description="torch device for the transformers backends: `auto` = CUDA when "
        "present, else CPU; or `cpu`, `cuda`, `cuda:1`",
    )
    dtype: str = Field(
        default="auto",
        description="torch dtype for the transformers backends: `auto` = bfloat16 on CUDA, "
        "float32 on CPU; or any torch dtype name",
    )
    device_map: str | None = Field(
        default=None,
        description="spread a target too large for one GPU over all visible "
        "GPUs (`auto`, `balanced`, needs the `accelerate` package: the `[gpu]` extra); "
        "unset = the whole model on `device`",
    )

    @property
    def is_standin(self) -> bool:
        """No `path`: the tiny stand-in (8 layers, hidden 64) is what the local backends load."""
        return not self.path

    def resolved(self) -> tuple[str, str]:
        """(device, dtype) with `auto` decided for this host."""
        import torch

        device = ("cuda" if torch.cuda.is_available() else "cpu") if self.device == "auto" else self.device
        dtype = ("bfloat16" if device.startswith("cuda") else "float32") if self.dtype == "auto" else self.dtype
        return device, dtype

    def folder(self, tokenizer: TokenizerResource, log: Callable[[str], None] = print) -> Path:
        if self.path:
            return Path(self.path)
        # torch-using: imported when the stand-in is built, so loading the definitions stays torch-free
        from eagle3_resources.target.standin_weights import ensure_standin_target

        tok = tokenizer.load()
        shipped = Path(self.standin_weights)
        return ensure_standin_target(
            Path(self.standin_dir),
            tok,
            lambda: corpus_strings(standin_corpus_files(tokenizer.standin_corpus)),
            log=log,
            shipped=shipped if shipped.is_absolute() else PROJECT_ROOT / shipped,
        )

    def load_model(self, tokenizer: TokenizerResource, log: Callable[[str], None] = print):
        """The model in eval mode, loaded once per process."""
        import torch
        from transformers import AutoModelForCausalLM

        folder = self.folder(tokenizer, log)
        device, dtype = self.resolved()
        key = (str(folder.resolve()), self.device_map or device, dtype)
        with _lock:
            if key not in _models:
                if self.device_map:
                    model = AutoModelForCausalLM.from_pretrained(
                        folder, dtype=getattr(torch, dtype), device_map=self.device_map
                    )
                else:
                    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
                    model = model.to(device)  # type: ignore[arg-type]  # transformers types `to` through wraps: no self
                log(f"target {folder.name} loaded on {self.device_map or device} in {dtype}")
                _models[key] = model.eval()
            return _models[key]
