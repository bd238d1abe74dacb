"""Which target layers feed an EAGLE-3 drafter, and what the ids mean."""

from __future__ import annotations

# Recorded with the data: ids are OUTPUTS of 0-based decoder layers. The same layers are
# HF `hidden_states[i + 1]`, and "capture before layer i + 1". SGLang's
# `eagle_aux_hidden_state_layer_ids` uses this convention on every version.
LAYER_CONVENTION = "output of decoder layer i (0-based) == HF hidden_states[i+1]"
FINAL_CONVENTION = "final hidden state after the model's final norm (the LM-head input)"


def eagle3_aux_layers(num_layers: int) -> list[int]:
    """The EAGLE-3 rule `[1, N//2 - 1, N - 4]` (SpecForge, Model-Optimizer); Kimi (61): [1, 29, 57]."""
    ids = [1, num_layers // 2 - 1, num_layers - 4]
    if not (0 <= ids[0] < ids[1] < ids[2] < num_layers):
        raise ValueError(f"a {num_layers}-layer target has no three distinct EAGLE-3 layers (rule gives {ids})")
    return ids
