"""Device check, quality half: a drafter trained on a target's own text, then real speculative decoding.

    python benchmarks/drafter_device_check.py                         # a GPU: hidden 2048, 8 layers
    python benchmarks/drafter_device_check.py --device cpu --hidden 64 --layers 8 --fit-steps 3 \\
        --train-samples 8 --prompts 1 --new-tokens 6 --epochs 1     # a quick run on a laptop

Part of `benchmarks/device_check.py` (the one script a GPU host runs); training speed at full
width is `drafter_training_speed.py`'s.

Needs torch, transformers and safetensors only (no Dagster, polars or sglang), so it runs on a
bare GPU machine from a plain checkout. Steps:
1. a DeepseekV3-layout target (MLA + MoE, as Kimi-K2.5) with random weights, fitted briefly on
   text from a random sparse Markov chain so that its greedy continuations are learnable;
2. training data: the target's own greedy completions of chain prompts (what an EAGLE-3 drafter
   is trained on), their hidden states captured by the transformers backend, kept in memory;
3. the drafter trained with this project's trainer (TTT, bf16 autocast on CUDA): tokens/s;
4. real speculative decoding on held-out prompts at batch 1 (k = 3 draft tokens, top-1, the
   target verifying), the drafter in bf16 on CUDA as served, after a one-prompt warm-up: accept
   length by SGLang's definition, per-position acceptance, lossless against greedy decoding; the
   untrained drafter's figures beside them as the floor. The tokens/s of this loop are reported
   under `eager_proxy`: transformers' eager batch-1 decoding is ~100x overhead-bound (a host sync per
   MoE layer per token), so they are not a deployment estimate; SGLang's are
   (`benchmarks/serving_speculative.py`). Few prompts and tokens by default: the accept length is the
   figure here.
With `--budget-s S` (the device check gives its limit less 15 s) the run keeps to S seconds from start-up and
ends with figures rather than being killed without any: the fit takes at most a quarter of the time, the untrained
drafter decodes first (its prompts one at a time, within a third of what is left), training ends after the step
whose successor would cut into the time the trained drafter's decoding of the same prompts needs (1.25x the
untrained's: it accepts more, so it makes fewer rounds), and no prompt starts that would end past S. What was cut
is in the JSON: `fit_steps`, `train_steps`, each drafter's `prompts`, each beside what was asked.
Figures go to stdout and, as JSON, to `--json` (default `$OUT/drafter_device_check.json` when OUT is set).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hidden_states_throughput import random_deepseek_v3  # noqa: E402  (the same mid-size target)

from eagle3_assets.stages.eagle3_drafter.data import Teacher, plan_steps, plan_windows  # noqa: E402
from eagle3_assets.stages.eagle3_drafter.model import DrafterConfig, Eagle3Drafter  # noqa: E402
from eagle3_assets.stages.eagle3_drafter.speculative import (  # noqa: E402
    TIE_EPS,
    evaluate_speculative,
    forward_shape_rounding,
)
from eagle3_assets.stages.eagle3_drafter.train import TrainSettings, train  # noqa: E402
from eagle3_assets.stages.eagle3_drafter.vocab import build_draft_vocab, count_loss_tokens  # noqa: E402
from eagle3_resources.hidden_states.transformers_backend import TransformersHiddenStates  # noqa: E402

STARTED = time.perf_counter()  # `--budget-s` counts from here (the imports above are a few seconds)
FIT_SHARE = 0.25  # of the budget: the target's fit (a shorter fit makes its text less learnable, not wrong)
UNTRAINED_DECODE_SHARE = 1 / 3  # of what is left after the data: the untrained drafter's decoding
TRAINED_DECODE_RESERVE = 1.25  # x the untrained's decoding seconds, kept from training for the trained drafter's


@dataclass(frozen=True)
class Deadline:
    """When a phase must be done by (`time.perf_counter()`), None for no budget. A phase of repeated units (fit
    steps, training steps, prompts) starts a unit only if it would end by then, taking as long as one before it did
    (the last step; the slowest prompt)."""

    at: float | None

    def left(self) -> float:
        return float("inf") if self.at is None else self.at - time.perf_counter()

    def share(self, fraction: float) -> Deadline:
        """A deadline `fraction` of the time left from now."""
        return self if self.at is None else Deadline(time.perf_counter() + fraction * max(0.0, self.left()))

    def before(self, seconds: float) -> Deadline:
        return self if self.at is None else Deadline(self.at - seconds)

    def fits(self, unit_s: float) -> bool:
        """Whether one more unit of `unit_s` seconds, started now, ends by the deadline."""
        return self.at is None or time.perf_counter() + unit_s <= self.at


def markov_chain(vocab: int, branching: int, seed: int) -> torch.Tensor:
    """Each token's few likely successors: text a small model can learn, and a drafter can predict."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (vocab, branching), generator=g)


def chain_text(chain: torch.Tensor, n: int, length: int, seed: int) -> torch.Tensor:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        t = rng.randrange(1, chain.shape[0])
        row = [t]
        for _ in range(length - 1):
            t = int(chain[t, 0 if rng.random() < 0.7 else rng.randrange(chain.shape[1])])
            row.append(t)
        rows.append(row)
    return torch.tensor(rows)


def fit(model, text: torch.Tensor, steps: int, device: torch.device, log, deadline: Deadline) -> tuple[float, int]:
    """A brief LM fit (AdamW, bf16 autocast on CUDA) so the target's greedy text follows the chain: (seconds,
    steps done, at least one: fewer than `steps` when the next would end past `deadline`)."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3 if model.config.hidden_size <= 256 else 1e-3)
    model.train()
    started, loss = time.monotonic(), float("nan")
    done, last = 0, time.perf_counter()
    for step in range(steps):
        if step and not deadline.fits(time.perf_counter() - last):
            log(f"target fit: {step} of {steps} steps in the budget")
            break
        last = time.perf_counter()
        batch = text[torch.randint(0, text.shape[0], (16,))].to(device)
        ctx = (
            torch.autocast("cuda", dtype=torch.bfloat16)
            if device.type == "cuda"
            else torch.autocast("cpu", enabled=False)
        )
        with ctx:
            loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            log(f"target fit step {step + 1}/{steps}: loss {loss.item():.3f}")
        done = step + 1
    model.eval()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.monotonic() - started, done


@torch.no_grad()
def greedy_completions(model, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    out = model.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    return out[:, prompts.shape[1] :]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8, help="at least 8 (three distinct EAGLE-3 layers)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--fit-steps", type=int, default=150)
    p.add_argument("--train-samples", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--completion-len", type=int, default=192)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--prompts", type=int, default=6, help="held-out prompts for speculative decoding")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--draft-steps", type=int, default=3)
    p.add_argument(
        "--compile",
        choices=["auto", "on", "off"],
        default="auto",
        help="torch.compile the drafter's MLP in training (auto: the trainer's default, on CUDA only); "
        "benchmarks/device_check.py passes off: this section's figure is the accept length, and a compiled MLP "
        "would be compiled again for the bf16 decode",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="end within this many seconds of start-up, cutting the fit, training and decoding to fit (the "
        "module's docstring says how); default: no budget, everything asked",
    )
    p.add_argument("--json", default=None, help="write the figures here (default: $OUT/drafter_device_check.json)")
    return p.parse_args(argv)


def log(message: str) -> None:
    print(message, flush=True)


def fitted_target(
    a: argparse.Namespace, device: torch.device, deadline: Deadline
) -> tuple[Any, torch.Tensor, dict[str, float]]:
    """(the target, fitted on the chain's text and in bf16 on CUDA; the chain; the fit's seconds and steps)."""
    chain = markov_chain(a.vocab, 4, seed=1)
    # made on the device in fp32 (fitted under autocast, then bf16): a CPU initialisation took 14 s here
    target = random_deepseek_v3(a.hidden, a.layers, a.vocab, device=device, dtype=torch.float32)
    text = chain_text(chain, 4096, a.prompt_len + a.completion_len, 2)
    seconds, steps = fit(target, text, a.fit_steps, device, log, deadline)
    if device.type == "cuda":
        target = target.to(torch.bfloat16)
    return target, chain, {"target_fit_s": round(seconds, 1), "fit_steps": steps, "fit_steps_asked": a.fit_steps}


def training_data(target, prompts: torch.Tensor, a: argparse.Namespace) -> dict[str, dict[str, torch.Tensor]]:
    """The target's greedy completions of the first `--train-samples` prompts and their hidden states, in memory as
    the store hands samples over (CPU, bf16 states)."""
    completions = torch.cat(
        [greedy_completions(target, prompts[i : i + 64], a.completion_len) for i in range(0, a.train_samples, 64)]
    )
    backend = TransformersHiddenStates(target)
    source: dict[str, dict[str, torch.Tensor]] = {}
    for i in range(a.train_samples):
        ids = torch.cat([prompts[i], completions[i]]).tolist()
        aux, final = backend.extract(ids)
        source[f"s{i}"] = {
            "input_ids": torch.tensor(ids, dtype=torch.int32),
            "loss_mask": torch.tensor([0] * a.prompt_len + [1] * a.completion_len, dtype=torch.int8),
            "aux_hidden_states": aux.to("cpu", torch.bfloat16),
            "final_hidden_state": final.to("cpu", torch.bfloat16),
        }
    return source


def new_drafters(
    target, source: dict[str, dict[str, torch.Tensor]], vocab: int, hidden: int
) -> tuple[Eagle3Drafter, Eagle3Drafter, torch.Tensor, torch.Tensor]:
    """(the drafter to train, an identical one left untrained as the floor, the target's head, the draft ids)."""
    counts = count_loss_tokens((d["input_ids"], d["loss_mask"]) for d in source.values())
    draft_ids = build_draft_vocab(counts, min(8192, max(64, len(counts))), vocab)
    cfg = DrafterConfig.of_width(
        hidden,
        intermediate_size=2 * hidden,
        vocab_size=vocab,
        draft_vocab_size=len(draft_ids),
        max_position_embeddings=4096,
    )
    embed = target.get_input_embeddings().weight.detach().float().cpu()
    head = target.get_output_embeddings().weight.detach().float().cpu()
    torch.manual_seed(0)
    untrained = Eagle3Drafter(cfg, embed, draft_ids)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg, embed, draft_ids)
    return drafter, untrained, head, draft_ids


def train_drafter(
    drafter: Eagle3Drafter,
    source: dict[str, dict[str, torch.Tensor]],
    head: torch.Tensor,
    draft_ids: torch.Tensor,
    epochs: int,
    device: torch.device,
    compile_mlp: bool | None = None,
    deadline: Deadline = Deadline(None),
) -> dict:
    """Train in place with this project's trainer; its figures. `compile_mlp`: TrainSettings.compile (None: the
    trainer's default, torch.compile on CUDA). The run ends after the step whose successor would end past
    `deadline` (at least one step)."""
    plan = plan_windows([(k, len(v["input_ids"])) for k, v in source.items()], 2048)
    settings = TrainSettings(
        ttt_steps=7,
        epochs=epochs,
        batch_tokens=2048,
        max_len=2048,
        checkpoint_every=0,
        warmup_steps=10,
        compile=compile_mlp,
    )
    last_step_at: list[float | None] = [None]

    def out_of_time(step: int, tokens: int) -> bool:
        # a step's time from the end of the one before; the first step's, which holds the trainer's set-up, is not one
        now, last = time.perf_counter(), last_step_at[0]
        last_step_at[0] = now
        return not deadline.fits(0.0 if last is None else now - last)

    history = train(
        drafter,
        source,
        plan.windows,
        [],
        settings,
        head=head,
        device=device,
        log=log,
        teacher=Teacher(head, draft_ids, device),
        on_step=None if deadline.at is None else out_of_time,
    )
    return {
        "train_steps": len(history.step_loss),
        "train_steps_asked": sum(
            len(plan_steps(plan.windows, settings.batch_tokens, settings.seed, e)) for e in range(epochs)
        ),
        "train_tokens": history.tokens,
        "train_s": round(history.seconds, 1),
        "train_tokens_per_s": history.tokens_per_s,  # the trainer's own figure (evaluation excluded)
        "train_mfu": history.mfu,
        "final_loss": history.step_loss[-1],
    }


def speculative_run(
    name: str,
    target,
    drafter: Eagle3Drafter,
    held_out: list[list[int]],
    a: argparse.Namespace,
    deadline: Deadline = Deadline(None),
) -> dict:
    """One drafter's speculative decoding of the held-out prompts, after a one-prompt warm-up: its figures. The
    prompts are decoded one at a time; none starts that would end past `deadline` taking as long as the slowest so
    far (at least one is decoded; `prompts` says how many)."""
    started = time.monotonic()

    def decode(prompts: list[list[int]], new_tokens: int):
        return evaluate_speculative(
            target, drafter, prompts, draft_steps=a.draft_steps, max_new_tokens=new_tokens, proxy=True, eos_token_ids=()
        )

    decode(held_out[:1], min(8, a.new_tokens))  # warm-up (CUDA context, cuBLAS handles, allocator), not counted
    report, slowest = None, 0.0
    for prompt in held_out:
        if report is not None and not deadline.fits(slowest):
            break
        prompt_started = time.perf_counter()
        one = decode([prompt], a.new_tokens)
        slowest = max(slowest, time.perf_counter() - prompt_started)
        if report is None:
            report = one
        else:
            report.prompts.extend(one.prompts)
    assert report is not None, "no held-out prompt to decode"
    t = report.totals()
    figures = {
        k: t[k]
        for k in (
            "accept_length_sglang",
            "accept_length_per_round",
            "accept_length_vllm",
            "position_acceptance",
            "lossless",
            "mismatched_prompts",
            "lossless_up_to_ties",
            "mismatched_at_ties",
        )
    }
    figures["eager_proxy"] = {k: t[k] for k in ("spec_tokens_per_s", "greedy_tokens_per_s", "speedup")}
    figures["prompts"], figures["prompts_asked"] = len(report.prompts), len(held_out)
    figures["seconds"] = round(time.monotonic() - started, 1)
    log(
        f"{name} drafter: accept length {t['accept_length_sglang']} (SGLang's definition), per position "
        f"{t['position_acceptance']}, lossless {t['lossless']} ({t['mismatched_at_ties']} of "
        f"{t['mismatched_prompts']} mismatched prompts at a tie of the target's dtype); "
        "eager proxy (not a deployment speed): speculative "
        f"{t['spec_tokens_per_s']} vs greedy {t['greedy_tokens_per_s']} tokens/s = x{t['speedup']}"
    )
    return figures


def served_dtype(device: torch.device) -> torch.dtype:
    """The drafter's dtype as it is served: bf16 on CUDA, fp32 on the CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def served(model: Eagle3Drafter, device: torch.device) -> Eagle3Drafter:
    """The drafter as it is served (`served_dtype`), in eval mode."""
    return model.to(device, served_dtype(device)).eval()


def rounding_figures(target, held_out: list[list[int]], tokens: int) -> dict:
    """How far the target's own forward shapes round apart here: what the lossless check's tie tolerance covers. A
    side figure: an error is recorded in it, not raised past the accept lengths measured before it."""
    try:
        rows = [forward_shape_rounding(target, p, tokens) for p in held_out if len(p) > tokens]
    except Exception as e:  # noqa: BLE001 - recorded in the JSON
        return {"error": repr(e), "tie_eps": TIE_EPS}
    return {
        "max_eps": max((r["max_eps"] for r in rows), default=None),
        "argmax_flips": sum(int(r["argmax_flips"]) for r in rows),
        "rows": sum(int(r["rows"]) for r in rows),
        "tie_eps": TIE_EPS,
    }


def write_json(figures: dict, path: str | None) -> None:
    target_json = path or (str(Path(os.environ["OUT"], "drafter_device_check.json")) if os.environ.get("OUT") else None)
    if target_json:
        Path(target_json).write_text(json.dumps(figures, indent=2) + "\n")


def measure(a: argparse.Namespace) -> dict:
    """The whole check, in the order the budget needs (the module's docstring): its figures."""
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device)
    budget = Deadline(None if a.budget_s is None else STARTED + a.budget_s)
    figures: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "hidden": a.hidden,
        "layers": a.layers,
        "vocab": a.vocab,
        "budget_s": a.budget_s,
    }
    target, chain, fit_figures = fitted_target(a, device, budget.share(FIT_SHARE))
    figures.update(fit_figures)

    # Training data: the target's greedy completions of chain prompts, and their hidden states.
    prompts = chain_text(chain, a.train_samples + a.prompts, a.prompt_len, 3).to(device)
    started = time.monotonic()
    source = training_data(target, prompts, a)
    figures["data_s"] = round(time.monotonic() - started, 1)

    drafter, untrained, head, draft_ids = new_drafters(target, source, a.vocab, a.hidden)
    held_out = [prompts[a.train_samples + i].tolist() for i in range(a.prompts)]
    figures["speculative_dtype"] = str(served_dtype(device)).removeprefix("torch.")
    figures["speed_note"] = (
        "eager_proxy: transformers eager decoding at batch 1, overhead-bound; not a deployment "
        "speed estimate (that is SGLang's: benchmarks/serving_speculative.py)"
    )
    # The floor first: its decoding time says how long the trained drafter's will take, which training leaves it.
    floor = speculative_run(
        "untrained", target, served(untrained, device), held_out, a, budget.share(UNTRAINED_DECODE_SHARE)
    )
    figures["untrained"] = floor
    decoded = held_out[: floor["prompts"]]
    figures["forward_shape_rounding"] = rounding_figures(target, decoded, a.draft_steps + 1)
    log(f"forward shapes round apart by up to {figures['forward_shape_rounding']}")

    compile_mlp = {"auto": None, "on": True, "off": False}[a.compile]
    reserve = TRAINED_DECODE_RESERVE * floor["seconds"]
    figures.update(
        train_drafter(drafter, source, head, draft_ids, a.epochs, device, compile_mlp, budget.before(reserve))
    )
    figures["trained"] = speculative_run("trained", target, served(drafter, device), decoded, a, budget)
    return figures


def main() -> None:
    a = parse_args()
    figures = measure(a)
    print(json.dumps(figures, indent=2))
    write_json(figures, a.json)


if __name__ == "__main__":
    main()
