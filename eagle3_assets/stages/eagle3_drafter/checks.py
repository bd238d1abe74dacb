"""Checks on the training side: the merged set, the stored hidden states, the drafter."""

from __future__ import annotations

import math
from pathlib import Path

import polars as pl

from eagle3_assets.common.outcome import CheckOutcome, Checks
from eagle3_assets.stages.eagle3_drafter.export import check_checkpoint
from eagle3_resources.hidden_states.layers import eagle3_aux_layers
from eagle3_resources.hidden_states.store import KEYS, HiddenStateStore, read_manifest

MIN_ACCEPT_LENGTH = 1.5


def dataset_mix(merged: pl.DataFrame, datasets: list[str]) -> CheckOutcome:
    """Every registered dataset contributes samples to the merged set. When it fails: materialize `token_ids` for the
    datasets it names (a range run, or the backfill dialog), then `merged_dataset` again."""
    counts = dict(merged.group_by("dataset").len().rows())
    missing = [d for d in datasets if counts.get(d, 0) == 0]
    total = max(1, merged.height)
    return CheckOutcome(
        not missing,
        f"{len(datasets) - len(missing)} of {len(datasets)} datasets present" + (f"; missing: {', '.join(missing)}" if missing else ""),
        {"share_pct": {d: round(100 * counts.get(d, 0) / total, 2) for d in datasets}, "missing": missing},
    )


def token_totals(merged: pl.DataFrame, *_) -> CheckOutcome:
    """Token counts add up: ids and masks have equal lengths, every sample trains on some tokens. When it fails: the
    named samples' `token_ids` rows are malformed; look at their `token_ids` checks and re-materialize that dataset."""
    lengths_ok = merged.select((pl.col("input_ids").list.len() == pl.col("n_tokens")).all()).item() if merged.height else True
    masks_ok = merged.select((pl.col("loss_mask").list.len() == pl.col("input_ids").list.len()).all()).item() if merged.height else True
    no_loss = merged.filter(pl.col("loss_mask").list.sum() == 0).height
    tokens, loss = int(merged["n_tokens"].sum() or 0), int(merged["completion_len"].sum() or 0)
    return CheckOutcome(
        merged.height > 0 and lengths_ok and masks_ok and no_loss == 0,
        f"{merged.height} samples, {tokens:,} tokens, {loss:,} under the loss mask",
        {"samples": merged.height, "tokens": tokens, "loss_tokens": loss, "lengths_consistent": lengths_ok,
         "masks_consistent": masks_ok, "samples_without_loss_tokens": no_loss},
    )


def hidden_state_shapes(root: Path, selected: pl.DataFrame) -> CheckOutcome:
    """Every shard holds ids [T], mask [T], aux [T, 3H] and final [T, H] with offsets ending at T, and every stored
    sample has as many rows as the merged set has tokens for it. When it fails: delete the named shards and
    re-materialize `hidden_states` (only they are redone); a mismatch of H means the target changed."""
    store = HiddenStateStore(root, tolerate_damage=True)
    H = store.hidden_size
    bad = [{"shard": name, "error": why} for name, why in store.damaged.items()]
    for name in store.manifest["shards"]:
        if name in store.damaged:
            continue
        f = store.shard(name)
        shapes = {k: f.shape(k) if k in f.tensors else None for k in (*KEYS, "offsets")}
        T = (shapes["input_ids"] or (0,))[0]
        want = {"input_ids": (T,), "loss_mask": (T,), "aux_hidden_states": (T, 3 * H), "final_hidden_state": (T, H),
                "offsets": shapes["offsets"]}
        n = (shapes["offsets"] or (0,))[0]
        if shapes != want or n == 0 or int(f.rows("offsets", n - 1, n)[0]) != T:
            bad.append({"shard": name, "shapes": {k: list(v) if v else None for k, v in shapes.items()}})
    wrong_length = [sid for sid, n in selected.select("sample_id", "n_tokens").rows()
                    if sid in store and store.shapes(sid)["input_ids"][0] != n]
    return CheckOutcome(not bad and not wrong_length,
                        f"{len(store.manifest['shards']) - len(bad)} of {len(store.manifest['shards'])} shards have the expected "
                        f"shapes; {len(wrong_length)} samples with a row count other than their tokens",
                        {"hidden_size": H, "bad_shards": bad[:20], "wrong_length": wrong_length[:20]})


def hidden_state_layers(root: Path, selected: pl.DataFrame) -> CheckOutcome:
    """The recorded layers are the EAGLE-3 rule [1, N//2-1, N-4] of the target, in its stated convention. When it fails:
    the store was written by another target or backend; delete it and re-materialize `hidden_states`."""
    m = read_manifest(root)
    want = eagle3_aux_layers(m["num_target_layers"])
    return CheckOutcome(m["aux_layer_ids"] == want and bool(m.get("layer_convention")),
                        f"layers {m['aux_layer_ids']} of a {m['num_target_layers']}-layer target (rule: {want})",
                        {"aux_layer_ids": m["aux_layer_ids"], "expected": want, "convention": m.get("layer_convention")})


def hidden_state_count(root: Path, selected: pl.DataFrame) -> CheckOutcome:
    """Every selected sample is stored, and nothing else is; every committed shard's file is readable and of its
    recorded size. When it fails: re-materialize `hidden_states` (it writes what is missing and redoes a damaged
    shard); extra samples are from an older selection."""
    store = HiddenStateStore(root, tolerate_damage=True)
    wanted = set(selected["sample_id"].to_list())
    missing = [sid for sid in selected["sample_id"].to_list() if sid not in store]
    extra = sorted(set(store.index) - wanted)
    damaged = sorted(store.damaged)
    return CheckOutcome(not missing and not extra and not damaged,
                        f"{len(store)} stored samples for {len(wanted)} selected ({len(missing)} missing, {len(extra)} extra), "
                        f"{len(store.manifest['shards'])} shards" + (f", {len(damaged)} damaged" if damaged else ""),
                        {"stored": len(store), "selected": len(wanted), "missing": missing[:20], "extra": extra[:20],
                         "damaged": {n: store.damaged[n] for n in damaged[:20]}})


def hidden_state_finite(nan_samples: list[str]) -> CheckOutcome:
    """No NaN or infinite value in any hidden state written by this run. When it fails: the target overflowed (dtype,
    weights or device); check the named samples and the target's dtype before training on them."""
    return CheckOutcome(not nan_samples, f"{len(nan_samples)} samples with non-finite values", {"samples": nan_samples[:20]})


def drafter_keys(checkpoint: Path) -> CheckOutcome:
    """The checkpoint's keys, shapes and dtypes are exactly what SGLang's `LlamaForCausalLMEagle3` loads. When it fails:
    do not serve it (SGLang would load it with random weights and accept nothing); the metadata lists the keys."""
    problems = check_checkpoint(checkpoint)
    return CheckOutcome(not problems, "loadable by SGLang" if not problems else f"{len(problems)} problem(s): {problems[0]}",
                        {"problems": problems})


def drafter_accept_length(trained: float, untrained: float, threshold: float = MIN_ACCEPT_LENGTH) -> CheckOutcome:
    """The trained drafter's simulated accept length is above the threshold and above an untrained drafter's. When it
    fails: more data or epochs (`epochs`, the datasets' budgets), or a lower `min_accept_length` for a tiny stand-in."""
    ok = not math.isnan(trained) and trained >= threshold and trained > untrained
    return CheckOutcome(ok, f"accept length {trained:.3f} (untrained {untrained:.3f}, threshold {threshold})",
                        {"accept_length": trained, "untrained": untrained, "threshold": threshold})


def drafter_beats_floor(figures: dict | None, margin: float = 0.1) -> CheckOutcome:
    """In real speculative decoding with the target (greedy, chain drafting), the trained drafter's accept length
    (SGLang's definition) beats an untrained drafter's by at least the margin, and the output equals the target's own
    greedy decoding. When it fails: if not lossless, the decoding loop or the target's dtype is at fault (report it);
    else the drafter learned too little: more data or epochs, or check the layer ids against the store's."""
    if figures is None:
        return CheckOutcome(True, "not measured: the target is too large to decode here (use "
                            "benchmarks/serving_speculative.py on the GPU host)", {"measured": False})
    gain = figures["accept_length_real"] - figures["accept_length_real_untrained"]
    ok = figures["lossless"] and gain >= margin
    return CheckOutcome(ok, f"{figures['label']}: accept length {figures['accept_length_real']} vs untrained "
                        f"{figures['accept_length_real_untrained']} (gain {gain:+.3f}, margin {margin}); "
                        f"{'lossless' if figures['lossless'] else 'NOT lossless'}", {**figures, "margin": margin})


MERGED_CHECKS: Checks = {"dataset_mix": (dataset_mix, "WARN"), "token_totals": (token_totals, "ERROR")}
HIDDEN_STATE_CHECKS: Checks = {
    "shapes": (hidden_state_shapes, "ERROR"),
    "layer_ids": (hidden_state_layers, "ERROR"),
    "record_count": (hidden_state_count, "ERROR"),
    "finite": (hidden_state_finite, "ERROR"),
}
DRAFTER_CHECKS: Checks = {"sglang_keys": (drafter_keys, "ERROR"), "accept_length": (drafter_accept_length, "WARN"),
                          "speculative_gain": (drafter_beats_floor, "ERROR")}
