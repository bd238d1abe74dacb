"""benchmarks/sglang_engine_speculative.py: SGLang's offline Engine with and without the drafter.

On a CPU the script runs end to end with a fake `sglang.Engine` injected (an object with the members the script
uses, answering `async_generate` with SGLang 0.5.23's `meta_info`), so the accept length, the speeds, the speed-up
and the report are proven on known numbers. Every name the script relies on (Engine arguments, Engine members,
`async_generate`'s keywords, sampling parameters, meta_info keys) is checked against the pinned sglang wheel's own
source by `ast`, and the check is shown to catch a rename in a copy of that source."""

from __future__ import annotations

import ast
import asyncio
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pytest
from support import drafter_report

from eagle3_resources.hidden_states import sglang_api
from eagle3_resources.hidden_states.sglang_api import Name

if TYPE_CHECKING:
    pass

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "sglang_engine_speculative.py"
sys.path.insert(0, str(SCRIPT.parent))  # as the script itself does: its folder holds speculative_common

import sglang_engine_speculative as bench  # noqa: E402
import speculative_common as common  # noqa: E402

# ---------------------------------------------------------------------------------------------- the fake engine

# accept length (SGLang's definition) the fake produces: by prompt-length parity and greedy or sampled
ACCEPT = {(0, True): 3.0, (1, True): 2.0, (0, False): 2.0, (1, False): 1.5}


def tokens_and_verifies(prompt_len: int, max_new_tokens: int, temperature: float) -> tuple[int, int]:
    """A prompt of even length gets max_new_tokens tokens, an odd one half as many, in tokens / accept passes."""
    tokens = max_new_tokens if prompt_len % 2 == 0 else max_new_tokens // 2
    return tokens, max(1, round(tokens / ACCEPT[(prompt_len % 2, temperature == 0)]))


class FakeEngine:
    """What the script uses of `sglang.Engine`: `loop` (the engine's event loop, which `Engine.generate` runs on),
    `async_generate(input_ids=, sampling_params=)`, `flush_cache()` (a FlushCacheReqOutput) and `shutdown()`.
    Answers as 0.5.23's tokenizer_manager builds meta_info; the spec_* keys only with a drafter."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.speculative = kwargs.get("speculative_algorithm") == "EAGLE3"
        self.loop = asyncio.new_event_loop()
        self.flushes = 0
        self.requests: list[tuple[int, list[int], dict]] = []  # (phase = flushes so far, input_ids, sampling_params)
        self.inflight = 0
        self.peak: dict[int, int] = {}  # the most requests in flight at once, per phase
        self.closed = False

    async def async_generate(self, input_ids=None, sampling_params=None):
        assert not self.closed
        phase = self.flushes
        self.requests.append((phase, list(input_ids), dict(sampling_params)))
        self.inflight += 1
        self.peak[phase] = max(self.peak.get(phase, 0), self.inflight)
        try:
            await asyncio.sleep(0.001)  # every admitted request is in flight before the first one answers
        finally:
            self.inflight -= 1
        n, verifies = tokens_and_verifies(
            len(input_ids), sampling_params["max_new_tokens"], sampling_params["temperature"]
        )
        meta = {
            "id": f"r{len(self.requests)}",
            "finish_reason": {"type": "length", "length": n},
            "prompt_tokens": len(input_ids),
            "weight_version": "default",
            "reasoning_tokens": 0,
            "completion_tokens": n,
            "cached_tokens": 0,
            "e2e_latency": 0.001,
        }
        if self.speculative:
            proposed = verifies * (self.kwargs["speculative_num_draft_tokens"] - 1)
            meta |= {
                "spec_accept_rate": (n - verifies) / proposed,
                "spec_accept_length": n / verifies,
                "spec_num_correct_drafts": n - verifies,
                "spec_num_proposed_drafts": proposed,
                "spec_verify_ct": verifies,
            }
        return {"text": "x" * n, "output_ids": list(range(n)), "meta_info": meta}

    def flush_cache(self):
        self.flushes += 1
        return SimpleNamespace(success=True, message="")

    def shutdown(self):
        self.closed = True
        self.loop.close()


class FakeSGLang:
    """Stands in for `sglang.Engine`: makes FakeEngines, and refuses a second while the first still runs."""

    def __init__(self) -> None:
        self.engines: list[FakeEngine] = []

    def __call__(self, **kwargs):
        assert all(e.closed for e in self.engines), "an engine started before the previous one was shut down"
        self.engines.append(FakeEngine(**kwargs))
        return self.engines[-1]


def write_prompts(path: Path, n_eval: int, n_train: int) -> list[list[int]]:
    """A JSONL of prompts as the merged set's rows (split, input_ids cut at prompt_len); returns the eval prompts."""
    rows, evals = [], []
    for i in range(n_eval + n_train):
        plen = 5 + i % 4
        ids = [1000 + 10 * i + k for k in range(plen)] + [7, 7, 7]
        split = "eval" if i < n_eval else "train"
        rows.append({"sample_id": f"ds/p{i:03d}", "split": split, "input_ids": ids, "prompt_len": plen})
        if split == "eval":
            evals.append(ids[:plen])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return evals


# ------------------------------------------------------------------------------------------------ end to end


def test_both_engines_every_temperature_and_concurrency_on_a_fake_sglang(tmp_path, capsys):
    n, max_new = 20, 60
    evals = write_prompts(tmp_path / "prompts.jsonl", n_eval=n, n_train=5)
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "model.safetensors").write_bytes(b"weights")
    out = tmp_path / "engine.json"
    sglang = FakeSGLang()
    rc = bench.main(
        [
            "--target",
            "/models/Kimi-K2.5",
            "--drafter",
            str(drafter),
            "--tp",
            "8",
            "--prompts",
            str(tmp_path / "prompts.jsonl"),
            "--num-prompts",
            str(n),
            "--concurrency",
            "1,4,16",
            "--max-new-tokens",
            str(max_new),
            "--warmup",
            "2",
            "--output",
            str(out),
        ],
        engine_factory=sglang,
    )
    assert rc == 0
    printed = capsys.readouterr().out

    # one engine at a time (FakeSGLang refuses otherwise), baseline first, each shut down
    base, spec = sglang.engines
    assert base.kwargs == bench.engine_kwargs("/models/Kimi-K2.5", tp=8, seed=0)
    assert spec.kwargs == bench.engine_kwargs("/models/Kimi-K2.5", tp=8, seed=0, drafter=str(drafter))
    assert spec.kwargs["speculative_num_steps"] == 3 and spec.kwargs["speculative_eagle_topk"] == 1
    assert spec.kwargs["speculative_num_draft_tokens"] == 4 and base.closed and spec.closed

    temps, concs = ["0", "1"], [1, 4, 16]
    for engine in (base, spec):
        assert engine.flushes == len(temps) * len(concs)  # the cache flushed before each measured batch
        warm = [r for r in engine.requests if r[0] == 0]
        assert len(warm) == 2 and all(sp["temperature"] == 0 and sp["max_new_tokens"] == 16 for _, _, sp in warm)
        for phase in range(1, 7):
            batch = [r for r in engine.requests if r[0] == phase]
            t = 0.0 if phase <= 3 else 1.0
            assert sorted(ids for _, ids, _ in batch) == sorted(evals)  # every eval prompt once, never a train one
            expected = {"temperature": t, "max_new_tokens": max_new, "ignore_eos": False} | (
                {"top_p": 0.95} if t else {}
            )
            assert all(sp == expected for _, _, sp in batch)
            assert engine.peak[phase] == concs[(phase - 1) % 3]  # exactly C requests in flight

    report = json.loads(out.read_text())
    assert report["source"] == "sglang_engine" and report["sglang_version"] is None  # the fake has no version
    assert report["drafter"]["path"] == str(drafter)
    assert report["drafter"]["weights_sha256"] == {"model.safetensors": hashlib.sha256(b"weights").hexdigest()}
    for tk, greedy in (("0", True), ("1", False)):
        counts = [tokens_and_verifies(len(p), max_new, 0.0 if greedy else 1.0) for p in evals]
        tokens, verifies = sum(c for c, _ in counts), sum(v for _, v in counts)
        accept = tokens / verifies  # SGLang's definition pooled over requests, not a mean of per-request ratios
        summary = report["summary"][tk]
        assert summary["accept_length"] == pytest.approx(accept)
        assert summary["completion_tokens"] == 3 * tokens and summary["spec_verify_ct"] == 3 * verifies
        for bs in ("1", "4", "16"):
            b, s = report["results"][tk]["baseline"][bs], report["results"][tk]["eagle3"][bs]
            assert b["completion_tokens"] == s["completion_tokens"] == tokens
            assert b["accept_length"] is None and s["spec_verify_ct"] == verifies
            assert s["accept_length"] == pytest.approx(accept) == summary["accept_length_by_concurrency"][bs]
            for x in (b, s):
                assert x["output_tokens_per_s"] == pytest.approx(x["completion_tokens"] / x["wall_s"])
            assert (
                s["speedup"]
                == pytest.approx(s["output_tokens_per_s"] / b["output_tokens_per_s"])
                == summary["speedup"][bs]
            )
            assert summary["output_tokens_per_s"][bs] == {
                "baseline": b["output_tokens_per_s"],
                "eagle3": s["output_tokens_per_s"],
            }
            assert len(report["requests"][tk]["eagle3"][bs]) == n
        assert (
            f"temperature {tk} ({'greedy' if greedy else 'sampled, top_p 0.95'}): accept length {accept:.3f}" in printed
        )
    assert (
        report["summary"]["0"]["accept_length"] > report["summary"]["1"]["accept_length"]
    )  # the fake's sampled drafts miss more


def test_the_pooled_accept_length_is_not_a_mean_of_request_ratios():
    """Two requests with accept lengths 3 (60 tokens) and 2 (30 tokens): SGLang's pooled figure is 90 / 35."""
    recs = {
        "eagle3": {
            "1": [
                {"completion_tokens": 60, "spec_verify_ct": 20, "spec_accept_length": 3.0},
                {"completion_tokens": 30, "spec_verify_ct": 15, "spec_accept_length": 2.0},
            ]
        }
    }
    results = {
        "baseline": {"1": {"output_tokens_per_s": 10.0}},
        "eagle3": {"1": {"accept_length": 90 / 35, "output_tokens_per_s": 25.0, "speedup": 2.5}},
    }
    s = bench.temperature_summary(results, recs)
    assert s["accept_length"] == pytest.approx(90 / 35) and s["spec_verify_ct"] == 35
    assert s["output_tokens_per_s"] == {"1": {"baseline": 10.0, "eagle3": 25.0}} and s["speedup"] == {"1": 2.5}


def test_engine_kwargs_and_refusals():
    assert bench.engine_kwargs("/m", tp=8) == {"model_path": "/m", "tp_size": 8, "trust_remote_code": True}
    assert bench.engine_kwargs(
        "/m", tp=1, drafter="/d", mem_fraction_static=0.8, seed=3, extra={"cuda_graph_max_bs_decode": 16}
    ) == {
        "model_path": "/m",
        "tp_size": 1,
        "trust_remote_code": True,
        "mem_fraction_static": 0.8,
        "random_seed": 3,
        "speculative_algorithm": "EAGLE3",
        "speculative_draft_model_path": "/d",
        "speculative_num_steps": 3,
        "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": 4,
        "cuda_graph_max_bs_decode": 16,
    }
    with pytest.raises(ValueError):
        bench.engine_kwargs("/m", tp=8, drafter="/d", num_steps=3, topk=1, num_draft_tokens=5)
    assert bench.parse_engine_arg("cuda_graph_max_bs_decode=16") == ("cuda_graph_max_bs_decode", 16)
    assert bench.parse_engine_arg("attention_backend=fa3") == ("attention_backend", "fa3")


def test_dry_run_prints_the_engine_arguments_and_a_run_without_sglang_says_how_to_install(tmp_path):
    """The script imports nothing heavy (no sglang, torch, dagster, pyarrow) until the engines start, and where sglang
    is missing (this host) it stops with the install command before reading any prompt."""
    dry = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--target",
            "/models/Kimi-K2.5",
            "--drafter",
            "/d",
            "--tp",
            "8",
            "--engine-arg",
            "cuda_graph_max_bs_decode=16",
            "--dry-run",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.splitlines()
    assert dry[0] == "# baseline" and dry[2] == "# eagle3"
    extra = {"cuda_graph_max_bs_decode": 16}
    assert json.loads(dry[1].removeprefix("sglang.Engine(**").removesuffix(")")) == bench.engine_kwargs(
        "/models/Kimi-K2.5", tp=8, seed=0, extra=extra
    )
    assert json.loads(dry[3].removeprefix("sglang.Engine(**").removesuffix(")")) == bench.engine_kwargs(
        "/models/Kimi-K2.5", tp=8, seed=0, extra=extra, drafter="/d"
    )
    probe = (
        f"import importlib.util, sys\nspec = importlib.util.spec_from_file_location('b', {str(SCRIPT)!r})\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "print(sorted(m for m in ('sglang', 'torch', 'dagster', 'pyarrow', 'polars') if m in sys.modules))\n"
    )
    assert (
        subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
        ).stdout.strip()
        == "[]"
    )
    assert importlib.util.find_spec("sglang") is None  # this host: no sglang
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--target", "/m", "--prompts", str(tmp_path / "absent.jsonl")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1
    assert "sglang is not importable" in run.stderr and sglang_api.INSTALL_HINT in run.stderr
    assert "absent.jsonl" not in run.stderr


# ------------------------------------------------------------------------- names, against the sglang release


def script_engine_names() -> tuple[set[str], set[str]]:
    """From the script's source: the members it reads on `engine`, and the keywords of its `async_generate` calls."""
    tree = ast.parse(SCRIPT.read_text())
    members = {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "engine"
    }
    keywords = {
        k.arg or "**"  # a **mapping has no name
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "async_generate"
        for k in n.keywords
    }
    return members, keywords


def script_contract() -> list[Name]:
    members, keywords = script_engine_names()
    assert members == {"async_generate", "loop", "flush_cache", "shutdown"} and keywords == {
        "input_ids",
        "sampling_params",
    }
    server_args = set(
        bench.engine_kwargs(
            "/m", tp=8, drafter="/d", mem_fraction_static=0.8, seed=0, extra={"cuda_graph_max_bs_decode": 16}
        )
    )  # --engine-arg's example
    sampling = set(common.sampling_params(16, True, temperature=1.0, top_p=0.95))
    return [
        Name("sglang", "Engine", why="sglang.Engine, what sglang_engine() returns"),
        Name("sglang", "__version__"),
        Name(
            "sglang.srt.server_args",
            "ServerArgs",
            kwargs=tuple(sorted(server_args)),
            fields_from="sglang.srt.arg_groups.fields",
            why="Engine(**kwargs) builds ServerArgs(**kwargs)",
        ),
        Name("sglang.srt.entrypoints.engine", "Engine", attrs=tuple(sorted(members))),
        Name("sglang.srt.entrypoints.engine", "Engine.async_generate", kwargs=tuple(sorted(keywords))),
        Name(
            "sglang.srt.managers.io_struct",
            "FlushCacheReqOutput",
            attrs=("success", "message"),
            why="what Engine.flush_cache returns",
        ),
        Name("sglang.srt.sampling.sampling_params", "SamplingParams", kwargs=tuple(sorted(sampling))),
    ]


def meta_info_keys(tokenizer_manager: Path) -> set[str]:
    """Keys tokenizer_manager writes into a `meta_info` dict: its literal, `meta_info[k] = ...`, `.update({...})`."""
    keys: set[str] = set()
    for n in ast.walk(ast.parse(tokenizer_manager.read_text())):
        if isinstance(n, ast.Assign):
            for t in n.targets:
                if isinstance(t, ast.Name) and t.id == "meta_info" and isinstance(n.value, ast.Dict):
                    keys |= {k.value for k in n.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
                if (
                    isinstance(t, ast.Subscript)
                    and isinstance(t.value, ast.Name)
                    and t.value.id == "meta_info"
                    and isinstance(t.slice, ast.Constant)
                    and isinstance(t.slice.value, str)
                ):
                    keys.add(t.slice.value)
        if (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr == "update"
            and isinstance(n.func.value, ast.Name)
            and n.func.value.id == "meta_info"
        ):
            for arg in n.args:
                if isinstance(arg, ast.Dict):
                    keys |= {k.value for k in arg.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return keys


def contract_problems(source_root: Path) -> list[str]:
    problems = sglang_api.check_contract(source_root, contract=script_contract())
    pkg = sglang_api.package_dir(source_root)
    assert pkg is not None, f"no sglang package under {source_root}"
    written = meta_info_keys(pkg / "srt" / "managers" / "tokenizer_manager.py")
    read = {*common.META_KEYS, "finish_reason"}  # request_record's keys
    problems += [f"meta_info[{k!r}]: not written by tokenizer_manager" for k in sorted(read - written)]
    return problems


def test_every_name_the_script_uses_is_in_the_pinned_sglang_release(sglang_release_source):
    assert contract_problems(sglang_release_source) == []


CONTRACT_FILES = (
    "__init__.py",
    "version.py",
    "_version.py",
    "srt/server_args.py",
    "srt/entrypoints/engine.py",
    "srt/managers/io_struct.py",
    "srt/managers/tokenizer_manager.py",
    "srt/sampling/sampling_params.py",
)


@pytest.mark.parametrize(
    "path, old, new, problem",
    [
        ("srt/managers/tokenizer_manager.py", '"spec_verify_ct"', '"spec_verify_count"', "meta_info['spec_verify_ct']"),
        (
            "srt/entrypoints/engine.py",
            "async def async_generate(",
            "async def async_generate_request(",
            "async_generate",
        ),
        (
            "srt/entrypoints/engine.py",
            "self.loop = self._ensure_event_loop()",
            "self.event_loop = self._ensure_event_loop()",
            "no attribute loop",
        ),
        (
            "srt/arg_groups/fields/spec.py",
            "    speculative_eagle_topk: A[",
            "    speculative_topk: A[",
            "speculative_eagle_topk",
        ),
        ("srt/sampling/sampling_params.py", "    top_p: float = 1.0", "    nucleus_p: float = 1.0", "top_p"),
    ],
)
def test_the_check_catches_a_rename_in_a_copy_of_the_release(sglang_release_source, tmp_path, path, old, new, problem):
    src = sglang_api.package_dir(sglang_release_source)
    assert src is not None
    dst = tmp_path / "sglang"
    for rel in CONTRACT_FILES:
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / rel, dst / rel)
    shutil.copytree(src / "srt" / "arg_groups" / "fields", dst / "srt" / "arg_groups" / "fields")
    assert contract_problems(tmp_path) == []  # the copy holds everything the check reads
    target = dst / path
    text = target.read_text()
    assert old in text
    target.write_text(text.replace(old, new))
    problems = contract_problems(tmp_path)
    assert problems and all(problem in p for p in problems), problems


# ------------------------------------------------------------------ the figures on the drafter asset, and their source


def fake_engine_report(tmp_path: Path) -> tuple[Path, Path]:
    """A real report of the script, engines faked: (report path, drafter folder)."""
    write_prompts(tmp_path / "prompts.jsonl", n_eval=8, n_train=2)
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "model.safetensors").write_bytes(b"trained weights")
    (drafter / "config.json").write_text("{}")
    out = tmp_path / "engine.json"
    assert (
        bench.main(
            [
                "--target",
                "/models/Kimi-K2.5",
                "--drafter",
                str(drafter),
                "--prompts",
                str(tmp_path / "prompts.jsonl"),
                "--concurrency",
                "1,4",
                "--max-new-tokens",
                "30",
                "--warmup",
                "0",
                "--output",
                str(out),
            ],
            engine_factory=FakeSGLang(),
        )
        == 0
    )
    return out, drafter


def figures_cli(report: Path, home: Path, data: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_", "EAGLE3_"))}
    return subprocess.run(
        [sys.executable, "-m", "eagle3_assets.operations.record_figures", str(report)],
        cwd=REPO,
        env=env | {"DAGSTER_HOME": str(home), "EAGLE3_DATA_DIR": str(data)},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_engine_figures_are_recorded_on_the_drafter_asset_and_refused_for_other_weights(tmp_path, capsys):
    """`python -m eagle3_assets.operations.record_figures REPORT` records the Engine benchmark's figures as an
    observation of eagle3_drafter, each named by its source; once the drafter's weights change it refuses (the
    figures would be another drafter's)."""
    import dagster as dg

    from eagle3_assets.stages.eagle3_drafter.figures import DRAFTER_ASSET, SOURCES

    report_path, drafter = fake_engine_report(tmp_path)
    capsys.readouterr()
    report = json.loads(report_path.read_text())
    home, data = tmp_path / "dagster_home", tmp_path / "data"
    done = figures_cli(report_path, home, data)
    assert done.returncode == 0, done.stderr + done.stdout
    acc0, acc1 = report["summary"]["0"]["accept_length"], report["summary"]["1"]["accept_length"]
    assert f"accept length {acc0:.3f} at temperature 0; accept length {acc1:.3f} at temperature 1" in done.stdout

    (drafter / "model.safetensors").write_bytes(b"retrained weights")
    refused = figures_cli(report_path, home, data)
    assert refused.returncode == 1 and "not the one benchmarked (model.safetensors changed" in refused.stderr

    with dg.DagsterInstance.from_config(str(home)) as instance:
        records = instance.fetch_observations(DRAFTER_ASSET, limit=10).records
    assert len(records) == 1  # the refused one recorded nothing
    observation = records[0].asset_observation
    assert observation is not None
    meta: dict[str, Any] = {k: getattr(v, "value", v) for k, v in observation.metadata.items()}
    assert meta["sglang_engine_source"].startswith(SOURCES["sglang_engine"])
    assert (
        "Target /models/Kimi-K2.5, EAGLE-3 steps/topk/draft tokens 3/1/4, 8 eval prompts"
        in meta["sglang_engine_source"]
    )
    assert meta["sglang_engine_accept_length_t0"] == pytest.approx(acc0)
    assert meta["sglang_engine_accept_length_t1"] == pytest.approx(acc1)
    for tk in ("0", "1"):
        for bs in ("1", "4"):
            assert meta[f"sglang_engine_speedup_t{tk}_c{bs}"] == pytest.approx(report["summary"][tk]["speedup"][bs])
    assert meta["drafter_weights_sha256"] == {"model.safetensors": hashlib.sha256(b"trained weights").hexdigest()}
    assert meta["sglang_engine_report"] == str(report_path.resolve())
    assert (
        f"| 1 | 4 | {report['summary']['1']['accept_length_by_concurrency']['4']:.3f} |"
        in meta["sglang_engine_figures"]
    )


def test_the_server_benchmark_figures_are_recorded_with_their_own_source(tmp_path):
    """The HTTP server benchmark's JSON (servers started by hand: no weights recorded) records under `sglang_server_*`,
    saying the figures are not tied to particular weights."""
    import dagster as dg
    from test_serving_bench import SCRIPT as SERVER_SCRIPT
    from test_serving_bench import FakeSGLang as FakeServer
    from test_serving_bench import write_merged

    from eagle3_assets.stages.eagle3_drafter.figures import DRAFTER_ASSET, SOURCES, record_figures

    write_merged(tmp_path / "merged.parquet", n_eval=4, n_train=2)
    out = tmp_path / "server.json"
    with (
        FakeServer(0.0, speculative=False, starting_polls=0) as base,
        FakeServer(0.0, speculative=True, starting_polls=0) as spec,
    ):
        run = subprocess.run(
            [
                sys.executable,
                str(SERVER_SCRIPT),
                "--url",
                spec.url,
                "--baseline-url",
                base.url,
                "--dataset",
                str(tmp_path / "merged.parquet"),
                "--num-prompts",
                "4",
                "--batch-sizes",
                "1,4",
                "--max-new-tokens",
                "60",
                "--warmup",
                "0",
                "--output",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert run.returncode == 0, run.stderr + run.stdout
    report = json.loads(out.read_text())
    assert report["source"] == "sglang_server" and report["drafter"] is None
    with dg.instance_for_test() as instance:
        record_figures(out, instance)
        (record,) = instance.fetch_observations(DRAFTER_ASSET, limit=10).records
    assert record.asset_observation is not None
    meta: dict[str, Any] = {k: getattr(v, "value", v) for k, v in record.asset_observation.metadata.items()}
    assert meta["sglang_server_source"].startswith(SOURCES["sglang_server"])
    assert meta["sglang_server_accept_length_t0"] == pytest.approx(report["summary"]["0"]["accept_length"])
    assert meta["sglang_server_speedup_t0_c4"] == pytest.approx(report["results"]["eagle3"]["4"]["speedup"])
    assert "not tied to particular weights" in meta["drafter_weights"] and "drafter_weights_sha256" not in meta
    assert not any(k.startswith("sglang_engine") for k in meta)


def test_the_materialization_names_the_source_of_each_accept_length():
    """The drafter's own figures: the decoded one from the transformers loop, the simulated one teacher-forced."""
    from eagle3_assets.stages.eagle3_drafter.asset import accept_length_metadata
    from eagle3_assets.stages.eagle3_drafter.figures import SOURCES

    report = drafter_report(trained={"accept_length": 5.09}, untrained={"accept_length": 1.8})
    meta = accept_length_metadata(
        report,
        {"accept_length_real": 3.21, "accept_length_real_untrained": 1.52, "label": "proxy (stand-in target)"},
        None,
    )
    assert meta["accept_length_real_source"] == SOURCES["transformers"] + "; target: proxy (stand-in target)"
    assert "lossless speculative decoding in transformers" in meta["accept_length_real_source"]
    assert meta["accept_length_simulated_source"] == SOURCES["simulated"]
    assert "teacher-forced" in meta["accept_length_simulated_source"]
