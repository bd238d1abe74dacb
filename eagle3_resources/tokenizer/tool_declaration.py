"""Tool declarations as Kimi renders them in the `tool_declare` system turn.

K2 and K2-Thinking render the tools as JSON with keys deep-sorted. K2.5/K2.6 render a
TypeScript-style declaration that Moonshot's tokenizer computes in Python (`tools_ts_str`)
before the Jinja template runs; rendering the Jinja alone silently falls back to JSON, a prompt
mismatch the model never saw. This module reproduces the TypeScript form exactly, including its
quirks (Python `repr` of numeric defaults, required fields first, `[k: string]: never` for
`additionalProperties: false`), and raises `ToolSchemaError` where Moonshot's encoder fails.
"""

from __future__ import annotations

import json
from typing import Any

from eagle3_resources.errors import ToolSchemaError

INDENT = "  "
FIELD_SEPARATOR = ",\n"
UNION_TYPE_NAMES = {
    "string": "string",
    "number": "number",
    "integer": "number",
    "boolean": "boolean",
    "null": "null",
    "object": "{}",
    "array": "Array<any>",
}
CONSTRAINT_KEYS = {
    "string": ("maxLength", "minLength", "pattern"),
    "number": ("maximum", "minimum"),
    "integer": ("maximum", "minimum"),
    "array": ("minItems", "maxItems"),
}


def deep_sort(value: Any) -> Any:
    """Sort dict keys recursively (Moonshot's `deep_sort_dict`); list order is kept."""
    if isinstance(value, dict):
        return {k: deep_sort(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [deep_sort(v) for v in value]
    return value


def tools_to_json(tools: list[dict[str, Any]]) -> str:
    """K2 / K2-Thinking declaration: the deep-sorted tools as compact JSON.

    Their chat_template.jinja writes `tools | tojson(separators=(',', ':'))`: no space after `,` or
    `:` (a spaced rendering was found by the independent fake server's count: 7 of the shipped
    prompts with tools came out 1-5 tokens off)."""
    return json.dumps(deep_sort(tools), ensure_ascii=False, separators=(",", ":"))


def comment(text: str, indent: str = "") -> str:
    return "\n".join(f"{indent}// {line}" if line else "" for line in text.split("\n"))


class _Refs:
    """`$defs` seen while walking a function's schema, and whether it refers to itself."""

    def __init__(self) -> None:
        self.definitions: dict[str, Any] = {}
        self.self_ref = False

    def resolve(self, ref: str) -> str:
        if ref == "#":
            self.self_ref = True
            return "parameters"
        if ref.startswith("#/$defs/"):
            name = ref.split("/")[-1]
            if name not in self.definitions:
                raise ToolSchemaError(f"reference not found: {ref}")
            return name
        raise ToolSchemaError(f"unsupported reference format: {ref}")


class _Type:
    """One parsed schema node: how it prints, and its comment lines (description, constraints)."""

    def __init__(self, schema: dict[str, Any], render, constraint_keys: tuple[str, ...] = ()):
        self.description = schema.get("description", "") if isinstance(schema, dict) else ""
        self.constraints = {k: schema[k] for k in constraint_keys if isinstance(schema, dict) and k in schema}
        self._render = render

    def ts(self, indent: str = "") -> str:
        return self._render(indent)

    def docstring(self, indent: str) -> str:
        lines = []
        if self.description:
            lines.append(comment(self.description, indent))
        if self.constraints:
            lines.append(indent + "// " + ", ".join(f"{k}: {v}" for k, v in sorted(self.constraints.items())))
        return "".join(line + "\n" for line in lines)


def _field(name: str, typ: _Type, optional: bool, default: Any, indent: str) -> str:
    text = typ.docstring(indent)
    if default is not None:
        shown = repr(default) if isinstance(default, (int, float, bool)) else json.dumps(default, ensure_ascii=False)
        text += f"{indent}// Default: {shown}\n"
    return text + f"{indent}{name}{'?' if optional else ''}: {typ.ts(indent)}"


def _object(schema: dict[str, Any], refs: _Refs) -> tuple[_Type, list[tuple[str, _Type, bool, Any]]]:
    fields: list[tuple[str, _Type, bool, Any]] = []
    extra: Any = None
    if schema:
        if "$defs" in schema:
            refs.definitions.update(schema["$defs"] or {})
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            extra = parse_type(extra, refs)
        if "properties" in schema:
            required = set(schema.get("required", []))
            for name, prop in schema["properties"].items():
                default = prop.get("default") if isinstance(prop, dict) else None
                fields.append((name, parse_type(prop, refs), name not in required, default))

    def render(indent: str) -> str:
        ordered = sorted((f for f in fields if not f[2]), key=lambda f: f[0]) + sorted(
            (f for f in fields if f[2]), key=lambda f: f[0]
        )
        parts = [_field(n, t, o, d, indent + INDENT) for n, t, o, d in ordered]
        if extra is not None:
            if extra is True:
                shown = "any"
            elif extra is False:
                shown = "never"
            elif isinstance(extra, _Type):
                shown = extra.ts(indent + INDENT)
            else:
                raise ToolSchemaError(f"unknown additionalProperties: {extra!r}")
            parts.append(f"{indent + INDENT}[k: string]: {shown}")
        if not parts:
            return "{}"
        return "{\n" + FIELD_SEPARATOR.join(parts) + "\n" + indent + "}"

    return _Type(schema, render), fields


def parse_type(schema: Any, refs: _Refs) -> _Type:
    """Parse one JSON-schema node into its TypeScript rendering."""
    if isinstance(schema, bool):
        shown = "any" if schema else "null"
        return _Type({}, lambda indent: shown)
    if not isinstance(schema, dict):
        raise ToolSchemaError(f"invalid JSON schema node: {schema!r}")
    if "$ref" in schema:
        name = refs.resolve(schema["$ref"])
        return _Type(schema, lambda indent: name)
    if "anyOf" in schema:
        options = [parse_type(s, refs) for s in schema["anyOf"]]
        return _Type(schema, lambda indent: " | ".join(o.ts(indent) for o in options))
    if "enum" in schema:
        values = schema["enum"]
        _check_enum(values, schema.get("type"))
        shown = " | ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in values)
        return _Type(schema, lambda indent: shown)
    if "type" in schema:
        typ = schema["type"]
        if isinstance(typ, list):
            unknown = [t for t in typ if t not in UNION_TYPE_NAMES]
            if unknown:
                raise ToolSchemaError(f"unknown type(s) {unknown} in {typ}")
            shown = " | ".join(UNION_TYPE_NAMES[t] for t in typ)
            return _Type(schema, lambda indent: shown)
        if typ == "object":
            return _object(schema, refs)[0]
        if typ == "array":
            item = parse_type(schema["items"], refs) if schema.get("items") else _Type({}, lambda indent: "any")

            def render_array(indent: str) -> str:
                doc = item.docstring(indent + INDENT)
                if doc:
                    return "Array<\n" + doc + indent + INDENT + item.ts(indent + INDENT) + "\n" + indent + ">"
                return f"Array<{item.ts(indent)}>"

            return _Type(schema, render_array, CONSTRAINT_KEYS["array"])
        if not isinstance(typ, str):
            raise ToolSchemaError(f"type must be a string or a list, got {typ!r}")
        shown = "number" if typ == "integer" else typ
        return _Type(schema, lambda indent: shown, CONSTRAINT_KEYS.get(typ, ()))
    if schema == {}:
        return _Type({}, lambda indent: "any")
    raise ToolSchemaError(f"invalid JSON schema object: {json.dumps(schema)[:200]}")


def _check_enum(values: Any, typ: Any) -> None:
    if not isinstance(values, list):
        raise ToolSchemaError(f"enum must be a list, got {values!r}")
    if typ is None:
        return
    if isinstance(typ, list):
        if len(typ) == 1:
            typ = typ[0]
        elif len(typ) == 2 and "null" in typ:
            typ = typ[0] if typ[0] != "null" else typ[1]
        else:
            raise ToolSchemaError(f"enum type {typ} is not supported")
    checks = {
        "string": lambda v: isinstance(v, str),
        "number": lambda v: isinstance(v, (int, float)),
        "integer": lambda v: isinstance(v, int),
        "boolean": lambda v: isinstance(v, bool),
    }
    check = checks.get(typ)
    for v in values:
        if v is not None and check is not None and not check(v):
            raise ToolSchemaError(f"enum value {v!r} is not a {typ}")


def function_to_typescript(function: dict[str, Any]) -> str:
    refs = _Refs()
    params, fields = _object(function.get("parameters") or {}, refs)
    interfaces = []
    if refs.self_ref:
        body = FIELD_SEPARATOR.join(_field(n, t, o, d, INDENT) for n, t, o, d in fields)
        interfaces.append("interface parameters {" + (f"\n{body}\n" if body else "") + "}")
    for name, schema in dict(refs.definitions).items():
        shown = parse_type(schema, refs).ts()
        desc = schema.get("description", "") if isinstance(schema, dict) else ""
        interfaces.append((comment(desc) + "\n" if desc else "") + f"interface {name} {shown}")
    name = function.get("name", "function")
    signature = "parameters" if refs.self_ref else params.ts()
    description = function.get("description")
    parts = [
        "\n".join(interfaces),
        comment(description) if description else "",
        f"type {name} = (_: {signature}) => any;",
    ]
    return "\n".join(p for p in parts if p)


def tools_to_typescript(tools: list[dict[str, Any]]) -> str:
    """K2.5/K2.6 declaration (`tools_ts_str`) of OpenAI-format tools, deep-sorted first."""
    functions = [
        function_to_typescript(tool["function"])
        for tool in deep_sort(tools)
        if tool.get("type") == "function" and tool.get("function")
    ]
    if not functions:
        return ""
    return "# Tools\n\n## functions\nnamespace functions {\n" + "\n".join(functions) + "\n}\n"
