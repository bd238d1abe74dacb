"""The walk of the completions run config: from the `completions` asset to the HTTP client, file by file (issue 26).

    PYTHONPATH=tests .venv/bin/python benchmarks/completions_walk.py

Materializes one partition of `completions` (B6, a pilot of 4, a run cap) against the fake OpenRouter on loopback
(tests/fakes; no network) with the test suite's stand-in target, under a profiler that follows the run config:

- taint: the asset's `config` (CompletionsConfig) and `completions_backend` (CompletionsResource), the float values
  of their fields, every object of a config-carrying type (CARRIERS) that a call handed a tainted value returns, and
  `self` of such a type's `__init__` when handed a tainted value;
- a stop: a call into project code handed a tainted value (or whose `self` is tainted) whose caller is in another
  file; the walk is the distinct (caller file, callee file) pairs in the order they first happen; reading a value
  (a method of a frozen dataclass or of the request settings) is not a stop;
- a climb back: a stop in a file the walk already visited.

It prints the walk, then `N stops in F files, C climbs back`. Takes about a minute.
"""

from __future__ import annotations

import os
import sys
import threading
import types
from pathlib import Path
from typing import Any

import pytest

ROOT = str(Path(__file__).resolve().parents[1]) + "/"
PKGS = (ROOT + "eagle3_assets/", ROOT + "eagle3_resources/")
ASSET = "eagle3_assets/stages/completions/asset.py"
CARRIERS = {
    "SamplingSettings",
    "Caps",
    "Limits",
    "Pricing",
    "PriceSheet",
    "RunOptions",
    "AdmissionTerms",
    "ClientOptions",
    "Means",
    "Partition",
    "PartitionPilot",
    "PilotRules",
    "CompletionsRun",
    "Admission",
    "OpenRouterBackend",
    "TransformersBackend",
    "SGLangBackend",
    "_PacedFeed",
    "_Place",
    "AdaptiveLimiter",
    "AsyncClient",
}
KEY = "k-walk"


def rel(path: str) -> str:
    return path[len(ROOT) :] if path.startswith(ROOT) else path


def args_of(frame: types.FrameType) -> list[tuple[str, Any]]:
    """A call's arguments, with the items of its sequences and the values of its dicts (a journal record's nested
    figures too)."""
    code = frame.f_code
    n = code.co_argcount + code.co_kwonlyargcount
    names = list(code.co_varnames[:n])
    if code.co_flags & 0x04:  # *args
        names.append(code.co_varnames[n])
        n += 1
    if code.co_flags & 0x08:  # **kwargs
        names.append(code.co_varnames[n])
    out: list[tuple[str, Any]] = []
    for name in names:
        v: Any = frame.f_locals.get(name)
        out.append((name, v))
        if type(v) in (tuple, list):
            out += [(name, x) for x in v[:8]]
        elif type(v) is dict:
            for x in list(v.values())[:32]:
                out.append((name, x))
                if type(x) is dict:
                    out += [(name, y) for y in list(x.values())[:32]]
    return out


def is_value(obj: Any) -> bool:
    params = getattr(type(obj), "__dataclass_params__", None)
    if params is not None and params.frozen:
        return True
    return type(obj).__module__ == "eagle3_resources.completions.types"  # SamplingSettings, ProviderRouting


def caller_file(frame: types.FrameType) -> str | None:
    """The project file whose code called this one; None for a task the event loop started (no caller)."""
    f = frame.f_back
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(PKGS):
            return name
        if name.endswith("asyncio/events.py"):
            return None
        f = f.f_back
    return None


class Walk:
    """The tracer, a pytest plugin: profiles every thread from the session's start to its finish."""

    def __init__(self) -> None:
        self.tainted: dict[int, object] = {}  # by id, kept alive
        self.frames: set[int] = set()
        self.edges: list[tuple[str, str, str]] = []
        self.seen: set[tuple[str, str]] = set()
        self.lock = threading.Lock()
        self.report = ""

    def mark(self, obj: Any) -> None:
        if obj is None or isinstance(obj, bool | int | str):
            return
        self.tainted[id(obj)] = obj
        if hasattr(obj, "__dict__") and type(obj).__name__ in ("CompletionsConfig", "CompletionsResource"):
            for v in vars(obj).values():
                if isinstance(v, float):
                    self.tainted[id(v)] = v

    def profile(self, frame: types.FrameType, event: str, arg: Any) -> None:
        try:
            self._profile(frame, event, arg)
        except Exception:  # a frame whose locals cannot be read: not part of the walk
            pass

    def _profile(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if event == "call":
            fn = frame.f_code.co_filename
            if not (fn.startswith(PKGS) or (fn == "<string>" and self.tainted)):
                return
            if fn == ROOT + ASSET and frame.f_code.co_name == "completions":
                self.mark(frame.f_locals.get("config"))
                self.mark(frame.f_locals.get("completions_backend"))
                return  # the walk's start
            if not any(id(v) in self.tainted for _, v in args_of(frame)):
                return
            self.frames.add(id(frame))
            if frame.f_code.co_name == "__init__":
                me = frame.f_locals.get("self")
                if me is not None and type(me).__name__ in CARRIERS:
                    self.mark(me)
            me = frame.f_locals.get("self") if frame.f_code.co_argcount else None
            if is_value(me):
                return
            if fn.startswith(PKGS):
                src = caller_file(frame)
                if src is not None and src != fn:
                    key = (rel(src), rel(fn))
                    with self.lock:
                        if key not in self.seen:
                            self.seen.add(key)
                            self.edges.append((rel(src), rel(fn), frame.f_code.co_qualname))
        elif event == "return" and id(frame) in self.frames:
            self.frames.discard(id(frame))
            if arg is not None and type(arg).__name__ in CARRIERS:
                self.mark(arg)

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        threading.setprofile(self.profile)
        sys.setprofile(self.profile)

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        sys.setprofile(None)
        threading.setprofile(None)
        self.report = render(self.edges)


def render(edges: list[tuple[str, str, str]]) -> str:
    stops, climbs = [ASSET], 0
    lines = [f" 1. {ASSET}"]
    for src, dst, name in edges:
        if src not in stops:  # reached by a task the event loop started (no caller in the project)
            stops.append(src)
            lines.append(f"{len(lines) + 1:2d}. {src}  (a task the event loop started)")
        back = dst in stops
        climbs += back
        if not back:
            stops.append(dst)
        lines.append(f"{len(lines) + 1:2d}. {dst}  <- {src} ({name}){'  CLIMBS BACK' if back else ''}")
    return "\n".join(lines) + f"\n{len(lines)} stops in {len(stops)} files, {climbs} climbs back"


def test_walk(data_dir_with_standin: Path, tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The drive: one partition of `completions` with a pilot and a run cap, against the fake OpenRouter."""
    import dagster as dg
    from fakes.openrouter import FakeOpenRouter, FakeSettings, ServerThread

    from eagle3_assets.money import SpendPolicy
    from eagle3_assets.stages.completions.asset import completions
    from eagle3_assets.stages.raw_prompts.asset import raw_prompts
    from eagle3_resources.completions.resource import BackendKind, CompletionsResource
    from eagle3_resources.storage import DataStore
    from eagle3_resources.target.resource import TargetModelResource
    from eagle3_resources.tokenizer.resource import TokenizerResource

    for var in ("EAGLE3_MAX_RUN_USD", "EAGLE3_MAX_DAY_USD", "EAGLE3_MAX_TOTAL_USD", "EAGLE3_MIN_BALANCE_USD"):
        monkeypatch.delenv(var, raising=False)
    fake = FakeOpenRouter(tok, FakeSettings(api_key=KEY, latency_s=0.01, mean_reasoning_words=20))
    standin = str(data_dir_with_standin / "standin")
    with ServerThread(fake.app) as server, dg.instance_for_test() as instance:
        resources = {
            "store": DataStore(root=str(data_dir_with_standin)),
            "tokenizer": TokenizerResource(standin_dir=standin),
            "target": TargetModelResource(standin_dir=standin),
            "completions_backend": CompletionsResource(
                backend=BackendKind.OPENROUTER,
                openrouter_base_url=f"{server.base_url}/api/v1",
                openrouter_api_key=KEY,
                concurrency=4,
            ),
            "spend_policy": SpendPolicy(),
        }
        config = {"max_tokens": 64, "pilot_size": 4, "max_run_usd": 5.0, "max_projected_usd": 100.0}
        result = dg.materialize(
            [raw_prompts, completions],
            instance=instance,
            resources=resources,
            partition_key="B6",
            run_config={"ops": {"completions": {"config": config}}},
        )
    assert result.success


def main() -> int:
    walk = Walk()
    here = Path(__file__).resolve()
    os.chdir(ROOT)
    code = pytest.main(
        [str(here), "-p", "conftest", "-q", "-x", "-p", "no:cacheprovider", "-o", f"python_files={here.name}"],
        plugins=[walk],
    )
    print(walk.report)
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
