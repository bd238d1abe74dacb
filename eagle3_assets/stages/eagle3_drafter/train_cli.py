"""Drafter training as a process of its own: what `torchrun` starts on each rank, and what the asset runs
when it asks for several processes.

    torchrun --nproc-per-node 8 -m eagle3_assets.stages.eagle3_drafter.train_cli --spec spec.json

`spec.json` (written by `write_spec`) names the hidden-state store (or `online: true`), the merged set,
the target folder, the output folder and the settings. Under torchrun each rank joins the process
group (NCCL on GPUs, one GPU per local rank; gloo on the CPU); rank 0 evaluates, exports the
checkpoint and writes the report (`report_path`), JSON. With `best` (the asset's `best_every`), rank 0 loads the
target and keeps the best checkpoint while the other ranks wait for its word (`best_checkpoint.py`). A killed run
started again with the same spec resumes from its last training checkpoint. The process group's collective timeout is
torch's default unless `EAGLE3_COLLECTIVE_TIMEOUT_S` sets it (`rank_zero.collective_timeout`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import polars as pl
import torch

from eagle3_assets.stages.eagle3_drafter.best_checkpoint import plan_from_spec
from eagle3_assets.stages.eagle3_drafter.pipeline import DrafterJob, DrafterReport, run_drafter_job
from eagle3_assets.stages.eagle3_drafter.rank_zero import collective_timeout
from eagle3_assets.stages.eagle3_drafter.train import Distributed, TrainHistory, TrainSettings
from eagle3_resources.atomic_files import write_json_atomic


@dataclass(frozen=True)
class TrainSpec:
    """What a training process is told, as `spec.json` holds it (paths as strings, the settings as a dict)."""

    hidden_root: Path | None  # None: online (the target computes the states)
    merged_path: Path
    target_folder: Path
    out_dir: Path
    settings: TrainSettings
    draft_vocab_size: int
    report_path: Path | None  # where the main process writes the report (JSON); None: nowhere
    device: str = "auto"
    online: bool = False
    init_from: Path | None = None
    best: dict[str, Any] | None = None  # the best-checkpoint keeper's plan (`best_checkpoint.plan_from_spec`)

    def to_json(self) -> dict[str, Any]:
        return {
            "hidden_root": str(self.hidden_root) if self.hidden_root else None,
            "merged_path": str(self.merged_path),
            "target_folder": str(self.target_folder),
            "out_dir": str(self.out_dir),
            "settings": asdict(self.settings),
            "draft_vocab_size": self.draft_vocab_size,
            "report_path": str(self.report_path) if self.report_path else None,
            "device": self.device,
            "online": self.online,
            "init_from": str(self.init_from) if self.init_from else None,
            "best": self.best,
        }

    @classmethod
    def from_json(cls, spec: dict[str, Any]) -> TrainSpec:
        return cls(
            hidden_root=Path(spec["hidden_root"]) if spec.get("hidden_root") else None,
            merged_path=Path(spec["merged_path"]),
            target_folder=Path(spec["target_folder"]),
            out_dir=Path(spec["out_dir"]),
            settings=TrainSettings(**spec["settings"]),
            draft_vocab_size=int(spec["draft_vocab_size"]),
            report_path=Path(spec["report_path"]) if spec.get("report_path") else None,
            device=spec.get("device", "auto"),
            online=bool(spec.get("online")),
            init_from=Path(spec["init_from"]) if spec.get("init_from") else None,
            best=spec.get("best"),
        )

    def write(self, path: Path) -> Path:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path


# 11 parameters: the keyword form of `TrainSpec` that tests and benchmarks call
def write_spec(
    path: Path,
    *,
    hidden_root: Path | None,
    merged_path: Path,
    target_folder: Path,
    out_dir: Path,
    settings: TrainSettings,
    draft_vocab_size: int,
    report_path: Path,
    device: str = "auto",
    online: bool = False,
    init_from: Path | None = None,
) -> Path:
    spec = TrainSpec(
        hidden_root,
        merged_path,
        target_folder,
        out_dir,
        settings,
        draft_vocab_size,
        report_path,
        device,
        online,
        init_from,
    )
    return spec.write(path)


def report_json(report: DrafterReport) -> dict[str, Any]:
    return {
        "checkpoint": str(report.checkpoint),
        "config": report.config,
        "draft_vocab_size": report.draft_vocab_size,
        "distinct_loss_tokens": report.distinct_loss_tokens,
        "train_samples": report.train_samples,
        "eval_samples": report.eval_samples,
        "eval_split": report.eval_split,
        "untrained": report.untrained,
        "trained": report.trained,
        "history": report.history.to_dict(),
        "train_tokens": report.train_tokens,
        "split_samples": report.split_samples,
        "windows": report.windows,
        "best_checkpoint": report.best_checkpoint,
        "draft_ids": report.draft_ids,
    }


def report_from_json(d: dict[str, Any]) -> DrafterReport:
    return DrafterReport(
        checkpoint=Path(d["checkpoint"]),
        config=d["config"],
        draft_vocab_size=d["draft_vocab_size"],
        distinct_loss_tokens=d["distinct_loss_tokens"],
        train_samples=d["train_samples"],
        eval_samples=d["eval_samples"],
        eval_split=d["eval_split"],
        untrained=d["untrained"],
        trained=d["trained"],
        history=TrainHistory(**d["history"]),
        train_tokens=d["train_tokens"],
        split_samples=d["split_samples"],
        windows=d["windows"],
        best_checkpoint=d.get("best_checkpoint"),
        draft_ids=d.get("draft_ids", []),
    )


def join_process_group(device: str) -> tuple[Distributed, str]:
    """(this rank, the device it trains on) from torchrun's environment; a lone process joins nothing."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Distributed(), device
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and device != "cpu"
    if cuda:
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    torch.distributed.init_process_group("nccl" if cuda else "gloo", timeout=collective_timeout())
    return Distributed(rank, world), device if cuda else "cpu"


def leave_process_group(dist: Distributed) -> None:
    """Leave the process group: let go of what still holds it (a DDP reducer kept alive by a reference cycle holds
    the gloo group, which `destroy_process_group` then only unregisters), then destroy it, so that the group's worker
    threads are joined here and not at interpreter finalization, where work they still own (tensors with Python
    references) aborts the rank: "terminate called without an active exception" after a run that trained to the
    end. No barrier: rank 0 alone still exports and decodes after the last collective, and a failed rank may be
    gone. A lone process has nothing to leave."""
    if dist.world_size == 1:
        return
    gc.collect()
    torch.distributed.destroy_process_group()


def run(
    spec: dict[str, Any], log: Callable[[str], None] = print, stop_after_steps: int | None = None
) -> DrafterReport | None:
    """One rank's run of a spec: join the process group, train (loading the target here when online), and on the
    main process write the report."""
    train_spec = TrainSpec.from_json(spec)
    dist, device = join_process_group(train_spec.device)
    try:
        merged = pl.read_parquet(train_spec.merged_path)
        log = log if dist.main else (lambda _m: None)
        job = DrafterJob(
            train_spec.hidden_root,
            merged,
            train_spec.target_folder,
            train_spec.out_dir,
            train_spec.settings,
            train_spec.draft_vocab_size,
            log,
            device=device,
            online_backend=online_target(train_spec.target_folder, device) if train_spec.online else None,
            init_from=train_spec.init_from,
            dist=dist,
            stop_after_steps=stop_after_steps,
            best=plan_from_spec(train_spec.best, log, dist),  # every rank keeps; rank 0 decodes
        )
        report = run_drafter_job(job)
        if report is not None and dist.main and train_spec.report_path is not None:
            write_json_atomic(Path(train_spec.report_path), report_json(report), indent=None)
        return report
    finally:
        leave_process_group(dist)


def online_target(folder: Path, device: str) -> Any:
    """The target as a transformers hidden-states backend on `device` (bf16 on CUDA, fp32 on the CPU)."""
    from transformers import AutoModelForCausalLM

    from eagle3_resources.hidden_states.transformers_backend import TransformersHiddenStates

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    # as a Module: PreTrainedModel.to is `wraps(Module.to)`, which the checker reads as unbound
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    on = device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    return TransformersHiddenStates(model.to(on).eval())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", required=True, help="the JSON spec (see write_spec)")
    parser.add_argument(
        "--stop-after-steps",
        type=int,
        default=None,
        help="end after this many optimizer steps (a checkpoint is written first), as a kill would; for tests",
    )
    args = parser.parse_args(argv)
    run(
        json.loads(Path(args.spec).read_text()),
        log=lambda m: print(m, flush=True),
        stop_after_steps=args.stop_after_steps,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
