"""Structured output in the HTTP API: which constraint a request asks for, and its compile before it is queued.

Constraint fields (one per request; two are a 400 naming the second):
    response_format        {"type": "json_object"} | {"type": "json_schema", "json_schema": {"schema": ...}}
    structured_outputs     vLLM's: {"json" | "regex" | "choice" | "grammar" | "json_object" | "structural_tag": ...,
                           "disable_any_whitespace": bool, ...}
    guided_json, guided_regex, guided_choice, guided_grammar      vLLM's older fields
    tool_choice            "required" or a named function (chat): the call after the server's prefill
                           (chat.tool_call_prefill) in the tool parser's format, its arguments by each tool's
                           `parameters` schema

With --reasoning-parser, a chat prompt that leaves thinking open gets its constraint after "</think>": the thinking
is free, the answer constrained; `thinking_token_budget` bounds the thinking (then "</think>" is forced).

The constraint is compiled on the tokenizer thread before the request is queued (an invalid schema, regex or
grammar is a 400 naming the field and saying why), so the engine's compile of it is a cache hit.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from deltaserve.sampling import SamplingParams
from deltaserve.server import json_limits
from deltaserve.server.errors import bad_request
from deltaserve.server.json_limits import JSONLimitError
from deltaserve.server.protocol import ChatCompletionRequest, NamedToolChoice, ToolDefinition, _SamplingFields
from deltaserve.server.reasoning import THINK_END
from deltaserve.structured.compiler import MAX_WHITESPACE
from deltaserve.structured.json_schema import prepare_schema
from deltaserve.structured.params import GrammarError, StructuredOutputsParams

# structured_outputs keys: StructuredOutputsParams' vLLM fields, and vLLM's that change nothing here
_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag", "disable_any_whitespace",
         "disable_additional_properties")
_IGNORED_KEYS = ("disable_fallback",)  # there is one backend, so nothing to fall back from
_GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "grammar"))
_BACKENDS = (None, "auto", "xgrammar")


def requested_constraint(request: _SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """The constraint a request's fields ask for and the field it came from; (None, None) when none."""
    found: list[tuple[str, dict[str, Any]]] = []
    response_format = request.response_format
    if response_format is not None and response_format.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif response_format is not None and response_format.type == "json_schema":
        body = response_format.json_schema
        if body is None or "schema" not in body:
            raise bad_request("response_format.json_schema.schema is required with type 'json_schema'",
                              "response_format")
        found.append(("response_format", {"json": body["schema"]}))
    if request.structured_outputs is not None:
        found.append(("structured_outputs", _structured_outputs_fields(request.structured_outputs)))
    found += [(name, {key: getattr(request, name)}) for name, key in _GUIDED if getattr(request, name) is not None]
    if request.guided_whitespace_pattern is not None:
        raise bad_request("guided_whitespace_pattern is not supported (xgrammar takes no whitespace pattern); "
                          "structured_outputs.disable_any_whitespace allows none", "guided_whitespace_pattern")
    if request.guided_decoding_backend not in _BACKENDS:
        raise bad_request(f"guided_decoding_backend {request.guided_decoding_backend!r} is not available: this "
                          "server decodes with xgrammar", "guided_decoding_backend")
    if len(found) > 1:
        raise bad_request(f"a request takes one output constraint, got {[name for name, _ in found]}", found[1][0])
    if not found:
        return None, None
    field, fields = found[0]
    for key in _JSON_TEXT_KEYS:
        if isinstance(fields.get(key), str):
            _check_json_limits(field, key, fields[key])
    return _params(field, **fields), field


_JSON_TEXT_KEYS = ("json", "structural_tag")  # constraints that may come as JSON text inside a string


def _check_json_limits(field: str, key: str, text: str) -> None:
    """400 naming `field` for JSON text nested deeper (or with longer integers) than a body may have: xgrammar's
    compile of a schema hundreds of levels deep takes the tokenizer thread for seconds, and Python's parser and
    the schema walk recurse. Malformed text is left to the compile, which says why."""
    try:
        json_limits.loads(text)
    except JSONLimitError as exc:
        where = {"structured_outputs": f"structured_outputs.{key}",
                 "response_format": "response_format.json_schema.schema"}.get(field, field)
        raise bad_request(f"{where}: {exc}", field) from exc
    except ValueError:
        pass


def _structured_outputs_fields(value: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(value) - set(_KEYS) - set(_IGNORED_KEYS))
    if "whitespace_pattern" in unknown:
        raise bad_request("structured_outputs.whitespace_pattern is not supported (xgrammar takes no whitespace "
                          "pattern); disable_any_whitespace allows none", "structured_outputs")
    if unknown:
        raise bad_request(f"structured_outputs has unknown field(s) {unknown}; known: {list(_KEYS)}",
                          "structured_outputs")
    return {key: value[key] for key in _KEYS if key in value}


def _params(field: str, **fields) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as exc:
        raise bad_request(f"{field}: {exc}", field) from exc


def chat_constraint(request: ChatCompletionRequest, tool_choice, tool_parser: str | None,
                    reasoning_parser: str | None,
                    thinking_open: bool) -> tuple[StructuredOutputsParams | None, str | None]:
    """A chat request's constraint: its fields', or a forced tool call's, behind the reasoning gate."""
    spec, field = requested_constraint(request)
    forced = tool_choice == "required" or isinstance(tool_choice, NamedToolChoice)
    if forced:
        if spec is not None:
            raise bad_request(f"tool_choice {'required' if tool_choice == 'required' else 'naming a function'} "
                              f"cannot be combined with {field}", field)
        spec, field = forced_call_constraint(tool_parser, tool_choice, request.tools,
                                             request.parallel_tool_calls), "tools"
    budget = request.thinking_token_budget
    if budget is not None and reasoning_parser is None:
        raise bad_request("thinking_token_budget needs the server to run with --reasoning-parser",
                          "thinking_token_budget")
    # a forced call's prefill closes the thinking; a prompt that does not open it leaves nothing to gate
    if reasoning_parser is None or not thinking_open or forced or (spec is None and budget is None):
        return spec, field
    if spec is None:
        field = "thinking_token_budget"
        return _params(field, reasoning_end=THINK_END, thinking_token_budget=budget), field
    return dataclasses.replace(spec, reasoning_end=THINK_END, thinking_token_budget=budget), field


async def constrain(state, params: SamplingParams, spec: StructuredOutputsParams | None,
                    field: str | None) -> SamplingParams:
    """`params` with the constraint, compiled (a cache hit for the engine later); a 400 naming `field` if it
    cannot be."""
    if spec is None:
        return params
    compiler = getattr(state.engine.engine, "grammar_compiler", None)
    if compiler is None:
        raise bad_request("this server's engine does not support structured output", field)
    try:
        await state.off_loop(compiler.compile, spec)
    except GrammarError as exc:
        where = "response_format.json_schema.schema" if field == "response_format" and spec.kind == "json" else field
        what = "reasoning's end tag" if exc.field == "reasoning_end" else _WHAT.get(spec.kind, "constraint")
        raise bad_request(f"{where}: the {what} cannot be used: {exc.reason}", field) from exc
    try:
        return dataclasses.replace(params, structured_outputs=spec)
    except ValueError as exc:  # a sampling field that conflicts with a constraint (min_tokens)
        raise bad_request(str(exc), str(exc).split(" ", 1)[0]) from exc


_WHAT = {"json": "JSON schema", "regex": "regex", "choice": "choice list", "grammar": "grammar",
         "json_object": "JSON object grammar", "structural_tag": "structural tag"}


# -- forced tool calls ---------------------------------------------------------------------------------------

# What each parser's call looks like after the server's prefill (chat._CALL_PREFIXES) and between calls.
_XML_END = "</function>\n</tool_call>"
_XML_NEXT = "\n<tool_call>\n<function="
# substrings the qwen3_xml parser reads as the end of a parameter value, and hermes as the end of a call
_XML_VALUE_ENDS = ["<parameter=", "</function>", "<tool_call>", "</tool_call>"]
_HERMES_END = "}\n</tool_call>"
_HERMES_NEXT = '\n<tool_call>\n{"name": "'


def forced_call_constraint(tool_parser: str, tool_choice, tools: list[ToolDefinition],
                           parallel: bool) -> StructuredOutputsParams:
    """An xgrammar structural tag for what follows the prefill of a forced call: a named function's
    arguments, or ("required") one call or more (one if not `parallel`) of any of `tools`."""
    hermes = tool_parser == "hermes"
    if isinstance(tool_choice, NamedToolChoice):
        index = next(i for i, t in enumerate(tools) if t.function.name == tool_choice.function.name)
        return StructuredOutputsParams(structural_tag=_tag(_call_body(tools, index, hermes, named=True)))
    calls = {"type": "or", "elements": [_call_body(tools, i, hermes, named=False) for i in range(len(tools))]}
    if not parallel:
        return StructuredOutputsParams(structural_tag=_tag(calls))
    more = {"type": "star", "content": {"type": "sequence", "elements": [
        _const(_HERMES_NEXT if hermes else _XML_NEXT), calls]}}
    return StructuredOutputsParams(structural_tag=_tag({"type": "sequence", "elements": [calls, more]}))


def _call_body(tools: list[ToolDefinition], index: int, hermes: bool, named: bool) -> dict:
    """One call's text after the prefill: (the name and its end, unless named) the arguments, the call's end."""
    function = tools[index].function
    schema = function.parameters or {"type": "object", "properties": {}}
    try:  # JSON arguments take json_schema's string-length rewrite; qwen3_xml values are raw text
        schema = prepare_schema(schema, "tools", rewrite_lengths=hermes)
    except GrammarError as exc:
        raise bad_request(f"tools[{index}].function.parameters: {exc.reason}", "tools") from exc
    arguments = {"type": "json_schema", "json_schema": schema, "style": "json" if hermes else "qwen_xml",
                 "max_whitespace_cnt": MAX_WHITESPACE}
    # xgrammar drops a string's length bounds where it filters strings: keep the bounds where there are some
    if not _has_length_bounds(schema):
        arguments["excludes"] = ["</tool_call>"] if hermes else _XML_VALUE_ENDS
    if hermes:
        head = [] if named else [_const(json.dumps(function.name, ensure_ascii=False)[1:] + ', "arguments": ')]
        return {"type": "sequence", "elements": [*head, arguments, _const(_HERMES_END)]}
    head = [] if named else [_const(f"{function.name}>\n")]
    return {"type": "sequence", "elements": [*head, arguments, _const(_XML_END)]}


def _has_length_bounds(schema: Any) -> bool:
    """Whether a schema (or any schema inside it) bounds a string's length."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if "minLength" in node or "maxLength" in node:
                return True
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def _const(text: str) -> dict:
    return {"type": "const_string", "value": text}


def _tag(format_: dict) -> dict:
    return {"type": "structural_tag", "format": format_}
