"""The streaming run's budget and plan, before anything starts (issue 27, deliverable 4).

A pure function of the data, the hosts and the measured rates: how long the run takes, how much disk the spool
needs at its peak, which side is the bottleneck, and a refusal (`SpoolTooSmall`) of a spool that cannot hold the
working set the spool itself requires (`eagle3_resources.hidden_states.spool`).

The model (stated so it can be checked):
- Capture makes `C = capture hosts x their tokens/s` tokens a second; training trains `T = training hosts x their
  tokens/s` token-passes a second, so it consumes `T / passes` tokens of data a second; the spool carries each
  byte once in (the capture's write) and once out (the trainer reads a shard once and serves all its passes from
  memory), so it passes `S = spool bytes/s / (2 x bytes per token)` tokens a second. The run's steady rate is
  `r = min(C, T / passes, S)` and the side that sets it is the bottleneck (ties go to capture, then training).
- Duration = `tokens / r` + the fill (training starts once a capture host has committed its first mix of
  `mix_shards` shards: `mix tokens / per-host capture rate`) + the drain (after the last shard is committed the
  trainer still owes the remaining passes of the mixes it holds: `mix tokens x passes (passes + 1) / 2`
  token-passes at `T`). So it is never below any side's own total work (`tokens / C`, `tokens x passes / T`,
  `tokens / S`).
- The spool's minimum (refused below): every capture host's lane holds `passes x mix_shards + 1` of its largest
  shards (the `passes` mixes the trainer may be holding from it and the one being written):
  `spool.min_lane_bytes` per host.
  Between two checkpoints the trainer also keeps the shards it has finished (they are deleted once the
  checkpoint that covers them is durable): `checkpoint tokens / passes` of data. The stall-free budget adds
  those, so capture never waits for a checkpoint.
- Peak disk: when capture is faster than what the run consumes (training or the spool is the bottleneck), the
  spool fills to its budget (rounded down to whole shards per lane); otherwise it holds the stall-free working
  set, at most the budget. Never more than the data itself plus one shard per lane.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Literal

from eagle3_resources.errors import SpoolTooSmall
from eagle3_resources.hidden_states.spool import default_mix_shards, min_lane_bytes
from eagle3_resources.hidden_states.store import padded_size

Side = Literal["capture", "training", "spool"]


@dataclass(frozen=True)
class Hosts:
    count: int
    tokens_per_s: float  # per host: captured tokens/s (capture), or trained token-passes/s (training)
    gpus_per_host: int = 8


@dataclass(frozen=True)
class StreamingInputs:
    tokens: int  # tokens of data to capture (each once)
    bytes_per_token: int  # the store's token_bytes(hidden_size): 57,349 for Kimi-K2.5 (57,344 of states + id, mask)
    capture: Hosts
    training: Hosts
    spool_bytes_per_s: float  # what the shared file system sustains, writes and reads together
    spool_budget_bytes: int
    passes: int = 1
    shard_bytes: int = 10**9  # the largest shard file (shard_gb, or the longest sample's bytes when larger)
    checkpoint_every_tokens: int = 0  # token-passes trained between two checkpoints of the trainer
    mix_shards: int = 1  # the trainer's shuffle span in shards (spool.default_mix_shards)


@dataclass(frozen=True)
class StreamingPlan:
    duration_s: float
    tokens_per_s: float  # the steady rate of data through the run
    bottleneck: Side
    rates: dict[Side, float]  # each side's own rate, in tokens of data a second
    busy: dict[Side, float]  # the fraction of the run's steady state each side works (the rest it waits)
    min_budget_bytes: int  # below this the plan is refused
    stall_free_budget_bytes: int  # at or above this capture never waits for a checkpoint
    peak_disk_bytes: int
    data_bytes: int  # the same data held offline, for comparison
    gpu_hours: float
    warnings: list[str] = field(default_factory=list)

    def describe(self, inputs: StreamingInputs) -> str:
        """The plan in the words and figures the asset prints and records."""
        i = inputs
        waits = {
            "capture": "training and the spool wait for capture",
            "training": "capture waits for training (the spool stays full)",
            "spool": "both capture and training wait for the spool's bandwidth",
        }[self.bottleneck]
        lines = [
            f"data: {i.tokens:,} tokens x {i.bytes_per_token:,} B = {self.data_bytes / 1e12:,.1f} TB offline; "
            f"{i.passes} pass(es)",
            f"capture: {i.capture.count} host(s) x {i.capture.tokens_per_s:,.0f} tok/s = "
            f"{self.rates['capture']:,.0f} tok/s (busy {self.busy['capture']:.0%})",
            f"training: {i.training.count} host(s) x {i.training.tokens_per_s:,.0f} tok/s / {i.passes} pass(es) = "
            f"{self.rates['training']:,.0f} tok/s of data (busy {self.busy['training']:.0%})",
            f"spool: {i.spool_bytes_per_s / 1e9:,.1f} GB/s / (2 x {i.bytes_per_token:,} B) = "
            f"{self.rates['spool']:,.0f} tok/s (busy {self.busy['spool']:.0%})",
            f"bottleneck: {self.bottleneck} at {self.tokens_per_s:,.0f} tok/s; {waits}",
            f"duration: {self.duration_s / 3600:,.1f} h; GPUs: "
            f"{i.capture.count * i.capture.gpus_per_host + i.training.count * i.training.gpus_per_host} "
            f"({self.gpu_hours:,.0f} GPU-hours)",
            f"spool: budget {i.spool_budget_bytes / 1e12:,.2f} TB, minimum {self.min_budget_bytes / 1e12:,.3f} TB, "
            f"stall-free {self.stall_free_budget_bytes / 1e12:,.2f} TB, "
            f"peak on disk {self.peak_disk_bytes / 1e12:,.2f} TB; shuffled {i.mix_shards} shard(s) at a time",
            *(f"warning: {w}" for w in self.warnings),
        ]
        return "\n".join(lines)


def plan_streaming(i: StreamingInputs) -> StreamingPlan:
    """The plan of a streaming run; `SpoolTooSmall` when the spool's budget cannot hold its working set."""
    for name, value in [
        ("tokens", i.tokens),
        ("bytes_per_token", i.bytes_per_token),
        ("capture hosts", i.capture.count),
        ("training hosts", i.training.count),
        ("passes", i.passes),
        ("shard_bytes", i.shard_bytes),
        ("mix_shards", i.mix_shards),
    ]:
        if value < 1:
            raise ValueError(f"{name} must be at least 1, not {value}")
    for name, rate in [
        ("capture tokens/s", i.capture.tokens_per_s),
        ("training tokens/s", i.training.tokens_per_s),
        ("spool bytes/s", i.spool_bytes_per_s),
    ]:
        if not rate > 0 or math.isinf(rate):
            raise ValueError(f"{name} must be a positive measured rate, not {rate}")
    if i.checkpoint_every_tokens < 0:
        raise ValueError(f"checkpoint_every_tokens must not be negative, not {i.checkpoint_every_tokens}")

    shard_file = padded_size(i.shard_bytes)
    min_budget = i.capture.count * min_lane_bytes(i.passes, i.shard_bytes, i.mix_shards)
    if i.spool_budget_bytes < min_budget:
        raise SpoolTooSmall(
            f"the spool's budget is {i.spool_budget_bytes:,} bytes; {i.capture.count} capture host(s) x "
            f"({i.passes} passes x {i.mix_shards} shard(s) a mix + 1) x {shard_file:,} bytes per shard = "
            f"{min_budget:,} is the least it can run with (each lane holds the shards the trainer is training and "
            f"the one being written)"
        )
    shard_tokens = max(1, i.shard_bytes // i.bytes_per_token)
    mix_tokens = min(i.tokens, shard_tokens * i.mix_shards)
    held = math.ceil(i.checkpoint_every_tokens / i.passes / shard_tokens) if i.checkpoint_every_tokens else 0
    stall_free = min_budget + held * shard_file

    rates: dict[Side, float] = {
        "capture": i.capture.count * i.capture.tokens_per_s,
        "training": i.training.count * i.training.tokens_per_s / i.passes,
        "spool": i.spool_bytes_per_s / (2 * i.bytes_per_token),
    }
    bottleneck: Side = min(rates, key=lambda side: rates[side])  # dict order breaks ties: capture, training, spool
    r = rates[bottleneck]
    fill = mix_tokens / i.capture.tokens_per_s
    drain = mix_tokens * i.passes * (i.passes + 1) / 2 / (i.training.count * i.training.tokens_per_s)
    duration = i.tokens / r + fill + drain

    data_bytes = i.tokens * i.bytes_per_token
    per_lane = i.spool_budget_bytes // i.capture.count // shard_file * shard_file
    usable = per_lane * i.capture.count
    ceiling = data_bytes + i.capture.count * shard_file
    peak = min(usable, stall_free) if bottleneck == "capture" else usable
    peak = min(peak, ceiling)
    warnings = []
    if i.spool_budget_bytes < stall_free:
        warnings.append(
            f"the budget is below the stall-free {stall_free:,} bytes: capture will wait for the trainer's "
            f"checkpoints (checkpoint more often, or raise the budget)"
        )
    gpus = i.capture.count * i.capture.gpus_per_host + i.training.count * i.training.gpus_per_host
    return StreamingPlan(
        duration_s=duration,
        tokens_per_s=r,
        bottleneck=bottleneck,
        rates=rates,
        busy={side: r / rate for side, rate in rates.items()},
        min_budget_bytes=min_budget,
        stall_free_budget_bytes=stall_free,
        peak_disk_bytes=peak,
        data_bytes=data_bytes,
        gpu_hours=duration / 3600 * gpus,
        warnings=warnings,
    )


def main(argv: list[str] | None = None) -> None:
    """Print a plan: `python -m eagle3_assets.stages.eagle3_drafter.streaming_plan --tokens 6e9 ...`."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--tokens", type=float, required=True)
    p.add_argument("--bytes-per-token", type=int, default=57_349, help="the store's token_bytes(hidden_size)")
    p.add_argument("--capture-hosts", type=int, required=True)
    p.add_argument("--capture-tok-s", type=float, required=True, help="per capture host")
    p.add_argument("--training-hosts", type=int, required=True)
    p.add_argument("--training-tok-s", type=float, required=True, help="per training host, token-passes/s")
    p.add_argument("--gpus-per-host", type=int, default=8)
    p.add_argument("--spool-gb-s", type=float, required=True)
    p.add_argument("--spool-tb", type=float, required=True)
    p.add_argument("--passes", type=int, default=1)
    p.add_argument("--shard-gb", type=float, default=1.0)
    p.add_argument("--checkpoint-tokens", type=float, default=0)
    p.add_argument(
        "--mix-shards", type=int, default=None, help="shards the trainer shuffles together (default: the budget's)"
    )
    a = p.parse_args(argv)
    shard_bytes, budget = int(a.shard_gb * 1e9), int(a.spool_tb * 1e12)
    inputs = StreamingInputs(
        tokens=int(a.tokens),
        bytes_per_token=a.bytes_per_token,
        capture=Hosts(a.capture_hosts, a.capture_tok_s, a.gpus_per_host),
        training=Hosts(a.training_hosts, a.training_tok_s, a.gpus_per_host),
        spool_bytes_per_s=a.spool_gb_s * 1e9,
        spool_budget_bytes=budget,
        passes=a.passes,
        shard_bytes=shard_bytes,
        checkpoint_every_tokens=int(a.checkpoint_tokens),
        mix_shards=a.mix_shards or default_mix_shards(budget // a.capture_hosts, shard_bytes, a.passes),
    )
    print(plan_streaming(inputs).describe(inputs))


if __name__ == "__main__":
    main()
