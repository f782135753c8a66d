"""Tool-call parsers: model text with `<tool_call>` blocks -> OpenAI tool calls, streaming and not.

Formats: `qwen3_xml` = `qwen3_coder` (Qwen3-Coder, Qwen3.5), whose VALUEs are raw text typed by the tool's
JSON schema (`convert_parameter`, in tool_types.py with the result types):
    <tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>
and `hermes` (Qwen2.5, Qwen3, Qwen3-Next): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

One state machine serves both modes: `extract()` feeds the whole text to a fresh parser, and the parser
only decides on text that no later delta can change, so every chunking gives the same result. Choices:
- Text outside blocks is content; whitespace right before `<tool_call>` and right after `</tool_call>` is
  dropped (a bare call gives content None). A `<tool_call>` not followed by `<function=NAME>` (hermes: a
  JSON object with a "name") is no call: its raw text stays content. Malformed text never raises.
- Deltas follow OpenAI: a call's first delta has index, id, type, name and arguments ""; the fragments
  after it concatenate to the non-streaming `arguments`. qwen3_xml sends `{"P": ` when `<parameter=P>`
  completes, then the value: JSON-escaped fragments as they come if the schema type is exactly "string"
  (and no pattern, enum or the like fixes its form), else whole at the closing tag; `}` when the function
  ends. Hermes sends each call whole.
- An unterminated call at the end of generation is closed with what was parsed (a truncated value is
  kept). Function names are not checked against `tools`; the server may do so.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from deltaserve.server.reasoning import first_tag, tag_prefix_start
from deltaserve.server.tool_types import (ContentDelta, ToolCall, ToolCallDelta, collect_deltas, convert_parameter,
                                          fixes_form, json_fragment, new_tool_call_id, parameter_schemas,
                                          schema_types, strict_json_loads)

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_FUNCTION_PREFIX = "<function="
_FUNCTION_END = "</function>"
_PARAM_PREFIX = "<parameter="
_PARAM_END = "</parameter>"
# A parameter value ends at its closing tag, or (the model forgot it) where the next tag begins.
_VALUE_ENDS = (_PARAM_END, _PARAM_PREFIX, _FUNCTION_END, TOOL_CALL_END)
_BLOCK_TAGS = (_FUNCTION_PREFIX, TOOL_CALL_END, TOOL_CALL_START)
_FUNCTION_TAGS = (_PARAM_PREFIX, _FUNCTION_END, TOOL_CALL_END, TOOL_CALL_START, _FUNCTION_PREFIX)
_MAX_NAME_CHARS = 256


class _ToolCallStream:
    """What every `<tool_call>` format shares: content outside blocks, whitespace rules, delta output.

    Subclasses parse a block's inside in `_step_block_state(final)` / `_finish_block_state()`.
    """

    def __init__(self, tools: list[Mapping] | None = None):
        self._schemas = parameter_schemas(tools)
        self._buffer = ""  # text received but not decided yet
        self._state = "content"
        self._out: list[ToolCallDelta | ContentDelta] = []
        self._trim_leading_space = False  # content right after </tool_call>
        self._held_space = ""  # whitespace before a <tool_call>: dropped, unless the block is no call
        self._block_has_call = False
        self._num_calls = 0

    @classmethod
    def extract(cls, text: str, tools: list[Mapping] | None = None) -> tuple[str | None, list[ToolCall]]:
        """Non-streaming: split a whole output into (content, tool_calls)."""
        parser = cls(tools)
        return collect_deltas(parser.feed(text) + parser.finish())

    def feed(self, delta: str) -> list[ToolCallDelta | ContentDelta]:
        """Consume one text delta; return the content and tool-call deltas it completes."""
        self._buffer += delta
        return self._drain(final=False)

    def finish(self) -> list[ToolCallDelta | ContentDelta]:
        """End of generation: flush held text and close an unterminated call."""
        out = self._drain(final=True)
        if self._state != "content":
            self._finish_block_state()  # appends to `out` (it is self._out)
        return out

    def _drain(self, final: bool) -> list[ToolCallDelta | ContentDelta]:
        self._out = []
        while self._step_content(final) if self._state == "content" else self._step_block_state(final):
            pass
        return self._out

    def _step_content(self, final: bool) -> bool:
        """Emit content up to the next <tool_call>; returns True when the state changed."""
        if self._trim_leading_space:
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return False
            self._trim_leading_space = False
        start = self._buffer.find(TOOL_CALL_START)
        if start >= 0:
            before = self._buffer[:start]
            self._emit_content(before.rstrip())
            self._held_space = before[len(before.rstrip()):]
            self._buffer = self._buffer[start + len(TOOL_CALL_START):]
            self._enter_block()
            return True
        if final:
            safe = self._buffer
        else:  # hold a possible partial "<tool_call>" and the whitespace that would be dropped with it
            safe = self._buffer[:tag_prefix_start(self._buffer, (TOOL_CALL_START,))].rstrip()
        self._emit_content(safe)
        self._buffer = self._buffer[len(safe):]
        return False

    def _enter_block(self) -> None:
        self._state = "block"
        self._block_has_call = False

    def _leave_block(self) -> None:
        self._state = "content"
        self._trim_leading_space = True

    def _reject_block(self) -> None:
        """The block is not a tool call: its <tool_call> (and what follows) is plain content."""
        self._emit_content(self._held_space + TOOL_CALL_START)
        self._held_space = ""
        self._state = "content"

    def _emit_content(self, text: str) -> None:
        if not text:
            return
        if self._out and isinstance(self._out[-1], ContentDelta):
            self._out[-1].text += text
        else:
            self._out.append(ContentDelta(text))

    def _open_call(self, name: str) -> None:
        self._out.append(ToolCallDelta(self._num_calls, "", new_tool_call_id(), "function", name))
        self._num_calls += 1
        self._held_space = ""
        self._block_has_call = True

    def _emit_arguments(self, text: str) -> None:
        if not text:
            return
        last = self._out[-1] if self._out else None
        if isinstance(last, ToolCallDelta) and last.id is None and last.index == self._num_calls - 1:
            last.arguments += text
        else:
            self._out.append(ToolCallDelta(self._num_calls - 1, text))

    def _step_block_state(self, final: bool) -> bool:
        """Advance inside a block; True when something changed (False: wait for more text)."""
        raise NotImplementedError

    def _finish_block_state(self) -> None:
        """End of generation inside a block (after a final drain): close what is open."""


class Qwen3XMLToolParser(_ToolCallStream):
    """`<tool_call><function=NAME><parameter=P>VALUE</parameter>...</function></tool_call>` blocks."""

    def __init__(self, tools: list[Mapping] | None = None):
        super().__init__(tools)
        self._call_name = ""
        self._call_has_params = False
        self._param_schema: Any = None
        self._param_streams = False  # a "string" value is streamed as JSON-escaped fragments
        self._value_started = False  # its leading newline has been handled

    def _step_block_state(self, final: bool) -> bool:
        if self._state == "block":
            return self._step_block(final)
        if self._state == "function":
            return self._step_function(final)
        return self._step_parameter(final)

    def _step_block(self, final: bool) -> bool:
        """After <tool_call> or </function>: expect <function=NAME> or </tool_call>."""
        head = self._buffer.lstrip()
        if head.startswith(_FUNCTION_PREFIX):
            status, name, rest = _read_tag_name(head, _FUNCTION_PREFIX, final)
            if status == "wait":
                return False
            if status == "ok":
                self._open_call(name)
                self._call_name, self._call_has_params = name, False
                self._buffer, self._state = rest, "function"
                return True
        elif self._block_has_call and head.startswith((TOOL_CALL_END, TOOL_CALL_START)):
            self._pass_tag(head, TOOL_CALL_END if head.startswith(TOOL_CALL_END) else TOOL_CALL_START)
            return True
        elif _is_partial_tag(head, _BLOCK_TAGS):
            if not final:
                return False
            if self._block_has_call:  # a truncated closing tag: markup, not content
                self._buffer = ""
                return False
        if self._block_has_call:  # text after </function> without </tool_call>: content
            self._leave_block()
        else:
            self._reject_block()
        return True

    def _step_function(self, final: bool) -> bool:
        """Inside <function=...>: expect parameters or the end of the function."""
        head = self._buffer.lstrip()
        closing = next((tag for tag in _FUNCTION_TAGS[1:] if head.startswith(tag)), None)
        if head.startswith(_PARAM_PREFIX):
            status, name, rest = _read_tag_name(head, _PARAM_PREFIX, final)
            if status == "wait":
                self._buffer = head
                return False
            if status == "ok":
                self._open_parameter(name)
                self._buffer = rest
                return True
        elif closing is not None:  # </function>, or a forgotten one before </tool_call> or a new call
            self._close_call()
            self._pass_tag(head, closing)
            return True
        elif _is_partial_tag(head, _FUNCTION_TAGS):  # at the end: a truncated tag, dropped by finish()
            self._buffer = head
            return False
        # Stray text between parameters cannot become content any more (the call is out): skip it.
        next_tag = head.find("<", 1)
        self._buffer = head[next_tag:] if next_tag >= 0 else ""
        return True

    def _pass_tag(self, head: str, tag: str) -> None:
        """Move past a structural tag at the start of `head` (a <function=...> is left for the block)."""
        self._buffer = head if tag == _FUNCTION_PREFIX else head[len(tag):]
        if tag == _FUNCTION_END:
            self._state = "block"
        elif tag == TOOL_CALL_END:
            self._leave_block()
        else:  # <tool_call> or <function=...>: the next call
            self._enter_block()

    def _step_parameter(self, final: bool) -> bool:
        """Inside <parameter=...>: collect the value up to its end."""
        if not self._value_started:
            if not self._buffer:
                return False
            if self._buffer.startswith("\n"):
                self._buffer = self._buffer[1:]
            self._value_started = True
        found = first_tag(self._buffer, _VALUE_ENDS)
        if found is not None:
            end, tag = found
            self._close_parameter(self._buffer[:end])
            self._buffer = self._buffer[end + len(_PARAM_END):] if tag == _PARAM_END else self._buffer[end:]
            self._state = "function"
            return True
        if self._param_streams and not final:
            cut = tag_prefix_start(self._buffer, _VALUE_ENDS)
            if cut > 0 and self._buffer[cut - 1] == "\n":
                cut -= 1  # may be the newline before </parameter>, which is stripped
            self._emit_arguments(json_fragment(self._buffer[:cut]))
            self._buffer = self._buffer[cut:]
        return False

    def _finish_block_state(self) -> None:
        if self._state == "parameter":  # truncated value: keep it, minus a partial closing tag
            self._close_parameter(self._buffer[:tag_prefix_start(self._buffer, _VALUE_ENDS)])
        if self._state in ("parameter", "function"):
            self._close_call()
        self._buffer = ""

    def _open_parameter(self, name: str) -> None:
        self._param_schema = self._schemas.get(self._call_name, {}).get(name)
        # a plain string streams as it comes; one whose form is fixed is trimmed at its end (convert_parameter)
        self._param_streams = schema_types(self._param_schema) == ["string"] and not fixes_form(self._param_schema)
        self._value_started = False
        separator = ", " if self._call_has_params else "{"
        self._call_has_params = True
        quote = '"' if self._param_streams else ""
        self._emit_arguments(f"{separator}{json.dumps(name, ensure_ascii=False)}: {quote}")
        self._state = "parameter"

    def _close_parameter(self, value: str) -> None:
        if value.endswith("\n"):
            value = value[:-1]
        if self._param_streams:
            self._emit_arguments(json_fragment(value) + '"')
        else:
            typed = convert_parameter(value, self._param_schema)
            self._emit_arguments(json.dumps(typed, ensure_ascii=False))
        self._state = "function"

    def _close_call(self) -> None:
        self._emit_arguments("}" if self._call_has_params else "{}")


class HermesToolParser(_ToolCallStream):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; each call is sent whole."""

    def _step_block_state(self, final: bool) -> bool:
        end = self._buffer.find(TOOL_CALL_END)
        if end < 0 and not final:
            head = self._buffer.lstrip()
            if head and not head.startswith("{"):
                self._reject_block()
                return True
            return False
        body = self._buffer if end < 0 else self._buffer[:end]
        call = _parse_hermes_body(body)
        if call is None:
            self._reject_block()
            return True
        name, arguments = call
        self._open_call(name)
        self._emit_arguments(arguments)
        self._buffer = "" if end < 0 else self._buffer[end + len(TOOL_CALL_END):]
        self._leave_block()
        return True


def _parse_hermes_body(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) from a hermes block body, or None if it is not a call."""
    try:
        call = strict_json_loads(body.strip())
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some models double-encode the arguments
        try:
            arguments = strict_json_loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)


def _read_tag_name(head: str, prefix: str, final: bool) -> tuple[str, str, str]:
    """Read NAME from `head` = prefix + "NAME>..." -> (status, name, text after ">").

    status is "ok", "wait" (the ">" may still come) or "bad" (no plausible name: contains "<" or a
    newline, is empty or too long). A name that is bad stays bad however the text goes on.
    """
    close = head.find(">", len(prefix))
    raw = head[len(prefix):] if close < 0 else head[len(prefix):close]
    plausible = len(raw) <= _MAX_NAME_CHARS and "<" not in raw and "\n" not in raw
    if close < 0:
        return ("wait" if plausible and not final else "bad"), "", head
    if plausible and raw.strip():
        return "ok", raw.strip(), head[close + 1:]
    return "bad", "", head


def _is_partial_tag(head: str, tags: tuple[str, ...]) -> bool:
    """True if `head` (possibly empty) could still grow into one of `tags`."""
    return any(tag.startswith(head) and tag != head for tag in tags)


TOOL_PARSERS: dict[str, type[_ToolCallStream]] = {
    "qwen3_xml": Qwen3XMLToolParser,
    "qwen3_coder": Qwen3XMLToolParser,
    "hermes": HermesToolParser,
}
