"""What the drafter buys, measured by decoding: the trained drafter and an untrained one (the floor), each in real
speculative decoding with the target on the eval split's prompts, checked lossless against greedy decoding."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
import torch

from eagle3_assets.common.registry import DATASETS
from eagle3_assets.stages.eagle3_drafter.export import read_checkpoint
from eagle3_assets.stages.eagle3_drafter.model import DrafterConfig, Eagle3Drafter
from eagle3_assets.stages.eagle3_drafter.speculative import (
    PromptResult,
    SpecDecodeReport,
    accept_lengths,
    evaluate_speculative,
)

UNREGISTERED = "unregistered"  # the kind of a dataset the registry does not name


def dataset_kind(dataset: str, registry: Mapping[str, Any] = DATASETS) -> str:
    """The prompt kind (chat, reasoning, function-calling, code) the dataset registry gives a dataset."""
    spec = registry.get(dataset)
    return str(spec.kind) if spec is not None else UNREGISTERED


def prompt_accept_length(p: PromptResult) -> float:
    """One prompt's accept length, SGLang's definition (`accept_lengths`); its token count when no verify ran."""
    return accept_lengths(p.spec.tokens, p.spec.accepted)["accept_length_sglang"] or float(p.spec.tokens)


@dataclass
class SpeculativeQuality:
    trained: SpecDecodeReport
    untrained: SpecDecodeReport
    kinds: list[str] = field(default_factory=list)  # each decoded prompt's kind, in the reports' order

    def by_kind(self) -> dict[str, dict[str, Any]]:
        """Per prompt kind: both drafters' accept length pooled over that kind's prompts, and how many."""
        out: dict[str, dict[str, Any]] = {}
        for kind in sorted(set(self.kinds)):
            rows = [i for i, k in enumerate(self.kinds) if k == kind]
            pooled = {}
            for name, report in (("trained", self.trained), ("untrained", self.untrained)):
                sub = SpecDecodeReport(report.proxy, report.draft_steps, report.max_new_tokens)
                sub.prompts = [report.prompts[i] for i in rows]
                pooled[name] = sub.totals()["accept_length_sglang"]
            out[kind] = {**pooled, "prompts": len(rows)}
        return out

    def gain_standard_error(self) -> float | None:
        """The standard error of the mean per-prompt gain (trained minus untrained accept length; None under 3
        prompts): how far apart two drafters of equal quality could land on these prompts by chance."""
        gains = [
            prompt_accept_length(t) - prompt_accept_length(u)
            for t, u in zip(self.trained.prompts, self.untrained.prompts, strict=True)
        ]
        if len(gains) < 3:
            return None
        mean = sum(gains) / len(gains)
        return math.sqrt(sum((g - mean) ** 2 for g in gains) / (len(gains) - 1) / len(gains))

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
            "accept_length_real_by_kind": self.by_kind(),
            "accept_length_real_gain_standard_error": self.gain_standard_error(),
        }


def eval_prompts(merged: pl.DataFrame, n: int, max_prompt_tokens: int = 1024) -> list[list[int]]:
    """The first `n` eval-split prompts (training split if there is no eval split): ids before the completion."""
    return [ids for ids, _ in eval_prompts_and_kinds(merged, n, max_prompt_tokens)]


def eval_prompts_and_kinds(
    merged: pl.DataFrame, n: int, max_prompt_tokens: int = 1024, kind_of: Callable[[str], str] = dataset_kind
) -> list[tuple[list[int], str]]:
    """`eval_prompts`, each with its dataset's prompt kind."""
    split = merged.filter(pl.col("split") == "eval")
    if split.height == 0:
        split = merged.filter(pl.col("split") == "train")
    datasets = split["dataset"] if "dataset" in split.columns else pl.Series([UNREGISTERED] * split.height)
    prompts = []
    for (ids, mask), dataset in zip(split.select("input_ids", "loss_mask").head(n).iter_rows(), datasets, strict=False):
        first = next((i for i, m in enumerate(mask) if m), len(ids))
        if first > 0:
            prompts.append((list(ids[:first])[-max_prompt_tokens:], kind_of(dataset)))
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
    target_model: Any,
    checkpoint: Path,
    merged: pl.DataFrame,
    how: DecodeEval,
    log: Callable[[str], None],
    floor: SpecDecodeReport | None = None,
) -> SpeculativeQuality:
    """Both drafters decode the same prompts; the untrained one starts from the seed training started from.
    `floor`: the untrained drafter's report of an earlier call with the same target, prompts, `how`, drafter config
    and draft ids (it decodes the same whatever was trained), taken with its greedy decodes instead of decoding
    them again."""
    embed = target_model.get_input_embeddings().weight.detach().float().cpu()
    trained, cfg = drafter_from_checkpoint(checkpoint, embed)
    torch.manual_seed(how.seed)
    untrained = Eagle3Drafter(cfg, embed, trained.draft_ids.cpu()).eval()
    device = target_model.get_input_embeddings().weight.device
    chosen_and_kinds = eval_prompts_and_kinds(merged, how.prompts)
    chosen = [ids for ids, _ in chosen_and_kinds]
    reports: dict[str, SpecDecodeReport] = {} if floor is None else {"untrained": floor}
    for name, drafter in (("trained", trained), ("untrained", untrained)):
        if name in reports:
            continue
        reports[name] = evaluate_speculative(
            target_model,
            drafter.to(device),
            chosen,
            draft_steps=how.draft_steps,
            max_new_tokens=how.max_new_tokens,
            proxy=how.proxy,
            aux_layer_ids=how.aux_layer_ids,
            greedy=reports.get("untrained" if name == "trained" else "trained"),  # the target's decodes, once
        )
        t = reports[name].totals()
        log(
            f"speculative decoding, {name} drafter, {len(chosen)} prompts: accept length {t['accept_length_sglang']} "
            f"(SGLang's definition), per position {t['position_acceptance']}, lossless {t['lossless']}, "
            f"{t['spec_tokens_per_s']} vs greedy {t['greedy_tokens_per_s']} tokens/s"
        )
    return SpeculativeQuality(reports["trained"], reports["untrained"], [kind for _, kind in chosen_and_kinds])
