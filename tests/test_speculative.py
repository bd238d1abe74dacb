"""Real speculative decoding on the stand-in target: lossless, counted right, rolled back right."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import pytest
import torch

from eagle3_assets.stages.eagle3_drafter import speculative
from eagle3_assets.stages.eagle3_drafter.checks import drafter_beats_floor
from eagle3_assets.stages.eagle3_drafter.mla import MLAShape
from eagle3_assets.stages.eagle3_drafter.model import DRAFTER_KINDS, MLA_KINDS, DrafterConfig, Eagle3Drafter
from eagle3_assets.stages.eagle3_drafter.pipeline import drafter_config
from eagle3_assets.stages.eagle3_drafter.quality import SpeculativeQuality
from eagle3_assets.stages.eagle3_drafter.speculative import (
    TIE_EPS,
    Eagle3ChainDrafter,
    PromptResult,
    SpecDecodeReport,
    SpecRun,
    accept_lengths,
    evaluate_speculative,
    forward_shape_rounding,
    greedy_generate,
    position_acceptance,
    speculative_generate,
)
from eagle3_assets.stages.eagle3_drafter.target_weights import load_embed_and_head
from eagle3_assets.stages.eagle3_drafter.vocab import build_draft_vocab, effective_draft_vocab_size
from eagle3_resources.hidden_states.transformers_backend import TransformersHiddenStates

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b",
    "Speculative decoding drafts several tokens",
    "1, 2, 3, 4, 5,",
]
K = 3
NO_EOS: tuple[int, ...] = ()
# The longest greedy continuation any test here compares with or drafts from: the oracle's 23-token run reads its
# token 23 (its sixth round drafts the three after the 21 verified).
REF_TOKENS = 24


@pytest.fixture(scope="module")
def prompts(tok, target_model) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    rand = torch.randint(0, target_model.config.vocab_size - 300, (2, 9), generator=g).tolist()
    return [tok.encode(t) for t in TEXTS] + rand


@pytest.fixture(scope="module")
def greedy_decodes(target_model, prompts) -> dict[tuple[int, ...], tuple[list[int], float]]:
    """Each prompt's greedy continuation (`greedy_generate`, REF_TOKENS long) and its seconds: the target's own
    decodes, made once for the module (the greedy test checks them against the model read without a cache)."""
    return {tuple(p): greedy_generate(target_model, p, REF_TOKENS, NO_EOS) for p in prompts}


@pytest.fixture(scope="module")
def references(greedy_decodes) -> dict[tuple[int, ...], list[int]]:
    """Each prompt's greedy continuation, long enough for any test here to draft from."""
    return {p: ids for p, (ids, _) in greedy_decodes.items()}


def greedy_report(greedy_decodes, prompts, tokens: int) -> SpecDecodeReport:
    """The module's greedy decodes of `prompts`, cut to `tokens`, in the form `evaluate_speculative(greedy=...)` takes
    them (the asset hands the trained drafter's on to the untrained one's): a test of the speculative loop decodes
    no greedy reference again. Without an EOS a shorter greedy decode is the longer one's first tokens."""
    report = SpecDecodeReport(proxy=True, draft_steps=K, max_new_tokens=tokens)
    for p in prompts:
        ids, seconds = greedy_decodes[tuple(p)]
        no_spec = SpecRun([], [], K, 0.0)
        report.prompts.append(PromptResult(len(p), no_spec, ids[:tokens], seconds * tokens / len(ids)))
    return report


def standin_drafter(target_resource, tokenizer_resource, references, kind: str = "auto") -> Eagle3Drafter:
    """A random drafter of `kind` for the stand-in, built as pipeline.py builds one."""
    folder = target_resource.folder(tokenizer_resource, log=lambda m: None)
    target_config = json.loads((folder / "config.json").read_text())
    embed, _ = load_embed_and_head(folder)
    counts = Counter(t for ref in references.values() for t in ref)
    size = effective_draft_vocab_size(256, len(counts))
    draft_ids = build_draft_vocab(counts, size, embed.shape[0])
    cfg = drafter_config(target_config, target_config["hidden_size"], size, embed.shape[0], kind)
    torch.manual_seed(0)
    return Eagle3Drafter(cfg, embed, draft_ids)


@pytest.fixture(scope="module")
def untrained(target_resource, tokenizer_resource, target_model, references) -> Eagle3Drafter:
    """A random drafter of the stand-in's default kind."""
    return standin_drafter(target_resource, tokenizer_resource, references)


class ScriptedDrafter:
    """Proposes from the target's known greedy continuation, each draft position right or wrong by script."""

    def __init__(self, references, right: list[bool]):
        self.references, self.right = references, right

    def begin(self, prompt_ids):
        self.ref, self.prompt_len, self.positions = self.references[tuple(prompt_ids)], len(prompt_ids), 0

    def extend(self, aux, next_tokens):
        self.positions += len(next_tokens)

    def propose(self, k):
        known = self.positions - self.prompt_len + 1  # greedy tokens verified beyond the prompt, the bonus included
        out = []
        for j in range(k):
            t = self.ref[known + j]
            out.append(t if self.right[j % len(self.right)] else (t + 1) % 163840)
        return out


def oracle(references):
    return ScriptedDrafter(references, [True])


def adversary(references):
    return ScriptedDrafter(references, [False])


def forward_log(model):
    """Record (cached positions, fed tokens) of every target forward."""
    log = []

    def hook(_module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        log.append((cache.get_seq_length() if cache is not None else 0, kwargs["input_ids"].shape[1]))

    return log, model.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.slow
def test_untrained_drafter_is_lossless(target_model, untrained, prompts, greedy_decodes):
    report = evaluate_speculative(
        target_model,
        untrained,
        prompts,
        draft_steps=K,
        max_new_tokens=REF_TOKENS,
        proxy=True,
        eos_token_ids=NO_EOS,
        greedy=greedy_report(greedy_decodes, prompts, REF_TOKENS),
    )
    totals = report.totals()
    assert report.lossless is True and totals["mismatched_prompts"] == 0
    assert totals["tokens"] == REF_TOKENS * len(prompts)
    assert 1.0 <= totals["accept_length_per_round"] <= K + 1
    meta = report.to_metadata()
    json.dumps(meta)
    assert meta["proxy"] is True and meta["label"].startswith("proxy") and len(meta["per_prompt"]) == len(prompts)
    assert meta["simulated"] is None and meta["spec_tokens_per_s"] > 0 and meta["greedy_tokens_per_s"] > 0


def test_perfect_oracle_accepts_every_draft_with_one_verify_forward_per_round(target_model, prompts, references):
    rounds = 5
    log, handle = forward_log(target_model)
    try:
        report = evaluate_speculative(
            target_model,
            oracle(references),
            prompts,
            draft_steps=K,
            max_new_tokens=1 + rounds * (K + 1),
            proxy=True,
            eos_token_ids=NO_EOS,
            compare_greedy=False,
        )
    finally:
        handle.remove()
    for p, result in zip(prompts, report.prompts, strict=True):  # a result per prompt
        run = result.spec
        assert run.output_ids == references[tuple(p)][: 1 + rounds * (K + 1)]
        assert run.accepted == [K] * rounds
        assert accept_lengths(run.tokens, run.accepted) == {
            "accept_length_sglang": (1 + rounds * (K + 1)) / rounds,
            "accept_length_per_round": K + 1,
            "accept_length_vllm": K + 1,
        }
        assert position_acceptance(run.accepted, K) == [1.0] * K
    assert len(log) == len(prompts) * (1 + rounds)  # one prefill + one verify per round, nothing else
    assert report.totals()["accept_length_per_round"] == K + 1

    # A budget that ends mid-round: the last round is cut, the output still exact.
    run = speculative_generate(target_model, oracle(references), prompts[0], K, 23, NO_EOS)
    assert run.output_ids == references[tuple(prompts[0])][:23] and run.accepted == [K] * 6


def test_a_second_drafter_takes_the_first_ones_greedy_decodes_and_decodes_no_more(target_model, prompts, references):
    """The asset measures the trained and the untrained drafter on the same prompts: the target's own decodes are
    made once. With them handed on, the second evaluation runs exactly the forwards of its speculative decodes."""

    def evaluate(drafter, tokens=12, greedy=None, compare_greedy=True):
        return evaluate_speculative(
            target_model,
            drafter,
            prompts[:2],
            draft_steps=K,
            max_new_tokens=tokens,
            proxy=True,
            eos_token_ids=NO_EOS,
            greedy=greedy,
            compare_greedy=compare_greedy,
        )

    first = evaluate(oracle(references))
    counts = {}
    for name in ("reused", "spec only"):
        log, handle = forward_log(target_model)
        try:
            second = evaluate(adversary(references), greedy=first, compare_greedy=name == "reused")
        finally:
            handle.remove()
        counts[name] = len(log)
        if name == "reused":
            assert [r.greedy_ids for r in second.prompts] == [r.greedy_ids for r in first.prompts]
            assert second.lossless is True
    assert counts["reused"] == counts["spec only"]
    with pytest.raises(ValueError, match="other prompts or another token count"):
        evaluate(adversary(references), tokens=8, greedy=first)


def test_always_wrong_drafter_gives_accept_length_one(target_model, prompts, references, greedy_decodes):
    report = evaluate_speculative(
        target_model,
        adversary(references),
        prompts[:3],
        draft_steps=K,
        max_new_tokens=12,
        proxy=True,
        eos_token_ids=NO_EOS,
        greedy=greedy_report(greedy_decodes, prompts[:3], 12),
    )
    assert report.lossless is True
    for result in report.prompts:
        assert result.spec.accepted == [0] * 11
        lengths = accept_lengths(result.spec.tokens, result.spec.accepted)
        assert lengths["accept_length_per_round"] == 1.0 and lengths["accept_length_vllm"] == 1.0
        assert lengths["accept_length_sglang"] == 12 / 11
    assert report.totals()["position_acceptance"] == [0.0, None, None]


def test_accept_length_definitions_on_a_hand_checked_case():
    # Rounds accept 3, 0 and 2 drafts of k=3: 4 + 1 + 3 = 8 tokens from rounds, + 1 from the prefill.
    assert accept_lengths(9, [3, 0, 2]) == {
        "accept_length_sglang": 3.0,
        "accept_length_per_round": 8 / 3,
        "accept_length_vllm": 1 + 5 / 3,
    }
    # Position 1: reached 3 times, accepted twice; 2: reached twice (3, 2), accepted twice; 3: reached twice, once.
    assert position_acceptance([3, 0, 2], 3) == [2 / 3, 1.0, 0.5]
    assert accept_lengths(1, []) == {
        "accept_length_sglang": None,
        "accept_length_per_round": None,
        "accept_length_vllm": None,
    }


def test_a_rejected_middle_draft_rolls_back_target_and_drafter(target_model, prompts, references):
    """Drafts right, wrong, right: one accepted per round; the cache keeps exactly the verified positions."""
    log, handle = forward_log(target_model)
    try:
        for p in prompts[:3]:
            log.clear()
            drafter = ScriptedDrafter(references, [True, False, True])
            run = speculative_generate(target_model, drafter, p, K, 20, NO_EOS)
            assert run.output_ids == references[tuple(p)][:20]
            assert run.accepted[:-1] == [1] * (len(run.accepted) - 1)
            # Before each verify the target has cached every verified token but the bonus it is fed now.
            assert log[0] == (0, len(p))
            cached = [c for c, _ in log[1:]]
            steps = zip(cached, cached[1:], run.accepted, strict=False)  # consecutive verifies, each with its round
            assert cached[0] == len(p) and all(b - a == n + 1 for a, b, n in steps)
            assert all(fed == K + 1 for _, fed in log[1:])
    finally:
        handle.remove()


class SpyChain(Eagle3ChainDrafter):
    """The real drafter, checking its cache holds exactly the verified positions when it drafts."""

    def begin(self, prompt_ids):
        super().begin(prompt_ids)
        self.prompt_len, self.cached, self.aux = len(prompt_ids), [], []

    def extend(self, aux, next_tokens):
        super().extend(aux, next_tokens)
        self.aux.append(aux)

    def propose(self, k):
        assert self.state is not None
        self.cached.append(self.state.keys.shape[1])
        return super().propose(k)


def test_real_drafter_cache_and_aux_follow_the_verified_sequence(target_model, untrained, prompts, references):
    spy = SpyChain(untrained)
    p = prompts[1]
    run = speculative_generate(target_model, spy, p, K, REF_TOKENS, NO_EOS)
    assert run.output_ids == references[tuple(p)]
    # Before round r the drafter has step-0 keys for the prompt and every verified token but the bonus.
    assert spy.cached[0] == len(p)
    assert all(b - a == n + 1 for a, b, n in zip(spy.cached, spy.cached[1:], run.accepted, strict=False))  # by round
    # The aux it was fed (prefill + verify forwards) equals what the extraction backend stores for training.
    fed = torch.cat(spy.aux)
    expected, _ = TransformersHiddenStates(target_model).extract(list(p) + run.output_ids)
    torch.testing.assert_close(fed, expected[: fed.shape[0]], rtol=1e-4, atol=1e-4)


def chain_test_config(kind: str) -> DrafterConfig:
    common: dict[str, Any] = {"intermediate_size": 64, "vocab_size": 500, "draft_vocab_size": 64}
    if kind in MLA_KINDS:  # 8 heads of 8 nope + 4 rope key channels, values 8 wide, LoRA ranks 16
        return DrafterConfig.mla_of(kind, 32, MLAShape.of_width(32), **common)
    return DrafterConfig(
        hidden_size=32, target_hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, **common
    )


@pytest.mark.parametrize("kind", DRAFTER_KINDS)
def test_incremental_chain_computes_what_ttt_trains(kind):
    """Teacher-forced, the incremental drafter's chain logits (its own prefix-cache attention: MLA's decompressed
    keys and values for the MLA kinds, the post-norm hidden handed on for EAGLE 3.1) equal `unroll`'s at the chain's
    root, and so do its proposals and the unroll's argmax."""
    cfg = chain_test_config(kind)
    torch.manual_seed(1)
    model = Eagle3Drafter(cfg, torch.randn(500, 32), torch.arange(0, 128, 2)).eval()
    with torch.no_grad():  # norms not all ones: fc_norm and a norm applied once too often show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn_like(p))
    L, steps = 20, 4
    aux, tokens = torch.randn(L, 96), torch.randint(0, 500, (L,))
    with torch.no_grad():
        trained = model.unroll(aux, tokens, torch.arange(L), steps)
    for root in (0, 7, L - steps - 1):
        chain = Eagle3ChainDrafter(model)
        chain.begin(tokens[: root + 1].tolist())
        cut = root // 2 + 1  # two extends, as after a prefill and a verify round
        chain.extend(aux[:cut], tokens[1 : cut + 1].tolist())
        if cut <= root:
            chain.extend(aux[cut : root + 1], tokens[cut + 1 : root + 2].tolist())
        picks, logits = chain.chain(steps, forced=tokens[root + 2 : root + 1 + steps].tolist())
        for i in range(steps):
            torch.testing.assert_close(logits[i], trained[i][root], rtol=1e-5, atol=1e-5)
        assert picks == [int(model.draft_ids[trained[i][root].argmax()]) for i in range(steps)]


class Steered(SpyChain):
    """A real drafter (its cache checked by SpyChain) whose first two proposals of a round are the target's greedy
    tokens, so rounds accept several drafts and the drafter's cache grows by several verified positions at once."""

    def __init__(self, drafter, reference: list[int]):
        super().__init__(drafter)
        self.reference = reference

    def propose(self, k):
        picks = super().propose(k)  # the drafter's own chain runs every round
        known = self.cached[-1] - self.prompt_len + 1  # greedy tokens verified beyond the prompt, the bonus included
        return self.reference[known : known + 2] + picks[2:]


@pytest.mark.parametrize("kind", DRAFTER_KINDS)
def test_each_kind_decodes_as_the_target_greedily_does(
    kind, target_resource, tokenizer_resource, target_model, prompts, references
):
    """Each kind's incremental decode (its own KV cache: GQA keys, or MLA's decompressed keys and values; the
    pre- or post-norm hidden handed on) inside the lossless loop: the output is the target's greedy decoding, with
    rounds rejecting at once (a random drafter) and rounds accepting two drafts (steered)."""
    drafter = standin_drafter(target_resource, tokenizer_resource, references, kind).eval()
    assert drafter.cfg.drafter_kind == kind
    for p in prompts[:2]:
        want = references[tuple(p)][:20]
        assert speculative_generate(target_model, Eagle3ChainDrafter(drafter), p, K, 20, NO_EOS).output_ids == want
        spy = Steered(drafter, references[tuple(p)])
        run = speculative_generate(target_model, spy, p, K, 20, NO_EOS)
        assert run.output_ids == want and min(run.accepted[:-1]) >= 2
        assert all(b - a == n + 1 for a, b, n in zip(spy.cached, spy.cached[1:], run.accepted, strict=False))


def test_eos_stops_both_decoders_at_the_same_token(target_model, untrained, prompts, references):
    p = prompts[0]
    eos = references[tuple(p)][5]
    greedy, _ = greedy_generate(target_model, p, 40, [eos])
    assert greedy[-1] == eos and eos not in greedy[:-1]
    run = speculative_generate(target_model, Eagle3ChainDrafter(untrained), p, K, 40, [eos])
    assert run.output_ids == greedy
    run = speculative_generate(target_model, oracle(references), p, K, 40, [eos])
    assert run.output_ids == greedy


# -- losslessness: the reference is independent of the loop, and a lossy decode fails the asset's check ----------


def uncached_top_tokens(model, prompt_ids, output_ids) -> list[int]:
    """The definition of greedy decoding, checked: the model's top token after the prompt and each prefix of
    `output_ids`, read with no cache at all. One forward over the whole sequence gives them all (a causal model's row
    i sees exactly tokens 0..i), where decoding them one by one would re-read the sequence at every token."""
    ids = torch.tensor([[*prompt_ids, *output_ids[:-1]]])
    with torch.inference_mode():
        logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt_ids) - 1 :]
    return logits.argmax(-1).tolist()


def test_the_greedy_reference_is_the_targets_own_decoding_without_any_cache(target_model, prompts, references):
    """greedy_generate (transformers' generate; the module's references are its decodes) against the model read
    without a cache: every token the top one after all before it, and an EOS decode stopping at its first EOS."""
    for p in prompts:
        ids = references[tuple(p)]
        assert len(ids) == REF_TOKENS and ids == uncached_top_tokens(target_model, p, ids)
    p = prompts[0]
    eos = references[tuple(p)][5]
    stopped = greedy_generate(target_model, p, 40, [eos])[0]
    assert stopped[-1] == eos and eos not in stopped[:-1]
    assert stopped == uncached_top_tokens(target_model, p, stopped)


@contextmanager
def forward_hooked(model, hook):
    """`hook(module, args, kwargs, output)` on every forward of `model` for the block."""
    handle = model.register_forward_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def verify_forwards_corrupted(model):
    """A target whose forward over several tokens after a cache (the verify shape) differs from its decoding one token
    at a time, as a wrong attention mask for a multi-token step with a KV cache would make it: rows after the first get
    their logits shifted by one token id."""

    def hook(_module, _args, kwargs, out):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if kwargs["input_ids"].shape[1] > 1 and cache is not None and cache.get_seq_length() > 0:
            out.logits[:, 1:] = out.logits[:, 1:].roll(1, -1)
        return out

    with forward_hooked(model, hook):
        yield


@contextmanager
def rejected_drafts_kept_in_the_cache():
    """A loop that forgets to roll the target's cache back past the drafts it rejected."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(speculative._Target, "crop", lambda self, remove: None)
        yield


@contextmanager
def drafts_accepted_unverified():
    """A loop whose verify forward reads every draft as the target's own pick (`greedy` = the drafts)."""
    forward = speculative._Target.forward

    def lying(self, ids, aux, last_only):
        logits, states = forward(self, ids, aux, last_only)
        if not last_only:
            logits[torch.arange(len(ids) - 1), torch.as_tensor(ids[1:])] = float("inf")
        return logits, states

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(speculative._Target, "forward", lying)
        yield


def evaluated_as_the_asset_does(target_model, drafters, prompts, tokens: int) -> list[SpecDecodeReport]:
    """The trained and the untrained drafter's reports as `quality.measure_speculative` makes them: the target's
    greedy decodes made with the first and handed on to the second."""
    reports: list[SpecDecodeReport] = []
    for drafter in drafters:
        reports.append(
            evaluate_speculative(
                target_model,
                drafter,
                prompts,
                draft_steps=K,
                max_new_tokens=tokens,
                proxy=True,
                eos_token_ids=NO_EOS,
                greedy=reports[0] if reports else None,
            )
        )
    return reports


@pytest.mark.parametrize("corruption", ["none", "target_verify", "cache_rollback", "unverified_drafts"])
def test_a_decode_that_is_not_lossless_fails_the_speculative_gain_check(
    target_model, untrained, prompts, references, corruption
):
    """The asset's `speculative_gain` check, fed the figures the asset computes (SpeculativeQuality.figures), with
    the margin at -inf so that losslessness alone decides. An honest decode passes; a corrupted target, or a loop
    that keeps rejected drafts or accepts drafts unverified, fails it, for the trained (oracle) and untrained
    (random) drafter alike."""
    corruptions: dict[str, Callable[[], AbstractContextManager[object]]] = {
        "none": nullcontext,
        "target_verify": lambda: verify_forwards_corrupted(target_model),
        "cache_rollback": rejected_drafts_kept_in_the_cache,
        "unverified_drafts": drafts_accepted_unverified,
    }
    corrupt = corruptions[corruption]
    chosen = prompts[:3]
    with corrupt():
        reports = evaluated_as_the_asset_does(
            target_model, (ScriptedDrafter(references, [True, True, False]), untrained), chosen, 16
        )
    outcome = drafter_beats_floor(SpeculativeQuality(reports[0], reports[1]).figures(), margin=-math.inf)
    print(corruption, outcome.description)
    if corruption == "none":
        assert outcome.passed and outcome.metadata["lossless"] is True
    else:
        assert not outcome.passed and "NOT lossless" in outcome.description
        assert outcome.metadata["lossless"] is False


@contextmanager
def flipped_at(model, position: int, gap: Callable[[torch.Tensor], float]):
    """A target whose top two tokens, for the context ending at absolute `position`, sit `gap(top logit)` apart: the
    runner-up just below the top in plain forwards (generate's steps, a forward without cache), just above it in the
    verify shape (several tokens after a cache). So the speculative decode takes the runner-up there and greedy
    decoding the top, as bf16 rounding does to a target's near-tie, or as a loop bug does by a wide gap."""

    def hook(_module, _args, kwargs, out):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        fed = kwargs["input_ids"].shape[1]
        start = cache.get_seq_length() - fed if cache is not None else 0  # the cache already holds the fed tokens
        rows = out.logits.shape[1]  # the last `rows` fed positions (generate keeps only the last one's)
        row = position - (start + fed - rows)
        if 0 <= row < rows:
            logits = out.logits[0, row]
            top, runner = logits.topk(2).indices.tolist()
            verify = fed > 1 and start > 0
            logits[runner] = logits[top] + (1 if verify else -1) * gap(logits[top])
        return out

    with forward_hooked(model, hook):
        yield


@pytest.mark.parametrize("kind", ["tie", "wide"])
def test_a_flip_at_a_tie_the_dtype_cannot_resolve_is_told_from_a_loop_that_is_not_lossless(
    target_model, untrained, prompts, references, kind
):
    """The decode first differs from greedy decoding at new token 5 in both cases; the divergence names that token,
    the two ids and the gap a plain forward sees there. A gap of a few float32 ulps is a tie of the dtype: lossless up
    to ties, and the asset's check passes; a gap of 1.0 is the loop's fault: NOT lossless, and the check fails."""
    prompt, at = prompts[0], 5
    scale = 4 * torch.finfo(torch.float32).eps
    gap = (lambda top: scale * max(1.0, abs(float(top)))) if kind == "tie" else (lambda top: 1.0)
    with flipped_at(target_model, len(prompt) + at - 1, gap):
        reports = evaluated_as_the_asset_does(target_model, (oracle(references), untrained), [prompt], 12)
    for report in reports:
        (result,) = report.prompts
        assert result.greedy_ids == references[tuple(prompt)][:12]  # the plain path keeps the top token
        d = result.divergence
        assert d is not None and d.position == at and result.lossless is False
        assert d.greedy == references[tuple(prompt)][at] and result.spec.output_ids[at] == d.speculative != d.greedy
        assert d.logit_gap is not None and d.logit_gap > 0  # the greedy token above the speculative one
        if kind == "wide":
            assert d.logit_gap == pytest.approx(1.0, abs=1e-5)
        assert d.tie is (kind == "tie") and result.lossless_up_to_ties is (kind == "tie")
        assert report.totals()["mismatched_at_ties"] == (1 if kind == "tie" else 0)
    outcome = drafter_beats_floor(SpeculativeQuality(reports[0], reports[1]).figures(), margin=-math.inf)
    if kind == "tie":
        assert outcome.passed and "lossless up to 2 tie(s)" in outcome.description
    else:
        assert not outcome.passed and "NOT lossless" in outcome.description


def test_the_forward_shapes_round_apart_by_less_than_the_tie_tolerance_and_a_wrong_verify_shows(target_model, prompts):
    """The figure TIE_EPS rests on: on the float32 stand-in, the plain forward, one-token steps and a 4-token verify
    give the same rows within a few eps, and the same top tokens; a verify forward that shifts its rows (a wrong
    mask) is far outside it."""
    sequence = prompts[0] + [5, 6, 7, 8]
    figures = forward_shape_rounding(target_model, sequence, 4)
    assert figures["rows"] == 4 and figures["argmax_flips"] == 0
    assert figures["max_eps"] < TIE_EPS
    with verify_forwards_corrupted(target_model):
        corrupted = forward_shape_rounding(target_model, sequence, 4)
    assert corrupted["max_eps"] > 1000 * TIE_EPS and corrupted["argmax_flips"] > 0
    with pytest.raises(ValueError, match="need 0 < tokens"):
        forward_shape_rounding(target_model, sequence, len(sequence))
