"""The SGLang hidden-states backend without a GPU: its API contract, id translation, rank protocol.

(a) the contract against the installed sglang (skipped without it), (b) against a source tree
named by $SGLANG_SOURCE (e.g. a checkout's `python/`), and always against the pinned wheel's own
source (downloaded once, read by `ast`) and copies of it with one name renamed, (c) the checker
on small fake trees, so it is seen to fail, (d) the pure pieces, the spawned rank processes with a fake engine, and
`eagle3 gpu-check --json` on this host.
"""

from __future__ import annotations

import ast
import importlib.util
import itertools
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from eagle3_resources.errors import RankError, SGLangUnavailable
from eagle3_resources.hidden_states import sglang_api
from eagle3_resources.hidden_states.layers import eagle3_aux_layers
from eagle3_resources.hidden_states.sglang_api import (
    CaptureRule,
    Name,
    capture_argument,
    layers_to_capture,
)
from eagle3_resources.hidden_states.sglang_backend import (
    Done,
    EngineSpec,
    Failed,
    Handoff,
    Limits,
    RankPool,
    ReplyGather,
    SGLangHiddenStates,
    plan_sub_batches,
    read_text_shape,
    server_args_kwargs,
    split_rows,
)

REPO = Path(__file__).resolve().parents[1]
HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
POST, PRE = CaptureRule.PLUS_ONE_IF_FIRST_IS_1, CaptureRule.ALWAYS_PLUS_ONE


# ---------------------------------------------------------------- (a) and (b): real SGLang


@pytest.mark.skipif(not HAVE_SGLANG, reason="sglang is not installed (GPU hosts: sglang_api.INSTALL_HINT)")
def test_contract_against_installed_sglang():
    try:
        import sglang  # noqa: F401
    except Exception as e:  # noqa: BLE001 - a broken install
        pytest.fail(f"sglang is installed but does not import: {e}")
    assert sglang_api.check_contract(mode="import") == []
    assert sglang_api.check_contract() == []
    assert sglang_api.capture_rule() is not None


@pytest.mark.skipif(
    not os.environ.get("SGLANG_SOURCE"), reason="set SGLANG_SOURCE to an sglang source tree (its python/ dir)"
)
def test_contract_against_source_tree():
    root = Path(os.environ["SGLANG_SOURCE"])
    assert sglang_api.package_dir(root) is not None, f"no sglang package under {root}"
    assert sglang_api.check_contract(root) == []
    rule = sglang_api.capture_rule(root)
    assert rule is not None
    # Kimi-K2.5 (61 layers): the default layers reach SGLang as they are, whatever the rule.
    assert capture_argument(eagle3_aux_layers(61), 61, rule) == [1, 29, 57]


def test_contract_against_the_pinned_release(sglang_release_source):
    """The pinned wheel's own source (`pip download sglang==<pin> --no-deps`, read by ast): always runs."""
    from sglang_source import pinned_sglang_version

    pkg = sglang_api.package_dir(sglang_release_source)
    assert pkg is not None and sglang_api.source_version(pkg) == pinned_sglang_version() == sglang_api.SGLANG_TESTED
    assert sglang_api.check_contract(sglang_release_source) == []
    # 0.5.23's DeepseekV2 setter has sglang#25454's rule: +1 only for a list starting with 1.
    rule = sglang_api.capture_rule(sglang_release_source)
    assert rule is POST
    assert capture_argument(eagle3_aux_layers(61), 61, rule) == [1, 29, 57]
    assert capture_argument([2, 4, 6], 8, rule) == [3, 5, 7]


SRT = "sglang/srt/"


@pytest.mark.parametrize(
    "rel, old, new, problem",
    [
        (
            SRT + "model_executor/model_runner.py",
            "    def init_attention_backends(self):",
            "    def init_attention_backend_list(self):",
            "sglang.srt.model_executor.model_runner.ModelRunner: no attribute init_attention_backends",
        ),
        (
            SRT + "arg_groups/fields/exec_.py",
            "    enable_return_aux_hidden_states: A[",
            "    enable_aux_hidden_states: A[",
            "sglang.srt.server_args.ServerArgs: no parameter enable_return_aux_hidden_states",
        ),
        (
            SRT + "runtime_context.py",
            "    ranks: SpawnRanks | None = None,",
            "    spawn_ranks: SpawnRanks | None = None,",
            "sglang.srt.runtime_context.publish: no parameter ranks",
        ),
        (
            SRT + "models/deepseek_v2.py",
            "    def set_eagle3_layers_to_capture(self, layer_ids",
            "    def set_aux_layers_to_capture(self, layer_ids",
            "sglang.srt.models.deepseek_v2.DeepseekV2ForCausalLM.set_eagle3_layers_to_capture: not found",
        ),
        (
            SRT + "models/deepseek_v2.py",
            "layer_ids[0] == 1:\n                self.model.layers_to_capture = [val + 1 for",
            "layer_ids[0] == 1:\n                self.model.layers_to_capture = [val + 2 for",
            "sglang.srt.models.deepseek_v2.DeepseekV2ForCausalLM.set_eagle3_layers_to_capture: "
            "layer-id rule not recognised in its source",
        ),
    ],
    ids=["ModelRunner method", "ServerArgs field", "publish keyword", "capture setter", "capture rule"],
)
def test_contract_on_a_copy_of_the_release_reports_one_renamed_name(
    sglang_release_source, tmp_path, rel, old, new, problem
):
    """The release's source copied, one name the backend relies on renamed: the checker reports exactly that."""
    shutil.copytree(sglang_release_source / "sglang", tmp_path / "sglang")
    path = tmp_path / rel
    text = path.read_text(encoding="utf-8")
    assert text.count(old) == 1, f"{old!r} is not once in {rel} of the release"
    path.write_text(text.replace(old, new), encoding="utf-8")
    assert sglang_api.check_contract(tmp_path) == [problem]


# ---------------------------------------------------------------- (c) the checker on fake trees


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    for d in [p for p in root.rglob("*") if p.is_dir()]:
        (d / "__init__.py").touch()
    return root


FAKE = {
    "sglang/srt/runner.py": """
        from sglang.srt.base import Base
        class Runner(Base):
            def __init__(self, model_config, gpu_id, nccl_port=None):
                self.model = None
            def forward(self, forward_batch):
                return forward_batch
    """,
    "sglang/srt/base.py": """
        class Base:
            page_size: int = 1
            def alloc_memory_pool(self):
                self.pool = object()
    """,
    "sglang/srt/utils/__init__.py": "from sglang.srt.utils.common import *\n",
    "sglang/srt/utils/common.py": "def require_mlp_sync():\n    return False\n",
    "sglang/srt/modes.py": "import enum\nclass Mode(enum.IntEnum):\n    NULL = 0\n    FULL = 2\n",
    "sglang/srt/flexible.py": "def anything(a, **kwargs):\n    return a\n",
    "sglang/srt/fields/model.py": "class Model:\n    model_path: str = ''\n    tp_size: int = 1\n",
    "sglang/srt/args.py": "class ServerArgs:\n    def resolve_once(self):\n        pass\n",
}

FAKE_CONTRACT = (
    Name(
        "sglang.srt.runner",
        "Runner",
        kwargs=("model_config", "gpu_id", "nccl_port"),
        attrs=("model", "forward", "alloc_memory_pool", "pool", "page_size"),
    ),
    Name("sglang.srt.runner", "Runner.forward"),
    Name("sglang.srt.utils", "require_mlp_sync"),
    Name("sglang.srt.modes", "Mode", attrs=("FULL",)),
    Name("sglang.srt.flexible", "anything", kwargs=("whatever",)),
    Name(
        "sglang.srt.args",
        "ServerArgs",
        kwargs=("model_path", "tp_size"),
        attrs=("resolve_once",),
        fields_from="sglang.srt.fields",
    ),
)


def test_checker_accepts_a_tree_that_has_every_name(tmp_path):
    root = write_tree(tmp_path, FAKE)
    assert sglang_api.check_contract(root, contract=FAKE_CONTRACT) == []


@pytest.mark.parametrize(
    "edit, problem",
    [
        (("sglang/srt/runner.py", "def forward(", "def run_forward("), "Runner.forward: not found"),
        (("sglang/srt/runner.py", "gpu_id, nccl_port=None", "gpu_id"), "Runner: no parameter nccl_port"),
        (("sglang/srt/base.py", "self.pool =", "self.kv_pool ="), "Runner: no attribute pool"),
        (("sglang/srt/base.py", "page_size: int = 1", "page: int = 1"), "Runner: no attribute page_size"),
        (
            ("sglang/srt/utils/common.py", "def require_mlp_sync", "def require_sync"),
            "utils.require_mlp_sync: not found",
        ),
        (("sglang/srt/modes.py", "FULL = 2", "ALL = 2"), "Mode: no attribute FULL"),
        (("sglang/srt/flexible.py", "a, **kwargs", "a"), "anything: no parameter whatever"),
        (
            ("sglang/srt/fields/model.py", "tp_size: int", "tensor_parallel_size: int"),
            "ServerArgs: no parameter tp_size",
        ),
    ],
)
def test_checker_catches_renames_and_missing_parameters(tmp_path, edit, problem):
    rel, old, new = edit
    files = dict(FAKE)
    assert old in files[rel]
    files[rel] = files[rel].replace(old, new)
    problems = sglang_api.check_contract(write_tree(tmp_path, files), contract=FAKE_CONTRACT)
    assert problems and any(problem in p for p in problems), problems


def test_checker_without_any_sglang(tmp_path):
    problems = sglang_api.check_contract(tmp_path)
    assert len(problems) == 1 and "no sglang package" in problems[0] and "pip install" in problems[0]


# Two shapes of DeepseekV2's setter, written for this test: before and after sglang#25454.
SETTER_BEFORE = """
    def set_eagle3_layers_to_capture(self, layer_ids=None):
        if layer_ids is None:
            self.model.layers_to_capture = [2, n // 2, n - 3]
        else:
            self.model.layers_to_capture = [val + 1 for val in layer_ids]
"""
SETTER_AFTER = """
    def set_eagle3_layers_to_capture(self, layer_ids=None):
        if layer_ids is None:
            self.model.layers_to_capture = [2, n // 2, n - 3]
        elif layer_ids and layer_ids[0] == 1:
            self.model.layers_to_capture = [val + 1 for val in layer_ids]
        else:
            self.model.layers_to_capture = list(layer_ids)
"""


def test_capture_rule_is_read_from_the_setter_source(tmp_path):
    assert sglang_api.capture_rule_from_source(SETTER_BEFORE) is PRE
    assert sglang_api.capture_rule_from_source(SETTER_AFTER) is POST
    assert sglang_api.capture_rule_from_source("def set_eagle3_layers_to_capture(self, ids):\n    pass\n") is None
    body = textwrap.indent(textwrap.dedent(SETTER_AFTER), "    ")
    root = write_tree(tmp_path, {"sglang/srt/models/deepseek_v2.py": f"class DeepseekV2ForCausalLM:\n{body}"})
    assert sglang_api.capture_rule(root) is POST


# ---------------------------------------------------------------- (d) the layer-id translation


def test_layers_to_capture_follows_sglang_before_and_after_25454():
    # After #25454 a list starting with 1 is "output of layer" (+1), any other "input of layer".
    assert layers_to_capture([1, 29, 57], POST) == [2, 30, 58]
    assert layers_to_capture([2, 30, 58], POST) == [2, 30, 58]
    # Before it, every explicit list was shifted.
    assert layers_to_capture([1, 29, 57], PRE) == [2, 30, 58]
    assert layers_to_capture([2, 30, 58], PRE) == [3, 31, 59]


def test_capture_argument_asks_for_the_outputs_of_our_layers():
    kimi = eagle3_aux_layers(61)
    assert kimi == [1, 29, 57]
    assert capture_argument(kimi, 61, POST) == capture_argument(kimi, 61, PRE) == [1, 29, 57]
    assert capture_argument([2, 4, 6], 8, POST) == [3, 5, 7]
    assert capture_argument([2, 4, 6], 8, PRE) == [2, 4, 6]
    assert capture_argument([0, 3, 5], 8, PRE) == [0, 3, 5]
    for n in (4, 8):
        for k in (1, 2, 3):
            for ids in itertools.combinations(range(n - 1), k):
                for rule in CaptureRule:
                    if rule is POST and ids[0] == 0:
                        continue
                    arg = capture_argument(list(ids), n, rule)
                    assert layers_to_capture(arg, rule) == [i + 1 for i in ids], (ids, rule)


@pytest.mark.parametrize(
    "ids, n, rule, message",
    [
        ([0, 3, 5], 8, POST, "output of layer 0"),
        ([1, 3, 7], 8, POST, "0..6"),  # the last layer's output is the pre-norm final state: not capturable
        ([4, 2, 6], 8, POST, "ascending"),
        ([2, 2, 6], 8, PRE, "distinct"),
        ([], 8, PRE, "ascending"),
    ],
)
def test_capture_argument_refuses_what_sglang_cannot_capture(ids, n, rule, message):
    with pytest.raises(ValueError, match=message):
        capture_argument(ids, n, rule)


# ---------------------------------------------------------------- (d) pure helpers


def test_server_args_are_all_in_the_contract():
    spec = EngineSpec(model_path="/m", tp_size=8, capture_argument=(1, 29, 57), capture_rule=POST, nccl_port=29500)
    kwargs = server_args_kwargs(spec)
    server_args = next(n for n in sglang_api.CONTRACT if n.qualname == "ServerArgs")
    assert set(kwargs) == set(server_args.kwargs)
    assert kwargs["return_aux_hidden_state_layer_ids"] == [1, 29, 57]
    assert kwargs["enable_return_aux_hidden_states"] is True and kwargs["speculative_algorithm"] == "EAGLE3"
    assert kwargs["chunked_prefill_size"] == -1 and kwargs["disable_cuda_graph"] is True


def test_the_backend_imports_only_names_in_the_contract():
    """sglang_api.CONTRACT is the one place: every `from sglang... import x` in the backend is listed."""
    listed = {(n.module, n.qualname.split(".")[0]) for n in sglang_api.CONTRACT}
    modules = {n.module for n in sglang_api.CONTRACT}
    source = (REPO / "eagle3_resources/hidden_states/sglang_backend.py").read_text()
    imported = [
        (node.module, a.name)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang")
        for a in node.names
    ]
    assert len(imported) >= 15
    unlisted = [(m, x) for m, x in imported if (m, x) not in listed and f"{m}.{x}" not in modules]
    assert unlisted == []


def test_read_text_shape_handles_the_multimodal_wrapper(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "kimi_k25", "text_config": {"num_hidden_layers": 61, "hidden_size": 7168}})
    )
    assert read_text_shape(tmp_path).num_layers == 61
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 8, "hidden_size": 64}))
    assert read_text_shape(tmp_path).hidden_size == 64


def test_plan_sub_batches_fits_the_pools_in_order():
    limits = Limits(max_tokens=100, max_requests=3, max_length=80)
    assert plan_sub_batches([50, 40, 20, 10, 10, 10, 80], limits) == [[0, 1], [2, 3, 4], [5, 6]]
    assert plan_sub_batches([100 // 4] * 4, limits) == [[0, 1, 2], [3]]
    with pytest.raises(ValueError, match="at most 80"):
        plan_sub_batches([81], limits)
    with pytest.raises(ValueError, match="empty"):
        plan_sub_batches([3, 0], limits)


def test_split_rows():
    flat = torch.arange(12.0).reshape(6, 2)
    a, b = split_rows(flat, [2, 4])
    assert a.tolist() == [[0, 1], [2, 3]] and b.shape == (4, 2)
    with pytest.raises(ValueError, match="expected"):
        split_rows(flat, [2, 3])


def test_reply_gather_needs_every_rank_and_rank_zero_tensors():
    g = ReplyGather(world_size=3, batch_id=7)
    assert not g.add(Done(2, 7))
    assert not g.add(Done(0, 7, Handoff(slab=0, tokens=1)))
    assert g.add(Done(1, 7)) and g.result is not None and g.result.rank == 0
    with pytest.raises(RankError, match="rank 1 failed on batch 7"):
        ReplyGather(2, 7).add(Failed(1, 7, "Traceback: boom"))
    with pytest.raises(RankError, match="without hidden states"):
        ReplyGather(2, 7).add(Done(0, 7))
    with pytest.raises(RankError, match="unexpected"):
        ReplyGather(2, 7).add(Done(1, 6))


# ---------------------------------------------------------------- (d) real rank processes, fake engine


def test_rank_pool_sends_every_batch_to_every_rank_and_returns_rank_zero():
    import functools

    from fakes.sglang import ECHO_SLAB, HIDDEN, echo_engine

    pool = RankPool(
        2, functools.partial(echo_engine), handoff=ECHO_SLAB, start_timeout_s=120, batch_timeout_s=60, stop_grace_s=10
    )
    try:
        infos = pool.start()
        assert [i["rank"] for i in infos] == [0, 1] and infos[0]["pid"] != infos[1]["pid"]
        for batch in ([[1, 2, 3], [4]], [[5, 6]]):
            aux, final = pool.run(batch)
            ids = torch.tensor([t for s in batch for t in s], dtype=torch.float32)
            assert aux.shape == (len(ids), 3 * HIDDEN) and aux.dtype == torch.bfloat16
            assert torch.equal(aux[:, 2].float(), 3 * ids) and torch.equal(final[:, 0].float(), -ids)
    finally:
        pool.close()
    assert not pool.alive


def test_rank_pool_reports_a_failing_rank_and_stops_all():
    import functools

    from fakes.sglang import ECHO_SLAB, echo_engine

    pool = RankPool(
        2,
        functools.partial(echo_engine, fail_on_batch_with=13),
        handoff=ECHO_SLAB,
        start_timeout_s=120,
        batch_timeout_s=60,
        stop_grace_s=10,
    )
    pool.start()
    assert pool.run([[1, 2]])[0].shape[0] == 2
    with pytest.raises(RankError, match="rank 1 failed on batch 1") as err:
        pool.run([[12, 13]])
    assert "refuses token 13" in str(err.value)
    assert not pool.alive
    with pytest.raises(RankError, match="unusable"):
        pool.run([[1]])


def test_rank_pool_reports_a_rank_that_dies_while_starting():
    import functools

    from fakes.sglang import ECHO_SLAB, echo_engine

    pool = RankPool(
        2, functools.partial(echo_engine, die_on_start=True), handoff=ECHO_SLAB, start_timeout_s=120, stop_grace_s=10
    )
    with pytest.raises(RankError, match="exited while starting"):
        pool.start()
    assert not pool.alive


@pytest.mark.skipif(HAVE_SGLANG, reason="checks the message of a host without sglang")
def test_backend_fails_fast_without_sglang(tmp_path):
    hint = r"pip install uv==\S+ && uv pip install --override deploy/sglang-host\.overrides\.txt -e '\.\[sglang,gpu\]'"
    with pytest.raises(SGLangUnavailable, match="sglang is not installed: " + hint):
        SGLangHiddenStates(str(tmp_path), tp_size=8)


# ---------------------------------------------------------------- eagle3 gpu-check on this host


@pytest.mark.slow
def test_gpu_check_json_on_this_host():
    proc = subprocess.run(
        [sys.executable, "-m", "eagle3_assets.operations.cli", "gpu-check", "--json"],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads(proc.stdout)
    rows = {c["name"]: c for c in report["checks"]}
    assert rows["transformers capture"]["status"] == "ok", rows["transformers capture"]
    assert rows["transformers capture"]["data"]["max_abs_err"] < 1e-3
    if not HAVE_SGLANG:
        tiny = rows["sglang capture (tiny, tp=1)"]
        assert tiny["status"] == "unavailable" and "pip install" in tiny["detail"] and not tiny["required"]
        assert rows["sglang"]["status"] == "unavailable"
        assert proc.returncode == report["exit_code"] == 0, proc.stderr[-2000:]


def test_gpu_check_exit_code_policy():
    from eagle3_assets.operations.gpu_check import Check, exit_code

    ok = Check("transformers capture", "ok", "", True)
    assert exit_code([ok, Check("sglang", "unavailable", "not installed", False)]) == 0
    assert exit_code([ok, Check("sglang", "unavailable", "not installed", True)]) == 1  # asked for with --tp/--model
    assert exit_code([ok, Check("sglang contract", "fail", "drift", False)]) == 1  # a failure always counts
    assert exit_code([Check("transformers capture", "fail", "mismatch", True)]) == 1
