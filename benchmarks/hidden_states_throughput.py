"""Benchmark: hidden-state extraction against its two limits, the bare forward and the disk, measured in one run.

    python benchmarks/hidden_states_throughput.py                      # CPU: a stand-in-shaped DeepseekV3
    python benchmarks/hidden_states_throughput.py --model DIR          # any HF folder (e.g. the built stand-in)
    python benchmarks/hidden_states_throughput.py --device cuda --hidden 2048 --layers 8 --json $OUT/extraction.json

Measured on the same batches (the store's own grouping by `--batch-tokens` within each shard, right-padded
with an attention mask):
  bare forward   `model.model(ids, attention_mask)`, nothing kept: what any extraction must pay;
  null sink      `extract_to_store(null_sink=True)`: hooks, the copies into the shard images (side
                 stream on a GPU), the finiteness sums, the writer threads' wait; no write. Its ratio
                 to the bare forward is the capture's own overhead (goal >= 0.95);
  extraction     `extract_to_store` for real, into a temporary store on `--dir`'s disk, in >= 20 shards
                 (so the last shard's write, the only one nothing overlaps, is a small tail);
  disk           fsync'd sequential 16 MiB writes of `--write-gb` (the samples repeated), in files of the
                 store's shard sizes, into `--dir`: O_DIRECT from `--writers` threads at once (buffered where
                 O_DIRECT is refused), and buffered from one thread; the better of the two is the disk's
                 bandwidth in that round;
  store writes   `extract_to_store` of the same bytes fed by a backend that returns ready states (no
                 forward): the write path alone (copies, checks, image writes, hashing, fsync, rename,
                 manifest); its GB/s against the disk's (goal >= 0.8).
Repeats: after an untimed warm-up (every batch through the model, a capture, a store write), `--rounds`
rounds of (bare, null sink, extraction) and `--write-rounds` rounds of (store writes, disk O_DIRECT, disk
buffered), each round in a rotated order; each buffered disk test is followed by an untimed store write (on
this project's host the first store write after one runs ~10% slower, 6 s later still, while the O_DIRECT disk
test does not: without it, the store's runs that came after a buffered test paid for it and the disk's never
did). A ratio is taken within each round, from runs seconds apart
(a shared host's load drifts slower than that), and the median over rounds is the figure; every round's
value is printed and written. The goal for the extraction: >= 0.9 x min(bare forward tok/s, disk GB/s /
bytes per token).
Without `--model` the target is a DeepseekV3 with random weights (MLA + MoE like Kimi-K2.5) of the
stand-in's shape (hidden 64, 8 layers) or of `--hidden` / `--layers`. Needs torch, transformers, safetensors
and xxhash only (no Dagster, no polars), so it runs as is on a bare GPU machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a plain checkout, installed or not

from eagle3_resources.hidden_states.extract import (  # noqa: E402
    HostBuffers,
    StoreSettings,
    batches,
    extract_to_store,
    store_figures,
)
from eagle3_resources.hidden_states.store import (  # noqa: E402
    ALIGN,
    CHECKSUM,
    WRITE_CHUNK,
    ShardPlan,
    StoredSample,
    host_buffer,
    plan_shards,
    shard_layout,
    token_bytes,
    write_file,
    write_files,
)
from eagle3_resources.hidden_states.transformers_backend import (  # noqa: E402
    TransformersHiddenStates,
)

STARTED = time.monotonic()  # `--budget-s` counts from here (the imports above are a few seconds)


def random_deepseek_v3(
    hidden: int, layers: int, vocab: int, *, device: torch.device | None = None, dtype: torch.dtype | None = None
):
    """The random DeepseekV3. With `device` (and `dtype`) its weights are made there, in that dtype: on a GPU the random
    initialisation of ~1B parameters takes a second instead of the CPU's 10-40 s, which a device check's time cap
    cannot spare. Without, on the CPU in fp32 (`.to()` it)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    heads = max(4, hidden // 128)
    cfg = DeepseekV3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=max(32, hidden // 4),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        first_k_dense_replace=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        q_lora_rank=max(32, hidden // 4),
        kv_lora_rank=max(16, hidden // 8),
        qk_nope_head_dim=max(8, hidden // heads // 2),
        qk_rope_head_dim=max(8, hidden // heads // 4),
        v_head_dim=max(16, hidden // heads // 2),
        max_position_embeddings=16384,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    if device is None:
        return DeepseekV3ForCausalLM(cfg)
    with torch.device(device):  # every parameter and buffer made on `device`, its initialisation run there
        return DeepseekV3ForCausalLM._from_config(cfg, dtype=dtype or torch.float32)


def sequences(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[StoredSample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        L = rng.randint(lo, hi)
        out.append(StoredSample(f"bench/{i}", "train", [rng.randrange(1, vocab) for _ in range(L)], [1] * L))
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def bare_forward(backend: TransformersHiddenStates, shards: list[list[StoredSample]], batch_tokens: int) -> float:
    """Seconds for the extraction's batches (formed within each shard, as `extract_to_store` forms them)
    through the model, outputs dropped."""
    device = backend.device
    sync(device)
    start = time.perf_counter()
    for rows in shards:
        for group in batches([len(s.input_ids) for s in rows], batch_tokens):
            ids, mask = backend.padded([list(rows[i].input_ids) for i in group])
            backend.model.model(input_ids=ids, attention_mask=mask, use_cache=False)
    sync(device)
    return time.perf_counter() - start


class ReadyStates:
    """A backend with no forward: every batch gets rows of one preallocated pair of state tensors on the device
    (finite random values), so `extract_to_store` runs its copy, check and write path as fast as it can."""

    name = "ready-states"

    def __init__(self, like: TransformersHiddenStates, longest: int):
        self.layer_ids, self.num_layers, self.hidden_size = like.layer_ids, like.num_layers, like.hidden_size
        self.device = like.device
        g = torch.Generator().manual_seed(1)
        H = self.hidden_size
        self.aux = torch.randn(longest, 3 * H, generator=g).to(self.device, torch.bfloat16)
        self.final = torch.randn(longest, H, generator=g).to(self.device, torch.bfloat16)

    def describe(self) -> dict:
        return {"backend": self.name}

    def extract_batch(self, seqs: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(self.aux[: len(s)], self.final[: len(s)]) for s in seqs]


class InterleavedBare:
    """Wraps the backend of a run: each batch's bare forward runs in the same call as its capture (before it on even
    batches, after it on odd ones), timed apart (`bare_s`). The run's own time is its wall time less those bare
    forwards. So the two are measured within a second of each other, batch by batch, all through the run: on a
    shared host whose load drifts over seconds, the drift falls on both alike. For CPU runs (a GPU's bare forward
    would have to synchronize, which would stop the capture's copies from overlapping the next forward)."""

    def __init__(self, inner: TransformersHiddenStates):
        self.inner = inner
        self.bare_s: list[float] = []
        self.calls: list[float] = []  # when each extract_batch began
        self.started = self.ended = 0.0  # the run's ends (set by the caller)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @torch.inference_mode()
    def bare(self, seqs: list[list[int]]) -> None:
        start = time.perf_counter()
        ids, mask = self.inner.padded(seqs)
        self.inner.model.model(input_ids=ids, attention_mask=mask, use_cache=False)
        self.bare_s.append(time.perf_counter() - start)

    def extract_batch(self, seqs: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        self.calls.append(time.perf_counter())
        before = len(self.bare_s) % 2 == 0
        if before:
            self.bare(seqs)
        out = self.inner.extract_batch(seqs)
        if not before:
            self.bare(seqs)
        return out

    def batch_ratios(self) -> list[float]:
        """Per batch: its bare forward / the run's own time from this call to the next (the capture's forward, then
        the pipeline's work until the next batch; the setup before the first call and the wait for the writers after
        the last count with the first and the last batch)."""
        ends = [*self.calls[1:], self.ended]
        # one call time and one bare forward per batch
        own = [end - begin - bare for begin, end, bare in zip(self.calls, ends, self.bare_s, strict=True)]
        own[0] += self.calls[0] - self.started
        return [bare / o for bare, o in zip(self.bare_s, own, strict=True)]


def disk_write_s(
    root: Path, sizes: list[int], *, direct: bool, threads: int, buffer: torch.Tensor
) -> tuple[float, bool]:
    """Seconds to write files of `sizes` bytes (16 MiB sequential writes, fsync each) with `threads` writers at once
    (store.write_files, as the store's writers write), and whether every write went O_DIRECT."""
    memory = buffer.numpy().data  # the memoryview of the array (numpy types its buffer protocol from Python 3.12)
    items = [(root / f"disk-{i}.bin", size) for i, size in enumerate(sizes)]
    start = time.perf_counter()
    results = write_files(items, memory, writers=threads, direct=direct, checksum=None)
    seconds = time.perf_counter() - start
    for path, _ in items:
        path.unlink()
    return seconds, all(d for _, d in results)


def store_writes_direct(buffers: HostBuffers, directory: str | None, direct: bool) -> bool:
    """Whether the store's writes from these (on a GPU page-locked) host buffers go O_DIRECT: one 2-chunk write from
    one of them, as a writer writes a shard. A kernel that cannot pin the driver's pages for the DMA, or a file system
    without O_DIRECT, makes the store write buffered (store.DIRECT_REFUSED): said in the output, not silently."""
    image = buffers.take(2 * WRITE_CHUNK)
    try:
        size = min(2 * WRITE_CHUNK, image.capacity // ALIGN * ALIGN)
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            _, used = write_file(Path(tmp) / "probe.bin", image.memory(), size, direct=direct, checksum=None)
        return used
    finally:
        buffers.give(image)


def next_round_s(kinds: list[str], took: dict[str, list[float]]) -> float:
    """A round of `kinds`, guessed from the longest run of each kind so far (every kind ran in the first round)."""
    return sum(max(took[k]) for k in kinds)


def spread(values: list[float]) -> dict:
    return {
        "best": max(values),
        "median": statistics.median(values),
        "worst": min(values),
        "all": [round(v, 4) for v in values],
    }


def rotated(names: list[str], r: int) -> list[str]:
    """Round r's order: each measurement first in turn, so none always follows the same one (a warm cache, a
    disk still flushing, a neighbour's burst)."""
    k = r % len(names)
    return names[k:] + names[:k]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="an HF model folder; unset = random DeepseekV3")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=163840)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--samples", type=int, default=None, help="default 400 on a GPU (~280k tokens), 48 on CPU")
    p.add_argument("--min-len", type=int, default=200)
    p.add_argument("--max-len", type=int, default=1200)
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--shard-gb", type=float, default=None, help="default: the store's size / 24 (>= 20 shards)")
    p.add_argument("--writers", type=int, default=StoreSettings.writers)
    p.add_argument(
        "--write-gb",
        type=float,
        default=1.0,
        help="the store-writes and disk measurements write at least this "
        "much (the samples repeated; a CPU forward is too slow to produce a store large enough to time a disk)",
    )
    p.add_argument(
        "--write-repeat",
        type=int,
        default=None,
        help="repeat the samples this many times for the write measurements (default: from --write-gb)",
    )
    p.add_argument("--buffered", action="store_true", help="no O_DIRECT for the store's writes")
    p.add_argument(
        "--rounds", type=int, default=3, help="rounds of bare forward, null sink and extraction, in rotated order"
    )
    p.add_argument(
        "--whole-runs",
        action="store_true",
        help="on a CPU too, time the bare forward in runs of its own (by "
        "default a CPU run interleaves it batch by batch with the null sink and the extraction)",
    )
    p.add_argument(
        "--write-rounds",
        type=int,
        default=None,
        help="rounds of the store writes and the disk, in rotated order (default: --rounds)",
    )
    p.add_argument("--dir", default=None, help="where the temporary stores are written (default: the system temp dir)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="no round starts that would end past this many seconds from the script's start, by the "
        "longest round of each kind so far (the first round always runs); the rounds done are in the figures. "
        "benchmarks/device_check.py gives one below its time cap",
    )
    p.add_argument(
        "--json", default=None, help="write the figures here (default: $OUT/extraction.json when $OUT is set)"
    )
    a = p.parse_args()
    a.write_rounds = a.write_rounds or a.rounds
    return a


def load_target(a: argparse.Namespace) -> tuple[Any, str, torch.device, torch.dtype]:
    """(the model, in eval mode on its device; its name; the device; the dtype)."""
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device)
    dtype = getattr(torch, ("bfloat16" if device.type == "cuda" else "float32") if a.dtype == "auto" else a.dtype)
    if a.model:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype)
        name = Path(a.model).name
    else:
        model = random_deepseek_v3(a.hidden, a.layers, a.vocab, device=device, dtype=dtype)
        name = f"random DeepseekV3 hidden {a.hidden}, {a.layers} layers"
    # transformers wraps PreTrainedModel.to with functools.wraps, which mypy reads as an unbound function
    model = model.to(device).eval()  # type: ignore[arg-type]
    return model, name, device, dtype


@dataclass
class Bench:
    """The run's fixed parts, all made before anything is timed: the target, the samples and their shards, the write
    measurements' samples (the samples repeated) and shards, the host buffers and the disk test's source bytes."""

    a: argparse.Namespace
    name: str
    device: torch.device
    dtype: torch.dtype
    backend: TransformersHiddenStates
    samples: list[StoredSample]
    tokens: int
    hidden: int
    shard_bytes: int
    settings: StoreSettings
    identity: dict[str, str]
    shards: list[list[StoredSample]]  # the samples of each of the store's shards, in order
    repeat: int  # the write measurements' samples are the samples this many times
    write_samples: list[StoredSample]
    write_plans: list[ShardPlan]
    write_bytes: list[int]  # each write-measurement shard's size
    buffers: HostBuffers
    scratch: torch.Tensor  # the disk test's source: any bytes
    ready: ReadyStates
    store_direct: bool  # whether the store's writes from `buffers` go O_DIRECT


def repeated(samples: list[StoredSample], repeat: int) -> list[StoredSample]:
    """The samples `repeat` times over, each copy under its own id: a store large enough to time a disk by."""
    return [
        StoredSample(f"{s.sample_id}/{k}", s.split, s.input_ids, s.loss_mask) for k in range(repeat) for s in samples
    ]


def prepare(a: argparse.Namespace, model, name: str, device: torch.device, dtype: torch.dtype) -> Bench:
    """The samples, the shard plans, the buffers and the probe of the store's O_DIRECT: made once, untimed."""
    backend = TransformersHiddenStates(model)
    n_samples = a.samples if a.samples is not None else (400 if device.type == "cuda" else 48)
    samples = sequences(n_samples, a.min_len, a.max_len, model.config.vocab_size)
    tokens = sum(len(s.input_ids) for s in samples)
    H = backend.hidden_size
    shard_bytes = int(a.shard_gb * 1e9) if a.shard_gb else max(1, tokens * token_bytes(H) // 24)
    settings = StoreSettings(
        shard_bytes=shard_bytes,
        batch_tokens=a.batch_tokens,
        writers=a.writers,
        direct_io=not a.buffered,
        free_bytes=10**15,
        reserve_bytes=0,
    )
    identity = {"bench": name}
    plans = plan_shards(samples, H, shard_bytes, {**identity, "aux_layer_ids": backend.layer_ids})
    sizes = [shard_layout(pl, [samples[i] for i in pl.samples], H).size for pl in plans]
    repeat = a.write_repeat or max(1, math.ceil(a.write_gb * 1e9 / sum(sizes)))
    write_samples = repeated(samples, repeat)
    write_plans = plan_shards(write_samples, H, shard_bytes * repeat, {**identity, "aux_layer_ids": backend.layer_ids})
    write_bytes = [shard_layout(pl, [write_samples[i] for i in pl.samples], H).size for pl in write_plans]
    buffers = HostBuffers(a.writers + 1, pin=device.type == "cuda")
    buffers.reserve(max(max(sizes), max(write_bytes)))  # allocated (and page-locked) once, outside every timing
    scratch = host_buffer(max(write_bytes) + 2**25, pin=False)  # the disk test's source: any bytes
    scratch.random_(0, 256)
    ready = ReadyStates(backend, max(len(s.input_ids) for s in samples))
    store_direct = store_writes_direct(buffers, a.dir, not a.buffered)
    shards = [[samples[i] for i in pl.samples] for pl in plans]
    return Bench(
        a=a,
        name=name,
        device=device,
        dtype=dtype,
        backend=backend,
        samples=samples,
        tokens=tokens,
        hidden=H,
        shard_bytes=shard_bytes,
        settings=settings,
        identity=identity,
        shards=shards,
        repeat=repeat,
        write_samples=write_samples,
        write_plans=write_plans,
        write_bytes=write_bytes,
        buffers=buffers,
        scratch=scratch,
        ready=ready,
        store_direct=store_direct,
    )


def print_setup(b: Bench) -> None:
    a = b.a
    print(
        f"{b.name} on {b.device} ({str(b.dtype).removeprefix('torch.')}), {torch.get_num_threads()} CPU threads; "
        f"{len(b.samples)} samples, {b.tokens:,} tokens, {token_bytes(b.hidden):,} B/token, {len(b.shards)} shards "
        f"of ~{b.shard_bytes / 1e6:,.0f} MB, "
        f"{a.writers} writers, batch budget {a.batch_tokens:,} tokens, layers {b.backend.layer_ids}; "
        f"checksum {CHECKSUM}; the store writes its {'page-locked ' if b.buffers.pin else ''}buffers "
        f"{'O_DIRECT' if b.store_direct else 'buffered'}",
        flush=True,
    )
    print(
        f"write measurements: the samples x {b.repeat} = {sum(b.write_bytes) / 1e9:.2f} GB in {len(b.write_bytes)} "
        f"shards of ~{statistics.median(b.write_bytes) / 1e6:,.0f} MB",
        flush=True,
    )


def extraction(
    b: Bench, be, null_sink: bool, which: list[StoredSample] | None = None, shard: int | None = None
) -> tuple[float, float, dict]:
    """(wall seconds, process CPU seconds, store figures) of one extract_to_store into a new temporary store; of `which`
    (default: the samples) in shards of `shard` bytes (default: the store's)."""
    which = b.samples if which is None else which
    shard = b.shard_bytes if shard is None else shard
    with tempfile.TemporaryDirectory(dir=b.a.dir) as tmp:
        sync(b.device)
        start, cpu = time.perf_counter(), time.process_time()
        extract_to_store(
            which,
            be,
            Path(tmp),
            replace(b.settings, shard_bytes=shard),
            identity=b.identity,
            log=lambda m: None,
            progress_every_s=3600,
            buffers=b.buffers,
            null_sink=null_sink,
        )
        sync(b.device)
        end, cpu = time.perf_counter(), time.process_time() - cpu
        seconds = end - start
        if isinstance(be, InterleavedBare):
            be.started, be.ended = start, end
        return seconds, cpu, ({} if null_sink else store_figures(Path(tmp)))


def disk(b: Bench, direct: bool, threads: int) -> tuple[float, float, bool]:
    """(wall seconds, process CPU seconds, whether every write went O_DIRECT) of the disk test's files."""
    with tempfile.TemporaryDirectory(dir=b.a.dir) as tmp:
        cpu = time.process_time()
        seconds, used_direct = disk_write_s(Path(tmp), b.write_bytes, direct=direct, threads=threads, buffer=b.scratch)
        return seconds, time.process_time() - cpu, used_direct


def warm_up(b: Bench) -> None:
    """Untimed: the first shards through the model (allocator, kernels), a capture and one shard's store write."""
    bare_forward(b.backend, b.shards[:2], b.a.batch_tokens)
    extraction(b, b.backend, True, b.samples[:4])
    extraction(b, b.ready, False, [b.write_samples[i] for i in b.write_plans[0].samples], b.shard_bytes * b.repeat)


KINDS = ("bare", "null", "extract", "ready", "disk_buffered", "disk_direct_parallel")
WRITE_KINDS = ["ready", "disk_direct_parallel", "disk_buffered"]


@dataclass
class Runs:
    """Every measured run's figures, by kind, as the rounds add them."""

    interleave: bool  # a CPU run's bare forward is timed batch by batch inside the null sink and extraction runs
    t: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in KINDS})  # wall seconds
    cpu: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in KINDS})  # process CPU seconds
    # bare seconds / the run's own seconds, per run
    pairs: dict[str, list[float]] = field(default_factory=lambda: {"null": [], "extract": []})
    bare_in: dict[str, list[float]] = field(default_factory=dict)  # interleaved: the bare forwards inside each run
    # interleaved: bare / own, batch by batch, every run
    batch_pairs: dict[str, list[float]] = field(default_factory=lambda: {"null": [], "extract": []})
    direct_ok: bool = False  # the disk test's O_DIRECT writes went O_DIRECT
    settle: list[float] = field(default_factory=list)  # seconds of the untimed store write after each buffered test
    figures: dict[str, Any] = field(default_factory=dict)  # the last extraction's store figures

    def __post_init__(self) -> None:
        if self.interleave:
            self.bare_in = {"null": [], "extract": []}

    def forward_kinds(self) -> list[str]:
        return ["null", "extract"] if self.interleave else ["bare", "null", "extract"]


def measure(b: Bench, runs: Runs, kind: str) -> None:
    """One run of `kind`, its seconds (and CPU seconds) added to `runs`, and its pairing with the same round's bare
    forward where that ran first."""
    t, pairs = runs.t, runs.pairs
    c = float("nan")
    if kind == "bare":
        s = bare_forward(b.backend, b.shards, b.a.batch_tokens)
        for k in pairs:
            if len(t[k]) > len(pairs[k]):  # the same round's run came first
                pairs[k].append(s / t[k][-1])
    elif kind in ("null", "extract"):
        interleaved = InterleavedBare(b.backend) if runs.interleave else None
        s, c, f = extraction(b, interleaved if interleaved is not None else b.backend, kind == "null")
        runs.figures = f or runs.figures
        if interleaved is not None:
            bare_s = sum(interleaved.bare_s)
            s -= bare_s
            t["bare"].append(bare_s)
            runs.bare_in[kind].append(bare_s)
            pairs[kind].append(bare_s / s)
            runs.batch_pairs[kind].extend(interleaved.batch_ratios())
        elif len(t["bare"]) > len(t[kind]):  # the same round's bare forward came first
            pairs[kind].append(t["bare"][-1] / s)
    elif kind == "ready":
        s, c, _ = extraction(b, b.ready, False, b.write_samples, b.shard_bytes * b.repeat)
    elif kind == "disk_buffered":
        s, c, _ = disk(b, False, 1)
        # The first store write after a buffered test is slower (measured here: 1.69-1.92 GB/s against 1.85-2.15 for
        # the next one; 6 s of sleep or two O_DIRECT disk tests in between changed nothing), and the O_DIRECT disk
        # test is not: so no timed store write comes first after it.
        runs.settle.append(extraction(b, b.ready, False, b.write_samples, b.shard_bytes * b.repeat)[0])
    else:
        s, c, runs.direct_ok = disk(b, True, b.a.writers)
    t[kind].append(s)
    runs.cpu[kind].append(c)


def print_repeats(a: argparse.Namespace, interleave: bool) -> None:
    print(
        "repeats: "
        + (
            f"{a.rounds} rounds of (null sink, extraction), each with every batch's bare forward interleaved "
            f"in the same run"
            if interleave
            else f"{a.rounds} rounds of (bare forward, null sink, extraction)"
        )
        + f", and {a.write_rounds} rounds of (store writes, disk O_DIRECT, disk buffered); "
        "each round in a rotated order, each buffered test followed by an untimed store write",
        flush=True,
    )


def run_rounds(b: Bench, runs: Runs) -> dict[str, int]:
    """`--rounds` rounds of the forward kinds and `--write-rounds` of the write kinds, each in a rotated order, while
    `--budget-s` lasts: the rounds done, by family."""
    a = b.a
    forward_kinds = runs.forward_kinds()
    print_repeats(a, runs.interleave)
    took: dict[str, list[float]] = {k: [] for k in forward_kinds + WRITE_KINDS}  # wall seconds of each run, by kind
    done_rounds = {"forward": 0, "write": 0}
    for r in range(max(a.rounds, a.write_rounds)):
        order = (rotated(forward_kinds, r) if r < a.rounds else []) + (
            rotated(WRITE_KINDS, r) if r < a.write_rounds else []
        )
        left = None if a.budget_s is None else a.budget_s - (time.monotonic() - STARTED)
        if r and left is not None and next_round_s(order, took) > left:
            print(
                f"budget: round {r + 1} would take ~{next_round_s(order, took):.0f} s, {left:.0f} s of "
                f"--budget-s {a.budget_s:g} are left: the figures are from {r} round(s)",
                flush=True,
            )
            break
        for kind in order:
            begin = time.monotonic()
            measure(b, runs, kind)
            took[kind].append(time.monotonic() - begin)
        done_rounds["forward"] += r < a.rounds
        done_rounds["write"] += r < a.write_rounds
        print(
            f"round {r + 1}: "
            + ", ".join(
                f"{k} {runs.t[k][-1]:.2f} s"
                + (f" (bare {runs.bare_in[k][-1]:.2f} s interleaved)" if k in runs.bare_in else "")
                for k in order
            ),
            flush=True,
        )
    return done_rounds


@dataclass
class Ratios:
    """The figures the runs give: rates, the disk's bandwidth, and the paired ratios (each a median over rounds, or
    on a CPU over batches, of ratios taken within one round)."""

    total: int  # the store's bytes
    write_total: int  # the write measurements' bytes
    rate: dict[str, dict]  # tokens/s spread, by kind
    gbps: dict[str, dict]  # GB/s spread, by kind
    disk_round: list[float]  # the disk's GB/s in each write round, the better of its two ways
    disk_kind: str
    null_ratio: float
    extract_ratio: float
    store_pairs: list[float]  # store writes GB/s / the disk's, per write round
    disk_gbps: float
    bare: float  # the bare forward's median tokens/s
    store_gbps: float
    extract_gbps: float
    bytes_per_token: float
    limit: float  # min(bare forward tok/s, disk tok/s)
    extract_paired: float  # the extraction's tok/s by its paired ratio to the bare forward
    cpu_per_gb: dict[str, float]
    store_to_disk: float
    store_to_disk_best: float
    extract_write_to_disk: float
    extract_to_limit: float


def ratios(b: Bench, runs: Runs) -> Ratios:
    t, tokens, repeat = runs.t, b.tokens, b.repeat
    total = runs.figures["bytes"]
    write_total = sum(b.write_bytes)
    rate = {
        k: spread([tokens * (repeat if k == "ready" else 1) / s for s in t[k]])
        for k in ("bare", "null", "extract", "ready")
    }
    gbps = {k: spread([(write_total if k in WRITE_KINDS else total) / s / 1e9 for s in v]) for k, v in t.items()}
    # The disk's bandwidth in each write round: the better of its two ways (buffered, O_DIRECT from `writers` threads).
    disk_round = [
        max(write_total / buffered, write_total / direct) / 1e9
        for buffered, direct in zip(t["disk_buffered"], t["disk_direct_parallel"], strict=True)  # one each per round
    ]
    disk_kind = max(("disk_buffered", "disk_direct_parallel"), key=lambda k: gbps[k]["median"])
    # Paired ratios. On a GPU each from one round's adjacent runs, the median over rounds the figure. On a CPU the bare
    # forward runs batch by batch inside the measured runs: the figure is the median over every batch of every run (the
    # finest pairing), and each run's own ratio (its sums) is given beside it.
    null_ratio = statistics.median(runs.batch_pairs["null"] if runs.interleave else runs.pairs["null"])
    extract_ratio = statistics.median(runs.batch_pairs["extract"] if runs.interleave else runs.pairs["extract"])
    store_pairs = [write_total / s / 1e9 / d for s, d in zip(t["ready"], disk_round, strict=True)]  # per write round
    disk_gbps = statistics.median(disk_round)
    bare = rate["bare"]["median"]
    store_gbps, extract_gbps = gbps["ready"]["median"], gbps["extract"]["median"]
    bytes_per_token = total / tokens
    limit = min(bare, disk_gbps * 1e9 / bytes_per_token)
    extract_paired = bare * extract_ratio
    return Ratios(
        total=total,
        write_total=write_total,
        rate=rate,
        gbps=gbps,
        disk_round=disk_round,
        disk_kind=disk_kind,
        null_ratio=null_ratio,
        extract_ratio=extract_ratio,
        store_pairs=store_pairs,
        disk_gbps=disk_gbps,
        bare=bare,
        store_gbps=store_gbps,
        extract_gbps=extract_gbps,
        bytes_per_token=bytes_per_token,
        limit=limit,
        extract_paired=extract_paired,
        cpu_per_gb={k: round(statistics.median(runs.cpu[k]) / (write_total / 1e9), 4) for k in WRITE_KINDS},
        store_to_disk=statistics.median(store_pairs),
        store_to_disk_best=gbps["ready"]["best"] / max(disk_round),
        extract_write_to_disk=extract_gbps / disk_gbps,
        extract_to_limit=extract_paired / limit,
    )


def figures_json(b: Bench, runs: Runs, r: Ratios, done_rounds: dict[str, int]) -> dict:
    a, device, figures = b.a, b.device, runs.figures
    return {
        "model": b.name,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(b.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "samples": len(b.samples),
        "tokens": b.tokens,
        "bytes": r.total,
        "bytes_per_token": round(r.bytes_per_token, 2),
        "shards": figures["shards"],
        "shard_bytes": b.shard_bytes,
        "writers": a.writers,
        "o_direct": runs.direct_ok and not a.buffered,
        "store_o_direct": b.store_direct,
        "pinned_buffers": b.buffers.pin,
        "checksum": CHECKSUM,
        "rounds": done_rounds["forward"],
        "write_rounds": done_rounds["write"],
        "rounds_asked": a.rounds,
        "write_rounds_asked": a.write_rounds,
        "budget_s": a.budget_s,
        "seconds_total": round(time.monotonic() - STARTED, 1),
        "write_repeat": b.repeat,
        "write_test_bytes": r.write_total,
        "write_test_shards": len(b.write_bytes),
        "seconds": {k: [round(x, 4) for x in v] for k, v in runs.t.items()},
        "settle_seconds": [round(x, 4) for x in runs.settle],
        "bare_interleaved": runs.interleave,
        "tokens_per_s": r.rate,
        "gb_per_s": r.gbps,
        "disk_gb_per_s": r.disk_gbps,
        "disk_gb_per_s_by_round": [round(x, 4) for x in r.disk_round],
        "disk_measured_as": r.disk_kind,
        "cpu_s_per_gb_written": r.cpu_per_gb,
        "ratio_null_sink_to_bare": r.null_ratio,
        "ratio_null_sink_to_bare_by_round": [round(x, 4) for x in runs.pairs["null"]],
        "ratio_null_sink_to_bare_by_batch": [round(x, 4) for x in runs.batch_pairs["null"]],
        "ratio_extraction_to_bare": r.extract_ratio,
        "ratio_extraction_to_bare_by_round": [round(x, 4) for x in runs.pairs["extract"]],
        "ratio_extraction_to_bare_by_batch": [round(x, 4) for x in runs.batch_pairs["extract"]],
        "ratio_store_write_to_disk": r.store_to_disk,
        "ratio_store_write_to_disk_by_round": [round(x, 4) for x in r.store_pairs],
        "ratio_store_write_to_disk_best": r.store_to_disk_best,
        "ratio_extraction_write_to_disk": r.extract_write_to_disk,
        "limit_tokens_per_s": r.limit,
        "ratio_extraction_to_limit": r.extract_to_limit,
        "overhead_pct_bytes_per_token": figures["overhead_pct"],
    }


def listed(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in values) + "]"


def rate_line(label: str, key: str, runs: Runs, r: Ratios) -> str:
    rate = r.rate[key]
    return (
        f"{label:<16}{rate['median']:12,.0f} tok/s  (median of {len(runs.t[key])}; "
        f"best {rate['best']:,.0f}, worst {rate['worst']:,.0f}; "
        f"{r.gbps[key]['median']:.3f} GB/s)"
    )


def paired(kind: str, runs: Runs) -> str:
    """How the ratio of `kind` to the bare forward was paired, and its parts."""
    if runs.interleave:
        b = runs.batch_pairs[kind]
        return (
            f"median of {len(b)} batches (each batch's bare forward run next to its capture; quartiles "
            f"{statistics.quantiles(b, n=4)[0]:.3f}-{statistics.quantiles(b, n=4)[2]:.3f}) "
            f"in {len(runs.pairs[kind])} runs; "
            f"each run's own sums {listed(runs.pairs[kind])}"
        )
    return f"median of {listed(runs.pairs[kind])}, each from one round's adjacent runs"


def print_rates(runs: Runs, r: Ratios) -> None:
    print(rate_line("bare forward", "bare", runs, r))
    print(rate_line("null sink", "null", runs, r))
    print(rate_line("extraction", "extract", runs, r))
    print(
        f"{'store writes':<16}{r.rate['ready']['median']:12,.0f} tok/s  "
        f"({r.store_gbps:.3f} GB/s median of {len(runs.t['ready'])}, "
        f"all {listed(r.gbps['ready']['all'])}: ready states, no forward; {r.cpu_per_gb['ready']:.3f} CPU s/GB)"
    )
    print(
        "disk (fsync'd)  "
        + ", ".join(
            f"{k.removeprefix('disk_')} {r.gbps[k]['median']:.3f} GB/s (all {listed(r.gbps[k]['all'])}, "
            f"{r.cpu_per_gb[k]:.3f} CPU s/GB)"
            for k in ("disk_direct_parallel", "disk_buffered")
        )
        + f"  -> {r.disk_gbps:.3f} GB/s "
        f"(median over rounds of the better way; O_DIRECT {'works' if runs.direct_ok else 'refused here'})"
    )


def print_ratios(b: Bench, runs: Runs, r: Ratios) -> None:
    print(
        f"ratio null sink / bare forward:   {r.null_ratio:.3f}   "
        f"(goal >= 0.95: the capture's own overhead; {paired('null', runs)})"
    )
    print(f"ratio extraction / bare forward:  {r.extract_ratio:.3f}   ({paired('extract', runs)})")
    print(
        f"ratio store write GB/s / disk:    {r.store_to_disk:.3f}   (goal >= 0.8; "
        f"median of {listed(r.store_pairs)}, "
        f"each against the disk in the same round; best over best {r.store_to_disk_best:.3f}; "
        "the extraction "
        f"itself wrote {r.extract_gbps:.3f} GB/s = {r.extract_write_to_disk:.3f} of the disk)"
    )
    print(
        f"extraction {r.extract_paired:,.0f} tok/s (bare x its paired ratio) vs 0.9 x min(bare {r.bare:,.0f}, disk "
        f"{r.disk_gbps * 1e9 / r.bytes_per_token:,.0f}) = "
        f"{0.9 * r.limit:,.0f} tok/s: ratio to the limit {r.extract_to_limit:.3f}   (goal >= 0.9)"
    )
    print(
        f"bytes per token {r.bytes_per_token:,.1f} vs minimum {4 * b.hidden * 2:,} ((3 + 1) x H x 2): overhead "
        f"{runs.figures['overhead_pct']:.2f}%   (goal <= 2%), {runs.figures['shards']} shards"
    )


def write_json(path: str | None, out: dict) -> None:
    target = path or (str(Path(os.environ["OUT"]) / "extraction.json") if os.environ.get("OUT") else None)
    if target:
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        Path(target).write_text(json.dumps(out, indent=2) + "\n")
        print(f"figures written to {target}")


def main() -> None:
    a = parse_args()
    model, name, device, dtype = load_target(a)
    bench = prepare(a, model, name, device, dtype)
    print_setup(bench)
    warm_up(bench)
    runs = Runs(interleave=device.type == "cpu" and not a.whole_runs)
    done_rounds = run_rounds(bench, runs)
    r = ratios(bench, runs)
    out = figures_json(bench, runs, r, done_rounds)
    print_rates(runs, r)
    print_ratios(bench, runs, r)
    write_json(a.json, out)


if __name__ == "__main__":
    main()
