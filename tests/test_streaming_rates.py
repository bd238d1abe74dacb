"""The streaming plan from measured rates (issue 42, item 6): the rates read from the JSON the project's own tools
write (`benchmarks/device_check.py` with `drafter_training_speed.py`'s figures, `eagle3 gpu-check --json`), each
labelled in the plan; a file without the figure refused with its file and key; every training host's reads and the
checkpoints counted on the spool; no plan of more capture hosts than the orchestrator launches, and the asset's
recorded plan is what it launches."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import polars as pl
import pytest
import torch
from support import load_benchmark

from eagle3_assets.operations import gpu_check
from eagle3_assets.stages.eagle3_drafter import streaming_rates
from eagle3_assets.stages.eagle3_drafter.model import DrafterConfig, Eagle3Drafter
from eagle3_assets.stages.eagle3_drafter.streaming import LANE, StreamingJob, StreamingRequest, stream_drafter
from eagle3_assets.stages.eagle3_drafter.streaming_plan import (
    LAUNCHED_CAPTURE_HOSTS,
    Hosts,
    StreamingInputs,
    main,
    plan_streaming,
)
from eagle3_assets.stages.eagle3_drafter.streaming_rates import RateUnreadable
from eagle3_assets.stages.eagle3_drafter.train import TrainSettings
from eagle3_resources.hidden_states.spool import SETTINGS

speed = load_benchmark("drafter_training_speed")
device_check = load_benchmark("device_check")

KIMI_HIDDEN = 7168


def device_check_json(folder: Path, tokens_per_s: float = 6000.0, hidden: int = KIMI_HIDDEN) -> Path:
    """A device_check.json whose `train_kimi` section holds `drafter_training_speed.speed_figures`' own figures (its
    timed steps given, not run), as `device_check.main` writes a section (`run_section`: seconds, command, figures)."""
    o = speed.SpeedOptions(
        device="cpu",
        hidden=hidden,
        intermediate=18432,
        draft_vocab=32000,
        target_vocab=163840,
        batch_tokens=4096,
        steps=5,
        warmup=2,
        min_len=512,
        max_len=2048,
        window=4096,
        peak_tflops=None,
        compile=None,
    )
    prepared = SimpleNamespace(
        cfg=speed.drafter_config(o), plan=SimpleNamespace(windows=[SimpleNamespace(tokens=2048)] * 2), phases={}
    )
    timed = SimpleNamespace(
        history=SimpleNamespace(compiled=True, step_loss=[3.0]), steps=5, seconds=10.0, tokens=int(tokens_per_s * 10)
    )
    figures = speed.speed_figures(o, prepared, torch.device("cpu"), timed)
    report = {
        "device": "cuda",
        "environment": {"gpu": "NVIDIA H200"},
        "sections": {"train_kimi": {"seconds": 60.0, "command": "drafter_training_speed.py ...", "figures": figures}},
    }
    # the section sits where device_check's own reader of it (its acceptance table) finds its figures
    row = next(r for r in device_check.acceptance(report) if r["section"] == "train_kimi")
    assert row["measured"] == figures["mfu"]
    path = folder / "device_check.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


def gpu_check_json(folder: Path, rows: list[gpu_check.Check], monkeypatch, capsys) -> Path:
    """`eagle3 gpu-check --json`'s output (`gpu_check.gpu_check`'s own printing) of these rows."""
    monkeypatch.setattr(gpu_check, "run_checks", lambda *args, **kwargs: rows)
    capsys.readouterr()
    gpu_check.gpu_check(as_json=True)
    path = folder / f"gpu-check-{len(list(folder.glob('gpu-check-*')))}.json"
    path.write_text(capsys.readouterr().out)
    return path


def disk_row(root: Path) -> gpu_check.Check:
    """The real disk write row: 1 MiB written into `root` as the store writes shards, timed."""
    return gpu_check.disk_write_row(root, 1, None, 64, True)


def target_row(tokens_per_s: float = 31000.0, status: str = gpu_check.OK) -> gpu_check.Check:
    """The target capture row, its data as `gpu_check.sglang_target_row` records it (which needs SGLang and the
    target: not run here)."""
    data = {
        "tokens": 9728,
        "seconds": round(9728 / tokens_per_s, 3),
        "tokens_per_s": tokens_per_s,
        "load_s": 600.0,
        "backend": {},
        "problems": [],
    }
    return gpu_check.Check("sglang capture (target, tp=8)", status, "...", True, data)


def test_each_rate_is_read_from_its_tools_json_and_labelled_in_the_plan(tmp_path, monkeypatch, capsys):
    training = device_check_json(tmp_path, tokens_per_s=6000.0)
    rate, label = streaming_rates.training_rate(training, 8, KIMI_HIDDEN)
    assert rate == 8 * 6000.0  # a host of 8 GPUs, each as measured (linear: stated in the label)
    assert f"measured: {training} sections.train_kimi.figures.tokens_per_s = 6,000.0 tok/s" in label
    assert "x 8 GPUs (assumed: ranks scale linearly" in label

    disk = disk_row(tmp_path)
    spool = gpu_check_json(tmp_path, [disk], monkeypatch, capsys)
    rate, label = streaming_rates.spool_rate(spool)
    assert rate == pytest.approx(disk.data["bytes"] / disk.data["seconds"])
    assert f"measured: {spool} checks['disk write'].data" in label and "assumed: reads as fast" in label

    capture = gpu_check_json(tmp_path, [disk, target_row(31000.0)], monkeypatch, capsys)
    rate, label = streaming_rates.capture_rate(capture)
    assert rate == 31000.0 and "checks['sglang capture (target, tp=8)'].data.tokens_per_s" in label

    main(
        [
            "--tokens",
            "6e9",
            "--training-hosts",
            "2",
            "--spool-tb",
            "2",
            "--shard-gb",
            "4",
            "--capture-gpu-check",
            str(capture),
            "--training-device-check",
            str(training),
            "--spool-gpu-check",
            str(spool),
        ]
    )
    out = capsys.readouterr().out
    assert "capture: 1 host(s) x 31,000 tok/s" in out and "training: 2 host(s) x 48,000 tok/s" in out
    assert f"rate of capture per host: measured: {capture}" in out
    assert f"rate of training per host: measured: {training}" in out
    assert f"rate of the spool: measured: {spool}" in out

    main(
        ["--tokens", "1e6", "--training-hosts", "1", "--spool-tb", "1", "--capture-tok-s", "5", "--spool-gb-s", "1"]
        + ["--training-tok-s", "7"]
    )
    out = capsys.readouterr().out
    assert "rate of training per host: assumed (given: --training-tok-s 7)" in out
    with pytest.raises(SystemExit, match="exactly one of --training-tok-s"):
        main(
            ["--tokens", "1e6", "--training-hosts", "1", "--spool-tb", "1", "--capture-tok-s", "5"]
            + ["--spool-gb-s", "1", "--training-tok-s", "7", "--training-device-check", str(training)]
        )


def test_a_file_without_the_figure_is_refused_naming_the_file_the_key_and_the_problem(tmp_path, monkeypatch, capsys):
    good = json.loads(device_check_json(tmp_path).read_text())

    def written(name: str, report: object) -> Path:
        path = tmp_path / name
        path.write_text(json.dumps(report))
        return path

    skipped = written("skipped.json", good | {"sections": {"train_kimi": {"error": "skipped: the run's time budget"}}})
    with pytest.raises(RateUnreadable, match=r"skipped.json: sections.train_kimi.figures: missing.*skipped: the run"):
        streaming_rates.training_rate(skipped, 8)
    other = written("other.json", good | {"sections": {"train_2048": good["sections"]["train_kimi"]}})
    with pytest.raises(RateUnreadable, match=r"other.json: sections.train_kimi: missing"):
        streaming_rates.training_rate(other, 8)
    cpu = device_check_json(tmp_path, hidden=512)  # the CPU quick run's width
    with pytest.raises(RateUnreadable, match=r"sections.train_kimi.figures.hidden: measured at width 512.*7168"):
        streaming_rates.training_rate(cpu, 8, KIMI_HIDDEN)
    bad = good["sections"]["train_kimi"]["figures"] | {"tokens_per_s": None}
    none = written("none.json", good | {"sections": {"train_kimi": {"figures": bad}}})
    with pytest.raises(RateUnreadable, match=r"none.json: sections.train_kimi.figures.tokens_per_s: None is not"):
        streaming_rates.training_rate(none, 8)
    with pytest.raises(RateUnreadable, match=r"nowhere.json: \(the file\): no such file"):
        streaming_rates.training_rate(tmp_path / "nowhere.json", 8)

    no_disk = gpu_check_json(tmp_path, [target_row()], monkeypatch, capsys)
    with pytest.raises(RateUnreadable, match=r"checks\['disk write'\]: no such row"):
        streaming_rates.spool_rate(no_disk)
    failed = gpu_check_json(tmp_path, [disk_row(tmp_path / "missing")], monkeypatch, capsys)  # no data root
    with pytest.raises(RateUnreadable, match=r"checks\['disk write'\].data: no bytes and seconds.*does not exist"):
        streaming_rates.spool_rate(failed)
    no_target = gpu_check_json(tmp_path, [disk_row(tmp_path)], monkeypatch, capsys)
    with pytest.raises(RateUnreadable, match=r"checks\['sglang capture \(target'\]: no such row.*--model"):
        streaming_rates.capture_rate(no_target)
    broken = gpu_check_json(tmp_path, [target_row(status=gpu_check.FAIL)], monkeypatch, capsys)
    with pytest.raises(RateUnreadable, match=r"tokens_per_s: the row is 'fail'"):
        streaming_rates.capture_rate(broken)
    with pytest.raises(SystemExit, match=r"error: .*skipped.json: sections.train_kimi.figures: missing"):
        main(
            ["--tokens", "1e6", "--training-hosts", "1", "--spool-tb", "1", "--capture-tok-s", "5"]
            + ["--spool-gb-s", "1", "--training-device-check", str(skipped)]
        )


SPOOL_BOUND = StreamingInputs(  # 100 B a token; capture 4 tok/s; 2 training hosts of 10; the spool 1,000 B/s
    tokens=10**6,
    bytes_per_token=100,
    capture=Hosts(1, 4.0),
    training=Hosts(2, 10.0),
    spool_bytes_per_s=1000.0,
    spool_budget_bytes=10**9,
    shard_bytes=10**4,
)


def test_every_training_hosts_reads_count_and_make_the_spool_the_bottleneck():
    rows = plan_streaming(SPOOL_BOUND)  # today's trainer, one pass: each row read once, by the rank that trains it
    assert rows.rates["spool"] == 1000.0 / (100 * 2) == 5.0 and rows.bottleneck == "capture"
    whole = replace(SPOOL_BOUND, reads_per_byte=2)  # each of the 2 hosts reading whole shards (before issue 42 item 1)
    each_host = plan_streaming(whole)
    assert each_host.rates["spool"] == pytest.approx(1000.0 / (100 * 3)) and each_host.bottleneck == "spool"
    assert each_host.duration_s > rows.duration_s
    assert each_host.spool_traffic_bytes == 10**6 * 100 * 3
    assert "(1 write + 2 read(s))" in each_host.describe(whole) and "2 read(s) of every byte (given)" in (
        each_host.describe(whole)
    )
    # more passes: a row's passes land on several of the 16 ranks, each reading it: 16 (1 - (15/16)^2) = 1.9375
    two = replace(SPOOL_BOUND, passes=2)
    assert two.reads == 1.9375 and plan_streaming(two).rates["spool"] == pytest.approx(1000.0 / (100 * 2.9375))
    assert "1.94 read(s) of every byte, the distinct ranks of 16 that train it in 2 pass(es)" in plan_streaming(
        two
    ).describe(two)


def test_the_checkpoints_are_spool_traffic():
    base = replace(SPOOL_BOUND, reads_per_byte=1, checkpoint_every_tokens=1000, passes=2)
    without = plan_streaming(base)
    inputs = replace(base, checkpoint_bytes=50_000)
    with_checkpoints = plan_streaming(inputs)
    # 50 kB every 1,000 token-passes, 2 passes a token: 100 B a token of data on top of its 200 B
    assert with_checkpoints.rates["spool"] == 1000.0 / (200 + 100)
    assert without.bottleneck == "capture" and with_checkpoints.bottleneck == "spool"
    assert with_checkpoints.spool_traffic_bytes == 10**6 * 300
    text = with_checkpoints.describe(inputs)
    assert "+ 100 B of checkpoints) = 3 tok/s" in text and "checkpoints: 0.00 GB every 1,000 token-passes" in text


def test_the_checkpoint_size_is_what_the_trainer_saves():
    """The meta-device count against a real drafter's state and its AdamW moments after a step (what the trainer's
    checkpoint holds of them), at a small width."""
    cfg = DrafterConfig.of_width(64, intermediate_size=128, vocab_size=512, draft_vocab_size=128)
    model = Eagle3Drafter(cfg, torch.randn(512, 64), torch.arange(128))
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained)
    for p in trained:
        p.grad = torch.ones_like(p)
    opt.step()
    moments = sum(
        t.numel() * t.element_size()
        for state in opt.state_dict()["state"].values()
        for k, t in state.items()
        if k != "step"
    )
    saved = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert streaming_rates.drafter_config_checkpoint_bytes(cfg) == saved + moments
    kimi = streaming_rates.drafter_checkpoint_bytes(KIMI_HIDDEN, 18432, 163840, 32000)
    assert 10e9 < kimi < 12e9  # Kimi-K2.5's MLA drafter: ~0.9B trained parameters, fp32 and two moments


def test_more_capture_hosts_than_the_orchestrator_launches_are_refused():
    two = replace(SPOOL_BOUND, capture=Hosts(2, 4.0))
    with pytest.raises(ValueError, match="2 capture hosts planned, but the orchestrator launches 1"):
        plan_streaming(two)
    assert plan_streaming(two, None).rates["capture"] == 8.0  # the model itself holds for any count
    with pytest.raises(SystemExit, match="error: 2 capture hosts planned"):
        main(
            ["--tokens", "1e6", "--training-hosts", "1", "--spool-tb", "1", "--capture-tok-s", "5"]
            + ["--spool-gb-s", "1", "--training-tok-s", "7", "--capture-hosts", "2"]
        )


class Started:
    """A side that the recording launcher started: it ends when stopped."""

    def __init__(self, name: str) -> None:
        self.name, self.stopped = name, False

    def poll(self) -> int | None:
        return None

    def stop(self, grace_s: float = 30.0) -> None:
        self.stopped = True

    def describe(self) -> str:
        return f"the {self.name} side"

    def tail(self) -> str:
        return ""


class Recording:
    """A launcher that records what it is asked to start, and stops the run once both sides are started."""

    def __init__(self) -> None:
        self.capture: list[dict] = []
        self.training: list[dict] = []

    def start_capture(self, spec_path: Path, log_path: Path) -> Started:
        self.capture.append(json.loads(spec_path.read_text()))
        return Started("capture")

    def start_training(self, spec_path: Path, log_path: Path, *, nodes: int, processes_per_node: int) -> Started:
        self.training.append(json.loads(spec_path.read_text()) | {"nodes": nodes, "ranks": processes_per_node})
        raise KeyboardInterrupt  # the step stopped: the orchestrator stops the started sides


def test_the_asset_launches_exactly_the_plan_it_records(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"hidden_size": 64, "vocab_size": 512, "intermediate_size": 128}))
    merged = pl.DataFrame(
        {
            "sample_id": [f"s{i}" for i in range(40)],
            "split": ["train"] * 36 + ["eval"] * 4,
            "input_ids": [[1] * (20 + i) for i in range(40)],
            "loss_mask": [[1] * (20 + i) for i in range(40)],
            "dataset": ["a", "b"] * 20,
        }
    )
    said: list[str] = []
    launcher = Recording()
    job = StreamingJob(
        merged=merged,
        merged_path=tmp_path / "merged.parquet",
        target_folder=target,
        out_dir=tmp_path / "drafter",
        settings=TrainSettings(batch_tokens=200, max_len=64, checkpoint_every=3),
        requested_draft_vocab=128,
        request=StreamingRequest(
            10**6,
            3,
            20_000,
            2000.0,
            500.0,
            5e8,
            {"train_tok_s": "measured: x"},
            mix_shards=2,
            spool_source="ss",
            prefetch_steps=2,
        ),
        identity={"target": "stand-in"},
        resources={},
        log=said.append,
        launcher=launcher,
        processes=3,
        nodes=2,
    )
    with pytest.raises(KeyboardInterrupt):
        stream_drafter(job)
    plan = next(s for s in said if s.startswith("streaming plan:"))  # what the asset records (`streaming_plan`)
    spool = json.loads((job.spool / SETTINGS).read_text())
    # the plan's capture hosts are the capture sides launched, each a lane of the spool
    assert f"capture: {LAUNCHED_CAPTURE_HOSTS} host(s) x 2,000 tok/s" in plan
    assert len(launcher.capture) == LAUNCHED_CAPTURE_HOSTS == len(spool["lanes"]) and LANE in spool["lanes"]
    # the training nodes and their ranks, the passes and the mix planned are those launched and in the spool
    assert "training: 2 host(s) x 500 tok/s / 3 pass(es)" in plan and "GPUs: 7 " in plan  # 1 x 1 + 2 x 3
    assert [(t["nodes"], t["ranks"], t["passes"]) for t in launcher.training] == [(2, 3, 3)]
    assert launcher.training[0]["prefetch_steps"] == 2  # each rank's read-ahead, as asked
    assert spool["passes"] == 3 and spool["mix_shards"] == 2 and "shuffled 2 shard(s) at a time" in plan
    # 6 ranks, 3 passes: 6 (1 - (5/6)^3) = 2.528 reads of every byte
    assert "(1 write + 2.52778 read(s))" in plan and "rate of training per host: measured: x" in plan
    assert "rate of the spool: ss" in plan and "checkpoints: 0.00 GB every 600 token-passes" in plan


def test_the_assets_config_takes_its_rates_from_the_files_labelled(tmp_path, monkeypatch, capsys):
    from eagle3_assets.stages.eagle3_drafter.asset import DrafterTrainConfig, streaming_request
    from eagle3_resources.errors import DrafterError
    from eagle3_resources.hidden_states.resource import HiddenStatesResource

    training = device_check_json(tmp_path, tokens_per_s=5000.0)
    spool = gpu_check_json(tmp_path, [disk_row(tmp_path)], monkeypatch, capsys)
    capture = gpu_check_json(tmp_path, [target_row(27000.0)], monkeypatch, capsys)
    no_context = SimpleNamespace()  # the last materializations are not read when every rate is given
    config = DrafterTrainConfig(
        processes=8,
        streaming_spool_gb=2000,
        streaming_train_device_check=str(training),
        streaming_capture_gpu_check=str(capture),
        streaming_spool_gpu_check=str(spool),
        streaming_reads_per_byte=16,
    )
    request = streaming_request(no_context, config, HiddenStatesResource(), KIMI_HIDDEN)  # type: ignore[arg-type]
    assert request.train_tok_s == 8 * 5000.0 and request.capture_tok_s == 27000.0
    assert request.rates_source["train_tok_s"].startswith(f"measured: {training}")
    assert request.rates_source["capture_tok_s"].startswith(f"measured: {capture}")
    assert request.spool_source.startswith(f"measured: {spool}") and request.reads_per_byte == 16
    assert request.prefetch_steps is None  # unset: the trainer's default
    no_read_ahead = config.model_copy(update={"streaming_prefetch_steps": 0})
    assert streaming_request(no_context, no_read_ahead, HiddenStatesResource(), KIMI_HIDDEN).prefetch_steps == 0  # type: ignore[arg-type]
    assumed = streaming_request(
        no_context,  # type: ignore[arg-type]
        DrafterTrainConfig(streaming_spool_gb=2000, streaming_train_tok_s=1.0, streaming_capture_tok_s=2.0),
        HiddenStatesResource(),
    )
    assert assumed.rates_source == {"train_tok_s": "assumed (declared in the config)"} | {
        "capture_tok_s": "assumed (declared in the config)"
    }
    assert assumed.spool_source == "assumed (streaming_spool_gb_s)"
    with pytest.raises(DrafterError, match="streaming_train_tok_s and its measurement file .* are both set"):
        streaming_request(no_context, config.model_copy(update={"streaming_train_tok_s": 1.0}), HiddenStatesResource())  # type: ignore[arg-type]
    no_disk = config.model_copy(update={"streaming_spool_gpu_check": str(capture)})
    with pytest.raises(DrafterError, match=r"train_tok_s: .*figures.hidden: measured at width 7168, .* 64 wide"):
        streaming_request(no_context, config, HiddenStatesResource(), 64)  # type: ignore[arg-type]
    with pytest.raises(DrafterError, match=r"spool rate: .*checks\['disk write'\]: no such row"):
        streaming_request(no_context, no_disk, HiddenStatesResource())  # type: ignore[arg-type]
