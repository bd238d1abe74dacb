"""One converter per source schema: a row in, messages + tools out (without the final answer).

Every converter ends in the same validation as a hand-written prompt file, so an imported prompt
is exactly as valid as one written by hand; a row that cannot be converted raises `InvalidPrompt`
with the reason, and the importer writes it to the rejects file.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from eagle3_assets.common.registry import ImportSpec
from eagle3_assets.stages.raw_prompts.prompts import (
    glaive_to_messages,
    validate_conversation,
    validate_tools,
)
from eagle3_resources.errors import InvalidPrompt

# ShareGPT speakers; tool turns there carry no call ids, so they cannot become tool messages.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")


@dataclass
class Converted:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    dropped_turns: int  # trailing assistant turns removed: the target writes the next one
    native_id: str | None = None  # the source's own row id, when it has one


def _drop_final_answer(messages: list[dict[str, Any]]) -> int:
    dropped = 0
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
        dropped += 1
    return dropped


def _apply_system(messages: list[dict[str, Any]], spec: ImportSpec) -> None:
    if spec.system == "drop" and messages and messages[0]["role"] == "system":
        messages.pop(0)


def _finish(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, spec: ImportSpec, native_id: Any = None
) -> Converted:
    _apply_system(messages, spec)
    dropped = _drop_final_answer(messages)
    if not any(m["role"] == "user" for m in messages):
        raise InvalidPrompt("no user turn before the final answer")
    validate_conversation(messages, tools)
    return Converted(messages, tools, dropped, None if native_id is None else str(native_id))


def _text(value: Any, where: str) -> str:
    """Message content as text: a string, or OpenAI content parts that are all text."""
    if value is None or isinstance(value, str):
        return value or ""
    if isinstance(value, list):
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidPrompt(f"{where}: content part of type {kind!r}; only text can be sent")
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidPrompt(f"{where}: content must be text, got {type(value).__name__}")


def convert_glaive(row: dict[str, Any], spec: ImportSpec) -> Converted:
    """glaive-function-calling-v2: `system` ("SYSTEM: ..." + JSON function definitions) and `chat`."""
    chat, system = row.get("chat"), row.get("system")
    if not isinstance(chat, str) or not chat.strip():
        raise InvalidPrompt('empty or missing "chat"')
    if system is not None and not isinstance(system, str):
        raise InvalidPrompt('"system" must be text')
    messages, tools, _ = glaive_to_messages(system if system is not None and system.strip() else "SYSTEM:", chat)
    return _finish(messages, tools, spec, row.get("id"))


def convert_instruction(row: dict[str, Any], spec: ImportSpec) -> Converted:
    """Instruction-style rows (OpenCodeInstruct: `id`, `input`, `output`, ...): the request becomes one user turn."""
    text = row.get(spec.instruction_column)
    if not isinstance(text, str) or not text.strip():
        raise InvalidPrompt(f'empty or missing "{spec.instruction_column}"')
    return _finish([{"role": "user", "content": text.strip()}], None, spec, row.get("id"))


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    out = []
    for j, call in enumerate(calls or []):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise InvalidPrompt(f"{where}, tool call {j + 1}: expected {{'id', 'type', 'function'}}")
        args = fn.get("arguments")
        if not isinstance(args, str):  # some exports store arguments as an object
            args = json.dumps(args if args is not None else {}, ensure_ascii=False)
        out.append({"id": call.get("id"), "type": "function", "function": {"name": fn.get("name"), "arguments": args}})
    return out


def convert_messages(row: dict[str, Any], spec: ImportSpec) -> Converted:
    """`messages` lists (ultrachat_200k, Mixture-of-Thoughts, OpenAI chat format) with optional `tools`."""
    raw = row.get("messages")
    if isinstance(raw, str):  # some exports keep the list as JSON text
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise InvalidPrompt(f'"messages" is text that is not JSON ({e})') from None
    if not isinstance(raw, list) or not raw:
        raise InvalidPrompt('empty or missing "messages"')
    messages = []
    for i, m in enumerate(raw):
        where = f"message {i + 1}"
        if not isinstance(m, dict):
            raise InvalidPrompt(f"{where}: expected an object")
        # Parquet structs carry every field of the column, None where a message has none.
        msg = {k: m[k] for k in MESSAGE_KEYS if m.get(k) is not None}
        msg["content"] = _text(m.get("content"), where)
        if "tool_calls" in msg:
            msg["tool_calls"] = _tool_calls(msg["tool_calls"], where)
            if not msg["tool_calls"]:
                del msg["tool_calls"]
        messages.append(msg)
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as e:
            raise InvalidPrompt(f'"tools" is text that is not JSON ({e})') from None
    tools = validate_tools(tools) if tools else None
    return _finish(messages, tools, spec, row.get("prompt_id") or row.get("id"))


def convert_sharegpt(row: dict[str, Any], spec: ImportSpec) -> Converted:
    """ShareGPT `conversations` of `{"from", "value"}` (OpenThoughts-114k), plus its `system` column."""
    turns = row.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise InvalidPrompt('empty or missing "conversations"')
    messages = []
    system = row.get("system")
    if isinstance(system, str) and system.strip():
        messages.append({"role": "system", "content": system})
    for i, turn in enumerate(turns):
        speaker = turn.get("from") if isinstance(turn, dict) else None
        role = SHAREGPT_ROLES.get(speaker) if speaker is not None else None
        if role is None:
            raise InvalidPrompt(
                f"turn {i + 1}: speaker {speaker!r} (known: {', '.join(SHAREGPT_ROLES)}); "
                "tool turns in ShareGPT carry no call ids"
            )
        value = turn.get("value")
        if not isinstance(value, str):
            raise InvalidPrompt(f"turn {i + 1}: value must be text")
        if role == "system" and messages and messages[0]["role"] == "system" and len(messages) == 1:
            messages[0]["content"] += "\n\n" + value  # the column and a first system turn are one prompt
            continue
        messages.append({"role": role, "content": value})
    return _finish(messages, None, spec, row.get("id"))


CONVERTERS: dict[str, Callable[[dict[str, Any], ImportSpec], Converted]] = {
    "glaive": convert_glaive,
    "instruction": convert_instruction,
    "messages": convert_messages,
    "sharegpt": convert_sharegpt,
}


def columns(spec: ImportSpec) -> tuple[list[str], list[str]]:
    """(columns read, columns required) of a Parquet source for this schema."""
    return {
        "glaive": (["system", "chat", "id"], ["chat"]),
        "instruction": (["id", spec.instruction_column], [spec.instruction_column]),
        "messages": (["messages", "tools", "prompt_id", "id"], ["messages"]),
        "sharegpt": (["system", "conversations", "id"], ["conversations"]),
    }[spec.schema]
