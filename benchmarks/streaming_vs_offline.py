"""Benchmark: the streaming drafter against the offline one on the same data, by real speculative decoding (issue 27).

    .venv/bin/python benchmarks/streaming_vs_offline.py --json /tmp/svo.json      # the defaults: 5 seeds, ~5 min
    .venv/bin/python benchmarks/streaming_vs_offline.py --seeds 1 2 3 --eval-prompts 8 --untrained-seeds 1  # the test's

The data: regenerated samples, as the published drafters train on. Prompts are the shipped prompt files (data/prompts,
the registry's datasets, read as the raw-prompts stage reads them, each conversation rendered in Kimi's template, its
last `--prompt-tokens` tokens), taken round-robin over the datasets; each completion is the stand-in target's own
greedy continuation (up to `--new-tokens`, ending at its EOS). The first `--train-samples` are the training split, the
next `--eval-prompts` the held-out one. Samples are grouped by dataset (the store's shard groups), as in a merged set;
the spool's capture interleaves them (datasets that differ, and the order before: benchmarks/mixed_datasets.py).

For each seed s (the drafter's initial weights `torch.manual_seed(s)`, as pipeline.py builds it, and the data order):
- offline: the training split extracted into a store (`extract_to_store`), then `train` for `--epochs` E epochs;
- streaming: the training split captured (`capture_to_spool`, on a thread of this process) into a one-lane spool whose
  budget is about `--budget-fraction` of the data's shard bytes (at least the lane's working set: `passes + 1` of its
  largest shard), while `train_from_spool` trains on it with `passes = E` (the spool's settings carry the seed,
  window length and step tokens; `TrainSettings` otherwise the same). Capture pauses while the spool is full.
Both are the one-process APIs the asset drives; the same stand-in target, draft vocabulary (the training split's loss
tokens) and teacher. `--stream-seed-offset` gives the streaming runs other seeds (another init and schedule).

Step size. The spool packs each slot (a shard's passes mixed with its neighbours') into steps of its own, so every slot
ends with a partial step. At real scale a shard holds thousands of windows and that is noise; the stand-in's shards
hold two samples, and at 256 tokens a step the streaming trainer takes a third more optimizer steps than the offline
one (80 against 60 on 40 samples) and decodes better for it (+0.22 accept length, t = 3.5). The default
`--batch-tokens 1` makes every step one window in both modes: the same steps, the same tokens per step, so what is
compared is the order the spool trains in, not the step count.

Measured on the held-out prompts with the REAL loop (`speculative.evaluate_speculative`: the target verifies the chain,
output checked equal to greedy decoding): SGLang's accept length (generated tokens / verify forwards, 3 draft steps,
top-1, 4 draft tokens), per drafter; and `train.evaluate`'s teacher-forced TTT proxy on the held-out samples' stored
states. The untrained drafter of each seed (its initial weights) is measured too: the floor.

The noise and the rule. Seeds are the noise: a drafter's accept length varies with its initial weights and its data
order, and that spread is what any one run of either mode is subject to. Per mode: the mean and the sample standard
deviation over its k seeds; the standard error of the difference of the means, SE = sqrt(sd_off^2/k + sd_str^2/k),
floored at `--min-se` (0.01 accept length, about the resolution of the held-out decodes' mean) so that seeds that
happen to agree closely do not make the band vanish. "Within noise" is Welch's two-sided t-test at 5%:
|mean_streaming - mean_offline| <= t_0.975(df) x SE, df by Welch-Satterthwaite rounded down. The brief's plain rule,
2 SE, is reported too (`within_2se`); it treats SE as exact, which with 3 to 5 seeds it is not: at df 4 to 8 a
2 SE band is exceeded by 8 to 12% of differences that are pure noise, the t band by 5%. A pass says "not
distinguishable at this k", not "equal". Training must matter far more than the noise: the gain of the offline mean
over the untrained mean must exceed `--signal-factor` (default 10) times SE, otherwise "within noise" would hold of
anything. Each streaming run also counts, from the trainer's own record of each step's windows (a hook after each
step), how many times every training token was trained: exactly E for every token, the offline run's token-epochs
(both trainers' token counts are E x the split's tokens).

Prints one JSON object (per seed and mode, the means, standard deviations, the difference, SE, the verdicts, the wall
time; `ttt_accept_length` the same for the proxy) and writes it to `--json`. CPU only; torch on `--threads` threads.
Keeps the regenerated samples and the store in `--work` for a later run (default: a temporary folder).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3_assets.common.registry import DEFAULT_REGISTRY, load_registry  # noqa: E402
from eagle3_assets.stages.eagle3_drafter.data import Teacher, plan_windows  # noqa: E402
from eagle3_assets.stages.eagle3_drafter.model import Eagle3Drafter  # noqa: E402
from eagle3_assets.stages.eagle3_drafter.pipeline import drafter_config  # noqa: E402
from eagle3_assets.stages.eagle3_drafter.speculative import (  # noqa: E402
    SpecDecodeReport,
    evaluate_speculative,
    greedy_generate_many,
)
from eagle3_assets.stages.eagle3_drafter.spool_data import SpoolWindows, train_from_spool  # noqa: E402
from eagle3_assets.stages.eagle3_drafter.target_weights import load_embed_and_head  # noqa: E402
from eagle3_assets.stages.eagle3_drafter.train import (  # noqa: E402
    Every,
    RunOptions,
    Trainer,
    TrainSettings,
    eval_samples,
    evaluate,
    train,
)
from eagle3_assets.stages.eagle3_drafter.vocab import (  # noqa: E402
    build_draft_vocab,
    count_loss_tokens,
    effective_draft_vocab_size,
)
from eagle3_assets.stages.raw_prompts.prompts import Prompt, read_prompts  # noqa: E402
from eagle3_resources.hidden_states.extract import StoreSettings, capture_to_spool, extract_to_store  # noqa: E402
from eagle3_resources.hidden_states.spool import (  # noqa: E402
    SpoolSettings,
    create_spool,
    default_mix_shards,
    min_lane_bytes,
)
from eagle3_resources.hidden_states.store import (  # noqa: E402
    HiddenStateStore,
    StoredSample,
    padded_size,
    plan_mixed_shards,
    shard_layout,
)
from eagle3_resources.hidden_states.transformers_backend import TransformersHiddenStates  # noqa: E402
from eagle3_resources.tokenizer.chat_format import render_messages  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LANE = "gpu0"
IDENTITY = {"target": "standin", "benchmark": "streaming_vs_offline"}


@dataclass(frozen=True)
class Comparison:
    """What one comparison runs (the command line's options, defaults as documented there)."""

    seeds: tuple[int, ...] = (1, 2, 3, 4, 5)
    train_samples: int = 40
    eval_prompts: int = 24
    prompt_tokens: int = 48
    new_tokens: int = 48  # the regenerated completions' length at most
    epochs: int = 3  # offline epochs = streaming passes
    ttt_steps: int = 3
    batch_tokens: int = 1  # tokens a step at most: 1 = one window a step in both modes (see the docstring)
    max_len: int = 128
    warmup_steps: int = 5
    lr: float | None = None  # None: default_learning_rate(width)
    draft_vocab: int = 512
    shard_bytes: int = 64_000  # about two samples a shard at the stand-in's width
    budget_fraction: float = 0.1
    draft_steps: int = 3
    decode_tokens: int = 32  # new tokens decoded per held-out prompt
    compare_greedy: bool = True  # check each decode equals greedy decoding (lossless)
    untrained_seeds: int | None = None  # how many seeds' untrained drafters to measure (None: all)
    stream_seed_offset: int = 0  # the streaming run of seed s uses seed s + this (another init and schedule: noise)
    min_se: float = 0.01
    signal_factor: float = 10.0

    def settings(self, seed: int, epochs: int) -> TrainSettings:
        return TrainSettings(
            ttt_steps=self.ttt_steps,
            epochs=epochs,
            lr=self.lr,
            warmup_steps=self.warmup_steps,
            batch_tokens=self.batch_tokens,
            max_len=self.max_len,
            seed=seed,
            checkpoint_every=10**6,  # the streaming trainer checkpoints when it waits for capture (and at its end)
        )


@dataclass
class Standin:
    tok: Any
    target: Any
    folder: Path


def load_standin(standin_dir: Path, log: Callable[[str], None] = print) -> Standin:
    """The stand-in tokenizer and target (built once under `standin_dir`, minutes the first time)."""
    from eagle3_resources.target.resource import TargetModelResource
    from eagle3_resources.tokenizer.resource import TokenizerResource

    tokenizer = TokenizerResource(standin_dir=str(standin_dir))
    target = TargetModelResource(standin_dir=str(standin_dir))
    model = target.load_model(tokenizer, log=log)
    return Standin(tokenizer.load(), model, target.folder(tokenizer, log=log))


@dataclass
class Data:
    train: list[StoredSample]  # grouped by dataset
    held_out: list[StoredSample]
    prompts: list[list[int]]  # the held-out samples' prompts
    # the target's greedy decodes of `prompts`, the lossless check's reference: the same for every drafter, so decoded
    # by the first `measure` and taken by the others (60 % of each measure's time)
    greedy: SpecDecodeReport | None = None

    @property
    def train_tokens(self) -> int:
        return sum(len(s.input_ids) for s in self.train)


def prompt_records() -> list[tuple[str, Prompt]]:
    """(dataset, prompt) of the shipped prompt files (the registry's datasets, read as the raw-prompts stage reads
    them), round-robin over the datasets (A1, A2, B1, ...)."""
    per_dataset = [[(name, p) for p in read_prompts(spec)] for name, spec in load_registry(DEFAULT_REGISTRY).items()]
    out: list[tuple[str, Prompt]] = []
    for k in range(max(len(rows) for rows in per_dataset)):
        out.extend(rows[k] for rows in per_dataset if k < len(rows))
    return out


def regenerate(standin: Standin, c: Comparison, log: Callable[[str], None] = print) -> Data:
    """The training and held-out samples: each prompt rendered in Kimi's template (its last `prompt_tokens`) and
    the target's greedy answer (up to `new_tokens`, its EOS included)."""
    records = prompt_records()
    need = c.train_samples + c.eval_prompts
    if need > len(records):
        raise ValueError(f"{need} samples asked for; the shipped prompt files hold {len(records)}")
    started = time.monotonic()
    rendered = [render_messages(record.messages, record.tools) for _, record in records[:need]]
    prompt_ids = [standin.tok.encode(text, allow_special=True)[-c.prompt_tokens :] for text in rendered]
    # batched: 15 s against 111 s one by one (one thread, the 64 default samples), and the same 64 answers
    answers = greedy_generate_many(standin.target, prompt_ids, c.new_tokens)
    samples, prompts = [], {}
    for i, ((dataset, record), prompt, answer) in enumerate(zip(records[:need], prompt_ids, answers, strict=True)):
        split = "train" if i < c.train_samples else "eval"
        sid = f"{dataset}/{record.prompt_id}"
        samples.append(StoredSample(sid, split, prompt + answer, [0] * len(prompt) + [1] * len(answer), dataset))
        prompts[sid] = prompt
    order = {s.group: k for k, s in reversed(list(enumerate(samples)))}
    train = sorted((s for s in samples if s.split == "train"), key=lambda s: order[s.group])  # stable: by dataset
    held = [s for s in samples if s.split == "eval"]
    log(
        f"data: {len(train)} training samples ({sum(len(s.input_ids) for s in train):,} tokens), {len(held)} held-out, "
        f"regenerated in {time.monotonic() - started:.1f} s"
    )
    return Data(train, held, [prompts[s.sample_id] for s in held])


def cached_data(standin: Standin, c: Comparison, work: Path, log: Callable[[str], None] = print) -> Data:
    """`regenerate`'s samples, kept in `work`/data.json and reused by a later run with the same data options (greedy
    decoding of the same target repeats them)."""
    key = {
        "target": standin.folder.name,
        **{k: getattr(c, k) for k in ("train_samples", "eval_prompts", "prompt_tokens", "new_tokens")},
    }
    path = work / "data.json"
    if path.exists() and (kept := json.loads(path.read_text()))["key"] == key:
        samples = [StoredSample(s["id"], s["split"], s["ids"], s["mask"], s["group"]) for s in kept["samples"]]
        log(f"data: {len(samples)} samples from {path}")
        train = [s for s in samples if s.split == "train"]
        held = [s for s in samples if s.split == "eval"]
        return Data(train, held, [list(s.input_ids[: list(s.loss_mask).index(1)]) for s in held])
    data = regenerate(standin, c, log)
    rows = [
        {"id": s.sample_id, "split": s.split, "ids": list(s.input_ids), "mask": list(s.loss_mask), "group": s.group}
        for s in [*data.train, *data.held_out]
    ]
    work.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": key, "samples": rows}))
    return data


def store_settings(c: Comparison) -> StoreSettings:
    """One writer: shards are committed in plan order, so the spool's adoption order repeats from run to run."""
    return StoreSettings(shard_bytes=c.shard_bytes, batch_tokens=2048, writers=1, free_bytes=10**12, reserve_bytes=0)


def extract(standin: Standin, samples: Sequence[StoredSample], root: Path, c: Comparison) -> HiddenStateStore:
    backend = TransformersHiddenStates(standin.target)
    extract_to_store(samples, backend, root, store_settings(c), identity=IDENTITY, log=lambda m: None)
    return HiddenStateStore(root)


@dataclass
class Built:
    model: Eagle3Drafter
    teacher: Teacher
    head: torch.Tensor


def build_drafter(standin: Standin, data: Data, c: Comparison, seed: int) -> Built:
    """The drafter pipeline.py builds for this data: the training split's loss tokens as draft vocabulary, the
    target's shape and frozen embedding, initial weights from `seed`."""
    target_config = json.loads((standin.folder / "config.json").read_text())
    target_config = target_config.get("text_config", target_config)
    embed, head = load_embed_and_head(standin.folder)
    counts = count_loss_tokens(
        (torch.as_tensor(list(s.input_ids)), torch.as_tensor(list(s.loss_mask))) for s in data.train
    )
    size = effective_draft_vocab_size(c.draft_vocab, len(counts))
    draft_ids = build_draft_vocab(counts, size, embed.shape[0])
    cfg = drafter_config(target_config, int(target_config["hidden_size"]), size, embed.shape[0])
    torch.manual_seed(seed)
    model = Eagle3Drafter(cfg, embed, draft_ids)
    return Built(model, Teacher(head, model.draft_ids, torch.device("cpu")), head)


@dataclass
class Run:
    """One drafter's figures."""

    mode: str  # offline, streaming or untrained
    seed: int
    accept_length: float  # SGLang's, real decoding
    accept_length_per_round: float | None
    position_acceptance: list[float | None]
    lossless: bool | None
    ttt_accept_length: float  # train.evaluate's proxy on the held-out samples
    ttt_acc: list[float]
    steps: int = 0
    tokens: int = 0  # the trainer's own count of tokens trained
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def measure(
    standin: Standin, built: Built, store: HiddenStateStore, data: Data, c: Comparison, mode: str, seed: int
) -> Run:
    """Real speculative decoding of the held-out prompts, and the teacher-forced proxy on their stored states."""
    model = built.model.eval()
    report = evaluate_speculative(
        standin.target,
        model,
        data.prompts,
        draft_steps=c.draft_steps,
        max_new_tokens=c.decode_tokens,
        proxy=True,
        aux_layer_ids=store.manifest["aux_layer_ids"],
        compare_greedy=c.compare_greedy,
        greedy=data.greedy,
    )
    if c.compare_greedy and data.greedy is None:
        data.greedy = report
    t = report.totals()
    windows = plan_windows([(s.sample_id, len(s.input_ids)) for s in data.held_out], c.max_len).windows
    proxy = evaluate(model, eval_samples(store, windows, built.teacher, torch.device("cpu")), c.ttt_steps)
    return Run(
        mode,
        seed,
        float(t["accept_length_sglang"]),
        t.get("accept_length_per_round"),
        list(t["position_acceptance"]),
        t["lossless"],
        float(proxy["accept_length"]),
        list(proxy["acc"]),
    )


def train_offline(standin: Standin, store: HiddenStateStore, data: Data, c: Comparison, seed: int) -> Run:
    built = build_drafter(standin, data, c, seed)
    windows = plan_windows([(s.sample_id, len(s.input_ids)) for s in data.train], c.max_len).windows
    cpu = torch.device("cpu")
    started = time.monotonic()
    history = train(
        built.model, store, windows, [], c.settings(seed, c.epochs), head=built.head, device=cpu,
        log=lambda m: None, teacher=built.teacher,
    )  # fmt: skip
    seconds = time.monotonic() - started
    run = measure(standin, built, store, data, c, "offline", seed)
    run.steps, run.tokens, run.seconds = len(history.step_loss), history.tokens, round(seconds, 1)
    return run


def spool_budget(data: Data, hidden: int, c: Comparison, seed: int) -> tuple[int, int, int]:
    """(the spool's budget, the data's shard bytes, the mix): `budget_fraction` of the data, at least the lane's
    working set, its shards as the capture plans them (the datasets interleaved by the spool's seed); the mix as the
    asset derives it."""
    plans = plan_mixed_shards(data.train, hidden, c.shard_bytes, IDENTITY, seed)
    sizes = [shard_layout(p, [data.train[i] for i in p.samples], hidden).size for p in plans]
    total = sum(padded_size(n) for n in sizes)
    budget = max(int(total * c.budget_fraction), min_lane_bytes(c.epochs, max(sizes)))
    return budget, total, default_mix_shards(budget, max(sizes), c.epochs)


class PassCounter:
    """The streaming trainer's record: after each optimizer step, the step's windows (the reader's, as the trainer
    trained them) added to a per-token count, and the trainer's own token count checked against them."""

    def __init__(self, data: Data):
        self.counts = {s.sample_id: torch.zeros(len(s.input_ids), dtype=torch.int32) for s in data.train}
        self.mismatches = 0
        self._done = 0

    def hooks(self, spool: SpoolWindows) -> list[Every]:
        def count(trainer: Trainer) -> None:
            step = spool.current
            assert step is not None
            for w in step.windows:
                self.counts[w.sample_id][w.start : w.end] += 1
            trained, self._done = trainer.tokens_done - self._done, trainer.tokens_done
            self.mismatches += int(trained != sum(w.tokens for w in step.windows))

        return [Every(1, count)]

    def histogram(self) -> dict[int, int]:
        """Tokens by the times they were trained."""
        out: Counter = Counter()
        for row in self.counts.values():
            out.update(row.tolist())
        return dict(sorted(out.items()))


@dataclass
class Streamed:
    """What one capture-and-train through a spool gave: the trainer, its spool data (figures), the capture's report,
    the pass counter and the wall seconds."""

    trainer: Any
    data: Any
    capture: Any
    counter: PassCounter
    seconds: float


def capture_and_train(
    standin: Standin,
    built: Any,
    data: Data,
    c: Comparison,
    seed: int,
    spool: SpoolSettings,
    root: Path,
    checkpoints: Path,
    planner: Any = None,
) -> Streamed:
    """A fresh spool at `root`, captured into (this thread, by `planner`: None is the capture's own plan) while the
    trainer trains `built` from it (another thread). A failed trainer stops the capture and its error is raised here.
    A failed capture raises here at once; the trainer, waiting for shards that will not come (`train_from_spool`
    takes no stop), is a daemon thread left polling until the process exits."""
    create_spool(root, spool)
    counter = PassCounter(data)
    options = RunOptions(torch.device("cpu"), lambda m: None, checkpoints)
    result: dict[str, Any] = {}

    def trainer() -> None:
        try:
            result["trainer"], result["data"] = train_from_spool(
                built.model, root, c.settings(seed, 1), options, built.teacher, hooks=counter.hooks, poll_s=0.01
            )
        except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
            result["error"] = e

    started = time.monotonic()
    thread = threading.Thread(target=trainer, name="streaming-trainer", daemon=True)
    thread.start()
    capture = capture_to_spool(
        data.train, TransformersHiddenStates(standin.target), root, LANE, store_settings(c), identity=IDENTITY,
        log=lambda m: None, progress_every_s=3600, stop=lambda: "error" in result, poll_s=0.01, planner=planner,
    )  # fmt: skip
    thread.join()
    seconds = time.monotonic() - started
    if "error" in result:
        raise result["error"]
    return Streamed(result["trainer"], result["data"], capture, counter, seconds)


def train_streaming(standin: Standin, store: HiddenStateStore, data: Data, c: Comparison, seed: int, work: Path) -> Run:
    """Capture into the spool while the trainer trains from it (`capture_and_train`). The spool and checkpoint are
    fresh per run (a finished spool's shards are deleted; a checkpoint would resume)."""
    built = build_drafter(standin, data, c, seed)
    hidden = int(store.manifest["hidden_size"])
    budget, total, mix = spool_budget(data, hidden, c, seed)
    root, checkpoints = work / f"spool-{seed}", work / f"checkpoint-{seed}"
    for old in (root, checkpoints):  # a run starts afresh: a finished spool, or its checkpoint, would be resumed
        shutil.rmtree(old, ignore_errors=True)
    spool = SpoolSettings({LANE: budget}, c.epochs, c.max_len, c.batch_tokens, seed, hidden, mix)
    streamed = capture_and_train(standin, built, data, c, seed, spool, root, checkpoints)
    counter, capture, seconds = streamed.counter, streamed.capture, streamed.seconds
    history, spool_data = streamed.trainer.history, streamed.data
    run = measure(standin, built, store, data, c, "streaming", seed)
    run.steps, run.tokens, run.seconds = len(history.step_loss), history.tokens, round(seconds, 1)
    run.extra = {
        "token_passes": counter.histogram(),
        "step_token_mismatches": counter.mismatches,
        "spool_budget_bytes": budget,
        "data_shard_bytes": total,
        "budget_share": round(budget / total, 4),
        "capture_pauses": capture.pauses,
        "capture_waited_s": round(capture.waited_s, 2),
        "trainer_waited_s": round(spool_data.waited_s, 2),
        "bytes_read": spool_data.bytes_read,
    }
    return run


def untrained(standin: Standin, store: HiddenStateStore, data: Data, c: Comparison, seed: int) -> Run:
    return measure(standin, build_drafter(standin, data, c, seed), store, data, c, "untrained", seed)


# Student's t, two-sided 5%: the 0.975 quantile for 1..30 degrees of freedom (any statistics table); beyond, 30's.
T_975 = (
    *(12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131),
    *(2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042),
)


def t_975(df: float) -> float:
    """The 0.975 quantile of Student's t at `df` rounded down (the conservative side), at least 1."""
    return T_975[min(len(T_975), max(1, math.floor(df))) - 1]


def spread(values: Sequence[float]) -> tuple[float, float, int]:
    """(mean, sample standard deviation, count); the deviation 0 for one value."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0, len(values)


def welch_df(sd_a: float, k_a: int, sd_b: float, k_b: int) -> float:
    """Welch-Satterthwaite degrees of freedom of the difference of two means (k_a + k_b - 2 if both spreads are 0)."""
    a, b = sd_a**2 / k_a, sd_b**2 / k_b
    if a + b == 0:
        return float(k_a + k_b - 2)
    return (a + b) ** 2 / (a**2 / max(1, k_a - 1) + b**2 / max(1, k_b - 1))


def verdict(runs: Sequence[Run], c: Comparison, key: str = "accept_length") -> dict[str, Any]:
    """The modes' means and spreads over the seeds, the difference, its standard error and the rules (the module's
    docstring): `within_noise` is Welch's test, `within_2se` the plain two-standard-error band."""
    by = {m: spread([getattr(r, key) for r in runs if r.mode == m]) for m in ("offline", "streaming", "untrained")}
    (off, sd_off, k_off), (st, sd_st, k_st), (un, _, _) = by["offline"], by["streaming"], by["untrained"]
    se = math.sqrt(sd_off**2 / k_off + sd_st**2 / k_st)
    noise = max(se, c.min_se)
    df = welch_df(sd_off, k_off, sd_st, k_st)
    diff, gain = st - off, off - un
    return {
        **{m: {"mean": round(mean, 4), "std": round(sd, 4), "n": n} for m, (mean, sd, n) in by.items()},
        "difference": round(diff, 4),
        "se_difference": round(se, 4),
        "t": round(diff / noise, 2),
        "welch_df": round(df, 1),
        "band": round(t_975(df) * noise, 4),
        "within_noise": abs(diff) <= t_975(df) * noise,
        "within_2se": abs(diff) <= 2 * noise,
        "training_gain": round(gain, 4),
        "gain_over_se": round(gain / noise, 1),
        "training_matters": gain > c.signal_factor * noise,
    }


def compare(standin: Standin, c: Comparison, work: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole comparison: data, store, then per seed offline, streaming and (for the first seeds) the untrained
    drafter; the figures and verdicts."""
    started = time.monotonic()
    data = cached_data(standin, c, work, log)
    store = extract(standin, [*data.train, *data.held_out], work / "store", c)
    runs: list[Run] = []
    n_untrained = len(c.seeds) if c.untrained_seeds is None else c.untrained_seeds
    for i, seed in enumerate(c.seeds):
        for mode in ("offline", "streaming", "untrained"):
            if mode == "untrained" and i >= n_untrained:
                continue
            if mode == "offline":
                run = train_offline(standin, store, data, c, seed)
            elif mode == "streaming":
                run = train_streaming(standin, store, data, c, seed + c.stream_seed_offset, work)
            else:
                run = untrained(standin, store, data, c, seed)
            runs.append(run)
            log(
                f"seed {run.seed} {mode:9s}: accept length {run.accept_length:.4f} (per round "
                f"{run.accept_length_per_round}), TTT proxy {run.ttt_accept_length:.4f}, {run.steps} steps, "
                f"{run.tokens:,} tokens trained, {run.seconds} s" + (f", {run.extra}" if run.extra else "")
            )
    return {
        "comparison": asdict(c),
        "train_samples": len(data.train),
        "train_tokens": data.train_tokens,
        "held_out_prompts": len(data.prompts),
        "runs": [asdict(r) for r in runs],
        "accept_length": verdict(runs, c),
        "ttt_accept_length": verdict(runs, c, "ttt_accept_length"),
        "wall_s": round(time.monotonic() - started, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = Comparison()
    p.add_argument("--standin-dir", type=Path, default=Path(tempfile.gettempdir()) / "eagle3-standin")
    p.add_argument("--work", type=Path, default=None, help="store and spools here (default: a temporary folder)")
    p.add_argument("--seeds", type=int, nargs="+", default=list(d.seeds))
    p.add_argument("--train-samples", type=int, default=d.train_samples)
    p.add_argument("--eval-prompts", type=int, default=d.eval_prompts)
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens)
    p.add_argument("--new-tokens", type=int, default=d.new_tokens, help="regenerated completion length at most")
    p.add_argument("--epochs", type=int, default=d.epochs, help="offline epochs = streaming passes")
    p.add_argument("--ttt-steps", type=int, default=d.ttt_steps)
    p.add_argument("--batch-tokens", type=int, default=d.batch_tokens)
    p.add_argument("--max-len", type=int, default=d.max_len)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--lr", type=float, default=d.lr, help="default: the drafter width's default")
    p.add_argument("--shard-bytes", type=int, default=d.shard_bytes)
    p.add_argument("--budget-fraction", type=float, default=d.budget_fraction)
    p.add_argument("--decode-tokens", type=int, default=d.decode_tokens)
    p.add_argument("--no-greedy-check", action="store_true", help="skip the lossless check (half the decode time)")
    p.add_argument("--untrained-seeds", type=int, default=None, help="default: every seed's")
    p.add_argument("--stream-seed-offset", type=int, default=0, help="streaming seeds = seeds + this")
    p.add_argument("--signal-factor", type=float, default=d.signal_factor)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None, help="also write the figures here")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    c = Comparison(
        seeds=tuple(a.seeds),
        train_samples=a.train_samples,
        eval_prompts=a.eval_prompts,
        prompt_tokens=a.prompt_tokens,
        new_tokens=a.new_tokens,
        epochs=a.epochs,
        ttt_steps=a.ttt_steps,
        batch_tokens=a.batch_tokens,
        max_len=a.max_len,
        warmup_steps=a.warmup_steps,
        lr=a.lr,
        shard_bytes=a.shard_bytes,
        budget_fraction=a.budget_fraction,
        decode_tokens=a.decode_tokens,
        compare_greedy=not a.no_greedy_check,
        untrained_seeds=a.untrained_seeds,
        stream_seed_offset=a.stream_seed_offset,
        signal_factor=a.signal_factor,
    )
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    standin = load_standin(a.standin_dir, log)
    with tempfile.TemporaryDirectory() as tmp:
        figures = compare(standin, c, a.work or Path(tmp), log)
    v = figures["accept_length"]
    log(
        f"accept length (SGLang's, real decoding): offline {v['offline']['mean']} +- {v['offline']['std']}, streaming "
        f"{v['streaming']['mean']} +- {v['streaming']['std']}, untrained {v['untrained']['mean']}; difference "
        f"{v['difference']}, SE {v['se_difference']} (t {v['t']}, Welch df {v['welch_df']}), within noise (|diff| <= "
        f"{v['band']}): {v['within_noise']}, within 2 SE: {v['within_2se']}; "
        f"training gain {v['training_gain']} = {v['gain_over_se']} SE; {figures['wall_s']} s"
    )
    print(json.dumps(figures))
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
