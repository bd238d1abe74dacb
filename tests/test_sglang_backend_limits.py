"""The SGLang capture backend's limits, against the pinned SGLang release's own source (issue 25, problems 3-5).

This host has no GPU and never imports sglang. The release's source (`sglang_release_source`) is read with
`ast`; where a test needs SGLang's behaviour, it compiles the few release functions involved (its
out-of-memory reporters) straight from that source, on CPU tensors. The rank engine itself
(`SGLangRankEngine`) runs in-process against a small recording stand-in for the sglang modules it imports
(written to a temporary folder, removed afterwards), with SGLang's real allocation functions doing the
allocation. What they show:

3. each rank chooses its GPU before sglang is imported or `ServerArgs` resolved (resolution asks torch
   about the current device);
4. a forward is bounded (`max_forward_tokens`, each sequence in whole KV pages; `max_forward_requests`),
   and SGLang's KV pool is sized to one forward (`max_total_tokens`, `max_running_requests`);
5. the no-sharing tree cache has every member SGLang's extend path reaches, so a full pool reports
   "out of memory" (and the backend names the batch, the pool and the knob), not AttributeError.
"""

from __future__ import annotations
import __future__

import ast
import logging
import random
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import pytest
import torch

from eagle3_resources.errors import KVPoolExhausted, RankError, SGLangUnavailable
from eagle3_resources.hidden_states import sglang_api
from eagle3_resources.hidden_states.sglang_api import CaptureRule, SourceTree
from eagle3_resources.hidden_states.sglang_backend import (
    DEFAULT_MAX_FORWARD_REQUESTS,
    DEFAULT_MAX_FORWARD_TOKENS,
    EngineSpec,
    Limits,
    SGLangHiddenStates,
    SGLangRankEngine,
    _NoSharingCache,
    limits_of,
    page_rounded,
    plan_sub_batches,
    server_args_kwargs,
)

HIDDEN = 4


# ---------------------------------------------------------------- the release's own functions, compiled from its source


def release_functions(pkg: Path, module: str, names: set[str], namespace: dict) -> dict:
    """Compile the top-level functions `names` of a release module into `namespace` (no sglang import)."""
    path = pkg.parent.joinpath(*module.split(".")).with_suffix(".py")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {n.name for n in found} == names, f"{module} lacks {names - {n.name for n in found}}"
    code = compile(
        ast.Module(body=[*found], type_ignores=[]),
        str(path),
        "exec",
        flags=__future__.annotations.compiler_flag,
        dont_inherit=True,
    )
    exec(code, namespace)
    return namespace


@pytest.fixture(scope="module")
def sglang_alloc(sglang_release_source) -> dict:
    """SGLang 0.5.23's KV allocation entry points and the helpers they call, compiled from the release."""
    pkg = sglang_api.package_dir(sglang_release_source)
    assert pkg is not None, f"no sglang package under {sglang_release_source}"
    ns: dict = {
        "torch": torch,
        "Optional": Optional,
        "logger": logging.getLogger("sglang-release"),
        "BasePrefixCache": object,
        "PageInterleavePoolAllocator": type("PageInterleavePoolAllocator", (), {}),
    }
    release_functions(pkg, "sglang.srt.mem_cache.common", {"evict_from_tree_cache", "available_and_evictable_str"}, ns)
    release_functions(pkg, "sglang.srt.mem_cache.allocator.page_interleave", {"page_interleave_shard_size"}, ns)
    release_functions(pkg, "sglang.srt.utils.common", {"get_num_new_pages"}, ns)
    release_functions(
        pkg, "sglang.srt.mem_cache.allocation", {"alloc_token_slots", "alloc_paged_token_slots_extend"}, ns
    )
    return ns


class PoolAllocator:
    """A KV pool of `size` token slots in pages of `page_size`, counting as SGLang's allocators do
    (token.py: `alloc(n)`; paged.py: `alloc_extend` needs `get_num_new_pages` whole pages)."""

    def __init__(self, size: int, page_size: int, get_num_new_pages):
        self.size, self.page_size, self._pages_of = size, page_size, get_num_new_pages
        self.clear()

    def clear(self) -> None:
        self.free_pages = self.size // self.page_size

    def available_size(self) -> int:
        return self.free_pages * self.page_size

    def alloc(self, need_size: int):
        if need_size // self.page_size > self.free_pages:
            return None
        self.free_pages -= need_size // self.page_size
        return torch.arange(need_size)

    def get_extend_allocation_demand(self, prefix_lens_cpu, seq_lens_cpu, *, conservative_num_tokens, shard_size):
        return conservative_num_tokens

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens):
        pages = self._pages_of(seq_lens=seq_lens_cpu, page_size=self.page_size, prefix_lens=prefix_lens_cpu)
        if pages > self.free_pages:
            return None
        self.free_pages -= pages
        return torch.arange(extend_num_tokens)


def sglang_extend_alloc(alloc: dict, tree_cache, lengths: list[int]):
    """What `alloc_for_extend` does for fresh requests (no prefix): SGLang's token or paged path."""
    if tree_cache.page_size == 1:
        return alloc["alloc_token_slots"](tree_cache, sum(lengths))
    seq = torch.tensor(lengths, dtype=torch.int64)
    zeros = torch.zeros_like(seq)
    return alloc["alloc_paged_token_slots_extend"](
        tree_cache=tree_cache,
        prefix_lens=zeros,
        prefix_lens_cpu=zeros,
        seq_lens=seq,
        seq_lens_cpu=seq,
        last_loc=torch.full((len(lengths),), -1, dtype=torch.int64),
        extend_num_tokens=sum(lengths),
    )


# ------------------------------------------------------- a recording stand-in for the sglang modules the rank imports

FAKE_SGLANG = {
    "_recorder.py": """
        CALLS = []   # (event, detail) in order
        CONFIG = {}  # pool_tokens, page_size, max_requests: what the fake ModelRunner's pools hold
        ALLOC = {}   # SGLang's own allocation functions, compiled from the release by the test
        def record(*event):
            CALLS.append(event)
    """,
    "sglang/__init__.py": "import _recorder\n_recorder.record('import sglang')\n",
    "sglang/srt/server_args.py": """
        import _recorder
        class ServerArgs:
            def __init__(self, **kwargs):
                self.kwargs = kwargs
                _recorder.record("ServerArgs")
            def resolve_once(self):
                _recorder.record("resolve_once")
    """,
    "sglang/srt/entrypoints/engine.py": """
        import _recorder
        def _set_envs_and_config(server_args):
            _recorder.record("_set_envs_and_config")
    """,
    "sglang/srt/runtime_context.py": """
        from types import SimpleNamespace
        import _recorder
        def publish(server_args, role, ranks):
            _recorder.record("publish", role, ranks)
        def SpawnRanks(world_rank, gpu_id):
            return ("ranks", world_rank, gpu_id)
        def spawn_world_rank(server_args, tp_rank, pp_rank):
            return tp_rank
        def get_device():
            return SimpleNamespace(device="cpu")
        def get_model():
            return SimpleNamespace(is_startup_weight_load_overlap=False)
    """,
    "sglang/srt/layers/moe/__init__.py": "def initialize_moe_config():\n    pass\n",
    "sglang/srt/layers/quantization/fp8_utils.py": "def initialize_fp8_gemm_config():\n    pass\n",
    "sglang/srt/layers/quantization/fp4_utils.py": "def initialize_fp4_gemm_config():\n    pass\n",
    "sglang/srt/layers/quantization/unquant.py": "def initialize_bf16_gemm_config():\n    pass\n",
    "sglang/srt/configs/model_config.py": """
        class ModelConfig:
            @classmethod
            def from_server_args(cls, server_args):
                return cls()
    """,
    "sglang/srt/distributed/bootstrap.py": """
        import _recorder
        def init_parallel_runtime(*, server_args, device, dist_port):
            _recorder.record("init_parallel_runtime", device)
        def init_layer_runtime(*, model_config):
            pass
    """,
    "sglang/srt/utils/__init__.py": "def require_mlp_sync():\n    return False\n",
    "sglang/srt/models/deepseek_v2.py": """
        class DeepseekV2ForCausalLM:
            def set_eagle3_layers_to_capture(self, layer_ids=None):
                if layer_ids is None:
                    self.layers_to_capture = [2, 4, 5]
                elif layer_ids and layer_ids[0] == 1:
                    self.layers_to_capture = [val + 1 for val in layer_ids]
                else:
                    self.layers_to_capture = list(layer_ids)
    """,
    "sglang/srt/model_executor/model_runner.py": """
        from types import SimpleNamespace
        import torch
        import _recorder
        from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM

        class ReqToTokenPool:
            def __init__(self, size):
                self.size = size
            def clear(self):
                _recorder.record("req_to_token_pool.clear")

        class ModelRunner:
            def __init__(self, model_config, mem_fraction_static, gpu_id, nccl_port, server_args):
                _recorder.record("ModelRunner", gpu_id)
                c = _recorder.CONFIG
                self.model, self.model_config, self.device = DeepseekV2ForCausalLM(), model_config, "cpu"
                self.page_size, self.max_total_num_tokens = c["page_size"], c["pool_tokens"]
                self.req_to_token_pool = ReqToTokenPool(c["max_requests"])
                self.token_to_kv_pool_allocator = _recorder.ALLOC["allocator"](c["pool_tokens"], c["page_size"])
            def alloc_memory_pool(self):
                pass
            def init_attention_backends(self):
                pass
            def init_cuda_graphs(self):
                pass
            def forward(self, forward_batch):
                ids = forward_batch.prefill_input_ids.float()
                aux = (ids[:, None] * torch.arange(1, 3 * HIDDEN + 1)).to(torch.bfloat16)
                final = (-ids[:, None] * torch.arange(1, HIDDEN + 1)).to(torch.bfloat16)
                out = SimpleNamespace(hidden_states=aux, last_hidden_states=final)
                return SimpleNamespace(logits_output=out)
    """.replace("HIDDEN", str(HIDDEN)),
    "sglang/srt/managers/schedule_batch.py": """
        import torch
        import _recorder

        class Req:
            def __init__(self, rid, origin_input_text, origin_input_ids, sampling_params, return_hidden_states):
                self.rid, self.origin_input_ids, self.prefix_len = rid, origin_input_ids, 0

        class ScheduleBatch:
            @classmethod
            def init_new(cls, reqs, req_to_token_pool, token_to_kv_pool_allocator, tree_cache, model_config,
                         enable_overlap, spec_algorithm):
                batch = cls()
                batch.reqs, batch.tree_cache, batch.device = reqs, tree_cache, "cpu"
                return batch

            def prepare_for_extend(self):
                # alloc_for_extend's KV step for fresh requests, by SGLang's own functions
                lengths = [len(r.origin_input_ids) for r in self.reqs]
                _recorder.ALLOC["extend"](self.tree_cache, lengths)
                self.input_ids = None
                self.prefill_input_ids_cpu = torch.tensor([t for r in self.reqs for t in r.origin_input_ids])
    """,
    "sglang/srt/model_executor/forward_batch_info.py": """
        import enum
        class CaptureHiddenMode(enum.IntEnum):
            NULL = 0
            FULL = 2
        class ForwardBatch:
            @classmethod
            def init_new(cls, batch, runner, *, capture_hidden_mode, return_hidden_states_before_norm):
                fb = cls()
                fb.prefill_input_ids = batch.input_ids
                return fb
    """,
    "sglang/srt/sampling/sampling_params.py": """
        class SamplingParams:
            def __init__(self, temperature, max_new_tokens):
                pass
    """,
    "sglang/srt/speculative/spec_info.py": "import enum\nclass SpeculativeAlgorithm(enum.Enum):\n    NONE = 0\n",
}


@pytest.fixture
def fake_sglang(tmp_path, monkeypatch, sglang_alloc):
    """The recording stand-in on sys.path (its `_recorder` module returned); every module it loaded is
    dropped afterwards, so `importlib.util.find_spec("sglang")` is None again for the other tests."""
    root = tmp_path / "fake_sglang"
    for rel, text in FAKE_SGLANG.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    for d in [p for p in (root / "sglang").rglob("*") if p.is_dir()] + [root / "sglang"]:
        (d / "__init__.py").touch()
    before = set(sys.modules)
    monkeypatch.syspath_prepend(str(root))
    import _recorder

    _recorder.ALLOC.update(
        allocator=lambda size, page: PoolAllocator(size, page, sglang_alloc["get_num_new_pages"]),
        extend=lambda tree_cache, lengths: sglang_extend_alloc(sglang_alloc, tree_cache, lengths),
    )
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: _recorder.record("torch.cuda.set_device", device))
    yield _recorder
    for name in set(sys.modules) - before:
        if name == "_recorder" or name.split(".")[0] == "sglang":
            del sys.modules[name]


def spec(**kw) -> EngineSpec:
    base = dict(
        model_path="/m",
        tp_size=4,
        capture_argument=(3, 5, 7),
        capture_rule=CaptureRule.PLUS_ONE_IF_FIRST_IS_1,
        nccl_port=29500,
    )
    return EngineSpec(**{**base, **kw})


def rank_engine(recorder, *, rank=0, pool_tokens=64, page_size=1, max_requests=8) -> SGLangRankEngine:
    recorder.CONFIG.update(pool_tokens=pool_tokens, page_size=page_size, max_requests=max_requests)
    return SGLangRankEngine(spec(), rank)


# ---------------------------------------------------------------- 3. each rank on its own GPU from the first CUDA call


def test_sglang_resolution_asks_torch_about_the_current_device(sglang_release_source):
    """Why the order matters: `ServerArgs.resolve_once` runs the resolution pipeline, whose handlers call
    `torch.cuda.get_device_capability()` with no device, i.e. on the current one (GPU 0 until set)."""
    pkg = sglang_api.package_dir(sglang_release_source)
    assert pkg is not None
    tree = SourceTree(pkg)
    resolve = tree.resolve("sglang.srt.server_args", "ServerArgs")
    assert resolve is not None
    resolve_once = tree.class_member(resolve, "resolve_once")
    assert resolve_once is not None
    assert "run_resolution_pipeline(self)" in tree.source_of(resolve_once)
    sites = []
    for path in sorted((pkg / "srt" / "arg_groups").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get_device_capability"
                and ast.unparse(node.func.value) == "torch.cuda"
                and not node.args
                and not node.keywords
            ):
                sites.append(f"{path.relative_to(pkg)}:{node.lineno}")
    assert len(sites) >= 3, sites  # overrides.py (3), attention_hook.py (3), model_hook.py in 0.5.23


def test_each_rank_chooses_its_gpu_before_sglang_is_imported_or_resolved(fake_sglang):
    engine = rank_engine(fake_sglang, rank=2)
    events = [e[0] for e in fake_sglang.CALLS]
    assert fake_sglang.CALLS[0] == ("torch.cuda.set_device", 2), fake_sglang.CALLS
    assert events.index("torch.cuda.set_device") < events.index("import sglang") < events.index("resolve_once")
    assert ("ModelRunner", 2) in fake_sglang.CALLS and ("publish", "scheduler", ("ranks", 2, 2)) in fake_sglang.CALLS
    assert engine.info()["page_size"] == 1


# ---------------------------------------------------------------- 4. a bounded forward, a pool of one forward


def test_sglang_kv_pool_is_sized_to_one_forward(sglang_release_source):
    kwargs = server_args_kwargs(spec(max_forward_tokens=16384, max_forward_requests=64))
    assert kwargs["max_total_tokens"] == 16384 and kwargs["max_running_requests"] == 64
    assert kwargs["chunked_prefill_size"] == -1  # hence the forward bound: SGLang does not split a sequence
    # Both are ServerArgs fields in the release (the contract's ServerArgs entry lists every key we pass) ...
    server_args = next(n for n in sglang_api.CONTRACT if n.qualname == "ServerArgs")
    assert {"max_total_tokens", "max_running_requests"} <= set(server_args.kwargs)
    assert sglang_api.check_contract(sglang_release_source, contract=[server_args]) == []
    # ... and the release caps the profiled KV pool at max_total_tokens.
    pkg = sglang_api.package_dir(sglang_release_source)
    assert pkg is not None
    tree = SourceTree(pkg)
    cfg = tree.resolve("sglang.srt.mem_cache.kv_cache_configurator", "KVCacheConfigurator._apply_token_constraints")
    assert cfg is not None
    source = tree.source_of(cfg)
    assert "get_schedule().max_total_tokens" in source and "min(token_capacity, user_limit)" in source


def test_a_batch_of_hundreds_of_thousands_of_tokens_is_split_into_bounded_forwards():
    pool = Limits(
        max_tokens=400_000,
        max_requests=4096,
        max_length=32768,
        page_size=64,
        max_forward_tokens=DEFAULT_MAX_FORWARD_TOKENS,
    )
    groups = plan_sub_batches([1000] * 300, pool)  # 300,000 tokens that the KV pool alone would take at once
    assert [len(g) for g in groups] == [32] * 9 + [12]  # 1000 tokens are 1024 in pages of 64: 32 per 32,768
    assert [i for g in groups for i in g] == list(range(300))


@pytest.mark.parametrize("page_size", [1, 16, 64, 128])
def test_every_planned_forward_fits_the_bound_in_whole_pages(page_size):
    rng = random.Random(page_size)
    limits = Limits(
        max_tokens=1_000_000, max_requests=48, max_length=8192, page_size=page_size, max_forward_tokens=8192
    )
    for _ in range(200):
        lengths = [rng.choice([rng.randint(1, 200), rng.randint(1, 8192)]) for _ in range(rng.randint(1, 120))]
        groups = plan_sub_batches(lengths, limits)
        assert [i for g in groups for i in g] == list(range(len(lengths)))
        cost = [sum(page_rounded(lengths[i], page_size) for i in g) for g in groups]
        assert all(c <= 8192 for c in cost) and all(len(g) <= 48 for g in groups)  # 8192: whole pages of each size
        # greedy: a forward closes only when the next would not fit (each group with the one after it; the last has
        # none)
        for g, nxt, c in zip(groups, groups[1:], cost, strict=False):
            assert len(g) == 48 or c + page_rounded(lengths[nxt[0]], page_size) > 8192


def test_the_planner_counts_each_sequence_in_whole_pages():
    limits = Limits(max_tokens=256, max_requests=100, max_length=256, page_size=64)
    assert plan_sub_batches([1] * 5, limits) == [[0, 1, 2, 3], [4]]  # each one-token sequence takes a 64-slot page
    assert plan_sub_batches([65, 64, 64, 1], limits) == [[0, 1, 2], [3]]  # 128 + 64 + 64 + 64 > 256
    with pytest.raises(ValueError, match=r"has 250 tokens \(256 in KV pages of 64\)"):
        plan_sub_batches([250], Limits(max_tokens=200, max_requests=4, max_length=256, page_size=64))


def test_a_forward_must_hold_the_longest_sample(tmp_path):
    with pytest.raises(ValueError, match="EAGLE3_SGLANG_MAX_FORWARD_TOKENS.*below max_length 65536"):
        SGLangHiddenStates(str(tmp_path), tp_size=8, max_length=65536, max_forward_tokens=32768)  # before any GPU check
    with pytest.raises(ValueError, match="sglang_max_forward_requests must be at least 1"):
        SGLangHiddenStates(str(tmp_path), max_forward_requests=0)
    info = {"max_total_num_tokens": 30_000, "max_requests": 512, "page_size": 64}
    with pytest.raises(
        SGLangUnavailable, match=r"holds 29952 tokens .* fewer than a max_length sample takes \(30016\)"
    ):
        limits_of([info, info], max_length=30_000, max_forward_tokens=32768)
    limits = limits_of([info, {**info, "max_total_num_tokens": 29_000}], max_length=20_000, max_forward_tokens=32768)
    assert (limits.max_tokens, limits.forward_tokens, limits.page_size) == (29_000, 28_992, 64)
    with pytest.raises(RankError, match="different KV page sizes"):
        limits_of([info, {**info, "page_size": 1}], max_length=1024, max_forward_tokens=32768)


def test_the_bounds_are_resource_settings(tmp_path, monkeypatch):
    from eagle3_assets.definitions import hidden_states_resource
    from eagle3_resources.hidden_states.resource import (
        HiddenStatesBackendKind,
        HiddenStatesResource,
    )
    from eagle3_resources.target.resource import TargetModelResource
    from eagle3_resources.tokenizer.resource import TokenizerResource

    resource = HiddenStatesResource()
    assert (resource.sglang_max_forward_tokens, resource.sglang_max_forward_requests) == (
        DEFAULT_MAX_FORWARD_TOKENS,
        DEFAULT_MAX_FORWARD_REQUESTS,
    )
    monkeypatch.setenv("EAGLE3_SGLANG_MAX_FORWARD_TOKENS", "16384")
    assert hidden_states_resource().process_config_and_initialize().sglang_max_forward_tokens == 16384
    resource = HiddenStatesResource(
        backend=HiddenStatesBackendKind.SGLANG, max_length=32768, sglang_max_forward_tokens=16384
    )
    with pytest.raises(ValueError, match="is 16384, below max_length 32768"):
        resource.make_backend(
            TargetModelResource(path=str(tmp_path), standin_dir=str(tmp_path)),
            TokenizerResource(standin_dir=str(tmp_path)),
        )


# ---------------------------------------------------------------- 5. a full pool says so


def tree_cache_members_reached(tree: SourceTree, cache) -> dict[str, list[str]]:
    """`tree_cache.<name>` read on SGLang's extend path: `ScheduleBatch.init_new` and `prepare_for_extend`,
    followed through ScheduleBatch methods (`self.`/`batch.`) and the functions they call in
    `sglang.srt.managers.schedule_batch` and `sglang.srt.mem_cache.*`. A branch guarded by
    `tree_cache.supports_*()` (directly, in an `and`, or through a local bound to it) is skipped when
    `cache` answers False, as it is at run time. Returns name -> the places it is read."""
    reached: dict[str, list[str]] = {}
    seen: set[tuple[str, str]] = set()

    def is_cache(node) -> bool:
        return (isinstance(node, ast.Name) and node.id == "tree_cache") or (
            isinstance(node, ast.Attribute) and node.attr == "tree_cache"
        )

    def is_false(node, false_names) -> bool:
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and is_cache(node.func.value)
            and node.func.attr.startswith("supports_")
            and not node.args
        ):
            answer = getattr(cache, node.func.attr, None)  # a missing one is reported as missing, below
            return answer is not None and answer() is False
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And):
            return any(is_false(v, false_names) for v in node.values)
        return isinstance(node, ast.Name) and node.id in false_names

    def visit_function(module: str, qualname: str, cls: str | None) -> None:
        if (module, qualname) in seen:
            return
        seen.add((module, qualname))
        found = tree.resolve(module, qualname)
        if found is None or not isinstance(found.node, ast.FunctionDef):
            return
        where = f"{found.module}:{qualname}"
        false_names: set[str] = set()

        def visit(node) -> None:
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and is_false(node.value, false_names)
            ):
                false_names.add(node.targets[0].id)
            if isinstance(node, (ast.If, ast.IfExp, ast.While)) and is_false(node.test, false_names):
                visit(node.test)
                for branch in node.orelse if isinstance(node.orelse, list) else [node.orelse]:
                    visit(branch)
                return
            if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And):  # short-circuit at a False operand
                for value in node.values:
                    visit(value)
                    if is_false(value, false_names):
                        return
                return
            if isinstance(node, ast.Attribute) and is_cache(node.value):
                reached.setdefault(node.attr, []).append(f"{where}:{node.lineno}")
            if isinstance(node, ast.Call):
                f = node.func
                if (
                    isinstance(f, ast.Attribute)
                    and isinstance(f.value, ast.Name)
                    and ((f.value.id == "self" and cls == "ScheduleBatch") or f.value.id == "batch")
                ):
                    visit_function("sglang.srt.managers.schedule_batch", f"ScheduleBatch.{f.attr}", "ScheduleBatch")
                elif isinstance(f, ast.Name):
                    target = tree.find(found.module, f.id)
                    if (
                        target is not None
                        and isinstance(target.node, ast.FunctionDef)
                        and (
                            target.module == "sglang.srt.managers.schedule_batch"
                            or target.module.startswith("sglang.srt.mem_cache")
                        )
                    ):
                        visit_function(target.module, f.id, None)
            for child in ast.iter_child_nodes(node):
                visit(child)

        for statement in found.node.body:
            visit(statement)

    for entry in ("ScheduleBatch.init_new", "ScheduleBatch.prepare_for_extend"):
        visit_function("sglang.srt.managers.schedule_batch", entry, "ScheduleBatch")
    assert ("sglang.srt.mem_cache.allocation", "alloc_for_extend") in seen, "the walk lost the allocation path"
    return reached


def test_the_no_sharing_cache_has_every_member_sglang_reaches(sglang_release_source):
    pkg = sglang_api.package_dir(sglang_release_source)
    assert pkg is not None
    tree = SourceTree(pkg)
    runner = SimpleNamespace(page_size=64, device="cpu", token_to_kv_pool_allocator=object())
    cache = _NoSharingCache(runner)
    reached = tree_cache_members_reached(tree, cache)
    # The out-of-memory report is on the path (mem_cache/allocation.py), and so are the guards themselves.
    assert {"available_and_evictable_str", "pretty_print", "supports_swa", "supports_prefix_sharing"} <= set(reached)
    missing = {name: places for name, places in reached.items() if not hasattr(cache, name)}
    assert missing == {}, f"SGLang {sglang_api.SGLANG_TESTED} reads these on the no-sharing cache: {missing}"
    # Every member we answer with is BasePrefixCache's, under the same name (the contract lists them).
    base = next(n for n in sglang_api.CONTRACT if n.qualname == "BasePrefixCache")
    ours = {n for n in vars(_NoSharingCache) if not n.startswith("_")}
    assert ours <= set(base.attrs)
    assert sglang_api.check_contract(sglang_release_source, contract=[base]) == []


@pytest.mark.parametrize("page_size", [1, 64])
def test_sglang_reports_out_of_memory_on_the_no_sharing_cache(sglang_alloc, page_size):
    allocator = PoolAllocator(256, page_size, sglang_alloc["get_num_new_pages"])
    cache = _NoSharingCache(SimpleNamespace(page_size=page_size, device="cpu", token_to_kv_pool_allocator=allocator))
    fits = [256 // 4 - (page_size > 1)] * 4  # 63 tokens take a whole 64-slot page
    assert len(sglang_extend_alloc(sglang_alloc, cache, fits)) == sum(fits)
    allocator.clear()
    over = [64] * 4 + [1]
    with pytest.raises(RuntimeError, match=r"(?is)out of memory.*Try to allocate 257 tokens.*Available tokens: 256 "):
        sglang_extend_alloc(sglang_alloc, cache, over)


def test_a_full_pool_names_the_batch_the_pool_and_the_knob(fake_sglang):
    engine = rank_engine(fake_sglang, pool_tokens=64, page_size=1, max_requests=8)
    aux, final = engine.capture([[1, 2, 3], [4]])
    assert aux is not None and final is not None  # rank 0 gets both
    assert aux.shape == (4, 3 * HIDDEN) and torch.equal(final[:, 0].float(), -torch.tensor([1.0, 2, 3, 4]))
    with pytest.raises(KVPoolExhausted) as err:
        engine.capture([[7] * 30, [8] * 30, [9] * 5])
    message = str(err.value)
    assert "a batch of 3 sequences, 65 tokens" in message and "the pool holds 64 tokens and 8 requests" in message
    assert "EAGLE3_SGLANG_MAX_FORWARD_TOKENS" in message and "sglang_mem_fraction" in message
    assert "Prefill out of memory" in str(err.value.__cause__) or "Out of memory" in str(err.value.__cause__)
    assert fake_sglang.CALLS[-1] == ("req_to_token_pool.clear",)  # the pools are cleared for the next batch
    aux, _ = engine.capture([[5] * 64])
    assert aux is not None and aux.shape == (64, 3 * HIDDEN)


def test_forwards_planned_in_whole_pages_fit_a_paged_pool(fake_sglang):
    """The planner and SGLang's paged allocator agree: every planned forward allocates; the same
    sequences planned by raw length overfill the pool."""
    engine = rank_engine(fake_sglang, pool_tokens=512, page_size=128, max_requests=64)
    lengths = [1, 130, 127, 2, 3, 129, 60, 1]
    limits = limits_of([engine.info()], max_length=256, max_forward_tokens=512)
    groups = plan_sub_batches(lengths, limits)
    assert groups == [[0, 1, 2], [3, 4, 5], [6, 7]]
    for g in groups:
        engine.capture([[i + 1] * lengths[i] for i in g])
    raw = Limits(max_tokens=512, max_requests=64, max_length=256)  # page size ignored: 393 tokens "fit"
    first = plan_sub_batches(lengths, raw)[0]
    assert first == [0, 1, 2, 3, 4, 5, 6, 7][: len(first)] and len(first) >= 5
    with pytest.raises(KVPoolExhausted, match="in whole KV pages of 128"):
        engine.capture([[i + 1] * lengths[i] for i in first])
