"""Structured output over HTTP on the random-weight tiny model (its free output is noise, so only the grammar can
make a reply valid): response_format, vLLM's structured_outputs and guided_* fields, forced tool calls in both
tool-call formats, thinking before the constrained answer, streaming and not, and the 400s."""

import json

import httpx
import jsonschema
import openai
import pytest

from deltaserve.config import EngineConfig
from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.server.api_server import make_state
from deltaserve.server.json_limits import MAX_JSON_DEPTH
from deltaserve.server.settings import ServerSettings
from tests.server.harness import ServerThread
from tests.structured.schemas import random_schema

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
    "zone": {"type": "string", "maxLength": 6}, "utc": {"type": "boolean"}}, "required": ["zone"]}}}
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}


def _serve(checkpoint, **settings):
    config = EngineConfig(model=str(checkpoint), max_model_len=1024, max_num_seqs=16)
    return ServerThread(make_state(LLMEngine(config), config, ServerSettings(served_model_names=("tiny",),
                                                                             **settings)))


@pytest.fixture(scope="module")
def server(make_checkpoint):
    with _serve(make_checkpoint("qwen3_5"), reasoning_parser="qwen3", tool_call_parser="qwen3_xml") as running:
        yield running


@pytest.fixture(scope="module")
def hermes(make_checkpoint):
    with _serve(make_checkpoint("qwen3_5"), tool_call_parser="hermes") as running:
        yield running


def chat(client, **kwargs):
    return client.chat.completions.create(model="tiny", messages=kwargs.pop("messages", ASK),
                                          max_tokens=kwargs.pop("max_tokens", 300), **kwargs)


def streamed(client, **kwargs):
    """(reasoning, content, {index: (name, arguments)}, finish_reason) accumulated from a stream."""
    reasoning = content = ""
    calls, finish = {}, None
    for chunk in chat(client, stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning") or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            name, arguments = calls.get(call.index, (None, ""))
            calls[call.index] = (name or call.function.name, arguments + (call.function.arguments or ""))
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, calls, finish


def test_response_format_json_schema_streaming_and_not(server):
    client = server.openai()
    schema = random_schema(3)
    response_format = {"type": "json_schema", "json_schema": {"name": "record", "schema": schema, "strict": True}}
    for seed in (1, 2):
        message = chat(client, response_format=response_format, seed=seed, extra_body=NO_THINKING).choices[0].message
        jsonschema.validate(json.loads(message.content), schema)
        _, content, _, finish = streamed(client, response_format=response_format, seed=seed, extra_body=NO_THINKING)
        assert finish == "stop" and content == message.content
    completion = client.completions.create(model="tiny", prompt="A record:", max_tokens=300, seed=7,
                                           extra_body={"response_format": response_format})
    jsonschema.validate(json.loads(completion.choices[0].text), schema)
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="A record:", max_tokens=300, seed=7, stream=True,
        extra_body={"response_format": response_format}))
    assert text == completion.choices[0].text


@pytest.mark.parametrize("body, check", [
    ({"guided_json": random_schema(5)}, lambda t: jsonschema.validate(json.loads(t), random_schema(5)) is None),
    ({"guided_json": json.dumps(random_schema(6))},
     lambda t: jsonschema.validate(json.loads(t), random_schema(6)) is None),
    ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, lambda t: len(t) == 6 and t[3] == "-"),
    ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
    ({"guided_grammar": 'root ::= "ok" | "not ok"'}, lambda t: t in ("ok", "not ok")),
    ({"structured_outputs": {"choice": ["a", "b"]}, "n": 3}, lambda t: t in ("a", "b")),
    ({"structured_outputs": {"json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
                             "disable_any_whitespace": True}},
     lambda t: len(json.loads(t)) <= 3 and t == json.dumps(json.loads(t))),  # json.dumps' separators, no others
    ({"response_format": {"type": "json_object"}, "seed": 6, "temperature": 1.0},
     lambda t: isinstance(json.loads(t), dict)),
])
def test_constraint_fields(server, body, check):
    body = {"model": "tiny", "prompt": "Answer:", "max_tokens": 300, **body}
    response = server.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    for choice in response.json()["choices"]:
        assert choice["finish_reason"] == "stop" and check(choice["text"]), choice["text"]


def test_thinking_then_the_constrained_answer(server):
    client = server.openai()
    schema = random_schema(8)
    body = {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}, "seed": 3,
            "extra_body": {"thinking_token_budget": 5}}
    message = chat(client, **body).choices[0].message
    assert message.model_extra["reasoning"] and "</think>" not in message.content
    jsonschema.validate(json.loads(message.content), schema)
    reasoning, content, _, finish = streamed(client, **body)
    assert (reasoning, content, finish) == (message.model_extra["reasoning"], message.content, "stop")
    # no constraint: the budget alone closes the thinking, and the answer is free
    message = chat(client, max_tokens=12, extra_body={"thinking_token_budget": 3}).choices[0].message
    assert message.model_extra["reasoning"] and message.content


@pytest.mark.parametrize("which", ["qwen3_xml", "hermes"])
def test_forced_tool_calls_have_arguments_that_validate(server, hermes, which):
    client = (server if which == "qwen3_xml" else hermes).openai()
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in (1, 2):
        response = chat(client, tools=[WEATHER, TIME], tool_choice=named, seed=seed, temperature=1.0)
        (call,) = response.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and response.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
        _, _, calls, finish = streamed(client, tools=[WEATHER, TIME], tool_choice=named, seed=seed, temperature=1.0)
        assert calls == {0: ("get_weather", call.function.arguments)} and finish == "tool_calls"
    for seed, parallel in ((3, False), (4, True), (5, True)):
        response = chat(client, tools=[WEATHER, TIME], tool_choice="required", seed=seed, temperature=1.0,
                        parallel_tool_calls=parallel)
        calls = response.choices[0].message.tool_calls
        assert calls and (parallel or len(calls) == 1)
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# an array schema one level deeper than a body may nest, as JSON text
_DEEP_SCHEMA_TEXT = '{"type": "array", "items": ' * MAX_JSON_DEPTH + '{"type": "integer"}' + "}" * MAX_JSON_DEPTH


@pytest.mark.parametrize("body, param, fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nothing"}}}},
     "response_format", 'response_format.json_schema.schema: the JSON schema cannot be used: Unsupported type'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "json_schema.schema is required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "array", "uniqueItems": True}}}},
     "response_format", "cannot enforce 'uniqueItems'"),
    ({"guided_regex": "([a-z"}, "guided_regex", "guided_regex: the regex cannot be used: Regex parsing error"),
    ({"guided_grammar": "root ::= "}, "guided_grammar", "EBNF parser error"),
    ({"guided_choice": []}, "guided_choice", "non-empty list of strings"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one output constraint"),
    ({"structured_outputs": {"regex": "a", "color": 1}}, "structured_outputs", "unknown field(s) ['color']"),
    ({"structured_outputs": {"json": {}, "whitespace_pattern": " "}}, "structured_outputs", "whitespace_pattern"),
    ({"guided_whitespace_pattern": " ", "guided_json": {}}, "guided_whitespace_pattern", "not supported"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend", "xgrammar"),
    ({"guided_regex": "a", "min_tokens": 2}, "min_tokens", "min_tokens must be 0 with structured_outputs"),
    # JSON text inside a string is bounded as the body is (Python's parser and xgrammar's compile recursed)
    ({"structured_outputs": {"json": _DEEP_SCHEMA_TEXT}}, "structured_outputs",
     f"structured_outputs.json: nested too deeply (more than {MAX_JSON_DEPTH} levels)"),
    ({"guided_json": "[" * 100_000 + "]" * 100_000}, "guided_json", "guided_json: nested too deeply"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": _DEEP_SCHEMA_TEXT}}}, "response_format",
     "response_format.json_schema.schema: nested too deeply"),
    ({"structured_outputs": {"structural_tag": '{"a": ' * 2000 + "1" + "}" * 2000}}, "structured_outputs",
     "structured_outputs.structural_tag: nested too deeply"),
    ({"guided_json": '{"maxItems": ' + "7" * 5000 + "}"}, "guided_json",
     "guided_json: maxItems: an integer of 5,000 digits"),
])
def test_bad_constraints_are_400s_naming_the_field(server, body, param, fragment):
    response = server.post("/v1/completions", json={"model": "tiny", "prompt": "x", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"], error
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_bad_chat_constraints_are_400s_naming_the_field(server, hermes):
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"not": {"type": "string"}}}}}}
    for client, kwargs, param, fragment in [
        (server, dict(tools=[bad_tool], tool_choice="required"), "tools", "tools[0].function.parameters: xgrammar "
                                                                          "cannot enforce 'not' (at properties.x)"),
        (server, dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
         "response_format", "cannot be combined with response_format"),
        (hermes, dict(extra_body={"thinking_token_budget": 4}), "thinking_token_budget", "--reasoning-parser"),
    ]:
        with pytest.raises(openai.BadRequestError) as error:
            chat(client.openai(), **kwargs)
        assert error.value.body["param"] == param and fragment in error.value.body["message"]
