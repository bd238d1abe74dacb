"""The fake provider's own rendering of a chat request into Kimi's prompt text.

Written from Moonshot's public chat templates and Python (Kimi-K2-Thinking and Kimi-K2.5
`chat_template.jinja`, `tokenization_kimi.py`, K2.5's `tool_declaration_ts.py`), not from this
project's chat-format code, so the fake's `prompt_tokens` is an independent oracle.

The template (both revisions):
- tools, when the request has any, are declared first:
  `<|im_system|>tool_declare<|im_middle|>{declaration}<|im_end|>`; Moonshot's `apply_chat_template`
  deep-sorts the tools' keys before anything else. K2.5 declares them TypeScript-style
  (`tools_ts_str`, computed in Python; if that fails or is empty the template falls back to JSON);
  K2 / K2-Thinking declare `tools | tojson(separators=(',', ':'))`, i.e. compact JSON;
- `<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>`
  when the first message is not a system message;
- every message: `<|im_user|>` / `<|im_assistant|>` / `<|im_system|>` (any other role) followed by
  `{name or role}<|im_middle|>`, its body, `<|im_end|>`;
- assistant bodies: `<think>{reasoning}</think>{content}{tool calls}`, where the reasoning is kept
  only for messages after the last assistant message without tool calls (earlier ones render
  `<think></think>`); tool calls are `<|tool_calls_section_begin|>` then per call
  `<|tool_call_begin|>{id}<|tool_call_argument_begin|>{arguments}<|tool_call_end|>` then
  `<|tool_calls_section_end|>` (arguments verbatim when a string, else Jinja `tojson`);
- tool results: `## Return of {tool_call_id}\\n{content}`;
- the generation prompt: `<|im_assistant|>assistant<|im_middle|><think>` (thinking on) or
  `...<think></think>` (thinking off).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."
TEMPLATE_VERSIONS = ("k2.5", "k2")


# -- tool declarations -------------------------------------------------------------------------


def sort_keys_deep(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: sort_keys_deep(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [sort_keys_deep(v) for v in value]
    return value


def tools_json(tools: list[dict[str, Any]]) -> str:
    """Jinja's `tojson(separators=(',', ':'))` (transformers: `json.dumps`, ensure_ascii off)."""
    return json.dumps(tools, ensure_ascii=False, separators=(",", ":"))


# A parsed schema node is (description, constraints, render(indent) -> str).
Node = tuple[str, dict[str, Any], Callable[[str], str]]


class _TS:
    """K2.5's TypeScript-style declaration of one function (semantics of `tool_declaration_ts.py`)."""

    INDENT = "  "

    def __init__(self) -> None:
        self.defs: dict[str, Any] = {}
        self.self_ref = False

    @staticmethod
    def _comment(text: str, indent: str = "") -> str:
        return "\n".join(f"{indent}// {line}" if line else "" for line in text.split("\n"))

    def _doc(self, node: Node, indent: str) -> str:
        description, constraints, _ = node
        lines = []
        if description:
            lines.append(self._comment(description, indent))
        if constraints:
            lines.append(indent + "// " + ", ".join(f"{k}: {constraints[k]}" for k in sorted(constraints)))
        return "".join(line + "\n" for line in lines)

    @staticmethod
    def _meta(schema: dict[str, Any], keys: tuple[str, ...] = ()) -> tuple[str, dict[str, Any]]:
        return schema.get("description", ""), {k: v for k, v in schema.items() if k in keys}

    def _member(self, name: str, node: Node, optional: bool, default: Any, indent: str) -> str:
        text = self._doc(node, indent)
        if default is not None:
            shown = (
                repr(default) if isinstance(default, (int, float, bool)) else json.dumps(default, ensure_ascii=False)
            )
            text += f"{indent}// Default: {shown}\n"
        return f"{text}{indent}{name}{'?' if optional else ''}: {node[2](indent)}"

    def obj(self, schema: dict[str, Any]) -> tuple[Node, list[tuple[str, Node, bool, Any]]]:
        members: list[tuple[str, Node, bool, Any]] = []
        extra: Any = None
        if schema:
            if "$defs" in schema:
                self.defs.update(schema["$defs"] or {})
            extra = schema.get("additionalProperties")
            if isinstance(extra, dict):
                extra = self.node(extra)
            if "properties" in schema:
                required = set(schema.get("required", []))
                for name, prop in schema["properties"].items():
                    default = prop.get("default") if isinstance(prop, dict) else None
                    members.append((name, self.node(prop), name not in required, default))

        def render(indent: str) -> str:
            ordered = sorted((m for m in members if not m[2]), key=lambda m: m[0])
            ordered += sorted((m for m in members if m[2]), key=lambda m: m[0])
            lines = [self._member(n, t, o, d, indent + self.INDENT) for n, t, o, d in ordered]
            if extra is not None:
                if extra is True:
                    shown = "any"
                elif extra is False:
                    shown = "never"
                elif isinstance(extra, tuple):
                    shown = extra[2](indent + self.INDENT)
                else:
                    raise ValueError(f"unknown additionalProperties {extra!r}")
                lines.append(f"{indent}{self.INDENT}[k: string]: {shown}")
            return "{\n" + ",\n".join(lines) + "\n" + indent + "}" if lines else "{}"

        return (*self._meta(schema), render), members

    def node(self, schema: Any) -> Node:
        if isinstance(schema, bool):
            word = "any" if schema else "null"
            return "", {}, lambda indent: word
        if "$ref" in schema:
            ref = schema["$ref"]
            if ref == "#":
                self.self_ref, name = True, "parameters"
            elif ref.startswith("#/$defs/"):
                name = ref.split("/")[-1]
                if name not in self.defs:
                    raise ValueError(f"reference not found: {ref}")
            else:
                raise ValueError(f"unsupported reference: {ref}")
            return (*self._meta(schema), lambda indent: name)
        if "anyOf" in schema:
            options = [self.node(s) for s in schema["anyOf"]]
            return (*self._meta(schema), lambda indent: " | ".join(o[2](indent) for o in options))
        if "enum" in schema:
            values = schema["enum"]
            self._check_enum(values, schema.get("type"))
            shown = " | ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in values)
            return (*self._meta(schema), lambda indent: shown)
        if "type" in schema:
            kind = schema["type"]
            if isinstance(kind, list):
                names = {
                    "string": "string",
                    "number": "number",
                    "integer": "number",
                    "boolean": "boolean",
                    "null": "null",
                    "object": "{}",
                    "array": "Array<any>",
                }
                shown = " | ".join(names[k] for k in kind)  # KeyError on an unknown type: Moonshot fails too
                return (*self._meta(schema), lambda indent: shown)
            if kind == "object":
                return self.obj(schema)[0]
            if kind == "array":
                item = self.node(schema["items"]) if schema.get("items") else ("", {}, lambda indent: "any")

                def render_array(indent: str) -> str:
                    doc = self._doc(item, indent + self.INDENT)
                    if doc:
                        return f"Array<\n{doc}{indent}{self.INDENT}{item[2](indent + self.INDENT)}\n{indent}>"
                    return f"Array<{item[2](indent)}>"

                return (*self._meta(schema, ("minItems", "maxItems")), render_array)
            if not isinstance(kind, str):
                raise ValueError(f"type {kind!r}")
            keys = {
                "string": ("maxLength", "minLength", "pattern"),
                "number": ("maximum", "minimum"),
                "integer": ("maximum", "minimum"),
            }.get(kind, ())
            word = "number" if kind == "integer" else kind
            return (*self._meta(schema, keys), lambda indent: word)
        if schema == {}:
            return "", {}, lambda indent: "any"
        raise ValueError(f"invalid JSON schema: {schema!r}")

    @staticmethod
    def _check_enum(values: list[Any], kind: Any) -> None:
        if kind is None:
            return
        if isinstance(kind, list):
            if len(kind) == 1:
                kind = kind[0]
            elif len(kind) == 2 and "null" in kind:
                kind = kind[0] if kind[0] != "null" else kind[1]
            else:
                raise ValueError(f"enum type {kind} is not supported")
        types: dict[str, type | tuple[type, ...]] = {
            "string": str,
            "number": (int, float),
            "integer": int,
            "boolean": bool,
        }
        wanted = types.get(kind)
        for v in values:
            if v is not None and wanted is not None and not isinstance(v, wanted):
                raise ValueError(f"enum value {v!r} is not a {kind}")

    def function(self, fn: dict[str, Any]) -> str:
        params, members = self.obj(fn.get("parameters") or {})
        blocks = []
        root = None
        if self.self_ref:
            root = "parameters"
            body = ",\n".join(self._member(n, t, o, d, self.INDENT) for n, t, o, d in members)
            blocks.append("interface parameters {" + (f"\n{body}\n" if body else "") + "}")
        for name, schema in dict(self.defs).items():
            text = self.node(schema)[2]("")
            desc = schema.get("description", "")
            blocks.append((self._comment(desc) + "\n" if desc else "") + f"interface {name} {text}")
        signature = root or params[2]("")
        description = fn.get("description")
        parts = [
            "\n".join(blocks),
            self._comment(description) if description else "",
            f"type {fn.get('name', 'function')} = (_: {signature}) => any;",
        ]
        return "\n".join(p for p in parts if p)


def tools_typescript(tools: list[dict[str, Any]]) -> str:
    """`tools_ts_str` of (already key-sorted) OpenAI-format tools; raises where Moonshot's encoder fails."""
    functions = [_TS().function(t["function"]) for t in tools if t.get("type") == "function" and t.get("function")]
    if not functions:
        return ""
    return "# Tools\n\n## functions\nnamespace functions {\n" + "\n".join(functions) + "\n}\n"


def declare_tools(tools: list[dict[str, Any]], version: str) -> str:
    tools = sort_keys_deep(tools)
    if version == "k2.5":
        try:
            declared = tools_typescript(tools)
        except Exception:  # Moonshot prints the error and lets the template fall back to JSON
            declared = ""
        if declared:
            return declared
    return tools_json(tools)


# -- messages ----------------------------------------------------------------------------------


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def _calls(calls: list[dict[str, Any]]) -> str:
    out = "<|tool_calls_section_begin|>"
    for call in calls:
        fn = call.get("function") or {}
        args = fn.get("arguments")
        args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        out += f"<|tool_call_begin|>{call.get('id') or ''}<|tool_call_argument_begin|>{args}<|tool_call_end|>"
    return out + "<|tool_calls_section_end|>"


def render_prompt(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    version: str = "k2.5",
    thinking: bool = True,
) -> str:
    """The prompt text (special tokens written out) the provider's model is given."""
    if version not in TEMPLATE_VERSIONS:
        raise ValueError(f"template_version must be one of {TEMPLATE_VERSIONS}, not {version!r}")
    parts: list[str] = []
    if tools:
        parts.append(f"<|im_system|>tool_declare<|im_middle|>{declare_tools(tools, version)}<|im_end|>")
    if not messages or messages[0].get("role") != "system":
        parts.append(f"<|im_system|>system<|im_middle|>{DEFAULT_SYSTEM}<|im_end|>")
    history_end = -1  # the last assistant message without tool calls: reasoning before it is dropped
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "assistant" and not messages[i].get("tool_calls"):
            history_end = i
            break
    for i, m in enumerate(messages):
        role = m.get("role")
        marker = {"user": "<|im_user|>", "assistant": "<|im_assistant|>"}.get(role or "", "<|im_system|>")
        head = f"{marker}{m.get('name') or role}<|im_middle|>"
        if role == "assistant":
            reasoning = "" if i <= history_end else (m.get("reasoning_content") or m.get("reasoning") or "")
            body = f"<think>{reasoning}</think>{_text(m.get('content'))}"
            if m.get("tool_calls"):
                body += _calls(m["tool_calls"])
        elif role == "tool":
            body = f"## Return of {m.get('tool_call_id') or ''}\n{_text(m.get('content'))}"
        else:
            body = _text(m.get("content"))
        parts.append(f"{head}{body}<|im_end|>")
    parts.append("<|im_assistant|>assistant<|im_middle|>" + ("<think>" if thinking else "<think></think>"))
    return "".join(parts)
