"""Hidden states from the target on a GPU host with SGLang's model runner (the `[sglang]` extra).

SGLang's HTTP server returns hidden states as JSON lists, far too slowly for training data, so,
like SpecForge's offline preparation, this runs SGLang's `ModelRunner` in-process: one process
per tensor-parallel rank (spawned here, NCCL between them), each loading its shard of the target.
Every batch goes to every rank; each runs the same batched prefill ("extend"); after the TP
all-reduces the hidden states are replicated, so only rank 0 copies them to the host and hands them
over, through a ring of shared host slabs the parent allocates once, before the ranks start
(`SlabRing`; /dev/shm files, sized from the per-forward bound). Rank 0 page-locks them
(cudaHostRegister), copies a batch's rows in with `non_blocking` on a side stream and goes on to the
next forward; a completion thread sends the parent only (slab, token count) once the copy's event has
completed. The parent lends the rows as views into the slab (`extract_batch`'s result, valid until the
next call), so the caller's copy into its shard image is the only copy on the host, and gives the slab
back. With no free slab rank 0 waits, and says so (`SlabWait`, counted in `handoff_figures`).

The capture happens inside SGLang: `enable_return_aux_hidden_states` with
`speculative_algorithm="EAGLE3"` is SGLang's capture-only mode (no draft is loaded). It calls the
model's `set_eagle3_layers_to_capture` (Kimi-K2.5's multimodal wrapper forwards it to its
DeepseekV3 language model) and makes the logits processor return the packed auxiliary layers as
`hidden_states` [T, 3H] and the post-norm final state as `last_hidden_states` [T, H]. Our layer ids
(outputs of 0-based decoder layers) are translated by `sglang_api.capture_argument`; every SGLang
name used here is listed, and checked, in `sglang_api.CONTRACT`. CUDA graphs, chunked prefill
and the radix cache are off: one extend per batch over whole sequences.

Each forward is bounded, as SGLang's own scheduler bounds a prefill: at most `max_forward_tokens`
tokens (each sequence counted in whole KV pages, as SGLang's paged allocator takes them) and at
most `max_forward_requests` sequences. SGLang's KV pool is sized to hold exactly one such forward
(`max_total_tokens`, `max_running_requests`, as SpecForge bounds its pool), so the memory
`mem_fraction_static` sets aside beyond it is left to the forward's activations.

sglang is imported only inside the rank processes. The parent checks, before spawning anything,
that sglang is installed (without importing it), that its sources still have every name we use,
and that there are enough CUDA devices; each failure says what to do.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import mmap
import os
import queue
import secrets
import shutil
import socket
import threading
import time
import traceback
import weakref
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, Self

import torch

from eagle3_resources.errors import HandoffMemoryError, KVPoolExhausted, RankError, SGLangUnavailable, SlabsHeld
from eagle3_resources.hidden_states import sglang_api
from eagle3_resources.hidden_states.layers import eagle3_aux_layers
from eagle3_resources.hidden_states.sglang_sizes import DEFAULT_HANDOFF_SLABS, DEFAULT_MAX_FORWARD_TOKENS

# Sequences in one forward (SGLang's max_running_requests): the request-to-token table is this
# many rows of context_length int32 (64 MB at 32K), and short samples still fill a forward.
DEFAULT_MAX_FORWARD_REQUESTS = 512
FORWARD_TOKENS_KNOB = "sglang_max_forward_tokens (EAGLE3_SGLANG_MAX_FORWARD_TOKENS)"
FORWARD_REQUESTS_KNOB = "sglang_max_forward_requests"
MEM_FRACTION_KNOB = "sglang_mem_fraction"


# ---------------------------------------------------------------- pure pieces


@dataclass(frozen=True)
class TextShape:
    num_layers: int
    hidden_size: int


def read_text_shape(model_path: str | Path) -> TextShape:
    """Decoder layers and hidden size from `config.json` (Kimi-K2.5 nests them in `text_config`)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    text = config.get("text_config") or config
    return TextShape(int(text["num_hidden_layers"]), int(text["hidden_size"]))


@dataclass(frozen=True)
class EngineSpec:
    """Everything a rank process needs to build its runner (picklable)."""

    model_path: str
    tp_size: int
    capture_argument: tuple[int, ...]  # what SGLang is handed (see sglang_api.capture_argument)
    capture_rule: sglang_api.CaptureRule  # the rule the argument was made for, re-checked in the rank
    nccl_port: int
    max_length: int = 32768
    mem_fraction_static: float = 0.8
    max_forward_tokens: int = DEFAULT_MAX_FORWARD_TOKENS  # also the KV pool's size (max_total_tokens)
    max_forward_requests: int = DEFAULT_MAX_FORWARD_REQUESTS  # SGLang's max_running_requests
    trust_remote_code: bool = True
    log_level: str = "warning"


def server_args_kwargs(spec: EngineSpec) -> dict[str, Any]:
    """The `ServerArgs` of every rank; each key is in `sglang_api.SERVER_ARGS_KWARGS`."""
    return {
        "model_path": spec.model_path,
        "tp_size": spec.tp_size,
        "trust_remote_code": spec.trust_remote_code,
        "context_length": spec.max_length,
        "mem_fraction_static": spec.mem_fraction_static,
        # The KV pool holds one forward (it is cleared after each): SGLang takes min(this, what
        # mem_fraction_static leaves after the weights), rounded down to whole pages.
        "max_total_tokens": spec.max_forward_tokens,
        "max_running_requests": spec.max_forward_requests,
        "chunked_prefill_size": -1,  # whole sequences in one extend
        "disable_cuda_graph": True,  # prefill and decode graphs off: eager extend with capture
        "disable_radix_cache": True,  # no prefix sharing between batches
        "enable_return_aux_hidden_states": True,  # capture-only EAGLE-3 mode, keeps last_hidden_states
        "speculative_algorithm": "EAGLE3",  # names the capture convention; SGLang resets it to None
        "return_aux_hidden_state_layer_ids": list(spec.capture_argument),
        "log_level": spec.log_level,
    }


def check_forward_bounds(max_length: int, max_forward_tokens: int, max_forward_requests: int) -> None:
    """Refuse bounds that cannot work, before any process starts: a sequence is never split."""
    if max_forward_requests < 1:
        raise ValueError(f"{FORWARD_REQUESTS_KNOB} must be at least 1, got {max_forward_requests}")
    if max_forward_tokens < max_length:
        raise ValueError(
            f"{FORWARD_TOKENS_KNOB} is {max_forward_tokens}, below max_length {max_length}: the SGLang "
            "backend runs each sample in one forward (no chunked prefill), so a forward must hold the "
            "longest; raise it or lower max_length"
        )


def page_rounded(n: int, page_size: int) -> int:
    """KV slots a fresh sequence of `n` tokens takes: SGLang's paged allocator gives each request whole pages."""
    return -(-n // page_size) * page_size


@dataclass(frozen=True)
class Limits:
    max_tokens: int  # tokens the KV pool holds (one batch must fit: no chunked prefill)
    max_requests: int  # rows of the request-to-token table
    max_length: int  # context length the runner was built for
    page_size: int = 1  # KV page size: each sequence takes whole pages
    max_forward_tokens: int | None = None  # bound on one forward's tokens (page-rounded); None: the pool only

    @property
    def forward_tokens(self) -> int:
        """Page-rounded tokens one forward may hold: the pool and the forward bound, in whole pages."""
        cap = self.max_tokens if self.max_forward_tokens is None else min(self.max_tokens, self.max_forward_tokens)
        return cap // self.page_size * self.page_size


def plan_sub_batches(lengths: list[int], limits: Limits) -> list[list[int]]:
    """Indices of `lengths` grouped, in order, into forwards that fit the runner's pools and the forward bound.

    Each sequence counts as its length rounded up to whole KV pages (what SGLang allocates for it).
    """
    budget = limits.forward_tokens
    groups: list[list[int]] = []
    tokens = 0
    for i, n in enumerate(lengths):
        if n <= 0:
            raise ValueError(f"sequence {i} is empty")
        need = page_rounded(n, limits.page_size)
        if n > limits.max_length or need > budget:
            raise ValueError(
                f"sequence {i} has {n} tokens ({need} in KV pages of {limits.page_size}); the SGLang "
                f"runner takes at most {min(limits.max_length, budget)} (max_length {limits.max_length}, "
                f"KV pool {limits.max_tokens}, max_forward_tokens {limits.max_forward_tokens})"
            )
        if not groups or tokens + need > budget or len(groups[-1]) >= limits.max_requests:
            groups.append([])
            tokens = 0
        groups[-1].append(i)
        tokens += need
    return groups


def kv_pool_message(lengths: list[int], *, page_size: int, pool_tokens: int, pool_requests: int) -> str:
    """What a user reads when SGLang cannot allocate a batch: the batch, the pool, and the knobs."""
    rounded = sum(page_rounded(n, page_size) for n in lengths)
    return (
        f"the SGLang KV pool is out of memory for a batch of {len(lengths)} sequences, {sum(lengths)} tokens "
        f"({rounded} in whole KV pages of {page_size}); the pool holds {pool_tokens} tokens and {pool_requests} "
        f"requests. Lower {FORWARD_TOKENS_KNOB} or {FORWARD_REQUESTS_KNOB} (a forward's size), or raise "
        f"{MEM_FRACTION_KNOB} if SGLang sized the pool below {FORWARD_TOKENS_KNOB}"
    )


def split_rows(flat: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    """A flat [sum L, D] output back into one [L, D] tensor per sequence, in order."""
    if flat.dim() != 2 or flat.shape[0] != sum(lengths):
        raise ValueError(f"expected [{sum(lengths)}, D] rows for lengths {lengths}, got {tuple(flat.shape)}")
    return list(torch.split(flat, lengths, dim=0))


# ---------------------------------------------------------------- the hand-off ring (rank 0 -> parent)

HANDOFF_SLABS_KNOB = "sglang_handoff_slabs"
SHM_DIR = Path("/dev/shm")


SLAB_ALIGN = 4096  # each region of a slab starts on a page: aligned DMA and bf16/int64 views


def _aligned(n: int) -> int:
    return -(-n // SLAB_ALIGN) * SLAB_ALIGN


@dataclass(frozen=True)
class SlabLayout:
    """One slab: rank 0's rows of one forward. The forward's token ids (int64, so the parent can check that
    the slab holds the batch it sent), then aux [tokens, aux_width] and final [tokens, final_width] in bf16,
    each region page-aligned."""

    tokens: int  # rows a slab holds: the backend's per-forward bound (max_forward_tokens)
    aux_width: int  # 3H
    final_width: int  # H

    @property
    def aux_offset(self) -> int:
        return _aligned(self.tokens * 8)

    @property
    def final_offset(self) -> int:
        return _aligned(self.aux_offset + self.tokens * self.aux_width * 2)

    @property
    def nbytes(self) -> int:
        return _aligned(self.final_offset + self.tokens * self.final_width * 2)

    def views(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(aux, final, ids) over a uint8 slab of `nbytes`."""
        a, f, t = self.aux_offset, self.final_offset, self.tokens
        return (
            buf[a : a + t * self.aux_width * 2].view(torch.bfloat16).view(t, self.aux_width),
            buf[f : f + t * self.final_width * 2].view(torch.bfloat16).view(t, self.final_width),
            buf[: t * 8].view(torch.int64),
        )


def _map_file(path: str, nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return mm, torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)


class SlabRing:
    """`count` slabs of shared host memory, created once by the parent before the ranks start.

    Each is a file in /dev/shm, its whole size reserved with posix_fallocate (a /dev/shm too small for
    them is refused here, with the figures, instead of a SIGBUS on first touch). The parent maps them,
    rank 0 maps them by name; once every rank is up the names are unlinked (`unlink`), so nothing is
    left in /dev/shm whatever happens afterwards, and the memory goes with the last mapping.
    """

    def __init__(self, count: int, layout: SlabLayout, *, directory: Path = SHM_DIR):
        if count < 1:
            raise ValueError(f"{HANDOFF_SLABS_KNOB} must be at least 1, got {count}")
        if layout.tokens < 1 or layout.aux_width < 1 or layout.final_width < 1:
            raise ValueError(f"empty slab layout {layout}")
        self.count, self.layout = count, layout
        tag = f"eagle3-handoff-{os.getpid()}-{secrets.token_hex(4)}"
        self.paths = [str(Path(directory) / f"{tag}-{i}") for i in range(count)]
        self._maps: list[mmap.mmap] = []
        self.slabs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        try:
            for path in self.paths:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.posix_fallocate(fd, 0, layout.nbytes)
                except OSError as e:
                    free = shutil.disk_usage(directory).free
                    raise HandoffMemoryError(
                        f"{directory} cannot hold the SGLang hand-off: {count} slabs of {layout.nbytes / 1e9:.2f} GB "
                        f"({layout.tokens} tokens x ({layout.aux_width} + {layout.final_width}) x 2 B + ids) need "
                        f"{count * layout.nbytes / 1e9:.2f} GB, {free / 1e9:.2f} GB free ({e.strerror}). Give the "
                        f"host a larger /dev/shm (docker --shm-size), or lower {HANDOFF_SLABS_KNOB} or "
                        f"{FORWARD_TOKENS_KNOB}"
                    ) from None
                finally:
                    os.close(fd)
                mm, buf = _map_file(path, layout.nbytes)
                self._maps.append(mm)
                self.slabs.append(layout.views(buf))
        except BaseException:
            self.close()
            raise

    def unlink(self) -> None:
        for path in self.paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def close(self) -> None:
        """Unlink the names and drop the parent's references to the mappings.

        Never mmap.close(): torch.frombuffer holds a reference to the mmap, not a buffer export, so closing
        it would unmap memory that rows still lent out point into. Each mapping goes with its last tensor.
        """
        self.unlink()
        self.slabs = []
        self._maps = []


# ---------------------------------------------------------------- rank protocol


@dataclass
class Ready:
    rank: int
    info: dict[str, Any]


@dataclass(frozen=True)
class Handoff:
    """Where rank 0 left a batch's rows: a few numbers, never the rows themselves."""

    slab: int
    tokens: int
    slab_waits: int = 0  # times rank 0 has found no free slab so far (cumulative)
    slab_wait_s: float = 0.0  # and the seconds it waited for one (cumulative)


@dataclass
class Done:
    rank: int
    batch_id: int
    handoff: Handoff | None = None  # rank 0 only, sent once its rows have landed in the slab


@dataclass
class SlabWait:
    """Rank 0 found no free slab for `batch_id` and waits for the parent to release one."""

    rank: int
    batch_id: int


@dataclass
class Failed:
    rank: int
    batch_id: int | None  # None: while starting
    error: str


@dataclass
class ReplyGather:
    """Collects one batch's replies: every rank must finish it, rank 0 says where its rows are."""

    world_size: int
    batch_id: int
    done: set[int] = field(default_factory=set)
    result: Done | None = None

    def add(self, reply: Ready | Done | Failed) -> bool:
        """True once all ranks are done; raises RankError on a failure."""
        if isinstance(reply, Failed):
            when = "while starting" if reply.batch_id is None else f"on batch {reply.batch_id}"
            raise RankError(f"rank {reply.rank} failed {when}:\n{reply.error}")
        if not isinstance(reply, Done) or reply.batch_id != self.batch_id:
            raise RankError(f"unexpected reply while waiting for batch {self.batch_id}: {reply!r}")
        if reply.rank == 0:
            if reply.handoff is None:
                raise RankError("rank 0 finished the batch without hidden states")
            self.result = reply
        self.done.add(reply.rank)
        return len(self.done) == self.world_size


class RankEngine(Protocol):
    def info(self) -> dict[str, Any]: ...

    def capture(self, sequences: list[list[int]]) -> tuple[torch.Tensor | None, torch.Tensor | None]: ...


class _Stop(Exception):
    """The parent is shutting down (a None on the free-slab queue)."""


class RankZeroHandoff:
    """Rank 0's side of the ring: copies each batch's rows into a free slab and tells the parent which.

    On CUDA the slabs are page-locked here (cudaHostRegister on the mapping: no copy, no second buffer),
    the copies run `non_blocking` on a side stream after the forward, and a completion thread waits for
    each batch's event, in order, before replying: the rank goes on to the next forward meanwhile. On a
    CPU the same protocol runs with plain copies. With no free slab (the parent is behind) rank 0 says so
    (`SlabWait`) and waits: that wait is counted and reported with every hand-off.
    """

    def __init__(self, paths: list[str], layout: SlabLayout, free, replies):
        self.layout, self.free, self.replies = layout, free, replies
        self._maps, self.slabs, self._bufs = [], [], []
        for path in paths:
            mm, buf = _map_file(path, layout.nbytes)
            self._maps.append(mm)
            self._bufs.append(buf)
            self.slabs.append(layout.views(buf))
        self.pinned = False
        self.waits, self.wait_s = 0, 0.0
        self._stream: torch.cuda.Stream | None = None
        self._pending: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._complete, name="handoff-completion", daemon=True)
        self._thread.start()

    def pin(self) -> None:
        """Page-lock every slab for CUDA (in this process's address space) so D2H copies run at DMA speed."""
        cudart = torch.cuda.cudart()
        for i, buf in enumerate(self._bufs):
            err = cudart.cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
            if int(getattr(err, "value", err)) != 0:
                raise RuntimeError(
                    f"cudaHostRegister of hand-off slab {i} ({buf.numel() / 1e9:.2f} GB) failed: "
                    f"{cudart.cudaGetErrorString(err)}"
                )
            self.pinned = True
            if not buf.is_pinned():
                raise RuntimeError(f"hand-off slab {i} is registered with CUDA but torch does not see it page-locked")

    def _take(self, batch_id: int) -> int:
        try:
            index = self.free.get_nowait()
        except queue.Empty:
            self.replies.put(SlabWait(0, batch_id))
            started = time.monotonic()
            index = self.free.get()
            self.waits += 1
            self.wait_s += time.monotonic() - started
        if index is None:
            raise _Stop
        return index

    def hand_off(self, batch_id: int, sequences: list[list[int]], aux: torch.Tensor, final: torch.Tensor) -> None:
        tokens = sum(len(s) for s in sequences)
        layout = self.layout
        if aux.dim() != 2 or final.dim() != 2 or aux.shape[0] != tokens or final.shape[0] != tokens:
            raise RuntimeError(
                f"the engine returned aux {tuple(aux.shape)} / final {tuple(final.shape)} for {tokens} tokens"
            )
        if tokens > layout.tokens or aux.shape[1] != layout.aux_width or final.shape[1] != layout.final_width:
            raise RuntimeError(
                f"aux {tuple(aux.shape)} / final {tuple(final.shape)} do not fit a hand-off slab of "
                f"{layout.tokens} x ({layout.aux_width} + {layout.final_width})"
            )
        index = self._take(batch_id)
        slab_aux, slab_final, slab_ids = self.slabs[index]
        slab_ids[:tokens].copy_(torch.tensor([t for s in sequences for t in s], dtype=torch.int64))
        event = keep = None
        if aux.is_cuda:
            if not self.pinned:
                raise RuntimeError("rank 0's states are on CUDA but the hand-off slabs are not page-locked")
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=aux.device)
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream(aux.device))  # after the forward, not before
            with torch.cuda.stream(stream):
                slab_aux[:tokens].copy_(aux, non_blocking=True)
                slab_final[:tokens].copy_(final, non_blocking=True)
                event = torch.cuda.Event(blocking=True)  # the completion thread sleeps on it, not spinning a core
                event.record(stream)
            keep = (aux, final)  # freed by the completion thread once the copy has landed
        else:
            slab_aux[:tokens].copy_(aux)
            slab_final[:tokens].copy_(final)
        self._pending.put((batch_id, Handoff(index, tokens, self.waits, round(self.wait_s, 6)), event, keep))

    def _complete(self) -> None:
        while True:
            item = self._pending.get()
            if item is None:
                return
            batch_id, handoff, event, keep = item
            try:
                if event is not None:
                    event.synchronize()
                self.replies.put(Done(0, batch_id, handoff))
            except BaseException:  # noqa: BLE001 - reported to the parent, which stops every rank
                self.replies.put(Failed(0, batch_id, traceback.format_exc()))
            del keep, item

    def close(self) -> None:
        self._pending.put(None)
        self._thread.join()
        if self.pinned:
            cudart = torch.cuda.cudart()
            for buf in self._bufs:
                cudart.cudaHostUnregister(buf.data_ptr())


def _rank_main(
    rank: int,
    world_size: int,
    factory: Callable[[int, int], RankEngine],
    requests,
    replies,
    slab_paths: list[str],
    layout: SlabLayout,
    free,
) -> None:
    """A rank process: build the engine, then run every batch until told to stop (None).

    Its eight arguments are what a spawned process is handed: the rank, the engine, its queues and the ring."""
    handoff = None
    try:
        if rank == 0:
            handoff = RankZeroHandoff(slab_paths, layout, free, replies)  # mapped before Ready: then they are unlinked
        engine = factory(rank, world_size)
        info = engine.info()
        if handoff is not None:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                handoff.pin()
            info = {**info, "handoff_pinned": handoff.pinned}
        replies.put(Ready(rank, info))
    except BaseException:  # noqa: BLE001 - reported to the parent, which stops every rank
        replies.put(Failed(rank, None, traceback.format_exc()))
        if handoff is not None:
            handoff.close()
        return
    try:
        _serve(rank, engine, requests, replies, handoff)
    finally:
        if handoff is not None:
            handoff.close()


def _serve(rank: int, engine: RankEngine, requests, replies, handoff: RankZeroHandoff | None) -> None:
    """A started rank's loop: each batch captured, then handed off (rank 0) or acknowledged, until a None."""
    while True:
        message = requests.get()
        if message is None:
            return
        batch_id, sequences = message
        try:
            aux, final = engine.capture(sequences)
            if handoff is not None:
                assert aux is not None and final is not None  # rank 0's capture returns its states or raises
                handoff.hand_off(batch_id, sequences, aux, final)  # replies once the rows have landed
            else:
                replies.put(Done(rank, batch_id))
            del aux, final  # on CUDA the completion thread holds them until the copy has landed, no longer
        except _Stop:
            return
        except BaseException:  # noqa: BLE001 - reported to the parent, which stops every rank
            replies.put(Failed(rank, batch_id, traceback.format_exc()))


def _stop(processes: list, requests: list, free, ring: SlabRing, grace_s: float) -> None:
    try:
        processes = [p for p in processes if p.pid is not None]  # started ones only
        for q in [*requests, free]:  # None on the free-slab queue wakes a rank 0 waiting for a slab
            try:
                q.put(None)
            except (ValueError, OSError):  # queue already closed
                pass
        deadline = time.monotonic() + grace_s
        for p in processes:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in processes:
            if p.is_alive():
                p.terminate()
                p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    finally:
        ring.close()


@dataclass
class Rows:
    """One batch's rows, lent from a slab of the ring until `release()`."""

    batch_id: int
    aux: torch.Tensor  # [tokens, aux_width] bf16, a view into the slab
    final: torch.Tensor  # [tokens, final_width] bf16, a view into the slab
    slab: int
    _release: Callable[[int], None] | None = field(default=None, repr=False)

    def release(self) -> None:
        """Give the slab back to rank 0; the views must not be read afterwards. Idempotent."""
        release, self._release = self._release, None
        if release is not None:
            release(self.slab)


class RankPool:
    """`world_size` spawned processes, each running `factory(rank, world_size)`; batches go to all.

    Rank 0 hands each batch's rows over through a ring of `slabs` shared host slabs of `handoff` layout,
    allocated here before any rank starts; the reply queue carries only small messages.
    """

    def __init__(
        self,
        world_size: int,
        factory: Callable[[int, int], RankEngine],
        *,
        handoff: SlabLayout,
        slabs: int = DEFAULT_HANDOFF_SLABS,
        start_timeout_s: float = 3600.0,
        batch_timeout_s: float = 1800.0,
        stop_grace_s: float = 60.0,
        shm_dir: Path = SHM_DIR,
    ):
        import torch.multiprocessing as mp

        self.world_size = world_size
        self.start_timeout_s = start_timeout_s
        self.batch_timeout_s = batch_timeout_s
        self.ring = SlabRing(slabs, handoff, directory=shm_dir)
        ctx = mp.get_context("spawn")
        self._requests = [ctx.Queue() for _ in range(world_size)]
        self._replies = ctx.Queue()
        self._free = ctx.Queue()  # slab indices rank 0 may fill
        for i in range(slabs):
            self._free.put(i)
        self._processes = [self._rank_process(ctx, rank, factory) for rank in range(world_size)]
        self._next_batch = 0
        self._next_result = 0
        self._gathers: dict[int, ReplyGather] = {}
        self._sizes: dict[int, list[int]] = {}  # batch id -> the token ids sent (checked against the slab)
        self._waiting: set[int] = set()  # batches rank 0 waits on a free slab for
        self._held: set[int] = set()  # slabs lent to the caller
        self._broken: str | None = None
        self.infos: list[dict[str, Any]] = []
        self.stats = {"batches": 0, "bytes": 0, "slab_waits": 0, "rank0_slab_wait_s": 0.0}
        self._finalizer = weakref.finalize(
            self, _stop, self._processes, self._requests, self._free, self.ring, stop_grace_s
        )

    def _rank_process(self, ctx: Any, rank: int, factory: Callable[[int, int], RankEngine]) -> Any:
        """Rank `rank`'s process (not started): its request queue, the shared reply queue and the ring."""
        ring = self.ring
        args = (
            rank,
            self.world_size,
            factory,
            self._requests[rank],
            self._replies,
            ring.paths,
            ring.layout,
            self._free,
        )
        return ctx.Process(target=_rank_main, name=f"sglang-rank-{rank}", args=args)

    def _get(self, deadline: float, what: str):
        while True:
            try:
                return self._replies.get(timeout=1.0)
            except queue.Empty:
                dead = [(p.name, p.exitcode) for p in self._processes if p.exitcode is not None]
                if dead:
                    raise RankError(f"rank process(es) exited {what}: {dead}") from None
                if time.monotonic() > deadline:
                    raise RankError(f"timed out {what}") from None

    def start(self) -> list[dict[str, Any]]:
        for p in self._processes:
            p.start()
        infos: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while len(infos) < self.world_size:
                reply = self._get(deadline, "while starting")
                if isinstance(reply, Failed):
                    raise RankError(f"rank {reply.rank} failed while starting:\n{reply.error}")
                infos[reply.rank] = reply.info
        except BaseException:
            self.close()
            raise
        self.ring.unlink()  # rank 0 has mapped the slabs: no name is left in /dev/shm from here on
        self.infos = [infos[r] for r in range(self.world_size)]
        return self.infos

    def _check_usable(self) -> None:
        if self._broken:
            raise RankError(f"the rank processes are unusable after an earlier failure: {self._broken}")

    def submit(self, sequences: list[list[int]]) -> int:
        """Send one batch to every rank; its id, for `result`. Batches run, and are collected, in order."""
        self._check_usable()
        tokens = sum(len(s) for s in sequences)
        if tokens > self.ring.layout.tokens:
            raise ValueError(f"a batch of {tokens} tokens does not fit a hand-off slab of {self.ring.layout.tokens}")
        batch_id = self._next_batch
        self._next_batch += 1
        self._gathers[batch_id] = ReplyGather(self.world_size, batch_id)
        self._sizes[batch_id] = [t for s in sequences for t in s]
        for q in self._requests:
            q.put((batch_id, sequences))
        return batch_id

    def _release(self, slab: int) -> None:
        self._held.discard(slab)
        if not self._broken:
            self._free.put(slab)

    def result(self, batch_id: int) -> Rows:
        """The next submitted batch's rows, lent from its slab: call `Rows.release()` once they are read.

        Raises SlabsHeld (the batch stays pending) when rank 0 needs a slab and the caller holds them all.
        """
        self._check_usable()
        if batch_id != self._next_result:
            raise ValueError(f"batches are collected in order: batch {self._next_result} comes before {batch_id}")
        gather = self._gathers[batch_id]
        deadline = time.monotonic() + self.batch_timeout_s
        try:
            while len(gather.done) < self.world_size:
                if batch_id in self._waiting and len(self._held) == self.ring.count:
                    raise SlabsHeld(
                        f"rank 0 waits for a free hand-off slab for batch {batch_id} and the caller holds "
                        f"all {self.ring.count}: release some rows first"
                    )
                reply = self._get(deadline, f"on batch {batch_id}")
                if isinstance(reply, SlabWait):
                    self._waiting.add(reply.batch_id)
                    self.stats["slab_waits"] += 1
                elif isinstance(reply, Done) and reply.batch_id in self._gathers:
                    self._gathers[reply.batch_id].add(reply)
                else:
                    gather.add(reply)  # a failure (raised with its traceback) or a reply that fits no batch
        except SlabsHeld:
            raise
        except BaseException as e:
            # A rank that failed mid-batch leaves its peers inside a collective: stop them all.
            self._broken = str(e).splitlines()[0]
            self.close()
            raise
        del self._gathers[batch_id]
        self._next_result += 1
        self._waiting.discard(batch_id)
        done = gather.result
        assert done is not None and done.handoff is not None  # ReplyGather.add refuses rank 0 without a hand-off
        handoff = done.handoff
        ids = self._sizes.pop(batch_id)
        aux, final, slab_ids = self.ring.slabs[handoff.slab]
        if handoff.tokens != len(ids) or not torch.equal(slab_ids[: len(ids)], torch.tensor(ids, dtype=torch.int64)):
            self._broken = f"hand-off slab {handoff.slab} does not hold batch {batch_id}"
            self.close()
            raise RankError(f"{self._broken} ({handoff.tokens} rows for {len(ids)} tokens sent)")
        self._held.add(handoff.slab)
        self.stats["batches"] += 1
        self.stats["bytes"] += handoff.tokens * (aux.shape[1] + final.shape[1]) * 2
        self.stats["rank0_slab_wait_s"] = handoff.slab_wait_s
        return Rows(batch_id, aux[: handoff.tokens], final[: handoff.tokens], handoff.slab, self._release)

    def run(self, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch on every rank; rank 0's flat (aux, final), copied out of the slab (the caller keeps them)."""
        rows = self.result(self.submit(sequences))
        try:
            return rows.aux.clone(), rows.final.clone()
        finally:
            rows.release()

    def close(self) -> None:
        self._finalizer()

    @property
    def alive(self) -> bool:
        return any(p.is_alive() for p in self._processes)


# ---------------------------------------------------------------- the SGLang engine (rank side)


class _NoSharingCache:
    """The tree cache `ScheduleBatch` is given: allocation only, no prefix sharing.

    It has every BasePrefixCache member that SGLang's extend path (`ScheduleBatch.init_new`,
    `prepare_for_extend` and the allocation functions they call) reaches for a cache whose
    `supports_*` answer False, as tests/test_sglang_backend_limits.py reads it from the release:
    the out-of-memory report included, so a full pool says so instead of raising AttributeError.
    """

    def __init__(self, runner):
        self.page_size = runner.page_size
        self.device = runner.device
        self.token_to_kv_pool_allocator = runner.token_to_kv_pool_allocator

    def supports_swa(self) -> bool:
        return False

    def supports_mamba(self) -> bool:
        return False

    def supports_prefix_sharing(self) -> bool:
        return False

    def evict(self, params) -> None:
        return None

    def maybe_hand_to_session(self, req) -> None:
        return None

    def evictable_size(self) -> int:
        return 0  # nothing is cached, so nothing can be evicted

    def available_and_evictable_str(self) -> str:
        """SGLang's out-of-memory report (BasePrefixCache's wording)."""
        available_size, evictable_size = self.token_to_kv_pool_allocator.available_size(), self.evictable_size()
        return f"Available tokens: {available_size + evictable_size} ({available_size=} + {evictable_size=})\n"

    def pretty_print(self) -> None:
        """SGLang logs the tree after an out-of-memory report: this cache has none."""
        return None

    def prefix_device_indices(self, req) -> torch.Tensor:
        """KV indices of a request's cached prefix: always empty, nothing is shared."""
        if req.prefix_len:
            raise RuntimeError(
                f"request {req.rid} has a cached prefix of {req.prefix_len} tokens in a cache that shares none"
            )
        return torch.empty((0,), dtype=torch.int64, device=self.device)

    def rotation_base_of(self, node) -> None:
        return None  # no tree, so no KV-shard rotation base (BasePrefixCache's "none here")


class SGLangRankEngine:
    """One TP rank: its ModelRunner, and one extend pass with full capture per batch."""

    def __init__(self, spec: EngineSpec, rank: int):
        # First, before sglang is imported: resolving ServerArgs (and importing SGLang's kernels) asks
        # torch.cuda about the *current* device; without this every rank would first touch GPU 0.
        torch.cuda.set_device(rank)
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.distributed import bootstrap
        from sglang.srt.entrypoints.engine import _set_envs_and_config
        from sglang.srt.layers.moe import initialize_moe_config
        from sglang.srt.layers.quantization.fp4_utils import initialize_fp4_gemm_config
        from sglang.srt.layers.quantization.fp8_utils import initialize_fp8_gemm_config
        from sglang.srt.layers.quantization.unquant import initialize_bf16_gemm_config
        from sglang.srt.model_executor.model_runner import ModelRunner
        from sglang.srt.runtime_context import (
            SpawnRanks,
            get_device,
            get_model,
            publish,
            spawn_world_rank,
        )
        from sglang.srt.server_args import ServerArgs
        from sglang.srt.utils import require_mlp_sync

        self.rank = rank
        server_args = ServerArgs(**server_args_kwargs(spec))
        server_args.resolve_once()
        _set_envs_and_config(server_args)
        publish(
            server_args,
            role="scheduler",
            ranks=SpawnRanks(world_rank=spawn_world_rank(server_args, tp_rank=rank, pp_rank=0), gpu_id=rank),
        )
        initialize_moe_config()
        initialize_fp8_gemm_config()
        initialize_bf16_gemm_config()
        initialize_fp4_gemm_config()
        model_config = ModelConfig.from_server_args(server_args)
        bootstrap.init_parallel_runtime(server_args=server_args, device=get_device().device, dist_port=spec.nccl_port)
        bootstrap.init_layer_runtime(model_config=model_config)
        runner = ModelRunner(
            model_config=model_config,
            mem_fraction_static=spec.mem_fraction_static,
            gpu_id=rank,
            nccl_port=spec.nccl_port,
            server_args=server_args,
        )
        overlap = bool(get_model().is_startup_weight_load_overlap)
        if overlap:
            runner.start_startup_weight_load()
        runner.alloc_memory_pool()
        runner.init_attention_backends()  # calls model.set_eagle3_layers_to_capture(capture_argument)
        runner.init_cuda_graphs()  # none are captured: disable_cuda_graph
        if overlap:
            runner.finalize_startup_weight_load()
        if require_mlp_sync():
            raise SGLangUnavailable(
                "this SGLang configuration needs MLP sync (DP attention); the backend does not do it"
            )
        rule = sglang_api.capture_rule_of_import()  # the model code is imported by now
        if rule is not spec.capture_rule:
            raise SGLangUnavailable(
                f"the imported SGLang reads capture ids as '{rule and rule.value}', "
                f"the parent planned for '{spec.capture_rule.value}'"
            )
        self.runner = runner
        self.model_class = type(runner.model).__name__

    def info(self) -> dict[str, Any]:
        r = self.runner
        return {
            "rank": self.rank,
            "model_class": self.model_class,
            "max_total_num_tokens": int(r.max_total_num_tokens),
            "max_requests": int(r.req_to_token_pool.size),
            "page_size": int(r.page_size),
            "device": str(r.device),
        }

    @torch.inference_mode()
    def capture(self, sequences: list[list[int]]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One extend over `sequences` with full capture; rank 0 gets (aux, final) on the GPU, the others (None, None).
        The KV pool is cleared afterwards, whatever happened: the next batch starts from an empty pool."""
        from sglang.srt.model_executor.forward_batch_info import (
            CaptureHiddenMode,
            ForwardBatch,
        )

        runner = self.runner
        try:
            batch = self._extend_batch(sequences)
            forward_batch = ForwardBatch.init_new(
                batch, runner, capture_hidden_mode=CaptureHiddenMode.FULL, return_hidden_states_before_norm=False
            )
            out = runner.forward(forward_batch).logits_output
            if self.rank != 0:
                torch.cuda.synchronize()
                return None, None
            aux, final = out.hidden_states, out.last_hidden_states
            if aux is None or final is None:
                raise RuntimeError("SGLang returned no aux/last hidden states: is the capture-only mode on?")
            return aux, final  # on the GPU: rank 0's RankZeroHandoff copies them once, into a page-locked slab
        finally:
            runner.req_to_token_pool.clear()
            runner.token_to_kv_pool_allocator.clear()

    def _requests(self, sequences: list[list[int]]) -> list[Any]:
        """One SGLang request per sequence, whole (no chunking, no logprobs), asking for hidden states."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        params = SamplingParams(temperature=0, max_new_tokens=1)
        reqs = []
        for i, ids in enumerate(sequences):
            req = Req(
                rid=str(i),
                origin_input_text="",
                origin_input_ids=array("q", ids),
                sampling_params=params,
                return_hidden_states=True,
            )
            req.full_untruncated_fill_ids = req.origin_input_ids
            req.extend_end = len(ids)
            req.logprob_start_len = -1
            reqs.append(req)
        return reqs

    def _extend_batch(self, sequences: list[list[int]]) -> Any:
        """The requests scheduled as one extend, their KV slots allocated (KVPoolExhausted when they do not fit)."""
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        runner = self.runner
        batch = ScheduleBatch.init_new(
            reqs=self._requests(sequences),
            req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
            tree_cache=_NoSharingCache(runner),
            model_config=runner.model_config,
            enable_overlap=False,
            spec_algorithm=SpeculativeAlgorithm.NONE,
        )
        try:
            batch.prepare_for_extend()  # allocates the KV slots
        except RuntimeError as e:  # SGLang's "Prefill out of memory" / "alloc_req_slots runs out of memory"
            if "out of memory" not in str(e).lower():
                raise
            raise KVPoolExhausted(
                kv_pool_message(
                    [len(s) for s in sequences],
                    page_size=int(runner.page_size),
                    pool_tokens=int(runner.max_total_num_tokens),
                    pool_requests=int(runner.req_to_token_pool.size),
                )
            ) from e
        if batch.input_ids is None and getattr(batch, "prefill_input_ids_cpu", None) is not None:
            batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device, non_blocking=True)
            batch.prefill_input_ids_cpu = None
        return batch


def build_sglang_engine(spec: EngineSpec, rank: int, world_size: int) -> SGLangRankEngine:
    """The rank-process factory (top level, so a spawned process can unpickle it)."""
    if world_size != spec.tp_size:
        raise ValueError(f"{world_size} ranks for tp_size {spec.tp_size}")
    return SGLangRankEngine(spec, rank)


# ---------------------------------------------------------------- the backend (parent side)


def limits_of(infos: list[dict[str, Any]], *, max_length: int, max_forward_tokens: int) -> Limits:
    """The planner's limits from every rank's pools; refused when the longest sample cannot fit one forward."""
    pages = {int(i["page_size"]) for i in infos}
    if len(pages) != 1:
        raise RankError(f"the ranks report different KV page sizes {sorted(pages)}")
    limits = Limits(
        max_tokens=min(int(i["max_total_num_tokens"]) for i in infos),
        max_requests=min(int(i["max_requests"]) for i in infos),
        max_length=max_length,
        page_size=pages.pop(),
        max_forward_tokens=max_forward_tokens,
    )
    if page_rounded(max_length, limits.page_size) > limits.forward_tokens:
        raise SGLangUnavailable(
            f"a forward holds {limits.forward_tokens} tokens (KV pool {limits.max_tokens}, {FORWARD_TOKENS_KNOB} "
            f"{max_forward_tokens}, pages of {limits.page_size}), fewer than a max_length sample takes "
            f"({page_rounded(max_length, limits.page_size)}): raise {MEM_FRACTION_KNOB} or {FORWARD_TOKENS_KNOB}, "
            "or lower max_length"
        )
    return limits


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def preflight(tp_size: int) -> None:
    """Raise SGLangUnavailable, saying what to do, unless this host can run `tp_size` ranks."""
    if importlib.util.find_spec("sglang") is None:
        raise SGLangUnavailable(f"sglang is not installed: {sglang_api.INSTALL_HINT}")
    if not torch.cuda.is_available():
        raise SGLangUnavailable(
            f"no CUDA device (torch {torch.__version__}, CUDA build: {torch.version.cuda}); "
            "the SGLang backend needs a GPU host with a CUDA build of torch"
        )
    if torch.cuda.device_count() < tp_size:
        raise SGLangUnavailable(
            f"tp_size={tp_size} needs {tp_size} GPUs; {torch.cuda.device_count()} visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
        )
    problems = sglang_api.check_contract()
    if problems:
        raise SGLangUnavailable(
            f"the installed sglang {sglang_api.installed_version()} lacks names this backend "
            f"uses (written for {sglang_api.SGLANG_REQUIREMENT}):\n  " + "\n  ".join(problems)
        )


class LentExtraction:
    """`extract_batch` over a started RankPool: sub-batches planned to the forward bound, all submitted at
    once (rank 0 fills one slab while the parent reads another), each sequence's rows lent as views into
    its slab until the next call (or `release`).

    A call whose plan needs more slabs at once than the ring has copies its oldest sub-batch out of its
    slab to free one (counted in `copied_out`); with extract_to_store's batches, one forward each, that
    does not happen.
    """

    def __init__(self, pool: RankPool, limits: Limits):
        self.pool, self.limits = pool, limits
        self._lent: list[Rows] = []
        self.copied_out = 0

    def release(self) -> None:
        """Give back every slab the last call lent; its rows must not be read afterwards."""
        lent, self._lent = self._lent, []
        for rows in lent:
            rows.release()

    def extract_batch(self, sequences: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        self.release()
        lengths = [len(s) for s in sequences]
        groups = plan_sub_batches(lengths, self.limits)
        batch_ids = [self.pool.submit([list(sequences[i]) for i in group]) for group in groups]
        results: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # sequence index -> its rows
        held: list[tuple[Rows, list[int]]] = []
        for group, batch_id in zip(groups, batch_ids, strict=True):  # one batch id per group
            while True:
                try:
                    rows = self.pool.result(batch_id)
                    break
                except SlabsHeld:
                    if not held:
                        raise
                    oldest, members = held.pop(0)
                    for i in members:
                        results[i] = (results[i][0].clone(), results[i][1].clone())
                    oldest.release()
                    self.copied_out += 1
            group_lengths = [lengths[i] for i in group]
            aux, final = split_rows(rows.aux, group_lengths), split_rows(rows.final, group_lengths)
            for i, a, f in zip(group, aux, final, strict=True):  # split_rows gives one tensor per length
                results[i] = (a, f)
            held.append((rows, group))
        self._lent = [rows for rows, _ in held]
        return [results[i] for i in range(len(sequences))]  # the groups cover every index

    def figures(self) -> dict[str, Any]:
        """The hand-off so far: batches and bytes through the slabs, rank 0's waits for a free one."""
        ring = self.pool.ring
        return {
            **self.pool.stats,
            "slabs": ring.count,
            "slab_bytes": ring.layout.nbytes,
            "copied_out": self.copied_out,
            "pinned": bool(self.pool.infos and self.pool.infos[0].get("handoff_pinned")),
        }


@dataclass(frozen=True)
class SGLangOptions:
    """How the SGLang backend runs: its ranks, the layers, the forward bounds, the hand-off ring, the timeouts."""

    tp_size: int = 8
    layer_ids: Sequence[int] | None = None  # outputs of 0-based decoder layers; None: eagle3_aux_layers
    max_length: int = 32768
    mem_fraction_static: float = 0.8
    max_forward_tokens: int = DEFAULT_MAX_FORWARD_TOKENS
    max_forward_requests: int = DEFAULT_MAX_FORWARD_REQUESTS
    trust_remote_code: bool = True
    start_timeout_s: float = 3600.0
    batch_timeout_s: float = 1800.0
    log_level: str = "warning"
    handoff_slabs: int = DEFAULT_HANDOFF_SLABS


class SGLangHiddenStates:
    """Aux [L, 3H] (layers low -> high) and final [L, H] hidden states, bf16 on the CPU, per sequence.

    `extract_batch`'s tensors are views into the hand-off slabs, valid until the next call to
    `extract_batch`/`extract` (clone what must live longer); `handoff_slabs` sets the ring's size.
    Built in three steps: the checks before any process (bounds, host, SGLang's sources), the capture
    argument for this SGLang, then the ranks started and their pools read (`limits_of`).
    """

    name = "sglang"

    def __init__(self, model_path: str, options: SGLangOptions | None = None, **fields: Any):
        """`options`, or its fields by name (`tp_size=8, max_length=8192`), which replace those of `options`."""
        o = self.options = SGLangOptions(**fields) if options is None else replace(options, **fields)
        check_forward_bounds(o.max_length, o.max_forward_tokens, o.max_forward_requests)
        preflight(o.tp_size)
        shape = read_text_shape(model_path)
        self.model_path = str(model_path)
        self.tp_size = o.tp_size
        self.num_layers, self.hidden_size = shape.num_layers, shape.hidden_size
        self.layer_ids = list(o.layer_ids) if o.layer_ids is not None else eagle3_aux_layers(self.num_layers)
        rule = sglang_api.capture_rule()
        if rule is None:
            raise SGLangUnavailable(
                f"cannot tell how this sglang reads EAGLE-3 layer ids ({'.'.join(sglang_api.CAPTURE_SETTER)} changed)"
            )
        self.capture_rule = rule
        self.capture_argument = sglang_api.capture_argument(self.layer_ids, self.num_layers, rule)
        self._pool = self._rank_pool()
        infos = self._pool.start()
        self.rank_info = infos[0]
        try:
            self.limits = limits_of(infos, max_length=o.max_length, max_forward_tokens=o.max_forward_tokens)
        except BaseException:
            self._pool.close()
            raise
        self._extraction = LentExtraction(self._pool, self.limits)

    def _engine_spec(self) -> EngineSpec:
        """What every rank builds its runner from."""
        o = self.options
        return EngineSpec(
            model_path=self.model_path,
            tp_size=o.tp_size,
            capture_argument=tuple(self.capture_argument),
            capture_rule=self.capture_rule,
            nccl_port=free_port(),
            max_length=o.max_length,
            mem_fraction_static=o.mem_fraction_static,
            max_forward_tokens=o.max_forward_tokens,
            max_forward_requests=o.max_forward_requests,
            trust_remote_code=o.trust_remote_code,
            log_level=o.log_level,
        )

    def _rank_pool(self) -> RankPool:
        """The rank processes (not started yet) and their ring: one slab holds one forward, max_forward_tokens rows
        of the packed aux layers and the final state."""
        o = self.options
        layout = SlabLayout(o.max_forward_tokens, len(self.layer_ids) * self.hidden_size, self.hidden_size)
        return RankPool(
            o.tp_size,
            functools.partial(build_sglang_engine, self._engine_spec()),
            handoff=layout,
            slabs=o.handoff_slabs,
            start_timeout_s=o.start_timeout_s,
            batch_timeout_s=o.batch_timeout_s,
        )

    def describe(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "layer_ids": self.layer_ids,
            "sglang_version": sglang_api.installed_version(),
            "sglang_capture_argument": self.capture_argument,
            "sglang_capture_rule": self.capture_rule.value,
            "tp_size": self.tp_size,
            "model_class": self.rank_info.get("model_class"),
            "max_batch_tokens": self.limits.forward_tokens,
            "max_batch_requests": self.limits.max_requests,
            "kv_pool_tokens": self.limits.max_tokens,
            "page_size": self.limits.page_size,
            "max_length": self.limits.max_length,
            "dtype": "bfloat16",
            "handoff_slabs": self._pool.ring.count,
            "handoff_slab_bytes": self._pool.ring.layout.nbytes,
            "handoff_pinned": bool(self.rank_info.get("handoff_pinned")),
        }

    def extract_batch(self, sequences: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Rows lent from the hand-off slabs: valid until the next call (see the class)."""
        return self._extraction.extract_batch(sequences)

    def handoff_figures(self) -> dict[str, Any]:
        return self._extraction.figures()

    def extract(self, input_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.extract_batch([input_ids])[0]

    def close(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
