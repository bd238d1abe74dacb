"""The streaming planner (eagle3_assets/stages/eagle3_drafter/streaming_plan.py): properties over random plans, the
refusal at the spool's own minimum, and the worked Kimi-K2.5 plan docs/streaming.md quotes."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle3_assets.stages.eagle3_drafter.streaming_plan import Hosts, StreamingInputs, main, plan_streaming
from eagle3_resources.errors import SpoolTooSmall
from eagle3_resources.hidden_states.spool import min_lane_bytes
from eagle3_resources.hidden_states.store import padded_size, token_bytes

rates = st.floats(min_value=1.0, max_value=1e6, allow_nan=False)


@st.composite
def plans(draw: st.DrawFn) -> StreamingInputs:
    hidden = draw(st.sampled_from([64, 2048, 7168]))
    per_token = token_bytes(hidden)
    shard = draw(st.integers(per_token, 8 * 10**9))
    passes = draw(st.integers(1, 4))
    mix = draw(st.integers(1, 8))
    capture = Hosts(draw(st.integers(1, 8)), draw(rates), draw(st.integers(1, 8)))
    training = Hosts(draw(st.integers(1, 8)), draw(rates), draw(st.integers(1, 8)))
    minimum = capture.count * min_lane_bytes(passes, shard, mix)
    return StreamingInputs(
        tokens=draw(st.integers(1, 10**10)),
        bytes_per_token=per_token,
        capture=capture,
        training=training,
        spool_bytes_per_s=draw(st.floats(1e6, 1e11)),
        spool_budget_bytes=minimum + draw(st.integers(0, 10**13)),
        passes=passes,
        shard_bytes=shard,
        checkpoint_every_tokens=draw(st.integers(0, 10**9)),
        mix_shards=mix,
        reads_per_byte=draw(st.one_of(st.none(), st.floats(0, 64))),
        checkpoint_bytes=draw(st.integers(0, 2 * 10**10)),
    )


@settings(max_examples=300, deadline=None)
@given(plans())
def test_the_run_is_never_shorter_than_any_sides_own_work(i):
    p = plan_streaming(i, None)
    capture = i.capture.count * i.capture.tokens_per_s
    training = i.training.count * i.training.tokens_per_s  # token-passes a second
    ranks = i.training.count * i.training.gpus_per_host  # default: the distinct ranks that train a row over its passes
    reads = ranks * (1 - (1 - 1 / ranks) ** i.passes) if i.reads_per_byte is None else i.reads_per_byte
    checkpoints = i.checkpoint_bytes * i.passes / i.checkpoint_every_tokens if i.checkpoint_every_tokens else 0
    spool = i.spool_bytes_per_s / (i.bytes_per_token * (1 + reads) + checkpoints)  # written, read, checkpointed
    first = min(i.tokens, i.shard_bytes // i.bytes_per_token or 1)  # tokens of the first (and of the last) shard
    mix = min(i.tokens, (i.shard_bytes // i.bytes_per_token or 1) * i.mix_shards)  # of the first mix
    slack = 1 + 1e-9
    # training cannot start before a capture host has committed its first mix, then owes every pass
    assert p.duration_s * slack >= mix / i.capture.tokens_per_s + i.tokens * i.passes / training
    # the trainer owes at least the last shard's passes after capture ends
    assert p.duration_s * slack >= i.tokens / capture + first * i.passes / training
    assert p.duration_s * slack >= i.tokens / spool
    assert p.gpu_hours == pytest.approx(
        p.duration_s / 3600 * (i.capture.count * i.capture.gpus_per_host + i.training.count * i.training.gpus_per_host)
    )


@settings(max_examples=300, deadline=None)
@given(plans())
def test_the_bottleneck_is_the_slowest_side_and_only_it_sets_the_pace(i):
    p = plan_streaming(i, None)
    assert p.rates[p.bottleneck] == min(p.rates.values()) == p.tokens_per_s
    assert p.busy[p.bottleneck] == 1.0 and all(0 < b <= 1.0 for b in p.busy.values())
    # a faster bottleneck never makes the run longer; a faster non-bottleneck side does not change the pace
    faster = dataclasses.replace(i, spool_bytes_per_s=i.spool_bytes_per_s * 2)
    if p.bottleneck == "capture":
        faster = dataclasses.replace(i, capture=dataclasses.replace(i.capture, tokens_per_s=i.capture.tokens_per_s * 2))
    elif p.bottleneck == "training":
        faster = dataclasses.replace(
            i, training=dataclasses.replace(i.training, tokens_per_s=i.training.tokens_per_s * 2)
        )
    assert plan_streaming(faster, None).duration_s <= p.duration_s * (1 + 1e-12)
    if p.bottleneck != "spool":
        other = dataclasses.replace(i, spool_bytes_per_s=i.spool_bytes_per_s * 2)
        assert plan_streaming(other, None).tokens_per_s == p.tokens_per_s


@settings(max_examples=300, deadline=None)
@given(plans())
def test_the_peak_disk_fits_the_budget_and_the_data_and_holds_the_working_set(i):
    p = plan_streaming(i, None)
    assert p.min_budget_bytes <= i.spool_budget_bytes
    assert p.peak_disk_bytes <= i.spool_budget_bytes
    assert p.peak_disk_bytes <= p.data_bytes + i.capture.count * padded_size(i.shard_bytes)
    assert p.peak_disk_bytes >= min(p.min_budget_bytes, p.data_bytes)  # at least what the spool needs to move
    assert p.stall_free_budget_bytes >= p.min_budget_bytes
    assert bool(p.warnings) == (i.spool_budget_bytes < p.stall_free_budget_bytes)
    shard = padded_size(i.shard_bytes)
    if p.bottleneck == "capture":  # the run drains the spool as fast as it fills: it holds the working set only
        assert p.peak_disk_bytes <= p.stall_free_budget_bytes
    else:  # capture outpaces the run: the spool fills to its budget (whole shards per lane), or holds all the data
        assert p.peak_disk_bytes >= min(i.spool_budget_bytes - i.capture.count * shard, p.data_bytes)


@settings(max_examples=200, deadline=None)
@given(plans())
def test_a_spool_below_its_working_set_is_refused_at_exactly_the_spools_own_minimum(i):
    minimum = i.capture.count * min_lane_bytes(i.passes, i.shard_bytes, i.mix_shards)
    assert plan_streaming(dataclasses.replace(i, spool_budget_bytes=minimum), None).min_budget_bytes == minimum
    with pytest.raises(SpoolTooSmall) as e:
        plan_streaming(dataclasses.replace(i, spool_budget_bytes=minimum - 1), None)
    assert f"{minimum:,}" in str(e.value) and "budget" in e.value.what_to_do


def test_rates_that_were_not_measured_are_refused():
    i = StreamingInputs(10**9, token_bytes(7168), Hosts(1, 3e4), Hosts(1, 5e4), 5e9, 10**13)
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="measured rate"):
            plan_streaming(dataclasses.replace(i, capture=Hosts(1, bad)))


KIMI_600K = [  # docs/streaming.md's worked plan: TorchSpec's 600k Kimi-K2.5 samples, 6B tokens, every rate assumed
    "--tokens",
    "6e9",
    "--capture-tok-s",
    "30000",
    "--training-hosts",
    "2",
    "--training-tok-s",
    "48000",
    "--spool-gb-s",
    "10",
    "--spool-tb",
    "2",
    "--shard-gb",
    "4",
    "--checkpoint-tokens",
    "30e6",
]


def test_the_worked_kimi_plan_the_streaming_doc_quotes(capsys):
    main(KIMI_600K)
    out = capsys.readouterr().out
    assert "6,000,000,000 tokens x 57,349 B = 344.1 TB offline" in out
    assert "capture: 1 host(s) x 30,000 tok/s" in out  # the one capture host the orchestrator launches
    # each byte written once and read once (one pass: by the one rank that trains it); Kimi's MLA drafter's 10.75 GB
    # checkpoint every 30M token-passes
    assert "10.00 GB/s / (57,349 B x (1 write + 1 read(s)) + 358 B of checkpoints) = 86,914 tok/s" in out
    assert "checkpoints: 10.75 GB every 30,000,000 token-passes" in out
    assert "bottleneck: capture at 30,000 tok/s" in out
    assert "duration: 55.6 h; GPUs: 24 (1,333 GPU-hours)" in out
    for side in ("capture", "training"):
        assert f"rate of {side} per host: assumed (given: --{side}-tok-s" in out
    assert "rate of the spool: assumed (given: --spool-gb-s 10)" in out
    # a lane of 2 TB holds 500 shards, a rank's 16 GiB (passes + 1) x 2 of them: the default mix is 2 shards
    assert "minimum 0.012 TB, stall-free 1.74 TB, peak on disk 1.74 TB; shuffled 2 shard(s) at a time" in out
    # the doc quotes the command's output as it prints it, line for line
    doc = (Path(__file__).parent.parent / "docs" / "streaming.md").read_text()
    assert "\n".join("    " + line for line in out.strip().splitlines()) in doc
