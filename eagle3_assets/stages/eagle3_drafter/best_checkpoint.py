"""The checkpoint that decodes best: every N optimizer steps, real speculative decoding on the held-out prompts,
per prompt kind, and the drafter with the highest accept length kept (not the one with the lowest loss, not the
last).

What one evaluation at global step s does (main process only, outside the training clock, on every rank):
1. exports the drafter as SGLang/vLLM load it (`export.export_checkpoint`: bf16 safetensors) to `step-<s>/` beside
   the training checkpoint, then reads that folder back (`quality.drafter_from_checkpoint`, the target's own
   embedding) -- so what is measured is what would be shipped, bit for bit;
2. decodes the held-out prompts with the target in the lossless loop (`speculative.evaluate_speculative`, greedy,
   top-1 chains of `draft_steps`), per prompt kind; the accept length is SGLang's (completion tokens / verify
   passes), pooled over all prompts and per kind;
3. records (step, accept length overall and per kind, the step's training loss, the evaluation's seconds) in
   `curve.json`, replacing any earlier record of the same step (a resumed run that evaluates a step again
   overwrites it, never duplicates it), and, when the accept length beats the best so far (strictly: the earlier
   step wins a tie), names `step-<s>/` the best in the same atomic write;
4. deletes the step folders no longer named (the previous best, or this step's when it is not the best).

`curve.json` is the keeper's whole state, written atomically (temporary file, fsync, rename): a kill at any moment
leaves the previous state or the new one, and a stray step folder that the next evaluation removes. It carries the
training run's fingerprint; a keeper that finds another run's curve starts afresh. A resumed run is exact (the
trainer's guarantee), so a step it evaluates again scores what it scored before the kill.

At the end (`finish`): the last step is evaluated if its multiple of N did not fall on it, and the best drafter's
weights are loaded into the trained model, which the pipeline then scores and exports as before: the exported
checkpoint is the best one.

Several ranks (torchrun, `processes` > 1; offline and in streaming mode). Every rank runs the hook and `finish`;
rank 0 evaluates (the target is loaded there alone) while the others wait for its word (`rank_zero.RankZeroWord`,
as the spool's followers wait for rank 0's next step): over a gloo group, in rounds of a heartbeat that rank 0 sends
from a thread while it exports and decodes, so no rank waits in one collective past the process group's timeout
(NCCL's 10 minutes by default) however long the decode takes, and none waits in the next step's gradient all-reduce.
The training clock is paused on every rank. An error of rank 0's evaluation is told to every rank, which raises it
(`DrafterError`, with rank 0's reason). The keeper's state is rank 0's files, as with one process, so a resumed run
(kill -9 included) picks its curve up the same; the weights loaded at the end are rank 0's model's, the one it exports.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from eagle3_assets.stages.eagle3_drafter.export import export_checkpoint, read_checkpoint
from eagle3_assets.stages.eagle3_drafter.model import Eagle3Drafter
from eagle3_assets.stages.eagle3_drafter.quality import UNREGISTERED as UNREGISTERED
from eagle3_assets.stages.eagle3_drafter.quality import dataset_kind as dataset_kind
from eagle3_assets.stages.eagle3_drafter.quality import drafter_from_checkpoint
from eagle3_assets.stages.eagle3_drafter.rank_zero import Ranks, RankZeroWord
from eagle3_assets.stages.eagle3_drafter.speculative import evaluate_speculative
from eagle3_assets.stages.eagle3_drafter.train import Every, Trainer
from eagle3_resources.atomic_files import write_json_atomic
from eagle3_resources.errors import DrafterError

CURVE_FILE = "curve.json"


@dataclass(frozen=True)
class BestCheckpointPlan:
    """What the keeper is given: evaluate every `every` optimizer steps, with `target` (a transformers causal LM,
    the stand-in or the real target; None on a rank other than 0, which never decodes) decoding up to
    `prompts_per_kind` eval-split prompts of each kind, `max_new_tokens` each, in chains of `draft_steps` (top-1)."""

    every: int
    target: Any
    prompts_per_kind: int = 4
    max_new_tokens: int = 48
    draft_steps: int = 3

    def __post_init__(self) -> None:
        if self.every < 1 or self.prompts_per_kind < 1:
            raise ValueError(f"the best-checkpoint keeper needs every >= 1 and prompts_per_kind >= 1, got {self}")


def plan_from_spec(
    best: Mapping[str, Any] | None, log: Callable[[str], None], dist: Ranks
) -> BestCheckpointPlan | None:
    """The plan of a training process's spec (`best`: every, prompts_per_kind, max_new_tokens, draft_steps, and the
    target and tokenizer resources as their config; None: off). Every rank calls it at the same point: rank 0 loads
    the target while the others wait for its word in heartbeat rounds (`RankZeroWord.alone`), so a load slower than
    the collective timeout never fails the first collective they meet next; a load that fails ends every rank with
    rank 0's reason."""
    if not best:
        return None

    def load() -> Any:
        from eagle3_resources.target.resource import TargetModelResource
        from eagle3_resources.tokenizer.resource import TokenizerResource

        return TargetModelResource(**best["target"]).load_model(TokenizerResource(**best["tokenizer"]), log)

    def failed(reason: str) -> Exception:
        return DrafterError(f"rank 0 of the trainer failed loading the target for the best checkpoint: {reason}")

    return BestCheckpointPlan(
        every=int(best["every"]),
        target=RankZeroWord(dist).alone(load, failed),  # None on the other ranks, which never decode
        prompts_per_kind=int(best["prompts_per_kind"]),
        max_new_tokens=int(best["max_new_tokens"]),
        draft_steps=int(best["draft_steps"]),
    )


def prompts_by_kind(
    merged: pl.DataFrame,
    per_kind: int,
    kind_of: Callable[[str], str] = dataset_kind,
    max_prompt_tokens: int = 1024,
) -> dict[str, list[list[int]]]:
    """The first `per_kind` eval-split prompts of each kind (the training split's when there is no eval split):
    each sample's ids before its first completion token, in the merged set's order; kinds sorted by name."""
    split = merged.filter(pl.col("split") == "eval")
    if split.height == 0:
        split = merged.filter(pl.col("split") == "train")
    out: dict[str, list[list[int]]] = {}
    for dataset, ids, mask in split.select("dataset", "input_ids", "loss_mask").iter_rows():
        chosen = out.setdefault(kind_of(dataset), [])
        first = next((i for i, m in enumerate(mask) if m), len(ids))
        if len(chosen) < per_kind and first > 0:
            chosen.append(list(ids[:first])[-max_prompt_tokens:])
    return {k: v for k, v in sorted(out.items()) if v}


def measure_by_kind(
    target: Any,
    drafter: Eagle3Drafter,
    prompts: Mapping[str, Sequence[Sequence[int]]],
    draft_steps: int,
    max_new_tokens: int,
    aux_layer_ids: Sequence[int],
) -> dict[str, Any]:
    """The lossless loop over each kind's prompts: SGLang's accept length (generated tokens / verify passes) pooled
    over every prompt, and per kind."""
    tokens, rounds, by_kind = 0, 0, {}
    for kind, chosen in prompts.items():
        report = evaluate_speculative(
            target,
            drafter,
            chosen,
            draft_steps=draft_steps,
            max_new_tokens=max_new_tokens,
            proxy=True,
            aux_layer_ids=aux_layer_ids,
            compare_greedy=False,
        )
        t = report.totals()
        by_kind[kind] = t["accept_length_sglang"]
        tokens, rounds = tokens + t["tokens"], rounds + t["verify_rounds"]
    return {"accept_length": round(tokens / rounds, 4) if rounds else None, "by_kind": by_kind}


def step_folder(step: int) -> str:
    return f"step-{step:08d}"


class BestCheckpointKeeper:
    """The hook (`hook()`), its durable state (`folder`/curve.json and the best drafter's folder beside it), and the
    end of the run (`finish`). Every rank runs the hook and `finish`; only the main process evaluates, the others wait
    for its word (the module's docstring)."""

    def __init__(
        self,
        folder: Path,
        plan: BestCheckpointPlan,
        prompts: Mapping[str, Sequence[Sequence[int]]],
        aux_layer_ids: list[int],
        fingerprint: str,
        log: Callable[[str], None],
        main: bool = True,
    ):
        if not prompts:
            raise ValueError("the best-checkpoint keeper has no held-out prompt to decode")
        self.folder, self.plan, self.prompts = Path(folder), plan, prompts
        self.aux_layer_ids, self.fingerprint, self.log = aux_layer_ids, fingerprint, log
        empty: dict[str, Any] = {"fingerprint": fingerprint, "curve": [], "best": None}
        # the main process alone reads and writes the folder
        self.state: dict[str, Any] = self.read_state() if main else empty
        self.evaluated_here: set[int] = set()  # steps this process evaluated (a resume re-evaluates, overwriting)
        self.word: RankZeroWord | None = None  # rank 0's word to the other ranks, made at the first evaluation

    # -------------------------------------------------------- state

    def read_state(self) -> dict[str, Any]:
        """The curve of this very training run (its fingerprint), or an empty one (another run's is removed)."""
        path = self.folder / CURVE_FILE
        if path.exists():
            state = json.loads(path.read_text())
            if state.get("fingerprint") == self.fingerprint:
                return state
            self.log(f"best checkpoint: {path} is another training run's; starting its curve afresh")
            shutil.rmtree(self.folder)
        return {"fingerprint": self.fingerprint, "curve": [], "best": None}

    @property
    def curve(self) -> list[dict[str, Any]]:
        return list(self.state["curve"])

    @property
    def best(self) -> dict[str, Any] | None:
        """The best record ({step, accept_length, by_kind, loss, seconds}), None before the first evaluation."""
        return self.state["best"]

    def best_folder(self) -> Path:
        if self.best is None:
            raise ValueError("no evaluation has run: there is no best checkpoint")
        return self.folder / step_folder(self.best["step"])

    # -------------------------------------------------------- the hook

    def hook(self) -> Every:
        return Every(self.plan.every, self.evaluate)

    def alone(self, trainer: Trainer, call: Callable[[], Any]) -> None:
        """`call()` on the main process, outside the training clock (on every rank), while the other ranks wait for
        its word; its error raised on every rank."""
        if self.word is None:
            self.word = RankZeroWord(trainer.dist)
        step = trainer.global_step

        def failed(reason: str) -> Exception:
            return DrafterError(f"rank 0 of the trainer failed keeping the best checkpoint at step {step}: {reason}")

        with trainer.clock.paused():
            self.word.alone(call, failed)

    def evaluate(self, trainer: Trainer) -> None:
        """Main process only, outside the training clock: export, read back, decode, record; keep when best."""
        self.alone(trainer, lambda: self.evaluate_step(trainer.model, trainer.global_step, last_loss(trainer)))

    def evaluate_step(self, model: Eagle3Drafter, step: int, loss: float | None) -> dict[str, Any]:
        started = time.perf_counter()
        self.folder.mkdir(parents=True, exist_ok=True)
        exported = export_checkpoint(model, self.folder / step_folder(step), self.aux_layer_ids)
        embed = self.plan.target.get_input_embeddings().weight.detach().float().cpu()
        drafter, _ = drafter_from_checkpoint(exported, embed)
        device = self.plan.target.get_input_embeddings().weight.device
        measured = measure_by_kind(
            self.plan.target,
            drafter.to(device),
            self.prompts,
            self.plan.draft_steps,
            self.plan.max_new_tokens,
            self.aux_layer_ids,
        )
        record = {"step": step, **measured, "loss": loss, "seconds": round(time.perf_counter() - started, 2)}
        best = self.best
        better = best is None or best["step"] == step or (record["accept_length"] or 0) > best["accept_length"]
        curve = sorted([r for r in self.state["curve"] if r["step"] != step] + [record], key=lambda r: r["step"])
        kept = record if better or best is None else best
        self.state = {"fingerprint": self.fingerprint, "curve": curve, "best": kept}
        write_json_atomic(self.folder / CURVE_FILE, self.state, indent=1)
        self.remove_unnamed_folders()
        self.evaluated_here.add(step)
        kinds = ", ".join(f"{k} {v}" for k, v in measured["by_kind"].items())
        self.log(
            f"best checkpoint: step {step}: accept length {record['accept_length']} ({kinds}), loss {loss}, "
            f"{record['seconds']} s" + ("; the best so far" if better else f"; the best stays step {kept['step']}")
        )
        return record

    def remove_unnamed_folders(self) -> None:
        keep = step_folder(self.best["step"]) if self.best is not None else None
        for path in self.folder.glob("step-*"):
            if path.name != keep:
                shutil.rmtree(path, ignore_errors=True)

    # -------------------------------------------------------- the end of the run

    def finish(self, trainer: Trainer) -> dict[str, Any]:
        """Every rank: the last step evaluated unless this process just did, and the best drafter's weights loaded
        into the trained model (main process, the one that exports it). Returns what the asset records: the curve and
        the best (the main process's)."""
        self.alone(trainer, lambda: self.load_best(trainer))
        return self.summary()

    def load_best(self, trainer: Trainer) -> None:
        if trainer.global_step not in self.evaluated_here:
            self.evaluate_step(trainer.model, trainer.global_step, last_loss(trainer))
        read_checkpoint(self.best_folder()).load_into(trainer.model)
        best = self.best or {}
        self.log(
            f"best checkpoint: step {best.get('step')} of {trainer.global_step}, accept length "
            f"{best.get('accept_length')}; its weights are the ones exported"
        )

    def summary(self) -> dict[str, Any]:
        p = self.plan
        return {
            "best": self.best,
            "curve": self.curve,
            "every": p.every,
            "prompts": {k: len(v) for k, v in self.prompts.items()},
            "max_new_tokens": p.max_new_tokens,
            "draft_steps": p.draft_steps,
        }


def last_loss(trainer: Trainer) -> float | None:
    """The training loss of the step just taken (one device read; the evaluation reads the device anyway)."""
    if trainer.pending:
        return round(float(trainer.pending[-1][0]), 6)
    return trainer.history.step_loss[-1] if trainer.history.step_loss else None
