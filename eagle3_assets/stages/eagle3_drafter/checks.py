"""Checks on the drafter: SGLang loads its checkpoint, its accept length, its gain in real speculative decoding."""

from __future__ import annotations

import math
from pathlib import Path

from eagle3_assets.common.outcome import CheckOutcome, Checks
from eagle3_assets.stages.eagle3_drafter.export import check_checkpoint

MIN_ACCEPT_LENGTH = 1.5


def drafter_keys(checkpoint: Path) -> CheckOutcome:
    """The checkpoint's keys, shapes and dtypes are exactly what SGLang loads for its kind. When it fails:
    do not serve it (SGLang would load it with random weights and accept nothing); the metadata lists the keys."""
    problems = check_checkpoint(checkpoint)
    return CheckOutcome(
        not problems,
        "loadable by SGLang" if not problems else f"{len(problems)} problem(s): {problems[0]}",
        {"problems": problems},
    )


def drafter_accept_length(trained: float, untrained: float, threshold: float = MIN_ACCEPT_LENGTH) -> CheckOutcome:
    """The trained drafter's simulated accept length is above the threshold and above an untrained drafter's. When it
    fails: more data or epochs (`epochs`, the datasets' budgets), or a lower `min_accept_length` for a tiny stand-in."""
    ok = not math.isnan(trained) and trained >= threshold and trained > untrained
    return CheckOutcome(
        ok,
        f"accept length {trained:.3f} (untrained {untrained:.3f}, threshold {threshold})",
        {"accept_length": trained, "untrained": untrained, "threshold": threshold},
    )


def drafter_beats_floor(figures: dict | None, margin: float = 0.1) -> CheckOutcome:
    """In real speculative decoding with the target (greedy, chain drafting), the trained drafter's accept length
    (SGLang's definition) beats an untrained drafter's by at least the margin, and the output equals the target's own
    greedy decoding, but for a decode that first differs at a tie its dtype cannot resolve (bf16: the verify forward
    and one-token decoding round differently). When it fails: if not lossless, the decoding loop is at fault (report
    it, with the divergence in the metadata); else the drafter learned too little: more data or epochs, or check the
    layer ids against the store's."""
    if figures is None:
        return CheckOutcome(
            True,
            "not measured: the target is too large to decode here (use "
            "benchmarks/serving_speculative.py on the GPU host)",
            {"measured": False},
        )
    gain = figures["accept_length_real"] - figures["accept_length_real_untrained"]
    ok = figures["lossless_up_to_ties"] and gain >= margin
    if figures["lossless"]:
        lossless = "lossless"
    elif figures["lossless_up_to_ties"]:
        lossless = f"lossless up to {figures['mismatched_at_ties']} tie(s) the target's dtype cannot resolve"
    else:
        lossless = "NOT lossless"
    return CheckOutcome(
        ok,
        f"{figures['label']}: accept length {figures['accept_length_real']} vs untrained "
        f"{figures['accept_length_real_untrained']} (gain {gain:+.3f}, margin {margin}); {lossless}",
        {**figures, "margin": margin},
    )


DRAFTER_CHECKS: Checks = {
    "sglang_keys": (drafter_keys, "ERROR"),
    "accept_length": (drafter_accept_length, "WARN"),
    "speculative_gain": (drafter_beats_floor, "ERROR"),
}
