"""Chat prompts.

- `load_chat_template(value)`: --chat-template is a file path or the template text itself (as in vLLM).
- `ChatRenderer`: OpenAI messages -> the prompt string, through the checkpoint's (or the flag's) Jinja
  template, with tools and chat_template_kwargs (--default-chat-template-kwargs, overridden per request).
- `tool_call_prefill(...)`: how tool_choice "required" or a named function steers the model. There is no
  structured output yet, so the server writes the opening of the call after the prompt and the model
  continues it: `<tool_call>\\n<function=NAME>\\n` (qwen3_xml / qwen3_coder) or the hermes JSON head.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from deltaserve.config import ConfigError
from deltaserve.server import json_limits
from deltaserve.server.errors import APIError, bad_request
from deltaserve.server.json_limits import JSONLimitError
from deltaserve.server.protocol import ChatMessageIn, NamedToolChoice, ToolDefinition

logger = logging.getLogger(__name__)

# apply_chat_template's own arguments: a request may not smuggle them in through chat_template_kwargs.
_RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                       "add_generation_prompt", "continue_final_message", "tokenize",
                                       "return_dict", "return_tensors", "tokenizer_kwargs"})
THINK_START, THINK_END = "<think>", "</think>"


def load_chat_template(value: str | None) -> str | None:
    """The template text for --chat-template VALUE: the file's content, or VALUE itself if it is a template."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ConfigError(f"--chat-template {value!r}: no such file, and not a Jinja template either")


@dataclass
class RenderedChat:
    prompt: str
    thinking_enabled: bool
    thinking_open: bool  # the prompt ends inside an open <think> block


class ChatRenderer:
    """Renders chat messages with a Jinja chat template (the tokenizer's unless --chat-template is given)."""

    def __init__(self, tokenizer, chat_template: str | None = None, default_kwargs: dict | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.default_kwargs = dict(default_kwargs or {})

    def warm_up(self) -> None:
        """Render one user message, so that Jinja compiles the template at start-up rather than in the first chat
        request. A template that cannot render it is logged, not raised: requests report their own errors."""
        has_template = self.chat_template is not None or getattr(self.tokenizer, "chat_template", None)
        if self.tokenizer is None or not has_template:
            return
        try:
            self.render([ChatMessageIn(role="user", content="Hello")], None)
        except APIError as exc:  # render's errors are the requests' 400s
            logger.warning("the chat template could not render one user message at start-up: %s", exc.message)

    def template_kwargs(self, request_kwargs: dict | None) -> dict:
        merged = {**self.default_kwargs, **(request_kwargs or {})}
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(merged))
        if reserved:
            raise bad_request(f"chat_template_kwargs may not set {reserved}", "chat_template_kwargs")
        return merged

    def render(self, messages: list[ChatMessageIn], tools: list[ToolDefinition] | None,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               request_kwargs: dict | None = None) -> RenderedChat:
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer, so chat requests are not available", "messages")
        if self.chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template; start the server with --chat-template",
                              "messages")
        if continue_final_message and add_generation_prompt:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                              "continue_final_message")
        kwargs = self.template_kwargs(request_kwargs)
        conversation = [_message_dict(i, m) for i, m in enumerate(messages)]
        tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
        try:
            prompt = self.tokenizer.apply_chat_template(
                conversation, tools=tool_dicts, chat_template=self.chat_template, tokenize=False,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                **kwargs)
        except Exception as exc:  # what a template does with a request's messages is the request's to answer for
            raise bad_request(f"the chat template could not render these messages: {exc or type(exc).__name__}",
                              "messages") from exc
        thinking = kwargs.get("enable_thinking", True) is not False
        return RenderedChat(prompt, thinking, thinking and prompt.rstrip("\n").endswith(THINK_START))


def _message_dict(index: int, message: ChatMessageIn) -> dict:
    """One message as the template expects it: text content as a string, tool-call arguments as a mapping."""
    out = message.model_dump(exclude_none=True)
    if out["role"] == "developer":  # OpenAI's newer name for the system role
        out["role"] = "system"
    if isinstance(message.content, list):
        texts = []
        for j, part in enumerate(message.content):
            if part.type != "text":
                raise bad_request(f"messages[{index}].content[{j}]: content part type {part.type!r} is not "
                                  "supported (this server serves text only)", "messages")
            if part.text is None:
                raise bad_request(f"messages[{index}].content[{j}]: a text content part needs `text`, a string",
                                  "messages")
            texts.append(part.text)
        out["content"] = "\n".join(texts)
    for j, call in enumerate(out.get("tool_calls") or []):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"messages[{index}].tool_calls[{j}] needs a function with a name", "messages")
        arguments = function.get("arguments")
        if isinstance(arguments, str):  # OpenAI clients send a JSON string; templates iterate a mapping
            where = f"messages[{index}].tool_calls[{j}].function.arguments"
            try:
                function["arguments"] = json_limits.loads(arguments) if arguments.strip() else {}
            except JSONLimitError as exc:  # bounded as the body is: deeper, the template recursed past Python's limit
                raise bad_request(f"{where}: {exc}", "messages") from exc
            except ValueError as exc:
                raise bad_request(f"{where} is not valid JSON: {exc}", "messages") from exc
    return out


# tool parser -> (named-function prefix, "required" prefix): the opening of a call in that parser's format.
_CALL_PREFIXES = {
    "qwen3_xml": ("<tool_call>\n<function={name}>\n", "<tool_call>\n<function="),
    "qwen3_coder": ("<tool_call>\n<function={name}>\n", "<tool_call>\n<function="),
    "hermes": ('<tool_call>\n{{"name": "{name}", "arguments": ', '<tool_call>\n{"name": "'),
}


def tool_call_prefill(tool_parser: str, tool_choice: str | NamedToolChoice,
                      thinking_open: bool) -> tuple[str, str]:
    """(text to append to the prompt, the part of it the output parser must see first) for a forced call.

    If the prompt ends inside an open <think> block, the block is closed first: the model then answers with
    the call, as it would after thinking.
    """
    if tool_parser not in _CALL_PREFIXES:
        raise bad_request(f"tool_choice {tool_choice!r} needs a tool-call parser that supports forced calls "
                          f"({sorted(_CALL_PREFIXES)}); this server runs {tool_parser!r}", "tool_choice")
    named, required = _CALL_PREFIXES[tool_parser]
    if tool_choice == "required":
        call_prefix = required
    else:
        name = tool_choice.function.name
        if tool_parser == "hermes":  # inside a JSON string
            name = json.dumps(name)[1:-1]
        elif re.search(r"[<>\s]", name):
            raise bad_request(f"tool_choice names function {name!r}, which a {tool_parser} tool call cannot carry "
                              "(no '<', '>' or whitespace)", "tool_choice")
        call_prefix = named.format(name=name)
    think_close = THINK_END + "\n\n" if thinking_open else ""
    return think_close + call_prefix, call_prefix
