"""Read and validate prompt files: the logic behind the `raw_prompts` asset.

Two formats (data/PROMPT_FORMATS.md): `messages` (OpenAI chat style, optional `tools`) and
`glaive` (glaive-function-calling-v2 style, converted here to messages + tools). Every problem
is reported as `file:line: what is wrong`, all of them at once, before anything downstream runs:
malformed data costs nothing here, and money later.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import polars as pl

from eagle3_assets.common.registry import DatasetSpec
from eagle3_resources.errors import InvalidPrompt, PromptFileError, ToolSchemaError
from eagle3_resources.jsonl import iter_json_lines
from eagle3_resources.tokenizer.chat_format import TemplateVersion, render_messages
from eagle3_resources.tokenizer.kimi import KimiTokenizer
from eagle3_resources.tokenizer.tool_declaration import tools_to_typescript

ROLES = ("system", "user", "assistant", "tool")
JSON_SCHEMA_TYPES = {"string", "number", "integer", "boolean", "object", "array", "null"}
TOOL_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]{0,63}$")


@dataclass
class Prompt:
    prompt_id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    line: int
    dropped_turns: int = 0  # glaive: trailing assistant turns the target regenerates
    source_row: str = ""  # file:row (or file:line) it came from
    key: str = ""  # de-duplication key (importers.selection.prompt_key); set where it is computed
    native_id: str | None = None  # the source's own id for the row, when it has one


# -- tool schemas -------------------------------------------------------------------------


def _check_schema(schema: Any, where: str) -> None:
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise InvalidPrompt(f"{where}: a JSON schema must be an object, got {type(schema).__name__}")
    typ = schema.get("type")
    types = typ if isinstance(typ, list) else [typ] if typ is not None else []
    for t in types:
        if t not in JSON_SCHEMA_TYPES:
            raise InvalidPrompt(
                f"{where}: unknown type {t!r} (JSON schema types: {', '.join(sorted(JSON_SCHEMA_TYPES))})"
            )
    if "properties" in schema:
        props = schema["properties"]
        if not isinstance(props, dict):
            raise InvalidPrompt(f"{where}.properties must be an object")
        for name, sub in props.items():
            _check_schema(sub, f"{where}.properties.{name}")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise InvalidPrompt(f"{where}.required must be a list of property names")
        missing = [r for r in required if r not in props]
        if missing:
            raise InvalidPrompt(f"{where}.required names {missing}, which are not in properties")
    if "items" in schema:
        _check_schema(schema["items"], f"{where}.items")
    if "enum" in schema and (not isinstance(schema["enum"], list) or not schema["enum"]):
        raise InvalidPrompt(f"{where}.enum must be a non-empty list")
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            if not isinstance(schema[key], list):
                raise InvalidPrompt(f"{where}.{key} must be a list")
            for i, sub in enumerate(schema[key]):
                _check_schema(sub, f"{where}.{key}[{i}]")


def validate_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list) or not tools:
        raise InvalidPrompt("tools must be a non-empty list")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tool {i + 1}"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise InvalidPrompt(f'{where}: expected {{"type": "function", "function": {{...}}}}')
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME_RE.match(name):
            raise InvalidPrompt(f"{where}: invalid function name {name!r}")
        where = f"tool {i + 1} ({name})"
        if name in names:
            raise InvalidPrompt(f"{where}: declared twice")
        names.add(name)
        if "description" in fn and not isinstance(fn["description"], str):
            raise InvalidPrompt(f"{where}: description must be a string")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type") != "object":
            raise InvalidPrompt(f'{where}: parameters must be a JSON schema with "type": "object"')
        _check_schema(params, f"{where}: parameters")
    try:
        tools_to_typescript(tools)  # what the K2.5 template will have to render
    except (ToolSchemaError, KeyError, TypeError) as e:
        raise InvalidPrompt(f"tools cannot be declared the way Kimi-K2.5 declares them: {e}") from None
    return tools


# -- conversations ------------------------------------------------------------------------


def validate_conversation(messages: Any, tools: list[dict[str, Any]] | None) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidPrompt("messages must be a non-empty list")
    declared = {t["function"]["name"] for t in tools or []}
    call_ids: dict[str, str] = {}
    for i, m in enumerate(messages):
        where = f"message {i + 1}"
        if not isinstance(m, dict):
            raise InvalidPrompt(f"{where}: expected an object")
        role = m.get("role")
        if role not in ROLES:
            raise InvalidPrompt(f"{where}: unknown role {role!r} (expected one of {', '.join(ROLES)})")
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            raise InvalidPrompt(f"{where}: content must be a string")
        if "name" in m and not isinstance(m["name"], str):
            raise InvalidPrompt(f"{where}: name must be a string")
        if role == "system" and i != 0:
            raise InvalidPrompt(f"{where}: a system message may only come first")
        if role in ("system", "user") and not (content or "").strip():
            raise InvalidPrompt(f"{where}: empty {role} content")
        if role == "assistant":
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise InvalidPrompt(f"{where}: tool_calls must be a list")
            if not calls and not (content or "").strip():
                raise InvalidPrompt(f"{where}: assistant message with neither content nor tool_calls")
            for j, call in enumerate(calls):
                cw = f"{where}, tool call {j + 1}"
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(call.get("id"), str) or not call["id"]:
                    raise InvalidPrompt(
                        f'{cw}: expected {{"id": ..., "type": "function", "function": {{"name", "arguments"}}}}'
                    )
                if fn.get("name") not in declared:
                    raise InvalidPrompt(f"{cw}: calls {fn.get('name')!r}, which is not declared in tools")
                args = fn.get("arguments")
                try:
                    parsed = json.loads(args) if isinstance(args, str) else args
                except json.JSONDecodeError as e:
                    raise InvalidPrompt(f"{cw}: arguments are not valid JSON ({e})") from None
                if not isinstance(parsed, dict):
                    raise InvalidPrompt(f"{cw}: arguments must be a JSON object")
                call_ids[call["id"]] = fn["name"]
        if role == "tool":
            ref = m.get("tool_call_id")
            if ref not in call_ids:
                raise InvalidPrompt(f"{where}: tool_call_id {ref!r} does not match an earlier tool call")
    if messages[-1]["role"] not in ("user", "tool"):
        raise InvalidPrompt(
            f"the last message is {messages[-1]['role']!r}; it must be 'user' or 'tool' "
            "(the target writes the next turn)"
        )
    if not any(m["role"] == "user" for m in messages):
        raise InvalidPrompt("no user message")


def parse_messages_record(obj: dict[str, Any], line: int) -> Prompt:
    if "messages" not in obj:
        raise InvalidPrompt('missing field "messages"')
    unknown = set(obj) - {"id", "messages", "tools"}
    if unknown:
        raise InvalidPrompt(f"unknown field(s) {sorted(unknown)}")
    tools = validate_tools(obj["tools"]) if obj.get("tools") is not None else None
    validate_conversation(obj["messages"], tools)
    return Prompt(str(obj["id"]), obj["messages"], tools, line)


# -- glaive -------------------------------------------------------------------------------

GLAIVE_TURN_RE = re.compile(r"(?:^|\n+)(SYSTEM|USER|ASSISTANT|FUNCTION RESPONSE):[ \t]?")
GLAIVE_CALL_RE = re.compile(r'^\s*\{\s*"name"\s*:\s*"([^"]+)"\s*,\s*"arguments"\s*:\s*\'(.*)\'\s*\}\s*$', re.DOTALL)
END_OF_TEXT = "<|endoftext|>"


def parse_glaive_system(system: str) -> tuple[str, list[dict[str, Any]] | None]:
    if not system.startswith("SYSTEM:"):
        raise InvalidPrompt('system must start with "SYSTEM:"')
    text = system[len("SYSTEM:") :]
    start = text.find("{")
    if start < 0:
        return text.strip(), None
    prompt = text[:start].strip().rstrip("-").strip()
    decoder = json.JSONDecoder()
    functions: list[dict[str, Any]] = []
    pos = start
    while pos < len(text):
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            break
        try:
            fn, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise InvalidPrompt(
                f"function definition {len(functions) + 1} in system is not valid JSON ({e.msg})"
            ) from None
        functions.append(fn)
    tools = validate_tools([{"type": "function", "function": fn} for fn in functions])
    return prompt, tools


def parse_glaive_call(payload: str) -> tuple[str, str]:
    m = GLAIVE_CALL_RE.match(payload)
    if m:
        name, args = m.group(1), m.group(2)
    else:
        try:
            obj = json.loads(payload)
            name, args = obj["name"], obj.get("arguments", {})
        except (json.JSONDecodeError, KeyError, TypeError):
            raise InvalidPrompt(f"cannot parse function call {payload[:80]!r}") from None
        args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    try:
        if not isinstance(json.loads(args), dict):
            raise InvalidPrompt(f"arguments of {name!r} must be a JSON object")
    except json.JSONDecodeError as e:
        raise InvalidPrompt(f"arguments of {name!r} are not valid JSON ({e})") from None
    return name, args


def glaive_to_messages(system: str, chat: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, int]:
    """A glaive row as messages + tools, without its trailing assistant turns (returned as a count).

    Real rows sometimes carry their system prompt inside `chat` ("SYSTEM: ..." before the first
    user turn): it is merged into the system message. One in the middle of a chat cannot be
    rendered (Kimi-K2.5 takes a system message first only) and is reported.
    """
    system_prompt, tools = parse_glaive_system(system)
    parts = GLAIVE_TURN_RE.split(chat.strip())
    if parts[0].strip():
        raise InvalidPrompt(f"chat text before the first turn marker: {parts[0][:60]!r}")
    messages: list[dict[str, Any]] = []
    n_calls = 0
    last_call: dict[str, Any] | None = None
    # split() on one capturing group: [before, speaker, text, speaker, text, ...], so the pairs match
    for speaker, text in zip(parts[1::2], parts[2::2], strict=True):
        text = text.strip()
        if speaker == "SYSTEM":
            if messages:
                raise InvalidPrompt("a SYSTEM turn inside chat after the conversation started")
            system_prompt = "\n\n".join(t for t in (system_prompt, text) if t)
        elif speaker == "USER":
            messages.append({"role": "user", "content": text})
        elif speaker == "ASSISTANT":
            text = text.removesuffix(END_OF_TEXT).strip()
            if text.startswith("<functioncall>"):
                name, args = parse_glaive_call(text[len("<functioncall>") :])
                last_call = {
                    "id": f"functions.{name}:{n_calls}",
                    "type": "function",
                    "function": {"name": name, "arguments": args},
                }
                n_calls += 1
                messages.append({"role": "assistant", "content": "", "tool_calls": [last_call]})
            else:
                messages.append({"role": "assistant", "content": text})
        else:  # FUNCTION RESPONSE
            if last_call is None:
                raise InvalidPrompt("FUNCTION RESPONSE without an earlier function call")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": last_call["id"],
                    "name": last_call["function"]["name"],
                    "content": text,
                }
            )
    if system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    dropped = 0
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
        dropped += 1
    validate_conversation(messages, tools)
    return messages, tools, dropped


def parse_glaive_record(obj: dict[str, Any], line: int) -> Prompt:
    for key in ("system", "chat"):
        if not isinstance(obj.get(key), str):
            raise InvalidPrompt(f'missing field "{key}"')
    messages, tools, dropped = glaive_to_messages(obj["system"], obj["chat"])
    return Prompt(str(obj.get("id", f"line-{line}")), messages, tools, line, dropped)


PARSERS = {"messages": parse_messages_record, "glaive": parse_glaive_record}


def read_prompts(spec: DatasetSpec) -> list[Prompt]:
    """Every prompt of a dataset, or a `PromptFileError` listing every problem found."""
    path = spec.prompt_file
    error = PromptFileError(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        error.problems.append((None, "prompt file not found"))
        raise error from None
    parse = PARSERS[spec.format]
    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    for rec in iter_json_lines(raw):
        lineno, obj = rec.line, rec.value
        if obj is None:
            error.problems.append((lineno, rec.problem or "unreadable"))  # a line without an object has its problem
            continue
        if not isinstance(obj.get("id"), (str, int)) or obj.get("id") == "":
            error.problems.append((lineno, 'missing field "id"'))
            continue
        try:
            prompt = parse(obj, lineno)
        except InvalidPrompt as e:
            error.problems.append((lineno, f"{obj['id']}: {e}"))
            continue
        if prompt.prompt_id in seen:
            error.problems.append(
                (lineno, f"duplicate id {prompt.prompt_id!r} (first on line {seen[prompt.prompt_id]})")
            )
            continue
        seen[prompt.prompt_id] = lineno
        prompts.append(prompt)
    if not prompts and not error.problems:
        error.problems.append((None, "no prompts (the file is empty)"))
    if error.problems:
        raise error
    return prompts


def prompts_frame(prompts: list[Prompt], dataset: str) -> pl.DataFrame:
    """One row per prompt; messages and tools kept as JSON text so nothing is reshaped."""
    return pl.DataFrame(
        {
            "prompt_id": [p.prompt_id for p in prompts],
            "dataset": [dataset] * len(prompts),
            "line": [p.line for p in prompts],
            "source_row": [p.source_row for p in prompts],
            "native_id": [p.native_id for p in prompts],
            "prompt_key": [p.key for p in prompts],
            "messages_json": [json.dumps(p.messages, ensure_ascii=False) for p in prompts],
            "tools_json": [json.dumps(p.tools, ensure_ascii=False) if p.tools else None for p in prompts],
            "n_messages": [len(p.messages) for p in prompts],
            "n_user_turns": [sum(m["role"] == "user" for m in p.messages) for p in prompts],
            "has_system": [p.messages[0]["role"] == "system" for p in prompts],
            "has_tools": [bool(p.tools) for p in prompts],
            "last_role": [p.messages[-1]["role"] for p in prompts],
            "chars": [sum(len(m.get("content") or "") for m in p.messages) for p in prompts],
            "dropped_turns": [p.dropped_turns for p in prompts],
        },
        schema_overrides={"tools_json": pl.String, "native_id": pl.String},
    )


def rendered_prompt_ids(
    df: pl.DataFrame, tokenizer: KimiTokenizer, version: TemplateVersion, thinking: bool
) -> list[list[int]]:
    """Each prompt as the target sees it: the chat template's rendering, special tokens encoded."""
    texts = [
        render_messages(json.loads(m), json.loads(t) if t else None, version=version, thinking=thinking)
        for m, t in df.select("messages_json", "tools_json").rows()
    ]
    return tokenizer.encode_batch(texts, allow_special=True)


def with_prompt_tokens(
    df: pl.DataFrame, tokenizer: KimiTokenizer, version: TemplateVersion, thinking: bool
) -> pl.DataFrame:
    """Add each prompt's length in target tokens."""
    lengths = [len(ids) for ids in rendered_prompt_ids(df, tokenizer, version, thinking)]
    return df.with_columns(prompt_tokens=pl.Series(lengths, dtype=pl.Int64))
