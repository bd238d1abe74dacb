from typing import Any

import polars as pl

from eagle3_assets.stages.token_ids.checks import TOKEN_CHECKS

GOOD = {
    "dataset": "T",
    "finish_reason": "stop",
    "n_separators": 1,
    "has_end": True,
    "n_leaked_specials": 0,
    "tool_call_think_end": None,
    "billed_completion_tokens": 1000,
    "completion_len_diff": 0,
    "billed_prompt_tokens": 50,
    "prompt_len_diff": 0,
    "ids_source": "backend",
    "ids_match": True,
}


def frame(rows):
    return pl.DataFrame(
        [{"prompt_id": f"p{i}", **GOOD, **r} for i, r in enumerate(rows)],
        schema_overrides={"tool_call_think_end": pl.String},
    )


def outcome(name, df):
    return TOKEN_CHECKS[name][0](df)


def test_every_check_passes_on_good_data():
    df = frame([{}] * 200)
    for name in TOKEN_CHECKS:
        assert outcome(name, df).passed, name


def test_each_check_fails_on_crafted_bad_data():
    good: list[dict[str, Any]] = [{}] * 200
    assert not outcome("billed_completion_tokens_match", frame(good + [{"completion_len_diff": 100}])).passed
    assert outcome(
        "billed_completion_tokens_match", frame(good + [{"completion_len_diff": 1}])
    ).passed  # 1 in 201,000: within 0.04%
    bad = outcome("billed_completion_tokens_match", frame(good + [{"completion_len_diff": 100}]))
    assert bad.metadata["outliers"] == ["T/p200"] and bad.metadata["samples_with_diff"] == 1
    assert not outcome("prompt_tokens_match", frame(good + [{"prompt_len_diff": 3}])).passed
    assert not outcome("separator_and_end_token", frame(good + [{"n_separators": 0}] * 3)).passed
    assert not outcome("separator_and_end_token", frame(good + [{"has_end": False}] * 3)).passed
    assert outcome(
        "separator_and_end_token",
        frame(good + [{"n_separators": 0, "tool_call_think_end": "implicit", "finish_reason": "tool_calls"}] * 3),
    ).passed
    assert not outcome("no_leaked_special_tokens", frame(good + [{"n_leaked_specials": 2}])).passed
    assert not outcome("backend_ids_agree_with_text", frame(good + [{"ids_match": False}] * 3)).passed
