"""Checks on the drafter: SGLang loads its checkpoint, it reads what the target captured and proposes the tokens it
was trained on, its accept length, and its gain in real speculative decoding. The first two and the last are the
release gate: blocking, so a drafter that would accept nothing never reaches the asset's consumers."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from eagle3_assets.common.outcome import CheckOutcome, Checks

MIN_ACCEPT_LENGTH = 1.5


def drafter_keys(checkpoint: Path) -> CheckOutcome:
    """The checkpoint's keys, shapes and dtypes are exactly what SGLang loads for its kind. When it fails:
    do not serve it (SGLang would load it with random weights and accept nothing); the metadata lists the keys."""
    # torch-using: imported when the check runs, so loading the definitions stays torch-free
    from eagle3_assets.stages.eagle3_drafter.export import check_checkpoint

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


def export_problems(checkpoint: Path, captured_layer_ids: Sequence[int] | None, draft_ids: Sequence[int]) -> list[str]:
    """How the exported files disagree with what training used: the aux layer ids (both servers' keys) against the
    layers the hidden-state store captured, d2t against the trainer's draft vocabulary, t2d against d2t."""
    from safetensors import safe_open

    from eagle3_assets.stages.eagle3_drafter.export import (
        WEIGHTS_FILE,
        sglang_layer_ids,
        trained_layer_ids,
        vllm_layer_ids,
    )

    folder = Path(checkpoint)
    try:
        cfg = json.loads((folder / "config.json").read_text())
        sglang_ids = list(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        vllm_ids = list(cfg["eagle_aux_hidden_state_layer_ids"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"config.json has no readable aux layer ids ({e!r})"]
    problems = []
    if captured_layer_ids is not None:
        captured = list(captured_layer_ids)
        if sglang_ids != sglang_layer_ids(captured):
            problems.append(
                f"SGLang would capture layers {sglang_ids} (eagle_config), the drafter was trained on "
                f"{captured}: SGLang's key should be {sglang_layer_ids(captured)}"
            )
        if vllm_ids != vllm_layer_ids(captured):
            problems.append(
                f"vLLM would capture target layers {trained_layer_ids(cfg)}, the drafter was trained on {captured}"
            )
    try:
        with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as f:
            d2t = f.get_tensor("d2t").long() if "d2t" in f.keys() else None
            t2d = f.get_tensor("t2d").bool() if "t2d" in f.keys() else None
    except OSError as e:
        return [*problems, f"{WEIGHTS_FILE} unreadable: {e}"]
    if d2t is None:
        return [*problems, "no d2t: the server cannot map draft ids to target ids"]
    import torch

    exported = (torch.arange(len(d2t)) + d2t).tolist()
    if draft_ids and exported != list(draft_ids):
        wrong = [i for i, (a, b) in enumerate(zip(exported, draft_ids, strict=False)) if a != b]
        first = wrong[0] if wrong else min(len(exported), len(draft_ids))
        problems.append(
            f"d2t maps {len(wrong) + abs(len(exported) - len(draft_ids))} of {len(draft_ids)} draft ids to other "
            f"target ids than training used (first: draft id {first})"
        )
    vocab = cfg.get("vocab_size")
    if any(t < 0 or (isinstance(vocab, int) and t >= vocab) for t in exported) or len(set(exported)) != len(exported):
        problems.append("d2t maps draft ids outside the target vocabulary or two draft ids to one target id")
    elif t2d is not None and torch.nonzero(t2d).squeeze(1).tolist() != sorted(exported):
        problems.append("t2d does not mark exactly the target ids d2t maps to")
    return problems


def drafter_matches_capture(
    checkpoint: Path, captured_layer_ids: Sequence[int] | None, draft_ids: Sequence[int]
) -> CheckOutcome:
    """The exported drafter (its files re-read from disk) reads the target layers it was trained on and proposes the
    tokens it was trained on. When it fails: do not serve it (a drafter fed other layers, or mapping its proposals to
    other ids, accepts almost nothing); re-export from the training folder and report the mismatch."""
    problems = export_problems(checkpoint, captured_layer_ids, draft_ids)
    checked = "aux layer ids" if captured_layer_ids is not None else "aux layer ids not checked (no store manifest)"
    return CheckOutcome(
        not problems,
        f"reads the layers it was trained on and maps its {len(draft_ids) or 'exported'} draft ids as trained"
        if not problems
        else f"{len(problems)} problem(s): {problems[0]}",
        {"problems": problems, "captured_layer_ids": list(captured_layer_ids or []), "checked": checked},
    )


def drafter_beats_floor(figures: dict | None, margin: float | None = 0.1) -> CheckOutcome:
    """In real speculative decoding with the target (greedy, chain drafting) of the exported drafter re-loaded from
    disk, its accept length (SGLang's definition) beats an untrained drafter's by at least the margin, overall and on
    every prompt kind decoded, and the output equals the target's own greedy decoding, but for a decode that first
    differs at a tie its dtype cannot resolve (bf16: the verify forward and one-token decoding round differently).
    The overall margin is the configured one or twice the standard error of the per-prompt gain, whichever is larger:
    a gain the prompts' spread could produce by chance does not pass. When it fails: if not lossless, the decoding loop
    is at fault (report it, with the divergence in the metadata); else the drafter learned too little (more data or
    epochs) or reads other layers or ids than it was trained on (the `matches_capture` check)."""
    if figures is None:
        return CheckOutcome(
            True,
            "not measured: the target is too large to decode here (use "
            "benchmarks/serving_speculative.py on the GPU host)",
            {"measured": False},
        )
    gain = figures["accept_length_real"] - figures["accept_length_real_untrained"]
    required = margin is not None
    margin = -math.inf if margin is None else margin  # None: measured and reported, not required
    error = figures.get("accept_length_real_gain_standard_error")
    # a margin of -inf gates nothing on the gain (losslessness alone), the prompts' spread included
    needed = max(margin, 2 * error) if error is not None and math.isfinite(margin) else margin
    by_kind = figures.get("accept_length_real_by_kind") or {}
    short = sorted(k for k, v in by_kind.items() if (v["trained"] or 0) - (v["untrained"] or 0) < margin)
    ok = figures["lossless_up_to_ties"] and gain >= needed and not short
    if figures["lossless"]:
        lossless = "lossless"
    elif figures["lossless_up_to_ties"]:
        lossless = f"lossless up to {figures['mismatched_at_ties']} tie(s) the target's dtype cannot resolve"
    else:
        lossless = "NOT lossless"
    kinds = f"; kinds under the margin: {', '.join(short)}" if short else (f"; {len(by_kind)} kinds" if by_kind else "")
    if not required:
        kinds += "; gain not required (min_accept_gain unset)"
    return CheckOutcome(
        ok,
        f"{figures['label']}: accept length {figures['accept_length_real']} vs untrained "
        f"{figures['accept_length_real_untrained']} (gain {gain:+.3f}, needed {needed:.3f}: margin {margin}"
        f"{'' if error is None else f', 2 x standard error {2 * error:.3f}'}){kinds}; {lossless}",
        {**figures, "margin": margin, "margin_needed": needed, "kinds_under_margin": short},
    )


DRAFTER_CHECKS: Checks = {
    "sglang_keys": (drafter_keys, "ERROR"),
    "matches_capture": (drafter_matches_capture, "ERROR"),
    "accept_length": (drafter_accept_length, "WARN"),
    "speculative_gain": (drafter_beats_floor, "ERROR"),
}
