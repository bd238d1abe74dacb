"""Train an EAGLE-3 drafter on stored hidden states with training-time test (TTT).

Teacher: the target's own next-token distribution, `lm_head(final hidden)`, restricted to the
draft vocabulary and renormalised; positions whose target argmax is outside the draft vocabulary
carry no loss. Loss: soft cross-entropy per TTT step, step k weighted `decay**k` (0.8 as in
SpecForge/EAGLE). Only positions predicting a completion token (loss mask) count.

Metrics, on the eval split:
- `acc_k`: share of completion positions where draft step k's argmax equals the target's argmax
  (out-of-vocabulary targets count as misses);
- `accept_length`: simulated accept length of greedy chain drafting, 1 + the number of leading
  draft steps that match, averaged over positions. Teacher-forced: step k reads the data's own
  token, which equals what a greedy target accepts when the data is the target's greedy output;
  on sampled data it is an estimate. It counts the bonus token (SGLang's definition); SpecForge's
  `sum_k prod_j acc_j` is reported as `accept_length_product` (also with the 1 added).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from eagle3_assets.drafter.model import Eagle3Drafter, default_learning_rate


@dataclass
class TrainSettings:
    ttt_steps: int = 7
    step_decay: float = 0.8
    epochs: int = 6
    lr: float | None = None  # None: default_learning_rate(drafter width)
    warmup_steps: int = 20
    sequences_per_step: int = 4
    max_len: int = 512
    seed: int = 0


@dataclass
class Sample:
    tokens: torch.Tensor  # [L] target ids
    positions: torch.Tensor  # [L] positions in the original sequence
    mask: torch.Tensor  # [L] 1 where the token is a completion token
    aux: torch.Tensor  # [L, 3H_t] float32
    teacher_p: torch.Tensor  # [L, V_draft] target distribution over the draft vocabulary
    teacher_argmax: torch.Tensor  # [L] the target's argmax over its full vocabulary


def prepare_sample(data: dict[str, torch.Tensor], head: torch.Tensor, draft_ids: torch.Tensor, max_len: int,
                   chunk: int = 256) -> Sample:
    """A stored sample's last `max_len` tokens, with the teacher computed from its final hidden states."""
    L = data["input_ids"].shape[0]
    start = max(0, L - max_len)
    final = data["final_hidden_state"][start:].float()
    argmax, draft_logits = [], []
    for i in range(0, final.shape[0], chunk):  # the full-vocabulary logits never all at once
        logits = final[i : i + chunk] @ head.T
        argmax.append(logits.argmax(-1))
        draft_logits.append(logits[:, draft_ids])
    return Sample(
        tokens=data["input_ids"][start:].long(),
        positions=torch.arange(start, L),
        mask=data["loss_mask"][start:].long(),
        aux=data["aux_hidden_states"][start:].float(),
        teacher_p=torch.softmax(torch.cat(draft_logits), -1),
        teacher_argmax=torch.cat(argmax),
    )


def step_weights(model: Eagle3Drafter, s: Sample, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights [L], teacher index [L], in-range [L]) for TTT step k.

    Step k at position t predicts token t+2+k against the target distribution at t+1+k.
    """
    L = s.tokens.shape[0]
    t = torch.arange(L)
    in_range = t + 2 + k <= L - 1
    j = (t + 1 + k).clamp(max=L - 1)
    target_tok = (t + 2 + k).clamp(max=L - 1)
    weights = in_range & (s.mask[target_tok] == 1) & model.t2d[s.teacher_argmax[j]]
    return weights.float(), j, in_range & (s.mask[target_tok] == 1)


def sample_loss(model: Eagle3Drafter, s: Sample, settings: TrainSettings) -> tuple[torch.Tensor, list[float]]:
    logits = model.unroll(s.aux, s.tokens, s.positions, settings.ttt_steps)
    denom = max(1.0, float(s.mask.sum()))
    total = torch.zeros(())
    per_step = []
    for k, lg in enumerate(logits):
        w, j, _ = step_weights(model, s, k)
        ce = -(s.teacher_p[j] * F.log_softmax(lg.float(), -1)).sum(-1)
        loss_k = (w * ce).sum() / denom
        per_step.append(loss_k.item())
        total = total + settings.step_decay**k * loss_k
    return total, per_step


@torch.no_grad()
def evaluate(model: Eagle3Drafter, samples: list[Sample], steps: int) -> dict:
    model.eval()
    correct = torch.zeros(steps)
    counted = torch.zeros(steps)
    accept_sum, accept_n = 0.0, 0
    draft_ids = model.draft_ids
    for s in samples:
        logits = model.unroll(s.aux, s.tokens, s.positions, steps)
        L = s.tokens.shape[0]
        chain_ok = torch.ones(L, dtype=torch.bool)
        accepted = torch.zeros(L)
        _, _, roots = step_weights(model, s, 0)
        for k, lg in enumerate(logits):
            w, j, valid = step_weights(model, s, k)
            hit = (draft_ids[lg.argmax(-1)] == s.teacher_argmax[j]) & (w > 0)
            correct[k] += float((hit & valid).sum())
            counted[k] += float(valid.sum())
            chain_ok &= hit
            accepted += chain_ok.float()
        accept_sum += float((1 + accepted)[roots].sum())
        accept_n += int(roots.sum())
    acc = (correct / counted.clamp(min=1)).tolist()
    product = 1 + sum(math.prod(acc[: k + 1]) for k in range(steps))
    model.train()
    return {
        "acc": [round(a, 4) for a in acc],
        "accept_length": round(accept_sum / max(1, accept_n), 4),
        "accept_length_product": round(product, 4),
        "positions": accept_n,
    }


@dataclass
class TrainHistory:
    step_loss: list[float] = field(default_factory=list)
    step_loss_by_ttt: list[list[float]] = field(default_factory=list)
    epochs: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def train(
    model: Eagle3Drafter,
    train_samples: list[Sample],
    eval_samples: list[Sample],
    settings: TrainSettings,
    log: Callable[[str], None],
) -> TrainHistory:
    if not train_samples:
        raise ValueError("no training samples: every sample was dropped before the drafter stage")
    torch.manual_seed(settings.seed)
    rng = random.Random(settings.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    lr = settings.lr if settings.lr is not None else default_learning_rate(model.cfg.hidden_size)
    log(f"drafter: peak learning rate {lr:g}" + ("" if settings.lr is not None else f" (default for width {model.cfg.hidden_size})"))
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    steps_per_epoch = math.ceil(len(train_samples) / settings.sequences_per_step)
    total_steps = steps_per_epoch * settings.epochs

    def lr_at(step: int) -> float:
        if step < settings.warmup_steps:
            return (step + 1) / settings.warmup_steps
        progress = (step - settings.warmup_steps) / max(1, total_steps - settings.warmup_steps)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    history = TrainHistory()
    started = time.monotonic()
    model.train()
    for epoch in range(settings.epochs):
        order = list(range(len(train_samples)))
        rng.shuffle(order)
        for b in range(0, len(order), settings.sequences_per_step):
            batch = [train_samples[i] for i in order[b : b + settings.sequences_per_step]]
            opt.zero_grad()
            step_losses = torch.zeros(settings.ttt_steps)
            loss_sum = 0.0
            for s in batch:
                loss, per_step = sample_loss(model, s, settings)
                (loss / len(batch)).backward()
                loss_sum += loss.item() / len(batch)
                step_losses += torch.tensor(per_step) / len(batch)
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            sched.step()
            history.step_loss.append(round(loss_sum, 5))
            history.step_loss_by_ttt.append([round(x, 5) for x in step_losses.tolist()])
        metrics = evaluate(model, eval_samples, settings.ttt_steps) if eval_samples else {}
        metrics.update(epoch=epoch + 1, train_loss=history.step_loss[-1], seconds=round(time.monotonic() - started, 1))
        history.epochs.append(metrics)
        log(
            f"drafter epoch {epoch + 1}/{settings.epochs}: loss {metrics['train_loss']:.4f}, "
            f"eval acc {metrics.get('acc')}, accept length {metrics.get('accept_length')} ({metrics['seconds']}s)"
        )
    history.seconds = time.monotonic() - started
    return history
