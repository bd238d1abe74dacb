import json

import pytest

from eagle3_assets.common.registry import (
    DATASETS,
    DatasetSpec,
    dataset_spec,
    load_registry,
)
from eagle3_assets.stages.raw_prompts.prompts import read_prompts
from eagle3_resources.errors import PromptFileError, RegistryError


def spec_for(path, fmt="messages"):
    return DatasetSpec(name="T1", prompt_file=path, format=fmt, kind="chat")


def write(tmp_path, lines, name="p.jsonl"):
    path = tmp_path / name
    text = "\n".join(line if isinstance(line, str) else json.dumps(line, ensure_ascii=False) for line in lines)
    path.write_text(text + "\n")
    return path


GOOD = {"id": "x1", "messages": [{"role": "user", "content": "hello"}]}
TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
    },
}


@pytest.mark.parametrize("name", list(DATASETS))
def test_every_shipped_dataset_parses(name):
    prompts = read_prompts(DATASETS[name])
    assert len(prompts) >= 20
    assert all(p.messages[-1]["role"] in ("user", "tool") for p in prompts)


def test_shipped_data_covers_the_required_shapes():
    all_prompts = [p for spec in DATASETS.values() for p in read_prompts(spec)]
    text = [m.get("content") or "" for p in all_prompts for m in p.messages]
    assert any(p.tools for p in all_prompts)
    assert any(m["role"] == "tool" for p in all_prompts for m in p.messages)
    assert any(sum(m["role"] == "user" for m in p.messages) > 1 for p in all_prompts)
    assert any(p.messages[0]["role"] == "system" for p in all_prompts)
    assert any(p.messages[0]["role"] != "system" for p in all_prompts)
    assert any("\u4e00" <= ch <= "\u9fff" for t in text for ch in t)  # Chinese
    assert any(ord(ch) >= 0x1F300 for t in text for ch in t)  # emoji
    assert any(len(t) > 5000 for t in text)  # long prompts


@pytest.mark.parametrize(
    "lines, line_no, fragment",
    [
        ([GOOD, '{"id": "x2", "messages": [', GOOD | {"id": "x3"}], 2, "malformed JSON"),
        ([GOOD, {"id": "x2", "msgs": []}], 2, 'missing field "messages"'),
        ([{"messages": [{"role": "user", "content": "hi"}]}], 1, 'missing field "id"'),
        ([{"id": "x1", "messages": [{"role": "bot", "content": "hi"}]}], 1, "unknown role 'bot'"),
        (
            [
                {
                    "id": "x1",
                    "messages": [{"role": "user", "content": "hi"}],
                    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
                }
            ],
            1,
            "parameters must be a JSON schema",
        ),
        (
            [
                {
                    "id": "x1",
                    "messages": [{"role": "user", "content": "hi"}],
                    "tools": [
                        {
                            "type": "function",
                            "function": {
                                "name": "f",
                                "parameters": {"type": "object", "properties": {"a": {"type": "strng"}}},
                            },
                        }
                    ],
                }
            ],
            1,
            "unknown type 'strng'",
        ),
        (
            [
                {
                    "id": "x1",
                    "messages": [{"role": "user", "content": "hi"}],
                    "tools": [
                        {
                            "type": "function",
                            "function": {
                                "name": "f",
                                "parameters": {"type": "object", "properties": {}, "required": ["a"]},
                            },
                        }
                    ],
                }
            ],
            1,
            "not in properties",
        ),
        (
            [{"id": "x1", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}],
            1,
            "must be 'user' or 'tool'",
        ),
        (
            [
                {
                    "id": "x1",
                    "messages": [
                        {"role": "user", "content": "hi"},
                        {
                            "role": "assistant",
                            "content": "",
                            "tool_calls": [
                                {"id": "c1", "type": "function", "function": {"name": "nope", "arguments": "{}"}}
                            ],
                        },
                        {"role": "tool", "tool_call_id": "c1", "content": "r"},
                    ],
                    "tools": [TOOL],
                }
            ],
            1,
            "not declared in tools",
        ),
        (
            [
                {
                    "id": "x1",
                    "messages": [
                        {"role": "user", "content": "hi"},
                        {"role": "tool", "tool_call_id": "c9", "content": "r"},
                    ],
                }
            ],
            1,
            "does not match an earlier tool call",
        ),
        ([GOOD, GOOD], 2, "duplicate id 'x1' (first on line 1)"),
    ],
)
def test_bad_input_names_file_line_and_problem(tmp_path, lines, line_no, fragment):
    path = write(tmp_path, lines)
    with pytest.raises(PromptFileError) as e:
        read_prompts(spec_for(path))
    msg = str(e.value)
    assert f"{path}:{line_no}:" in msg and fragment in msg, msg


def test_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(PromptFileError, match="no prompts"):
        read_prompts(spec_for(path))


def test_missing_file(tmp_path):
    with pytest.raises(PromptFileError, match="prompt file not found"):
        read_prompts(spec_for(tmp_path / "nope.jsonl"))


def test_all_problems_are_reported_at_once(tmp_path):
    path = write(tmp_path, ["{oops", {"id": "a"}, GOOD])
    with pytest.raises(PromptFileError) as e:
        read_prompts(spec_for(path))
    assert [line for line, _ in e.value.problems] == [1, 2]


def test_glaive_converts_to_messages_and_tools(tmp_path):
    system = (
        "SYSTEM: You are a helpful assistant with access to the following functions. Use them if required -\n"
        + json.dumps(
            {
                "name": "get_news",
                "description": "News",
                "parameters": {
                    "type": "object",
                    "properties": {"category": {"type": "string"}},
                    "required": ["category"],
                },
            },
            indent=4,
        )
    )
    chat = (
        "USER: Any sports news?\n\n\nASSISTANT: "
        '<functioncall> {"name": "get_news", "arguments": \'{"category": "sports"}\'} <|endoftext|>'
        '\n\n\nFUNCTION RESPONSE: {"headline": "Win"}\n\n\nASSISTANT: The headline is Win. <|endoftext|>\n\n\n'
    )
    path = write(tmp_path, [{"id": "g1", "system": system, "chat": chat}])
    (p,) = read_prompts(spec_for(path, "glaive"))
    assert [m["role"] for m in p.messages] == ["system", "user", "assistant", "tool"]
    assert (
        p.messages[0]["content"]
        == "You are a helpful assistant with access to the following functions. Use them if required"
    )
    call = p.messages[2]["tool_calls"][0]
    assert call["id"] == "functions.get_news:0" and json.loads(call["function"]["arguments"]) == {"category": "sports"}
    assert p.tools is not None
    assert p.messages[3]["tool_call_id"] == "functions.get_news:0" and p.tools[0]["function"]["name"] == "get_news"
    assert p.dropped_turns == 1


def test_glaive_bad_function_json(tmp_path):
    path = write(tmp_path, [{"id": "g1", "system": 'SYSTEM: tools -\n{"name": "f",', "chat": "USER: hi"}])
    with pytest.raises(PromptFileError, match=r":1: g1: function definition 1 in system is not valid JSON"):
        read_prompts(spec_for(path, "glaive"))


def test_unknown_dataset():
    with pytest.raises(RegistryError, match="unknown dataset 'Z9'.*A1, A2, B1"):
        dataset_spec("Z9")


def test_registry_errors(tmp_path):
    reg = tmp_path / "r.yaml"
    reg.write_text("datasets:\n  X1:\n    prompt_file: x.jsonl\n    format: csv\n    kind: chat\n")
    with pytest.raises(RegistryError, match="format 'csv'"):
        load_registry(reg)
    reg.write_text(
        "datasets:\n  X1:\n    prompt_file: x.jsonl\n    format: messages\n    kind: chat\n    sample_cap: -3\n"
    )
    with pytest.raises(RegistryError, match="sample_cap must be a positive integer"):
        load_registry(reg)


# -- JSON Lines as the format defines it ---------------------------------------------------


def test_raw_line_and_paragraph_separators_inside_strings_do_not_split_a_line(tmp_path):
    texts = ["before\u2028after", "para\u2029graph", "next\u0085line", "form\x0cfeed"]
    path = tmp_path / "p.jsonl"
    path.write_bytes(
        "".join(
            json.dumps({"id": f"x{i}", "messages": [{"role": "user", "content": t}]}, ensure_ascii=False) + "\n"
            for i, t in enumerate(texts)
        ).encode("utf-8")
    )
    assert "\u2028".encode() in path.read_bytes()  # raw, not escaped
    prompts = read_prompts(spec_for(path))
    assert [p.messages[0]["content"] for p in prompts] == texts
    assert [p.line for p in prompts] == [1, 2, 3, 4]


@pytest.mark.parametrize(
    "data, line, fragment",
    [
        (b"\xef\xbb\xbf" + json.dumps(GOOD).encode() + b"\n", 1, "byte-order mark"),
        (
            json.dumps(GOOD).encode() + b"\n" + b'{"id": "x2", "messages": [{"role": "user", "content": "a\x00b"}]}\n',
            2,
            "NUL byte",
        ),
        (
            json.dumps(GOOD).encode()
            + b"\n"
            + '{"id": "x2", "messages": [{"role": "user", "content": "café"}]}\n'.encode("latin-1"),
            2,
            "not valid UTF-8 at byte",
        ),
        (
            json.dumps(GOOD).encode() + b"\r\n" + json.dumps(GOOD | {"id": "x2"}).encode() + b"\r\n{",
            3,
            "malformed JSON",
        ),
    ],
)
def test_bom_nul_and_bad_encoding_each_get_their_own_message(tmp_path, data, line, fragment):
    path = tmp_path / "p.jsonl"
    path.write_bytes(data)
    with pytest.raises(PromptFileError) as info:
        read_prompts(spec_for(path))
    assert f"{path}:{line}: " in str(info.value) and fragment in str(info.value), str(info.value)
    assert len(info.value.problems) == 1
