"""Request bodies for the hostile-input campaign (test_hostile.py): hand-written malformed ones, and a seeded
generator that breaks valid bodies at random.

    HAND_WRITTEN              [(method, path, headers, raw body)]
    random_body(rng) -> (path, raw body)   a valid body of some route with one to three mutations: a field
                              deleted, given a value of another type or an extreme one, an unknown field added,
                              the whole body replaced, or the JSON text cut, corrupted or given non-JSON numbers
"""

from __future__ import annotations

import copy
import json
import random

_USER = {"role": "user", "content": "Hi there"}
_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "integer"}}}}}

# Valid bodies, each generating at most a few tokens (the campaign's server also defaults max_tokens to 4).
VALID = {
    "/v1/completions": [
        {"prompt": "The sea", "max_tokens": 3},
        {"prompt": [5, 6, 7], "max_tokens": 2, "echo": True, "temperature": 0},
        {"prompt": ["a b", "c"], "max_tokens": 2, "seed": 3, "stop": ["x"]},
        {"prompt": "a b", "max_tokens": 2, "n": 2, "seed": 3},
        {"prompt": "Go", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}, "logprobs": 2},
    ],
    "/v1/chat/completions": [
        {"messages": [_USER], "max_tokens": 3},
        {"messages": [{"role": "system", "content": "Be brief"}, _USER], "max_tokens": 2, "stream": True,
         "top_logprobs": 2, "logprobs": True},
        {"messages": [_USER, {"role": "assistant", "content": "", "tool_calls": [_CALL]},
                      {"role": "tool", "content": "1", "tool_call_id": "call_1"}], "max_tokens": 2},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "max_completion_tokens": 2,
         "chat_template_kwargs": {"enable_thinking": False}},
    ],
    "/tokenize": [{"prompt": "Hello", "return_token_strs": True}, {"messages": [_USER], "tools": [_TOOL]}],
    "/detokenize": [{"tokens": [5, 6, 7]}],
}


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


# Values a field gets instead of its own: wrong types, edges of every range, the too long and the too deep.
EXTREMES = [
    None, True, False, 0, -1, 1, 2, 2**31, 2**63, 2**64, -2**63 - 1, 10**400, 0.5, -0.0, 1e308, -1e308, "", "x",
    "\ud800", "a" * 3000, "word " * 600, [], [None], [[]], [-1], [2**64], [0.5], ["a", 5], {}, {"a": 1},
    {"type": "text"}, [{"role": "user"}], [{"role": "user", "content": [{"type": "text"}]}], _nested(300),
    _nested(40), [5] * 3000,
    # JSON inside strings (tool-call arguments are parsed again)
    '{"a": ' + "[" * 600 + "]" * 600 + "}", '{"a": ' + "7" * 5000 + "}", "[1", "{}", "null", '{"a": NaN}',
]
_KEYS = ["role", "content", "tool_calls", "tool_call_id", "name", "type", "text", "function", "arguments",
         "model", "prompt", "messages", "n", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
         "min_p", "seed", "stop", "stop_token_ids", "logprobs", "top_logprobs", "echo", "stream",
         "stream_options", "tools", "tool_choice", "response_format", "logit_bias", "best_of", "suffix",
         "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos",
         "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "tokens", "user",
         "include_stop_str_in_output", "skip_special_tokens", "add_special_tokens", "return_token_strs"]
_TEXT_NUMBERS = [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999", b"7" * 5000, b"0x10", b"01", b"1.", b"+1"]


def _value(rng: random.Random):
    return copy.deepcopy(rng.choice(EXTREMES))  # a later mutation may edit it in place


def _slots(body) -> list[tuple]:
    """(container, key) of every value in the body, at any depth: dict keys and list positions."""
    slots, stack = [], [body]
    while stack and len(slots) < 400:  # an inserted value may be huge or deep: a sample is enough
        value = stack.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, child in items:
            slots.append((value, key))
            if isinstance(child, (dict, list)):
                stack.append(child)
    return slots


def _mutate_fields(rng: random.Random, body: dict) -> None:
    """Delete a value anywhere in the body, replace it, or add a field beside it."""
    slots = _slots(body)
    container, key = rng.choice(slots) if slots else (body, None)
    action = rng.randrange(4)
    if action == 0 and key is not None:
        del container[key]
    elif action in (1, 2) and key is not None:
        container[key] = _value(rng)
    elif isinstance(container, dict):
        container[rng.choice(_KEYS)] = _value(rng)
    else:
        container.append(_value(rng))


def _mutate_text(rng: random.Random, text: bytes) -> bytes:
    action = rng.randrange(6)
    if action == 0:
        return text[:rng.randrange(len(text))]  # cut short
    if action == 1:
        i = rng.randrange(len(text))
        return text[:i] + bytes([rng.randrange(256)]) + text[i + 1:]  # one byte changed
    if action == 2:
        i = rng.randrange(len(text))
        return text[:i] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 8))) + text[i:]
    if action == 3:  # a number JSON does not have, or Python will not convert
        digits = [i for i, byte in enumerate(text) if chr(byte).isdigit()]
        if digits:
            i = rng.choice(digits)
            return text[:i] + rng.choice(_TEXT_NUMBERS) + text[i + 1:]
        return text
    if action == 4:  # a key given twice
        return text.replace(b"{", b'{"n": 1, "n": 500, ', 1)
    return b"\xef\xbb\xbf" + text  # a byte-order mark


def random_body(rng: random.Random) -> tuple[str, bytes]:
    """One malformed (sometimes still valid) body for a random route."""
    path = rng.choice(sorted(VALID))
    body = json.loads(json.dumps(rng.choice(VALID[path])))  # a deep copy
    if rng.random() < 0.05:
        return path, json.dumps(_value(rng)).encode()  # not an object at all
    for _ in range(rng.randint(1, 3)):
        _mutate_fields(rng, body)
    text = json.dumps(body).encode()
    if rng.random() < 0.3:
        text = _mutate_text(rng, text)
    return path, text


_JSON = {"content-type": "application/json"}


def _post(path: str, body) -> tuple:
    return ("POST", path, _JSON, json.dumps(body).encode())


def _chat(*messages, **fields) -> tuple:
    return _post("/v1/chat/completions", {"messages": list(messages), "max_tokens": 1, **fields})


def _called(arguments: str) -> dict:
    """An assistant turn that called a tool with these arguments (a JSON string, as OpenAI clients send)."""
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}


HAND_WRITTEN = [
    ("POST", "/v1/completions", _JSON, b""),
    ("POST", "/v1/completions", _JSON, b"null"),
    ("POST", "/v1/completions", _JSON, b"   \n"),
    ("POST", "/v1/completions", {"content-type": "text/plain"}, b'{"prompt": "hi", "max_tokens": 2}'),
    ("POST", "/v1/completions", {}, b'{"prompt": "hi", "max_tokens": 2}'),
    ("POST", "/v1/completions", _JSON, b'{"prompt": "hi", "seed": ' + b"7" * 5001 + b"}"),
    # issue 29's findings: echo decoding ids out of range, fan-out, seeds past 64 bits, JSON nested in arguments
    *[_post("/v1/completions", {"prompt": ids, "echo": True, "max_tokens": 2}) for ids in ([-1], [2**32], [2**64])],
    _post("/v1/completions", {"prompt": ["hi"] * 64, "n": 128, "max_tokens": 1}),
    _post("/v1/completions", {"prompt": ["a"] * 5000}),
    _post("/v1/completions", {"prompt": "hi", "seed": 2**64}),
    _post("/v1/completions", {"prompt": "hi", "seed": -2**63 - 1}),
    *[_chat(_USER, _called('{"a": ' + "[" * depth + "]" * depth + "}"), {"role": "tool", "content": "1"})
      for depth in (300, 489, 2000)],
    _post("/tokenize", {"messages": [_USER, _called('{"a": ' + "[" * 489 + "]" * 489 + "}")]}),
    _chat(_called('{"a": ' + "7" * 5001 + "}")),
    _chat(_called("[1")),
    _chat({"role": "user", "content": [{"type": "text"}]}),
    # JSON text in a constraint: a schema 300 levels deep compiled for seconds, 1,500 levels recursed
    *[_post("/v1/completions", {"prompt": "hi", "structured_outputs": {"json": '{"type": "array", "items": ' * depth
                                                                       + "{}" + "}" * depth}})
      for depth in (300, 1500)],
    _post("/v1/completions", {"prompt": "hi", "guided_json": "[" * 100_000}),
    _post("/v1/completions", {"prompt": [1] * 100_000}),  # past the context
    _post("/v1/completions", {"prompt": [[]]}),
    _post("/v1/completions", {"prompt": "hi", "stop": ["a"] * 2000, "max_tokens": 2}),
    _post("/v1/completions", {"prompt": "hi", "stop_token_ids": [2**64]}),
    _post("/v1/completions", {"prompt": "hi", "model": "m" * 100_000}),
    _post("/v1/completions", {"prompt": "hi", "suffix": "x"}),
    _post("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 1}),
    _chat(*[_USER] * 3000),
    _chat({"role": "tool", "content": "x"}),
    _chat(_USER, tool_choice={"type": "function", "function": {"name": "nope"}}, tools=[_TOOL]),
    _chat(_USER, chat_template_kwargs={"messages": []}),
    _chat(_USER, chat_template_kwargs={"enable_thinking": [1, 2]}),
    _chat(_USER, continue_final_message=True),
    _chat({"role": "assistant", "content": "", "tool_calls": ["not a call", 5, None]}),
    _post("/tokenize", {"prompt": "hi", "messages": [_USER]}),
    _post("/tokenize", {}),
    _post("/detokenize", {"tokens": [-1]}),
    _post("/detokenize", {"tokens": [2**64]}),
    _post("/detokenize", {"tokens": []}),
    ("GET", "/v1/completions", {}, b""),
    ("PUT", "/tokenize", _JSON, b"{}"),
    ("OPTIONS", "/v1/chat/completions", {}, b""),
    ("HEAD", "/health", {}, b""),
    ("GET", "/v1/models?x=%ff%fe", {}, b""),
    ("GET", "/%ff/..%2f..%2fetc/passwd", {}, b""),
    ("POST", "/v1/completions", {**_JSON, "authorization": "Bearer " + "k" * 10_000}, b"{}"),
]
