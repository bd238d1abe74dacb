"""The training side of a streaming drafter run (issue 27):
`python -m eagle3_assets.stages.eagle3_drafter.streaming_train SPEC`, under torchrun when it has
several ranks (each rank joins the process group as `train_cli` does).

It does what the offline trainer does, from the spool: the drafter built as `run_drafter_job` builds it (the
vocabulary of the training split, the target's shape and frozen embedding), the untrained drafter scored on the
eval states the capture side stores first (it waits for `eval_done`), training from the spool (`train_from_spool`:
the real Trainer, `passes` passes as one epoch, its position in the atomic checkpoint), the trained drafter scored
and exported (`export_report`), the report written as JSON (`train_cli.report_json`, plus `best_checkpoint` and the
side's `streaming` figures) to `report`. Its `streaming` section is the whole training side's, every rank's figures
gathered at the end of training (`gather_figures`: one all-gather, every rank at the same point): `steps`;
`bytes_read`, the shard bytes read by all ranks together (each rank the chunks its share of the steps' rows lie in,
each once: `spool_data`'s figures are per rank), with `bytes_read_per_rank`, the list by rank; `waited_s`,
rank 0's seconds waiting for capture (the wait every rank shares: the others wait for rank 0's word meanwhile), and
`waited_s_max`, the longest any rank waited; `coverage`, from the record (below). One process: its own figures, a
list of one. With `best` in the spec, the best-checkpoint keeper runs as offline
(`BestCheckpointKeeper`: the main rank decodes with the target loaded here, the other ranks wait for its word) and the
best drafter is exported.

What it writes as it goes, in the run's shared folder (the main rank):
- `progress`: JSON lines {steps, estimated_steps, tokens, bytes_read, waited_s, seconds}, at most every
  `progress_every_s`, and a last one with "done" (and `coverage`). Its `bytes_read` and `waited_s` are rank 0's alone
  (no collective per line): with several ranks `bytes_read` is rank 0's share of what the side read (the report's is
  every rank's);
- `record`: one JSON line per optimizer step, {"step", "windows": [[sample_id, start, end], ...]}, flushed and
  fsynced before the step's checkpoint can be written. A resumed run starts again after its checkpoint's step and
  writes those step numbers again, so the record of what the exported weights were trained on is, for each step up
  to the last, its LAST line (`trained_steps`); `coverage` counts from it how many times each training token was
  trained.

Only one trainer may read a spool: the main rank holds `<spool>/trainer.lock` for its life (`lane_lock`), and the
trainer's lease with it (lease.py), which its reader checks before writing order.log, consumer.json or a deletion, so
a trainer a later one replaced (its lock lied, or it stalled past it) writes none of them. Every rank
watches the orchestrator's heartbeat (`OrphanWatch`) and leaves when it is gone.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import IO, Any

import polars as pl
import torch

from eagle3_assets.stages.eagle3_drafter.best_checkpoint import BestCheckpointKeeper, plan_from_spec
from eagle3_assets.stages.eagle3_drafter.data import plan_windows
from eagle3_assets.stages.eagle3_drafter.pipeline import (
    BuiltDrafter,
    DrafterJob,
    DrafterReport,
    Outcome,
    Splits,
    best_checkpoint_keeper,
    build_drafter,
    export_report,
    score_untrained,
)
from eagle3_assets.stages.eagle3_drafter.spool_data import SpoolWindows, train_from_spool
from eagle3_assets.stages.eagle3_drafter.spool_prefetch import PREFETCH_STEPS
from eagle3_assets.stages.eagle3_drafter.streaming import split_samples, target_hidden_size
from eagle3_assets.stages.eagle3_drafter.streaming_sides import ORPHAN_AFTER_S, OrphanWatch
from eagle3_assets.stages.eagle3_drafter.train import (
    Distributed,
    Every,
    RunOptions,
    Trainer,
    TrainSettings,
    eval_samples,
    evaluate,
    training_device,
)
from eagle3_assets.stages.eagle3_drafter.train_cli import join_process_group, leave_process_group, report_json
from eagle3_resources.atomic_files import write_json_atomic
from eagle3_resources.cpu import apply_torch_threads
from eagle3_resources.errors import StreamingTrainingFailed
from eagle3_resources.hidden_states.lane_lock import exclusive, trainer_lock_path
from eagle3_resources.hidden_states.lease import Lease
from eagle3_resources.hidden_states.store import HiddenStateStore


def trained_steps(record: Path, last_step: int) -> dict[int, list[tuple[str, int, int]]]:
    """Step number -> the windows trained in it, each step's LAST line (a resumed run wrote it again), steps after
    `last_step` left out (a killed run's steps past the checkpoint it resumed from, not all written again yet)."""
    steps: dict[int, list[tuple[str, int, int]]] = {}
    try:
        lines = Path(record).read_text().splitlines()
    except FileNotFoundError:
        return steps
    for line in lines:
        try:
            d = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill
            continue
        if int(d["step"]) <= last_step:
            steps[int(d["step"])] = [(str(s), int(a), int(b)) for s, a, b in d["windows"]]
    return steps


def coverage(steps: dict[int, list[tuple[str, int, int]]], lengths: dict[str, int]) -> dict[int, int]:
    """Times trained -> tokens trained that many times, over every token of the samples in `lengths` (0: tokens never
    trained); a window's token outside its sample counts under -1."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for windows in steps.values():
        for sid, start, end in windows:
            spans.setdefault(sid, []).append((start, end))
    counts: dict[int, int] = {}
    for sid, n in lengths.items():
        edges: dict[int, int] = {0: 0, n: 0}
        for start, end in spans.pop(sid, []):
            edges[start] = edges.get(start, 0) + 1
            edges[end] = edges.get(end, 0) - 1
        depth, points = 0, sorted(edges)
        for a, b in zip(points, points[1:], strict=False):
            depth += edges[a]
            key = depth if 0 <= a and b <= n else -1
            counts[key] = counts.get(key, 0) + (b - a)
    for rest in spans.values():  # windows of samples that are not training samples
        counts[-1] = counts.get(-1, 0) + sum(b - a for a, b in rest)
    return dict(sorted(counts.items()))


@dataclass
class SideProgress:
    """The `Every(1)` hook of the training side (main rank): each step's windows into the record (fsynced), the
    figures into the progress file at most every `every_s`."""

    data: SpoolWindows
    record: IO[str]
    progress: IO[str]
    every_s: float
    started: float = field(default_factory=time.monotonic)
    last: float = 0.0

    def __call__(self, trainer: Trainer) -> None:
        if not trainer.dist.main:
            return
        step = self.data.current
        windows = [[w.sample_id, w.start, w.end] for w in step.windows] if step is not None else []
        self.record.write(json.dumps({"step": trainer.global_step, "windows": windows}) + "\n")
        self.record.flush()
        os.fsync(self.record.fileno())
        if time.monotonic() - self.last >= self.every_s:
            self.last = time.monotonic()
            self.write(trainer)

    def figures(self, trainer: Trainer) -> dict[str, Any]:
        return {
            "steps": trainer.global_step,
            "estimated_steps": self.data.estimated_steps,
            "tokens": trainer.history.tokens + trainer.tokens_done - trainer.tokens_counted,
            "bytes_read": self.data.bytes_read,
            "waited_s": round(self.data.waited_s, 3),
            "seconds": round(time.monotonic() - self.started, 3),
        }

    def write(self, trainer: Trainer, **more: Any) -> None:
        self.progress.write(json.dumps(self.figures(trainer) | more) + "\n")
        self.progress.flush()


def wait_for(path: Path, log: Callable[[str], None], poll_s: float = 0.2) -> None:
    if not path.exists():
        log(f"training side: waiting for the eval split's states ({path})")
    while not path.exists():
        time.sleep(poll_s)


@dataclass(frozen=True)
class Prepared:
    """A rank's drafter built, the eval states the capture stored first, and the untrained scores (main rank)."""

    job: DrafterJob
    built: BuiltDrafter
    store: HiddenStateStore
    splits: Splits
    held_out: Callable[[], Any]
    untrained: dict[str, Any]


def prepare(spec: dict[str, Any], dist: Distributed, device: str, log: Callable[[str], None]) -> Prepared:
    """The drafter as `run_drafter_job` builds it, then (once the capture side has stored them) the eval states and
    the untrained drafter's scores."""
    settings = TrainSettings(**spec["settings"])
    merged = pl.read_parquet(spec["merged"])
    dev = training_device(device)
    if dev.type == "cpu":
        apply_torch_threads("drafter training (streaming)", log)
    train_ids = merged.filter(pl.col("split") == "train")["sample_id"].to_list()
    lengths = dict(merged.select("sample_id", "n_tokens").iter_rows())
    train_plan = plan_windows([(s, int(lengths[s])) for s in train_ids], settings.max_len)
    job = DrafterJob(
        None,
        merged,
        Path(spec["target_folder"]),
        Path(spec["out_dir"]),
        settings,
        int(spec["draft_vocab"]),
        log,
        device=device,
        init_from=Path(spec["init_from"]) if spec.get("init_from") else None,
        dist=dist,
        best=plan_from_spec(spec.get("best"), log, dist),  # every rank keeps; rank 0 decodes
    )
    built = build_drafter(job, target_hidden_size(job.target_folder), train_ids, dev)
    model, teacher = built.model, built.teacher
    wait_for(Path(spec["eval_done"]), log)
    store = HiddenStateStore(Path(spec["eval_root"]))
    eval_lengths = {sid: end - start for sid, (_, start, end, _) in store.index.items()}
    splits = Splits(
        train_ids, train_plan, plan_windows(sorted(eval_lengths.items()), settings.max_len), spec["held_split"]
    )
    held_out = partial(eval_samples, store, splits.eval.windows, teacher, dev)
    untrained = score_untrained(model, held_out, settings.ttt_steps, dist, log, splits.eval_split)
    return Prepared(job, built, store, splits, held_out, untrained)


def train_side(
    spec: dict[str, Any], dist: Distributed, device: str, log: Callable[[str], None], lease: Lease | None = None
) -> None:
    """One rank's training from the spool; the main rank scores, exports and writes the report. `lease`: the main
    rank's trainer lease (None on the other ranks, which write nothing under the spool)."""
    ready = prepare(spec, dist, device, log)
    job, built, store, splits, held_out = ready.job, ready.built, ready.store, ready.splits, ready.held_out
    model, teacher, settings, merged = built.model, built.teacher, job.settings, job.merged
    dev = training_device(device)
    if dist.main:
        end_line(Path(spec["record"]))
    with open(spec["record"], "a") as record, open(spec["progress"], "a") as progress_file:
        kept: list[BestCheckpointKeeper] = []

        def hooks(data: SpoolWindows) -> list[Every]:
            keeper = best_checkpoint_keeper(job, store.manifest["aux_layer_ids"], data.fingerprint(model.draft_ids))
            kept.extend([keeper] if keeper is not None else [])
            return ([keeper.hook()] if keeper is not None else []) + [Every(1, progress)]

        progress = SideProgress(None, record, progress_file, float(spec["progress_every_s"]))  # type: ignore[arg-type]  # its data is set below, before the first step
        options = RunOptions(dev, log, Path(spec["checkpoints"]), dist)
        trainer, data = train_from_spool(
            model,
            Path(spec["spool"]),
            settings,
            options,
            teacher,
            held_out,
            lambda d: hooks(bind(progress, d)),
            0.05,
            lease=lease,
            prefetch_steps=PREFETCH_STEPS if spec.get("prefetch_steps") is None else int(spec["prefetch_steps"]),
        )
        # a resume may train no step (a run that died after its last checkpoint, before its report: the orphan
        # that finished its steps): its checkpoint's position says what was trained; none at all is a plan of none
        if trainer.global_step == 0:
            raise StreamingTrainingFailed("the training side trained no step: the spool's capture plan holds none")
        best = kept[0].finish(trainer) if kept else None  # every rank: the main one evaluates and loads the best
        read = gather_figures(data, dist)  # every rank, here: the last collective of training
        if not dist.main:
            return
        if not data.trained_out():
            raise StreamingTrainingFailed("the trainer ended before every pass over the spool's shards was trained")
        steps = trained_steps(Path(spec["record"]), trainer.global_step)
        train, _, _ = split_samples(merged)
        counted = coverage(steps, {s.sample_id: len(s.input_ids) for s in train})
        progress.write(trainer, done=True, coverage={str(k): v for k, v in counted.items()})
    trained = evaluate(model, held_out(), settings.ttt_steps)
    log(f"trained drafter on {splits.eval_split}: accept length {trained['accept_length']}, acc {trained['acc']}")
    best_keys = (
        {"best_step": best["best"]["step"], "best_accept_length_real": best["best"]["accept_length"]} if best else {}
    )
    extra = {"streaming_passes": int(spec["passes"])} | best_keys
    outcome = Outcome(ready.untrained, trained, trainer.history, best, extra)
    report = export_report(job, built, store.manifest["aux_layer_ids"], splits, outcome)
    streaming = {
        "steps": trainer.global_step,
        "bytes_read": sum(read.bytes_read),
        "bytes_read_per_rank": read.bytes_read,
        "waited_s": round(data.waited_s, 3),  # rank 0's (this rank)
        "waited_s_max": round(max(read.waited_s), 3),
        "coverage": {str(k): v for k, v in counted.items()},
    }
    write_report(Path(spec["report"]), report, streaming)


@dataclass(frozen=True)
class RankFigures:
    """Every rank's reading of the spool, in rank order: the shard bytes it read, the seconds it waited (each rank's
    `SpoolWindows.bytes_read` and `waited_s`)."""

    bytes_read: list[int]
    waited_s: list[float]


def gather_figures(data: SpoolWindows, dist: Distributed) -> RankFigures:
    """Every rank's figures, on every rank; every rank calls it at the same point. One all-gather of a small CPU
    tensor (bytes, microseconds waited: integers, exact) over the spool's gloo group (`RankZeroWord.group`: the world
    under gloo, a gloo group of its own under NCCL, which takes no CPU tensor). One process: its own figures."""
    mine = torch.tensor([data.bytes_read, round(data.waited_s * 1e6)], dtype=torch.int64)
    rows = [mine]
    if dist.world_size > 1:
        rows = [torch.empty_like(mine) for _ in range(dist.world_size)]
        torch.distributed.all_gather(rows, mine, group=data.word.group)
    return RankFigures([int(r[0]) for r in rows], [int(r[1]) / 1e6 for r in rows])


def end_line(path: Path) -> None:
    """End the record's last line if a kill cut it, so the next line appended starts a line of its own."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) != b"\n":
            f.write(b"\n")


def bind(progress: SideProgress, data: SpoolWindows) -> SpoolWindows:
    progress.data = data
    return data


def write_report(path: Path, report: DrafterReport, streaming: dict[str, Any]) -> None:
    """`train_cli`'s report JSON, with the best checkpoint's summary and the side's figures, written atomically."""
    write_json_atomic(
        path, report_json(report) | {"best_checkpoint": report.best_checkpoint, "streaming": streaming}, indent=None
    )


def training_main(spec_path: Path) -> None:
    """One rank of the training side: join the process group, watch the orchestrator, take the spool's trainer lock
    (main rank), train."""
    spec = json.loads(Path(spec_path).read_text())
    dist, device = join_process_group(spec.get("device", "auto"))
    say = partial(print, flush=True)
    log: Callable[[str], None] = say if dist.main else (lambda _m: None)
    orphan_after_s = float(spec.get("orphan_after_s", ORPHAN_AFTER_S))
    watch = OrphanWatch(Path(spec["folder"]), spec["run_id"], orphan_after_s, say).install()
    try:
        log(f"training side of run {spec['run_id']} on {socket.gethostname()}, {dist.world_size} rank(s)")
        lock = (
            exclusive(
                trainer_lock_path(Path(spec["spool"])),
                "the streaming trainer",
                wait_s=float(spec.get("lock_wait_s", 3 * orphan_after_s + 60)),
                log=log,
            )
            if dist.main
            else nullcontext()
        )
        with lock as lease:
            train_side(spec, dist, device, log, lease)
    finally:
        watch.close()
        leave_process_group(dist)
    log("training side: done")


def main(argv: Iterable[str]) -> int:
    training_main(Path(list(argv)[0]))  # a stop or an orphan leaves by SystemExit with its code
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
