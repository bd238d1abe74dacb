"""Accept length and speed from SGLang itself: its offline `Engine`, the target alone and then with the EAGLE-3 drafter.

    # an 8-GPU Kimi-K2.5 host with sglang installed (docs/gpu-host.md, step 5): both engines, one after the other
    .venv/bin/python benchmarks/sglang_engine_speculative.py --target /models/Kimi-K2.5 --tp 8 \\
        --drafter /data/eagle3/eagle3_drafter --prompts /data/eagle3/merged_dataset/merged.parquet
    # the Engine arguments of both engines, and stop (no sglang needed)
    .venv/bin/python benchmarks/sglang_engine_speculative.py --target /models/Kimi-K2.5 --drafter DIR --dry-run

What it does, the way SpecForge's benchmarks/bench_eagle3.py does it over SGLang's server, but in-process:
`sglang.Engine(**kwargs)` for the baseline (the target alone), then, once that one is shut down and its GPUs
free, for the speculative engine (`speculative_algorithm="EAGLE3"`, `--num-steps 3 --topk 1 --num-draft-tokens 4`
by default: SGLang's and Kimi's published EAGLE-3 settings). Each engine is warmed up (a few short requests, not
measured), then at each temperature of `--temperatures` (default 0, greedy, and 1.0, Kimi-K2.5's serving
temperature in thinking mode, with `--top-p` 0.95, Moonshot's setting) and each concurrency of `--concurrency`
(default 1, 4, 16) the radix cache is flushed and every prompt goes through `Engine.async_generate` with C
requests in flight (an asyncio semaphore on the engine's own event loop, the loop `Engine.generate` runs on).
The prompts are the eval split of the merged training set, sent as token ids (the sample's first `prompt_len` ids:
no chat template, no tokenizer), the same prompts `serving_speculative.py` sends.

Reported per temperature (and per concurrency):
  accept length   SGLang's definition, sum(completion_tokens) / sum(spec_verify_ct) over the requests (meta_info);
                  it counts the bonus token, so 1.0 means no draft token was accepted. Per temperature it is pooled
                  over every concurrency; the per-concurrency figures are in the table.
  output tok/s    sum(completion_tokens) / wall time of the batch (first request sent to last answer).
  speed-up        the speculative engine's output tok/s over the baseline's, same temperature and concurrency.

The JSON (`--output`) has `source: "sglang_engine"`; `python -m eagle3_assets.operations.record_figures FILE` records it
on the `eagle3_drafter` asset as an observation (eagle3_assets/stages/eagle3_drafter/figures.py). sglang is imported
only when the engines start, with a clear message where it is missing; everything else is the standard library.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative_common import (  # noqa: E402  (shared with serving_speculative.py)
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
    temperature_key,
    temperature_summary,
    weights_fingerprint,
)

SOURCE = "sglang_engine"
EngineFactory = Callable[..., Any]


# ----------------------------------------------------------------------------------------------- pure functions


def engine_kwargs(
    target: str,
    *,
    tp: int,
    drafter: str | None = None,
    num_steps: int = 3,
    topk: int = 1,
    num_draft_tokens: int = 4,
    mem_fraction_static: float | None = None,
    seed: int | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`sglang.Engine(**kwargs)`: the baseline engine, or with `drafter` the EAGLE-3 one. The names are ServerArgs
    fields of SGLang 0.5.23 (tests/test_sglang_engine_bench.py checks them against that release's source)."""
    kw: dict[str, Any] = {"model_path": target, "tp_size": int(tp), "trust_remote_code": True}
    if mem_fraction_static is not None:
        kw["mem_fraction_static"] = float(mem_fraction_static)
    if seed is not None:
        kw["random_seed"] = int(seed)
    if drafter is not None:
        check_draft_tree(num_steps, topk, num_draft_tokens)
        kw |= {
            "speculative_algorithm": "EAGLE3",
            "speculative_draft_model_path": drafter,
            "speculative_num_steps": int(num_steps),
            "speculative_eagle_topk": int(topk),
            "speculative_num_draft_tokens": int(num_draft_tokens),
        }
    return kw | dict(extra or {})


def parse_engine_arg(item: str) -> tuple[str, Any]:
    """`KEY=VALUE` for one more Engine argument; VALUE read as JSON where it parses (numbers, true, null), else text."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"--engine-arg wants KEY=VALUE, got {item!r}")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


# ------------------------------------------------------------------------------------------------------ engine


async def _generate_all(engine: Any, prompts: list[list[int]], concurrency: int, params: dict[str, Any]) -> list[dict]:
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> dict[str, Any]:
        async with gate:
            t0 = time.perf_counter()
            out = await engine.async_generate(input_ids=prompts[i], sampling_params=params)
            return request_record(i, out, time.perf_counter() - t0)

    return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


def run_batch(
    engine: Any, prompts: list[list[int]], concurrency: int, params: dict[str, Any]
) -> tuple[list[dict], float]:
    """Every prompt through the engine with `concurrency` requests in flight: (records in prompt order, wall s)."""
    start = time.perf_counter()
    records = engine.loop.run_until_complete(_generate_all(engine, prompts, concurrency, params))
    return records, time.perf_counter() - start


def flush_cache(engine: Any, label: str) -> None:
    out = engine.flush_cache()
    if not getattr(out, "success", True):
        print(f"warning: [{label}] flush_cache: {getattr(out, 'message', out)} (continuing)", file=sys.stderr)


def bench_engine(
    engine: Any,
    prompts: list[list[int]],
    *,
    temperatures: Sequence[float],
    concurrency: Sequence[int],
    max_new_tokens: int,
    ignore_eos: bool,
    top_p: float | None,
    warmup: int,
    label: str,
) -> tuple[dict[str, dict[str, dict]], dict[str, dict[str, list]]]:
    """Every temperature and concurrency on one engine: ({temperature: {concurrency: summary}}, the same of records)."""
    summaries: dict[str, dict[str, dict]] = {}
    records: dict[str, dict[str, list]] = {}
    if warmup:
        run_batch(
            engine,
            prompts[:warmup],
            min(warmup, max(concurrency)),
            sampling_params(min(max_new_tokens, 16), ignore_eos),
        )
    for t in temperatures:
        tk = temperature_key(t)
        params = sampling_params(max_new_tokens, ignore_eos, temperature=t, top_p=top_p)
        summaries[tk], records[tk] = {}, {}
        for bs in concurrency:
            flush_cache(engine, label)
            recs, wall = run_batch(engine, prompts, bs, params)
            summaries[tk][str(bs)], records[tk][str(bs)] = summarize(recs, wall), recs
            s = summaries[tk][str(bs)]
            acc = "-" if s["accept_length"] is None else f"{s['accept_length']:.3f}"
            print(
                f"[{label}] temperature {tk}, concurrency {bs}: {s['requests']} requests, {s['completion_tokens']} "
                f"tokens in {wall:.2f}s, {s['output_tokens_per_s']:.1f} tok/s, accept length {acc}",
                flush=True,
            )
    return summaries, records


def sglang_engine() -> tuple[EngineFactory, str | None]:
    """`sglang.Engine` and the installed version, imported only now; a clear exit where sglang is missing."""
    try:
        import sglang
    except ImportError as e:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from eagle3_resources.hidden_states.sglang_api import INSTALL_HINT  # the project's one install command

        raise SystemExit(
            f"sglang is not importable here ({e}); this benchmark runs SGLang's offline Engine on a GPU "
            f"host: {INSTALL_HINT}. `--dry-run` prints the Engine arguments without it."
        ) from e
    return sglang.Engine, getattr(sglang, "__version__", None)


# --------------------------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", required=True, help="the target model folder (Kimi-K2.5)")
    p.add_argument(
        "--drafter",
        default=str(DEFAULT_DATA_DIR / "eagle3_drafter"),
        help="the exported EAGLE-3 drafter (config.json + model.safetensors)",
    )
    p.add_argument("--tp", type=int, default=8, help="tensor-parallel GPUs (ServerArgs.tp_size)")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="merged.parquet, or a JSONL of prompt ids")
    p.add_argument("--split", default="eval")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--temperatures", default="0,1.0", help="comma-separated; 0 is greedy")
    p.add_argument("--top-p", type=float, default=0.95, help="top_p at temperatures above 0 (Kimi-K2.5: 0.95)")
    p.add_argument("--concurrency", default="1,4,16", help="requests in flight, comma-separated")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens")
    p.add_argument("--num-steps", type=int, default=3, help="speculative_num_steps")
    p.add_argument("--topk", type=int, default=1, help="speculative_eagle_topk")
    p.add_argument("--num-draft-tokens", type=int, default=4, help="speculative_num_draft_tokens")
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        type=parse_engine_arg,
        metavar="KEY=VALUE",
        help="one more Engine (ServerArgs) argument for both engines, e.g. --engine-arg cuda_graph_max_bs_decode=16",
    )
    p.add_argument("--skip-baseline", action="store_true", help="only the speculative engine (no speed-up then)")
    p.add_argument("--warmup", type=int, default=4, help="warm-up requests per engine, not measured")
    p.add_argument("--seed", type=int, default=0, help="prompt sample and ServerArgs.random_seed")
    p.add_argument("--output", type=Path, default=Path("sglang_engine_speculative.json"))
    p.add_argument("--dry-run", action="store_true", help="print both engines' arguments and exit")
    args = p.parse_args(argv)
    try:
        args.temperatures = [float(t) for t in str(args.temperatures).split(",") if t.strip()]
        args.concurrency = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    except ValueError as e:
        p.error(str(e))
    if not args.temperatures or any(t < 0 for t in args.temperatures):
        p.error("--temperatures: one or more numbers >= 0")
    if not args.concurrency or any(c < 1 for c in args.concurrency):
        p.error("--concurrency: one or more integers >= 1")
    try:
        check_draft_tree(args.num_steps, args.topk, args.num_draft_tokens)
    except ValueError as e:
        p.error(str(e))
    return args


def engines(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    common = dict(tp=args.tp, mem_fraction_static=args.mem_fraction_static, seed=args.seed, extra=dict(args.engine_arg))
    out = {} if args.skip_baseline else {"baseline": engine_kwargs(args.target, **common)}
    out["eagle3"] = engine_kwargs(
        args.target,
        drafter=args.drafter,
        num_steps=args.num_steps,
        topk=args.topk,
        num_draft_tokens=args.num_draft_tokens,
        **common,
    )
    return out


def main(argv: Sequence[str] | None = None, engine_factory: EngineFactory | None = None) -> int:
    """`engine_factory` stands in for `sglang.Engine` (the tests' fake); by default sglang's, imported here."""
    args = parse_args(argv)
    if args.dry_run:
        for label, kw in engines(args).items():
            print(f"# {label}\nsglang.Engine(**{json.dumps(kw, sort_keys=True)})")
        return 0
    version = None
    if engine_factory is None:
        engine_factory, version = sglang_engine()

    prompts = load_prompts(args.prompts, args.num_prompts, args.split, args.seed)
    print(
        f"{len(prompts)} {args.split} prompts from {args.prompts} ({sum(map(len, prompts)) / len(prompts):.0f} tokens "
        f"on average); temperatures {args.temperatures}, concurrency {args.concurrency}",
        flush=True,
    )
    run = dict(
        temperatures=args.temperatures,
        concurrency=args.concurrency,
        max_new_tokens=args.max_new_tokens,
        ignore_eos=args.ignore_eos,
        top_p=args.top_p,
        warmup=min(args.warmup, len(prompts)),
    )
    by_engine: dict[str, dict[str, dict]] = {}
    records_by_engine: dict[str, dict[str, dict]] = {}
    started: dict[str, dict[str, Any]] = {}
    for label, kw in engines(args).items():
        print(f"[{label}] sglang.Engine({', '.join(f'{k}={v!r}' for k, v in kw.items())})", flush=True)
        t0 = time.monotonic()
        engine = engine_factory(**kw)
        started[label] = {"kwargs": kw, "startup_s": time.monotonic() - t0}
        try:
            by_engine[label], records_by_engine[label] = bench_engine(engine, prompts, label=label, **run)
        finally:
            engine.shutdown()  # frees the GPUs before the next engine starts

    # {temperature: {engine: {concurrency: summary}}}, the speed-up against the baseline at the same temperature
    results = {
        temperature_key(t): {label: by_engine[label][temperature_key(t)] for label in by_engine}
        for t in args.temperatures
    }
    requests = {tk: {label: records_by_engine[label][tk] for label in records_by_engine} for tk in results}
    for tk in results:
        add_speedups(results[tk])
    summary = {tk: temperature_summary(results[tk], requests[tk]) for tk in results}

    report = {
        "source": SOURCE,  # eagle3_assets/stages/eagle3_drafter/figures.py: what measured these figures
        "sglang_version": version,
        "accept_length_definition": ACCEPT_LENGTH_NOTE,
        "speedup_definition": SPEEDUP_NOTE,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "drafter": {"path": args.drafter, "weights_sha256": weights_fingerprint(args.drafter)},
        "num_prompts": len(prompts),
        "engines": started,
        "summary": summary,
        "results": results,
        "requests": requests,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    for tk, by_label in results.items():
        sampled = "greedy" if float(tk) == 0 else f"sampled, top_p {args.top_p}"
        acc = summary[tk]["accept_length"]
        print(
            f"\ntemperature {tk} ({sampled}): accept length {'-' if acc is None else f'{acc:.3f}'} "
            f"(all concurrencies pooled)"
        )
        print(format_table(by_label, label_header="engine"))
    print(f"results: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
