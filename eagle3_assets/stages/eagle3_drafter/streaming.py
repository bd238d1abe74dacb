"""The drafter's streaming mode as one materialization (issue 27): the step plans, starts the capture side and the
training side wherever its launcher runs them, watches both, and returns the exported drafter's report. It runs
neither side itself.

`stream_drafter` is what `eagle3_drafter` calls when `streaming_spool_gb` is set (offline stays the default):

1. The plan (`streaming_plan.plan_streaming`) of the merged set's training split with the given or measured rates:
   its duration, peak disk and bottleneck are logged and returned for the metadata; a spool that cannot hold the
   working set is refused here (`SpoolTooSmall`), before any folder is made or side started.
2. The spool is created, the orchestrator's heartbeat (`streaming_sides.Heartbeat`) starts, each side's spec is
   written into the run's shared folder, and the `SidesLauncher` starts them (`LocalSides`: two process groups on
   this machine; `KubernetesSides`: Jobs): the capture side (`streaming_capture`: the eval split into a small
   store, then the training split into the spool's lane) and the training side (`streaming_train`: the real Trainer
   from the spool, under torchrun with `processes` ranks, then the export).
3. The step follows them through the shared folder only: the sides' progress files and the spool's bytes on disk
   (`FillSampler`, a thread); at most every `progress_every_s` the figures are logged and observed (capture and
   training progress, the spool's fill and its sampled peak, GB/s in and out, who waits for whom).
4. Both sides exit 0: the training side's report (JSON) is the run's. Either fails: the other is stopped and the
   run fails (`CaptureFailed`, `StreamingTrainingFailed`) with the failed side's log. The step stopped (terminate,
   Ctrl-C): both sides are stopped. The step killed (kill -9): its heartbeat stops, and each side leaves by itself
   within `orphan_after_s` (the sides' `OrphanWatch`); a new run's heartbeat makes them leave at once. A capture side
   holds its lane's writer lock and the training side the spool's trainer lock for their lives
   (eagle3_resources/hidden_states/lane_lock.py), so a side of an earlier run still ending is waited for, never
   worked beside.

Where it lives: `<drafter>.streaming/` beside the exported drafter (spool/ unless `spool_dir` puts it elsewhere,
eval_states/, training/ checkpoints, the sides' specs, logs, progress, the trainer's record, the heartbeat). A run
that fails or is stopped leaves it, and the next one resumes both sides exactly (the spool's and the trainer
checkpoint's guarantees); a run that finishes removes it. The upstream is the merged set, as `hidden_states`' own:
the asset keeps `hidden_states` as its dependency (the lineage is unchanged), and streaming mode does not read the
offline store.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import polars as pl

from eagle3_assets.stages.eagle3_drafter.pipeline import DrafterReport
from eagle3_assets.stages.eagle3_drafter.streaming_plan import (
    ASSUMED,
    LAUNCHED_CAPTURE_HOSTS,
    Hosts,
    StreamingInputs,
    StreamingPlan,
    plan_streaming,
)
from eagle3_assets.stages.eagle3_drafter.streaming_sides import (
    HEARTBEAT_EVERY_S,
    ORPHAN_AFTER_S,
    Heartbeat,
    LocalSides,
    SideHandle,
    SidesLauncher,
    last_line,
)
from eagle3_assets.stages.eagle3_drafter.train import TrainSettings
from eagle3_assets.stages.eagle3_drafter.train_cli import report_from_json
from eagle3_resources.errors import CaptureFailed, StreamingTrainingFailed
from eagle3_resources.hidden_states.shared_fs import ReportingThread, read_json
from eagle3_resources.hidden_states.spool import SpoolSettings, create_spool, default_mix_shards, spool_status
from eagle3_resources.hidden_states.store import StoredSample, plan_mixed_shards, shard_layout, token_bytes

LANE = "capture"
EVAL_FALLBACK = 8  # training samples held out for the scores when the eval split is empty


@dataclass(frozen=True)
class StreamingRequest:
    """What the asset asks of a streaming run (its config, resolved)."""

    spool_bytes: int
    passes: int
    shard_bytes: int
    capture_tok_s: float  # per capture host, as planned (declared or measured)
    train_tok_s: float  # token-passes/s of the trainer, as planned
    spool_bytes_per_s: float
    rates_source: dict[str, str]  # where each planned rate came from: "capture_tok_s", "train_tok_s" -> its label
    capture_gpus: int = 1
    writers: int = 2
    mix_shards: int | None = None  # shards the trainer shuffles together; None: `spool.default_mix_shards`
    spool_source: str = ASSUMED  # where spool_bytes_per_s came from
    reads_per_byte: float | None = None  # the training side's reads of each byte; None: its nodes (streaming_plan)
    prefetch_steps: int | None = None  # steps each rank reads ahead of the one it trains (0: on the training thread;
    # None: the trainer's default, spool_prefetch.PREFETCH_STEPS)


@dataclass
class StreamingFigures:
    """What the run measured, for the log, the observations and the metadata. The training side's figures come from
    its progress lines while it runs (rank 0's reading alone: with several ranks, `train_bytes_read` and the GB/s
    observed are rank 0's share) and, at the end, from its report (every rank's: `train_bytes_read` summed over the
    ranks, `train_bytes_read_per_rank` the list, `train_waited_s` rank 0's wait for capture, `train_waited_s_max` the
    longest any rank waited; see `streaming_train`'s docstring)."""

    plan: StreamingPlan
    plan_text: str
    budget_bytes: int
    data_bytes: int
    peak_bytes: int = 0  # the spool's bytes on disk, largest sample
    fill_samples: int = 0
    capture: dict[str, Any] = field(default_factory=dict)  # the capture process's last progress figures
    train_steps: int = 0
    estimated_steps: int = 0
    train_tokens: int = 0
    train_bytes_read: int = 0  # while running, rank 0's; from the report, every rank's together
    train_waited_s: float = 0.0  # rank 0's
    train_waited_s_max: float = 0.0  # the longest wait of any rank (from the report)
    train_bytes_read_per_rank: list[int] = field(default_factory=list)  # by rank (from the report)
    seconds: float = 0.0
    train_coverage: dict[int, int] = field(default_factory=dict)  # times trained -> tokens (the trainer's record)

    def observation(self, fill: int) -> dict[str, Any]:
        c = self.capture
        seconds = max(self.seconds, 1e-9)
        return {
            "capture_tokens": c.get("tokens_written", 0),
            "capture_tokens_planned": c.get("tokens_pending"),
            "capture_shards": c.get("shards_written", 0),
            "capture_gb_per_s": round(float(c.get("bytes_per_s", 0.0)) / 1e9, 6),
            "capture_waited_s": c.get("waited_s", 0.0),
            "capture_pauses": c.get("pauses", 0),
            "capture_waiting": c.get("waiting", False),
            "train_steps": self.train_steps,
            "train_steps_estimated": self.estimated_steps,
            "train_tokens": self.train_tokens,
            "train_gb_per_s": round(self.train_bytes_read / seconds / 1e9, 6),
            "train_waited_s": round(self.train_waited_s, 3),
            "spool_bytes": fill,
            "spool_budget_bytes": self.budget_bytes,
            "spool_fill_pct": round(100 * fill / self.budget_bytes, 1),
            "spool_peak_bytes": self.peak_bytes,
            "who_waits": self.who_waits(),
        }

    def who_waits(self) -> str:
        cap, tr = float(self.capture.get("waited_s", 0.0)), self.train_waited_s
        if cap == tr == 0:
            return "neither side has waited"
        side = "capture waited for training (a full spool)" if cap >= tr else "training waited for capture"
        return f"{side}: capture waited {cap:,.1f} s for room, training {tr:,.1f} s for shards"

    def metadata(self) -> dict[str, Any]:
        """The materialization's streaming figures (numbers Dagster plots across materializations)."""
        c, seconds = self.capture, max(self.seconds, 1e-9)
        return {
            "streaming_plan": self.plan_text,
            "streaming_planned_duration_s": round(self.plan.duration_s, 1),
            "streaming_planned_bottleneck": self.plan.bottleneck,
            "streaming_planned_peak_disk_bytes": self.plan.peak_disk_bytes,
            "streaming_spool_budget_bytes": self.budget_bytes,
            "streaming_spool_peak_bytes_sampled": self.peak_bytes,
            "streaming_spool_fill_samples": self.fill_samples,
            "streaming_data_bytes": self.data_bytes,
            "streaming_capture_tokens": int(c.get("tokens_written", 0)),
            "streaming_capture_shards": int(c.get("shards_written", 0)),
            "streaming_capture_gb_per_s": round(float(c.get("bytes_per_s", 0.0)) / 1e9, 6),
            "streaming_capture_busy_gb_per_s": round(float(c.get("busy_bytes_per_s", 0.0)) / 1e9, 6),
            "streaming_capture_pauses": int(c.get("pauses", 0)),
            "streaming_capture_waited_s": float(c.get("waited_s", 0.0)),
            "streaming_train_steps": self.train_steps,
            "streaming_train_tokens": self.train_tokens,
            "streaming_train_bytes_read": self.train_bytes_read,
            "streaming_train_gb_per_s": round(self.train_bytes_read / seconds / 1e9, 6),
            "streaming_train_waited_s": round(self.train_waited_s, 3),
            "streaming_train_waited_s_max": round(self.train_waited_s_max, 3),
            "streaming_train_bytes_read_per_rank": self.train_bytes_read_per_rank,
            "streaming_who_waits": self.who_waits(),
            "streaming_seconds": round(self.seconds, 1),
            # times trained -> training tokens trained that many times, from the trainer's record (all {passes: n})
            "streaming_trained_token_passes": {str(k): v for k, v in self.train_coverage.items()},
        }


def split_samples(merged: pl.DataFrame) -> tuple[list[StoredSample], list[StoredSample], str]:
    """(training samples for the spool, held-out samples for the scores, the held-out split's name), the same in
    the asset's process and the capture process."""
    rows = [
        StoredSample(sid, split, ids, mask, dataset)
        for sid, split, ids, mask, dataset in merged.select(
            "sample_id", "split", "input_ids", "loss_mask", "dataset"
        ).iter_rows()
    ]
    train = [s for s in rows if s.split == "train"]
    held = [s for s in rows if s.split == "eval"]
    if held:
        return train, held, "eval"
    return train, train[:EVAL_FALLBACK], "train"


def target_hidden_size(folder: Path) -> int:
    config = json.loads((Path(folder) / "config.json").read_text())
    return int(config.get("text_config", config)["hidden_size"])


def plan_for(
    train: list[StoredSample],
    hidden: int,
    identity: dict[str, Any],
    request: StreamingRequest,
    settings: TrainSettings,
    training_nodes: tuple[int, int] = (1, 1),
    checkpoint_bytes: int = 0,
) -> tuple[StreamingInputs, StreamingPlan]:
    """The plan of streaming `train` (refused with `SpoolTooSmall` when the spool cannot hold its working set) on
    `training_nodes` = (nodes, ranks per node), each node training at `request.train_tok_s`; the largest shard is
    measured on the capture's own shard plan (its datasets interleaved, seeded by the training seed as the spool's),
    and the mix is the request's or the largest the budget allows (`default_mix_shards`). One capture host, the one
    the orchestrator launches (`LAUNCHED_CAPTURE_HOSTS`); `stream_drafter` launches the sides from these inputs.
    `checkpoint_bytes`: one trainer checkpoint (`checkpoint_bytes_of`), written on the spool's file system."""
    plans = plan_mixed_shards(train, hidden, request.shard_bytes, identity, settings.seed)
    sizes = [shard_layout(p, [train[i] for i in p.samples], hidden).size for p in plans]
    largest = max(sizes, default=1)
    mix = request.mix_shards or default_mix_shards(request.spool_bytes, largest, request.passes)
    inputs = StreamingInputs(
        tokens=sum(len(s.input_ids) for s in train),
        bytes_per_token=token_bytes(hidden),
        capture=Hosts(
            LAUNCHED_CAPTURE_HOSTS,
            request.capture_tok_s,
            request.capture_gpus,
            request.rates_source.get("capture_tok_s", ASSUMED),
        ),
        training=Hosts(
            training_nodes[0], request.train_tok_s, training_nodes[1], request.rates_source.get("train_tok_s", ASSUMED)
        ),
        spool_bytes_per_s=request.spool_bytes_per_s,
        spool_budget_bytes=request.spool_bytes,
        passes=request.passes,
        shard_bytes=largest,
        checkpoint_every_tokens=settings.checkpoint_every * settings.batch_tokens,
        mix_shards=mix,
        spool_source=request.spool_source,
        reads_per_byte=request.reads_per_byte,
        checkpoint_bytes=checkpoint_bytes,
    )
    return inputs, plan_streaming(inputs)


def checkpoint_bytes_of(target_folder: Path, hidden: int, draft_vocab: int, kind: str) -> int:
    """One trainer checkpoint's bytes for the drafter this target trains (`pipeline.drafter_config`; its draft
    vocabulary at most the target's), counted on the meta device (`streaming_rates.drafter_config_checkpoint_bytes`)."""
    from eagle3_assets.stages.eagle3_drafter.pipeline import drafter_config
    from eagle3_assets.stages.eagle3_drafter.streaming_rates import drafter_config_checkpoint_bytes

    config = json.loads((Path(target_folder) / "config.json").read_text())
    text = config.get("text_config", config)
    vocab = int(text["vocab_size"])
    return drafter_config_checkpoint_bytes(drafter_config(text, hidden, min(draft_vocab, vocab), vocab, kind))


class FillSampler:
    """The spool's bytes on disk, sampled from a thread of its own; `peak` the largest seen. A sample that fails (its
    reads of the spool's files retried first: shared_fs.py) ends the thread, and the orchestrator raises its error
    (`raise_if_failed`) instead of reading figures that stopped."""

    def __init__(self, root: Path, every_s: float = 0.05):
        self.root, self.every_s = root, every_s
        self.peak, self.samples, self.last = 0, 0, 0
        self._stop = threading.Event()
        self._thread = ReportingThread("spool-fill-sampler", self._run)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.every_s)

    def sample(self) -> int:
        self.last = int(spool_status(self.root)["bytes_on_disk"])
        self.peak, self.samples = max(self.peak, self.last), self.samples + 1
        return self.last

    def raise_if_failed(self) -> None:
        self._thread.raise_if_failed()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


@dataclass(frozen=True)
class StreamingJob:
    """A streaming drafter run: the merged set, the target, where it goes, how it trains, and where its sides run
    (`launcher`: `LocalSides()` when None). `processes`/`nodes`: the training side's ranks per node and nodes.
    `best`: the training side's best-checkpoint section of its spec (None: off). `spool_dir`: the spool's folder
    (None: `<drafter>.streaming/spool`). `orphan_after_s`: a side leaves once the heartbeat has not changed so long."""

    merged: pl.DataFrame
    merged_path: Path
    target_folder: Path
    out_dir: Path
    settings: TrainSettings
    requested_draft_vocab: int
    request: StreamingRequest
    identity: dict[str, Any]
    resources: dict[str, dict[str, Any]]  # target, tokenizer, hidden_states_backend: their config, for the capture
    log: Callable[[str], None]
    observe: Callable[[dict[str, Any]], None] = lambda figures: None
    device: str = "auto"
    init_from: Path | None = None
    progress_every_s: float = 10.0
    launcher: SidesLauncher | None = None
    processes: int = 1
    nodes: int = 1
    best: dict[str, Any] | None = None
    spool_dir: Path | None = None
    orphan_after_s: float = ORPHAN_AFTER_S

    @property
    def folder(self) -> Path:
        return Path(str(self.out_dir) + ".streaming")

    @property
    def spool(self) -> Path:
        return Path(self.spool_dir) if self.spool_dir is not None else self.folder / "spool"


@dataclass(frozen=True)
class RunFiles:
    """The run's files in its shared folder (`<drafter>.streaming/`), as both sides and the orchestrator name them."""

    folder: Path
    spool: Path

    def __getattr__(self, name: str) -> Path:
        files = {
            "eval_root": "eval_states",
            "checkpoints": "training",
            "capture_spec": "capture.json",
            "capture_log": "capture.log",
            "capture_progress": "capture-progress.jsonl",
            "eval_done": "eval-done",
            "training_spec": "training.json",
            "training_log": "training.log",
            "training_progress": "training-progress.jsonl",
            "training_record": "training-record.jsonl",
            "training_report": "training-report.json",
        }
        if name not in files:
            raise AttributeError(name)
        return self.folder / files[name]


def side_specs(job: StreamingJob, files: RunFiles, run_id: str, held_split: str) -> tuple[dict, dict]:
    """(the capture side's spec, the training side's), as they read them (JSON)."""
    common = {"folder": str(files.folder), "run_id": run_id, "orphan_after_s": job.orphan_after_s}
    every_s = min(job.progress_every_s, 1.0)
    capture = common | {
        "merged": str(job.merged_path),
        "spool": str(files.spool),
        "eval_root": str(files.eval_root),
        "lane": LANE,
        "shard_bytes": job.request.shard_bytes,
        "writers": job.request.writers,
        "identity": job.identity,
        "resources": job.resources,
        "progress": str(files.capture_progress),
        "eval_done": str(files.eval_done),
        "progress_every_s": every_s,
    }
    training = common | {
        "merged": str(job.merged_path),
        "target_folder": str(job.target_folder),
        "out_dir": str(job.out_dir),
        "settings": asdict(replace(job.settings, epochs=1)),  # the spool's passes are its one epoch
        "draft_vocab": job.requested_draft_vocab,
        "device": job.device,
        "init_from": str(job.init_from) if job.init_from else None,
        "spool": str(files.spool),
        "eval_root": str(files.eval_root),
        "eval_done": str(files.eval_done),
        "held_split": held_split,
        "prefetch_steps": job.request.prefetch_steps,
        "checkpoints": str(files.checkpoints),
        "progress": str(files.training_progress),
        "record": str(files.training_record),
        "report": str(files.training_report),
        "progress_every_s": every_s,
        "passes": job.request.passes,
        "best": job.best,
    }
    return capture, training


def stream_drafter(job: StreamingJob) -> tuple[DrafterReport, StreamingFigures]:
    """Plan (refusing a spool too small before anything starts), start the capture side and the training side
    through the launcher, follow them until both are done, and return the training side's report (its drafter
    exported) with the streaming figures. A failure or a stop of either side, or of this step, stops both."""
    settings = replace(job.settings, epochs=1)
    hidden = target_hidden_size(job.target_folder)
    train, _, held_split = split_samples(job.merged)
    training_nodes = (job.nodes, job.processes)
    checkpoint = checkpoint_bytes_of(job.target_folder, hidden, job.requested_draft_vocab, settings.drafter_kind)
    # SpoolTooSmall first; what is launched below is these inputs: its capture host(s), nodes, ranks, passes, mix
    inputs, plan = plan_for(train, hidden, job.identity, job.request, settings, training_nodes, checkpoint)
    text = plan.describe(inputs)
    job.log("streaming plan:\n" + text)
    figures = StreamingFigures(plan, text, job.request.spool_bytes, plan.data_bytes)

    files = RunFiles(job.folder, job.spool)
    files.folder.mkdir(parents=True, exist_ok=True)
    r = job.request
    create_spool(
        files.spool,
        SpoolSettings(
            {LANE: r.spool_bytes},  # one lane: the plan's one capture host (LAUNCHED_CAPTURE_HOSTS)
            inputs.passes,
            settings.max_len,
            settings.batch_tokens,
            settings.seed,
            hidden,
            mix_shards=inputs.mix_shards,
        ),
    )
    run_id = uuid.uuid4().hex[:12]
    # first (a side of an earlier run sees another run's heartbeat and leaves), beating several times per orphan_after_s
    heartbeat = Heartbeat(files.folder, run_id, min(HEARTBEAT_EVERY_S, job.orphan_after_s / 4))
    capture_spec, training_spec = side_specs(job, files, run_id, held_split)
    files.capture_spec.write_text(json.dumps(capture_spec, indent=1))
    files.training_spec.write_text(json.dumps(training_spec, indent=1))
    for stale in (files.eval_done, files.capture_progress, files.training_progress, files.training_report):
        stale.unlink(missing_ok=True)  # the sides write them afresh; the record is kept (a resume writes after it)
    launcher: SidesLauncher = job.launcher if job.launcher is not None else LocalSides()
    sampler = FillSampler(files.spool)
    # its clock: the run's seconds (the GB/s), from the sides' start to the end
    watch = Watch(files, sampler, figures, heartbeat)
    sides: list[SideHandle] = []
    try:
        sides.append(launcher.start_capture(files.capture_spec, files.capture_log))
        sides.append(
            launcher.start_training(
                files.training_spec,
                files.training_log,
                nodes=inputs.training.count,
                processes_per_node=inputs.training.gpus_per_host,
            )
        )
        for side in sides:
            job.log(f"streaming run {run_id}: {side.describe()}")
        follow(job, sides[0], sides[1], watch)
    except BaseException:  # a side's failure, or this step stopped (terminate, Ctrl-C): both sides stop
        job.log(f"streaming run {run_id}: stopping both sides; {files.folder} is kept, and the next run resumes")
        for side in sides:
            side.stop()
        raise
    finally:
        heartbeat.close()
        sampler.close()
    report = finish(job, watch)
    shutil.rmtree(files.folder)  # finished: nothing of it is needed again (a failed run keeps it and resumes)
    shutil.rmtree(files.spool, ignore_errors=True)  # when the spool is elsewhere (streaming_spool_dir)
    return report, figures


@dataclass
class Watch:
    """What the orchestrator reads while the sides run: their progress files and the spool's fill; and its own
    threads (the spool's sampler, the heartbeat), whose failure fails the step (`raise_if_failed`)."""

    files: RunFiles
    sampler: FillSampler
    figures: StreamingFigures
    heartbeat: Heartbeat | None = None
    started: float = field(default_factory=time.monotonic)

    def raise_if_failed(self) -> None:
        """Raise the error that ended the sampler's or the heartbeat's thread, if one did."""
        self.sampler.raise_if_failed()
        if self.heartbeat is not None:
            self.heartbeat.raise_if_failed()

    def update(self) -> dict[str, Any]:
        """The figures as of now, from the sides' progress files and the sampler; the observation of them."""
        f = self.figures
        f.capture = last_line(self.files.capture_progress) or f.capture
        t = last_line(self.files.training_progress)
        if t:
            f.train_steps, f.estimated_steps, f.train_tokens = (
                int(t["steps"]),
                int(t["estimated_steps"]),
                int(t["tokens"]),
            )
            f.train_bytes_read, f.train_waited_s = int(t["bytes_read"]), float(t["waited_s"])  # rank 0's
            if "coverage" in t:
                f.train_coverage = {int(k): int(v) for k, v in t["coverage"].items()}
        f.seconds = time.monotonic() - self.started
        f.peak_bytes, f.fill_samples = max(f.peak_bytes, self.sampler.peak), self.sampler.samples
        return f.observation(self.sampler.last)


def follow(job: StreamingJob, capture: SideHandle, training: SideHandle, watch: Watch, poll_s: float = 0.2) -> None:
    """Until the training side has finished (and then the capture side): log and observe the figures at most every
    `job.progress_every_s`; a side that fails stops the other and fails the run with its log's tail."""
    last = time.monotonic()
    while True:
        watch.raise_if_failed()  # a thread of this step that failed fails it (the caller stops both sides)
        done_capture, done_training = capture.poll(), training.poll()
        if done_capture not in (None, 0):
            training.stop()
            raise CaptureFailed(
                f"the capture side ({capture.describe()}) exited with {done_capture}; the training side was stopped. "
                f"The end of its log:\n{capture.tail()}"
            )
        if done_training not in (None, 0):
            capture.stop()
            raise StreamingTrainingFailed(
                f"the training side ({training.describe()}) exited with {done_training}; the capture side was stopped. "
                f"The end of its log:\n{training.tail()}"
            )
        if done_training == 0:
            break
        if time.monotonic() - last >= job.progress_every_s:
            last = time.monotonic()
            o = watch.update()
            job.log(
                f"streaming: capture {o['capture_tokens']:,} tokens ({o['capture_gb_per_s']:.3f} GB/s), training step "
                f"{o['train_steps']}/~{o['train_steps_estimated']} ({o['train_gb_per_s']:.3f} GB/s read), spool "
                f"{o['spool_fill_pct']}% full (peak {o['spool_peak_bytes']:,} B); {o['who_waits']}"
            )
            job.observe(o)
        time.sleep(poll_s)
    # the trainer has read every planned shard, so the capture side has committed them all and is ending
    deadline = time.monotonic() + 300
    while (done_capture := capture.poll()) is None and time.monotonic() < deadline:
        time.sleep(poll_s)
    if done_capture != 0:
        capture.stop()
        raise CaptureFailed(
            f"the training side finished, yet the capture side ({capture.describe()}) "
            + ("still runs 300 s later" if done_capture is None else f"exited with {done_capture}")
            + f": the end of its log:\n{capture.tail()}"
        )


def finish(job: StreamingJob, watch: Watch) -> DrafterReport:
    """The training side's report, the final figures (the run's seconds on `watch`'s clock, which `follow` kept)
    logged and observed."""
    files, figures, sampler = watch.files, watch.figures, watch.sampler
    if not files.training_report.exists():
        raise StreamingTrainingFailed(f"the training side exited 0 without its report ({files.training_report})")
    d = read_json(files.training_report)
    report = replace(report_from_json(d), best_checkpoint=d.get("best_checkpoint"))
    watch.update()
    s = d["streaming"]
    figures.train_steps, figures.train_tokens = len(report.history.step_loss), report.history.tokens
    figures.train_bytes_read, figures.train_waited_s = int(s["bytes_read"]), float(s["waited_s"])  # every rank's
    figures.train_waited_s_max = float(s["waited_s_max"])
    figures.train_bytes_read_per_rank = [int(b) for b in s["bytes_read_per_rank"]]
    figures.train_coverage = {int(k): int(v) for k, v in s["coverage"].items()}
    job.observe(figures.observation(sampler.last))
    job.log(f"streaming done: {figures.who_waits()}; spool peak {figures.peak_bytes:,} of {figures.budget_bytes:,} B")
    return report
