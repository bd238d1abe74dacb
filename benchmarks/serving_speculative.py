"""Serving benchmark on a GPU host: the target alone against the target with the trained EAGLE-3 drafter.

    # an 8-GPU Kimi-K2.5 host with sglang installed: launches both servers, one after the other
    .venv/bin/python benchmarks/serving_speculative.py --model-path /models/Kimi-K2.5 --tp-size 8 \\
        --draft-model-path /data/eagle3/eagle3_drafter --dataset /data/eagle3/merged_dataset/merged.parquet
    # servers started by hand: benchmark them where they run
    .venv/bin/python benchmarks/serving_speculative.py --url http://127.0.0.1:30001 --baseline-url http://127.0.0.1:30000
    # print the exact server commands and stop
    .venv/bin/python benchmarks/serving_speculative.py --model-path /models/Kimi-K2.5 --draft-model-path DIR --dry-run

Each server is `python -m sglang.launch_server` in its own process group (stopped as a group), waited for on
`/health` (503 while it starts, 200 once up). The prompts are the eval split of the merged training set, sent as
token ids (`input_ids` = the sample's first `prompt_len` ids, so no chat template or tokenizer is involved) to
SGLang's native `/generate` with greedy sampling (`temperature` 0) and `max_new_tokens`, at each concurrency of
`--batch-sizes` (C requests in flight, N requests in all). Per request the response's `meta_info` is kept:
`completion_tokens`, and with speculative decoding `spec_verify_ct` (target verify passes), `spec_accept_length`,
`spec_accept_rate`. The radix cache is flushed before each measured batch so every run prefills the same way.

Reported per server and concurrency:
  accept length   SGLang's definition: completion_tokens / spec_verify_ct, which counts the bonus token (the
                  target's own token after each verify pass), so 1.0 means no draft token was ever accepted and
                  the ceiling is --speculative-num-draft-tokens. Aggregated over requests as
                  sum(completion_tokens) / sum(spec_verify_ct), not as a mean of per-request ratios.
  output tok/s    sum(completion_tokens) / wall time of the batch (first request sent to last response read).
  speed-up        output tok/s over the baseline server's at the same concurrency.

The JSON (`--output`) has `source: "sglang_server"` and a `summary` per temperature (here only "0", greedy) of the
shape benchmarks/sglang_engine_speculative.py writes; `python -m eagle3_assets.operations.record_figures FILE` records
it on the `eagle3_drafter` asset (eagle3_assets/stages/eagle3_drafter/figures.py). The eval prompts and the arithmetic
are benchmarks/speculative_common.py's, shared with that script.

Imports only the standard library at module import; the Parquet file is read with pyarrow when one is given
(a JSONL file of prompt ids needs nothing): runs where sglang is installed without this project's extras.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative_common import (  # noqa: E402  (the eval prompts and the arithmetic both SGLang benchmarks share)
    ACCEPT_LENGTH_NOTE,
    DEFAULT_DATA_DIR,
    DEFAULT_PROMPTS,
    SPEEDUP_NOTE,
    add_speedups,
    check_draft_tree,
    format_table,
    load_prompts,
    request_record,
    sampling_params,
    summarize,
    temperature_summary,
    weights_fingerprint,
)

# ----------------------------------------------------------------------------------------------- pure functions


def server_command(
    model_path: str,
    *,
    port: int,
    tp_size: int = 8,
    host: str = "127.0.0.1",
    draft_model_path: str | None = None,
    num_steps: int = 3,
    eagle_topk: int = 1,
    num_draft_tokens: int = 4,
    mem_fraction_static: float | None = None,
    trust_remote_code: bool = True,
    extra_args: Sequence[str] = (),
    python: str = "python",
) -> list[str]:
    """The `sglang.launch_server` command line: the baseline server, or with `draft_model_path` the EAGLE-3 one.

    Flag names as SGLang 0.5.23's ServerArgs defines them (`--tp-size`; `--tp` only works as an argparse
    abbreviation of it). `num_draft_tokens` must be at most num_steps * eagle_topk + 1 (a chain of
    num_steps drafts plus the root when topk is 1)."""
    cmd = [python, "-m", "sglang.launch_server", "--model-path", model_path, "--tp-size", str(tp_size)]
    if trust_remote_code:
        cmd.append("--trust-remote-code")
    cmd += ["--host", host, "--port", str(port)]
    if mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(mem_fraction_static)]
    if draft_model_path is not None:
        check_draft_tree(num_steps, eagle_topk, num_draft_tokens)
        cmd += [
            "--speculative-algorithm",
            "EAGLE3",
            "--speculative-draft-model-path",
            draft_model_path,
            "--speculative-num-steps",
            str(num_steps),
            "--speculative-eagle-topk",
            str(eagle_topk),
            "--speculative-num-draft-tokens",
            str(num_draft_tokens),
        ]
    return cmd + list(extra_args)


def generate_body(prompt_ids: Sequence[int], max_new_tokens: int, ignore_eos: bool = False) -> dict[str, Any]:
    """The `/generate` request: token ids in, greedy sampling."""
    return {
        "input_ids": [int(t) for t in prompt_ids],
        "sampling_params": sampling_params(max_new_tokens, ignore_eos),
        "stream": False,
    }


# ------------------------------------------------------------------------------------------------------- client


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 30.0) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    try:
        return status, json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return status, raw.decode(errors="replace")


def wait_healthy(url: str, timeout_s: float, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    """Until `/health` answers 200 (SGLang answers 503 while the server starts), or the server process dies."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-4000:] if log and log.exists() else ""
            raise RuntimeError(f"server exited with {proc.returncode} before it was healthy\n{tail}")
        try:
            if http_json(url + "/health", timeout=10)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(1.0 if proc is not None else 0.2)
    raise TimeoutError(f"{url}/health not 200 after {timeout_s:.0f}s")


def generate(
    url: str, prompt_ids: Sequence[int], max_new_tokens: int, ignore_eos: bool, timeout_s: float
) -> dict[str, Any]:
    status, out = http_json(url + "/generate", generate_body(prompt_ids, max_new_tokens, ignore_eos), timeout=timeout_s)
    if status != 200 or not isinstance(out, dict):
        raise RuntimeError(f"/generate answered {status}: {str(out)[:500]}")
    return out


def run_batch(
    url: str,
    prompts: list[list[int]],
    concurrency: int,
    max_new_tokens: int,
    ignore_eos: bool = False,
    timeout_s: float = 1800.0,
) -> tuple[list[dict[str, Any]], float]:
    """Every prompt through `/generate` with `concurrency` requests in flight: (records in prompt order, wall s)."""

    def one(i: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        out = generate(url, prompts[i], max_new_tokens, ignore_eos, timeout_s)
        return request_record(i, out, time.perf_counter() - t0)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        records = list(pool.map(one, range(len(prompts))))
    return records, time.perf_counter() - start


def flush_cache(url: str) -> None:
    try:
        status, body = http_json(url + "/flush_cache", body={}, timeout=60)
    except OSError as e:
        status, body = None, e
    if status != 200:
        print(f"warning: {url}/flush_cache answered {status}: {str(body)[:200]} (continuing)", file=sys.stderr)


def bench_server(
    url: str,
    prompts: list[list[int]],
    batch_sizes: list[int],
    max_new_tokens: int,
    ignore_eos: bool,
    warmup: int,
    timeout_s: float,
    label: str,
) -> tuple[dict[str, dict[str, Any]], dict[str, list]]:
    """Every concurrency against one running server: ({bs: summary}, {bs: per-request records})."""
    summaries, records = {}, {}
    if warmup:
        run_batch(url, prompts[:warmup], min(warmup, max(batch_sizes)), min(max_new_tokens, 16), ignore_eos, timeout_s)
    for bs in batch_sizes:
        flush_cache(url)
        recs, wall = run_batch(url, prompts, bs, max_new_tokens, ignore_eos, timeout_s)
        summaries[str(bs)], records[str(bs)] = summarize(recs, wall), recs
        s = summaries[str(bs)]
        acc = "-" if s["accept_length"] is None else f"{s['accept_length']:.3f}"
        print(
            f"[{label}] concurrency {bs}: {s['requests']} requests, {s['completion_tokens']} tokens in {wall:.2f}s, "
            f"{s['output_tokens_per_s']:.1f} tok/s, accept length {acc}",
            flush=True,
        )
    return summaries, records


# -------------------------------------------------------------------------------------------------- server life


def signals_for_servers() -> None:
    """The servers this script starts must stop on SIGTERM. A blocked signal mask and ignored dispositions survive
    fork and exec, so a parent that blocked SIGTERM (the full test suite's process did, measured: each stop then waited
    its grace before SIGKILL) would hand them down to every rank: clear both here, before any server starts."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
    for sig in (signal.SIGTERM, signal.SIGINT):
        if signal.getsignal(sig) is signal.SIG_IGN:
            signal.signal(sig, signal.SIG_DFL)


def start_server(cmd: list[str], log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as fh:
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)


def group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs (zombies, waiting for a parent that may never reap them, don't)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
            return True
        except ProcessLookupError:
            return False
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def stop_server(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGTERM to the server's process group (the launcher and every rank it spawned), SIGKILL after the grace;
    returns once no process of the group runs, so the GPUs and the port are free for the next server."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            proc.poll()  # reap the launcher
            if proc.returncode is not None and not group_alive(proc.pid):
                return
            time.sleep(0.2)
    proc.poll()


# --------------------------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-path", help="the target (Kimi-K2.5 folder); needed unless --url")
    p.add_argument(
        "--draft-model-path",
        default=str(DEFAULT_DATA_DIR / "eagle3_drafter"),
        help="the exported drafter checkpoint (config.json + model.safetensors)",
    )
    p.add_argument("--tp-size", type=int, default=8)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--speculative-num-steps", type=int, default=3)
    p.add_argument("--speculative-eagle-topk", type=int, default=1)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=4)
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for both launch_server commands (repeat; e.g. --server-arg=--attention-backend ...)",
    )
    p.add_argument("--python", default=sys.executable, help="the interpreter that has sglang")
    p.add_argument("--url", help="benchmark this running server (the speculative one) instead of launching")
    p.add_argument("--baseline-url", help="with --url: a running baseline server to compare against")
    p.add_argument("--skip-baseline", action="store_true", help="launch only the EAGLE-3 server")
    p.add_argument("--dataset", type=Path, default=DEFAULT_PROMPTS, help="merged.parquet, or a JSONL of prompt ids")
    p.add_argument("--split", default="eval")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--batch-sizes", default="1,16", help="concurrencies, comma-separated")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens")
    p.add_argument("--warmup", type=int, default=4, help="warm-up requests per server, not measured")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-timeout", type=float, default=3600.0, help="seconds to wait for /health")
    p.add_argument("--request-timeout", type=float, default=1800.0)
    p.add_argument("--output", type=Path, default=Path("serving_speculative.json"))
    p.add_argument("--dry-run", action="store_true", help="print the server commands and exit")
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in str(args.batch_sizes).split(",") if b.strip()]
    if not args.url and not args.model_path:
        p.error("--model-path is needed unless --url is given")
    if args.baseline_url and not args.url:
        p.error("--baseline-url goes with --url")
    return args


def commands(args: argparse.Namespace) -> dict[str, list[str]]:
    common = dict(
        port=args.port,
        tp_size=args.tp_size,
        host=args.host,
        mem_fraction_static=args.mem_fraction_static,
        extra_args=args.server_arg,
        python=args.python,
    )
    cmds = {} if args.skip_baseline else {"baseline": server_command(args.model_path, **common)}
    cmds["eagle3"] = server_command(
        args.model_path,
        draft_model_path=args.draft_model_path,
        num_steps=args.speculative_num_steps,
        eagle_topk=args.speculative_eagle_topk,
        num_draft_tokens=args.speculative_num_draft_tokens,
        **common,
    )
    return cmds


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        if args.url:
            print(
                f"# --url: no server is launched; benchmarking {args.url}"
                + (f" against {args.baseline_url}" if args.baseline_url else "")
            )
        else:
            for label, cmd in commands(args).items():
                print(f"# {label}\n{shlex.join(cmd)}")
        return 0

    prompts = load_prompts(args.dataset, args.num_prompts, args.split, args.seed)
    print(
        f"{len(prompts)} {args.split} prompts from {args.dataset} "
        f"({sum(map(len, prompts)) / len(prompts):.0f} tokens on average), concurrency {args.batch_sizes}",
        flush=True,
    )
    run = dict(
        batch_sizes=args.batch_sizes,
        max_new_tokens=args.max_new_tokens,
        ignore_eos=args.ignore_eos,
        warmup=min(args.warmup, len(prompts)),
        timeout_s=args.request_timeout,
    )
    results: dict[str, dict[str, dict[str, Any]]] = {}
    requests: dict[str, dict[str, list]] = {}
    servers: dict[str, Any] = {}
    if args.url:
        targets = ([("baseline", args.baseline_url.rstrip("/"))] if args.baseline_url else []) + [
            ("eagle3", args.url.rstrip("/"))
        ]
        for label, url in targets:
            wait_healthy(url, args.server_timeout)
            servers[label] = {"url": url}
            results[label], requests[label] = bench_server(url, prompts, label=label, **run)
    else:
        url = f"http://{args.host}:{args.port}"
        signals_for_servers()
        for label, cmd in commands(args).items():
            log = args.output.with_name(f"{args.output.stem}.{label}.log")
            print(f"[{label}] {shlex.join(cmd)}\n[{label}] log: {log}", flush=True)
            servers[label] = {"command": cmd, "log": str(log)}
            proc = start_server(cmd, log)
            try:
                t0 = time.monotonic()
                wait_healthy(url, args.server_timeout, proc, log)
                servers[label]["startup_s"] = time.monotonic() - t0
                results[label], requests[label] = bench_server(url, prompts, label=label, **run)
            finally:
                stop_server(proc)
    add_speedups(results)

    report = {
        "source": "sglang_server",  # eagle3_assets/stages/eagle3_drafter/figures.py: what measured these figures
        "accept_length_definition": ACCEPT_LENGTH_NOTE,
        "speedup_definition": SPEEDUP_NOTE,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        # which weights: the launched EAGLE-3 server's drafter; unknown for servers started by hand (--url)
        "drafter": None
        if args.url
        else {"path": args.draft_model_path, "weights_sha256": weights_fingerprint(args.draft_model_path)},
        "num_prompts": len(prompts),
        "servers": servers,
        "summary": {"0": temperature_summary(results, requests)},  # greedy; the same shape as the Engine benchmark's
        "results": results,
        "requests": requests,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(results))
    print(f"results: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
