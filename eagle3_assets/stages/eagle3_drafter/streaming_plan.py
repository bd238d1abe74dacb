"""The streaming run's budget and plan, before anything starts (issue 27, deliverable 4).

A pure function of the data, the hosts and the measured rates: how long the run takes, how much disk the spool
needs at its peak, which side is the bottleneck, and a refusal (`SpoolTooSmall`) of a spool that cannot hold the
working set the spool itself requires (`eagle3_resources.hidden_states.spool`).

Every rate is labelled where it came from: measured (the file and the figure: `streaming_rates.py` reads
`benchmarks/device_check.py`'s and `eagle3 gpu-check --json`'s JSON) or assumed; the description prints the label of
each.

The model (stated so it can be checked):
- Capture makes `C = capture hosts x their tokens/s` tokens a second; training trains `T = training hosts x their
  tokens/s` token-passes a second, so it consumes `T / passes` tokens of data a second. The spool's file system
  carries, per token of data, its bytes once in (the capture's write), `reads_per_byte` times out (the training
  side's reads, below) and the trainer's checkpoints (`checkpoint_bytes` every `checkpoint_every_tokens`
  token-passes, on the same file system: `checkpoint_bytes x passes / checkpoint_every_tokens` bytes per token of
  data), so it passes `S = spool bytes/s / (bytes per token x (1 + reads_per_byte) + checkpoint bytes per token)`
  tokens a second. The run's steady rate is `r = min(C, T / passes, S)` and the side that sets it is the bottleneck
  (ties go to capture, then training).
- The training side's reads (`reads_per_byte`). Today's trainer (`spool_data.py`, `spool.py` "Several ranks", since
  issue 42 item 1) has each rank read only the rows of its share of each step (the chunks they lie in) and keep them
  until the shard's passes are done: a row is read once by each rank that trains it in one of its `passes`, and the
  rows of a pass land on any of the run's R ranks (training hosts x their GPUs), so the default is the expected count
  of distinct ranks among `passes` draws, `R (1 - (1 - 1/R)^passes)`: 1 for one pass (assumed: the shuffle spreads a
  row's passes over the ranks at random; a chunk at the edge of two ranks' rows, at most 4 MiB, read by both, is not
  counted). Before the prefetcher every rank read every shard whole: the training hosts (their page caches shared by
  their ranks) to every rank of the run.
- What is launched is what is planned: the orchestrator launches `LAUNCHED_CAPTURE_HOSTS` capture host (one lane,
  streaming.py's `LANE`), so a plan of more is refused (`plan_streaming`'s `launchable_capture_hosts`).
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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from eagle3_resources.errors import SpoolTooSmall
from eagle3_resources.hidden_states.spool import default_mix_shards, min_lane_bytes
from eagle3_resources.hidden_states.store import padded_size

Side = Literal["capture", "training", "spool"]

ASSUMED = "assumed"  # the label of a rate nobody measured (a measured one's names its file and figure)
LAUNCHED_CAPTURE_HOSTS = 1  # capture hosts the orchestrator launches: one lane (streaming.py's LANE)


@dataclass(frozen=True)
class Hosts:
    count: int
    tokens_per_s: float  # per host: captured tokens/s (capture), or trained token-passes/s (training)
    gpus_per_host: int = 8
    source: str = ASSUMED  # where tokens_per_s came from: "measured: <file> <figure> ..." or "assumed ..."


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
    spool_source: str = ASSUMED  # where spool_bytes_per_s came from
    reads_per_byte: float | None = None  # file-system reads of each captured byte by training; None: today's trainer
    checkpoint_bytes: int = 0  # one checkpoint of the trainer (weights and optimizer), on the spool's file system

    @property
    def reads(self) -> float:
        """Times the training side reads each captured byte from the file system (see the module's docstring)."""
        if self.reads_per_byte is not None:
            return self.reads_per_byte
        ranks = self.training.count * self.training.gpus_per_host
        return ranks * (1 - (1 - 1 / ranks) ** self.passes)

    @property
    def checkpoint_bytes_per_token(self) -> float:
        """Checkpoint bytes written per token of data (`checkpoint_every_tokens` counts token-passes)."""
        if not (self.checkpoint_bytes and self.checkpoint_every_tokens):
            return 0.0
        return self.checkpoint_bytes * self.passes / self.checkpoint_every_tokens

    @property
    def spool_bytes_per_token(self) -> float:
        """File-system bytes per token of data: the write, the training side's reads, the checkpoints."""
        return self.bytes_per_token * (1 + self.reads) + self.checkpoint_bytes_per_token


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
    spool_traffic_bytes: float = 0.0  # what the file system moves over the run: written, read, checkpointed
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
            f"spool: {i.spool_bytes_per_s / 1e9:,.2f} GB/s / ({i.bytes_per_token:,} B x (1 write + {i.reads:g} "
            f"read(s)) + {i.checkpoint_bytes_per_token:,.0f} B of checkpoints) = {self.rates['spool']:,.0f} tok/s "
            f"(busy {self.busy['spool']:.0%}); {self.spool_traffic_bytes / 1e15:,.2f} PB moved over the run",
            f"checkpoints: {i.checkpoint_bytes / 1e9:,.2f} GB every {i.checkpoint_every_tokens:,} token-passes"
            if i.checkpoint_bytes and i.checkpoint_every_tokens
            else "checkpoints: not counted (no checkpoint size or interval given)",
            f"rate of capture per host: {i.capture.source}",
            f"rate of training per host: {i.training.source}",
            f"rate of the spool: {i.spool_source}",
            "reads: "
            + (
                f"each rank reads only its rows: {i.reads:.3g} read(s) of every byte, the distinct ranks of "
                f"{i.training.count * i.training.gpus_per_host} that train it in {i.passes} pass(es) (assumed: at "
                "random)"
                if i.reads_per_byte is None
                else f"{i.reads_per_byte:g} read(s) of every byte (given)"
            ),
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


def plan_streaming(i: StreamingInputs, launchable_capture_hosts: int | None = LAUNCHED_CAPTURE_HOSTS) -> StreamingPlan:
    """The plan of a streaming run; `SpoolTooSmall` when the spool's budget cannot hold its working set, and a
    `ValueError` for more capture hosts than the orchestrator launches (`launchable_capture_hosts`; None: the model
    alone, for any count)."""
    if launchable_capture_hosts is not None and i.capture.count > launchable_capture_hosts:
        raise ValueError(
            f"{i.capture.count} capture hosts planned, but the orchestrator launches {launchable_capture_hosts} "
            f"(one lane: streaming.py's LANE); a plan of {i.capture.count} would not be the run. Plan with "
            f"{launchable_capture_hosts} capture host(s) (--capture-hosts {launchable_capture_hosts})"
        )
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
    if i.reads_per_byte is not None and not i.reads_per_byte >= 0:
        raise ValueError(f"reads_per_byte must not be negative, not {i.reads_per_byte}")
    if i.checkpoint_bytes < 0:
        raise ValueError(f"checkpoint_bytes must not be negative, not {i.checkpoint_bytes}")
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
        "spool": i.spool_bytes_per_s / i.spool_bytes_per_token,
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
        spool_traffic_bytes=i.tokens * i.spool_bytes_per_token,
        warnings=warnings,
    )


def _pick(
    flag: str, given: float | None, measured: str | None, read: Callable[[str], tuple[float, str]], scale: float = 1.0
) -> tuple[float, str]:
    """(a rate, its label): the given number (assumed) or the file's figure; exactly one of them."""
    if given is not None and measured is None:
        return given * scale, f"{ASSUMED} (given: {flag} {given:g})"
    if given is None and measured is not None:
        return read(measured)
    raise SystemExit(f"give exactly one of {flag} (assumed) and its measurement file")


def main(argv: list[str] | None = None) -> None:
    """Print a plan: `python -m eagle3_assets.stages.eagle3_drafter.streaming_plan --tokens 6e9 ...`."""
    from eagle3_assets.stages.eagle3_drafter import streaming_rates as rates
    from eagle3_resources.hidden_states.store import token_bytes

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--tokens", type=float, required=True)
    p.add_argument("--hidden", type=int, default=7168, help="the target's width (Kimi-K2.5's 7168)")
    p.add_argument("--bytes-per-token", type=int, default=None, help="default: the store's token_bytes(--hidden)")
    p.add_argument("--capture-hosts", type=int, default=LAUNCHED_CAPTURE_HOSTS)
    p.add_argument("--capture-tok-s", type=float, default=None, help="per capture host, assumed")
    p.add_argument("--capture-gpu-check", default=None, help="`eagle3 gpu-check --model --tp --json` output")
    p.add_argument("--training-hosts", type=int, required=True)
    p.add_argument("--training-tok-s", type=float, default=None, help="per training host, token-passes/s, assumed")
    p.add_argument("--training-device-check", default=None, help="benchmarks/device_check.py's JSON")
    p.add_argument("--gpus-per-host", type=int, default=8)
    p.add_argument("--spool-gb-s", type=float, default=None, help="the spool's file system, assumed")
    p.add_argument("--spool-gpu-check", default=None, help="`eagle3 gpu-check --json` output on the spool's root")
    p.add_argument("--spool-tb", type=float, required=True)
    p.add_argument("--reads-per-byte", type=float, default=None, help="default: each rank its own rows (the model)")
    p.add_argument("--passes", type=int, default=1)
    p.add_argument("--shard-gb", type=float, default=1.0)
    p.add_argument("--checkpoint-tokens", type=float, default=0, help="token-passes between two checkpoints")
    p.add_argument("--checkpoint-gb", type=float, default=None, help="default: the drafter's at --hidden")
    p.add_argument("--intermediate", type=int, default=18432)
    p.add_argument("--target-vocab", type=int, default=163840)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--drafter-kind", default="eagle3_mla")
    p.add_argument(
        "--mix-shards", type=int, default=None, help="shards the trainer shuffles together (default: the budget's)"
    )
    a = p.parse_args(argv)
    shard_bytes, budget = int(a.shard_gb * 1e9), int(a.spool_tb * 1e12)
    try:
        capture, capture_source = _pick("--capture-tok-s", a.capture_tok_s, a.capture_gpu_check, rates.capture_rate)
        training, training_source = _pick(
            "--training-tok-s",
            a.training_tok_s,
            a.training_device_check,
            lambda path: rates.training_rate(path, a.gpus_per_host, a.hidden),
        )
        spool, spool_source = _pick("--spool-gb-s", a.spool_gb_s, a.spool_gpu_check, rates.spool_rate, 1e9)
    except rates.RateUnreadable as e:
        raise SystemExit(f"error: {e}") from None
    if a.checkpoint_gb is not None:
        checkpoint = int(a.checkpoint_gb * 1e9)
    elif a.checkpoint_tokens:
        checkpoint = rates.drafter_checkpoint_bytes(
            a.hidden, a.intermediate, a.target_vocab, a.draft_vocab, a.drafter_kind
        )
    else:
        checkpoint = 0
    inputs = StreamingInputs(
        tokens=int(a.tokens),
        bytes_per_token=a.bytes_per_token or token_bytes(a.hidden),
        capture=Hosts(a.capture_hosts, capture, a.gpus_per_host, capture_source),
        training=Hosts(a.training_hosts, training, a.gpus_per_host, training_source),
        spool_bytes_per_s=spool,
        spool_budget_bytes=budget,
        passes=a.passes,
        shard_bytes=shard_bytes,
        checkpoint_every_tokens=int(a.checkpoint_tokens),
        mix_shards=a.mix_shards or default_mix_shards(budget // a.capture_hosts, shard_bytes, a.passes),
        spool_source=spool_source,
        reads_per_byte=a.reads_per_byte,
        checkpoint_bytes=checkpoint,
    )
    try:
        plan = plan_streaming(inputs)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    print(plan.describe(inputs))


if __name__ == "__main__":
    main()
