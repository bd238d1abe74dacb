"""Hidden states from a Hugging Face model on CPU (or one GPU): the embedded default.

Forward hooks on the decoder layers capture each layer's output directly, so the recorded
layers do not depend on how a transformers version fills `output_hidden_states`; the final
hidden state is the base model's `last_hidden_state`, i.e. after the final norm.
"""

from __future__ import annotations

from typing import Any

import torch

from eagle3_resources.hidden_states.layers import eagle3_aux_layers


class TransformersHiddenStates:
    name = "transformers"

    def __init__(self, model, layer_ids: list[int] | None = None):
        self.model = model
        base = model.model
        self.layers = base.layers
        self.num_layers = len(self.layers)
        self.layer_ids = layer_ids or eagle3_aux_layers(self.num_layers)
        self.hidden_size = model.config.hidden_size

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "num_layers": self.num_layers, "hidden_size": self.hidden_size}

    @torch.no_grad()
    def extract(self, input_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [L, 3H] low->high, final [L, H]) for one sequence."""
        captured: dict[int, torch.Tensor] = {}

        def hook(i):
            def fn(_module, _inputs, output):
                captured[i] = (output[0] if isinstance(output, tuple) else output).detach()

            return fn

        handles = [self.layers[i].register_forward_hook(hook(i)) for i in self.layer_ids]
        try:
            ids = torch.tensor([input_ids], device=self.model.device)
            final = self.model.model(input_ids=ids, use_cache=False).last_hidden_state[0]
        finally:
            for h in handles:
                h.remove()
        aux = torch.cat([captured[i][0] for i in self.layer_ids], dim=-1)
        return aux, final
