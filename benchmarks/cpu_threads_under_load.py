"""torch CPU threads under load: torch's default count against the one eagle3_resources.cpu chooses.

The workload is the stand-in target's fit (`eagle3_resources.target.standin.fit`, the same code)
on the stand-in config (DeepseekV3, hidden 64, 8 layers, MLA, small MoE, vocabulary 163,840) with
random weights and random token sequences shaped like the fitting set (~50 prompt + ~30 answer
tokens, a few thousand distinct ids, batch 16). `--load N` starts N busy-loop processes (one
process group, killed by its pgid at the end) to stand for other work on the machine.

    .venv/bin/python benchmarks/cpu_threads_under_load.py --load 0
    .venv/bin/python benchmarks/cpu_threads_under_load.py --load 6 --steps 3
    .venv/bin/python benchmarks/cpu_threads_under_load.py --load 1 --duty 0.3 --threads 1,2   # any counts
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from eagle3_resources import cpu  # noqa: E402
from eagle3_resources.target import standin  # noqa: E402
from eagle3_resources.tokenizer.special_tokens import (  # noqa: E402
    KIMI_SPECIAL_TOKENS,
    PAD,
    VOCAB_SIZE,
)

BUSY = "while True: pass"
# Busy `duty` of every 10 ms, asleep the rest: a process that keeps part of a CPU busy.
PARTLY_BUSY = """import time
while True:
    t = time.perf_counter() + {duty} * 0.01
    while time.perf_counter() < t:
        pass
    time.sleep((1 - {duty}) * 0.01)
"""


def start_load(n: int, duty: float = 1.0) -> int | None:
    """N busy-loop processes (busy `duty` of the time) in one new process group; its pgid (None for n == 0)."""
    if n <= 0:
        return None
    code = BUSY if duty >= 1 else PARTLY_BUSY.format(duty=duty)
    first = subprocess.Popen([sys.executable, "-c", code], process_group=0)
    for _ in range(n - 1):
        subprocess.Popen([sys.executable, "-c", code], process_group=first.pid)
    return first.pid


def stop_load(pgid: int | None) -> None:
    if pgid is None:
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        while os.waitpid(-pgid, 0):
            pass
    except ChildProcessError:
        pass


def workload(seed: int = 0):
    tok = SimpleNamespace(vocab_size=VOCAB_SIZE, token_id=lambda name: KIMI_SPECIAL_TOKENS[name])
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    # a duck-typed tokenizer: standin_config reads its vocab_size and token_id only
    model = DeepseekV3ForCausalLM(standin.standin_config(tok))  # type: ignore[arg-type]
    rng = random.Random(seed)
    used = rng.sample(range(VOCAB_SIZE - 256), 3000)
    seqs = []
    for _ in range(300):
        n_prompt, n_answer = rng.randint(20, standin.FIT_PROMPT_TOKENS), rng.randint(25, 40)
        seqs.append(([rng.choice(used) for _ in range(n_prompt + n_answer)], n_prompt))
    return model, seqs, KIMI_SPECIAL_TOKENS[PAD]


def timed_fit(model, seqs, pad: int, threads: int, steps: int) -> float:
    torch.set_num_threads(threads)
    m = copy.deepcopy(model)
    standin.fit(m, seqs, pad, steps=1, log=lambda _: None)  # warm-up (allocations, first-call costs)
    started = time.monotonic()
    standin.fit(m, seqs, pad, steps=steps, log=lambda _: None)
    return time.monotonic() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--load", type=int, default=0, help="busy-loop processes to run alongside (default 0)")
    ap.add_argument(
        "--duty", type=float, default=1.0, help="fraction of the time each load process is busy (default 1)"
    )
    ap.add_argument("--steps", type=int, default=4, help="timed fit steps per run (default 4)")
    ap.add_argument(
        "--threads",
        default="default,chosen",
        help="comma-separated counts to time: integers, `default` (torch's own) or `chosen` (the rule)",
    )
    args = ap.parse_args()

    default = torch.get_num_threads()
    model, seqs, pad = workload()
    pgid = start_load(args.load, args.duty)
    try:
        time.sleep(0.5 if args.load else 0)  # let the busy loops get going before the rule looks
        picture = cpu.measure()
        choice = cpu.choose_threads(picture, os.environ.get(cpu.ENV))
        print(
            f"{os.cpu_count()} CPUs, load {args.load} busy processes (duty {args.duty:g}); "
            f"torch default {default} threads; "
            f"rule: {choice.threads} ({choice.reason})",
            flush=True,
        )
        results: dict[str, tuple[int, float]] = {}
        for label in args.threads.split(","):
            n = default if label == "default" else choice.threads if label == "chosen" else int(label)
            secs = timed_fit(model, seqs, pad, n, args.steps)
            results[label] = (n, secs)
            print(
                f"  {label:>8}: {n} thread{'s' if n != 1 else ''}, {args.steps} steps in {secs:6.2f} s "
                f"({secs / args.steps:.2f} s/step)",
                flush=True,
            )
        if "default" in results and "chosen" in results:
            (nd, d), (nc, c) = results["default"], results["chosen"]
            print(f"  default/chosen = {d / c:.2f}x" + ("  (same count)" if nd == nc else ""), flush=True)
    finally:
        stop_load(pgid)


if __name__ == "__main__":
    main()
