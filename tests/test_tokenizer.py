import json
import shutil
from typing import Any

import pytest

from eagle3_resources.errors import TokenizerFolderError
from eagle3_resources.tokenizer.chat_format import (
    DEFAULT_SYSTEM_PROMPT,
    TemplateVersion,
    render_messages,
)
from eagle3_resources.tokenizer.kimi import (
    MAX_RUN_CHARS,
    KimiTokenizer,
    kimi_pieces,
)
from eagle3_resources.tokenizer.special_tokens import KIMI_SPECIAL_TOKENS, VOCAB_SIZE

REFERENCE_TABLE = {  # ../shared/reference/kimi-k25.md, written out here on purpose
    "[BOS]": 163584,
    "[EOS]": 163585,
    "<|im_end|>": 163586,
    "<|im_user|>": 163587,
    "<|im_assistant|>": 163588,
    "<|start_header_id|>": 163590,
    "<|end_header_id|>": 163591,
    "[EOT]": 163593,
    "<|im_system|>": 163594,
    "<|tool_calls_section_begin|>": 163595,
    "<|tool_calls_section_end|>": 163596,
    "<|tool_call_begin|>": 163597,
    "<|tool_call_argument_begin|>": 163598,
    "<|tool_call_end|>": 163599,
    "<|im_middle|>": 163601,
    "<think>": 163606,
    "</think>": 163607,
    "[UNK]": 163838,
    "[PAD]": 163839,
}


def test_standin_has_every_kimi_special_id(tok):
    assert tok.vocab_size == VOCAB_SIZE == 163840
    for token, want in REFERENCE_TABLE.items():
        assert tok.token_id(token) == want, token
        assert tok.encode(token, allow_special=True) == [want]
    assert tok.encode("<|im_end|>", allow_special=True) != [163533]


def test_generation_prompt_ends_with_think(tok):
    ids = tok.encode(render_messages([{"role": "user", "content": "hi"}]), allow_special=True)
    assert ids[-1] == 163606
    off = tok.encode(render_messages([{"role": "user", "content": "hi"}], thinking=False), allow_special=True)
    assert off[-2:] == [163606, 163607]


def test_wrong_special_id_fails_at_load_naming_both_ids(tok, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tok.folder, bad)
    cfg = json.loads((bad / "tokenizer_config.json").read_text())
    decoder = cfg["added_tokens_decoder"]
    decoder["163533"] = decoder.pop("163586")  # the history's bug: <|im_end|> at 163533
    (bad / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerFolderError) as e:
        KimiTokenizer(bad)
    msg = str(e.value)
    assert "'<|im_end|>'" in msg and "163586" in msg and "missing" in msg


def test_moved_special_id_is_reported(tok, tmp_path):
    bad = tmp_path / "moved"
    shutil.copytree(tok.folder, bad)
    cfg = json.loads((bad / "tokenizer_config.json").read_text())
    d = cfg["added_tokens_decoder"]
    d["163586"], d["163607"] = d["163607"], d["163586"]  # swap <|im_end|> and </think>
    (bad / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerFolderError, match=r"'</think>': expected id 163607, tokenizer has id 163586"):
        KimiTokenizer(bad)


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "你好，世界。今天天气很好",
        "emoji 😀👩‍💻🇯🇵 mixed 中文 and English",
        "tabs\t\tand   spaces\n\n\nnew",
        "x" * 30_000,
        " " * 26_000 + "end",
    ],
)
def test_encode_decode_roundtrip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_long_runs_are_cut_like_kimi(tok):
    text = "a" + " " * (MAX_RUN_CHARS + 10) + "b"
    pieces = kimi_pieces(text)
    assert "".join(pieces) == text and len(pieces) == 2
    assert tok.encode(text) == [t for p in pieces for t in tok.encoding.encode(p, disallowed_special=())]


def test_special_strings_in_prose_are_text(tok):
    ids = tok.encode("a literal </think> in prose")
    assert 163607 not in ids and tok.decode(ids) == "a literal </think> in prose"
    assert tok.encode_batch(["</think>", "x"]) == [tok.encode("</think>"), tok.encode("x")]


def test_chat_format_turns_defaults_and_history():
    messages = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning": "old thoughts"},
        {"role": "user", "content": "Q2"},
    ]
    text = render_messages(messages)
    assert text == (
        f"<|im_system|>system<|im_middle|>{DEFAULT_SYSTEM_PROMPT}<|im_end|>"
        "<|im_user|>user<|im_middle|>Q1<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>A1<|im_end|>"
        "<|im_user|>user<|im_middle|>Q2<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>"
    )


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "unit": {"type": "string", "enum": ["c", "f"]},
                    "city": {"type": "string", "description": "City name"},
                },
                "required": ["city"],
            },
        },
    }
]


def test_tools_declared_first_then_system_and_results_rendered():
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "functions.get_weather:0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "name": "get_weather", "content": '{"t": 21}'},
    ]
    text = render_messages(messages, TOOLS)
    ts = (
        "# Tools\n\n## functions\nnamespace functions {\n// Get the weather\n"
        'type get_weather = (_: {\n  // City name\n  city: string,\n  unit?: "c" | "f"\n}) => any;\n}\n'
    )
    assert text == (
        f"<|im_system|>tool_declare<|im_middle|>{ts}<|im_end|>"
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think><|tool_calls_section_begin|><|tool_call_begin|>"
        'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}'
        "<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
        '<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0\n{"t": 21}<|im_end|>'
        "<|im_assistant|>assistant<|im_middle|><think>"
    )
    k2 = render_messages(messages[1:2], TOOLS, version=TemplateVersion.K2)
    assert k2.startswith(
        '<|im_system|>tool_declare<|im_middle|>[{"function":{"description":"Get the weather","name":"get_weather",'
    )


def test_special_token_table_matches_reference():
    for token, want in REFERENCE_TABLE.items():
        assert KIMI_SPECIAL_TOKENS[token] == want
