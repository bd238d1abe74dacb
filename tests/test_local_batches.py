"""The local backend's batches: prompts of very different lengths generate in separate padded groups
(`prompt_groups`), and a prompt's completion is the same whichever prompts share its batch."""

from __future__ import annotations

import asyncio
import itertools

import torch

from eagle3_resources.completions import local_generate
from eagle3_resources.completions.local import TransformersBackend
from eagle3_resources.completions.local_generate import (
    Decoding,
    InverseCdfSampler,
    generate_padded,
    generate_rows,
    prompt_seed,
)
from eagle3_resources.completions.prompt_groups import GenerationCost, prompt_groups
from eagle3_resources.completions.types import CompletionRequest, SamplingSettings

B8_PILOT = [269, 4435, 1205, 198, 1756, 232, 1011, 1280]  # the first command's B8 pilot, prompt tokens


def brute_force(lengths: list[int], steps: int, cost: GenerationCost) -> float:
    """The least cost of any split of the rows into groups (every set partition, not only runs of sorted lengths)."""

    def partitions(items):
        if not items:
            yield []
            return
        first, rest = items[0], items[1:]
        for part in partitions(rest):
            yield [[first], *part]
            for i in range(len(part)):
                yield [*part[:i], [first, *part[i]], *part[i + 1 :]]

    return min(
        sum(cost.batch(len(g), max(lengths[i] for i in g), steps) for g in p)
        for p in partitions(list(range(len(lengths))))
    )


def test_a_long_prompt_generates_apart_and_similar_prompts_together():
    cost = GenerationCost()
    groups = prompt_groups(B8_PILOT, 160)
    assert groups[0] == [1]  # the 4,435-token prompt alone
    assert sorted(itertools.chain(*groups)) == list(range(8))
    assert prompt_groups([120, 130, 300, 90, 200, 150, 110, 100], 160) == [list(range(8))]
    assert prompt_groups([20, 300, 20, 20], 160) == [[0, 1, 2, 3]]  # short prompts: the step's fixed cost rules
    one = cost.batch(8, max(B8_PILOT), 160)
    split = sum(cost.batch(len(g), max(B8_PILOT[i] for i in g), 160) for g in groups)
    assert split < 0.7 * one
    # no split of the rows, sorted runs or any other, costs less
    for lengths in (B8_PILOT, [20, 300, 20, 20], [4000, 3900, 100, 90, 2000, 50]):
        got = prompt_groups(lengths, 160)
        assert (
            abs(sum(cost.batch(len(g), max(lengths[i] for i in g), 160) for g in got) - brute_force(lengths, 160, cost))
            < 1e-9
        )


def answer(ids: list[int]) -> list[int]:
    """The ids up to the first end token (a batch pads the rows that ended before the others)."""
    end = next((i for i, t in enumerate(ids) if t in (163585, 163586)), len(ids) - 1)
    return ids[: end + 1]


def test_a_prompt_generates_the_same_tokens_in_a_mixed_batch_and_alone(tok, target_model):
    prompts = [list(range(1000, 1000 + n)) for n in (12, 1200, 40, 9, 1100, 30)]  # two groups of very different lengths
    decoding = Decoding.of(SamplingSettings(max_tokens=32, temperature=1.0, top_p=0.95, seed=0), tok)
    seeds = [prompt_seed(7, f"p{i}") for i in range(len(prompts))]
    assert len(prompt_groups([len(p) for p in prompts], decoding.max_tokens)) > 1
    together = [answer(ids) for ids in generate_rows(target_model, prompts, decoding, seeds)]
    alone = [answer(generate_padded(target_model, [p], decoding, [s])[0]) for p, s in zip(prompts, seeds, strict=True)]
    assert together == alone
    assert len({tuple(ids) for ids in together}) > 1  # not every row the same text


def test_a_rows_draws_depend_on_its_own_seed_alone():
    """Per-row seeds: a row samples the same tokens beside any other rows, at any place in the batch (the stand-in
    is too peaked for the model-level test above to see its draws)."""
    g = torch.Generator().manual_seed(0)
    together = InverseCdfSampler(1.0, 0.9, None, [11, 22, 33])
    alone = InverseCdfSampler(1.0, 0.9, None, [22])
    shared = InverseCdfSampler(1.0, 0.9, None, 22)  # one generator for the batch: row 1 draws after row 0
    differs = 0
    for _ in range(200):
        logits = torch.randn(3, 500, generator=g)
        row = together(None, logits.clone())[1].argmax()
        assert row == alone(None, logits[1:2].clone())[0].argmax()
        differs += int(row != shared(None, logits.clone())[1].argmax())
    assert differs > 50


def test_each_row_of_a_batch_is_seeded_by_its_prompt(tok, target_model, monkeypatch):
    seen: list[list[int]] = []

    class Spy(InverseCdfSampler):
        def __init__(self, *args, **kwargs):
            seen.append(list(args[3]))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(local_generate, "InverseCdfSampler", Spy)
    lengths = [12, 1200, 40, 9, 1100, 30]
    batch = [CompletionRequest(f"p{i}", [], None, list(range(1000, 1000 + n))) for i, n in enumerate(lengths)]
    backend = TransformersBackend(target_model, tok, batch_size=6, lanes=1)
    asyncio.run(backend._generate(batch, Decoding.of(SamplingSettings(max_tokens=32), tok), 5, 1))
    want = [[prompt_seed(5, f"p{i}") for i in g] for g in prompt_groups(lengths, 32)]
    assert sorted(seen) == sorted(want)
    assert len(seen) == 2
