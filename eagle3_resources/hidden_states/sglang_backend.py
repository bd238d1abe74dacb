"""Hidden states from the target on a GPU host with SGLang's model runner (the `[sglang]` extra).

SGLang's HTTP server returns hidden states as JSON lists, far too slowly for training data, so,
like SpecForge's offline preparation, this runs SGLang's `ModelRunner` in-process: one process
per tensor-parallel rank (spawned here, NCCL between them), each loading its shard of the target.
Every batch goes to every rank; each runs the same batched prefill ("extend"); after the TP
all-reduces the hidden states are replicated, so only rank 0 copies them to the host and sends
them back: straight from the GPU into shared memory, so the queue passes a handle, not a second copy.

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

import functools
import importlib.util
import json
import os
import queue
import socket
import time
import traceback
import weakref
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Self

import torch

from eagle3_resources.hidden_states import sglang_api
from eagle3_resources.hidden_states.layers import eagle3_aux_layers


class SGLangUnavailable(RuntimeError):
    """This host cannot run the SGLang backend (no sglang, no CUDA, too few GPUs, API drift)."""


class RankError(RuntimeError):
    """A rank process failed or died."""


class KVPoolExhausted(RuntimeError):
    """SGLang could not allocate a batch's KV slots (raised in the rank, with the figures and the knobs)."""


# Tokens in one forward (one extend). SGLang's own scheduler caps a prefill at chunked_prefill_size
# (8-16K, by GPU) so that decode keeps its KV room; capture keeps no KV between forwards, so the pool
# is only this big and a forward may be twice that. At Kimi-K2.5 size the aux output alone is
# 32768 x 3 x 7168 x 2 B = 1.4 GB per rank. It must be at least max_length (a sample is never split).
DEFAULT_MAX_FORWARD_TOKENS = 32768
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
        raise ValueError(f"{FORWARD_TOKENS_KNOB} is {max_forward_tokens}, below max_length {max_length}: the SGLang "
                         "backend runs each sample in one forward (no chunked prefill), so a forward must hold the "
                         "longest; raise it or lower max_length")


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
            raise ValueError(f"sequence {i} has {n} tokens ({need} in KV pages of {limits.page_size}); the SGLang "
                             f"runner takes at most {min(limits.max_length, budget)} (max_length {limits.max_length}, "
                             f"KV pool {limits.max_tokens}, max_forward_tokens {limits.max_forward_tokens})")
        if not groups or tokens + need > budget or len(groups[-1]) >= limits.max_requests:
            groups.append([])
            tokens = 0
        groups[-1].append(i)
        tokens += need
    return groups


def kv_pool_message(lengths: list[int], *, page_size: int, pool_tokens: int, pool_requests: int) -> str:
    """What a user reads when SGLang cannot allocate a batch: the batch, the pool, and the knobs."""
    rounded = sum(page_rounded(n, page_size) for n in lengths)
    return (f"the SGLang KV pool is out of memory for a batch of {len(lengths)} sequences, {sum(lengths)} tokens "
            f"({rounded} in whole KV pages of {page_size}); the pool holds {pool_tokens} tokens and {pool_requests} "
            f"requests. Lower {FORWARD_TOKENS_KNOB} or {FORWARD_REQUESTS_KNOB} (a forward's size), or raise "
            f"{MEM_FRACTION_KNOB} if SGLang sized the pool below {FORWARD_TOKENS_KNOB}")


def split_rows(flat: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    """A flat [sum L, D] output back into one [L, D] tensor per sequence, in order."""
    if flat.dim() != 2 or flat.shape[0] != sum(lengths):
        raise ValueError(f"expected [{sum(lengths)}, D] rows for lengths {lengths}, got {tuple(flat.shape)}")
    return list(torch.split(flat, lengths, dim=0))


# ---------------------------------------------------------------- rank protocol


@dataclass
class Ready:
    rank: int
    info: dict[str, Any]


@dataclass
class Done:
    rank: int
    batch_id: int
    aux: torch.Tensor | None = None  # rank 0 only: [sum L, 3H]
    final: torch.Tensor | None = None  # rank 0 only: [sum L, H]


@dataclass
class Failed:
    rank: int
    batch_id: int | None  # None: while starting
    error: str


@dataclass
class ReplyGather:
    """Collects one batch's replies: every rank must finish it, rank 0 carries the tensors."""

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
            if reply.aux is None or reply.final is None:
                raise RankError("rank 0 finished the batch without hidden states")
            self.result = reply
        self.done.add(reply.rank)
        return len(self.done) == self.world_size


class RankEngine(Protocol):
    def info(self) -> dict[str, Any]: ...

    def capture(self, sequences: list[list[int]]) -> tuple[torch.Tensor | None, torch.Tensor | None]: ...


def shared_host_copy(t: torch.Tensor) -> torch.Tensor:
    """`t` as bf16 in new shared memory, copied once from wherever it is (rank 0's GPU).

    A tensor already in shared memory crosses a torch.multiprocessing queue as a handle; any other
    tensor is first copied into shared memory by the queue, a second full copy of the batch.
    """
    nbytes = t.numel() * 2
    try:
        storage = torch.UntypedStorage._new_shared(nbytes)
        out = torch.empty(0, dtype=torch.bfloat16).set_(storage, 0, tuple(t.shape))
    except (AttributeError, RuntimeError, TypeError):  # a torch without these internals: the same result, one copy more
        out = torch.empty(t.shape, dtype=torch.bfloat16).share_memory_()
    out.copy_(t)  # from a GPU this waits for the forward: the reply must not leave before its bytes have landed
    return out


def _rank_main(rank: int, world_size: int, factory: Callable[[int, int], RankEngine], requests, replies) -> None:
    """A rank process: build the engine, then run every batch until told to stop (None)."""
    try:
        engine = factory(rank, world_size)
        replies.put(Ready(rank, engine.info()))
    except BaseException:  # noqa: BLE001 - reported to the parent, which stops every rank
        replies.put(Failed(rank, None, traceback.format_exc()))
        return
    while True:
        message = requests.get()
        if message is None:
            return
        batch_id, sequences = message
        try:
            aux, final = engine.capture(sequences)
            if rank == 0:
                replies.put(Done(rank, batch_id, shared_host_copy(aux), shared_host_copy(final)))
            else:
                replies.put(Done(rank, batch_id))
        except BaseException:  # noqa: BLE001 - reported to the parent, which stops every rank
            replies.put(Failed(rank, batch_id, traceback.format_exc()))


def _stop(processes: list, requests: list, grace_s: float) -> None:
    processes = [p for p in processes if p.pid is not None]  # started ones only
    for q in requests:
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


class RankPool:
    """`world_size` spawned processes, each running `factory(rank, world_size)`; batches go to all."""

    def __init__(self, world_size: int, factory: Callable[[int, int], RankEngine], *,
                 start_timeout_s: float = 3600.0, batch_timeout_s: float = 1800.0, stop_grace_s: float = 60.0):
        import torch.multiprocessing as mp

        self.world_size = world_size
        self.start_timeout_s = start_timeout_s
        self.batch_timeout_s = batch_timeout_s
        ctx = mp.get_context("spawn")
        self._requests = [ctx.Queue() for _ in range(world_size)]
        self._replies = ctx.Queue()
        self._processes = [
            ctx.Process(target=_rank_main, args=(rank, world_size, factory, self._requests[rank], self._replies),
                        name=f"sglang-rank-{rank}")
            for rank in range(world_size)
        ]
        self._next_batch = 0
        self._broken: str | None = None
        self.infos: list[dict[str, Any]] = []
        self._finalizer = weakref.finalize(self, _stop, self._processes, self._requests, stop_grace_s)

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
        self.infos = [infos[r] for r in range(self.world_size)]
        return self.infos

    def run(self, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch on every rank; rank 0's flat (aux, final)."""
        if self._broken:
            raise RankError(f"the rank processes are unusable after an earlier failure: {self._broken}")
        batch_id = self._next_batch
        self._next_batch += 1
        for q in self._requests:
            q.put((batch_id, sequences))
        gather = ReplyGather(self.world_size, batch_id)
        deadline = time.monotonic() + self.batch_timeout_s
        try:
            while not gather.add(self._get(deadline, f"on batch {batch_id}")):
                pass
        except BaseException as e:
            # A rank that failed mid-batch leaves its peers inside a collective: stop them all.
            self._broken = str(e).splitlines()[0]
            self.close()
            raise
        return gather.result.aux, gather.result.final

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
            raise RuntimeError(f"request {req.rid} has a cached prefix of {req.prefix_len} tokens in a cache that "
                               "shares none")
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
        publish(server_args, role="scheduler",
                ranks=SpawnRanks(world_rank=spawn_world_rank(server_args, tp_rank=rank, pp_rank=0), gpu_id=rank))
        initialize_moe_config()
        initialize_fp8_gemm_config()
        initialize_bf16_gemm_config()
        initialize_fp4_gemm_config()
        model_config = ModelConfig.from_server_args(server_args)
        bootstrap.init_parallel_runtime(server_args=server_args, device=get_device().device, dist_port=spec.nccl_port)
        bootstrap.init_layer_runtime(model_config=model_config)
        runner = ModelRunner(model_config=model_config, mem_fraction_static=spec.mem_fraction_static, gpu_id=rank,
                             nccl_port=spec.nccl_port, server_args=server_args)
        overlap = bool(get_model().is_startup_weight_load_overlap)
        if overlap:
            runner.start_startup_weight_load()
        runner.alloc_memory_pool()
        runner.init_attention_backends()  # calls model.set_eagle3_layers_to_capture(capture_argument)
        runner.init_cuda_graphs()  # none are captured: disable_cuda_graph
        if overlap:
            runner.finalize_startup_weight_load()
        if require_mlp_sync():
            raise SGLangUnavailable("this SGLang configuration needs MLP sync (DP attention); the backend does not do it")
        rule = sglang_api.capture_rule_of_import()  # the model code is imported by now
        if rule is not spec.capture_rule:
            raise SGLangUnavailable(f"the imported SGLang reads capture ids as '{rule and rule.value}', "
                                    f"the parent planned for '{spec.capture_rule.value}'")
        self.runner = runner
        self.model_class = type(runner.model).__name__

    def info(self) -> dict[str, Any]:
        r = self.runner
        return {"rank": self.rank, "model_class": self.model_class, "max_total_num_tokens": int(r.max_total_num_tokens),
                "max_requests": int(r.req_to_token_pool.size), "page_size": int(r.page_size), "device": str(r.device)}

    @torch.inference_mode()
    def capture(self, sequences: list[list[int]]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
        from sglang.srt.model_executor.forward_batch_info import (
            CaptureHiddenMode,
            ForwardBatch,
        )
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        runner = self.runner
        params = SamplingParams(temperature=0, max_new_tokens=1)
        reqs = []
        for i, ids in enumerate(sequences):
            req = Req(rid=str(i), origin_input_text="", origin_input_ids=array("q", ids), sampling_params=params,
                      return_hidden_states=True)
            req.full_untruncated_fill_ids = req.origin_input_ids
            req.extend_end = len(ids)
            req.logprob_start_len = -1
            reqs.append(req)
        try:
            batch = ScheduleBatch.init_new(
                reqs=reqs, req_to_token_pool=runner.req_to_token_pool,
                token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator, tree_cache=_NoSharingCache(runner),
                model_config=runner.model_config, enable_overlap=False, spec_algorithm=SpeculativeAlgorithm.NONE,
            )
            try:
                batch.prepare_for_extend()  # allocates the KV slots
            except RuntimeError as e:  # SGLang's "Prefill out of memory" / "alloc_req_slots runs out of memory"
                if "out of memory" not in str(e).lower():
                    raise
                raise KVPoolExhausted(kv_pool_message(
                    [len(s) for s in sequences], page_size=int(runner.page_size),
                    pool_tokens=int(runner.max_total_num_tokens), pool_requests=int(runner.req_to_token_pool.size),
                )) from e
            if batch.input_ids is None and getattr(batch, "prefill_input_ids_cpu", None) is not None:
                batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device, non_blocking=True)
                batch.prefill_input_ids_cpu = None
            forward_batch = ForwardBatch.init_new(batch, runner, capture_hidden_mode=CaptureHiddenMode.FULL,
                                                  return_hidden_states_before_norm=False)
            out = runner.forward(forward_batch).logits_output
            if self.rank != 0:
                torch.cuda.synchronize()
                return None, None
            aux, final = out.hidden_states, out.last_hidden_states
            if aux is None or final is None:
                raise RuntimeError("SGLang returned no aux/last hidden states: is the capture-only mode on?")
            return aux, final  # on the GPU: _rank_main copies them once, into shared memory
        finally:
            runner.req_to_token_pool.clear()
            runner.token_to_kv_pool_allocator.clear()


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
    limits = Limits(max_tokens=min(int(i["max_total_num_tokens"]) for i in infos),
                    max_requests=min(int(i["max_requests"]) for i in infos), max_length=max_length,
                    page_size=pages.pop(), max_forward_tokens=max_forward_tokens)
    if page_rounded(max_length, limits.page_size) > limits.forward_tokens:
        raise SGLangUnavailable(
            f"a forward holds {limits.forward_tokens} tokens (KV pool {limits.max_tokens}, {FORWARD_TOKENS_KNOB} "
            f"{max_forward_tokens}, pages of {limits.page_size}), fewer than a max_length sample takes "
            f"({page_rounded(max_length, limits.page_size)}): raise {MEM_FRACTION_KNOB} or {FORWARD_TOKENS_KNOB}, "
            "or lower max_length")
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
        raise SGLangUnavailable(f"no CUDA device (torch {torch.__version__}, CUDA build: {torch.version.cuda}); "
                                "the SGLang backend needs a GPU host with a CUDA build of torch")
    if torch.cuda.device_count() < tp_size:
        raise SGLangUnavailable(f"tp_size={tp_size} needs {tp_size} GPUs; {torch.cuda.device_count()} visible "
                                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    problems = sglang_api.check_contract()
    if problems:
        raise SGLangUnavailable(f"the installed sglang {sglang_api.installed_version()} lacks names this backend "
                                f"uses (written for {sglang_api.SGLANG_REQUIREMENT}):\n  " + "\n  ".join(problems))


class SGLangHiddenStates:
    """Aux [L, 3H] (layers low -> high) and final [L, H] hidden states, bf16 on the CPU, per sequence."""

    name = "sglang"

    def __init__(self, model_path: str, *, tp_size: int = 8, layer_ids: list[int] | None = None,
                 max_length: int = 32768, mem_fraction_static: float = 0.8,
                 max_forward_tokens: int = DEFAULT_MAX_FORWARD_TOKENS,
                 max_forward_requests: int = DEFAULT_MAX_FORWARD_REQUESTS, trust_remote_code: bool = True,
                 start_timeout_s: float = 3600.0, batch_timeout_s: float = 1800.0, log_level: str = "warning"):
        check_forward_bounds(max_length, max_forward_tokens, max_forward_requests)
        preflight(tp_size)
        shape = read_text_shape(model_path)
        self.model_path = str(model_path)
        self.tp_size = tp_size
        self.num_layers, self.hidden_size = shape.num_layers, shape.hidden_size
        self.layer_ids = list(layer_ids) if layer_ids is not None else eagle3_aux_layers(self.num_layers)
        rule = sglang_api.capture_rule()
        if rule is None:
            raise SGLangUnavailable("cannot tell how this sglang reads EAGLE-3 layer ids "
                                    f"({'.'.join(sglang_api.CAPTURE_SETTER)} changed)")
        self.capture_rule = rule
        self.capture_argument = sglang_api.capture_argument(self.layer_ids, self.num_layers, rule)
        spec = EngineSpec(model_path=self.model_path, tp_size=tp_size, capture_argument=tuple(self.capture_argument),
                          capture_rule=rule, nccl_port=free_port(), max_length=max_length,
                          mem_fraction_static=mem_fraction_static, max_forward_tokens=max_forward_tokens,
                          max_forward_requests=max_forward_requests, trust_remote_code=trust_remote_code,
                          log_level=log_level)
        self._pool = RankPool(tp_size, functools.partial(build_sglang_engine, spec),
                              start_timeout_s=start_timeout_s, batch_timeout_s=batch_timeout_s)
        infos = self._pool.start()
        self.rank_info = infos[0]
        try:
            self.limits = limits_of(infos, max_length=max_length, max_forward_tokens=max_forward_tokens)
        except BaseException:
            self._pool.close()
            raise

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "num_layers": self.num_layers, "hidden_size": self.hidden_size,
                "layer_ids": self.layer_ids, "sglang_version": sglang_api.installed_version(),
                "sglang_capture_argument": self.capture_argument, "sglang_capture_rule": self.capture_rule.value,
                "tp_size": self.tp_size, "model_class": self.rank_info.get("model_class"),
                "max_batch_tokens": self.limits.forward_tokens, "max_batch_requests": self.limits.max_requests,
                "kv_pool_tokens": self.limits.max_tokens, "page_size": self.limits.page_size,
                "max_length": self.limits.max_length, "dtype": "bfloat16"}

    def extract_batch(self, sequences: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        lengths = [len(s) for s in sequences]
        results: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(sequences)
        for group in plan_sub_batches(lengths, self.limits):
            aux, final = self._pool.run([list(sequences[i]) for i in group])
            group_lengths = [lengths[i] for i in group]
            if aux.shape[-1] != len(self.layer_ids) * self.hidden_size or final.shape[-1] != self.hidden_size:
                raise RankError(f"SGLang returned aux {tuple(aux.shape)} / final {tuple(final.shape)}; expected "
                                f"[*, {len(self.layer_ids) * self.hidden_size}] / [*, {self.hidden_size}]")
            for i, a, f in zip(group, split_rows(aux, group_lengths), split_rows(final, group_lengths)):
                results[i] = (a, f)
        return results  # type: ignore[return-value]

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
