"""Hidden states from a Hugging Face model: the stand-in on CPU (the default), or a target on GPUs.

Forward hooks on the decoder layers capture each layer's output directly (the residual stream,
exactly HF's `hidden_states[i + 1]`), so the recorded layers do not depend on how a transformers
version fills `output_hidden_states`; the final hidden state is the base model's
`last_hidden_state`, i.e. after the final norm. A batch is right-padded to its longest sample with
an attention mask: under causal attention a real token never sees the padding, and positions
start at 0 for every row. With `device_map` the model spans several GPUs; hooks run on whichever
device holds their layer.
"""

from __future__ import annotations

from typing import Any

import torch

from eagle3_resources.hidden_states.layers import eagle3_aux_layers


def text_causal_lm(model):
    """The causal LM inside a multimodal wrapper (Kimi-K2.5 keeps its DeepseekV3 as `language_model`), or the model."""
    for candidate in (
        model,
        getattr(model, "language_model", None),
        getattr(getattr(model, "model", None), "language_model", None),
    ):
        if candidate is not None and hasattr(getattr(candidate, "model", None), "layers"):
            return candidate
    raise ValueError(f"{type(model).__name__} has no decoder layers at .model.layers or .language_model.model.layers")


class TransformersHiddenStates:
    name = "transformers"

    def __init__(self, model, layer_ids: list[int] | None = None):
        self.model = text_causal_lm(model)
        self.layers = self.model.model.layers
        self.num_layers = len(self.layers)
        self.layer_ids = list(layer_ids) if layer_ids is not None else eagle3_aux_layers(self.num_layers)
        self.hidden_size = self.model.config.hidden_size
        self.pad_id = int(getattr(self.model.config, "pad_token_id", None) or 0)

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    def describe(self) -> dict[str, Any]:
        p = next(self.model.parameters())
        return {
            "backend": self.name,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "device": str(self.device),
            "dtype": str(p.dtype).removeprefix("torch."),
            "device_map": {str(k): str(v) for k, v in (getattr(self.model, "hf_device_map", None) or {}).items()}
            or None,
        }

    def padded(self, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        longest = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), longest), dtype=torch.long)
        for row, s in enumerate(sequences):
            ids[row, : len(s)] = torch.as_tensor(s, dtype=torch.long)
            mask[row, : len(s)] = 1
        device = self.device
        if device.type == "cuda":  # a blocking copy from pageable memory would wait for the previous batch's forward
            return ids.pin_memory().to(device, non_blocking=True), mask.pin_memory().to(device, non_blocking=True)
        return ids.to(device), mask.to(device)

    @torch.inference_mode()
    def extract_batch(self, sequences: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per sequence: (aux [L, 3H] layers low -> high, final [L, H]), on the model's devices."""
        captured: dict[int, torch.Tensor] = {}

        def hook(i):
            def fn(_module, _inputs, output):
                captured[i] = output[0] if isinstance(output, tuple) else output

            return fn

        handles = [self.layers[i].register_forward_hook(hook(i)) for i in self.layer_ids]
        try:
            ids, mask = self.padded(sequences)
            final = self.model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        finally:
            for h in handles:
                h.remove()
        out_device = final.device
        aux = torch.cat([captured[i].to(out_device) for i in self.layer_ids], dim=-1)
        return [(aux[row, : len(s)], final[row, : len(s)]) for row, s in enumerate(sequences)]

    def extract(self, input_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.extract_batch([input_ids])[0]

    def close(self) -> None:
        """Nothing to stop: the model belongs to the target resource, which loads it once per process."""
