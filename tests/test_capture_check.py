"""The hidden-state capture checked against a plain forward of the target (`hidden_states` check `matches_forward`).

A store captured by the transformers backend passes; captures that are silently wrong, as a backend could make them
(the hooks on the next layers while the manifest names the rule's, or the residual perturbed by a few percent as a
broken all-reduce fusion would), fail, before any drafter trains on them.
"""

from __future__ import annotations

import torch

from eagle3_assets.stages.hidden_states.capture_check import TOLERANCE, capture_matches_forward
from eagle3_resources.hidden_states.extract import StoreSettings, extract_to_store
from eagle3_resources.hidden_states.store import StoredSample, read_manifest
from eagle3_resources.hidden_states.transformers_backend import TransformersHiddenStates

SETTINGS = StoreSettings(shard_bytes=60_000, batch_tokens=96, free_bytes=10**12, reserve_bytes=0)


def samples(vocab: int) -> list[StoredSample]:
    g = torch.Generator().manual_seed(5)
    out = []
    for i, n in enumerate((40, 9, 33)):
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        out.append(StoredSample(f"S/{i}", "train", ids, [1] * n))
    return out


class CapturesTheNextLayers(TransformersHiddenStates):
    """Hooks one layer too deep, while the manifest records the rule's layers (the off-by-one a server can make)."""

    def extract_batch(self, sequences):
        claimed = self.layer_ids
        self.layer_ids = [i + 1 for i in claimed]
        try:
            return super().extract_batch(sequences)
        finally:
            self.layer_ids = claimed


class PerturbsTheResidual(TransformersHiddenStates):
    """Adds 5 % noise to what it captured, as an all-reduce fusion that corrupts the residual would."""

    def extract_batch(self, sequences):
        g = torch.Generator().manual_seed(0)
        return [
            (
                aux
                + 0.05 * aux.norm(dim=-1, keepdim=True) / aux.shape[-1] ** 0.5 * torch.randn(aux.shape, generator=g),
                f,
            )
            for aux, f in super().extract_batch(sequences)
        ]


def capture(backend, target_model, root):
    extract_to_store(
        samples(target_model.config.vocab_size), backend, root, SETTINGS, identity={}, progress_every_s=3600
    )
    return root


def test_a_true_capture_matches_the_plain_forward(target_model, tmp_path):
    root = capture(TransformersHiddenStates(target_model), target_model, tmp_path / "store")
    outcome = capture_matches_forward(target_model, root)
    print(outcome.description, outcome.metadata["samples"])
    assert outcome.passed, outcome.description
    assert len(outcome.metadata["samples"]) == 2 and outcome.metadata["largest_relative_error"] < 0.01
    # every recorded layer and the final state were compared, on each sample's first tokens
    assert set(outcome.metadata["samples"][0]) == {"sample_id", "tokens", "final"} | {
        f"layer_{i}" for i in read_manifest(root)["aux_layer_ids"]
    }


def test_the_next_layers_under_the_rules_names_fail(target_model, tmp_path):
    root = capture(CapturesTheNextLayers(target_model), target_model, tmp_path / "store")
    outcome = capture_matches_forward(target_model, root)
    assert not outcome.passed and outcome.metadata["largest_relative_error"] > 10 * TOLERANCE, outcome.description


def test_a_residual_perturbed_by_a_few_percent_fails(target_model, tmp_path):
    root = capture(PerturbsTheResidual(target_model), target_model, tmp_path / "store")
    outcome = capture_matches_forward(target_model, root)
    assert not outcome.passed, outcome.description
    final_errors = [row["final"] for row in outcome.metadata["samples"]]
    assert max(final_errors) < 0.01  # the final state was stored untouched: the aux layers are what fail
