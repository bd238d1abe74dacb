"""The stand-in target against the pilot every dataset runs first: the README's first command depends on both.

The pilot is a blocking check: one dataset whose pilot fails stops the whole first run. So every
dataset's pilot is run here as the `completions` asset runs it (the embedded prompts in the
registry's order, the first `pilot_size`, the local backend with the asset's settings, the same
`pilot_outcome`), against the stand-in the session builds, and must pass with room to spare.
And the fit must give the same weights whatever torch thread count the load picked before it.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from eagle3_assets.common.registry import DATASETS
from eagle3_assets.stages.completions.asset import CompletionsConfig
from eagle3_assets.stages.completions.pilot import MIN_ANSWER_SHARE, MIN_OK_SHARE, pilot_outcome
from eagle3_assets.stages.completions.run import build_requests, completions_frame, run_completions
from eagle3_assets.stages.raw_prompts.importers.build import build_prompt_sets
from eagle3_assets.stages.raw_prompts.importers.importer import PromptLength
from eagle3_assets.stages.raw_prompts.prompts import prompts_frame
from eagle3_assets.stages.token_ids.reconstruct import build_token_ids
from eagle3_resources.completions.local import TransformersBackend
from eagle3_resources.completions.resource import BackendKind, CompletionsResource
from eagle3_resources.target.standin import build_standin_target
from eagle3_resources.tokenizer.chat_format import TemplateVersion, render_messages
from eagle3_resources.tokenizer.resource import standin_corpus_files
from eagle3_resources.tokenizer.standin import corpus_strings


@pytest.mark.slow
def test_every_dataset_pilot_passes_on_the_standin_with_margin(tok, target_model, tmp_path, ledger):
    config = CompletionsConfig()
    settings = config.settings(BackendKind.LOCAL)
    backend = CompletionsResource(backend=BackendKind.LOCAL).make_backend(tok, lambda: target_model, log=lambda m: None)
    assert isinstance(backend, TransformersBackend)
    length = PromptLength(
        render=lambda m, t: render_messages(m, t, version=TemplateVersion.K2_5, thinking=True),
        count=lambda text: len(tok.encode(text, allow_special=True)),
    )
    sets = build_prompt_sets(list(DATASETS), DATASETS, mode="sample", length=length, log=lambda m: None)
    assert list(sets) == list(DATASETS) and len(sets) == 10
    figures = {}
    for name, result in sets.items():
        df = prompts_frame(result.prompts, name).head(config.pilot_size)
        requests = build_requests(df, tok, TemplateVersion.K2_5, True, send_tools=config.send_tools)
        journal = tmp_path / f"{name}.jsonl"
        run_completions(name, requests, backend, settings, journal, ledger=ledger, log=lambda m: None)
        frame = completions_frame(name, requests, journal, df)
        outcome = pilot_outcome(frame, build_token_ids(frame, tok))
        figures[name] = (
            outcome.passed,
            outcome.metadata["pilot_requests"],
            outcome.metadata["ok"],
            outcome.metadata["ok_with_final_answer"],
            outcome.description,
        )
    print(figures)
    n = config.pilot_size
    for name, (passed, requests, ok, answered, description) in figures.items():
        assert passed, f"{name}: {description}"
        assert requests == n
        # Margin: the pilot needs MIN_OK_SHARE of the 8 ok (4); ask for 3/4 of them (6), and for
        # answers after `</think>` in at least half again the share the pilot needs.
        assert ok >= math.ceil(0.75 * n) > math.ceil(MIN_OK_SHARE * n), (name, ok, description)
        assert answered >= math.ceil(1.5 * MIN_ANSWER_SHARE * ok), (name, answered, ok, description)


@pytest.mark.slow
def test_fit_gives_the_same_weights_whatever_torch_thread_count_came_before(tok, tmp_path):
    """The fit fixes its own thread count: fitted after torch was set to 1 or to 2 threads (what
    the load rule picks on a busy or an idle 2-core machine), the weights are bit for bit the same,
    and torch's setting is given back afterwards."""
    texts = list(corpus_strings(standin_corpus_files("data/prompts")))
    weights = {}
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            folder = build_standin_target(tmp_path / f"threads-{threads}", tok, texts, steps=12, log=print)
            assert torch.get_num_threads() == threads  # the later stages keep the load's choice
            weights[threads] = load_file(folder / "model.safetensors")
    finally:
        torch.set_num_threads(before)
    one, two = weights[1], weights[2]
    assert one.keys() == two.keys() and len(one) > 100
    differ = [k for k in one if not torch.equal(one[k], two[k])]
    assert differ == []
