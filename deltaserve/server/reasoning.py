"""Reasoning parsers: split a model's `<think>...</think>` block from its answer.

Qwen3 / Qwen3.5 / Qwen3-Next chat templates end the generation prompt with `<think>\\n` when thinking is
enabled, so the generated text usually starts directly with the reasoning and contains only the closing
`</think>`; older templates (and some sampling paths) let the model write the opening `<think>` itself.
DeepSeek-R1 uses the same two tags. Rules (non-streaming and streaming agree on them):

- thinking disabled (`chat_template_kwargs={"enable_thinking": False}`): everything is content, verbatim;
- a `<think>` at the start of the output (after optional whitespace) is removed;
- the text before `</think>` is reasoning; without `</think>` everything is reasoning;
- newlines are trimmed where the chat template puts them: at the start of the reasoning, at the end of a
  terminated reasoning (before `</think>`), and at the start of the content (the "\\n\\n" after `</think>`);
  all other whitespace is kept, and an empty reasoning or content becomes None;
- `content_starts` (for example `("<tool_call>",)`) lists tags that also end the reasoning but belong to
  the content: a model that calls a tool before closing its thought still gets its call parsed.

The streaming parser never emits a partial tag: it holds back any suffix that could still become one (and
trailing newlines that could still precede `</think>`), so the concatenated deltas equal `extract()` for any
chunking of the text.
"""

from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"


def tag_prefix_start(text: str, tags: tuple[str, ...]) -> int:
    """Index where the longest suffix of `text` that is a proper prefix of one of `tags` begins.

    Returns len(text) when no suffix could grow into a tag; the text before the index is safe to emit.
    """
    longest = max((len(tag) for tag in tags), default=1)
    for start in range(max(0, len(text) - longest + 1), len(text)):
        suffix = text[start:]
        if any(tag.startswith(suffix) and tag != suffix for tag in tags):
            return start
    return len(text)


def first_tag(text: str, tags: tuple[str, ...]) -> tuple[int, str] | None:
    """(index, tag) of the earliest complete tag in `text`, or None."""
    hits = [(text.find(tag), tag) for tag in tags if tag in text]
    return min(hits) if hits else None


class Qwen3ReasoningParser:
    """`<think>` reasoning splitter for Qwen3-family (and DeepSeek-R1) output.

    Non-streaming: `extract(text)`. Streaming: `feed(delta)` per text delta, then `finish()` once; each
    returns `(reasoning_delta, content_delta)` with None for nothing. One instance per request.
    """

    def __init__(self, thinking_enabled: bool = True, content_starts: tuple[str, ...] = ()):
        self.thinking_enabled = thinking_enabled
        self.content_starts = tuple(content_starts)
        self._end_tags = (THINK_END, *self.content_starts)
        # Streaming state: "start" (not yet known whether the output opens with <think>), "reasoning"
        # or "content"; `_buffer` holds text received but not yet emitted.
        self._state = "start" if thinking_enabled else "content"
        self._buffer = ""
        self._trim_leading_newlines = False

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """Split a whole output into (reasoning, content). Does not touch the streaming state."""
        if not self.thinking_enabled:
            return None, text or None
        head = text.lstrip()
        if head.startswith(THINK_START):
            text = head[len(THINK_START):]
        text = text.lstrip("\n")
        found = first_tag(text, self._end_tags)
        if found is None:
            return text or None, None
        index, tag = found
        reasoning = text[:index].rstrip("\n")
        # </think> is markup and dropped; a content-start tag (<tool_call>) is part of the content.
        rest = text[index + len(THINK_END):] if tag == THINK_END else text[index:]
        return reasoning or None, rest.lstrip("\n") or None

    def feed(self, delta: str) -> tuple[str | None, str | None]:
        """Consume one text delta; return what can be emitted without risking a partial tag."""
        self._buffer += delta
        return self._drain(final=False)

    def finish(self) -> tuple[str | None, str | None]:
        """End of generation: emit everything still held back."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str | None, str | None]:
        reasoning = content = ""
        if self._state == "start":
            self._resolve_start(final)
        if self._state == "reasoning":
            reasoning = self._drain_reasoning(final)
        if self._state == "content":
            content = self._take_buffer()
        return reasoning or None, content or None

    def _resolve_start(self, final: bool) -> None:
        """Decide whether the output opens with <think>; wait while the head could still become one."""
        head = self._buffer.lstrip()
        if head.startswith(THINK_START):
            self._buffer = head[len(THINK_START):]
        elif THINK_START.startswith(head) and not final:
            return  # empty, whitespace, or a prefix such as "<thi": not decidable yet
        self._state = "reasoning"
        self._trim_leading_newlines = True

    def _drain_reasoning(self, final: bool) -> str:
        """Emit reasoning up to an end tag (switching to content) or up to what is safe to emit."""
        if self._trim_leading_newlines:
            self._buffer = self._buffer.lstrip("\n")
            if not self._buffer:
                return ""
            self._trim_leading_newlines = False
        found = first_tag(self._buffer, self._end_tags)
        if found is not None:
            index, tag = found
            emitted = self._buffer[:index].rstrip("\n")
            skip = len(THINK_END) if tag == THINK_END else 0
            self._buffer = self._buffer[index + skip:]
            self._state = "content"
            self._trim_leading_newlines = True
            return emitted
        if final:
            return self._take_buffer()
        # Hold back a possible partial end tag and the newlines before it: both vanish if it completes.
        cut = tag_prefix_start(self._buffer, self._end_tags)
        emitted = self._buffer[:cut].rstrip("\n")
        self._buffer = self._buffer[len(emitted):]
        return emitted

    def _take_buffer(self) -> str:
        if self._trim_leading_newlines:
            self._buffer = self._buffer.lstrip("\n")
            if self._buffer:
                self._trim_leading_newlines = False
        text, self._buffer = self._buffer, ""
        return text


# DeepSeek-R1 emits the same <think> ... </think> layout (its template also pre-fills "<think>\n").
REASONING_PARSERS: dict[str, type[Qwen3ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": Qwen3ReasoningParser,
}
