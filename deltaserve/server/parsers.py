"""Turn generated text into an OpenAI chat message: reasoning, content and tool calls.

The API server makes one `ChatOutputParser` per request (per choice) and either calls `parse(text)` on
the finished output or `feed(delta)` on each detokenized text delta and `finish()` at the end. It chains
the reasoning parser (reasoning.py) and the tool-call parser (tool_calls.py): the reasoning parser's
content goes through the tool parser, and a `<tool_call>` written inside the thinking block ends the
reasoning there, so the call is still parsed.

    parser = ChatOutputParser("qwen3", "qwen3_coder", tools=request_tools)
    for text in deltas:
        parsed = parser.feed(text)   # ParsedDelta(reasoning, content, tool_calls)
    parsed = parser.finish()
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from deltaserve.server.reasoning import REASONING_PARSERS, Qwen3ReasoningParser
from deltaserve.server.tool_calls import TOOL_CALL_START, TOOL_PARSERS
from deltaserve.server.tool_types import ContentDelta, ToolCall, ToolCallDelta

__all__ = ["ChatOutputParser", "ParsedDelta", "ParsedMessage", "REASONING_PARSERS", "TOOL_PARSERS",
           "ToolCall", "ToolCallDelta", "get_reasoning_parser", "get_tool_parser"]


def get_reasoning_parser(name: str) -> type[Qwen3ReasoningParser]:
    """The reasoning parser class registered as `name` (the --reasoning-parser flag)."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name]


def get_tool_parser(name: str) -> type:
    """The tool-call parser class registered as `name` (the --tool-call-parser flag)."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]


def _check_tool_choice(tool_choice: Any) -> None:
    if tool_choice in ("none", "auto", "required"):
        return
    function = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or "
                         f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}")


@dataclass
class ParsedDelta:
    """What one streamed text delta adds to the message; tool_calls in OpenAI delta shape, in order."""

    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class ParsedMessage:
    """A whole parsed message (non-streaming)."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]


class ChatOutputParser:
    """Reasoning + tool-call parsing for one request; either parser may be None (not configured).

    Tool calls are parsed only when a tool parser is named, `tools` is non-empty and tool_choice is not
    "none" ("auto", "required" and a named function all parse; the server steers the model for the last
    two). `thinking_enabled` mirrors chat_template_kwargs["enable_thinking"] (default True).
    """

    def __init__(self, reasoning_parser: str | None = None, tool_parser: str | None = None,
                 tools: list[Mapping] | None = None, tool_choice: Any = "auto",
                 thinking_enabled: bool = True):
        _check_tool_choice(tool_choice)
        tool_class = get_tool_parser(tool_parser) if tool_parser is not None else None
        self._tool_class = tool_class if tools and tool_choice != "none" else None
        self._tools = tools
        self._tool_stream = self._tool_class(tools) if self._tool_class else None
        reasoning_class = get_reasoning_parser(reasoning_parser) if reasoning_parser is not None else None
        content_starts = (TOOL_CALL_START,) if self._tool_class else ()
        self._reasoning = (reasoning_class(thinking_enabled=thinking_enabled, content_starts=content_starts)
                           if reasoning_class else None)

    def parse(self, text: str) -> ParsedMessage:
        """Non-streaming: parse a whole output. Independent of feed()/finish()."""
        reasoning, content = self._reasoning.extract(text) if self._reasoning else (None, text or None)
        if self._tool_class is None or content is None:
            return ParsedMessage(reasoning, content, [])
        content, tool_calls = self._tool_class.extract(content, self._tools)
        return ParsedMessage(reasoning, content, tool_calls)

    def feed(self, delta: str) -> ParsedDelta:
        """Consume one text delta of the output."""
        reasoning, content = self._reasoning.feed(delta) if self._reasoning else (None, delta)
        return self._parse_content(reasoning, content, final=False)

    def finish(self) -> ParsedDelta:
        """End of generation: flush everything held back and close an unterminated tool call."""
        reasoning, content = self._reasoning.finish() if self._reasoning else (None, None)
        return self._parse_content(reasoning, content, final=True)

    def _parse_content(self, reasoning: str | None, content: str | None, final: bool) -> ParsedDelta:
        if self._tool_stream is None:
            return ParsedDelta(reasoning, content or None)
        items = self._tool_stream.feed(content or "")
        if final:
            items += self._tool_stream.finish()
        text = "".join(item.text for item in items if isinstance(item, ContentDelta))
        calls = [item for item in items if isinstance(item, ToolCallDelta)]
        return ParsedDelta(reasoning, text or None, calls)
