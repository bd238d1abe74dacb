"""The hidden-state stage: the layer convention against transformers' own output, the shard store,
resume after kill -9, and the disk check."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, TypedDict

import polars as pl
import pytest
import torch
import xxhash
from hidden_states_worker import samples as worker_samples
from support import stop_group

from eagle3_assets.stages.hidden_states.checks import HIDDEN_STATE_CHECKS, RUN_CHECKS
from eagle3_assets.stages.hidden_states.selection import select_samples
from eagle3_resources.errors import DiskSpaceError, StaleShardsError
from eagle3_resources.hidden_states.extract import (
    StoreSettings,
    batches,
    extract_to_store,
    store_figures,
)
from eagle3_resources.hidden_states.layers import eagle3_aux_layers
from eagle3_resources.hidden_states.store import (
    MANIFEST,
    HiddenStateStore,
    StoredSample,
    min_bytes_per_token,
    read_manifest,
)
from eagle3_resources.hidden_states.transformers_backend import TransformersHiddenStates

REPO = Path(__file__).resolve().parents[1]


class Roomy(TypedDict):
    """StoreSettings' disk figures for a test that is not about the disk check."""

    free_bytes: int
    reserve_bytes: int


ROOMY: Roomy = {"free_bytes": 10**12, "reserve_bytes": 0}  # the disk check is tested on its own below


def file_xxh3(path: Path) -> str:
    """The file's XXH3-128 (what the manifest records for new shards), by the library on the bytes read back."""
    return xxhash.xxh3_128(path.read_bytes()).hexdigest()


def make_samples(n: int, vocab: int, lengths=(5, 17, 33, 9, 64, 2, 40)) -> list[StoredSample]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        L = lengths[i % len(lengths)]
        ids = torch.randint(0, vocab, (L,), generator=g).tolist()
        out.append(
            StoredSample(
                f"{'AB'[i % 2]}1/{i:04d}", "eval" if i % 4 == 3 else "train", ids, [0] * (L // 3) + [1] * (L - L // 3)
            )
        )
    return out


def ground_truth_mismatches(
    model, ids: list[int], aux: torch.Tensor, final: torch.Tensor, layer_ids: list[int]
) -> list[str]:
    """Compare stored states with transformers' `output_hidden_states=True` on the same ids, in bf16 tolerance.

    HF's hidden_states[0] is the embedding output and hidden_states[i + 1] the output of decoder
    layer i, residual included; the final state is the norm's output (`last_hidden_state`).
    """
    with torch.no_grad():
        out = model.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    H = model.config.hidden_size
    problems = []
    for j, layer in enumerate(layer_ids):
        want = out.hidden_states[layer + 1][0].to(torch.bfloat16).float()
        got = aux[:, j * H : (j + 1) * H].float()
        if not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max())):
            problems.append(f"aux block {j} is not the output of layer {layer}")
    want_final = out.last_hidden_state[0].to(torch.bfloat16).float()
    if not torch.allclose(final.float(), want_final, rtol=2e-2, atol=2e-2 * float(want_final.abs().max())):
        problems.append("final is not the normed last hidden state")
    return problems


def test_layer_rule():
    assert eagle3_aux_layers(61) == [1, 29, 57]  # Kimi-K2.x
    assert eagle3_aux_layers(8) == [1, 3, 4]  # the stand-in
    with pytest.raises(ValueError):
        eagle3_aux_layers(6)


def test_batches_respect_the_token_budget():
    lengths = [5, 50, 7, 7, 30, 200, 1]
    groups = batches(lengths, 64)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) == 1 or max(lengths[i] for i in g) * len(g) <= 64
    assert [5] in groups  # longer than the budget: alone
    assert batches(lengths, 64) == groups  # deterministic


def test_store_holds_each_layer_output_and_the_normed_final_state(target_model, tmp_path):
    """Ground truth for the layer convention: batched, padded extraction through the store equals HF's hidden_states."""
    model = target_model
    backend = TransformersHiddenStates(model)
    samples = make_samples(9, model.config.vocab_size)
    settings = StoreSettings(shard_bytes=60_000, batch_tokens=128, **ROOMY)
    report = extract_to_store(samples, backend, tmp_path, settings, identity={"t": 1}, progress_every_s=3600)
    assert report.shards > 1 and report.samples_written == 9 and not report.nan_samples
    store = HiddenStateStore(tmp_path)
    assert read_manifest(tmp_path)["aux_layer_ids"] == [1, 3, 4] and len(store) == 9
    for s in samples:
        got = store[s.sample_id]
        assert got["input_ids"].tolist() == list(s.input_ids) and got["loss_mask"].tolist() == list(s.loss_mask)
        assert got["aux_hidden_states"].dtype == torch.bfloat16
        assert (
            ground_truth_mismatches(
                model, list(s.input_ids), got["aux_hidden_states"], got["final_hidden_state"], [1, 3, 4]
            )
            == []
        )

    # The oracle itself: each shifted layer id, and the pre-norm last layer as "final", are caught.
    s = samples[4]
    for shifted in ([2, 3, 4], [1, 4, 4], [0, 3, 4], [1, 3, 5]):
        aux, final = TransformersHiddenStates(model, layer_ids=shifted).extract(list(s.input_ids))
        assert ground_truth_mismatches(model, list(s.input_ids), aux.to(torch.bfloat16), final, [1, 3, 4]), shifted
    good = store[s.sample_id]
    last_layer = TransformersHiddenStates(model, layer_ids=[model.config.num_hidden_layers - 1]).extract(
        list(s.input_ids)
    )[0]
    assert ground_truth_mismatches(model, list(s.input_ids), good["aux_hidden_states"], last_layer, [1, 3, 4]) == [
        "final is not the normed last hidden state"
    ]


def test_a_padded_batch_gives_each_sample_its_own_states(target_model):
    backend = TransformersHiddenStates(target_model)
    seqs = [s.input_ids for s in make_samples(4, target_model.config.vocab_size, lengths=(3, 40, 11, 26))]
    together = backend.extract_batch([list(s) for s in seqs])
    for s, (aux, final) in zip(seqs, together, strict=True):  # one capture per sequence
        alone_aux, alone_final = backend.extract(list(s))
        assert aux.shape == alone_aux.shape and final.shape == alone_final.shape
        torch.testing.assert_close(aux, alone_aux, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(final, alone_final, rtol=1e-4, atol=1e-4)


def test_a_multimodal_wrapper_is_looked_through(target_model):
    """Kimi-K2.5's checkpoint keeps its DeepseekV3 under `language_model` beside a vision tower."""

    class Wrapper(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.vision_tower = torch.nn.Linear(2, 2)
            self.language_model = lm

    ids = list(range(300, 320))
    wrapped = TransformersHiddenStates(Wrapper(target_model))
    assert wrapped.num_layers == target_model.config.num_hidden_layers and wrapped.layer_ids == [1, 3, 4]
    for got, want in zip(wrapped.extract(ids), TransformersHiddenStates(target_model).extract(ids), strict=True):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="no decoder layers"):
        TransformersHiddenStates(torch.nn.Linear(2, 2))


def test_bytes_per_token_within_two_percent_of_the_minimum(target_model, tmp_path):
    backend = TransformersHiddenStates(target_model)
    samples = make_samples(60, target_model.config.vocab_size, lengths=(180, 420, 250, 600, 90))
    extract_to_store(samples, backend, tmp_path, StoreSettings(**ROOMY), identity={}, progress_every_s=3600)
    figures = store_figures(tmp_path)
    floor = min_bytes_per_token(target_model.config.hidden_size)
    assert figures["min_bytes_per_token"] == floor == 4 * 64 * 2
    on_disk = sum(p.stat().st_size for p in tmp_path.glob("*.safetensors"))
    assert figures["bytes"] == on_disk and figures["tokens"] == sum(len(s.input_ids) for s in samples)
    assert on_disk / figures["tokens"] <= floor * 1.02, figures  # ids, masks, offsets and headers included
    for name, entry in read_manifest(tmp_path)["shards"].items():
        assert file_xxh3(tmp_path / name) == entry["xxh3_128"]


def test_random_reads_come_from_the_index_not_a_scan(target_model, tmp_path, monkeypatch):
    from eagle3_resources.hidden_states import store as store_module

    monkeypatch.setattr(store_module, "OPEN_SHARDS", 2)  # more shards than a reader keeps open
    backend = TransformersHiddenStates(target_model)
    samples = make_samples(12, target_model.config.vocab_size)
    extract_to_store(
        samples, backend, tmp_path, StoreSettings(shard_bytes=30_000, **ROOMY), identity={}, progress_every_s=3600
    )
    store = HiddenStateStore(tmp_path)
    assert len({shard for shard, *_ in store.index.values()}) > 2
    # Every sample sits at the rows its offsets name, in the shard the index names.
    for s in reversed(samples):
        shard, a, b, split = store.index[s.sample_id]
        assert b - a == len(s.input_ids) and split == s.split
        assert store[s.sample_id]["input_ids"].tolist() == list(s.input_ids)
        assert store.shapes(s.sample_id)["aux_hidden_states"] == (len(s.input_ids), 3 * 64)
    assert store.sample_ids("eval") == [s.sample_id for s in samples if s.split == "eval"]
    assert len(store._handles) == 2


def test_disk_check_refuses_before_writing_anything(target_model, tmp_path):
    backend = TransformersHiddenStates(target_model)
    samples = make_samples(10, target_model.config.vocab_size)
    tokens = sum(len(s.input_ids) for s in samples)
    root = tmp_path / "store"
    with pytest.raises(DiskSpaceError) as err:
        extract_to_store(
            samples, backend, root, StoreSettings(free_bytes=tokens * 517 // 2, reserve_bytes=0), identity={}
        )
    text = str(err.value)
    assert f"{tokens:,} tokens" in text and "free" in text and "max_tokens" in text and "dataset_weights" in text
    assert not root.exists()

    # Only what is not stored yet counts: half the samples stored, the other half fits in the same space.
    extract_to_store(
        samples[:5], backend, root, StoreSettings(shard_bytes=1, **ROOMY), identity={}, progress_every_s=3600
    )
    half = sum(len(s.input_ids) for s in samples[5:]) * 517
    report = extract_to_store(
        samples,
        backend,
        root,
        StoreSettings(shard_bytes=1, free_bytes=half + 10, margin_pct=0, reserve_bytes=0),
        identity={},
        progress_every_s=3600,
    )
    assert report.shards_skipped == 5 and report.shards_written == 5


def test_untrusted_files_are_removed_and_redone(target_model, tmp_path):
    backend = TransformersHiddenStates(target_model)
    samples = make_samples(6, target_model.config.vocab_size)
    settings = StoreSettings(shard_bytes=1, **ROOMY)  # one sample per shard
    extract_to_store(samples, backend, tmp_path, settings, identity={}, progress_every_s=3600)
    sums = {n: e["xxh3_128"] for n, e in read_manifest(tmp_path)["shards"].items()}
    manifest = read_manifest(tmp_path)
    del manifest["shards"]["all-00002.safetensors"]  # killed between rename and record
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    (tmp_path / "all-00004.safetensors").write_bytes(b"\0" * 100)  # truncated although listed
    (tmp_path / "all-00005.safetensors.tmp").write_bytes(b"half")  # killed mid-write
    report = extract_to_store(samples, backend, tmp_path, settings, identity={}, progress_every_s=3600)
    assert report.shards_written == 2 and report.shards_skipped == 4
    assert "all-00005.safetensors.tmp" in report.removed_untrusted
    assert {n: e["xxh3_128"] for n, e in read_manifest(tmp_path)["shards"].items()} == sums
    assert not list(tmp_path.glob("*.tmp"))


def test_shards_another_plan_would_discard_are_kept_unless_asked(target_model, tmp_path):
    backend = TransformersHiddenStates(target_model)
    samples = [replace(s, group=s.sample_id[:2]) for s in make_samples(6, target_model.config.vocab_size)]
    settings = StoreSettings(shard_bytes=1, **ROOMY)
    extract_to_store(samples, backend, tmp_path, settings, identity={}, progress_every_s=3600)
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("*.safetensors")}
    assert sorted(before) == [f"{g}-0000{i}.safetensors" for g in ("A1", "B1") for i in range(3)]
    with pytest.raises(StaleShardsError, match="the target .* changed") as err:
        extract_to_store(samples, backend, tmp_path, settings, identity={"other": True}, progress_every_s=3600)
    assert "6 committed shard(s)" in str(err.value) and "discard_stale_shards" in str(err.value)
    with pytest.raises(StaleShardsError, match="samples changed"):  # B1 lost a sample
        extract_to_store(samples[:5], backend, tmp_path, settings, identity={}, progress_every_s=3600)
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("*.safetensors")} == before  # nothing deleted
    # A dataset added leaves the others' shards alone.
    more = [*samples, replace(samples[0], sample_id="C1/new", group="C1")]
    added = extract_to_store(more, backend, tmp_path, settings, identity={}, progress_every_s=3600)
    assert added.shards_written == 1 and added.shards_skipped == 6
    again = extract_to_store(
        samples,
        backend,
        tmp_path,
        replace(settings, discard_stale=True),
        identity={"other": True},
        progress_every_s=3600,
    )
    assert again.shards_written == 6 and sorted(p.name for p in tmp_path.glob("*.safetensors")) == sorted(before)


class Failing:
    """A backend that fails on its n-th batch, as a stop or a crash would interrupt the loop."""

    def __init__(self, inner, fail_at: int, error: BaseException):
        self.inner, self.left, self.error = inner, fail_at, error

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def extract_batch(self, sequences):
        self.left -= 1
        if self.left < 0:
            raise self.error
        return self.inner.extract_batch(sequences)


def test_a_stop_commits_the_finished_shards_first(target_model, tmp_path):
    backend = TransformersHiddenStates(target_model)
    samples = make_samples(8, target_model.config.vocab_size)
    settings = StoreSettings(shard_bytes=1, batch_tokens=1, **ROOMY)
    with pytest.raises(KeyboardInterrupt):
        extract_to_store(
            samples, Failing(backend, 3, KeyboardInterrupt()), tmp_path, settings, identity={}, progress_every_s=3600
        )
    assert sorted(read_manifest(tmp_path)["shards"]) == [f"all-0000{i}.safetensors" for i in range(3)]
    report = extract_to_store(samples, backend, tmp_path, settings, identity={}, progress_every_s=3600)
    assert report.shards_skipped == 3 and report.shards_written == 5


def test_a_failing_write_stops_the_extraction_and_keeps_what_was_committed(target_model, tmp_path, monkeypatch):
    """A full disk mid-run (ENOSPC from the third shard's write): no more GPU time on shards that cannot be kept."""
    import errno

    from eagle3_resources.hidden_states import store as store_module

    real_write, calls = store_module.write_file, []

    def write_until_full(path, data, size=None, **kw):
        calls.append(1)
        if len(calls) >= 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(path, data, size, **kw)

    monkeypatch.setattr(store_module, "write_file", write_until_full)
    backend = Failing(TransformersHiddenStates(target_model), 10**6, RuntimeError())
    samples = make_samples(12, target_model.config.vocab_size)
    with pytest.raises(RuntimeError, match="No space left on device"):
        extract_to_store(
            samples,
            backend,
            tmp_path,
            StoreSettings(shard_bytes=1, batch_tokens=1, writers=1, **ROOMY),
            identity={},
            progress_every_s=3600,
        )
    assert sorted(read_manifest(tmp_path)["shards"]) == ["all-00000.safetensors", "all-00001.safetensors"]
    assert 10**6 - backend.left < 12  # stopped before computing every shard


def test_progress_reports_rate_bytes_and_eta(target_model, tmp_path):
    seen: list[dict[str, Any]] = []
    samples = make_samples(5, target_model.config.vocab_size)
    report = extract_to_store(
        samples,
        TransformersHiddenStates(target_model),
        tmp_path,
        StoreSettings(shard_bytes=1, batch_tokens=1, **ROOMY),
        identity={},
        progress_every_s=0.0,
        on_progress=seen.append,
    )
    assert len(seen) >= 5
    last = seen[-1]
    assert last["tokens_written"] == last["tokens_pending"] == report.tokens_written
    assert last["bytes_written"] == report.bytes_written == store_figures(tmp_path)["bytes"]
    assert last["eta_s"] == 0.0 and last["tokens_per_s"] > 0 and last["gb_written"] >= 0


def worker(model_folder: Path, root: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "hidden_states_worker.py"), str(model_folder), str(root), *extra],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kill_9_mid_extraction_then_resume_equals_an_uninterrupted_run(
    target_resource, tokenizer_resource, target_model, tmp_path
):
    folder = target_resource.folder(tokenizer_resource)
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    # Held for good in its 4th batch (of 12; 3 of 10 shards done): the kill finds it mid-run, not a race against a sleep
    # after each batch (which a loaded machine could lose, the extraction ending before the kill).
    proc = worker(folder, killed, "--stall-after", "4")
    assert proc.stdout is not None  # stdout=PIPE
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            m = killed / MANIFEST
            if m.exists() and len(json.loads(m.read_text())["shards"]) >= 2:
                break
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        stop_group(proc)
    kept = {
        n: (e["xxh3_128"], (killed / n).stat().st_ino, (killed / n).stat().st_mtime_ns)
        for n, e in json.loads((killed / MANIFEST).read_text())["shards"].items()
    }
    planned = json.loads((killed / MANIFEST).read_text())["planned_shards"]
    assert 2 <= len(kept) < len(planned), "the kill came too late to test anything"
    # What a kill can leave besides: a shard renamed but not yet recorded, and a half-written temporary file.
    pending = [n for n in planned if n not in kept]
    (killed / pending[0]).write_bytes(b"\0" * 1000)
    (killed / (pending[-1] + ".tmp")).write_bytes(b"\0" * 10)

    resumed = worker(folder, killed)
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out
    assert f"{len(planned) - len(kept)} written, {len(kept)} kept" in out
    uninterrupted = worker(folder, whole)
    out, _ = uninterrupted.communicate(timeout=600)
    assert uninterrupted.returncode == 0, out

    final = json.loads((killed / MANIFEST).read_text())["shards"]
    assert {n: e["xxh3_128"] for n, e in final.items()} == {
        n: e["xxh3_128"] for n, e in json.loads((whole / MANIFEST).read_text())["shards"].items()
    }
    for n, (_digest, ino, mtime) in kept.items():  # finished shards were not redone
        assert ((killed / n).stat().st_ino, (killed / n).stat().st_mtime_ns) == (ino, mtime)
    for n, e in final.items():  # and every file is what its manifest entry says
        assert file_xxh3(killed / n) == e["xxh3_128"]
    assert sorted(p.name for p in killed.iterdir()) == sorted([*final, MANIFEST])
    assert len(final) == len(planned) == len(HiddenStateStore(killed).manifest["shards"])
    assert len(HiddenStateStore(killed)) == len(worker_samples(target_model.config.vocab_size))


def merged_frame(samples: list[StoredSample]) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "sample_id": [s.sample_id for s in samples],
            "split": [s.split for s in samples],
            "dataset": [s.sample_id.split("/")[0] for s in samples],
            "input_ids": [list(s.input_ids) for s in samples],
            "loss_mask": [list(s.loss_mask) for s in samples],
            "n_tokens": [len(s.input_ids) for s in samples],
        },
        schema_overrides={"input_ids": pl.List(pl.Int32), "loss_mask": pl.List(pl.Int8)},
    )


def test_selection_by_token_budget_and_dataset_mix():
    samples = make_samples(40, 1000, lengths=(10,))
    merged = merged_frame(samples)  # A1 and B1, 20 samples of 10 tokens each
    assert select_samples(merged).height == 40
    only_a = select_samples(merged, dataset_weights={"A1": 1, "B1": 0})
    assert set(only_a["dataset"].to_list()) == {"A1"} and only_a.height == 20
    half = select_samples(merged, max_tokens=200)
    assert half.group_by("dataset").len().sort("dataset").rows() == [("A1", 10), ("B1", 10)]
    mix = select_samples(merged, max_tokens=120, dataset_weights={"A1": 3, "B1": 1})
    assert dict(mix.group_by("dataset").len().rows()) == {"A1": 9, "B1": 3}
    assert mix["sample_id"].to_list() == [
        s for s in merged["sample_id"].to_list() if s in set(mix["sample_id"].to_list())
    ]
    with pytest.raises(ValueError, match="Z9"):
        select_samples(merged, dataset_weights={"Z9": 1})


def test_checks_pass_on_a_good_store_and_name_what_is_wrong(target_model, tmp_path):
    samples = make_samples(6, target_model.config.vocab_size)
    merged = merged_frame(samples)
    extract_to_store(
        samples,
        TransformersHiddenStates(target_model),
        tmp_path,
        StoreSettings(shard_bytes=1, **ROOMY),
        identity={},
        progress_every_s=3600,
    )
    file_checks = {name: fn for name, (fn, _) in HIDDEN_STATE_CHECKS.items() if name not in RUN_CHECKS}
    for name, fn in file_checks.items():
        assert fn(tmp_path, merged).passed, name

    # A selection with one sample more than stored, and one fewer.
    count = file_checks["record_count"](tmp_path, merged.head(5))
    assert not count.passed and count.metadata["extra"] == [samples[5].sample_id]
    longer = merged.with_columns(
        pl.when(pl.col("sample_id") == samples[1].sample_id).then(99).otherwise(pl.col("n_tokens")).alias("n_tokens")
    )
    shapes = file_checks["shapes"](tmp_path, longer)
    assert not shapes.passed and shapes.metadata["wrong_length"] == [samples[1].sample_id]

    # A manifest claiming layers off the EAGLE-3 rule.
    manifest = read_manifest(tmp_path)
    (tmp_path / MANIFEST).write_text(json.dumps({**manifest, "aux_layer_ids": [2, 3, 4]}))
    assert not file_checks["layer_ids"](tmp_path, merged).passed

    # A shard lost from disk's end: listed, but of another size.
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with open(tmp_path / "all-00003.safetensors", "ab") as f:
        f.write(b"\0")
    count = file_checks["record_count"](tmp_path, merged)
    assert not count.passed and list(count.metadata["damaged"]) == ["all-00003.safetensors"]
    assert samples[3].sample_id in count.metadata["missing"]
    assert not file_checks["shapes"](tmp_path, merged).passed
    with pytest.raises(ValueError, match="all-00003.safetensors"):
        HiddenStateStore(tmp_path)


def materialize_hidden_states(data_root: Path, config: dict):
    import dagster as dg

    from eagle3_assets.stages.hidden_states.asset import hidden_states
    from eagle3_resources.hidden_states.resource import HiddenStatesResource
    from eagle3_resources.storage import DataStore
    from eagle3_resources.target.resource import TargetModelResource
    from eagle3_resources.tokenizer.resource import TokenizerResource

    standin = str(data_root / "standin")
    return dg.materialize(
        [hidden_states],
        raise_on_error=False,
        run_config={"ops": {"hidden_states": {"config": config}}},
        resources={
            "store": DataStore(root=str(data_root)),
            "tokenizer": TokenizerResource(standin_dir=standin),
            "target": TargetModelResource(standin_dir=standin),
            "hidden_states_backend": HiddenStatesResource(),
        },
    )


@pytest.mark.timeout(900)
def test_the_asset_checks_the_disk_first_then_stores_within_two_percent(data_dir_with_standin, target_model):
    from eagle3_resources.storage import DataLayout

    layout = DataLayout(data_dir_with_standin)
    samples = make_samples(40, target_model.config.vocab_size, lengths=(150, 320, 90, 500))
    merged = merged_frame(samples).with_columns(pl.col("loss_mask").list.sum().alias("completion_len"))
    layout.merged_dataset().parent.mkdir(parents=True, exist_ok=True)
    merged.write_parquet(layout.merged_dataset())

    refused = materialize_hidden_states(data_dir_with_standin, {"free_bytes": 100_000, "disk_reserve_gb": 0})
    assert not refused.success
    failure = next(e for e in refused.all_events if e.event_type_value == "STEP_FAILURE")
    error = failure.step_failure_data.error.cause
    assert error.cls_name == "DiskSpaceError" and "max_tokens" in error.message and "100.00 kB free" in error.message
    assert failure.step_failure_data.user_failure_data.description.endswith(f"What to do: {DiskSpaceError.what_to_do}")
    assert not layout.hidden_states().exists() or not any(layout.hidden_states().iterdir())

    budget = materialize_hidden_states(data_dir_with_standin, {"max_tokens": 3000, "dataset_weights": {"A1": 1}})
    assert budget.success
    meta = budget.asset_materializations_for_node("hidden_states")[0].metadata
    assert meta["tokens"].value <= 3000 and "B1" not in {
        s.split("/")[0] for s in HiddenStateStore(layout.hidden_states()).index
    }

    whole = materialize_hidden_states(data_dir_with_standin, {})
    assert whole.success
    meta = whole.asset_materializations_for_node("hidden_states")[0].metadata
    assert meta["samples"].value == 40 and meta["tokens"].value == int(merged["n_tokens"].sum())
    assert meta["min_bytes_per_token"].value == 512 and meta["overhead_over_min_pct"].value <= 2.0
    assert meta["tokens_per_s"].value > 0 and "data:image/png;base64," in meta["tokens_by_dataset_picture"].value
    assert all(c.passed for c in whole.get_asset_check_evaluations())
