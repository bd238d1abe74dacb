"""Real speculative decoding with an EAGLE-3 drafter: greedy chain drafting, verified by the target.

Why: the drafter's training metric (`train.evaluate`) is a *simulated* accept length, teacher-forced
on stored hidden states. This module runs the actual draft/verify loop SGLang runs for EAGLE-3 with
`--speculative-eagle-topk 1 --speculative-num-steps k --speculative-num-draft-tokens k+1`, on a
Hugging Face target with a KV cache, and checks the output is the target's own greedy decoding.

One round, verified context = positions 0..t, the target's next token x[t+1] (the "bonus") known:
1. draft: the drafter proposes d1..dk in a chain (top-1). Step 0 at position t reads
   fc(aux[t]) and embed(x[t+1]) -> d1 (this step-0 row was already computed when position t was
   verified, see 3); step i >= 1 reads the previous step's hidden state (pre-norm; EAGLE 3.1's
   `norm_output`: post-norm) and embed(d_i),
   rope position t+i, and attends to the step-0 keys of positions 0..t plus its own chain's keys
   -- exactly what `Eagle3Drafter.unroll` (TTT) trains step i at position t on.
2. verify: ONE target forward over [x[t+1], d1..dk] (positions t+1..t+k+1) with the KV cache and
   output_hidden_states. g_j = argmax logits[j]; n = longest prefix with d_{j+1} == g_j; the round
   yields d1..dn plus the bonus g_n (n+1 tokens). The target's cache is cropped to the verified
   positions (`DynamicCache.crop(-rejected)`, exact for DeepseekV3's MLA cache too: transformers
   caches its decompressed per-head k/v, so dropping trailing positions is a slice).
3. extend: the aux hidden states of the n+1 newly verified positions come from that same verify
   forward (HF hidden_states[i+1] for layer id i); the drafter runs its step-0 layer over them with
   the next tokens [d1..dn, g_n] and caches their keys. Its chain keys (steps >= 1) are never
   kept, so the drafter needs no rollback. The last row roots the next chain.
The prompt is the first "verify": one prefill forward gives the first token and the prompt's aux.

Accept length, three definitions (all count in tokens per target verify forward):
- `accept_length_sglang`: SGLang's `completion_tokens / spec_verify_ct` -- all generated tokens,
  the prefill's first token included, per verify round (what an SGLang server reports per request);
- `accept_length_per_round`: tokens produced by verify rounds / rounds = mean of (n+1): bonus
  counted, prefill token not; the steady state both SGLang's and vLLM's tend to;
- `accept_length_vllm`: vLLM's `1 + accepted draft tokens / drafts` (before max_new_tokens/EOS
  truncation). SpecForge's simulated figure (`train.evaluate`'s accept_length) counts the bonus
  too; its `sum_k prod_j acc_j` variant is a product of per-step accuracies, not a measurement.

Real vs simulated: on the stand-in, with greedy data, the real per-round figure equals the
teacher-forced hits walked the way decoding roots its rounds (from the prompt's end, advancing by
accepted + 1), to the round; `train.evaluate` averages over *every* position instead, and reads
higher (2.75 vs 2.41 there), because real rounds start right after a rejection.

Losslessness holds up to floating-point ties: batched verify and one-token greedy decoding compute
the same logits to ~1e-6 in float32, so an argmax can only flip on a near-exact tie (float32 on
CPU: none seen). In bf16 on a GPU a rare flip is numerics, not a bug (SGLang shows the same).
Throughput: on CPU a verify forward of k+1 tokens costs ~2x a one-token step for the stand-in, so
its tokens/s say little about a GPU-served Kimi, whose decode steps are memory-bound.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, overload

import torch
from transformers import GenerationConfig

from eagle3_assets.stages.eagle3_drafter.mla import MLAAttention
from eagle3_assets.stages.eagle3_drafter.model import Attention, DecoderLayer, Eagle3Drafter
from eagle3_resources.hidden_states.layers import eagle3_aux_layers
from eagle3_resources.hidden_states.transformers_backend import text_causal_lm

# --------------------------------------------------------------------------------------------
# Drafters
# --------------------------------------------------------------------------------------------


class ChainDrafter(Protocol):
    """What the loop needs from a drafter: any drafter (trained, untrained, a test oracle) fits."""

    def begin(self, prompt_ids: Sequence[int]) -> None:
        """A new sequence: forget the previous one."""

    def extend(self, aux: torch.Tensor, next_tokens: Sequence[int]) -> None:
        """Newly verified positions p..p+n-1: their aux states [n, 3H_t] and the token after each."""

    def propose(self, k: int) -> list[int]:
        """k target token ids continuing the verified sequence (after the bonus token)."""


@dataclass
class _DraftState:
    keys: torch.Tensor  # [heads, T, key dim] step-0 keys of verified positions 0..T-1 (roped)
    values: torch.Tensor  # [heads, T, value dim]
    root: torch.Tensor | None = None  # [H] the layer's step-0 output (pre-norm) at position T-1


def _attend(
    attn: Attention | MLAAttention, x: torch.Tensor, positions: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of new rows x [n, 2H] over past keys (all visible) and each other (causal).

    The layer's own projections (`project`: rope, repeated KV heads; for MLA the decompressed per-head keys and
    values of SGLang's latent cache) and a float softmax over a prefix cache, so inference computes what TTT trained
    through another attention path. Returns (out [n, H], k, v) of the rows.
    """
    n = x.shape[0]
    q, k, v = attn.project(x, positions)
    keys, values = torch.cat([past_k, k], 1), torch.cat([past_v, v], 1)
    past = past_k.shape[1]
    visible = torch.ones(n, past + n, dtype=torch.bool, device=x.device).tril(past)
    scores = (q @ keys.transpose(1, 2) * attn.scale).masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores.float(), -1).to(q.dtype)
    out = attn.o_proj((probs @ values).transpose(0, 1).reshape(n, -1))
    return out, k, v


def _layer(
    layer: DecoderLayer,
    embeds: torch.Tensor,
    hidden: torch.Tensor,
    positions: torch.Tensor,
    past_k: torch.Tensor,
    past_v: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`DecoderLayer.forward` with a prefix cache: (pre-norm hidden out, new keys, new values)."""
    x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], -1)
    attn_out, k, v = _attend(layer.self_attn, x, positions, past_k, past_v)
    residual = attn_out + hidden
    return layer.mlp(layer.post_attention_layernorm(residual)) + residual, k, v


class Eagle3ChainDrafter:
    """An `Eagle3Drafter` run incrementally, with its own KV cache over the verified context."""

    def __init__(self, drafter: Eagle3Drafter):
        self.drafter = drafter  # no dropout or batch norm: its train/eval mode is left as the caller has it
        self.state: _DraftState | None = None

    @property
    def _param(self) -> torch.Tensor:
        return self.drafter.fc.weight

    def _current(self) -> _DraftState:
        if self.state is None:
            raise RuntimeError("begin() a sequence before extending or drafting it")
        return self.state

    def begin(self, prompt_ids: Sequence[int]) -> None:
        heads = self.drafter.cfg.num_attention_heads
        key_dim, value_dim = self.drafter.midlayer.self_attn.cache_dims
        p = self._param
        keys = torch.zeros(heads, 0, key_dim, dtype=p.dtype, device=p.device)
        self.state = _DraftState(keys=keys, values=torch.zeros(heads, 0, value_dim, dtype=p.dtype, device=p.device))

    @torch.inference_mode()
    def extend(self, aux: torch.Tensor, next_tokens: Sequence[int]) -> None:
        """Step 0 (TTT step 0) over newly verified positions; their keys join the cache."""
        s, m = self._current(), self.drafter
        aux = aux.to(device=self._param.device, dtype=self._param.dtype)
        start = s.keys.shape[1]
        positions = torch.arange(start, start + aux.shape[0], device=aux.device)
        tokens = torch.as_tensor(list(next_tokens), dtype=torch.long, device=aux.device)
        out, k, v = _layer(m.midlayer, m.embed(tokens), m.project(aux), positions, s.keys, s.values)
        s.keys, s.values, s.root = torch.cat([s.keys, k], 1), torch.cat([s.values, v], 1), out[-1]

    @torch.inference_mode()
    def chain(self, k: int, forced: Sequence[int] | None = None) -> tuple[list[int], list[torch.Tensor]]:
        """k chained draft steps from the root: (target ids, draft-vocab logits per step).

        `forced` feeds given tokens instead of the drafter's own picks (teacher forcing), which
        is how a test compares this with `unroll`.
        """
        s, m = self._current(), self.drafter
        if s.root is None:
            raise RuntimeError("extend() the sequence with its prompt before drafting")
        root_logits, handed = m.head(s.root[None])  # handed on: the root itself, or its normed form (norm_output)
        logits = [root_logits[0]]
        picks = [int(m.draft_ids[logits[0].argmax()])]
        hidden, root_pos = handed[0], s.keys.shape[1] - 1
        past_k, past_v = s.keys, s.values
        for i in range(1, k):
            token = forced[i - 1] if forced is not None else picks[-1]
            embeds = m.embed(torch.tensor([token], device=hidden.device))
            pos = torch.tensor([root_pos + i], device=hidden.device)
            out, kk, vv = _layer(m.midlayer, embeds, hidden[None], pos, past_k, past_v)
            step_logits, handed = m.head(out)
            hidden = handed[0]
            past_k, past_v = torch.cat([past_k, kk], 1), torch.cat([past_v, vv], 1)  # chain keys: this round only
            logits.append(step_logits[0])
            picks.append(int(m.draft_ids[logits[-1].argmax()]))
        return picks, logits

    def propose(self, k: int) -> list[int]:
        return self.chain(k)[0]


# --------------------------------------------------------------------------------------------
# The target
# --------------------------------------------------------------------------------------------


class _Target:
    """A HF causal LM with a KV cache, hiding the transformers 4.x/5.x cache-argument rename."""

    def __init__(self, model, aux_layer_ids: Sequence[int] | None):
        self.model = text_causal_lm(model)
        params = inspect.signature(self.model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.keep_arg = "logits_to_keep" in params
        layers = self.model.config.num_hidden_layers
        self.layer_ids = list(aux_layer_ids) if aux_layer_ids is not None else eagle3_aux_layers(layers)
        self.device = self.model.get_input_embeddings().weight.device
        self.cache: Any = None  # transformers' cache object, after the first forward

    @overload
    def forward(self, ids: Sequence[int], aux: Literal[True], last_only: bool) -> tuple[torch.Tensor, torch.Tensor]: ...

    @overload
    def forward(self, ids: Sequence[int], aux: bool, last_only: bool) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def forward(self, ids: Sequence[int], aux: bool, last_only: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits [n or 1, V] float32, aux [n, 3H] or None) for ids appended to the cache."""
        kwargs: dict[str, Any] = {self.cache_arg: self.cache, "use_cache": True, "output_hidden_states": aux}
        if last_only and self.keep_arg:
            kwargs["logits_to_keep"] = 1
        x = torch.as_tensor([list(ids)], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, **kwargs)
        self.cache = out["cache"] if "cache" in out else out["past_key_values"]
        states = torch.cat([out.hidden_states[i + 1][0] for i in self.layer_ids], -1) if aux else None
        logits = out.logits[0, -1:] if last_only else out.logits[0]
        return logits.float(), states

    def crop(self, remove: int) -> None:
        """Drop the last `remove` cached positions (negative crop: the same call on 4.x and 5.x)."""
        if remove:
            self.cache.crop(-remove)


def _eos_ids(model, eos: Iterable[int] | int | None) -> set[int]:
    if eos is None:
        cfg = getattr(model, "generation_config", None) or model.config
        eos = getattr(cfg, "eos_token_id", None)
        eos = eos if eos is not None else getattr(model.config, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}


def _finish(tokens: list[int], max_new_tokens: int, eos: set[int]) -> tuple[list[int], bool]:
    """Tokens cut at the first EOS (kept) or at max_new_tokens; whether generation is over."""
    for i, t in enumerate(tokens[:max_new_tokens]):
        if t in eos:
            return tokens[: i + 1], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens


# --------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------


@dataclass
class SpecRun:
    """One prompt's speculative decode."""

    output_ids: list[int]
    accepted: list[int]  # per verify round: draft tokens accepted (0..k)
    draft_steps: int
    seconds: float

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def tokens(self) -> int:
        return len(self.output_ids)


@torch.inference_mode()
def speculative_generate(
    target,
    drafter: ChainDrafter,
    prompt_ids: Sequence[int],
    draft_steps: int,
    max_new_tokens: int,
    eos_token_ids: Iterable[int] | int | None = None,
    aux_layer_ids: Sequence[int] | None = None,
) -> SpecRun:
    """Greedy chain speculative decoding; output equals the target's greedy decoding."""
    if draft_steps < 1 or max_new_tokens < 1 or not prompt_ids:
        raise ValueError("need draft_steps >= 1, max_new_tokens >= 1 and a non-empty prompt")
    started = time.perf_counter()
    tgt, eos = _Target(target, aux_layer_ids), _eos_ids(target, eos_token_ids)
    logits, aux = tgt.forward(prompt_ids, aux=True, last_only=True)
    bonus = int(logits[-1].argmax())
    output, done = _finish([bonus], max_new_tokens, eos)
    drafter.begin(prompt_ids)
    drafter.extend(aux, list(prompt_ids[1:]) + [bonus])
    accepted: list[int] = []
    while not done:
        drafts = list(drafter.propose(draft_steps))[:draft_steps]
        logits, aux = tgt.forward([bonus] + drafts, aux=True, last_only=False)
        greedy = logits.argmax(-1).tolist()
        n = next((j for j, d in enumerate(drafts) if d != greedy[j]), len(drafts))
        tgt.crop(len(drafts) - n)
        new = drafts[:n] + [greedy[n]]
        accepted.append(n)
        output, done = _finish(output + new, max_new_tokens, eos)
        if not done:
            drafter.extend(aux[: n + 1], new)
            bonus = new[-1]
    return SpecRun(output, accepted, draft_steps, time.perf_counter() - started)


@torch.inference_mode()
def greedy_generate(
    target, prompt_ids: Sequence[int], max_new_tokens: int, eos_token_ids: Iterable[int] | int | None = None
) -> tuple[list[int], float]:
    """The reference output and its seconds: transformers' own greedy decoding, `generate(do_sample=False)`.

    Why not a loop over `_Target`: a reference sharing the speculative loop's cache wrapper shares its bugs (a
    wrong cache argument, wrong logits rows), and both outputs would agree while neither is the target's decoding.
    """
    model, eos = text_causal_lm(target), sorted(_eos_ids(target, eos_token_ids))
    ids = torch.as_tensor([list(prompt_ids)], dtype=torch.long, device=model.get_input_embeddings().weight.device)
    started = time.perf_counter()
    config = _greedy_config(eos, max_new_tokens)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, ids.shape[1] :].tolist(), time.perf_counter() - started


def greedy_generate_many(
    target, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_token_ids: Iterable[int] | int | None = None
) -> list[list[int]]:
    """Each prompt's greedy decode (cut after its first EOS, kept), the prompts of one length in one `generate` call:
    no padding, so each row is its prompt's own decoding, up to the rounding of batched matmuls (a near-tie may fall
    the other way than `greedy_generate`'s). For training data, where that does not matter; never for the lossless
    reference (`greedy_generate`)."""
    model, eos = text_causal_lm(target), sorted(_eos_ids(target, eos_token_ids))
    device = model.get_input_embeddings().weight.device
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_length.setdefault(len(p), []).append(i)
    out: list[list[int]] = [[] for _ in prompts]
    for length, rows in by_length.items():
        ids = torch.as_tensor([list(prompts[i]) for i in rows], dtype=torch.long, device=device)
        generated = model.generate(
            ids, attention_mask=torch.ones_like(ids), generation_config=_greedy_config(eos, max_new_tokens)
        )
        for i, row in zip(rows, generated[:, length:].tolist(), strict=True):
            out[i] = _finish(row, max_new_tokens, set(eos))[0]
    return out


def _greedy_config(eos: list[int], max_new_tokens: int) -> GenerationConfig:
    # eos [] rather than None: generate fills a None from the model's generation_config (its EOS ids).
    return GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        eos_token_id=eos,
        pad_token_id=eos[0] if eos else 0,
    )


# A tie: two tokens' logits closer than this many of the target's dtype eps, relative to their size. In bf16 the
# verify forward (several tokens after a cache) and generate's one-token steps round differently, so a target's
# near-tie can fall either way: a flip there is the dtype's, not the loop's. Measured by `forward_shape_rounding` on
# the CPU stand-in: up to 3 eps apart in float32, 1 in bf16 (random prompts); the device check measures it on a GPU.
TIE_EPS = 8


@dataclass(frozen=True)
class Divergence:
    """Where a speculative decode first left the target's greedy decoding, and the two tokens' logits there."""

    position: int  # new tokens before it
    greedy: int | None  # None: that decode had ended
    speculative: int | None
    logit_gap: float | None  # greedy's token's logit minus the speculative one's: a plain forward over the prefix
    tolerance: float  # TIE_EPS eps of the target's dtype, at the logits' size

    @property
    def tie(self) -> bool:
        """Whether the target's dtype cannot tell the two tokens apart here (the flip is rounding, not the loop)."""
        return self.logit_gap is not None and abs(self.logit_gap) <= self.tolerance

    def to_metadata(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "greedy": self.greedy,
            "speculative": self.speculative,
            "logit_gap": None if self.logit_gap is None else round(self.logit_gap, 6),
            "tolerance": round(self.tolerance, 6),
            "tie": self.tie,
        }


@torch.inference_mode()
def divergence(
    target, prompt_ids: Sequence[int], speculative_ids: Sequence[int], greedy_ids: Sequence[int]
) -> Divergence | None:
    """The first position where the two decodes differ (None: they do not), judged by the target's logits there: one
    forward over the prompt and the tokens both decodes agree on, with no cache (neither decode's own path)."""
    if list(speculative_ids) == list(greedy_ids):
        return None
    common = min(len(speculative_ids), len(greedy_ids))
    i = next((j for j in range(common) if speculative_ids[j] != greedy_ids[j]), common)
    if i == common:  # one decode ended where the other went on: not a choice between two tokens
        greedy_next = int(greedy_ids[i]) if i < len(greedy_ids) else None
        speculative_next = int(speculative_ids[i]) if i < len(speculative_ids) else None
        return Divergence(i, greedy_next, speculative_next, None, 0.0)
    model = text_causal_lm(target)
    weight = model.get_input_embeddings().weight  # the dtype the target computes in (some upcast only the logits)
    ids = torch.as_tensor([[*prompt_ids, *greedy_ids[:i]]], dtype=torch.long, device=weight.device)
    logits = model(input_ids=ids, use_cache=False).logits[0, -1]
    g, s = float(logits[greedy_ids[i]]), float(logits[speculative_ids[i]])
    tolerance = TIE_EPS * torch.finfo(weight.dtype).eps * max(1.0, abs(g), abs(s))
    return Divergence(i, int(greedy_ids[i]), int(speculative_ids[i]), g - s, tolerance)


@torch.inference_mode()
def forward_shape_rounding(target, sequence: Sequence[int], tokens: int) -> dict[str, float | int]:
    """How far apart the target's logits for the last `tokens` positions of `sequence` come out of the decode's three
    forward shapes: one plain forward over it (`divergence`'s), one-token steps after the rest is cached (generate's),
    and one `tokens`-token verify after it (the speculative loop's). `max_eps`: the largest difference, in eps of the
    target's dtype at the row's largest logit (what TIE_EPS must cover); `argmax_flips`: rows whose top token differs
    between shapes."""
    if not 0 < tokens < len(sequence):
        raise ValueError(f"need 0 < tokens < {len(sequence)} (the sequence's length), got {tokens}")
    model = text_causal_lm(target)
    weight = model.get_input_embeddings().weight
    prefix, rest = list(sequence[:-tokens]), list(sequence[-tokens:])
    ids = torch.as_tensor([list(sequence)], dtype=torch.long, device=weight.device)
    plain = model(input_ids=ids, use_cache=False).logits[0, -tokens:].float()
    verifier, stepper = _Target(target, None), _Target(target, None)
    verifier.forward(prefix, aux=False, last_only=True)
    verify = verifier.forward(rest, aux=False, last_only=False)[0]
    stepper.forward(prefix, aux=False, last_only=True)
    steps = torch.cat([stepper.forward([t], aux=False, last_only=True)[0] for t in rest])
    scale = torch.finfo(weight.dtype).eps * plain.abs().amax(-1).clamp(min=1.0)
    worst = max(
        float(((a - b).abs().amax(-1) / scale).max()) for a, b in ((plain, verify), (plain, steps), (verify, steps))
    )
    tops = torch.stack([plain.argmax(-1), verify.argmax(-1), steps.argmax(-1)])
    return {"max_eps": round(worst, 3), "argmax_flips": int((tops != tops[0]).any(0).sum()), "rows": tokens}


# --------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------


def accept_lengths(tokens: int, accepted: Sequence[int]) -> dict[str, float | None]:
    """The three accept-length definitions for `tokens` generated over verify rounds `accepted`.

    `tokens` includes the prefill's first token; rounds produced tokens - 1 of them (after any
    truncation by max_new_tokens or EOS). None when no verify round ran.
    """
    rounds = len(accepted)
    if not rounds:
        return {"accept_length_sglang": None, "accept_length_per_round": None, "accept_length_vllm": None}
    return {
        "accept_length_sglang": tokens / rounds,
        "accept_length_per_round": (tokens - 1) / rounds,
        "accept_length_vllm": 1 + sum(accepted) / rounds,
    }


def position_acceptance(accepted: Iterable[int], draft_steps: int) -> list[float | None]:
    """Per draft position j = 1..k: P(draft j accepted | drafts 1..j-1 accepted), over rounds."""
    reached, hit = [0] * draft_steps, [0] * draft_steps
    for n in accepted:
        for j in range(min(n + 1, draft_steps)):
            reached[j] += 1
            hit[j] += int(j < n)
    return [h / r if r else None for h, r in zip(hit, reached, strict=True)]


@dataclass
class PromptResult:
    prompt_tokens: int
    spec: SpecRun
    greedy_ids: list[int] | None = None
    greedy_seconds: float | None = None
    divergence: Divergence | None = None  # where a decode that is not lossless first differs

    @property
    def lossless(self) -> bool | None:
        return None if self.greedy_ids is None else self.spec.output_ids == self.greedy_ids

    @property
    def lossless_up_to_ties(self) -> bool | None:
        """Lossless, or first differing at a tie the target's dtype cannot resolve (after which the two decodes
        continue different texts and cannot be compared)."""
        if self.lossless is None:
            return None
        return self.lossless or (self.divergence is not None and self.divergence.tie)

    def to_metadata(self) -> dict[str, Any]:
        s = self.spec
        return {
            "prompt_tokens": self.prompt_tokens,
            "tokens": s.tokens,
            "verify_rounds": s.rounds,
            **_rounded(accept_lengths(s.tokens, s.accepted)),
            "position_acceptance": _rounded(position_acceptance(s.accepted, s.draft_steps)),
            "spec_tokens_per_s": _rate(s.tokens, s.seconds),
            "greedy_tokens_per_s": None
            if self.greedy_ids is None
            else _rate(len(self.greedy_ids), self.greedy_seconds),
            "lossless": self.lossless,
            "lossless_up_to_ties": self.lossless_up_to_ties,
            "divergence": None if self.divergence is None else self.divergence.to_metadata(),
        }


@dataclass
class SpecDecodeReport:
    """Speculative decoding measured on real decodes; `proxy` = measured on the stand-in target."""

    proxy: bool
    draft_steps: int
    max_new_tokens: int
    prompts: list[PromptResult] = field(default_factory=list)
    simulated: dict[str, Any] | None = None  # train.evaluate's teacher-forced figures, set by the caller

    @property
    def lossless(self) -> bool | None:
        checks = [p.lossless for p in self.prompts if p.lossless is not None]
        return all(checks) if checks else None

    @property
    def lossless_up_to_ties(self) -> bool | None:
        checks = [p.lossless_up_to_ties for p in self.prompts if p.lossless_up_to_ties is not None]
        return all(checks) if checks else None

    def totals(self) -> dict[str, Any]:
        """Aggregates over prompts, token-weighted (sums of tokens / sums of rounds, of seconds)."""
        accepted = [n for p in self.prompts for n in p.spec.accepted]
        tokens = sum(p.spec.tokens for p in self.prompts)
        # Pooled rounds: sglang's ratio adds every prompt's prefill token, per_round none of them.
        lengths = accept_lengths(tokens, accepted)
        if accepted:
            lengths["accept_length_per_round"] = (tokens - len(self.prompts)) / len(accepted)
        spec_s = sum(p.spec.seconds for p in self.prompts)
        greedy = [p for p in self.prompts if p.greedy_ids is not None]
        greedy_tokens = sum(len(p.greedy_ids or ()) for p in greedy)  # all set: `greedy` holds the compared prompts
        greedy_s = sum(p.greedy_seconds or 0.0 for p in greedy)
        spec_rate, greedy_rate = _rate(tokens, spec_s), _rate(greedy_tokens, greedy_s) if greedy else None
        return {
            "prompts": len(self.prompts),
            "tokens": tokens,
            "verify_rounds": len(accepted),
            **_rounded(lengths),
            "position_acceptance": _rounded(position_acceptance(accepted, self.draft_steps)),
            "spec_tokens_per_s": spec_rate,
            "greedy_tokens_per_s": greedy_rate,
            "speedup": round(spec_rate / greedy_rate, 3) if spec_rate and greedy_rate else None,
            "lossless": self.lossless,
            "mismatched_prompts": sum(1 for p in greedy if not p.lossless),
            "lossless_up_to_ties": self.lossless_up_to_ties,
            "mismatched_at_ties": sum(1 for p in greedy if not p.lossless and p.lossless_up_to_ties),
        }

    def to_metadata(self) -> dict[str, Any]:
        return {
            "proxy": self.proxy,
            "label": "proxy (stand-in target)" if self.proxy else "target",
            "draft_steps": self.draft_steps,
            "num_draft_tokens": self.draft_steps + 1,
            "topk": 1,
            "max_new_tokens": self.max_new_tokens,
            **self.totals(),
            "simulated": self.simulated,
            "definitions": DEFINITIONS,
            "per_prompt": [p.to_metadata() for p in self.prompts],
        }


DEFINITIONS = {
    "accept_length_sglang": "SGLang's completion_tokens / spec_verify_ct: generated tokens (prefill's first token "
    "included) per target verify forward; counts the bonus token",
    "accept_length_per_round": "tokens produced by verify rounds / rounds = mean(accepted drafts + 1): bonus counted, "
    "prefill token not",
    "accept_length_vllm": "vLLM's 1 + accepted draft tokens / drafts (before truncation at max_new_tokens/EOS)",
    "position_acceptance": "for draft position j = 1..k: share of rounds accepting draft j among rounds that "
    "accepted drafts 1..j-1",
    "simulated": "train.evaluate on stored hidden states: teacher-forced, no decoding (SpecForge-style)",
}


def _rate(tokens: int, seconds: float | None) -> float | None:
    return round(tokens / seconds, 2) if seconds else None


def _rounded(x):
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return round(x, 4) if isinstance(x, float) else x


# 9 parameters: the decode's knobs as keywords (SGLang's steps and tokens, EOS, layers), the form tests call
def evaluate_speculative(
    target: Any,
    drafter: ChainDrafter | Eagle3Drafter,
    prompts: Sequence[Sequence[int]],
    *,
    draft_steps: int = 3,
    max_new_tokens: int = 64,
    proxy: bool,
    eos_token_ids: Iterable[int] | int | None = None,
    aux_layer_ids: Sequence[int] | None = None,
    compare_greedy: bool = True,
    greedy: SpecDecodeReport | None = None,
) -> SpecDecodeReport:
    """Decode every prompt speculatively (and, with compare_greedy, with the target alone).

    Run it once with the trained drafter and once with an untrained one (the floor). Greedy runs
    after spec on each prompt; both include their prefill in the seconds. `greedy`: a report of the same target,
    prompts, token count and stop ids whose greedy decodes are taken instead of decoding them again.
    """
    chain = Eagle3ChainDrafter(drafter) if isinstance(drafter, Eagle3Drafter) else drafter
    eos = _eos_ids(target, eos_token_ids)
    report = SpecDecodeReport(proxy=proxy, draft_steps=draft_steps, max_new_tokens=max_new_tokens)
    if greedy is not None and (len(greedy.prompts) != len(prompts) or greedy.max_new_tokens != max_new_tokens):
        raise ValueError("the greedy decodes to reuse are of other prompts or another token count")
    for n, ids in enumerate(prompts):
        spec = speculative_generate(target, chain, ids, draft_steps, max_new_tokens, eos, aux_layer_ids)
        result = PromptResult(prompt_tokens=len(ids), spec=spec)
        if compare_greedy:
            known = greedy.prompts[n] if greedy is not None else None
            if known is not None and known.greedy_ids is not None and known.prompt_tokens == len(ids):
                result.greedy_ids, result.greedy_seconds = known.greedy_ids, known.greedy_seconds
            else:
                result.greedy_ids, result.greedy_seconds = greedy_generate(target, ids, max_new_tokens, eos)
            result.divergence = divergence(target, ids, spec.output_ids, result.greedy_ids)
        report.prompts.append(result)
    return report
