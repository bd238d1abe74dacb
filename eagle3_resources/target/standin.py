"""The stand-in target: a tiny DeepseekV3 (Kimi-K2.5's family) made locally from a fixed seed.

Transformers' built-in `DeepseekV3ForCausalLM` with Kimi's vocabulary (163,840) and special ids,
8 layers (the fewest for which the EAGLE-3 rule `[1, N//2-1, N-4]` gives three distinct layers),
hidden size 64, MLA attention and a small MoE. A randomly initialised model never emits
`</think>` or `<|im_end|>`, so every completion would be cut at `max_tokens` and the merge stage
would drop them all; it is therefore fitted for a couple of minutes on the shipped prompts,
each answered in Kimi's format by a fixed rule, until it writes reasoning, `</think>`, an answer
and `<|im_end|>` by itself. The result is saved with `save_pretrained` and loaded like any
Hugging Face model folder, which is how a real target is loaded.

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
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from eagle3_resources.cpu import apply_torch_threads
from eagle3_resources.tokenizer.chat_format import render_messages
from eagle3_resources.tokenizer.kimi import KimiTokenizer
from eagle3_resources.tokenizer.special_tokens import BOS, EOS, IM_END, PAD, THINK_END

BUILDER_VERSION = "4"
SEED = 0
FIT_STEPS = 200
FIT_BATCH = 16
FIT_PROMPT_TOKENS = 48
FIT_LR = 5e-3
BACKGROUND_MARGIN = 12.0


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


def fitting_sequences(tokenizer: KimiTokenizer, texts: Iterable[str]) -> list[tuple[list[int], int]]:
    """(ids, prompt length) per text: a one-turn chat answered by `rule_reply`."""
    think_end, im_end = tokenizer.token_id(THINK_END), tokenizer.token_id(IM_END)
    seqs = []
    for text in sorted({t for t in texts if len(t.strip()) >= 8}):
        prompt = tokenizer.encode(render_messages([{"role": "user", "content": text}]), allow_special=True)
        reasoning, content = rule_reply(text)
        completion = tokenizer.encode(reasoning) + [think_end] + tokenizer.encode(content) + [im_end]
        prompt = prompt[-FIT_PROMPT_TOKENS:]
        seqs.append((prompt + completion, len(prompt)))
    return seqs


def fit(model, seqs: list[tuple[list[int], int]], pad_id: int, *, steps: int, log: Callable[[str], None]) -> list[float]:
    """Fit the completions of `seqs` (not their prompts) with the exact full-vocabulary loss."""
    used = torch.tensor(sorted({t for s, _ in seqs for t in s}))
    n_unused = model.config.vocab_size - len(used)
    head = model.lm_head.weight
    keep = torch.zeros(head.shape[0], dtype=torch.bool)
    keep[used] = True
    unused_row = torch.nn.Parameter(torch.zeros(head.shape[1]))
    remap = torch.full((model.config.vocab_size,), -1, dtype=torch.long)
    remap[used] = torch.arange(len(used))
    log_unused = math.log(n_unused) if n_unused else -math.inf

    gen = torch.Generator().manual_seed(SEED)
    params = [p for p in model.parameters() if p is not head] + [unused_row]
    head_used = torch.nn.Parameter(head.detach()[used].clone())
    opt = torch.optim.AdamW(params + [head_used], lr=FIT_LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * (1 - s / steps) + 0.05)
    model.train()
    losses = []
    started = time.monotonic()
    for step in range(steps):
        idx = torch.randint(len(seqs), (FIT_BATCH,), generator=gen).tolist()
        batch = [seqs[i] for i in idx]
        width = max(len(s) for s, _ in batch)
        ids = torch.full((len(batch), width), pad_id)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        target = torch.zeros((len(batch), width), dtype=torch.bool)
        for row, (s, n_prompt) in enumerate(batch):
            ids[row, : len(s)] = torch.tensor(s)
            mask[row, : len(s)] = 1
            target[row, n_prompt : len(s)] = True
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
        valid = target[:, 1:]
        h = hidden[valid]
        logits = torch.cat([h @ head_used.T, (log_unused + h @ unused_row)[:, None]], dim=1)
        loss = torch.nn.functional.cross_entropy(logits, remap[ids[:, 1:][valid]])
        # Keep the unseen tokens' total probability below e^-BACKGROUND_MARGIN everywhere, even
        # where the model is unsure: a sampler must never pick a token the model never saw.
        log_p_unused = logits[:, -1] - torch.logsumexp(logits, dim=1)
        loss = loss + torch.relu(log_p_unused + BACKGROUND_MARGIN).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params + [head_used], 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 40 == 0 or step == steps - 1:
            log(f"stand-in target fit step {step + 1}/{steps} loss {loss.item():.3f} ({time.monotonic() - started:.0f}s)")
    with torch.no_grad():
        head[keep] = head_used
        head[~keep] = unused_row
    model.eval()
    return losses


def fingerprint(tokenizer_folder: Path) -> str:
    h = hashlib.sha256(BUILDER_VERSION.encode())
    h.update((Path(tokenizer_folder) / "tiktoken.model").read_bytes())
    h.update(f"{FIT_STEPS}/{FIT_BATCH}/{FIT_PROMPT_TOKENS}/{FIT_LR}/{BACKGROUND_MARGIN}".encode())
    return h.hexdigest()[:12]


def build_standin_target(
    out_dir: Path, tokenizer: KimiTokenizer, texts: Iterable[str], *, steps: int = FIT_STEPS,
    log: Callable[[str], None] = print,
) -> Path:
    from transformers import DeepseekV3ForCausalLM, GenerationConfig

    apply_torch_threads("the stand-in target's fit", log)
    torch.manual_seed(SEED)
    model = DeepseekV3ForCausalLM(standin_config(tokenizer))
    seqs = fitting_sequences(tokenizer, texts)
    losses = fit(model, seqs, tokenizer.token_id(PAD), steps=steps, log=log)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.token_id(BOS),
        eos_token_id=[tokenizer.token_id(IM_END), tokenizer.token_id(EOS)],
        pad_token_id=tokenizer.token_id(PAD),
    )
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        (tmp / "standin.json").write_text(
            json.dumps(
                {"seed": SEED, "fit_steps": steps, "fit_sequences": len(seqs), "first_loss": losses[0],
                 "final_loss": losses[-1], "tokenizer": str(tokenizer.folder)},
                indent=2,
            )
        )
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not (out_dir / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def ensure_standin_target(
    cache_root: Path, tokenizer: KimiTokenizer, texts: Callable[[], Iterable[str]], log: Callable[[str], None] = print
) -> Path:
    folder = Path(cache_root) / f"target-{fingerprint(tokenizer.folder)}"
    if not (folder / "config.json").is_file():
        log(f"building the stand-in target at {folder} (once; cached afterwards)")
        build_standin_target(folder, tokenizer, texts(), log=log)
    return folder
