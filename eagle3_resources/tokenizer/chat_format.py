"""Kimi's chat format: OpenAI-style messages to the exact prompt the target model sees.

Turn markup: `<|im_{role}|>{name or role}<|im_middle|>{content}<|im_end|>`, no newlines, no BOS.
Tools are declared first in a `tool_declare` system turn (TypeScript-style for K2.5/K2.6, JSON
for K2/K2-Thinking), then the default system turn when the conversation has none. Earlier
assistant turns render their thinking empty (`<think></think>`); only assistant turns after the
last plain (tool-call-free) assistant turn keep `<think>{reasoning}</think>`. The generation
prompt ends in `<think>` with thinking on, `<think></think>` with it off.

The rendered text is encoded with special tokens allowed, as the serving stack does.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Any

from eagle3_resources.tokenizer.special_tokens import (
    IM_ASSISTANT,
    IM_END,
    IM_MIDDLE,
    IM_SYSTEM,
    IM_USER,
    THINK,
    THINK_END,
    TOOL_CALL_ARGUMENT_BEGIN,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALLS_SECTION_BEGIN,
    TOOL_CALLS_SECTION_END,
)
from eagle3_resources.tokenizer.tool_declaration import (
    tools_to_json,
    tools_to_typescript,
)

DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."


# StrEnum would change str() of a member (its value instead of "TemplateVersion.K2"); kept (issue 26 item 6)
class TemplateVersion(str, Enum):  # noqa: UP042
    """Which revision's chat semantics to render (they differ in how tools are declared)."""

    K2_5 = "k2.5"  # also K2.6: TypeScript-style tool declaration
    K2 = "k2"  # K2 and K2-Thinking: JSON tool declaration, keys deep-sorted


def declare_tools(tools: list[dict[str, Any]], version: TemplateVersion) -> str:
    if version is TemplateVersion.K2_5:
        return tools_to_typescript(tools)
    return tools_to_json(tools)


def _turn(role_token: str, name: str, content: str) -> str:
    return f"{role_token}{name}{IM_MIDDLE}{content}{IM_END}"


def _tool_calls_section(tool_calls: list[dict[str, Any]]) -> str:
    calls = []
    for call in tool_calls:
        arguments = call["function"]["arguments"]
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append(f"{TOOL_CALL_BEGIN}{call['id']}{TOOL_CALL_ARGUMENT_BEGIN}{arguments}{TOOL_CALL_END}")
    return TOOL_CALLS_SECTION_BEGIN + "".join(calls) + TOOL_CALLS_SECTION_END


def render_messages(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    version: TemplateVersion = TemplateVersion.K2_5,
    add_generation_prompt: bool = True,
    thinking: bool = True,
) -> str:
    """The prompt text, special tokens written out, exactly as Kimi's template renders it."""
    out: list[str] = []
    if tools:
        out.append(_turn(IM_SYSTEM, "tool_declare", declare_tools(tools, version)))
    if not messages or messages[0]["role"] != "system":
        out.append(_turn(IM_SYSTEM, "system", DEFAULT_SYSTEM_PROMPT))

    last_plain_assistant = max(
        (i for i, m in enumerate(messages) if m["role"] == "assistant" and not m.get("tool_calls")), default=-1
    )
    for i, message in enumerate(messages):
        role = message["role"]
        name = message.get("name") or role
        content = message.get("content") or ""
        if role == "user":
            out.append(_turn(IM_USER, name, content))
        elif role == "assistant":
            reasoning = message.get("reasoning") or message.get("reasoning_content") or ""
            think = f"{THINK}{reasoning if i > last_plain_assistant else ''}{THINK_END}"
            calls = _tool_calls_section(message["tool_calls"]) if message.get("tool_calls") else ""
            out.append(_turn(IM_ASSISTANT, name, think + content + calls))
        elif role == "tool":
            out.append(_turn(IM_SYSTEM, name, f"## Return of {message.get('tool_call_id', '')}\n{content}"))
        else:  # system, and any other role, render as a system-style turn
            out.append(_turn(IM_SYSTEM, name, content))

    if add_generation_prompt:
        out.append(f"{IM_ASSISTANT}assistant{IM_MIDDLE}{THINK if thinking else THINK + THINK_END}")
    return "".join(out)
