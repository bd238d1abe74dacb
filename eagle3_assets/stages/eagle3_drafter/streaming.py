"""The drafter's streaming mode as one materialization (issue 27): plan, capture in a process of its own, train
from the spool here, watch both, export.

`stream_drafter` is what `eagle3_drafter` calls when `streaming_spool_gb` is set (offline stays the default):

1. The plan (`streaming_plan.plan_streaming`) of the merged set's training split with the given or measured rates:
   its duration, peak disk and bottleneck are logged and returned for the metadata; a spool that cannot hold the
   working set is refused here (`SpoolTooSmall`), before any folder is made or process started.
2. A capture process (`python -m eagle3_assets.stages.eagle3_drafter.streaming SPEC`) builds the backend the
   `hidden_states` asset builds (the `hidden_states_backend` resource: SGLang on a GPU host, transformers on the
   CPU), extracts the eval split into a small offline store (the held-out scores need it after the spool's shards
   are gone), then captures the training split into the spool's one lane (`capture_to_spool`), writing its progress
   figures as JSON lines.
3. This process trains from the spool (`SpoolWindows`: the real Trainer, `passes` passes as one epoch, its
   position in the atomic checkpoint); a wait for shards ends with an error if the capture process has died.
4. A sampler thread reads the spool's bytes on disk (`spool_status`) throughout; after each step, at most every
   `progress_every_s`, and at the end, `observe` gets the figures: capture and training progress, the spool's fill
   and its sampled peak, GB/s in (capture's writes) and out (the trainer's reads), and the seconds each side waited
   for the other.

Where it lives: `<drafter>.streaming/` beside the exported drafter (spool/, eval_states/, training/ checkpoints,
the capture's spec, log and figures). A run that fails or is stopped leaves it, and the next one resumes both sides
exactly (the spool's own guarantees); a run that finishes removes it. The upstream is the merged set, as
`hidden_states`' own: the asset keeps `hidden_states` as its dependency (the lineage is unchanged), and streaming
mode does not read the offline store.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import polars as pl

from eagle3_assets.stages.eagle3_drafter.data import PackedBatch, Window, plan_windows
from eagle3_assets.stages.eagle3_drafter.pipeline import (
    DrafterJob,
    DrafterReport,
    Outcome,
    Splits,
    build_drafter,
    export_report,
)
from eagle3_assets.stages.eagle3_drafter.spool_data import SpoolWindows, read_plans
from eagle3_assets.stages.eagle3_drafter.streaming_plan import Hosts, StreamingInputs, StreamingPlan, plan_streaming
from eagle3_assets.stages.eagle3_drafter.train import (
    Every,
    RunOptions,
    Trainer,
    TrainSettings,
    eval_samples,
    evaluate,
    training_device,
)
from eagle3_resources.cpu import apply_torch_threads
from eagle3_resources.errors import CaptureFailed
from eagle3_resources.hidden_states.spool import (
    Position,
    SpoolReader,
    SpoolSettings,
    Step,
    create_spool,
    spool_status,
)
from eagle3_resources.hidden_states.store import (
    HiddenStateStore,
    StoredSample,
    plan_shards,
    shard_layout,
    token_bytes,
)

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
    rates_source: dict[str, str]  # where each planned rate came from
    capture_gpus: int = 1
    writers: int = 2


@dataclass
class StreamingFigures:
    """What the run measured, for the log, the observations and the metadata."""

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
    train_bytes_read: int = 0
    train_waited_s: float = 0.0
    seconds: float = 0.0

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
            "streaming_who_waits": self.who_waits(),
            "streaming_seconds": round(self.seconds, 1),
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
    train: list[StoredSample], hidden: int, identity: dict[str, Any], request: StreamingRequest, settings: TrainSettings
) -> tuple[StreamingInputs, StreamingPlan]:
    """The plan of streaming `train` (refused with `SpoolTooSmall` when the spool cannot hold its working set); the
    largest shard is measured on the capture's own shard plan."""
    plans = plan_shards(train, hidden, request.shard_bytes, identity)
    sizes = [shard_layout(p, [train[i] for i in p.samples], hidden).size for p in plans]
    inputs = StreamingInputs(
        tokens=sum(len(s.input_ids) for s in train),
        bytes_per_token=token_bytes(hidden),
        capture=Hosts(1, request.capture_tok_s, request.capture_gpus),
        training=Hosts(1, request.train_tok_s, 1),
        spool_bytes_per_s=request.spool_bytes_per_s,
        spool_budget_bytes=request.spool_bytes,
        passes=request.passes,
        shard_bytes=max(sizes, default=1),
        checkpoint_every_tokens=settings.checkpoint_every * settings.batch_tokens,
    )
    return inputs, plan_streaming(inputs)


class _WatchedReader(SpoolReader):
    """The spool's reader whose waits also end (with the watch's `CaptureFailed`) once the capture process died."""

    def __init__(self, root: Path, watch: Callable[[], bool], *, position: Position, poll_s: float):
        super().__init__(root, position=position, poll_s=poll_s)
        self.watch = watch

    def next_step(
        self, stop: Callable[[], bool] = lambda: False, on_wait: Callable[[], None] | None = None
    ) -> Step | None:
        return super().next_step(lambda: self.watch() or stop(), on_wait)


class _WatchedWindows(SpoolWindows):
    """`SpoolWindows` whose reader is a `_WatchedReader`, opened where and as `SpoolWindows` opens its own."""

    watch: Callable[[], bool] = staticmethod(lambda: False)

    def steps(self, epoch: int, start: int) -> Generator[tuple[list[Window], PackedBatch], None, None]:
        if self.reader is None:
            self.reader = _WatchedReader(self.root, self.watch, position=self.position, poll_s=self.poll_s)
        yield from super().steps(epoch, start)


class CaptureProcess:
    """The capture side: `python -m eagle3_assets.stages.eagle3_drafter.streaming SPEC` in its own process group."""

    def __init__(self, spec: dict[str, Any], folder: Path):
        self.folder = folder
        self.spec_path = folder / "capture.json"
        self.spec_path.write_text(json.dumps(spec))
        self.log_path = folder / "capture.log"
        self.progress_path = Path(spec["progress"])
        self.eval_done = Path(spec["eval_done"])
        self.eval_done.unlink(missing_ok=True)
        self.progress_path.unlink(missing_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "eagle3_assets.stages.eagle3_drafter.streaming", str(self.spec_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                process_group=0,
            )
        self.died_at: float | None = None

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""

    def failed(self) -> bool:
        """Raises `CaptureFailed` if the process ended with an error, or ended cleanly over a minute ago while the
        trainer still waits (its shards cannot come); False while it runs."""
        rc = self.proc.poll()
        if rc is None:
            return False
        if rc != 0:
            raise CaptureFailed(f"the capture process exited with {rc}; its log ({self.log_path}):\n{self.tail()}")
        self.died_at = self.died_at or time.monotonic()
        if time.monotonic() - self.died_at > 60:
            raise CaptureFailed(f"the capture process finished, yet the trainer still waits for shards: {self.tail()}")
        return False

    def wait_for_eval(self, poll_s: float = 0.2) -> None:
        while not self.eval_done.exists():
            rc = self.proc.poll()
            if rc is not None and not self.eval_done.exists():
                raise CaptureFailed(f"the capture process exited with {rc} before the eval split: {self.tail()}")
            time.sleep(poll_s)

    def last_progress(self) -> dict[str, Any]:
        try:
            lines = self.progress_path.read_text().splitlines()
        except FileNotFoundError:
            return {}
        for line in reversed(lines):
            if line.endswith("}"):
                return json.loads(line)
        return {}

    def finish(self, timeout: float = 600) -> dict[str, Any]:
        rc = self.proc.wait(timeout)
        if rc != 0:
            raise CaptureFailed(f"the capture process exited with {rc}; its log ({self.log_path}):\n{self.tail()}")
        return self.last_progress()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class FillSampler:
    """The spool's bytes on disk, sampled from a thread of its own; `peak` the largest seen."""

    def __init__(self, root: Path, every_s: float = 0.05):
        self.root, self.every_s = root, every_s
        self.peak, self.samples, self.last = 0, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.every_s)

    def sample(self) -> int:
        self.last = int(spool_status(self.root)["bytes_on_disk"])
        self.peak, self.samples = max(self.peak, self.last), self.samples + 1
        return self.last

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


@dataclass(frozen=True)
class StreamingJob:
    """A streaming drafter run: the merged set, the target, where it goes, how it trains."""

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

    @property
    def folder(self) -> Path:
        return Path(str(self.out_dir) + ".streaming")


def stream_drafter(job: StreamingJob) -> tuple[DrafterReport, StreamingFigures]:
    """Plan (refusing a spool too small before anything starts), capture in a process of its own, train here from
    the spool, export; the report as `run_drafter_job`'s, and the streaming figures."""
    settings = replace(job.settings, epochs=1)  # the spool's passes are its one epoch
    hidden = target_hidden_size(job.target_folder)
    train, held, held_split = split_samples(job.merged)
    inputs, plan = plan_for(train, hidden, job.identity, job.request, settings)  # SpoolTooSmall: nothing made yet
    text = plan.describe(inputs)
    job.log("streaming plan:\n" + text)
    figures = StreamingFigures(plan, text, job.request.spool_bytes, plan.data_bytes)

    folder = job.folder
    spool, eval_root, checkpoints = folder / "spool", folder / "eval_states", folder / "training"
    create_spool(
        spool,
        SpoolSettings(
            {LANE: job.request.spool_bytes},
            job.request.passes,
            settings.max_len,
            settings.batch_tokens,
            settings.seed,
            hidden,
        ),
    )
    spec = {
        "merged": str(job.merged_path),
        "spool": str(spool),
        "eval_root": str(eval_root),
        "lane": LANE,
        "shard_bytes": job.request.shard_bytes,
        "writers": job.request.writers,
        "identity": job.identity,
        "resources": job.resources,
        "progress": str(folder / "capture-progress.jsonl"),
        "eval_done": str(folder / "eval-done"),
        "progress_every_s": min(job.progress_every_s, 1.0),
    }
    capture = CaptureProcess(spec, folder)
    sampler = FillSampler(spool)
    try:
        side = TrainerSide(capture, sampler, eval_root, held_split, checkpoints, spool)
        report = train_here(job, settings, side, figures)
        figures.capture = capture.finish()
    finally:
        capture.kill()
        sampler.close()
    figures.peak_bytes, figures.fill_samples = max(figures.peak_bytes, sampler.peak), sampler.samples
    job.observe(figures.observation(sampler.last))
    job.log(f"streaming done: {figures.who_waits()}; spool peak {figures.peak_bytes:,} of {figures.budget_bytes:,} B")
    shutil.rmtree(folder)  # finished: nothing of it is needed again (a failed run keeps it and resumes)
    return report, figures


@dataclass
class StreamingProgress:
    """The `Every(1)` hook of a streaming training: the figures after each step; a log line and an observation at
    most every `job.progress_every_s`."""

    job: StreamingJob
    data: SpoolWindows
    capture: CaptureProcess
    sampler: FillSampler
    figures: StreamingFigures
    started: float = field(default_factory=time.monotonic)
    last: float = 0.0

    def __call__(self, trainer: Trainer) -> None:
        self.record(trainer.global_step, trainer.tokens_done)
        if time.monotonic() - self.last < self.job.progress_every_s:
            return
        self.last = time.monotonic()
        self.figures.capture = self.capture.last_progress()
        o = self.figures.observation(self.sampler.last)
        self.job.log(
            f"streaming: capture {o['capture_tokens']:,} tokens ({o['capture_gb_per_s']:.3f} GB/s), training step "
            f"{o['train_steps']}/~{o['train_steps_estimated']} ({o['train_gb_per_s']:.3f} GB/s read), spool "
            f"{o['spool_fill_pct']}% full (peak {o['spool_peak_bytes']:,} B); {o['who_waits']}"
        )
        self.job.observe(o)

    def record(self, steps: int, tokens: int) -> None:
        f = self.figures
        f.train_steps, f.train_tokens = steps, tokens
        f.train_bytes_read, f.train_waited_s = self.data.bytes_read, self.data.waited_s
        f.seconds, f.peak_bytes = time.monotonic() - self.started, max(f.peak_bytes, self.sampler.peak)


@dataclass(frozen=True)
class TrainerSide:
    """What the trainer's side works with: the capture process and the spool's sampler, the eval states' store
    the capture writes first (of the `held_split`), where the checkpoints go, the spool."""

    capture: CaptureProcess
    sampler: FillSampler
    eval_root: Path
    held_split: str
    checkpoints: Path
    spool: Path


def train_here(
    job: StreamingJob, settings: TrainSettings, side: TrainerSide, figures: StreamingFigures
) -> DrafterReport:
    """The trainer's side: vocabulary and model as `run_drafter_job` builds them, scores on the eval states the
    capture process stored first, training from the spool with the progress hook, then the export."""
    log, dev = job.log, training_device(job.device)
    if dev.type == "cpu":
        apply_torch_threads("drafter training (streaming)", log)
    train_ids = job.merged.filter(pl.col("split") == "train")["sample_id"].to_list()
    lengths = dict(job.merged.select("sample_id", "n_tokens").iter_rows())
    train_plan = plan_windows([(s, int(lengths[s])) for s in train_ids], settings.max_len)
    drafter_job = DrafterJob(
        None,
        job.merged,
        job.target_folder,
        job.out_dir,
        settings,
        job.requested_draft_vocab,
        log,
        device=job.device,
        init_from=job.init_from,
    )
    built = build_drafter(drafter_job, target_hidden_size(job.target_folder), train_ids, dev)
    model, teacher = built.model, built.teacher

    side.capture.wait_for_eval()
    store = HiddenStateStore(side.eval_root)
    eval_lengths = {sid: end - start for sid, (_, start, end, _) in store.index.items()}
    splits = Splits(
        train_ids, train_plan, plan_windows(sorted(eval_lengths.items()), settings.max_len), side.held_split
    )
    held_out = partial(eval_samples, store, splits.eval.windows, teacher, dev)
    untrained = evaluate(model, held_out(), settings.ttt_steps)
    log(f"untrained drafter on {splits.eval_split}: accept length {untrained['accept_length']}, acc {untrained['acc']}")

    while read_plans(side.spool, [LANE]) is None:  # the capture's plan (SpoolWindows would wait for it unwatched)
        side.capture.failed()
        time.sleep(0.05)
    data = _WatchedWindows(side.spool, settings, dev, log, poll_s=0.05)
    data.watch = side.capture.failed
    figures.estimated_steps = data.estimated_steps
    progress = StreamingProgress(job, data, side.capture, side.sampler, figures)
    trainer = Trainer(
        model, data, settings, RunOptions(dev, log, side.checkpoints), teacher, held_out, [Every(1, progress)]
    )
    data.on_wait = trainer.checkpoint
    history = trainer.fit()
    progress.record(len(history.step_loss), history.tokens)
    if data.reader is None or not data.reader.finished:
        raise CaptureFailed("the trainer ended before every pass over the spool's shards was trained")
    trained = evaluate(model, held_out(), settings.ttt_steps)
    log(f"trained drafter on {splits.eval_split}: accept length {trained['accept_length']}, acc {trained['acc']}")
    outcome = Outcome(untrained, trained, history, extra={"streaming_passes": job.request.passes})
    return export_report(drafter_job, built, store.manifest["aux_layer_ids"], splits, outcome)


def capture_main(spec_path: Path) -> None:
    """The capture process: the eval split into its store, then the training split into the spool's lane."""
    from eagle3_resources.hidden_states.extract import StoreSettings, capture_to_spool, extract_to_store
    from eagle3_resources.hidden_states.resource import HiddenStatesResource
    from eagle3_resources.target.resource import TargetModelResource
    from eagle3_resources.tokenizer.resource import TokenizerResource

    spec = json.loads(spec_path.read_text())
    log = partial(print, flush=True)
    r = spec["resources"]
    target, tokenizer = TargetModelResource(**r["target"]), TokenizerResource(**r["tokenizer"])
    resource = HiddenStatesResource(**r["hidden_states_backend"])
    train, held, _ = split_samples(pl.read_parquet(spec["merged"]))
    settings = StoreSettings(
        shard_bytes=int(spec["shard_bytes"]), batch_tokens=resource.batch_tokens, writers=int(spec["writers"])
    )
    apply_torch_threads("hidden-state capture (streaming)", log)
    backend = resource.make_backend(target, tokenizer, log)
    try:
        extract_to_store(held, backend, Path(spec["eval_root"]), settings, identity=spec["identity"], log=log)
        Path(spec["eval_done"]).touch()
        with open(spec["progress"], "a") as progress:

            def on_progress(figures: dict[str, Any]) -> None:
                progress.write(json.dumps(figures) + "\n")
                progress.flush()

            report = capture_to_spool(
                train,
                backend,
                Path(spec["spool"]),
                spec["lane"],
                settings,
                identity=spec["identity"],
                log=log,
                progress_every_s=float(spec["progress_every_s"]),
                on_progress=on_progress,
                poll_s=0.05,
            )
            final = {"bytes_per_s": report.bytes_per_s, "busy_bytes_per_s": report.busy_bytes_per_s}
            on_progress({**final, **_last_line(Path(spec["progress"])), **final})
    finally:
        backend.close()


def _last_line(path: Path) -> dict[str, Any]:
    lines = [line for line in path.read_text().splitlines() if line.endswith("}")]
    return json.loads(lines[-1]) if lines else {}


if __name__ == "__main__":
    capture_main(Path(sys.argv[1]))
