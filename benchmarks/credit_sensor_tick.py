"""Benchmark: the credit sensor's time per tick as the ledger grows to the registry's full budgets (simulated).

    .venv/bin/python benchmarks/credit_sensor_tick.py [--fraction 0.1,0.5,1.0] [--answer-chars 6500]

For each fraction of the registry's sample caps (about 98,000 prompts at 1.0, each with 1.2 attempts,
as retries add), a spend ledger is filled through the project's own ledger operations, and the
credit sensor is evaluated (real Dagster instance, the policy's thresholds set, no account) several
times; the median tick is printed. Beside it, in the same run, the peer: what a tick cost before the
ledger existed, re-reading every journal (`read_journal` over JSON Lines records with answers of
`--answer-chars` characters, ~1,620 Kimi tokens each, as the history's runs averaged).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import dagster as dg  # noqa: E402

from eagle3_assets.common.registry import DATASETS  # noqa: E402
from eagle3_assets.money import Caps, SpendPolicy, open_ledger  # noqa: E402
from eagle3_assets.money import ledger as L  # noqa: E402
from eagle3_assets.operations.sensors import credit_sensor  # noqa: E402
from eagle3_resources.alerts import AlertSink  # noqa: E402
from eagle3_resources.journal import Journal, read_journal  # noqa: E402
from eagle3_resources.storage import DataLayout, DataStore  # noqa: E402

ATTEMPTS_PER_PROMPT = 1.2


def fill_ledger(layout: DataLayout, fraction: float) -> int:
    ledger = open_ledger(layout)
    rows = 0
    now = time.time()
    for name, spec in DATASETS.items():
        n = int((spec.sample_cap or 10000) * fraction * ATTEMPTS_PER_PROMPT)
        for start in range(0, n, 512):
            wants = [L.Want(f"{name}-{i}", 1, 0.05, 16384) for i in range(start, min(n, start + 512))]

            def batch(conn, wants=wants, name=name):
                ids, _ = L.reserve(conn, wants, run_id=f"run-{name}", dataset=name, owner="bench", caps=Caps(), now=now)
                for k, a in enumerate(ids):
                    if k % 6 == 5:  # a retried attempt: released, nothing generated
                        L.release(conn, a, "429", now)
                    else:
                        L.opened(conn, a, f"gen-{a}")
                        L.settle(
                            conn,
                            a,
                            cost_usd=0.0045,
                            prompt_tokens=900,
                            completion_tokens=1620,
                            source="response",
                            now=now,
                        )
                return len(ids)

            rows += ledger.write(batch)
    return rows


def fill_journals(layout: DataLayout, fraction: float, answer_chars: int) -> int:
    text = ("word " * (answer_chars // 5))[:answer_chars]
    records = 0
    for name, spec in DATASETS.items():
        n = int((spec.sample_cap or 10000) * fraction)
        with Journal(layout.completions_journal(name)) as journal:
            for i in range(n):
                journal.append(
                    {
                        "type": "result",
                        "run_id": f"run-{name}",
                        "t": time.time(),
                        "prompt_id": f"{name}-{i}",
                        "status": "ok",
                        "reasoning": text[: answer_chars // 2],
                        "content": text[answer_chars // 2 :],
                        "cost_usd": 0.0045,
                        "completion_tokens": 1620,
                        "generation_id": f"gen-{i}",
                    }
                )
                records += 1
    return records


def tick_times(root: Path, ticks: int) -> list[float]:
    policy = SpendPolicy(max_day_usd=1e9, max_total_usd=1e9, max_run_usd=1e9)
    out = []
    with dg.instance_for_test() as instance:
        cursor = None
        for _ in range(ticks):
            context = dg.build_sensor_context(
                instance=instance,
                cursor=cursor,
                resources={"spend_policy": policy, "store": DataStore(root=str(root)), "alerts": AlertSink()},
            )
            started = time.perf_counter()
            result = credit_sensor(context)
            out.append(time.perf_counter() - started)
            assert isinstance(result, dg.SensorResult)  # the credit sensor always returns one (its cursor)
            cursor = result.cursor
    return out


def journal_read_time(layout: DataLayout) -> float:
    started = time.perf_counter()
    total = 0.0
    for path in layout.all_completion_journals():
        total += sum(r.get("cost_usd") or 0.0 for r in read_journal(path).records)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fraction", default="0.1,0.5,1.0", help="fractions of the registry's sample caps")
    parser.add_argument("--ticks", type=int, default=15)
    parser.add_argument("--answer-chars", type=int, default=6500)
    parser.add_argument("--no-journals", action="store_true", help="skip the peer (it writes ~0.7 GB at 1.0)")
    args = parser.parse_args()
    os.environ.pop("OPENROUTER_API_KEY", None)  # no account: the tick is the ledger's and Dagster's work only
    print(
        f"{'fraction':>8} {'attempts':>9} {'ledger MB':>9} {'tick (median)':>14} {'tick (max)':>10} "
        f"{'journal records':>15} {'journals MB':>11} {'re-read all':>11} {'ratio':>6}"
    )
    for fraction in (float(f) for f in args.fraction.split(",")):
        with tempfile.TemporaryDirectory() as d:
            layout = DataLayout(d)
            rows = fill_ledger(layout, fraction)
            times = tick_times(Path(d), args.ticks)
            ledger_mb = sum(p.stat().st_size for p in layout.ledger().parent.glob("*")) / 1e6
            median = statistics.median(times)
            line = f"{fraction:>8.2f} {rows:>9,} {ledger_mb:>9.1f} {median * 1e3:>12.1f}ms {max(times) * 1e3:>8.1f}ms"
            if not args.no_journals:
                records = fill_journals(layout, fraction, args.answer_chars)
                journal_mb = sum(p.stat().st_size for p in layout.all_completion_journals()) / 1e6
                reread = journal_read_time(layout)
                line += f" {records:>15,} {journal_mb:>11.0f} {reread:>10.2f}s {reread / median:>6.0f}x"
            print(line, flush=True)


if __name__ == "__main__":
    main()
