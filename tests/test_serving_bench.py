"""benchmarks/serving_speculative.py: the server commands, the summary, and its client end to end against a
loopback HTTP server in this process that answers `/health`, `/flush_cache` and `/generate` the way SGLang does."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support import alive, free_port

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "serving_speculative.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("serving_speculative", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench = load_bench()


# ----------------------------------------------------------------------------------------------- commands


def test_baseline_command_exact():
    assert bench.server_command("/models/Kimi-K2.5", port=30000, python="python") == [
        "python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/Kimi-K2.5",
        "--tp-size",
        "8",
        "--trust-remote-code",
        "--host",
        "127.0.0.1",
        "--port",
        "30000",
    ]


def test_eagle3_command_exact():
    cmd = bench.server_command(
        "/models/Kimi-K2.5",
        port=30001,
        draft_model_path="/data/eagle3/eagle3_drafter",
        mem_fraction_static=0.8,
        extra_args=["--attention-backend", "flashinfer"],
        python="python",
    )
    assert cmd == [
        "python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/Kimi-K2.5",
        "--tp-size",
        "8",
        "--trust-remote-code",
        "--host",
        "127.0.0.1",
        "--port",
        "30001",
        "--mem-fraction-static",
        "0.8",
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        "/data/eagle3/eagle3_drafter",
        "--speculative-num-steps",
        "3",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "4",
        "--attention-backend",
        "flashinfer",
    ]


def test_more_draft_tokens_than_the_tree_holds_is_refused():
    with pytest.raises(ValueError):
        bench.server_command("/m", port=1, draft_model_path="/d", num_steps=3, eagle_topk=1, num_draft_tokens=5)


def test_dry_run_prints_both_commands_and_imports_nothing_heavy():
    """The script runs on a host without this project's extras: no sglang, dagster, polars or pyarrow at import."""
    out = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--model-path",
            "/models/Kimi-K2.5",
            "--draft-model-path",
            "/data/eagle3/eagle3_drafter",
            "--python",
            "python3",
            "--port",
            "30000",
            "--dry-run",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    lines = out.splitlines()
    assert lines[0] == "# baseline" and lines[2] == "# eagle3"
    assert shlex.split(lines[1]) == bench.server_command("/models/Kimi-K2.5", port=30000, python="python3")
    assert shlex.split(lines[3]) == bench.server_command(
        "/models/Kimi-K2.5", port=30000, python="python3", draft_model_path="/data/eagle3/eagle3_drafter"
    )
    probe = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('b', {str(SCRIPT)!r})\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "print(sorted(m for m in ('sglang', 'dagster', 'polars', 'pyarrow', 'torch') if m in sys.modules))\n"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert loaded.strip() == "[]"


# ------------------------------------------------------------------------------------------------ summary


def test_summarize_aggregates_accept_length_as_sum_over_sum():
    records = [
        {
            "completion_tokens": 60,
            "spec_verify_ct": 20,
            "spec_accept_length": 3.0,
            "latency_s": 1.0,
            "finish_reason": "length",
        },
        {
            "completion_tokens": 30,
            "spec_verify_ct": 15,
            "spec_accept_length": 2.0,
            "latency_s": 2.0,
            "finish_reason": "stop",
        },
    ]
    s = bench.summarize(records, wall_s=3.0, baseline_tokens_per_s=10.0)
    assert s["accept_length"] == pytest.approx(90 / 35)  # not the mean of the ratios, 2.5
    assert s["mean_request_accept_length"] == pytest.approx(2.5)
    assert s["output_tokens_per_s"] == pytest.approx(30.0)
    assert s["speedup"] == pytest.approx(3.0)
    assert s["finish_reasons"] == {"length": 1, "stop": 1}
    base = bench.summarize([{"completion_tokens": 10, "latency_s": 1.0}], wall_s=1.0)
    assert base["accept_length"] is None and base["spec_verify_ct"] is None and base["speedup"] is None


def test_jsonl_prompts_keep_the_split_and_cut_at_prompt_len(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"sample_id": "a", "split": "eval", "input_ids": [1, 2, 3, 4], "prompt_len": 2},
                {"sample_id": "b", "split": "train", "input_ids": [9, 9]},
                {"sample_id": "c", "prompt_ids": [5, 6]},
            ]
        )
        + "\n"
    )
    assert bench.load_prompts(path, 10) == [[1, 2], [5, 6]]


# ---------------------------------------------------------------------------------- the loopback SGLang


class FakeSGLang:
    """Answers like SGLang 0.5.x: `/health` 503 while "starting" then 200, `/flush_cache`, and `/generate` on
    `input_ids` with `meta_info` (`completion_tokens`, and with speculation `spec_verify_ct`, `spec_accept_length`).

    Each request takes `delay_s`. A prompt of even length gets `max_new_tokens` tokens in max_new_tokens / 3
    verify passes, an odd one max_new_tokens / 2 tokens in max_new_tokens / 4 passes (per-request accept
    lengths 3 and 2). `gather` (phase -> n): that phase's requests are held until n are in flight at once (or
    `GATHER_S` passed), so a client's concurrency shows whatever the scheduler does with its threads. Every request
    is timed on the monotonic clock the client's own (perf_counter) runs on: `events`."""

    GATHER_S = 30.0

    def __init__(
        self, delay_s: float, speculative: bool, starting_polls: int = 3, gather: dict[int, int] | None = None
    ):
        self.delay_s, self.speculative, self.starting_polls = delay_s, speculative, starting_polls
        self.gather, self.gathered = gather or {}, set[int]()
        self.health_calls, self.flushes = 0, 0
        self.requests: list[tuple[int, dict]] = []  # (phase = flushes so far, body)
        self.inflight = 0
        self.peak: dict[int, int] = {}  # the most requests in flight at once, per phase
        # (time.monotonic(), what, phase): "health", "flush" and "generate" when each arrived, "reply" just before
        # each /generate answer is written (so before the client can have it)
        self.events: list[tuple[float, str, int]] = []
        self.lock = threading.Condition()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def reply(self, status, body=None):
                raw = b"" if body is None else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                if self.path == "/health":
                    with fake.lock:
                        fake.events.append((time.monotonic(), "health", fake.flushes))
                        fake.health_calls += 1
                        up = fake.health_calls > fake.starting_polls
                    return self.reply(200 if up else 503)
                self.reply(404, {"error": "not found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if self.path == "/flush_cache":
                    with fake.lock:
                        fake.flushes += 1
                        fake.events.append((time.monotonic(), "flush", fake.flushes))
                    return self.reply(200)
                if self.path != "/generate":
                    return self.reply(404, {"error": "not found"})
                with fake.lock:
                    phase = fake.flushes
                    fake.events.append((time.monotonic(), "generate", phase))
                    fake.requests.append((phase, body))
                    fake.inflight += 1
                    fake.peak[phase] = max(fake.peak.get(phase, 0), fake.inflight)
                    if fake.inflight >= fake.gather.get(phase, 0):
                        fake.gathered.add(phase)
                        fake.lock.notify_all()
                    fake.lock.wait_for(lambda: phase in fake.gathered, FakeSGLang.GATHER_S)
                try:
                    time.sleep(fake.delay_s)
                finally:
                    # out of flight before the answer is written: a client that sends its next request the moment
                    # it reads this one must not find this one still counted (a concurrency of 1 read as 2)
                    with fake.lock:
                        fake.events.append((time.monotonic(), "reply", phase))
                        fake.inflight -= 1
                self.reply(200, fake.answer(body))

        class Server(ThreadingHTTPServer):
            request_queue_size = 64  # 16 connections at once, none left to a SYN retry

        self.server = Server(("127.0.0.1", free_port()), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @staticmethod
    def tokens_and_verifies(prompt_len: int, max_new_tokens: int) -> tuple[int, int]:
        if prompt_len % 2 == 0:
            return max_new_tokens, max_new_tokens // 3
        return max_new_tokens // 2, max_new_tokens // 4

    def answer(self, body: dict) -> dict:
        ids, sp = body["input_ids"], body["sampling_params"]
        n, verifies = self.tokens_and_verifies(len(ids), sp["max_new_tokens"])
        meta = {
            "id": "r",
            "finish_reason": {"type": "length", "length": n},
            "prompt_tokens": len(ids),
            "completion_tokens": n,
            "cached_tokens": 0,
            "e2e_latency": self.delay_s,
        }
        if self.speculative:
            meta.update(
                spec_verify_ct=verifies,
                spec_accept_length=n / verifies,
                spec_num_correct_drafts=n - verifies,
                spec_num_proposed_drafts=verifies * 3,
                spec_accept_rate=(n - verifies) / (verifies * 3),
            )
        return {"text": "x" * n, "output_ids": list(range(n)), "meta_info": meta}

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


def write_merged(path: Path, n_eval: int, n_train: int) -> list[list[int]]:
    """A merged.parquet like merge.py writes; returns the eval prompts (input_ids[:prompt_len])."""
    rows, evals = [], []
    for i in range(n_eval + n_train):
        plen = 5 + i % 7
        ids = [1000 + i * 10 + k for k in range(plen)] + [7] * 4
        split = "eval" if i < n_eval else "train"
        rows.append(
            {
                "sample_id": f"ds/p{i:03d}",
                "dataset": "ds",
                "prompt_id": f"p{i:03d}",
                "split": split,
                "input_ids": ids,
                "loss_mask": [0] * plen + [1] * 4,
                "prompt_len": plen,
                "completion_len": 4,
                "n_tokens": plen + 4,
            }
        )
        if split == "eval":
            evals.append(ids[:plen])
    pq.write_table(pa.Table.from_pylist(rows), path)
    return evals


def test_client_end_to_end_against_a_loopback_sglang(tmp_path):
    n, max_new, d_base, d_spec = 16, 60, 0.15, 0.06
    dataset = tmp_path / "merged.parquet"
    evals = write_merged(dataset, n_eval=n, n_train=6)
    out = tmp_path / "results.json"
    gather = {2: 16}  # the second measured concurrency's 16 requests answered once all 16 are in flight
    with (
        FakeSGLang(d_base, speculative=False, gather=gather) as base,
        FakeSGLang(d_spec, speculative=True, gather=gather) as spec,
    ):
        proc = subprocess.run(
            [
                sys.executable,
                str(SCRIPT),
                "--url",
                spec.url,
                "--baseline-url",
                base.url,
                "--dataset",
                str(dataset),
                "--num-prompts",
                str(n),
                "--batch-sizes",
                "1,16",
                "--max-new-tokens",
                str(max_new),
                "--warmup",
                "2",
                "--output",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        ended = time.monotonic()
        assert proc.returncode == 0, proc.stderr + proc.stdout
        fakes = {"baseline": base, "eagle3": spec}
        for fake in fakes.values():
            assert fake.health_calls > fake.starting_polls  # waited through the 503s
            assert fake.flushes == 2  # one before each measured concurrency
            warm = [b for phase, b in fake.requests if phase == 0]
            measured = [b for phase, b in fake.requests if phase > 0]
            assert len(warm) == 2 and len(measured) == 2 * n
            for b in measured:  # greedy, token ids in, the asked length
                assert b["sampling_params"]["temperature"] == 0 and b["sampling_params"]["max_new_tokens"] == max_new
                assert "text" not in b
            for phase in (1, 2):  # the eval split, every prompt once per concurrency, never a train prompt
                assert sorted(b["input_ids"] for p, b in fake.requests if p == phase) == sorted(evals)
            # the concurrency really was 1, then 16 (all 16 in flight at once: the fake waits for them)
            assert fake.peak[1] == 1 and fake.peak[2] == 16

    report = json.loads(out.read_text())
    assert "completion_tokens / spec_verify_ct" in report["accept_length_definition"]
    res = report["results"]
    counts = [FakeSGLang.tokens_and_verifies(len(p), max_new) for p in evals]
    tokens, verifies = sum(c for c, _ in counts), sum(v for _, v in counts)
    events = sorted(e for fake in fakes.values() for e in fake.events)  # both servers, on one monotonic clock
    for phase, (bs, waves) in enumerate((("1", n), ("16", 1)), start=1):
        b, s = res["baseline"][bs], res["eagle3"][bs]
        assert b["completion_tokens"] == s["completion_tokens"] == tokens
        assert b["accept_length"] is None and b["speedup"] == pytest.approx(1.0)
        assert s["spec_verify_ct"] == verifies
        assert s["accept_length"] == pytest.approx(tokens / verifies)
        assert s["speedup"] == pytest.approx(s["output_tokens_per_s"] / b["output_tokens_per_s"])
        # The wall time is this concurrency's and nothing else's, whatever the load: no shorter than the span the
        # server saw (first request in, last answer out; so tok/s at most the configured rate) and no longer than
        # from the cache flush before it to the client's next request to either server (or its end). Bounds on the
        # clock alone (tok/s within 20% of the configured rate) would fail on a busy host.
        for label, delay in (("baseline", d_base), ("eagle3", d_spec)):
            summary, mine = res[label][bs], fakes[label].events
            arrived = [t for t, what, p in mine if what == "generate" and p == phase]
            last_reply = max(t for t, what, p in mine if what == "reply" and p == phase)
            flushed = next(t for t, what, p in mine if what == "flush" and p == phase)
            after = next((t for t, _, _ in events if t > last_reply), ended)
            assert last_reply - min(arrived) >= waves * delay
            assert last_reply - min(arrived) <= summary["wall_s"] <= after - flushed, (label, bs, summary["wall_s"])
            assert summary["output_tokens_per_s"] == pytest.approx(tokens / summary["wall_s"])
    assert len(report["requests"]["eagle3"]["16"]) == n
    assert f"{tokens / verifies:.3f}" in proc.stdout  # the printed table


# ------------------------------------------------------------------------------ launch mode, a fake launcher

FAKE_LAUNCHER = r"""
import json, os, subprocess, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

argv = sys.argv[1:]
assert argv[:2] == ["-m", "sglang.launch_server"], argv
port = int(argv[argv.index("--port") + 1])
spec = "--speculative-algorithm" in argv
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # a "rank", same process group
started = time.monotonic()
with open(os.environ["FAKE_LAUNCHES"], "a") as fh:
    fh.write(json.dumps({"argv": argv, "pids": [os.getpid(), rank.pid], "pgid": os.getpgid(0)}) + "\n")

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def reply(self, status, body=None):
        raw = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self):
        self.reply(200 if time.monotonic() - started > 1.5 else 503)  # "loading weights" for 1.5 s

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/flush_cache":
            return self.reply(200)
        n = body["sampling_params"]["max_new_tokens"]
        meta = {"completion_tokens": n, "prompt_tokens": len(body["input_ids"])}
        if spec:
            meta.update(spec_verify_ct=n // 4, spec_accept_length=4.0)
        time.sleep(0.01)
        self.reply(200, {"text": "", "meta_info": meta})

ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def test_launch_mode_starts_and_stops_each_server_as_a_process_group(tmp_path):
    """No --url: both commands run one after the other (here with a stand-in for `python -m sglang.launch_server`
    via --python), each waited for on /health, benchmarked, and stopped with every process of its group: within
    seconds even when the benchmark inherits a blocked SIGTERM (as it did from the whole suite's process), which
    without the script's reset the servers would inherit too and each stop would wait out its 60 s grace."""
    launcher = tmp_path / "python"
    launcher.write_text(f"#!{sys.executable}\n" + FAKE_LAUNCHER)
    launcher.chmod(0o755)
    launches = tmp_path / "launches.jsonl"
    dataset = tmp_path / "merged.parquet"
    write_merged(dataset, n_eval=4, n_train=2)
    port = free_port()
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--model-path",
            "/models/Kimi-K2.5",
            "--draft-model-path",
            "/d",
            "--python",
            str(launcher),
            "--port",
            str(port),
            "--dataset",
            str(dataset),
            "--num-prompts",
            "4",
            "--batch-sizes",
            "1,4",
            "--max-new-tokens",
            "32",
            "--warmup",
            "0",
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "FAKE_LAUNCHES": str(launches)},
        preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM}),
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    runs = [json.loads(line) for line in launches.read_text().splitlines()]
    assert [r["argv"] for r in runs] == [
        bench.server_command("/models/Kimi-K2.5", port=port, python=str(launcher))[1:],
        bench.server_command("/models/Kimi-K2.5", port=port, python=str(launcher), draft_model_path="/d")[1:],
    ]
    for r in runs:
        assert r["pgid"] == r["pids"][0]  # its own process group
        assert not any(alive(pid) for pid in r["pids"])  # the launcher and its "rank" are gone
    res = json.loads(out.read_text())["results"]
    for bs in ("1", "4"):
        assert res["baseline"][bs]["accept_length"] is None
        assert res["eagle3"][bs]["accept_length"] == pytest.approx(4.0)
        assert res["eagle3"][bs]["completion_tokens"] == 4 * 32
        assert res["eagle3"][bs]["speedup"] > 0
    assert (tmp_path / "results.baseline.log").exists() and (tmp_path / "results.eagle3.log").exists()
