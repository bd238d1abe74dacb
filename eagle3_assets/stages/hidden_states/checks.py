"""Checks on the stored hidden states: shapes, the EAGLE-3 layers, the record count, finite values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import polars as pl

from eagle3_assets.common.outcome import CheckOutcome, Checks
from eagle3_assets.stages.hidden_states.capture_check import capture_matches_forward
from eagle3_resources.hidden_states.layers import eagle3_aux_layers


def hidden_state_shapes(root: Path, selected: pl.DataFrame) -> CheckOutcome:
    """Every shard holds ids [T], mask [T], aux [T, 3H] and final [T, H] with offsets ending at T, and every stored
    sample has as many rows as the merged set has tokens for it. When it fails: delete the named shards and
    re-materialize `hidden_states` (only they are redone); a mismatch of H means the target changed."""
    # torch-using: imported when the check runs, so loading the definitions stays torch-free
    from eagle3_resources.hidden_states.store import KEYS, HiddenStateStore

    store = HiddenStateStore(root, tolerate_damage=True)
    H = store.hidden_size
    bad: list[dict[str, Any]] = [{"shard": name, "error": why} for name, why in store.damaged.items()]
    for name in store.manifest["shards"]:
        if name in store.damaged:
            continue
        f = store.shard(name)
        shapes = {k: f.shape(k) if k in f.tensors else None for k in (*KEYS, "offsets")}
        T = (shapes["input_ids"] or (0,))[0]
        want = {
            "input_ids": (T,),
            "loss_mask": (T,),
            "aux_hidden_states": (T, 3 * H),
            "final_hidden_state": (T, H),
            "offsets": shapes["offsets"],
        }
        n = (shapes["offsets"] or (0,))[0]
        if shapes != want or n == 0 or int(f.rows("offsets", n - 1, n)[0]) != T:
            bad.append({"shard": name, "shapes": {k: list(v) if v else None for k, v in shapes.items()}})
    wrong_length = [
        sid
        for sid, n in selected.select("sample_id", "n_tokens").rows()
        if sid in store and store.shapes(sid)["input_ids"][0] != n
    ]
    return CheckOutcome(
        not bad and not wrong_length,
        f"{len(store.manifest['shards']) - len(bad)} of {len(store.manifest['shards'])} shards have the expected "
        f"shapes; {len(wrong_length)} samples with a row count other than their tokens",
        {"hidden_size": H, "bad_shards": bad[:20], "wrong_length": wrong_length[:20]},
    )


def hidden_state_layers(root: Path, selected: pl.DataFrame) -> CheckOutcome:
    """The recorded layers are the EAGLE-3 rule [1, N//2-1, N-4] of the target, in its stated convention. When it fails:
    the store was written by another target or backend; delete it and re-materialize `hidden_states`."""
    from eagle3_resources.hidden_states.store import read_manifest

    m = read_manifest(root)
    want = eagle3_aux_layers(m["num_target_layers"])
    return CheckOutcome(
        m["aux_layer_ids"] == want and bool(m.get("layer_convention")),
        f"layers {m['aux_layer_ids']} of a {m['num_target_layers']}-layer target (rule: {want})",
        {"aux_layer_ids": m["aux_layer_ids"], "expected": want, "convention": m.get("layer_convention")},
    )


def hidden_state_count(root: Path, selected: pl.DataFrame) -> CheckOutcome:
    """Every selected sample is stored, and nothing else is; every committed shard's file is readable and of its
    recorded size. When it fails: re-materialize `hidden_states` (it writes what is missing and redoes a damaged
    shard); extra samples are from an older selection."""
    from eagle3_resources.hidden_states.store import HiddenStateStore

    store = HiddenStateStore(root, tolerate_damage=True)
    wanted = set(selected["sample_id"].to_list())
    missing = [sid for sid in selected["sample_id"].to_list() if sid not in store]
    extra = sorted(set(store.index) - wanted)
    damaged = sorted(store.damaged)
    return CheckOutcome(
        not missing and not extra and not damaged,
        f"{len(store)} stored samples for {len(wanted)} selected ({len(missing)} missing, {len(extra)} extra), "
        f"{len(store.manifest['shards'])} shards" + (f", {len(damaged)} damaged" if damaged else ""),
        {
            "stored": len(store),
            "selected": len(wanted),
            "missing": missing[:20],
            "extra": extra[:20],
            "damaged": {n: store.damaged[n] for n in damaged[:20]},
        },
    )


def hidden_state_finite(nan_samples: list[str]) -> CheckOutcome:
    """No NaN or infinite value in any hidden state written by this run. When it fails: the target overflowed (dtype,
    weights or device); check the named samples and the target's dtype before training on them."""
    return CheckOutcome(
        not nan_samples, f"{len(nan_samples)} samples with non-finite values", {"samples": nan_samples[:20]}
    )


HIDDEN_STATE_CHECKS: Checks = {
    "shapes": (hidden_state_shapes, "ERROR"),
    "layer_ids": (hidden_state_layers, "ERROR"),
    "record_count": (hidden_state_count, "ERROR"),
    "finite": (hidden_state_finite, "ERROR"),
    "matches_forward": (capture_matches_forward, "ERROR"),
}
# computed by the asset from what it ran (the extraction's report, the target it loaded), not from (root, selected)
RUN_CHECKS = ("finite", "matches_forward")
