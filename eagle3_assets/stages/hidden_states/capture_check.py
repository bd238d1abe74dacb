"""The stored capture checked against a plain forward of the target, before any training reads it.

The first tokens of a few stored samples go through the target once more, the plain way: one unbatched forward with
transformers' `output_hidden_states` (not the capture's hooks, padding, batching or shard writes). The stored aux
states (the recorded layers, in the manifest's order) and final hidden state must equal that forward's up to the
store's bf16 rounding. A capture that is silently wrong (layers off by one, another sample's rows, a tensor-parallel
all-reduce fusion that corrupts the captured residual, as sglang PR #28343 fixed for Kimi-K2.5) fails here, and the
check blocks the drafter. Causal attention makes a prefix's states those of the whole sample, so a few tokens do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3_assets.common.outcome import CheckOutcome

SAMPLES = 2
TOKENS = 32
# relative L2 error per tensor: the store's bf16 rounding leaves ~0.003; a neighbouring layer is off by ~0.3 or more
TOLERANCE = 0.02


def plain_forward(model: Any, ids: list[int], layer_ids: list[int]) -> tuple[Any, Any]:
    """(aux [n, len(layer_ids) x H], final [n, H]) in fp32 on the CPU: the outputs of `layer_ids` (0-based, HF's
    hidden_states[i + 1]) and the post-norm last hidden state, from one forward of `ids`."""
    import torch

    from eagle3_resources.hidden_states.transformers_backend import text_causal_lm

    lm = text_causal_lm(model)
    device = lm.get_input_embeddings().weight.device
    with torch.inference_mode():
        out = lm.model(input_ids=torch.tensor([ids], device=device), output_hidden_states=True, use_cache=False)
    aux = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
    return aux.float().cpu(), out.last_hidden_state[0].float().cpu()


def relative_error(reference: Any, stored: Any) -> float:
    return float((reference - stored.float()).norm() / reference.norm().clamp(min=1e-12))


def capture_matches_forward(model: Any, root: Path, samples: int = SAMPLES, tokens: int = TOKENS) -> CheckOutcome:
    """The first `tokens` of the first `samples` stored samples (by id) against `plain_forward`. When it fails: the
    capture does not record what the target computes; do not train on it (fix the backend, delete the store)."""
    from eagle3_resources.hidden_states.store import HiddenStateStore, read_manifest

    layer_ids = list(read_manifest(root)["aux_layer_ids"])
    store = HiddenStateStore(root)
    rows: list[dict[str, Any]] = []
    errors: list[float] = []
    try:
        for sample_id in sorted(store.sample_ids())[:samples]:
            stored = store[sample_id]
            n = min(tokens, int(stored["input_ids"].shape[0]))
            aux, final = plain_forward(model, [int(t) for t in stored["input_ids"][:n]], layer_ids)
            H = final.shape[1]
            per_tensor = {
                f"layer_{layer}": relative_error(
                    aux[:, k * H : (k + 1) * H], stored["aux_hidden_states"][:n, k * H : (k + 1) * H]
                )
                for k, layer in enumerate(layer_ids)
            }
            per_tensor["final"] = relative_error(final, stored["final_hidden_state"][:n])
            errors += per_tensor.values()
            rows.append({"sample_id": sample_id, "tokens": n} | {k: round(v, 5) for k, v in per_tensor.items()})
    finally:
        store.close()
    if not errors:
        return CheckOutcome(False, "no stored sample to check the capture on", {"layer_ids": layer_ids})
    worst = max(errors)
    return CheckOutcome(
        worst <= TOLERANCE,
        f"{len(rows)} samples' first {tokens} tokens against a plain forward of the target: largest relative error "
        f"{worst:.4f} (at most {TOLERANCE}; the store's bf16 rounding leaves ~0.003)",
        {"layer_ids": layer_ids, "samples": rows, "largest_relative_error": worst, "tolerance": TOLERANCE},
    )
