"""The drafter's streaming mode as one Dagster materialization (issue 27), on the CPU stand-ins: the plan first, the
capture side and the training side each a process group of its own (two hosts simulated on one machine, sharing
the run's folder; the capture with the stand-in target through the `hidden_states_backend` resource, the real
trainer from a spool whose budget is about a tenth of the data), every token trained exactly `passes` times by the
trainer's record; and a spool too small refused before anything starts."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import dagster as dg
import polars as pl
import pytest
from test_drafter_training import corpus
from test_spool import Sampler

from eagle3_assets.stages.eagle3_drafter.asset import DrafterTrainConfig, eagle3_drafter
from eagle3_assets.stages.eagle3_drafter.streaming import LANE, split_samples
from eagle3_resources.errors import SpoolTooSmall
from eagle3_resources.hidden_states.lane_lock import lane_lock_path, trainer_lock_path
from eagle3_resources.hidden_states.resource import HiddenStatesResource
from eagle3_resources.hidden_states.spool import min_lane_bytes
from eagle3_resources.hidden_states.store import ALIGN, plan_mixed_shards, shard_layout
from eagle3_resources.storage import DataLayout, DataStore
from eagle3_resources.target.resource import TargetModelResource
from eagle3_resources.tokenizer.resource import TokenizerResource

HIDDEN = 64  # the stand-in target's
PASSES = 2
SHARD_BYTES = 40_000  # about one sample a shard
pytestmark = pytest.mark.timeout(1200)


def training_shards(merged: pl.DataFrame) -> dict[str, tuple[int, int]]:
    """Sample id -> (its shard's number, that shard's bytes), the training split cut into shards as the capture cuts
    it (the spool's own plan, its datasets interleaved by the training seed, and file layout)."""
    train, _, _ = split_samples(merged)
    seed = DrafterTrainConfig().seed  # the runs' (run_config leaves it)
    plans = plan_mixed_shards(train, HIDDEN, SHARD_BYTES, {}, seed)  # the identity enters keys, not names or sizes
    return {
        train[i].sample_id: (k, shard_layout(p, [train[j] for j in p.samples], HIDDEN).size)
        for k, p in enumerate(plans)
        for i in p.samples
    }


def write_merged(data_root: Path, tok) -> tuple[int, int]:
    """The merged set (64 samples, a quarter of them eval) at its place; (the training split's shard bytes as the
    capture cuts them, the largest shard's)."""
    merged = corpus(tok, 64)
    path = DataLayout(data_root).merged_dataset()
    path.parent.mkdir(parents=True, exist_ok=True)
    merged.write_parquet(path)
    sizes = dict(training_shards(merged).values())
    return sum(sizes.values()), max(sizes.values())


def streaming_folder(data_root: Path) -> Path:
    """Where a streaming run keeps its files: beside the exported drafter, under the data root."""
    return Path(str(DataLayout(data_root).drafter()) + ".streaming")


def run_config(spool_bytes: int, **more: object) -> dict:
    """The drafter's config of these tests: the tiny trainer, the spool, the declared plan rates; `more` on top."""
    return {
        "ttt_steps": 3,
        "batch_tokens": 200,
        "max_len": 64,
        "checkpoint_every": 3,
        "draft_vocab_size": 512,
        "spec_eval_prompts": 0,
        "streaming_spool_gb": spool_bytes / 1e9,
        "streaming_passes": PASSES,
        "streaming_shard_gb": SHARD_BYTES / 1e9,
        "streaming_capture_tok_s": 2000.0,
        "streaming_train_tok_s": 500.0,
        "streaming_spool_gb_s": 0.5,
    } | more


def resources_for(data_root: Path) -> dict:
    standin = str(data_root / "standin")
    return {
        "store": DataStore(root=str(data_root)),
        "tokenizer": TokenizerResource(standin_dir=standin),
        "target": TargetModelResource(standin_dir=standin),
        "hidden_states_backend": HiddenStatesResource(batch_tokens=512),
    }


def materialize(data_root: Path, spool_bytes: int, **more: object):
    with dg.instance_for_test() as instance:
        result = dg.materialize(
            [eagle3_drafter],
            instance=instance,
            raise_on_error=False,
            run_config={"ops": {"eagle3_drafter": {"config": run_config(spool_bytes, **more)}}},
            resources=resources_for(data_root),
        )
        records = instance.fetch_observations(eagle3_drafter.key, limit=1000).records
        observations = [r.asset_observation.metadata for r in reversed(records) if r.asset_observation is not None]
    return result, observations


class SidesSeen:
    """The sides' processes as they run, seen from outside: each side's lock file (the capture's lane writer lock,
    the training side's trainer lock) names its holder's pid; while that process lives, its process group is read."""

    def __init__(self, spool: Path):
        self.paths = {"capture": lane_lock_path(spool, LANE), "training": trainer_lock_path(spool)}
        self.seen: dict[str, tuple[int, int]] = {}  # side -> (pid, process group)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            for side, path in self.paths.items():
                try:
                    pid = int(json.loads(path.read_text())["pid"])
                    self.seen[side] = (pid, os.getpgid(pid))
                except (FileNotFoundError, json.JSONDecodeError, KeyError, ProcessLookupError):
                    continue

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class KeptFile:
    """A file of the run's folder kept past the folder's removal: hard-linked at `keep` as soon as it exists. The
    link is the same file, so it holds every line appended to it until the end (the trainer's record is opened once,
    for appending)."""

    def __init__(self, path: Path, keep: Path):
        self.path, self.keep = path, keep
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                os.link(self.path, self.keep)
                return
            except FileNotFoundError:
                continue

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.mark.slow
def test_one_materialization_captures_and_trains_through_a_tenth_of_the_data(data_dir_with_standin, tok):
    data_bytes, largest = write_merged(data_dir_with_standin, tok)
    budget = data_bytes // 10
    assert budget >= min_lane_bytes(PASSES, largest), (budget, largest)  # the tenth still holds the working set
    spool = streaming_folder(data_dir_with_standin) / "spool"
    sampler, sides = Sampler(spool), SidesSeen(spool)
    try:
        result, observations = materialize(data_dir_with_standin, budget)
    finally:
        sampler.stop()
        sides.stop()
    assert result.success, result.all_events[-5:]
    meta = {k: v.value for k, v in result.asset_materializations_for_node("eagle3_drafter")[0].metadata.items()}
    print({k: v for k, v in meta.items() if k.startswith("streaming_") and k != "streaming_plan"})

    # the plan was made and recorded, for these figures
    assert "bottleneck: " in meta["streaming_plan"] and meta["streaming_planned_bottleneck"] == "training"
    # capture: every training token, once, into the spool
    train_tokens = meta["train_tokens"]
    assert meta["streaming_capture_tokens"] == train_tokens > 0
    assert meta["streaming_capture_shards"] >= 10 and meta["streaming_capture_gb_per_s"] > 0
    # training: every token trained PASSES times, its bytes read from the spool
    assert meta["streaming_train_tokens"] == PASSES * train_tokens
    # every row's chunk once (a shard's header chunk is not read: its index is in the manifest), whatever the passes
    shards = meta["streaming_capture_shards"]
    assert data_bytes - shards * ALIGN <= meta["streaming_train_bytes_read"] <= data_bytes
    assert meta["streaming_train_gb_per_s"] > 0
    assert meta["streaming_train_steps"] == len(meta["loss_per_step"])
    # the spool stayed within its budget, sampled by the asset and from here, and was pressed against it
    assert meta["streaming_spool_budget_bytes"] <= budget
    assert 0 < meta["streaming_spool_peak_bytes_sampled"] <= meta["streaming_spool_budget_bytes"]
    assert sampler.samples > 100 and 0 < sampler.peak <= meta["streaming_spool_budget_bytes"]
    assert meta["streaming_capture_pauses"] > 0 and "waited" in meta["streaming_who_waits"]
    assert meta["sglang_key_check"] == "ok" and meta["accept_length_simulated"] > 0
    # every training token trained exactly PASSES times, by the trainer's per-step record
    assert meta["streaming_trained_token_passes"] == {str(PASSES): train_tokens}
    # two hosts simulated on one machine: capture and training ran as two process groups of their own, sharing the
    # run's folder (both locks are in its spool), neither the test's (where the materializing step ran)
    (capture_pid, capture_group), (training_pid, training_group) = sides.seen["capture"], sides.seen["training"]
    assert capture_group != training_group and os.getpgid(0) not in (capture_group, training_group)
    assert (capture_group, training_group) == (capture_pid, training_pid)  # each its group's leader
    # progress seen as observations of the drafter; the run's folder is gone once it is done
    last = observations[-1]
    assert last["train_steps"].value == meta["streaming_train_steps"] and "spool_fill_pct" in last
    assert not spool.parent.exists()


def test_a_spool_too_small_is_refused_before_capture_starts(data_dir_with_standin, tok):
    _, largest = write_merged(data_dir_with_standin, tok)
    result, observations = materialize(data_dir_with_standin, min_lane_bytes(PASSES, largest) - 4096)
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert failure.step_failure_data.error.cause.cls_name == "SpoolTooSmall"
    description = failure.step_failure_data.user_failure_data.description
    assert description.endswith(f"What to do: {SpoolTooSmall.what_to_do}") and "least it can run with" in description
    streaming = streaming_folder(data_dir_with_standin)
    assert not streaming.exists() and not observations  # no spool, no capture process, no progress


@pytest.mark.slow
def test_best_every_in_streaming_mode_keeps_and_exports_the_best_checkpoint(data_dir_with_standin, tok):
    """`best_every` runs in the training side as offline: the main rank decodes the held-out prompts with the target
    every N steps and at the last; the drafter exported is the step with the highest accept length."""
    data_bytes, _ = write_merged(data_dir_with_standin, tok)
    result, _ = materialize(
        data_dir_with_standin, data_bytes // 10, best_every=25, best_prompts_per_kind=2, spec_eval_new_tokens=8
    )
    assert result.success, result.all_events[-5:]
    meta = {k: v.value for k, v in result.asset_materializations_for_node("eagle3_drafter")[0].metadata.items()}
    curve = meta["accept_length_curve"]["curve"]
    steps = [r["step"] for r in curve]
    assert steps[:-1] == list(range(25, steps[-1], 25)) and steps[-1] == meta["streaming_train_steps"]
    best = max(curve, key=lambda r: (r["accept_length"], -r["step"]))  # the earlier step wins a tie
    assert meta["best_checkpoint_step"] == best["step"]
    exported = json.loads((Path(meta["path"]) / "config.json").read_text())["eagle3_pipeline"]
    assert exported["best_step"] == best["step"] and exported["streaming_passes"] == PASSES


@pytest.mark.slow
def test_two_training_ranks_under_torchrun(data_dir_with_standin, tok):
    """`processes: 2`: the training side runs under torchrun (rank 0 reads the spool, rank 1 follows), the capture
    side in a process group of its own; every token is trained exactly PASSES times, counted on rank 0's record of
    whole steps; the bytes read reported are both ranks', each rank's the shards its windows needed."""
    data_bytes, _ = write_merged(data_dir_with_standin, tok)
    spool = streaming_folder(data_dir_with_standin) / "spool"
    sides = SidesSeen(spool)
    folder = streaming_folder(data_dir_with_standin)
    record = KeptFile(folder / "training-record.jsonl", data_dir_with_standin / "record.jsonl")
    progress = KeptFile(folder / "training-progress.jsonl", data_dir_with_standin / "progress.jsonl")
    try:
        result, _ = materialize(data_dir_with_standin, data_bytes // 10, processes=2)
    finally:
        sides.stop()
        record.stop()
        progress.stop()
    assert result.success, result.all_events[-5:]
    meta = {k: v.value for k, v in result.asset_materializations_for_node("eagle3_drafter")[0].metadata.items()}
    assert meta["train_processes"] == 2
    assert meta["streaming_trained_token_passes"] == {str(PASSES): meta["train_tokens"]}
    # the bytes the training side read are both ranks': each rank reads of each shard its share of a step needs (the
    # step's windows rank::2, or its first window when it has one only) the chunks its rows lie in, once, bounded here
    # from the trainer's record of every step's windows and the capture's shard plan
    steps = [json.loads(line) for line in record.keep.read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, meta["streaming_train_steps"] + 1))
    shards = training_shards(pl.read_parquet(DataLayout(data_dir_with_standin).merged_dataset()))
    # each rank reads only the chunks its share's rows lie in (rank 0 too: issue 42), so at most those shards' bytes
    needed = [
        {shards[sid] for s in steps for sid, _, _ in s["windows"][rank::2] or s["windows"][:1]} for rank in range(2)
    ]
    per_rank = [sum(size for _, size in need) for need in needed]
    print({k: v for k, v in meta.items() if k.startswith("streaming_train_")}, "at most per rank:", per_rank)
    got = meta["streaming_train_bytes_read_per_rank"]
    assert len(got) == 2 and all(0 < g <= most for g, most in zip(got, per_rank, strict=True)), (got, per_rank)
    assert meta["streaming_train_bytes_read"] == sum(got)
    assert meta["streaming_train_waited_s_max"] >= meta["streaming_train_waited_s"] >= 0
    # the GB/s are over the run's seconds, which hold the training side's (its last progress line: rank 0's seconds
    # from before its first step to after its last)
    trained_s = json.loads(progress.keep.read_text().splitlines()[-1])["seconds"]
    assert meta["streaming_seconds"] >= round(trained_s, 1) > 0
    assert 0 < meta["streaming_train_gb_per_s"] <= sum(per_rank) / trained_s / 1e9
    # rank 0 (torchrun starts each rank in a session of its own): neither the capture's group nor the test's
    (capture_pid, capture_group), (_, training_group) = sides.seen["capture"], sides.seen["training"]
    assert capture_group == capture_pid and training_group not in (capture_group, os.getpgid(0))


@pytest.mark.parametrize(
    ("more", "says"),
    [
        ({"streaming_nodes": 2}, "need `streaming_sides: kubernetes`"),
        ({"streaming_sides": "slurm"}, "`kubernetes` each as a Job"),
    ],
)
def test_a_launch_shape_this_machine_cannot_run_is_refused_before_anything_starts(
    data_dir_with_standin, tok, more, says
):
    """Several training nodes need a cluster launcher; an unknown launcher is named. Both refused before a spool or a
    process exists."""
    data_bytes, _ = write_merged(data_dir_with_standin, tok)
    result, observations = materialize(data_dir_with_standin, data_bytes // 10, **more)
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert says in failure.step_failure_data.error.cause.message
    streaming = streaming_folder(data_dir_with_standin)
    assert not streaming.exists() and not observations
