"""Chat prompts and sampling defaults.

- `load_chat_template(value)`: --chat-template is a file path or the template text itself (as in vLLM).
- `ChatRenderer`: OpenAI messages -> the prompt string, through the checkpoint's (or the flag's) Jinja
  template, with tools and chat_template_kwargs (--default-chat-template-kwargs, overridden per request).
- `sampling_defaults(...)`: the checkpoint's generation_config.json sampling defaults, as vLLM reads them,
  with --override-generation-config on top. Request fields win over both.
- `tool_call_prefill(...)`: how tool_choice "required" or a named function steers the model. There is no
  structured output yet, so the server writes the opening of the call after the prompt and the model
  continues it: `<tool_call>\\n<function=NAME>\\n` (qwen3_xml / qwen3_coder) or the hermes JSON head.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from deltaserve.config import ConfigError
from deltaserve.sampling import SamplingParams
from deltaserve.server.errors import bad_request
from deltaserve.server.protocol import ChatMessageIn, NamedToolChoice, ToolDefinition

logger = logging.getLogger(__name__)

# Keys of generation_config.json that vLLM takes as sampling defaults (max_new_tokens becomes max_tokens).
_GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
# --override-generation-config may also set these (vLLM ignores them there; we honour them).
_OVERRIDE_ONLY_KEYS = ("presence_penalty", "frequency_penalty", "max_tokens")
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


def sampling_defaults(model_dir: str | Path, generation_config: str, override: dict) -> dict[str, Any]:
    """Default SamplingParams fields from the checkpoint and --override-generation-config.

    `generation_config`: "auto" reads `model_dir`/generation_config.json, "vllm" reads nothing, anything else
    is a folder holding a generation_config.json. Raises ConfigError naming the flag for a bad value.
    """
    found: dict[str, Any] = {}
    if generation_config != "vllm":
        folder = Path(model_dir) if generation_config == "auto" else Path(generation_config)
        if generation_config != "auto" and not folder.is_dir():
            raise ConfigError(f"--generation-config {generation_config!r}: no such folder")
        file = folder / "generation_config.json"
        if file.is_file():
            try:
                raw = json.loads(file.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise ConfigError(f"cannot read '{file}': {exc}") from exc
            found = {k: raw[k] for k in _GENERATION_CONFIG_KEYS if raw.get(k) is not None}
    if not isinstance(override, dict):
        raise ConfigError(f"--override-generation-config must be a JSON object, got {override!r}")
    unknown = sorted(set(override) - set(_GENERATION_CONFIG_KEYS) - set(_OVERRIDE_ONLY_KEYS))
    if unknown:
        logger.warning("--override-generation-config: ignoring key(s) %s (known: %s)", unknown,
                       sorted(_GENERATION_CONFIG_KEYS + _OVERRIDE_ONLY_KEYS))
    found.update({k: v for k, v in override.items() if k not in unknown and v is not None})
    if "max_new_tokens" in found:  # Hugging Face's name; an explicit max_tokens override wins over it
        found.setdefault("max_tokens", found.pop("max_new_tokens"))
    try:
        SamplingParams(**found)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"generation config defaults {found}: {exc} (see --generation-config and "
                          "--override-generation-config)") from exc
    if found:
        logger.info("default sampling parameters from the generation config: %s (--generation-config vllm "
                    "ignores the checkpoint's)", found)
    return found


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
        except (jinja2.TemplateError, ValueError, TypeError, KeyError) as exc:
            raise bad_request(f"the chat template could not render these messages: {exc}", "messages") from exc
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
            if part.type != "text" or part.text is None:
                raise bad_request(f"messages[{index}].content[{j}]: content part type {part.type!r} is not "
                                  "supported (this server serves text only)", "messages")
            texts.append(part.text)
        out["content"] = "\n".join(texts)
    for j, call in enumerate(out.get("tool_calls") or []):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"messages[{index}].tool_calls[{j}] needs a function with a name", "messages")
        arguments = function.get("arguments")
        if isinstance(arguments, str):  # OpenAI clients send a JSON string; templates iterate a mapping
            try:
                function["arguments"] = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as exc:
                raise bad_request(f"messages[{index}].tool_calls[{j}].function.arguments is not valid JSON: "
                                  f"{exc}", "messages") from exc
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
    call_prefix = required if tool_choice == "required" else named.format(name=tool_choice.function.name)
    think_close = THINK_END + "\n\n" if thinking_open else ""
    return think_close + call_prefix, call_prefix
