"""Benchmark: the streaming drafter per dataset against offline, on datasets that differ (issue 42, item 2).

    .venv/bin/python benchmarks/mixed_datasets.py --json /tmp/mixed.json   # the defaults: 5 seeds
    .venv/bin/python benchmarks/mixed_datasets.py --seeds 1 2 3     # tests/test_streaming_mix_quality.py's

Why. Offline training shuffles every window of the merged set every epoch. The spool's trainer takes shards in the
order capture commits them and shuffles within a slot; before issue 42 capture planned shards dataset by dataset, so
streaming trained one dataset, then the next. streaming_vs_offline.py cannot see that: its datasets answer alike.

The data: two datasets whose answers differ, made from the stand-in target's own answer rule (`rule_reply`, which it
was fitted on, so its teacher-forced predictions follow them) on the shipped prompts' texts, one text per sample:
`reasoning` trains on the answer's reasoning only ("Let me think about <topic>. I should answer clearly and
briefly." and `</think>`; the sample ends there), `answer` on the final answer only ("Here is a short answer about
<topic>. I hope this helps." and `<|im_end|>`; the reasoning before it is context, not trained). Their loss tokens
are nearly disjoint and where they meet they continue differently (". I should" / ". I hope"), so a drafter trained
on one and then the other forgets the first; the last `--prompt-tokens` of each rendered prompt are kept. The
training split lists them dataset by dataset, as a merged set does; `--per-dataset` samples each (the shares are
the merged set's: equal by default), `--eval-per-dataset` more of each held out.

Per seed s (the drafter's initial weights and the data order, as streaming_vs_offline.py):
- offline: the training split extracted into a store, then `train` for `--epochs` E epochs;
- streaming: captured (`capture_to_spool`, this thread) into a one-lane spool of about `--budget-fraction` of the
  data's shard bytes (at least the lane's working set; a quarter by default) while `train_from_spool` trains on it
  (another thread) with `passes = E`; the capture's shards interleave the datasets (`store.plan_mixed_shards`), the
  trainer shuffles a mix of as many shards as the budget allows (`spool.default_mix_shards`: 3 of the 30 here);
- by dataset: the same, the shards planned as before issue 42 (`store.plan_shards`: each dataset's samples in order,
  shards of one dataset), so the trainer takes one dataset after the other.
`--batch-tokens 1` (the default) makes every step one window in every mode: the same steps, so what differs is the
order; the spool's step estimate (plan.json's windows) then gives its learning-rate schedule offline's length.

The measure: each dataset's accept length, teacher-forced (`train.evaluate`, the TTT proxy with `--ttt-steps` draft
steps) on its held-out samples' stored states. Not SGLang's by decoding: on the stand-in every prompt decodes to the
same rule, reasoning then answer, so a decode cannot tell the datasets apart. The rule is streaming_vs_offline.py's,
per dataset: within noise when |mean_streaming - mean_offline| <= t_0.975(df) x SE over the seeds (Welch), SE floored
at `--min-se`; and training must raise every dataset's offline mean by more than `--signal-factor` SE over the
untrained drafter's. Prints one JSON object and writes it to `--json`. CPU only; torch on `--threads` threads.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import streaming_vs_offline as svo  # noqa: E402

from eagle3_assets.stages.eagle3_drafter.data import plan_windows  # noqa: E402
from eagle3_assets.stages.eagle3_drafter.train import eval_samples, evaluate, train  # noqa: E402
from eagle3_resources.hidden_states.spool import (  # noqa: E402
    SpoolSettings,
    default_mix_shards,
    min_lane_bytes,
)
from eagle3_resources.hidden_states.store import (  # noqa: E402
    HiddenStateStore,
    ShardPlan,
    ShardPlanner,
    StoredSample,
    padded_size,
    plan_mixed_shards,
    plan_shards,
    shard_layout,
)
from eagle3_resources.target.standin import fitting_sequences  # noqa: E402
from eagle3_resources.tokenizer.special_tokens import THINK_END  # noqa: E402

LANE = "gpu0"
IDENTITY = {"target": "standin", "benchmark": "mixed_datasets"}
DATASETS = ("reasoning", "answer")
MODES = ("offline", "streaming", "by_dataset", "untrained")


@dataclass(frozen=True)
class Settings:
    """What one comparison runs (the command line's options, defaults as documented there)."""

    seeds: tuple[int, ...] = (1, 2, 3, 4, 5)
    per_dataset: int = 48
    eval_per_dataset: int = 6
    prompt_tokens: int = 16
    epochs: int = 1
    ttt_steps: int = 3
    batch_tokens: int = 1
    max_len: int = 128
    warmup_steps: int = 5
    draft_vocab: int = 512
    shard_bytes: int = 100_000  # about four samples a shard at the stand-in's width
    budget_fraction: float = 0.25  # a mix of 3 shards (12 samples): the trainer's shuffle across shards at work
    min_se: float = 0.01
    signal_factor: float = 10.0

    def comparison(self) -> svo.Comparison:
        """streaming_vs_offline's settings for the pieces shared with it (drafter, store, trainer settings)."""
        return svo.Comparison(
            seeds=self.seeds,
            epochs=self.epochs,
            ttt_steps=self.ttt_steps,
            batch_tokens=self.batch_tokens,
            max_len=self.max_len,
            warmup_steps=self.warmup_steps,
            draft_vocab=self.draft_vocab,
            shard_bytes=self.shard_bytes,
            budget_fraction=self.budget_fraction,
        )


def two_datasets(standin: svo.Standin, s: Settings) -> svo.Data:
    """`reasoning` and `answer` samples (the module's docstring) from distinct shipped prompt texts: the training
    split dataset by dataset, `eval_per_dataset` of each held out."""
    texts = [p.messages[-1]["content"] for _, p in svo.prompt_records() if isinstance(p.messages[-1]["content"], str)]
    sequences = fitting_sequences(standin.tok, texts, s.prompt_tokens)
    random.Random(0).shuffle(sequences)  # the datasets draw from every prompt file alike
    per = s.per_dataset + s.eval_per_dataset
    if len(sequences) < per * len(DATASETS):
        raise ValueError(f"{per * len(DATASETS)} samples asked for; the shipped prompt texts give {len(sequences)}")
    think_end = standin.tok.token_id(THINK_END)
    train: list[StoredSample] = []
    held: list[StoredSample] = []
    for d, dataset in enumerate(DATASETS):
        for i, (ids, prompt) in enumerate(sequences[d * per : (d + 1) * per]):
            cut = ids.index(think_end) + 1  # the reasoning and its `</think>`
            if dataset == "reasoning":
                ids, mask = ids[:cut], [0] * prompt + [1] * (cut - prompt)
            else:
                mask = [0] * cut + [1] * (len(ids) - cut)
            split = "train" if i < s.per_dataset else "eval"
            (train if split == "train" else held).append(StoredSample(f"{dataset}/{i:03d}", split, ids, mask, dataset))
    return svo.Data(train, held, [])


def by_dataset(
    samples: Sequence[StoredSample], hidden: int, shard_bytes: int, identity: dict[str, Any], seed: int
) -> list[ShardPlan]:
    """The capture's plan before issue 42: each dataset's samples in order, in shards of their own (`plan_shards`)."""
    return plan_shards(samples, hidden, shard_bytes, identity)


@dataclass
class Run:
    mode: str
    seed: int
    accept_length: dict[str, float]  # per dataset, teacher-forced on its held-out samples
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def accept_by_dataset(built: svo.Built, store: HiddenStateStore, data: svo.Data, s: Settings) -> dict[str, float]:
    out = {}
    for dataset in DATASETS:
        held = [(x.sample_id, len(x.input_ids)) for x in data.held_out if x.group == dataset]
        samples = eval_samples(store, plan_windows(held, s.max_len).windows, built.teacher, torch.device("cpu"))
        out[dataset] = float(evaluate(built.model.eval(), samples, s.ttt_steps)["accept_length"])
    return out


def train_offline(standin: svo.Standin, store: HiddenStateStore, data: svo.Data, s: Settings, seed: int) -> Run:
    c = s.comparison()
    built = svo.build_drafter(standin, data, c, seed)
    windows = plan_windows([(x.sample_id, len(x.input_ids)) for x in data.train], s.max_len).windows
    started = time.monotonic()
    history = train(
        built.model, store, windows, [], c.settings(seed, s.epochs), head=built.head, device=torch.device("cpu"),
        log=lambda m: None, teacher=built.teacher,
    )  # fmt: skip
    seconds = round(time.monotonic() - started, 1)
    return Run(
        "offline", seed, accept_by_dataset(built, store, data, s), len(history.step_loss), history.tokens, seconds
    )


def spool_shape(data: svo.Data, hidden: int, s: Settings, planner: ShardPlanner, seed: int) -> tuple[int, int, int]:
    """(the spool's budget, the data's shard bytes, the mix): `budget_fraction` of the data, at least the lane's
    working set; the mix as the asset derives it (`default_mix_shards`)."""
    plans = planner(data.train, hidden, s.shard_bytes, IDENTITY, seed)
    sizes = [shard_layout(p, [data.train[i] for i in p.samples], hidden).size for p in plans]
    total = sum(padded_size(n) for n in sizes)
    budget = max(int(total * s.budget_fraction), min_lane_bytes(s.epochs, max(sizes)))
    return budget, total, default_mix_shards(budget, max(sizes), s.epochs)


def train_streaming(
    standin: svo.Standin,
    store: HiddenStateStore,
    data: svo.Data,
    s: Settings,
    seed: int,
    work: Path,
    mode: str,
) -> Run:
    """Capture into a fresh spool (this thread) while the trainer trains from it (another thread); `streaming`: the
    capture's own plan (its default), `by_dataset`: the plan before issue 42. A failed trainer stops the capture and
    its error is raised here."""
    c = s.comparison()
    chosen = None if mode == "streaming" else by_dataset  # streaming: what production runs is what is measured
    planner: ShardPlanner = chosen or plan_mixed_shards
    built = svo.build_drafter(standin, data, c, seed)
    hidden = int(store.manifest["hidden_size"])
    budget, total, mix = spool_shape(data, hidden, s, planner, seed)
    root, checkpoints = work / f"spool-{mode}-{seed}", work / f"checkpoint-{mode}-{seed}"
    for old in (root, checkpoints):
        shutil.rmtree(old, ignore_errors=True)
    spool_settings = SpoolSettings({LANE: budget}, s.epochs, s.max_len, s.batch_tokens, seed, hidden, mix)
    streamed = svo.capture_and_train(standin, built, data, c, seed, spool_settings, root, checkpoints, chosen)
    counter, capture, seconds = streamed.counter, streamed.capture, round(streamed.seconds, 1)
    history, spool = streamed.trainer.history, streamed.data
    plan = json.loads((root / "lanes" / LANE / "plan.json").read_text())
    extra = {
        "token_passes": counter.histogram(),
        "step_token_mismatches": counter.mismatches,
        "estimated_steps": spool.estimated_steps,
        "budget_share": round(budget / total, 4),
        "mix_shards": mix,
        "shards": len(plan["shards"]),
        "shard_datasets": [shard["datasets"] for shard in plan["shards"]],
        "capture_pauses": capture.pauses,
    }
    accept = accept_by_dataset(built, store, data, s)
    return Run(mode, seed, accept, len(history.step_loss), history.tokens, seconds, extra)


def untrained(standin: svo.Standin, store: HiddenStateStore, data: svo.Data, s: Settings, seed: int) -> Run:
    return Run(
        "untrained", seed, accept_by_dataset(svo.build_drafter(standin, data, s.comparison(), seed), store, data, s)
    )


def verdict(runs: Sequence[Run], s: Settings, mode: str, dataset: str) -> dict[str, Any]:
    """`mode` against offline on `dataset` over the seeds: the means, the difference, its SE and Welch's verdict."""
    (off, sd_off, k_off), (it, sd_it, k_it) = (
        svo.spread([r.accept_length[dataset] for r in runs if r.mode == m]) for m in ("offline", mode)
    )
    se = math.sqrt(sd_off**2 / k_off + sd_it**2 / k_it)
    noise = max(se, s.min_se)
    band = svo.t_975(svo.welch_df(sd_off, k_off, sd_it, k_it)) * noise
    return {
        "offline": round(off, 4),
        mode: round(it, 4),
        "difference": round(it - off, 4),
        "se_difference": round(se, 4),
        "band": round(band, 4),
        "within_noise": abs(it - off) <= band,
    }


def verdicts(runs: Sequence[Run], s: Settings) -> dict[str, Any]:
    """Per dataset: each streaming order against offline, the spreads, and whether training mattered."""
    out: dict[str, Any] = {}
    for dataset in DATASETS:
        spreads = {m: svo.spread([r.accept_length[dataset] for r in runs if r.mode == m]) for m in MODES}
        off, sd_off, k_off = spreads["offline"]
        floor = spreads["untrained"][0]
        se = max(sd_off / math.sqrt(k_off), s.min_se)
        out[dataset] = {
            "mean_std": {m: [round(mean, 4), round(sd, 4)] for m, (mean, sd, _) in spreads.items()},
            "streaming": verdict(runs, s, "streaming", dataset),
            "by_dataset": verdict(runs, s, "by_dataset", dataset),
            "training_gain": round(off - floor, 4),
            "training_matters": off - floor > s.signal_factor * se,
        }
    return out


def compare(standin: svo.Standin, s: Settings, work: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The data, its store, then per seed offline, streaming, by dataset and untrained; the figures and verdicts."""
    started = time.monotonic()
    data = two_datasets(standin, s)
    store = svo.extract(standin, [*data.train, *data.held_out], work / "store", s.comparison())
    runs: list[Run] = []
    for seed in s.seeds:
        for mode in MODES:
            if mode == "offline":
                run = train_offline(standin, store, data, s, seed)
            elif mode == "untrained":
                run = untrained(standin, store, data, s, seed)
            else:
                run = train_streaming(standin, store, data, s, seed, work, mode)
            runs.append(run)
            figures = ", ".join(f"{d} {a:.4f}" for d, a in run.accept_length.items())
            log(f"seed {seed} {mode:10s}: accept length {figures}; {run.steps} steps, {run.seconds} s")
    return {
        "settings": asdict(s),
        "train_samples": len(data.train),
        "train_tokens": data.train_tokens,
        "runs": [asdict(r) for r in runs],
        "accept_length": verdicts(runs, s),
        "wall_s": round(time.monotonic() - started, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    d = Settings()
    p.add_argument("--standin-dir", type=Path, default=Path(tempfile.gettempdir()) / "eagle3-standin")
    p.add_argument("--work", type=Path, default=None, help="store and spools here (default: a temporary folder)")
    p.add_argument("--seeds", type=int, nargs="+", default=list(d.seeds))
    p.add_argument("--per-dataset", type=int, default=d.per_dataset, help="training samples of each dataset")
    p.add_argument("--eval-per-dataset", type=int, default=d.eval_per_dataset)
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens)
    p.add_argument("--epochs", type=int, default=d.epochs, help="offline epochs = streaming passes")
    p.add_argument("--ttt-steps", type=int, default=d.ttt_steps)
    p.add_argument("--batch-tokens", type=int, default=d.batch_tokens)
    p.add_argument("--shard-bytes", type=int, default=d.shard_bytes)
    p.add_argument("--budget-fraction", type=float, default=d.budget_fraction)
    p.add_argument("--signal-factor", type=float, default=d.signal_factor)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None, help="also write the figures here")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    s = Settings(
        seeds=tuple(a.seeds),
        per_dataset=a.per_dataset,
        eval_per_dataset=a.eval_per_dataset,
        prompt_tokens=a.prompt_tokens,
        epochs=a.epochs,
        ttt_steps=a.ttt_steps,
        batch_tokens=a.batch_tokens,
        shard_bytes=a.shard_bytes,
        budget_fraction=a.budget_fraction,
        signal_factor=a.signal_factor,
    )
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    standin = svo.load_standin(a.standin_dir, log)
    with tempfile.TemporaryDirectory() as tmp:
        figures = compare(standin, s, a.work or Path(tmp), log)
    for dataset, v in figures["accept_length"].items():
        ms = v["mean_std"]
        log(
            f"{dataset}: offline {ms['offline'][0]} +- {ms['offline'][1]}, streaming {ms['streaming'][0]} +- "
            f"{ms['streaming'][1]} (within noise {v['streaming']['within_noise']}, band {v['streaming']['band']}), "
            f"by dataset {ms['by_dataset'][0]} +- {ms['by_dataset'][1]} (within noise "
            f"{v['by_dataset']['within_noise']}), untrained {ms['untrained'][0]}"
        )
    print(json.dumps(figures))
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
