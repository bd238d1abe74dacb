import polars as pl

from eagle3_assets.stages.completions.run import COMPLETION_COLUMNS
from eagle3_assets.stages.token_ids.reconstruct import (
    build_token_ids,
    reconstruct_completion,
    token_ids_summary,
)

SEP, END = 163607, 163586


def completion_rows(rows):
    base = {c: None for c in COMPLETION_COLUMNS}
    full = []
    for r in rows:
        row = dict(base, dataset="T1", status="ok", cost_usd=0.0, attempts=1, prompt_ids=[1, 2, 3], messages_json="[]")
        row.update(r)
        full.append(row)
    return pl.DataFrame(full, schema=COMPLETION_COLUMNS)


def test_normal_completion(tok):
    ids = reconstruct_completion(tok, tok.encode("think"), tok.encode("answer"), "stop", None)
    assert ids == tok.encode("think") + [SEP] + tok.encode("answer") + [END]


def test_length_inside_reasoning_has_no_separator_or_end(tok):
    assert reconstruct_completion(tok, tok.encode("half a thought"), [], "length", None) == tok.encode("half a thought")


def test_length_inside_content_has_separator_but_no_end(tok):
    ids = reconstruct_completion(tok, tok.encode("r"), tok.encode("partial"), "length", None)
    assert ids.count(SEP) == 1 and ids[-1] != END


def test_structured_tool_calls_become_special_markers(tok):
    calls = [{"id": "functions.get_x:0", "type": "function", "function": {"name": "get_x", "arguments": '{"a": 1}'}}]
    ids = reconstruct_completion(tok, tok.encode("r"), [], "tool_calls", calls)
    assert ids[-1] == END and 163595 in ids and 163597 in ids and 163598 in ids and 163599 in ids and 163596 in ids
    assert tok.decode(ids).endswith(
        "<|tool_call_begin|>functions.get_x:0"
        '<|tool_call_argument_begin|>{"a": 1}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
    )


def test_raw_tool_markers_in_content_map_to_special_ids_but_think_in_prose_does_not(tok):
    content = (
        "Use </think> literally. "
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
        "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>"
    )
    df = build_token_ids(
        completion_rows(
            [
                {
                    "prompt_id": "a",
                    "reasoning": "r",
                    "content": content,
                    "finish_reason": "stop",
                    "completion_tokens": None,
                }
            ]
        ),
        tok,
    )
    ids = df["input_ids"][0].to_list()[3:]
    assert ids.count(SEP) == 1  # only the real separator; the prose one is text
    assert 163595 in ids and 163599 in ids


def test_backend_ids_are_kept_and_checked(tok):
    good = tok.encode("abc") + [SEP] + tok.encode("def") + [END]
    odd = tok.encode("ab") + tok.encode("c") + [SEP] + tok.encode("def") + [END]  # a non-canonical split
    df = build_token_ids(
        completion_rows(
            [
                {
                    "prompt_id": "a",
                    "reasoning": "abc",
                    "content": "def",
                    "finish_reason": "stop",
                    "completion_ids": good,
                    "completion_tokens": len(good),
                },
                {
                    "prompt_id": "b",
                    "reasoning": "abc",
                    "content": "def",
                    "finish_reason": "stop",
                    "completion_ids": odd,
                    "completion_tokens": len(odd),
                },
            ]
        ),
        tok,
    )
    assert df["ids_match"].to_list() == [True, tok.encode("ab") + tok.encode("c") == tok.encode("abc")]
    assert df["input_ids"][1].to_list()[3:] == odd  # what the model generated is what it trains on
    assert df["loss_mask"][0].to_list() == [0, 0, 0] + [1] * len(good)


def test_loss_mask_setting_and_billed_difference(tok):
    comp = tok.encode("x") + [SEP] + tok.encode("y") + [END]
    rows = completion_rows(
        [
            {
                "prompt_id": "a",
                "reasoning": "x",
                "content": "y",
                "finish_reason": "stop",
                "completion_tokens": len(comp) + 2,
                "prompt_tokens": 3,
            }
        ]
    )
    df = build_token_ids(rows, tok, mask_im_end=False)
    assert df["loss_mask"][0].to_list()[-1] == 0 and df["loss_mask"][0].to_list()[-2] == 1
    assert df["completion_len_diff"][0] == -2 and df["prompt_len_diff"][0] == 0
    s = token_ids_summary(df)
    assert s["normal_with_one_separator_pct"] == 100.0 and s["billed_completion_diff_pct"] == round(
        -200 / (len(comp) + 2), 4
    )


def test_failed_rows_are_not_samples(tok):
    df = build_token_ids(
        completion_rows(
            [
                {"prompt_id": "a", "status": "failed", "error": "x"},
                {"prompt_id": "b", "reasoning": "r", "content": "c", "finish_reason": "stop"},
            ]
        ),
        tok,
    )
    assert df["prompt_id"].to_list() == ["b"]


def test_cut_right_after_the_separator_is_told_apart_by_the_bill(tok):
    r = tok.encode("a full thought")
    cut_inside = build_token_ids(
        completion_rows(
            [
                {
                    "prompt_id": "a",
                    "reasoning": "a full thought",
                    "content": "",
                    "finish_reason": "length",
                    "completion_tokens": len(r),
                }
            ]
        ),
        tok,
    )
    cut_after = build_token_ids(
        completion_rows(
            [
                {
                    "prompt_id": "a",
                    "reasoning": "a full thought",
                    "content": "",
                    "finish_reason": "length",
                    "completion_tokens": len(r) + 1,
                }
            ]
        ),
        tok,
    )
    assert cut_inside["input_ids"][0].to_list()[3:] == r
    assert cut_after["input_ids"][0].to_list()[3:] == r + [SEP] and cut_after["completion_len_diff"][0] == 0
