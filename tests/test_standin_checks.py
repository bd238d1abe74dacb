"""Failures of the tiny stand-in target, said so: the three WARN checks it fails every time (`token_ids`'
`backend_ids_agree_with_text` and `separator_and_end_token`, `completions`' `truncated_share`) carry its note and
`standin: true` when the data is the stand-in's and the check failed, and nothing changes otherwise; `eagle3 status`
tags them `(stand-in)` under a one-line legend.

The oracle for "unchanged" is the check function's own outcome, computed here without the stand-in machinery.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from types import SimpleNamespace
from typing import Any

import dagster as dg
import polars as pl
import pytest
from test_status import dataset_line, home_with_yaml, widest
from test_token_checks import frame

from eagle3_assets.common.outcome import per_dataset
from eagle3_assets.common.per_dataset import SUMMARY_CHECK
from eagle3_assets.common.registry import DATASETS
from eagle3_assets.common.standin import STANDIN_NOTES, explained, is_standin_target
from eagle3_assets.money import SpendPolicy, open_ledger
from eagle3_assets.operations.quality import board_markdown
from eagle3_assets.operations.status import as_json, gather_status, render_text
from eagle3_assets.stages.completions.asset import completions
from eagle3_assets.stages.completions.checks import COMPLETION_CHECKS
from eagle3_assets.stages.completions.run import COMPLETION_COLUMNS
from eagle3_assets.stages.raw_prompts.asset import raw_prompts
from eagle3_assets.stages.token_ids.asset import token_ids
from eagle3_assets.stages.token_ids.checks import TOKEN_CHECKS
from eagle3_resources.completions.resource import CompletionsResource
from eagle3_resources.storage import DataStore
from eagle3_resources.target.resource import TargetModelResource
from eagle3_resources.target.standin import standin_config
from eagle3_resources.tokenizer.resource import TokenizerResource

EXPLAINED = {
    "backend_ids_agree_with_text": TOKEN_CHECKS,
    "separator_and_end_token": TOKEN_CHECKS,
    "truncated_share": COMPLETION_CHECKS,
}
SEP, END = 163607, 163586
SPECIAL = re.compile(r"<\|[^|<>\s]+\|>|</?think>")


def failing_frames() -> dict[str, pl.DataFrame]:
    """Data each explained check fails on (and the others pass on, but for no_duplicates on completions)."""
    good: list[dict[str, Any]] = [{}] * 20
    ids = frame(good + [{"ids_match": False, "n_separators": 0}] * 5)
    answers = pl.DataFrame(
        [{"prompt_id": f"p{i}", "dataset": "T", "status": "truncated" if i < 5 else "ok"} for i in range(20)]
    )
    return {"backend_ids_agree_with_text": ids, "separator_and_end_token": ids, "truncated_share": answers}


def outcomes(check: str, df: pl.DataFrame, standin: bool):
    return explained(per_dataset({check: EXPLAINED[check][check]}, {"T": df}), standin)["T"][check]


# -- the notes -----------------------------------------------------------------------------------------------


def test_every_note_names_a_warn_check_the_stand_in_and_a_real_targets_failure():
    assert set(STANDIN_NOTES) == set(EXPLAINED)
    for name, note in STANDIN_NOTES.items():
        assert EXPLAINED[name][name][1] == "WARN", name  # an ERROR is never explained away
        assert note.startswith("Expected of the tiny stand-in target (8 layers, hidden 64), which "), name
        assert "on a real target this fails only if " in note, name
        assert not SPECIAL.findall(re.sub(r"`[^`]*`", "", note)), name  # special tokens quoted (the UI's markdown)


def test_the_notes_figures_are_the_stand_ins():
    fake_tokenizer = SimpleNamespace(vocab_size=163840, token_id=lambda token: 0)
    config = standin_config(fake_tokenizer)  # type: ignore[arg-type]  # the config reads only these two
    assert (config.num_hidden_layers, config.hidden_size) == (8, 64)


# -- the check outcomes, with and without the stand-in --------------------------------------------------------


@pytest.mark.parametrize("check", list(EXPLAINED))
def test_a_failure_names_the_stand_in_only_when_the_data_is_the_stand_ins(check):
    df = failing_frames()[check]
    fn = EXPLAINED[check][check][0]
    plain = fn(df)
    assert not plain.passed

    real = outcomes(check, df, standin=False)
    assert real == plain  # description and metadata as the check wrote them
    assert "stand-in" not in real.description and "standin" not in real.metadata

    ours = outcomes(check, df, standin=True)
    assert not ours.passed
    assert ours.description == f"{plain.description}. {STANDIN_NOTES[check]}"
    assert ours.metadata == {**plain.metadata, "standin": True}
    assert plain.metadata.get("standin") is None  # the check's own outcome is not changed in place


@pytest.mark.parametrize("check", list(EXPLAINED))
def test_a_passing_check_keeps_its_text_on_the_stand_in(check):
    good = {
        "backend_ids_agree_with_text": frame([{}] * 20),
        "separator_and_end_token": frame([{}] * 20),
        "truncated_share": pl.DataFrame([{"prompt_id": f"p{i}", "dataset": "T", "status": "ok"} for i in range(20)]),
    }[check]
    plain = EXPLAINED[check][check][0](good)
    assert plain.passed
    assert outcomes(check, good, standin=True) == plain


def test_other_failing_checks_are_not_explained_by_the_stand_in():
    df = frame([{}] * 20 + [{"completion_len_diff": 500, "n_leaked_specials": 2, "prompt_len_diff": 3}])
    for standin in (False, True):
        got = explained(per_dataset(TOKEN_CHECKS, {"T": df}), standin)["T"]
        for name in ("billed_completion_tokens_match", "no_leaked_special_tokens", "prompt_tokens_match"):
            plain = TOKEN_CHECKS[name][0](df)
            assert not plain.passed and got[name] == plain, name


@pytest.mark.parametrize(
    ("backend", "target_path", "standin"),
    [
        ("local", None, True),
        ("local", "/models/kimi-k2.5", False),
        ("openrouter", None, False),
        ("sglang", None, False),
        ("sglang", "/models/kimi-k2.5", False),
    ],
)
def test_only_the_local_backend_without_a_target_path_is_the_stand_in(backend, target_path, standin, monkeypatch):
    monkeypatch.delenv("EAGLE3_COMPLETIONS_BACKEND", raising=False)
    resources = CompletionsResource(backend=backend), TargetModelResource(path=target_path, standin_dir="/unused")
    assert is_standin_target(*resources) is standin
    df = failing_frames()["backend_ids_agree_with_text"]
    got = explained(per_dataset(TOKEN_CHECKS, {"T": df}), is_standin_target(*resources))["T"]
    for name, (fn, _) in TOKEN_CHECKS.items():
        if not standin:  # a real target's configuration: every description and metadata unchanged
            assert got[name] == fn(df), name
    assert ("stand-in" in got["backend_ids_agree_with_text"].description) is standin


def test_the_backend_setting_from_the_environment_counts(monkeypatch):
    monkeypatch.setenv("EAGLE3_COMPLETIONS_BACKEND", "openrouter")
    assert not is_standin_target(CompletionsResource(), TargetModelResource(standin_dir="/unused"))
    monkeypatch.setenv("EAGLE3_COMPLETIONS_BACKEND", "local")
    assert is_standin_target(CompletionsResource(), TargetModelResource(standin_dir="/unused"))


# -- the assets' wiring, and `eagle3 status` ----------------------------------------------------------------


def completion_rows(tok, dataset: str) -> pl.DataFrame:
    """Answers as the stand-in gives them: most right, some without `</think>` in ids split unlike the text's."""
    canonical = tok.encode("abc") + [SEP] + tok.encode("def") + [END]
    odd = tok.encode("ab") + tok.encode("c") + tok.encode("def") + [END]  # no separator, a non-canonical split
    base = {c: None for c in COMPLETION_COLUMNS}
    rows = []
    for i in range(12):
        ids = odd if i < 3 else canonical
        rows.append(
            dict(
                base,
                prompt_id=f"{dataset}-{i}",
                dataset=dataset,
                status="ok",
                provider="transformers",
                finish_reason="stop",
                reasoning="abc",
                content="def",
                completion_ids=ids,
                prompt_ids=[1, 2, 3],
                attempts=1,
                cost_usd=0.0,
                messages_json="[]",
            )
        )
    return pl.DataFrame(rows, schema=COMPLETION_COLUMNS)


def materialize_token_ids(instance, data_dir, tok, target_path: str | None, dataset: str = "B8"):
    path = data_dir / "completions" / f"{dataset}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    completion_rows(tok, dataset).write_parquet(path)
    standin = str(data_dir / "standin")
    result = dg.materialize(
        [token_ids],
        partition_key=dataset,
        instance=instance,
        resources={
            "store": DataStore(root=str(data_dir)),
            "tokenizer": TokenizerResource(standin_dir=standin),
            # token_ids never loads the target: a path only says the completions came from a real one
            "target": TargetModelResource(path=target_path, standin_dir=standin),
            "completions_backend": CompletionsResource(backend="local"),  # type: ignore[arg-type]
        },
    )
    assert result.success
    return {  # the dataset's own checks (`all_datasets` sums them up for the asset's page)
        e.asset_check_evaluation_data.check_name: e.asset_check_evaluation_data
        for e in result.all_events
        if e.event_type_value == "ASSET_CHECK_EVALUATION" and e.asset_check_evaluation_data.check_name != SUMMARY_CHECK
    }


@pytest.fixture
def data_dir_with_tokenizer(tmp_path, standin_dir, tok):
    root = tmp_path / "data"
    shutil.copytree(standin_dir, root / "standin", ignore=shutil.ignore_patterns("target-*"))
    return root


@pytest.mark.timeout(600)
@pytest.mark.parametrize("target_path", [None, "/models/kimi-k2.5"], ids=["stand-in", "real target"])
def test_token_ids_and_status_say_which_failures_are_the_stand_ins(
    tmp_path, data_dir_with_tokenizer, tok, monkeypatch, target_path
):
    monkeypatch.setenv("DAGSTER_HOME", str(home_with_yaml(tmp_path)))
    monkeypatch.delenv("EAGLE3_COMPLETIONS_BACKEND", raising=False)
    standin = target_path is None
    with dg.DagsterInstance.get() as instance:
        evaluations = materialize_token_ids(instance, data_dir_with_tokenizer, tok, target_path)
        status = gather_status(instance, open_ledger(DataStore(root=str(data_dir_with_tokenizer)).layout))

    frames = {"B8": pl.read_parquet(data_dir_with_tokenizer / "token_ids" / "B8.parquet")}
    plain = per_dataset(TOKEN_CHECKS, frames)["B8"]  # the oracle: the check functions on what is on disk
    assert {n for n, o in plain.items() if not o.passed} == {"backend_ids_agree_with_text", "separator_and_end_token"}
    for name, ev in evaluations.items():
        expected = plain[name].description
        if standin and not plain[name].passed:
            expected += f". {STANDIN_NOTES[name]}"
        assert ev.passed == plain[name].passed and ev.description == f"B8: {expected}", name
        assert ("standin" in ev.metadata) is (standin and not plain[name].passed), name

    text = render_text(status)
    print(text)
    assert widest(text) <= 120
    failing_line = next(line for line in text.splitlines() if line.strip().startswith("failing: token_ids:"))
    tag = " (stand-in)" if standin else ""
    assert failing_line.strip() == (
        f"failing: token_ids: WARN backend_ids_agree_with_text{tag}, WARN separator_and_end_token{tag}"
    )
    assert "2 WARN" in dataset_line(text, "B8")
    legend = [line for line in text.splitlines() if line.startswith("(stand-in) ")]
    if standin:
        assert legend == [
            "(stand-in) expected of the tiny stand-in target (8 layers, hidden 64), not a fault; "
            "each check's description says why"
        ]
        assert text.index(failing_line) < text.index(legend[0]) < text.index("\nstage ")  # under the dataset table
    else:
        assert legend == [] and "stand-in" not in text

    board = board_markdown(status)  # `pipeline_status` in the UI: the same tags
    assert ("`backend_ids_agree_with_text` (stand-in), `separator_and_end_token` (stand-in)" in board) is standin
    assert "`backend_ids_agree_with_text`, `separator_and_end_token`" in board or standin

    doc = json.loads(json.dumps(as_json(status)))
    shown = doc["datasets"]["B8"]["token_ids"]
    assert sorted(shown["failing"]) == ["WARN backend_ids_agree_with_text", "WARN separator_and_end_token"]
    assert {n for n, c in shown["checks"].items() if c["standin"]} == (
        {"backend_ids_agree_with_text", "separator_and_end_token"} if standin else set()
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("configured", [False, True], ids=["stand-in", "its folder as a configured target"])
def test_completions_truncated_share_names_the_stand_in_only_for_the_stand_in(
    data_dir_with_standin, target_resource, tokenizer_resource, monkeypatch, configured
):
    """The stand-in answers with `max_tokens` 2: every answer is cut. Configured by path, the same model is a real
    target as far as the pipeline knows: the check's text is its own."""
    monkeypatch.delenv("EAGLE3_COMPLETIONS_BACKEND", raising=False)
    monkeypatch.setitem(DATASETS, "A1", dataclasses.replace(DATASETS["A1"], sample_cap=4))
    standin = str(data_dir_with_standin / "standin")
    folder = target_resource.folder(tokenizer_resource)
    with dg.instance_for_test() as instance:
        result = dg.materialize(
            [raw_prompts, completions],
            partition_key="A1",
            instance=instance,
            resources={
                "store": DataStore(root=str(data_dir_with_standin)),
                "tokenizer": TokenizerResource(standin_dir=standin),
                "target": TargetModelResource(path=str(folder) if configured else None, standin_dir=standin),
                "completions_backend": CompletionsResource(backend="local"),  # type: ignore[arg-type]
                "spend_policy": SpendPolicy(),
            },
            run_config={"ops": {"completions": {"config": {"max_tokens": 2, "pilot_size": 0}}}},
        )
    assert result.success
    evaluations = {
        e.asset_check_evaluation_data.check_name: e.asset_check_evaluation_data
        for e in result.all_events
        if e.event_type_value == "ASSET_CHECK_EVALUATION"
        and e.asset_check_evaluation_data.asset_key == dg.AssetKey("completions")
    }
    answers = pl.read_parquet(data_dir_with_standin / "completions" / "A1.parquet")
    assert answers.height == 4 and set(answers["status"]) == {"truncated"}
    plain = COMPLETION_CHECKS["truncated_share"][0](answers)
    cut = evaluations["truncated_share"]
    assert not cut.passed and not plain.passed
    expected = plain.description if configured else f"{plain.description}. {STANDIN_NOTES['truncated_share']}"
    assert cut.description == f"A1: {expected}"
    assert ("standin" in cut.metadata) is not configured
    for name in ("complete", "error_rate"):  # passing: their text as ever
        assert evaluations[name].passed and "stand-in" not in (evaluations[name].description or ""), name
