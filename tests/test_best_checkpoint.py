"""The checkpoint that decodes best (issue 27, deliverable 3): every N steps the trainer decodes the held-out prompts
speculatively with the target (the lossless loop), per prompt kind, and the drafter exported is the one with the
highest accept length, not the last; its curve survives a kill and a resume without a duplicate step."""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from pathlib import Path

import polars as pl
import pytest
import torch
from safetensors.torch import load_file
from support import extract_merged

from eagle3_assets.stages.eagle3_drafter.asset import (
    DrafterTrainConfig,
    best_checkpoint_metadata,
    refuse_best_checkpoint,
)
from eagle3_assets.stages.eagle3_drafter.best_checkpoint import (
    CURVE_FILE,
    BestCheckpointPlan,
    measure_by_kind,
    prompts_by_kind,
)
from eagle3_assets.stages.eagle3_drafter.export import trained_layer_ids
from eagle3_assets.stages.eagle3_drafter.pipeline import DrafterJob, run_drafter_job
from eagle3_assets.stages.eagle3_drafter.quality import drafter_from_checkpoint
from eagle3_assets.stages.eagle3_drafter.speculative import greedy_generate
from eagle3_assets.stages.eagle3_drafter.train import CHECKPOINT_FILE, Every, Trainer, TrainSettings
from eagle3_resources.errors import DrafterError

REPO = Path(__file__).resolve().parents[1]
# English lines over 40 characters (the README's of 2026-12-06, frozen so that editing the README leaves the
# training tests' data, and the figures they assert, as they are).
TEXT_LINES = REPO / "tests" / "data" / "text_lines.txt"
# A1 chat, B1 function-calling, B2 code, B4 reasoning in data/datasets.yaml
DATASETS = ("A1", "B1", "B2", "B4")
SETTINGS = TrainSettings(
    ttt_steps=3, epochs=3, batch_tokens=256, max_len=64, seed=1, checkpoint_every=4, warmup_steps=2
)
EVERY = 2
NEW_TOKENS = 16
PER_KIND = 1


def corpus(tok, target_model, n: int = 16) -> pl.DataFrame:
    """Regenerated samples, as the pipeline trains on: a line of English text as the prompt and the target's own greedy
    continuation as the completion, so that training raises the real accept length."""
    lines = TEXT_LINES.read_text().splitlines()[:n]
    rows = []
    for i, line in enumerate(lines):
        prompt = tok.encode(line[:80])
        answer, _ = greedy_generate(target_model, prompt, 40, ())
        rows.append(
            {
                "sample_id": f"{DATASETS[i % 4]}/{i:03d}",
                "split": "eval" if i // 4 == 3 else "train",
                "dataset": DATASETS[i % 4],
                "input_ids": prompt + answer,
                "loss_mask": [0] * len(prompt) + [1] * len(answer),
                "n_tokens": len(prompt) + len(answer),
            }
        )
    return pl.DataFrame(rows, schema_overrides={"input_ids": pl.List(pl.Int32), "loss_mask": pl.List(pl.Int8)})


def stored_corpus(tmp_path_factory, tok, target_model) -> tuple[pl.DataFrame, Path]:
    """`corpus()` and its hidden-state store (a folder holding `merged.parquet` and `hidden_states/`), built once a
    run: three files train on it (this one, the DDP and release-gate tests), and the 16 greedy decodes and the
    extraction took minutes of each file's setup on 2 loaded cores. Under pytest-xdist the first worker to ask builds
    it in the run's shared temporary folder while the others wait on a file lock (as `standin_dir`); the trainers
    only read the store."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        shared = tmp_path_factory.getbasetemp().parent
    else:
        shared = tmp_path_factory.getbasetemp()
    root = shared / "best-checkpoint-corpus"
    with open(shared / "best-checkpoint-corpus.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not root.exists():
            building = Path(tempfile.mkdtemp(prefix="building-", dir=shared))
            merged = corpus(tok, target_model)
            merged.write_parquet(building / "merged.parquet")
            extract_merged(merged, target_model, building / "hidden_states")
            building.rename(root)  # whole or not at all: an interrupted build leaves no corpus to reuse
    return pl.read_parquet(root / "merged.parquet"), root


@pytest.fixture(scope="module")
def data(tmp_path_factory, tok, target_model, target_resource, tokenizer_resource):
    merged, root = stored_corpus(tmp_path_factory, tok, target_model)
    return {"root": root, "merged": merged, "target": target_resource.folder(tokenizer_resource)}


def job(data, out: Path, target_model, logs: list[str], **kw) -> DrafterJob:
    return DrafterJob(
        data["root"] / "hidden_states",
        data["merged"],
        data["target"],
        out,
        kw.pop("settings", SETTINGS),
        512,
        logs.append,
        device="cpu",
        best=BestCheckpointPlan(EVERY, target_model, prompts_per_kind=PER_KIND, max_new_tokens=NEW_TOKENS),
        **kw,
    )


def spike_after(step: int, factor: float):
    """A hook that multiplies the learning rate by `factor` from `step` on: a later phase that decodes worse."""

    def spike(trainer: Trainer) -> None:
        if trainer.global_step == step:
            trainer.sched.base_lrs = [lr * factor for lr in trainer.sched.base_lrs]

    return Every(1, spike)


@pytest.mark.slow
def test_prompts_are_grouped_by_the_registry_kind(data):
    by_kind = prompts_by_kind(data["merged"], 2)
    assert list(by_kind) == ["chat", "code", "function-calling", "reasoning"]
    assert all(len(v) == 1 for v in by_kind.values())  # one eval sample of each dataset


@pytest.mark.slow
def test_the_exported_drafter_is_the_best_by_real_accept_length_not_the_last(data, target_model, tmp_path):
    logs: list[str] = []
    out = tmp_path / "drafter"
    report = run_drafter_job(job(data, out, target_model, logs, hooks=(spike_after(8, 1000.0),)))
    assert report is not None and report.best_checkpoint is not None
    curve, best = report.best_checkpoint["curve"], report.best_checkpoint["best"]
    total_steps = len(report.history.step_loss)
    assert [r["step"] for r in curve] == list(range(EVERY, total_steps + 1, EVERY))  # the last step evaluated too
    lengths = {r["step"]: r["accept_length"] for r in curve}
    # what makes this test mean something: the spike makes the later phase decode worse, so the best is not last
    assert best["accept_length"] > lengths[total_steps] and best["step"] < total_steps
    assert best["accept_length"] == max(lengths.values()) and lengths[best["step"]] == best["accept_length"]
    assert set(best["by_kind"]) == {"chat", "code", "function-calling", "reasoning"}

    # the exported checkpoint, read back as SGLang's format is read, decodes with the best accept length again
    embed = target_model.get_input_embeddings().weight.detach().float().cpu()
    exported, _ = drafter_from_checkpoint(out, embed)
    prompts = prompts_by_kind(data["merged"], PER_KIND)
    again = measure_by_kind(target_model, exported, prompts, 3, NEW_TOKENS, trained_layer_ids(report.config))
    assert again == {"accept_length": best["accept_length"], "by_kind": best["by_kind"]}
    assert report.config["eagle3_pipeline"]["best_step"] == best["step"]
    # its weights are the best step's, bit for bit, and not the last step's (the training checkpoint holds those)
    kept = out.parent / "drafter.training" / "best" / f"step-{best['step']:08d}" / "model.safetensors"
    shipped = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(t, shipped[k]) for k, t in load_file(str(kept)).items())
    last = torch.load(out.parent / "drafter.training" / CHECKPOINT_FILE, weights_only=False)["model"]
    assert not torch.equal(last["fc.weight"].to(torch.bfloat16), shipped["fc.weight"])
    on_disk = json.loads((out.parent / "drafter.training" / "best" / CURVE_FILE).read_text())
    assert on_disk["curve"] == curve and on_disk["best"] == best
    assert sorted(p.name for p in kept.parents[1].glob("step-*")) == [kept.parent.name]  # the others removed

    # the asset's record: the step exported, its accept length per kind, the curve and its picture
    meta = best_checkpoint_metadata(report)
    assert (
        meta["best_checkpoint_step"] == best["step"] and meta["best_checkpoint_accept_length"] == again["accept_length"]
    )
    assert meta["best_checkpoint_last_step_accept_length"] == lengths[total_steps]
    assert meta["accept_length_curve"].value["curve"] == curve
    assert meta["accept_length_curve_plot"].value.startswith("![plot](data:image/png;base64,")


def test_the_asset_refuses_the_keeper_where_the_target_cannot_decode_beside_the_trainer(data):
    refuse_best_checkpoint(DrafterTrainConfig(best_every=0, processes=2), data["target"])  # off: nothing to refuse
    refuse_best_checkpoint(DrafterTrainConfig(best_every=5), data["target"])  # the stand-in decodes here
    # several processes: rank 0 decodes, the others wait for its word (tests/test_best_checkpoint_ddp.py)
    refuse_best_checkpoint(DrafterTrainConfig(best_every=5, processes=2), data["target"])
    refuse_best_checkpoint(DrafterTrainConfig(best_every=5, processes=2, streaming_spool_gb=1.0), data["target"])
    with pytest.raises(DrafterError, match="spec_eval_max_target_gb"):
        refuse_best_checkpoint(DrafterTrainConfig(best_every=5, spec_eval_max_target_gb=1e-6), data["target"])


class Killed(Exception):
    """The process dies here, as under kill -9: after the step's evaluation, before its training checkpoint."""


def die_at(step: int) -> Every:
    def die(trainer: Trainer) -> None:
        if trainer.global_step == step:
            raise Killed(step)

    return Every(1, die)


def without_seconds(curve: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "seconds"} for r in curve]


@pytest.mark.slow
def test_the_curve_survives_a_resume_without_a_duplicate_step(data, target_model, tmp_path):
    logs: list[str] = []
    out = tmp_path / "drafter"
    with pytest.raises(Killed):  # evaluated at 2, 4 and 6; the last training checkpoint is step 4's
        run_drafter_job(job(data, out, target_model, logs, hooks=(die_at(6),)))
    before = json.loads((tmp_path / "drafter.training" / "best" / CURVE_FILE).read_text())
    assert [r["step"] for r in before["curve"]] == [2, 4, 6]
    report = run_drafter_job(job(data, out, target_model, logs))  # resumes at step 4: evaluates step 6 again
    assert report is not None and report.history.resumed_from_step == 4 and report.best_checkpoint is not None
    curve = report.best_checkpoint["curve"]
    steps = [r["step"] for r in curve]
    assert steps == sorted(set(steps)) and steps[:3] == [2, 4, 6]
    assert without_seconds(curve[:3]) == without_seconds(before["curve"])  # step 6 measured again, the same
    whole = run_drafter_job(job(data, tmp_path / "whole", target_model, []))
    assert whole is not None and whole.best_checkpoint is not None
    assert without_seconds(curve) == without_seconds(whole.best_checkpoint["curve"])
    assert report.best_checkpoint["best"]["step"] == whole.best_checkpoint["best"]["step"]
