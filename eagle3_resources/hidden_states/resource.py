"""The hidden-states resource: transformers (CPU, the default) or SGLang (GPU host)."""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

import dagster as dg
from pydantic import Field

from eagle3_resources.target.resource import TargetModelResource
from eagle3_resources.tokenizer.resource import TokenizerResource


class HiddenStatesBackendKind(str, Enum):  # noqa: UP042 - StrEnum would change str() of the config value
    TRANSFORMERS = "transformers"
    SGLANG = "sglang"


class HiddenStatesResource(dg.ConfigurableResource):
    """How the target's auxiliary and final hidden states are computed."""

    backend: HiddenStatesBackendKind = Field(
        default=HiddenStatesBackendKind.TRANSFORMERS, description="transformers | sglang"
    )
    sglang_tp_size: int = Field(default=8, description="tensor-parallel GPUs for the SGLang backend")
    sglang_mem_fraction: float = Field(default=0.8, description="SGLang mem_fraction_static")
    sglang_max_forward_tokens: int = Field(
        default=32768,
        description="SGLang backend: most tokens in one forward "
        "pass, each sample counted in whole KV pages; also the KV pool's size "
        "(max_total_tokens), the rest of sglang_mem_fraction is left to "
        "activations. At least max_length (a sample is never split)",
    )
    sglang_max_forward_requests: int = Field(
        default=512, description="SGLang backend: most samples in one forward pass (SGLang's max_running_requests)"
    )
    sglang_handoff_slabs: int = Field(
        default=2,
        description="SGLang backend: shared /dev/shm slabs rank 0 hands "
        "each forward's rows back through, each sglang_max_forward_tokens x (3 + 1) "
        "x hidden x 2 bytes (1.88 GB at Kimi-K2.5's defaults); two let rank 0 fill "
        "one while the parent reads the other",
    )
    max_length: int = Field(default=32768, description="longest sample (tokens) the backend accepts")
    batch_tokens: int = Field(
        default=8192,
        description="tokens per forward pass: a batch is several samples whose "
        "longest times their count stays within this (a longer sample goes alone). Larger "
        "batches use the GPU better and need more activation memory; 8192 suits the CPU "
        "stand-in, an 8-GPU Kimi host takes 32768 or more",
    )

    def make_backend(
        self, target: TargetModelResource, tokenizer: TokenizerResource, log: Callable[[str], None] = print
    ):
        if self.backend is HiddenStatesBackendKind.SGLANG:
            from eagle3_resources.hidden_states.sglang_backend import SGLangHiddenStates, SGLangOptions

            options = SGLangOptions(
                tp_size=self.sglang_tp_size,
                max_length=self.max_length,
                mem_fraction_static=self.sglang_mem_fraction,
                max_forward_tokens=self.sglang_max_forward_tokens,
                max_forward_requests=self.sglang_max_forward_requests,
                handoff_slabs=self.sglang_handoff_slabs,
            )
            return SGLangHiddenStates(str(target.folder(tokenizer, log)), options)
        from eagle3_resources.hidden_states.transformers_backend import (
            TransformersHiddenStates,
        )

        return TransformersHiddenStates(target.load_model(tokenizer, log))
