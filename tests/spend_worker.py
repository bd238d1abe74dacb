"""A process that buys completions for synthetic datasets, as a run would: the money tests start several and kill some.

    python tests/spend_worker.py --url URL --key K --tokenizer DIR --data DIR --run-id R --datasets A,B
        [--prompts 40] [--run-usd X] [--total-usd Y] [--start-at EPOCH] [--concurrency 16] [--max-tokens 400]
        [--stream 0]

Each dataset's prompts are rendered with the project's chat format (what a real run sends), completed through
`run_completions` with the data root's shared ledger, journaled under DIR/completions/<dataset>/journal.jsonl.
Prints one JSON line per dataset when it ends.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3_assets.money import Caps, Pricing, open_ledger  # noqa: E402
from eagle3_assets.stages.completions.run import run_completions  # noqa: E402
from eagle3_resources.completions.openrouter import OpenRouterBackend  # noqa: E402
from eagle3_resources.completions.types import CompletionRequest, SamplingSettings  # noqa: E402
from eagle3_resources.storage import DataLayout  # noqa: E402
from eagle3_resources.tokenizer.chat_format import render_messages  # noqa: E402
from eagle3_resources.tokenizer.resource import load_tokenizer  # noqa: E402

PRICING = Pricing(0.60e-6, 2.50e-6)  # the fake's default prices


def synthetic(tok, dataset: str, n: int) -> list[CompletionRequest]:
    out = []
    for i in range(n):
        messages = [{"role": "user", "content": f"{dataset} question {i}: what is {i} times {i + 3}, and why?"}]
        out.append(
            CompletionRequest(
                f"{dataset}-{i:04d}", messages, None, tok.encode(render_messages(messages, None), allow_special=True)
            )
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--datasets", required=True)
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--run-usd", type=float)
    p.add_argument("--total-usd", type=float)
    p.add_argument("--start-at", type=float, default=0.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument(
        "--stream", type=int, default=1, help="0: non-streaming requests (no generation id before the answer)"
    )
    a = p.parse_args()
    tok = load_tokenizer(Path(a.tokenizer))
    layout = DataLayout(a.data)
    ledger = open_ledger(layout)
    caps = Caps(run_usd=a.run_usd, total_usd=a.total_usd)
    requests = {d: synthetic(tok, d, a.prompts) for d in a.datasets.split(",")}
    time.sleep(max(0.0, a.start_at - time.time()))  # several workers start together
    for dataset, reqs in requests.items():
        backend = OpenRouterBackend(
            a.url, a.key, concurrency=a.concurrency, backoff_base_s=0.05, backoff_cap_s=0.5, stream=bool(a.stream)
        )
        run = run_completions(
            dataset,
            reqs,
            backend,
            SamplingSettings(max_tokens=a.max_tokens),
            layout.completions_journal(dataset),
            ledger=ledger,
            caps=caps,
            pricing=PRICING,
            run_id=a.run_id,
            log=lambda m: print(m, file=sys.stderr),
            settle_window_s=5.0,
        )
        print(
            json.dumps(
                {
                    "dataset": dataset,
                    "sent": run.sent,
                    "stopped_by": run.stopped_by,
                    "billed_usd": run.cost_usd,
                    "results": dict(run.results),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
