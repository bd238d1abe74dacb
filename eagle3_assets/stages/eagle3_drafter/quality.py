"""What the drafter buys, measured by decoding: the trained drafter and an untrained one (the floor), each in real
speculative decoding with the target on the eval split's prompts, checked lossless against greedy decoding."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl
import torch

from eagle3_assets.stages.eagle3_drafter.export import read_checkpoint
from eagle3_assets.stages.eagle3_drafter.model import DrafterConfig, Eagle3Drafter
from eagle3_assets.stages.eagle3_drafter.speculative import SpecDecodeReport, evaluate_speculative


@dataclass
class SpeculativeQuality:
    trained: SpecDecodeReport
    untrained: SpecDecodeReport

    def figures(self) -> dict:
        t, u = self.trained.totals(), self.untrained.totals()
        return {
            "accept_length_real": t["accept_length_sglang"],
            "accept_length_real_untrained": u["accept_length_sglang"],
            "accept_length_real_gain": round((t["accept_length_sglang"] or 0) - (u["accept_length_sglang"] or 0), 4),
            "position_acceptance_real": t["position_acceptance"],
            "position_acceptance_real_untrained": u["position_acceptance"],
            "lossless": bool(self.trained.lossless and self.untrained.lossless),
            "lossless_up_to_ties": bool(self.trained.lossless_up_to_ties and self.untrained.lossless_up_to_ties),
            "mismatched_at_ties": t["mismatched_at_ties"] + u["mismatched_at_ties"],
            "speedup": t["speedup"],
            "label": "proxy (stand-in target)" if self.trained.proxy else "target",
            "draft_steps": self.trained.draft_steps,  # chains decoded: the figure's ceiling is one more
        }


def eval_prompts(merged: pl.DataFrame, n: int, max_prompt_tokens: int = 1024) -> list[list[int]]:
    """The first `n` eval-split prompts (training split if there is no eval split): ids before the completion."""
    split = merged.filter(pl.col("split") == "eval")
    if split.height == 0:
        split = merged.filter(pl.col("split") == "train")
    prompts = []
    for ids, mask in split.select("input_ids", "loss_mask").head(n).iter_rows():
        first = next((i for i, m in enumerate(mask) if m), len(ids))
        if first > 0:
            prompts.append(list(ids[:first])[-max_prompt_tokens:])
    return prompts


def drafter_from_checkpoint(folder: Path, embed: torch.Tensor) -> tuple[Eagle3Drafter, DrafterConfig]:
    """The drafter a checkpoint folder holds, of its kind (read from its config.json), its weights loaded."""
    ckpt = read_checkpoint(Path(folder))
    cfg = ckpt.drafter_config
    model = Eagle3Drafter(cfg, embed, ckpt.draft_ids)
    ckpt.load_into(model)
    return model.eval(), cfg


def target_weight_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))


@dataclass(frozen=True)
class DecodeEval:
    """How the drafters are measured: the first `prompts` eval-split prompts, `max_new_tokens` each, chains of
    `draft_steps` (top-1); the untrained floor starts from `seed`, as training did; `aux_layer_ids`: the target
    layers the drafter was trained on; `proxy`: the target is the stand-in."""

    prompts: int
    max_new_tokens: int
    draft_steps: int
    seed: int
    aux_layer_ids: list[int]
    proxy: bool


def measure_speculative(
    target_model: Any, checkpoint: Path, merged: pl.DataFrame, how: DecodeEval, log: Callable[[str], None]
) -> SpeculativeQuality:
    """Both drafters decode the same prompts; the untrained one starts from the seed training started from."""
    embed = target_model.get_input_embeddings().weight.detach().float().cpu()
    trained, cfg = drafter_from_checkpoint(checkpoint, embed)
    torch.manual_seed(how.seed)
    untrained = Eagle3Drafter(cfg, embed, trained.draft_ids.cpu()).eval()
    device = target_model.get_input_embeddings().weight.device
    chosen = eval_prompts(merged, how.prompts)
    reports = {}
    for name, drafter in (("trained", trained), ("untrained", untrained)):
        reports[name] = evaluate_speculative(
            target_model,
            drafter.to(device),
            chosen,
            draft_steps=how.draft_steps,
            max_new_tokens=how.max_new_tokens,
            proxy=how.proxy,
            aux_layer_ids=how.aux_layer_ids,
        )
        t = reports[name].totals()
        log(
            f"speculative decoding, {name} drafter, {len(chosen)} prompts: accept length {t['accept_length_sglang']} "
            f"(SGLang's definition), per position {t['position_acceptance']}, lossless {t['lossless']}, "
            f"{t['spec_tokens_per_s']} vs greedy {t['greedy_tokens_per_s']} tokens/s"
        )
    return SpeculativeQuality(reports["trained"], reports["untrained"])
