"""Benchmark: sustained requests/s of the completions client against the fake OpenRouter.

    .venv/bin/pip install -e '.[bench]'
    .venv/bin/python benchmarks/completions_client.py [--quick] [--against REV]

For each (concurrency C, latency L) the fake server runs in its own process (own process group),
answering every request after L seconds; each client runs in a fresh process, sends N = 3C
requests with C in flight, and reports requests/s as a fraction of the limit C/L, plus its peak
RSS. Clients, in the same run:
  - ours: the project's OpenRouterBackend driven through `run_completions` (journal, admission,
    progress: the production path), streaming and non-streaming;
    every attempt reserved and settled in the shared spend ledger (SQLite) at the fake's prices;
  - peer: the official `openai` SDK, `AsyncOpenAI` + an `asyncio.Semaphore(C)`, same two modes;
  - with --against REV: the project's client as it was at git revision REV (exported to a temporary
    folder and run from there), against the same server in the same run: a regression check.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KEY = "bench-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(latency: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fakes.openrouter",
            "--port",
            str(port),
            "--api-key",
            KEY,
            "--latency-s",
            str(latency),
            "--mean-reasoning-words",
            "6",
            "--mean-content-words",
            "4",
            "--generation-404-s",
            "0",
        ],
        cwd=REPO / "tests",
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        text=True,
    )
    assert proc.stdout is not None  # stdout=PIPE
    proc.stdout.readline()  # {"listening": ...}
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    return proc, f"http://127.0.0.1:{port}/api/v1"


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)


# -- the clients, each run in a fresh process -------------------------------------------------


class Deadline(Exception):
    pass


def client_ours(url: str, concurrency: int, n: int, stream: bool, deadline: float) -> dict:
    from eagle3_assets.money import Pricing, SpendLedger
    from eagle3_assets.stages.completions.run import final_results, run_completions
    from eagle3_resources.completions.openrouter import OpenRouterBackend
    from eagle3_resources.completions.types import CompletionRequest, SamplingSettings

    reqs = [CompletionRequest(f"p{i}", [{"role": "user", "content": f"q{i}"}], None, [1, 2, 3]) for i in range(n)]
    backend = OpenRouterBackend(url, KEY, concurrency=concurrency, stream=stream, max_attempts=3)

    def expire(*_):
        raise Deadline()

    signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, deadline)
    with tempfile.TemporaryDirectory() as d:
        started = time.monotonic()
        try:
            run_completions(
                "bench",
                reqs,
                backend,
                SamplingSettings(max_tokens=256),
                Path(d) / "j.jsonl",
                ledger=SpendLedger(Path(d) / "ledger.sqlite"),
                pricing=Pricing(0.60e-6, 2.50e-6),
                log=lambda m: None,
            )
        except Deadline:
            pass
        elapsed = time.monotonic() - started
        signal.setitimer(signal.ITIMER_REAL, 0)
        done, _ = final_results(Path(d) / "j.jsonl")
    return {"ok": sum(r["status"] == "ok" for r in done.values()), "elapsed": elapsed, "timed_out": elapsed >= deadline}


def client_openai(url: str, concurrency: int, n: int, stream: bool, deadline: float) -> dict:
    import asyncio

    import httpx
    from openai import AsyncOpenAI

    async def main() -> dict:
        client = AsyncOpenAI(
            base_url=url,
            api_key=KEY,
            max_retries=2,
            timeout=600,
            http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency), timeout=600),
        )
        sem = asyncio.Semaphore(concurrency)
        ok = 0

        async def one(i: int) -> None:
            nonlocal ok
            async with sem:
                kwargs = dict(
                    model="moonshotai/kimi-k2.5", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=256
                )
                if stream:
                    chunks = await client.chat.completions.create(stream=True, **kwargs)
                    async for _ in chunks:
                        pass
                else:
                    await client.chat.completions.create(**kwargs)
                ok += 1

        started = time.monotonic()
        tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
        done, pending = await asyncio.wait(tasks, timeout=deadline)
        elapsed = time.monotonic() - started
        for t in pending:
            t.cancel()
        errors = sum(1 for t in done if t.exception() is not None)
        return {"ok": ok, "elapsed": elapsed, "errors": errors, "timed_out": bool(pending)}

    return asyncio.run(main())


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def child(args) -> None:
    import resource

    if args.child == "ours":  # import first, so the baseline is the libraries, the peak the traffic
        import eagle3_assets.stages.completions.run  # noqa: F401
        import eagle3_resources.completions.openrouter  # noqa: F401
    else:
        import openai  # noqa: F401
    baseline = rss_mib()
    fn = client_ours if args.child == "ours" else client_openai
    out = fn(args.url, args.concurrency, args.n, args.stream, args.deadline)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["peak_rss_mib"] = usage.ru_maxrss / 1024
    out["cpu_s"] = usage.ru_utime + usage.ru_stime
    out["baseline_rss_mib"] = baseline
    print(json.dumps(out))


def measure(client: str, url: str, concurrency: int, n: int, stream: bool, timeout: float, tree: Path = REPO) -> dict:
    """One client in a fresh process; `tree` is the checkout whose code it runs (an older revision for --against)."""
    cmd = [
        sys.executable,
        str(tree / "benchmarks" / "completions_client.py"),
        "--child",
        client,
        "--url",
        url,
        "--concurrency",
        str(concurrency),
        "--n",
        str(n),
        "--deadline",
        str(timeout),
    ]
    if stream:
        cmd.append("--stream")
    env = dict(os.environ, PYTHONPATH=str(tree))  # ahead of the editable install: the tree's own modules
    failed = {"ok": 0, "peak_rss_mib": float("nan"), "baseline_rss_mib": float("nan"), "cpu_s": float("nan")}
    try:
        proc = subprocess.run(
            cmd, cwd=tree, capture_output=True, text=True, timeout=timeout + 120, start_new_session=True, env=env
        )
    except subprocess.TimeoutExpired:
        return failed | {"elapsed": timeout, "timed_out": True}
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        # the client never ran (a missing `openai`, a crash): say so, not "stopped at the deadline"
        last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}, no output"])[-1]
        return failed | {"elapsed": float("nan"), "timed_out": False, "error": last[:160]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", choices=["ours", "openai"])
    parser.add_argument("--url")
    parser.add_argument("--concurrency", type=int)
    parser.add_argument("--n", type=int)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument(
        "--deadline", type=float, default=300.0, help="seconds a client gets; it reports what it finished"
    )
    parser.add_argument("--quick", action="store_true", help="only C=256, L=1")
    parser.add_argument("--against", metavar="REV", help="also run the client of this git revision (regression check)")
    args = parser.parse_args()
    if args.child:
        return child(args)
    clients = [("ours", True, REPO, "eagle3"), ("ours", False, REPO, "eagle3")]
    if args.against:
        old = Path(tempfile.mkdtemp(prefix="bench-against-"))
        subprocess.run(f"git archive {args.against} | tar -x -C {old}", shell=True, cwd=REPO, check=True)
        clients += [("ours", True, old, f"@{args.against[:9]}"), ("ours", False, old, f"@{args.against[:9]}")]
    clients += [("openai", True, REPO, "openai AsyncOpenAI+sem"), ("openai", False, REPO, "openai AsyncOpenAI+sem")]

    configs = [(256, 1.0)] if args.quick else [(256, 1.0), (2000, 2.0)]
    print(
        f"{'client':<29} {'C':>5} {'L':>4} {'ok':>6} {'req/s':>8} {'of C/L':>7} "
        f"{'client CPU':>10} {'peak RSS':>9} {'(imports)':>10}"
    )
    for concurrency, latency in configs:
        n = 3 * concurrency
        limit = concurrency / latency
        for client, stream, tree, label in clients:
            server, url = start_server(latency)  # a fresh server each: the fake keeps every bill it wrote
            try:
                r = measure(client, url, concurrency, n, stream, timeout=args.deadline, tree=tree)
                name = f"{label} {'sse' if stream else 'json'}"
                if r.get("error"):
                    print(f"{name:<29} {concurrency:>5} {latency:>4.1f} did not run: {r['error']}", flush=True)
                    continue
                rate = r["ok"] / r["elapsed"] if r["elapsed"] else 0.0
                flag = f" (stopped at the {args.deadline:.0f}s deadline)" if r.get("timed_out") else ""
                print(
                    f"{name:<29} {concurrency:>5} {latency:>4.1f} {r['ok']:>6} {rate:>8.1f} {rate / limit:>7.2f} "
                    f"{100 * r.get('cpu_s', float('nan')) / r['elapsed']:>9.0f}% "
                    f"{r['peak_rss_mib']:>6.0f}MiB {r['baseline_rss_mib']:>7.0f}MiB{flag}",
                    flush=True,
                )
            finally:
                stop(server)


if __name__ == "__main__":
    main()
