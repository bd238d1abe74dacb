"""Every SGLang name the hidden-states backend depends on, and a checker that they still exist.

SGLang's in-process API (ModelRunner, ScheduleBatch, ServerArgs, the runtime context) is internal
and changes between patch releases: 0.5.23 replaced `tp_rank=` on `ModelRunner` with a published
runtime context, moved `bench_one_batch` to `sglang.benchmark.one_batch` and assembles `ServerArgs`
from namespace structs. `sglang_backend.py` uses only the names listed in `CONTRACT`, with only
the keyword arguments listed there, so `check_contract` can say before any GPU is touched whether
an SGLang build still has them:

- with sglang importable (a GPU host): `check_contract(mode="import")` imports each module and
  reads signatures with `inspect`;
- without importing it: `check_contract()` parses the source files with `ast`, from an installed
  package's location (`importlib.util.find_spec`, which imports nothing) or from any source tree,
  e.g. a checkout's `python/` directory (`check_contract(Path("sglang/python"))`).

The layer-id convention of `set_eagle3_layers_to_capture` is read from the same source
(`capture_rule`), and `capture_argument` translates our ids (outputs of 0-based decoder layers)
into what that rule expects.
"""

from __future__ import annotations

import ast
import enum
import importlib
import importlib.util
import inspect
import re
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

# Written against the 0.5.23 wheel (the newest release when this was written; its sources are
# what `check_contract` was run on). The API moves within the 0.5 series, hence the narrow range.
SGLANG_REQUIREMENT = "sglang>=0.5.23,<0.5.24"
SGLANG_TESTED = "0.5.23"
INSTALL_HINT = (
    "pip install uv==0.13.9 && uv pip install --override deploy/sglang-host.overrides.txt -e '.[sglang,gpu]'"
    "  (in the checkout's root; sglang " + SGLANG_TESTED + " pins torch==2.14.1, above pyproject's CPU cap, "
    "which only uv's --override lifts: plain pip cannot resolve it; needs a GPU host with a CUDA 13 driver)"
)


@dataclass(frozen=True)
class Name:
    """One SGLang object we use: `module`.`qualname`, the keywords we pass, the members we read."""

    module: str
    qualname: str  # "ModelRunner" or "ModelRunner.forward"
    kwargs: tuple[str, ...] = ()  # keyword arguments we pass: must be parameters (or fields)
    attrs: tuple[str, ...] = ()  # attributes, methods or enum members we read on the class
    fields_from: str | None = None  # a package whose classes' annotated fields are the constructor's
    why: str = ""

    @property
    def dotted(self) -> str:
        return f"{self.module}.{self.qualname}"


SERVER_ARGS_KWARGS = (
    "model_path",
    "tp_size",
    "trust_remote_code",
    "context_length",
    "mem_fraction_static",
    "chunked_prefill_size",
    "disable_cuda_graph",
    "disable_radix_cache",
    "enable_return_aux_hidden_states",
    "speculative_algorithm",
    "return_aux_hidden_state_layer_ids",
    "log_level",
    "max_total_tokens",
    "max_running_requests",
)

CONTRACT: tuple[Name, ...] = (
    Name(
        "sglang.srt.server_args",
        "ServerArgs",
        kwargs=SERVER_ARGS_KWARGS,
        attrs=("resolve_once",),
        fields_from="sglang.srt.arg_groups.fields",
        why="engine settings; enable_return_aux_hidden_states + speculative_algorithm='EAGLE3' is the "
        "capture-only mode (no draft) that captures the EAGLE-3 layers and keeps the final hidden state",
    ),
    Name("sglang.srt.entrypoints.engine", "_set_envs_and_config", why="NCCL/CUDA environment of a rank process"),
    Name(
        "sglang.srt.runtime_context",
        "publish",
        kwargs=("role", "ranks"),
        why="installs this process's config and TP placement (replaces ModelRunner's tp_rank= since 0.5.2x)",
    ),
    Name("sglang.srt.runtime_context", "SpawnRanks", kwargs=("world_rank", "gpu_id")),
    Name("sglang.srt.runtime_context", "spawn_world_rank", kwargs=("tp_rank", "pp_rank")),
    Name("sglang.srt.runtime_context", "get_device"),
    Name("sglang.srt.runtime_context", "get_model"),
    Name("sglang.srt.arg_groups.fields.device", "Device", attrs=("device",), why="get_device().device"),
    Name(
        "sglang.srt.arg_groups.fields.model",
        "Model",
        attrs=("is_startup_weight_load_overlap",),
        why="get_model().is_startup_weight_load_overlap",
    ),
    Name("sglang.srt.layers.moe", "initialize_moe_config"),
    Name("sglang.srt.layers.quantization.fp8_utils", "initialize_fp8_gemm_config"),
    Name("sglang.srt.layers.quantization.unquant", "initialize_bf16_gemm_config"),
    Name("sglang.srt.layers.quantization.fp4_utils", "initialize_fp4_gemm_config"),
    Name("sglang.srt.configs.model_config", "ModelConfig.from_server_args"),
    Name(
        "sglang.srt.distributed.bootstrap",
        "init_parallel_runtime",
        kwargs=("server_args", "device", "dist_port"),
        why="NCCL process groups over tcp://127.0.0.1:dist_port",
    ),
    Name("sglang.srt.distributed.bootstrap", "init_layer_runtime", kwargs=("model_config",)),
    Name(
        "sglang.srt.model_executor.model_runner",
        "ModelRunner",
        kwargs=("model_config", "mem_fraction_static", "gpu_id", "nccl_port", "server_args"),
        attrs=(
            "model",
            "model_config",
            "req_to_token_pool",
            "token_to_kv_pool_allocator",
            "max_total_num_tokens",
            "device",
            "page_size",
            "forward",
            "alloc_memory_pool",
            "init_attention_backends",
            "init_cuda_graphs",
            "start_startup_weight_load",
            "finalize_startup_weight_load",
        ),
    ),
    Name("sglang.srt.model_executor.model_runner", "ModelRunnerOutput", attrs=("logits_output",)),
    Name(
        "sglang.srt.mem_cache.memory_pool",
        "ReqToTokenPool",
        attrs=("size", "clear"),
        why="size: requests per batch; clear: freed after every batch",
    ),
    Name("sglang.srt.mem_cache.allocator", "BaseTokenToKVPoolAllocator", attrs=("clear", "available_size")),
    Name(
        "sglang.srt.layers.logits_processor",
        "LogitsProcessorOutput",
        attrs=("hidden_states", "last_hidden_states"),
        why="hidden_states: the packed aux layers [T, 3H]; last_hidden_states: post-norm final [T, H]",
    ),
    Name(
        "sglang.srt.managers.schedule_batch",
        "Req",
        kwargs=("rid", "origin_input_text", "origin_input_ids", "sampling_params", "return_hidden_states"),
        attrs=("full_untruncated_fill_ids", "extend_end", "logprob_start_len", "prefix_len"),
    ),
    Name(
        "sglang.srt.managers.schedule_batch",
        "ScheduleBatch.init_new",
        kwargs=(
            "reqs",
            "req_to_token_pool",
            "token_to_kv_pool_allocator",
            "tree_cache",
            "model_config",
            "enable_overlap",
            "spec_algorithm",
        ),
    ),
    Name(
        "sglang.srt.managers.schedule_batch",
        "ScheduleBatch",
        attrs=("prepare_for_extend", "input_ids", "prefill_input_ids_cpu", "device"),
    ),
    Name(
        "sglang.srt.mem_cache.base_prefix_cache",
        "BasePrefixCache",
        attrs=(
            "supports_swa",
            "supports_mamba",
            "supports_prefix_sharing",
            "evict",
            "maybe_hand_to_session",
            "evictable_size",
            "available_and_evictable_str",
            "pretty_print",
            "prefix_device_indices",
            "rotation_base_of",
        ),
        why="what the backend's no-sharing tree cache implements",
    ),
    Name(
        "sglang.srt.model_executor.forward_batch_info",
        "ForwardBatch.init_new",
        kwargs=("capture_hidden_mode", "return_hidden_states_before_norm"),
    ),
    Name("sglang.srt.model_executor.forward_batch_info", "CaptureHiddenMode", attrs=("FULL",)),
    Name("sglang.srt.sampling.sampling_params", "SamplingParams", kwargs=("temperature", "max_new_tokens")),
    Name("sglang.srt.speculative.spec_info", "SpeculativeAlgorithm", attrs=("NONE",)),
    Name("sglang.srt.utils", "require_mlp_sync", why="must be False: no DP attention in this backend"),
    Name("sglang.srt.models.deepseek_v2", "DeepseekV2ForCausalLM.set_eagle3_layers_to_capture", kwargs=("layer_ids",)),
    Name("sglang.srt.models.deepseek_v2", "DeepseekV3ForCausalLM"),
    Name(
        "sglang.srt.models.kimi_k25",
        "KimiK25ForConditionalGeneration",
        attrs=("set_eagle3_layers_to_capture", "language_model"),
        why="Kimi-K2.5's multimodal wrapper forwards the capture request to its DeepseekV3 language_model",
    ),
)

CAPTURE_SETTER = ("sglang.srt.models.deepseek_v2", "DeepseekV2ForCausalLM.set_eagle3_layers_to_capture")


# ---------------------------------------------------------------- layer-id convention


class CaptureRule(str, enum.Enum):  # noqa: UP042 - StrEnum would change str() of a rule
    """How `set_eagle3_layers_to_capture(ids)` turns ids into `layers_to_capture`.

    SGLang captures `hidden_states + residual` at the INPUT of each layer in `layers_to_capture`,
    i.e. the output of the layer before it.
    """

    ALWAYS_PLUS_ONE = "always +1"  # before sglang#25454: [v + 1 for v in ids]
    PLUS_ONE_IF_FIRST_IS_1 = "+1 only when ids[0] == 1"  # sglang#25454 (May 2026) onward; 0.5.23


def layers_to_capture(argument: list[int], rule: CaptureRule) -> list[int]:
    """What SGLang's DeepseekV2 sets `model.layers_to_capture` to for `argument` under `rule`."""
    if rule is CaptureRule.ALWAYS_PLUS_ONE or (argument and argument[0] == 1):
        return [v + 1 for v in argument]
    return list(argument)


def capture_argument(layer_ids: list[int], num_layers: int, rule: CaptureRule) -> list[int]:
    """The ids to hand SGLang so that it captures the outputs of our 0-based `layer_ids`.

    Capturing the output of layer i means capturing at the input of layer i + 1, so the output of
    the last layer (the pre-norm final state) cannot be captured: ids run 0 .. num_layers - 2.
    A list starting with 1 means the same under every rule (SGLang adds 1). Under the #25454 rule
    any other list is read as layer inputs, so we add the 1 ourselves; the output of layer 0 then
    reads as `[1, ...]` and would be shifted again, so it cannot be asked for.
    """
    ids = list(layer_ids)
    if not ids or ids != sorted(set(ids)):
        raise ValueError(f"layer ids must be distinct and ascending (the capture order is low -> high), got {ids}")
    if ids[0] < 0 or ids[-1] > num_layers - 2:
        raise ValueError(
            f"layer ids must lie in 0..{num_layers - 2} for a {num_layers}-layer target "
            f"(SGLang captures a layer's output at the next layer's input), got {ids}"
        )
    if rule is CaptureRule.ALWAYS_PLUS_ONE or ids[0] == 1:
        argument = ids
    else:
        argument = [i + 1 for i in ids]
        if argument[0] == 1:
            raise ValueError(
                "SGLang's set_eagle3_layers_to_capture cannot express the output of layer 0 "
                f"under the rule '{rule.value}' (an id list starting with 1 is shifted by one)"
            )
    assert layers_to_capture(argument, rule) == [i + 1 for i in ids]
    return argument


def capture_rule_from_source(function_source: str) -> CaptureRule | None:
    """The rule a `set_eagle3_layers_to_capture` implements, read from its source; None if unknown."""
    tree = ast.parse(textwrap.dedent(function_source))
    plus_one = first_is_one = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq):
            left, right = node.left, node.comparators[0]
            if (
                isinstance(left, ast.Subscript)
                and isinstance(left.slice, ast.Constant)
                and left.slice.value == 0
                and isinstance(right, ast.Constant)
                and right.value == 1
            ):
                first_is_one = True
        if (
            isinstance(node, ast.ListComp)
            and isinstance(node.elt, ast.BinOp)
            and isinstance(node.elt.op, ast.Add)
            and isinstance(node.elt.right, ast.Constant)
            and node.elt.right.value == 1
        ):
            plus_one = True
    if plus_one and first_is_one:
        return CaptureRule.PLUS_ONE_IF_FIRST_IS_1
    if plus_one:
        return CaptureRule.ALWAYS_PLUS_ONE
    return None


# ---------------------------------------------------------------- locating sglang


def package_dir(source_root: Path | None = None) -> Path | None:
    """The `sglang` package directory: under `source_root` (a checkout's `python/`, or the directory
    holding `sglang/`, or the package itself), else the installed one (found without importing it)."""
    if source_root is not None:
        root = Path(source_root)
        for candidate in (root / "sglang", root / "python" / "sglang", root):
            if (candidate / "srt").is_dir() and (candidate / "__init__.py").is_file():
                return candidate
        return None
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def source_version(pkg: Path) -> str | None:
    """The version a source tree declares (wheels carry `_version.py`; git checkouts do not)."""
    for name in ("_version.py", "version.py"):
        f = pkg / name
        if f.is_file():
            m = re.search(r"""__version__\s*(?::\s*str\s*)?=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", f.read_text())
            if m:
                return m.group(1)
    return None


def installed_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def version_in_range(v: str) -> bool:
    nums = tuple(int(x) for x in re.findall(r"\d+", v)[:3])
    return (0, 5, 23) <= nums < (0, 5, 24)


# ---------------------------------------------------------------- the checker over source (ast)


@dataclass
class _Found:
    module: str
    node: ast.AST


def _class_node(found: _Found) -> ast.ClassDef:
    """The class `found` names: its callers pass classes (`resolve` follows classes, `fields_from` names ServerArgs)."""
    return cast(ast.ClassDef, found.node)


class SourceTree:
    """Looks names up in an sglang source tree by parsing files; imports nothing."""

    def __init__(self, pkg: Path):
        self.pkg = pkg
        self.root = pkg.parent
        self._asts: dict[str, ast.Module | None] = {}

    def module_file(self, module: str) -> Path | None:
        base = self.root.joinpath(*module.split("."))
        for f in (base.with_suffix(".py"), base / "__init__.py"):
            if f.is_file():
                return f
        return None

    def module_ast(self, module: str) -> ast.Module | None:
        if module not in self._asts:
            f = self.module_file(module)
            self._asts[module] = ast.parse(f.read_text(encoding="utf-8"), str(f)) if f else None
        return self._asts[module]

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        is_pkg = (f := self.module_file(module)) is not None and f.name == "__init__.py"
        parts = module.split(".")
        base = parts if is_pkg else parts[:-1]
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def find(self, module: str, name: str, _seen: set | None = None) -> _Found | None:
        """The definition of `name` in `module`, following re-exports and star imports."""
        seen = _seen if _seen is not None else set()
        if (module, name) in seen:
            return None
        seen.add((module, name))
        tree = self.module_ast(module)
        if tree is None:
            return None
        star: list[str] = []
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                return _Found(module, node)
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return _Found(module, node)
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
                return _Found(module, node)
        for imp in ast.walk(tree):  # imports, also those inside try/if blocks
            if isinstance(imp, ast.ImportFrom):
                source = self._absolute(module, imp)
                for alias in imp.names:
                    if alias.name == "*":
                        star.append(source)
                    elif (alias.asname or alias.name) == name:
                        found = self.find(source, alias.name, seen)
                        return found if found is not None else self._module(f"{source}.{alias.name}")
        for source in star:
            if (found := self.find(source, name, seen)) is not None:
                return found
        return self._module(f"{module}.{name}")

    def _module(self, module: str) -> _Found | None:
        """The module itself (a name imported from a package may be its submodule), if its file is there."""
        tree = self.module_ast(module)
        return _Found(module, tree) if tree is not None else None

    def resolve(self, module: str, qualname: str) -> _Found | None:
        head, *rest = qualname.split(".")
        found = self.find(module, head)
        for part in rest:
            if found is None or not isinstance(found.node, ast.ClassDef):
                return None
            found = self.class_member(found, part)
        return found

    def bases(self, cls: _Found) -> list[_Found]:
        out = []
        for b in _class_node(cls).bases:
            name = b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else None
            if name and (found := self.find(cls.module, name)) is not None and isinstance(found.node, ast.ClassDef):
                out.append(found)
        return out

    def class_member(self, cls: _Found, name: str, _depth: int = 0) -> _Found | None:
        for node in _class_node(cls).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                return _Found(cls.module, node)
        if _depth < 10:
            for base in self.bases(cls):
                if (found := self.class_member(base, name, _depth + 1)) is not None:
                    return found
        return None

    def members(self, cls: _Found, _depth: int = 0) -> set[str]:
        """Methods, class attributes and fields, and `self.x` assigned in any method; with bases."""
        names: set[str] = set()
        for node in _class_node(cls).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
        for sub in ast.walk(cls.node):
            targets = (
                sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(sub, ast.AnnAssign) else []
            )
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    names.add(t.attr)
        if _depth < 10:
            for base in self.bases(cls):
                names |= self.members(base, _depth + 1)
        return names

    def fields(self, cls: _Found, _depth: int = 0) -> set[str]:
        """Annotated class-level fields (dataclasses, msgspec structs), with bases."""
        names = {
            n.target.id
            for n in _class_node(cls).body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
        }
        if _depth < 10:
            for base in self.bases(cls):
                names |= self.fields(base, _depth + 1)
        return names

    def package_fields(self, package: str) -> set[str]:
        """Annotated fields of every class in every module of `package` (ServerArgs's namespaces)."""
        f = self.module_file(package)
        if f is None:
            return set()
        files = sorted(f.parent.glob("*.py")) if f.name == "__init__.py" else [f]
        names: set[str] = set()
        for path in files:
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ClassDef):
                    names |= {
                        n.target.id
                        for n in node.body
                        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                    }
        return names

    def parameters(self, found: _Found) -> tuple[set[str], bool] | None:
        """(parameter names, takes **kwargs) of a function, or of a class's constructor."""
        node = found.node
        if isinstance(node, ast.ClassDef):
            init = self.class_member(found, "__init__")
            if init is None:
                return self.fields(found), False
            node = init.node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return None
        a = node.args
        return {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)}, a.kwarg is not None

    def source_of(self, found: _Found) -> str:
        f = self.module_file(found.module)
        assert f is not None  # `found` was read from this file
        return ast.get_source_segment(f.read_text(encoding="utf-8"), found.node) or ""


def _check_source(tree: SourceTree, contract: Iterable[Name]) -> list[str]:
    problems = []
    for name in contract:
        found = tree.resolve(name.module, name.qualname)
        if found is None:
            problems.append(f"{name.dotted}: not found")
            continue
        if name.kwargs:
            if name.fields_from:
                accepted, var_kw = tree.package_fields(name.fields_from) | tree.fields(found), False
            else:
                params = tree.parameters(found)
                if params is None:
                    problems.append(f"{name.dotted}: not a function or class, cannot take {list(name.kwargs)}")
                    continue
                accepted, var_kw = params
            missing = [k for k in name.kwargs if k not in accepted]
            if missing and not var_kw:
                problems.append(f"{name.dotted}: no parameter {', '.join(missing)}")
        if name.attrs:
            if not isinstance(found.node, ast.ClassDef):
                problems.append(f"{name.dotted}: not a class, cannot have {list(name.attrs)}")
                continue
            have = tree.members(found)
            missing = [a for a in name.attrs if a not in have]
            if missing:
                problems.append(f"{name.dotted}: no attribute {', '.join(missing)}")
    return problems


# ---------------------------------------------------------------- the checker over the import


def _import_object(name: Name):
    obj = importlib.import_module(name.module)
    for part in name.qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _instance_attrs(cls: type) -> set[str]:
    names: set[str] = set()
    for klass in inspect.getmro(cls):
        names |= set(getattr(klass, "__annotations__", {}))
        names |= set(getattr(klass, "__struct_fields__", ()))
        try:
            src = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        for node in ast.walk(ast.parse(src)):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            names |= {
                t.attr
                for t in targets
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
            }
    return names


def _check_import(contract: Iterable[Name]) -> list[str]:
    problems = []
    for name in contract:
        try:
            obj = _import_object(name)
        except Exception as e:  # noqa: BLE001 - ImportError, AttributeError, or whatever importing raised
            problems.append(f"{name.dotted}: cannot import ({type(e).__name__}: {e})")
            continue
        if name.kwargs:
            struct_fields = getattr(obj, "__struct_fields__", None)
            if struct_fields is not None:
                accepted, var_kw = set(struct_fields), False
            else:
                try:
                    sig = inspect.signature(obj)
                except (TypeError, ValueError) as e:
                    problems.append(f"{name.dotted}: no signature ({e})")
                    continue
                accepted = set(sig.parameters)
                var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
            missing = [k for k in name.kwargs if k not in accepted]
            if missing and not var_kw:
                problems.append(f"{name.dotted}: no parameter {', '.join(missing)}")
        if name.attrs:
            if not inspect.isclass(obj):
                problems.append(f"{name.dotted}: not a class, cannot have {list(name.attrs)}")
                continue
            missing = [a for a in name.attrs if not hasattr(obj, a)]
            if missing:
                have = _instance_attrs(obj)
                missing = [a for a in missing if a not in have]
            if missing:
                problems.append(f"{name.dotted}: no attribute {', '.join(missing)}")
    return problems


# ---------------------------------------------------------------- entry points


def check_contract(
    source_root: Path | None = None, *, mode: str = "source", contract: Iterable[Name] | None = None
) -> list[str]:
    """Problems with the names in `contract` (default: CONTRACT) in an SGLang build; [] means all are there.

    mode "source" (default) parses files: those under `source_root`, else the installed package's
    (located without importing it). mode "import" imports sglang and inspects live objects.
    With the default contract, the source must also show a known layer-id rule (`capture_rule`).
    """
    check_rule = contract is None
    contract = CONTRACT if contract is None else tuple(contract)
    if mode == "import":
        if source_root is not None:
            raise ValueError("mode='import' checks the importable sglang; give no source_root")
        return _check_import(contract)
    if mode != "source":
        raise ValueError(f"mode must be 'source' or 'import', got {mode!r}")
    pkg = package_dir(source_root)
    if pkg is None:
        where = f"under {source_root}" if source_root is not None else "installed"
        return [f"no sglang package {where} ({INSTALL_HINT})"]
    problems = _check_source(SourceTree(pkg), contract)
    if check_rule and not problems and capture_rule(source_root) is None:
        problems.append(f"{'.'.join(CAPTURE_SETTER)}: layer-id rule not recognised in its source")
    return problems


def capture_rule(source_root: Path | None = None) -> CaptureRule | None:
    """The `set_eagle3_layers_to_capture` rule of the SGLang at `source_root` (or installed)."""
    pkg = package_dir(source_root)
    if pkg is None:
        return None
    tree = SourceTree(pkg)
    found = tree.resolve(*CAPTURE_SETTER)
    return capture_rule_from_source(tree.source_of(found)) if found is not None else None


def capture_rule_of_import() -> CaptureRule | None:
    """The rule of the imported SGLang's DeepseekV2 (inside a rank process)."""
    module = importlib.import_module(CAPTURE_SETTER[0])
    cls_name, method = CAPTURE_SETTER[1].split(".")
    return capture_rule_from_source(inspect.getsource(getattr(getattr(module, cls_name), method)))
