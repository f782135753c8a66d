"""Tool-call results and argument typing, shared by the tool-call parsers (tool_calls.py).

`ToolCall` / `ToolCallDelta` / `ContentDelta` are what the parsers return (OpenAI shapes). `convert_parameter`
types a qwen3_xml parameter's raw text by the tool's JSON schema: string stays a string (one leading and
one trailing newline stripped), integer / number / boolean / null parsed, object / array parsed as JSON
(then as a Python literal), and anything unparseable or without a schema kept as JSON if it parses, else
as the string.
"""

from __future__ import annotations

import ast
import json
import math
import re
import secrets
from dataclasses import dataclass
from typing import Any, Mapping

from deltaserve.server import json_limits

_INTEGER = re.compile(r"-?[0-9]+")


@dataclass
class FunctionCall:
    name: str
    arguments: str  # a JSON object, as text


@dataclass
class ToolCall:
    """One complete call, shaped like OpenAI's `message.tool_calls[i]`."""

    id: str
    function: FunctionCall
    type: str = "function"

    def to_dict(self) -> dict:
        return {"id": self.id, "type": self.type,
                "function": {"name": self.function.name, "arguments": self.function.arguments}}


@dataclass
class ToolCallDelta:
    """One streamed piece of a call, shaped like OpenAI's `delta.tool_calls[i]` (None fields omitted)."""

    index: int
    arguments: str
    id: str | None = None
    type: str | None = None
    name: str | None = None

    def to_dict(self) -> dict:
        function = {"arguments": self.arguments} if self.name is None else {
            "name": self.name, "arguments": self.arguments}
        head = {"index": self.index, "id": self.id, "type": self.type}
        return {**{k: v for k, v in head.items() if v is not None}, "function": function}


@dataclass
class ContentDelta:
    text: str


def new_tool_call_id() -> str:
    """'call_' + 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


def parameter_schemas(tools: list[Mapping] | None) -> dict[str, dict[str, Any]]:
    """Map function name -> {parameter name -> JSON schema} from an OpenAI `tools` list."""
    schemas: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}, "
                             f"got {tool!r}")
        parameters = function.get("parameters") or {}
        if not isinstance(parameters, Mapping):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object, got {parameters!r}")
        properties = parameters.get("properties") or {}
        if not isinstance(properties, Mapping):
            raise ValueError(f"tools[{i}].function.parameters.properties must be an object of parameter schemas, "
                             f"got {properties!r}")
        schemas[function["name"]] = dict(properties)
    return schemas


def schema_types(schema: Any) -> list[str]:
    """JSON types a parameter schema allows: its "type" (string or list), else its anyOf/oneOf types."""
    if not isinstance(schema, Mapping):
        return []
    declared = schema.get("type")
    if isinstance(declared, str):
        return [declared]
    if isinstance(declared, list):
        return [t for t in declared if isinstance(t, str)]
    options = schema.get("anyOf") or schema.get("oneOf") or []
    return [t for option in options for t in schema_types(option)]


def strict_json_loads(text: str) -> Any:
    """json.loads without Python's NaN/Infinity extension (they would make the arguments invalid JSON), within
    json_limits' bounds (a ValueError past them: what a model writes is bounded as what a client sends)."""
    return json_limits.loads(text, allow_constants=False)


def _as_type(text: str, json_type: str) -> tuple[bool, Any]:
    """(True, parsed) if `text` reads as `json_type`, else (False, None)."""
    lowered = text.lower()
    if json_type == "null" and lowered in ("null", "none"):
        return True, None
    if json_type == "boolean" and lowered in ("true", "false"):
        return True, lowered == "true"
    if json_type == "integer" and _INTEGER.fullmatch(text):
        try:
            return True, int(text)
        except ValueError:  # more digits than Python converts
            return False, None
    if json_type == "number":
        try:
            number = float(text)
        except ValueError:
            return False, None
        if math.isfinite(number):  # keep "3" an int: same JSON value, and what the model wrote
            return True, int(text) if _INTEGER.fullmatch(text) else number
    if json_type in ("object", "array"):
        wanted = dict if json_type == "object" else list
        for parse in (strict_json_loads, ast.literal_eval):  # models sometimes write Python literals
            try:  # the round trip turns tuples into lists and rejects sets, NaN and the like
                value = strict_json_loads(json.dumps(parse(text), allow_nan=False))
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                continue
            if isinstance(value, wanted):
                return True, value
    return False, None


def convert_parameter(value: str, schema: Any) -> Any:
    """Type a raw parameter value (one edge newline already stripped) by its JSON schema.

    string -> unchanged; null/boolean/integer/number -> parsed; object/array -> JSON, else a Python
    literal; a type list tries its non-string types first. No schema, or nothing fits: JSON if the value
    parses as JSON, else the string itself. A string whose form the schema fixes (`fixes_form`) loses the
    whitespace around it: a grammar that writes such a value (structured output) treats it as layout.
    """
    types = schema_types(schema)
    text = value.strip()
    for json_type in sorted(set(types) - {"string"}):
        ok, parsed = _as_type(text, json_type)
        if ok:
            return parsed
    string = text if fixes_form(schema) else value
    if "string" in types:
        return string
    try:
        return strict_json_loads(text)
    except ValueError:
        return string


_FORM_KEYWORDS = ("pattern", "format", "enum", "const", "minLength", "maxLength")


def fixes_form(schema: Any) -> bool:
    """Whether a parameter schema constrains a string's text (pattern, format, enum, const, length)."""
    return isinstance(schema, Mapping) and any(key in schema for key in _FORM_KEYWORDS)


def json_fragment(text: str) -> str:
    """`text` escaped for the inside of a JSON string; fragments concatenate like the whole would."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def collect_deltas(deltas: list[ToolCallDelta | ContentDelta]) -> tuple[str | None, list[ToolCall]]:
    """Merge streamed deltas into (content, tool_calls), as a client accumulating a stream would."""
    content: list[str] = []
    calls: list[ToolCall] = []
    for delta in deltas:
        if isinstance(delta, ContentDelta):
            content.append(delta.text)
        elif delta.id is not None:
            calls.append(ToolCall(delta.id, FunctionCall(delta.name or "", delta.arguments)))
        else:
            calls[delta.index].function.arguments += delta.arguments
    return "".join(content) or None, calls
