"""Tool-call turns in `token_ids`: how the reasoning ended (explicit `</think>`, implicit, unknown) is settled by
the bill, and the ids are Kimi's, checked against HAND-WRITTEN expectations.

Kimi answers a prompt with tools by calling them: reasoning, then a tool-call section and `<|im_end|>`, no
content. The reasoning ends with `</think>` (explicit) or runs straight into `<|tool_calls_section_begin|>`
(implicit); the API's text is the same either way and only the billed completion count tells them apart.
Expected ids below are literal special-token ids (Kimi's table, ../shared/reference/kimi-k25.md) around the
tokenizer's plain encode of the text pieces; nothing here asks the project how a section is rendered.
"""

from __future__ import annotations

import json

import httpx
import polars as pl
import pytest
from fakes.openrouter import FakeOpenRouter, FakeSettings, ServerThread

from eagle3_assets.common.registry import DATASETS
from eagle3_assets.stages.completions.run import COMPLETION_COLUMNS, build_requests, completions_frame, run_completions
from eagle3_assets.stages.raw_prompts.prompts import prompts_frame, read_prompts
from eagle3_assets.stages.token_ids.reconstruct import _rebuilt_completion, build_token_ids
from eagle3_resources.completions.openrouter import OpenRouterBackend
from eagle3_resources.completions.types import SamplingSettings
from eagle3_resources.tokenizer.chat_format import TemplateVersion

# Kimi-K2.x special tokens, written out (not asked of the tokenizer under test).
THINK_END = 163607  # </think>
IM_END = 163586  # <|im_end|>
SECTION_BEGIN = 163595  # <|tool_calls_section_begin|>
SECTION_END = 163596  # <|tool_calls_section_end|>
CALL_BEGIN = 163597  # <|tool_call_begin|>
ARGUMENT_BEGIN = 163598  # <|tool_call_argument_begin|>
CALL_END = 163599  # <|tool_call_end|>

REASONING = "The user wants the weather in Paris, so I call the tool."
CALLS = [
    {
        "id": "functions.get_weather:0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    },
    {
        "id": "functions.get_weather:1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Lyon", "unit": "C"}'},
    },
]


def expected_ids(tok, reasoning: str, calls: list[dict], *, think_end: bool) -> list[int]:
    """Hand-written: enc(reasoning) [</think>] <section_begin> (<call_begin> enc(id) <arg_begin> enc(args)
    <call_end>)* <section_end> <im_end>."""
    ids = tok.encode(reasoning) + ([THINK_END] if think_end else []) + [SECTION_BEGIN]
    for call in calls:
        ids += [CALL_BEGIN] + tok.encode(call["id"]) + [ARGUMENT_BEGIN]
        ids += tok.encode(call["function"]["arguments"]) + [CALL_END]
    return ids + [SECTION_END, IM_END]


# ---------------------------------------------------------------- the reconstruction, unit level


@pytest.mark.parametrize("end_in_bill", [0, 1])  # the bill counts <|im_end|> (0) or not (1)
@pytest.mark.parametrize(
    ("kind", "bill_delta"),
    [("explicit", 0), ("implicit", -1), ("unknown", +1), ("unknown", -2)],
)
def test_rebuilt_tool_call_turn_is_settled_by_the_bill(tok, kind, bill_delta, end_in_bill):
    explicit = expected_ids(tok, REASONING, CALLS, think_end=True)
    billed = len(explicit) - end_in_bill + bill_delta
    rebuilt, think_end_kind = _rebuilt_completion(
        tok, tok.encode(REASONING), [], "tool_calls", CALLS, billed, end_in_bill
    )
    assert think_end_kind == kind
    # unknown: neither count fits, the explicit reading is kept (and the row's bill difference shows it)
    assert rebuilt == expected_ids(tok, REASONING, CALLS, think_end=kind != "implicit")


def test_a_tool_call_turn_with_content_or_without_a_bill_is_explicit_and_unlabelled(tok):
    with_content = _rebuilt_completion(
        tok, tok.encode("r"), tok.encode("Checking."), "tool_calls", CALLS[:1], 3, 0
    )  # a bill that would fit "implicit" is not asked: content was written, so </think> was
    assert with_content == (
        tok.encode("r")
        + [THINK_END]
        + tok.encode("Checking.")
        + [SECTION_BEGIN, CALL_BEGIN]
        + tok.encode("functions.get_weather:0")
        + [ARGUMENT_BEGIN]
        + tok.encode('{"city": "Paris"}')
        + [CALL_END, SECTION_END, IM_END],
        None,
    )
    no_bill = _rebuilt_completion(tok, tok.encode(REASONING), [], "tool_calls", CALLS, None, 0)
    assert no_bill == (expected_ids(tok, REASONING, CALLS, think_end=True), None)


def completion_rows(rows: list[dict]) -> pl.DataFrame:
    base = {c: None for c in COMPLETION_COLUMNS}
    full = [
        {
            **base,
            "dataset": "T",
            "status": "ok",
            "cost_usd": 0.0,
            "attempts": 1,
            "prompt_ids": [1, 2, 3],
            "messages_json": "[]",
            **r,
        }
        for r in rows
    ]
    return pl.DataFrame(full, schema=COMPLETION_COLUMNS)


def test_token_ids_rows_of_tool_call_turns(tok):
    """build_token_ids from stored completions rows (`tool_calls_json`): ids, the label, the proof columns."""
    explicit = expected_ids(tok, REASONING, CALLS, think_end=True)
    implicit = expected_ids(tok, REASONING, CALLS, think_end=False)
    row = {"reasoning": REASONING, "content": "", "finish_reason": "tool_calls", "tool_calls_json": json.dumps(CALLS)}
    df = build_token_ids(
        completion_rows(
            [
                {**row, "prompt_id": "explicit", "completion_tokens": len(explicit)},
                {**row, "prompt_id": "implicit", "completion_tokens": len(implicit)},
                {**row, "prompt_id": "unknown", "completion_tokens": len(explicit) + 3},
            ]
        ),
        tok,
    )
    got = {r["prompt_id"]: r for r in df.iter_rows(named=True)}
    assert got["explicit"]["input_ids"] == [1, 2, 3] + explicit
    assert got["implicit"]["input_ids"] == [1, 2, 3] + implicit
    assert got["unknown"]["input_ids"] == [1, 2, 3] + explicit
    assert [got[k]["tool_call_think_end"] for k in ("explicit", "implicit", "unknown")] == [
        "explicit",
        "implicit",
        "unknown",
    ]
    assert [got[k]["completion_len_diff"] for k in ("explicit", "implicit", "unknown")] == [0, 0, -3]
    assert [got[k]["n_separators"] for k in ("explicit", "implicit", "unknown")] == [1, 0, 1]
    assert all(r["has_end"] and r["n_leaked_specials"] == 0 for r in got.values())
    assert got["implicit"]["loss_mask"] == [0, 0, 0] + [1] * len(implicit)


# ---------------------------------------------------------------- the fake provider's tool-call answers

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_the_fake_answers_a_prompt_with_tools_in_openais_tool_call_shape(tok):
    """Non-streaming: message.tool_calls [{id, type, function {name, arguments}}], no content, reasoning,
    finish_reason tool_calls, and a bill equal to the hand-written ids' count; a prompt without tools gets text."""
    fake = FakeOpenRouter(tok, FakeSettings(api_key="k", rate_tool_calls=1.0))
    with ServerThread(fake.app) as server, httpx.Client(base_url=f"{server.base_url}/api/v1", timeout=30) as client:

        def ask(**body):
            r = client.post(
                "/chat/completions",
                json={"model": "moonshotai/kimi-k2.5", "messages": ASK, **body},
                headers={"Authorization": "Bearer k"},
            )
            assert r.status_code == 200
            return r.json()

        called, plain = ask(tools=TOOLS), ask()
    choice = called["choices"][0]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and msg["content"] is None and msg["reasoning"]
    (call,) = msg["tool_calls"]
    assert call["id"] == "functions.get_weather:0" and call["type"] == "function"
    assert call["function"]["name"] == "get_weather" and set(json.loads(call["function"]["arguments"])) == {"city"}
    assert called["usage"]["completion_tokens"] == len(expected_ids(tok, msg["reasoning"], [call], think_end=True))
    assert plain["choices"][0]["finish_reason"] == "stop" and "tool_calls" not in plain["choices"][0]["message"]


# ---------------------------------------------------------------- end to end: the fake provider calls tools


def tool_call_turns(tok, tmp_path, ledger, *, stream: bool, **settings) -> tuple[pl.DataFrame, FakeOpenRouter]:
    """A2's prompts that declare tools, answered with two tool calls each by the fake provider, through the
    OpenRouter client, the journal and `completions_frame`, into `build_token_ids`."""
    fake = FakeOpenRouter(tok, FakeSettings(api_key="k", rate_tool_calls=1.0, tool_calls_per_answer=2, **settings))
    prompts = prompts_frame(read_prompts(DATASETS["A2"]), "A2")
    requests = [r for r in build_requests(prompts, tok, TemplateVersion.K2_5, True) if r.tools][:4]
    assert len(requests) == 4
    with ServerThread(fake.app) as server:
        run_completions(
            "A2",
            requests,
            OpenRouterBackend(f"{server.base_url}/api/v1", "k", stream=stream),
            SamplingSettings(max_tokens=4096),
            tmp_path / "A2.jsonl",
            ledger=ledger,
            log=lambda m: None,
        )
    completions = completions_frame("A2", requests, tmp_path / "A2.jsonl", prompts)
    assert completions["finish_reason"].to_list() == ["tool_calls"] * 4  # every one answered with tool calls
    return completions.join(build_token_ids(completions, tok), on="prompt_id"), fake


@pytest.mark.parametrize(
    ("kind", "settings"),
    [
        ("explicit", {"stream": True}),
        ("implicit", {"stream": False, "rate_implicit_think_end": 1.0}),
        ("implicit", {"stream": True, "rate_implicit_think_end": 1.0}),
        ("unknown", {"stream": True, "completion_token_offset": 2}),  # a bill neither reading fits
    ],
)
def test_tool_call_turns_from_the_fake_provider_come_back_as_kimi_generated_them(tok, tmp_path, ledger, kind, settings):
    df, fake = tool_call_turns(tok, tmp_path, ledger, **settings)
    for row in df.iter_rows(named=True):
        answer = fake.generated(row["generation_id"])  # what the provider generated, not what the client kept
        assert answer.tool_calls is not None and len(answer.tool_calls) == 2 and answer.content == ""
        assert answer.think_end == (kind != "implicit")
        want = expected_ids(tok, answer.reasoning, answer.tool_calls, think_end=kind != "implicit")
        assert row["input_ids"] == row["prompt_ids"] + want
        assert row["tool_call_think_end"] == kind
        assert row["completion_len_diff"] == (-2 if kind == "unknown" else 0) and row["prompt_len_diff"] == 0
        assert row["n_separators"] == (0 if kind == "implicit" else 1)
        assert row["has_end"] and row["n_leaked_specials"] == 0 and row["tools_in_request"] == "tools_field"
