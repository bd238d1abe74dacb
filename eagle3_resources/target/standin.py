"""The stand-in target: a tiny DeepseekV3 (Kimi-K2.5's family) made locally from a fixed seed.

Transformers' built-in `DeepseekV3ForCausalLM` with Kimi's vocabulary (163,840) and special ids,
8 layers (the fewest for which the EAGLE-3 rule `[1, N//2-1, N-4]` gives three distinct layers),
hidden size 64, MLA attention and a small MoE. A randomly initialised model never emits
`</think>` or `<|im_end|>`, so every completion would be cut at `max_tokens` and the merge stage
would drop them all; it is therefore fitted on the shipped prompts, each answered in Kimi's format
by a fixed rule, until it writes reasoning, `</think>`, an answer and `<|im_end|>` by itself. The
fit runs once, where the weights the project ships are made (`standin_weights`). The result is
saved with `save_pretrained` and loaded like any Hugging Face model folder, which is how a real
target is loaded.

Rows of `lm_head` for tokens the fitting text never uses share one trained vector `u`, so all
their logits equal `h.u` and the full-vocabulary cross-entropy is computed exactly over the used
rows plus one term, log(#unused) + h.u: the exact loss at a fraction of the cost of a
163,840-way softmax. Fitting drives `h.u` far below the real logits, so the model never samples
a token it has not seen (with rows left at zero it sampled them: 160k logits of 0 outweigh a few
confident ones).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from eagle3_resources.atomic_files import published_folder
from eagle3_resources.tokenizer.chat_format import render_messages
from eagle3_resources.tokenizer.kimi import KimiTokenizer
from eagle3_resources.tokenizer.special_tokens import BOS, EOS, IM_END, PAD, THINK_END

BUILDER_VERSION = "5"
SEED = 0
# 1,000 steps (~7 min on one AVX2 core), paid once where the shipped weights are made (`standin_weights`), not on
# a first run. At 220 the fit ended at loss ~1.7 and greedy decodes looped on one token right after "Let me think
# about" ("} } } }", "the the the"): the drafter's real accept length then measured how it predicts a loop (2.06 on
# one CPU, 3.88 on another). At 1,000 (loss ~0.2) greedy decodes copy the topic and finish the template.
FIT_STEPS = 1000
FIT_BATCH = 16
FIT_PROMPT_TOKENS = 48
# Every FIT_LONG_EVERY-th step fits FIT_LONG_BATCH texts whose prompt is longer than FIT_LONG_MIN tokens,
# kept up to FIT_LONG_PROMPT_TOKENS. Fitted on 48-token prompts only, the model lost its way after the
# thousand-token documents of B8 (up to 4,435 prompt tokens) and looped until `max_tokens`: B8's
# pilot had 3, 7, 8 and 6 of 8 answers end (fits and sampling seeds), 7, 8 and 8 with these steps,
# for about a quarter more fit time.
FIT_LONG_EVERY = 10
FIT_LONG_BATCH = 1
FIT_LONG_MIN = 256
FIT_LONG_PROMPT_TOKENS = 2048
FIT_LR = 5e-3
BACKGROUND_MARGIN = 12.0
# The fit runs on this many torch threads whatever the load: a parallel reduction sums in an order
# that depends on the thread count, so fits on 1 and 2 threads drift apart (final loss 2.378 against
# 2.385) and with them the stand-in's answers and whether the pilots pass. One thread, not the
# machine's cores: on a busy machine a second thread makes each step 7-20x slower (eagle3_resources
# /cpu.py), idle it saves at most a third; fitting only the used vocabulary rows pays that back.
# The weights are then a function of the seed, the data and the CPU's instruction set.
FIT_THREADS = 1


def standin_config(tokenizer: KimiTokenizer):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        max_position_embeddings=16384,
        bos_token_id=tokenizer.token_id(BOS),
        eos_token_id=tokenizer.token_id(IM_END),
        pad_token_id=tokenizer.token_id(PAD),
        tie_word_embeddings=False,
    )


def rule_reply(text: str) -> tuple[str, str]:
    """The fixed rule the stand-in learns to answer with: (reasoning, content)."""
    words = text.split()
    topic = " ".join(words[-4:]) if len(words) >= 4 else text.strip()[-12:]
    reasoning = f"Let me think about {topic}. I should answer clearly and briefly."
    content = f"Here is a short answer about {topic}. I hope this helps."
    return reasoning, content


def fitting_sequences(
    tokenizer: KimiTokenizer, texts: Iterable[str], prompt_tokens: int = FIT_PROMPT_TOKENS
) -> list[tuple[list[int], int]]:
    """(ids, prompt length) per text: a one-turn chat answered by `rule_reply`, its prompt's last `prompt_tokens`
    kept."""
    think_end, im_end = tokenizer.token_id(THINK_END), tokenizer.token_id(IM_END)
    seqs = []
    for text in sorted({t for t in texts if len(t.strip()) >= 8}):
        prompt = tokenizer.encode(render_messages([{"role": "user", "content": text}]), allow_special=True)
        reasoning, content = rule_reply(text)
        completion = tokenizer.encode(reasoning) + [think_end] + tokenizer.encode(content) + [im_end]
        prompt = prompt[-prompt_tokens:]
        seqs.append((prompt + completion, len(prompt)))
    return seqs


def long_fitting_sequences(tokenizer: KimiTokenizer, texts: Iterable[str]) -> list[tuple[list[int], int]]:
    """The long-prompt texts every FIT_LONG_EVERY-th step fits."""
    return [s for s in fitting_sequences(tokenizer, texts, FIT_LONG_PROMPT_TOKENS) if s[1] > FIT_LONG_MIN]


def fitting_token_ids(tokenizer: KimiTokenizer, texts: Iterable[str]) -> torch.Tensor:
    """The ids the fit trains rows of (`UsedRows`), ascending: every token of its short and long sequences."""
    texts = list(texts)
    seqs = [*fitting_sequences(tokenizer, texts), *long_fitting_sequences(tokenizer, texts)]
    return torch.tensor(sorted({t for s, _ in seqs for t in s}), dtype=torch.long)


@contextmanager
def fixed_torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to `n` in this thread, and set back to what it was afterwards
    (the stages after the fit keep the count the load chose: `eagle3_resources.cpu`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class UsedRows:
    """What the fit trains of `embed_tokens` and `lm_head`: the rows of the tokens the fitting text uses, as
    parameters of their own, and one shared row standing for every unused token (its logit carries the log of
    their count). The other rows get no gradient (AdamW would leave them unchanged anyway), so the optimizer
    steps over ~1M numbers instead of the 21M of two 163,840-row matrices."""

    def __init__(self, model: Any, tokens: set[int]):
        self.used = torch.tensor(sorted(tokens))
        n_unused = model.config.vocab_size - len(self.used)
        self.head, self.embed = model.lm_head.weight, model.get_input_embeddings().weight
        self.keep = torch.zeros(self.head.shape[0], dtype=torch.bool)
        self.keep[self.used] = True
        self.unused_row = torch.nn.Parameter(torch.zeros(self.head.shape[1]))
        self.remap = torch.full((model.config.vocab_size,), -1, dtype=torch.long)
        self.remap[self.used] = torch.arange(len(self.used))
        self.log_unused = math.log(n_unused) if n_unused else -math.inf
        self.head_used = torch.nn.Parameter(self.head.detach()[self.used].clone())
        self.embed_used = torch.nn.Parameter(self.embed.detach()[self.used].clone())

    def loss(self, model: Any, ids: torch.Tensor, mask: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The exact full-vocabulary loss on the `target` positions, with the unused tokens kept improbable."""
        rows = self.remap[ids]  # padding (never a used token) reads row 0: masked out of attention and loss
        embeds = self.embed_used[rows.clamp(min=0)]
        hidden = model.model(inputs_embeds=embeds, attention_mask=mask).last_hidden_state[:, :-1]
        valid = target[:, 1:]
        h = hidden[valid]
        logits = torch.cat([h @ self.head_used.T, (self.log_unused + h @ self.unused_row)[:, None]], dim=1)
        loss = torch.nn.functional.cross_entropy(logits, rows[:, 1:][valid])
        # Keep the unseen tokens' total probability below e^-BACKGROUND_MARGIN everywhere, even
        # where the model is unsure: a sampler must never pick a token the model never saw.
        log_p_unused = logits[:, -1] - torch.logsumexp(logits, dim=1)
        return loss + torch.relu(log_p_unused + BACKGROUND_MARGIN).mean()

    def write_back(self) -> None:
        """The trained rows into the model's matrices; every unused row becomes the shared one."""
        with torch.no_grad():
            self.head[self.keep] = self.head_used
            self.head[~self.keep] = self.unused_row
            self.embed[self.used] = self.embed_used


def padded_batch(
    batch: Sequence[tuple[list[int], int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention mask, completion positions) of (ids, prompt length) pairs, right-padded to the longest."""
    width = max(len(s) for s, _ in batch)
    ids = torch.full((len(batch), width), pad_id)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    target = torch.zeros((len(batch), width), dtype=torch.bool)
    for row, (s, n_prompt) in enumerate(batch):
        ids[row, : len(s)] = torch.tensor(s)
        mask[row, : len(s)] = 1
        target[row, n_prompt : len(s)] = True
    return ids, mask, target


def fit(
    model: Any,
    seqs: list[tuple[list[int], int]],
    pad_id: int,
    *,
    steps: int,
    log: Callable[[str], None],
    long_seqs: Sequence[tuple[list[int], int]] = (),
) -> list[float]:
    """Fit the completions of `seqs` (not their prompts) with the exact full-vocabulary loss, training the used rows
    of the embedding and the head only (`UsedRows`); every FIT_LONG_EVERY steps a batch of `long_seqs`."""
    rows = UsedRows(model, {t for s, _ in [*seqs, *long_seqs] for t in s})
    gen = torch.Generator().manual_seed(SEED)
    params = [p for p in model.parameters() if p is not rows.head and p is not rows.embed]
    params += [rows.unused_row, rows.embed_used]
    opt = torch.optim.AdamW(params + [rows.head_used], lr=FIT_LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * (1 - s / steps) + 0.05)
    model.train()
    losses = []
    started = time.monotonic()
    for step in range(steps):
        long_turn = bool(long_seqs) and step % FIT_LONG_EVERY == FIT_LONG_EVERY // 2
        pool, size = (long_seqs, FIT_LONG_BATCH) if long_turn else (seqs, FIT_BATCH)
        batch = [pool[i] for i in torch.randint(len(pool), (size,), generator=gen).tolist()]
        loss = rows.loss(model, *padded_batch(batch, pad_id))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params + [rows.head_used], 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 40 == 0 or step == steps - 1:
            log(
                f"stand-in target fit step {step + 1}/{steps} loss {loss.item():.3f} "
                f"({time.monotonic() - started:.0f}s)"
            )
    rows.write_back()
    model.eval()
    return losses


def fingerprint(tokenizer_folder: Path, steps: int = FIT_STEPS) -> str:
    """What a fit's weights are a function of (the CPU aside): builder, tokenizer (and so the corpus), settings."""
    h = hashlib.sha256(BUILDER_VERSION.encode())
    h.update((Path(tokenizer_folder) / "tiktoken.model").read_bytes())
    h.update(f"{steps}/{FIT_BATCH}/{FIT_PROMPT_TOKENS}/{FIT_LR}/{BACKGROUND_MARGIN}/{FIT_THREADS}".encode())
    h.update(f"{FIT_LONG_EVERY}/{FIT_LONG_BATCH}/{FIT_LONG_MIN}/{FIT_LONG_PROMPT_TOKENS}".encode())
    return h.hexdigest()[:12]


def new_standin_model(tokenizer: KimiTokenizer) -> Any:
    """The stand-in as the fit starts from it: transformers' initialisation under the fixed seed."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(SEED)
    return DeepseekV3ForCausalLM(standin_config(tokenizer))


def publish_standin(
    model: Any,
    tokenizer: KimiTokenizer,
    out_dir: Path,
    info: dict[str, Any],
    tensors: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> Path:
    """`model` saved as a Hugging Face folder at `out_dir` (with Kimi's stop ids), `info` in its standin.json;
    `tensors` edits the saved state (the file's names and layout, which transformers may convert) before it lands."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from transformers import GenerationConfig

    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.token_id(BOS),
        eos_token_id=[tokenizer.token_id(IM_END), tokenizer.token_id(EOS)],
        pad_token_id=tokenizer.token_id(PAD),
    )
    out_dir = Path(out_dir)
    with published_folder(out_dir, replace=False, marker="config.json") as tmp:  # a concurrent build may win
        model.save_pretrained(tmp, safe_serialization=True)
        if tensors is not None:
            weights = tmp / "model.safetensors"
            with safe_open(str(weights), "pt") as f:
                metadata = f.metadata()
            state = load_file(str(weights))
            tensors(state)
            save_file(state, str(weights), metadata=metadata)
        info = {"seed": SEED, **info, "tokenizer": str(tokenizer.folder)}
        (tmp / "standin.json").write_text(json.dumps(info, indent=2))
    return out_dir


def build_standin_target(
    out_dir: Path,
    tokenizer: KimiTokenizer,
    texts: Iterable[str],
    *,
    steps: int = FIT_STEPS,
    log: Callable[[str], None] = print,
) -> Path:
    texts = list(texts)
    seqs = fitting_sequences(tokenizer, texts)
    long_seqs = long_fitting_sequences(tokenizer, texts)
    with fixed_torch_threads(FIT_THREADS):
        log(
            f"torch threads for the stand-in target's fit: {FIT_THREADS} "
            "(fixed: the fitted weights must not depend on the load)"
        )
        model = new_standin_model(tokenizer)
        losses = fit(model, seqs, tokenizer.token_id(PAD), steps=steps, log=log, long_seqs=long_seqs)
    fitted = {"fit_steps": steps, "fit_sequences": len(seqs), "first_loss": losses[0], "final_loss": losses[-1]}
    return publish_standin(model, tokenizer, out_dir, fitted)
