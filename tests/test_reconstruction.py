"""Exact ids: hand-checked renderings, canonical round trips (property tests), non-canonical flags."""

import json
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from fakes.openrouter import FakeOpenRouter, FakeSettings, ServerThread
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eagle3_assets.common.registry import DATASETS
from eagle3_assets.stages.completions.run import (
    COMPLETION_COLUMNS,
    build_requests,
    completions_frame,
    run_completions,
)
from eagle3_assets.stages.raw_prompts.prompts import prompts_frame, read_prompts
from eagle3_assets.stages.token_ids.reconstruct import build_token_ids
from eagle3_resources.completions.openrouter import OpenRouterBackend
from eagle3_resources.completions.types import SamplingSettings
from eagle3_resources.tokenizer.chat_format import TemplateVersion, render_messages

DATA = json.loads((Path(__file__).parent / "data" / "tool_conversation.json").read_text())
SEP, END = 163607, 163586
SECTION = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.lookup:0<|tool_call_argument_begin|>"
    '{"q": "x"}<|tool_call_end|><|tool_calls_section_end|>'
)


@pytest.mark.parametrize("version", ["k2.5", "k2"])
def test_tool_conversation_renders_to_the_hand_checked_ids(tok, version):
    expected: list[int] = []
    for seg in DATA["expected"][version]:
        expected += tok.encode(seg["text"]) if isinstance(seg, dict) else [tok.token_id(seg)]
    text = render_messages(DATA["messages"], DATA["tools"], version=TemplateVersion(version))
    assert tok.encode(text, allow_special=True) == expected


def completion_row(reasoning, content, finish="stop", billed=None, backend_ids=None):
    row: dict[str, Any] = {c: None for c in COMPLETION_COLUMNS}
    row.update(
        prompt_id="s",
        dataset="T",
        status="ok",
        finish_reason=finish,
        reasoning=reasoning,
        content=content,
        prompt_ids=[1, 2],
        cost_usd=0.0,
        attempts=1,
        completion_tokens=billed,
        completion_ids=backend_ids,
        messages_json="[]",
    )
    return pl.DataFrame([row], schema=COMPLETION_COLUMNS)


PIECES = (
    list("abcXYZ 019.,!?-_\n\t")
    + list("数据模型推理")
    + ["😀", "👩\u200d💻", "🇯🇵", "é", "ß", " the", "ing", "</think>", "<|im_end|>"]
)
TEXT = st.lists(st.sampled_from(PIECES), max_size=80).map("".join) | st.sampled_from(["", " ", "   \n\n  "])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reasoning=TEXT, content=TEXT, with_tool_call=st.booleans())
def test_canonical_sequences_come_back_exactly(tok, reasoning, content, with_tool_call):
    """encode -> decode as the API returns it -> reconstruct == the original ids, billed count equal."""
    if with_tool_call:
        content = content + SECTION
    original = (
        tok.encode(reasoning)
        + [SEP]
        + tok.encode(
            content,
            allow_special={
                m
                for m in [
                    "<|tool_calls_section_begin|>",
                    "<|tool_calls_section_end|>",
                    "<|tool_call_begin|>",
                    "<|tool_call_argument_begin|>",
                    "<|tool_call_end|>",
                ]
            },
        )
        + [END]
    )
    api_reasoning = tok.decode(original[: original.index(SEP)])
    api_content = tok.decode(original[original.index(SEP) + 1 : -1])
    df = build_token_ids(completion_row(api_reasoning, api_content, billed=len(original)), tok)
    row = df.row(0, named=True)
    assert row["input_ids"][2:] == original
    assert (
        row["completion_len_diff"] == 0
        and row["n_separators"] == 1
        and row["has_end"]
        and row["n_leaked_specials"] == 0
    )


@pytest.mark.parametrize("text", [" " * 25_010 + "x", "y" * 25_050, "\t" * 30_000, ("ab " * 9000) + " " * 26_000])
def test_runs_over_25000_characters_come_back_exactly(tok, text):
    original = tok.encode(text) + [SEP] + tok.encode("ok") + [END]
    df = build_token_ids(completion_row(tok.decode(tok.encode(text)), "ok", billed=len(original)), tok)
    assert df["input_ids"][0].to_list()[2:] == original and df["completion_len_diff"][0] == 0


def test_non_canonical_sequences_are_flagged_not_hidden(tok):
    canonical = tok.encode("Let me think about the weather") + [SEP] + tok.encode("It is sunny.") + [END]
    token = next(t for t in canonical if len(tok.encoding.decode_single_token_bytes(t)) >= 2)
    raw = tok.encoding.decode_single_token_bytes(token)
    split = (
        [tok.encoding.encode_single_token(raw[:1]), tok.encoding.encode_single_token(raw[1:])]
        if len(raw) == 2
        else [tok.encoding.encode_single_token(bytes([b])) for b in raw]
    )
    i = canonical.index(token)
    odd = canonical[:i] + split + canonical[i + 1 :]
    assert tok.decode(odd) == tok.decode(canonical)  # the same text: only the ids can tell
    df = build_token_ids(
        completion_row("Let me think about the weather", "It is sunny.", billed=len(odd), backend_ids=odd), tok
    )
    row = df.row(0, named=True)
    assert row["ids_match"] is False  # flagged
    assert row["input_ids"][2:] == odd  # and the generated ids are what is kept
    assert row["completion_len_diff"] == 0


def test_zero_billed_differences_against_the_fake_server(tok, tmp_path, ledger):
    fake = FakeOpenRouter(tok, FakeSettings(api_key="k"))
    frames = []
    with ServerThread(fake.app) as server:
        for name in ("A2", "B3", "B7"):  # tools, glaive function calls, Chinese/emoji/special strings in prose
            prompts = prompts_frame(read_prompts(DATASETS[name]), name)
            reqs = build_requests(prompts, tok, TemplateVersion.K2_5, True)
            run_completions(
                name,
                reqs,
                OpenRouterBackend(f"{server.base_url}/api/v1", "k"),
                SamplingSettings(max_tokens=4096),
                tmp_path / f"{name}.jsonl",
                ledger=ledger,
                log=print,
            )
            frames.append(build_token_ids(completions_frame(name, reqs, tmp_path / f"{name}.jsonl", prompts), tok))
    df = pl.concat(frames)
    assert df.height == 31 + 28 + 32
    assert (df["completion_len_diff"] == 0).all() and (df["prompt_len_diff"] == 0).all()
    assert df["text_roundtrip_ok"].is_null().all() and (df["n_separators"] == 1).all()  # ids came from the text
    assert set(df["tools_in_request"]) == {"tools_field", "none"}


def test_tools_can_be_left_out_of_the_request_and_the_prompt(tok):
    prompts = prompts_frame(read_prompts(DATASETS["A2"]), "A2")
    sent = build_requests(prompts, tok, TemplateVersion.K2_5, True)
    omitted = build_requests(prompts, tok, TemplateVersion.K2_5, True, send_tools=False)
    declare = tok.encode("<|im_system|>tool_declare", allow_special=True)[:1] + tok.encode("tool_declare")
    for a, b in zip(sent, omitted, strict=True):  # a request per prompt either way
        if a.tools:
            assert b.tools is None and b.tools_in_request == "omitted" and a.tools_in_request == "tools_field"
            assert a.prompt_ids[: len(declare)] == declare and b.prompt_ids[: len(declare)] != declare
