"""Reasoning, tool calls, generation defaults and engine failures end to end, on a scripted engine.

The ScriptedEngine "generates" a fixed text token by token (the demo tokenizer, whose <think> and
<tool_call> markers are single tokens as in Qwen's), so each test chooses exactly what the model says.
"""

import asyncio
import itertools
import json

import httpx
import openai
import pytest

from deltaserve.config import ConfigError, EngineConfig
from deltaserve.sampling import SamplingParams
from deltaserve.server.api_server import make_state
from deltaserve.server.async_engine import AsyncEngine
from deltaserve.generation_defaults import sampling_defaults
from deltaserve.server.chat import ChatRenderer
from deltaserve.server.errors import APIError
from deltaserve.server.protocol import ChatMessageIn
from deltaserve.server.settings import ServerSettings
from tests.server.harness import ScriptedEngine, ServerThread

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


@pytest.fixture(scope="module")
def engine(tokenizer):
    return ScriptedEngine(tokenizer)


@pytest.fixture(scope="module")
def server(engine):
    settings = ServerSettings(served_model_names=("scripted",), reasoning_parser="qwen3",
                              tool_call_parser="qwen3_xml", enable_auto_tool_choice=True)
    with ServerThread(make_state(engine, EngineConfig(), settings)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def chat(client, **kwargs):
    return client.chat.completions.create(model="scripted", messages=kwargs.pop("messages", ASK), **kwargs)


def streamed(client, **kwargs):
    """(reasoning, content, {index: (name, arguments)}, finish_reason) accumulated from a stream."""
    reasoning = content = ""
    calls, finish = {}, None
    for chunk in chat(client, stream=True, **kwargs):
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        assert extra.get("reasoning") == extra.get("reasoning_content")
        reasoning += extra.get("reasoning") or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            name, arguments = calls.get(call.index, (None, ""))
            calls[call.index] = (name or call.function.name, arguments + (call.function.arguments or ""))
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, calls, finish


def test_reasoning_is_split_streaming_and_not(engine, client):
    engine.script = "Two plus two.\nIt is four.\n</think>\n\nThe answer is 4."
    message = chat(client).choices[0].message
    assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"] == \
        "Two plus two.\nIt is four."
    assert message.content == "The answer is 4."
    assert message.tool_calls in (None, [])
    assert streamed(client) == ("Two plus two.\nIt is four.", "The answer is 4.", {}, "stop")
    hidden = chat(client, extra_body={"include_reasoning": False}).choices[0].message
    assert hidden.model_extra["reasoning"] is None and hidden.content == "The answer is 4."


def test_thinking_disabled_leaves_everything_as_content(engine, client):
    engine.script = "Plain answer, no thoughts."
    response = chat(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert response.choices[0].message.content == "Plain answer, no thoughts."
    assert response.choices[0].message.model_extra["reasoning"] is None
    prompt = engine.tokenizer.decode(engine.last_prompt_ids)
    assert prompt.endswith("<think>\n\n</think>\n\n")


def test_auto_tool_call_streaming_and_not(engine, client):
    engine.script = "The user wants weather.\n</think>\n\n" + CALL
    response = chat(client, tools=[WEATHER, TIME])
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning"] == "The user wants weather."
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris", "days": 3}
    assert choice.message.tool_calls[0].id

    reasoning, content, calls, finish = streamed(client, tools=[WEATHER, TIME])
    assert (reasoning, content, finish) == ("The user wants weather.", "", "tool_calls")
    assert calls[0][0] == "get_weather" and json.loads(calls[0][1]) == {"city": "Paris", "days": 3}


def test_tool_call_inside_thinking_and_two_calls(engine, client):
    second = "<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>"
    engine.script = "I should look it up.\n" + CALL + "\n" + second
    message = chat(client, tools=[WEATHER, TIME]).choices[0].message
    assert message.model_extra["reasoning"] == "I should look it up."
    assert [c.function.name for c in message.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(message.tool_calls[1].function.arguments) == {"zone": "CET"}
    _, _, calls, _ = streamed(client, tools=[WEATHER, TIME])
    assert [calls[i][0] for i in sorted(calls)] == ["get_weather", "get_time"]
    assert json.loads(calls[1][1]) == {"zone": "CET"}


def test_tool_choice_none_parses_no_calls(engine, client):
    engine.script = "Thinking.\n</think>\n\n" + CALL
    message = chat(client, tools=[WEATHER], tool_choice="none").choices[0].message
    assert not message.tool_calls and "<function=get_weather>" in message.content


def test_named_tool_choice_writes_the_call_opening(engine, client):
    engine.script = "<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
    choice = {"type": "function", "function": {"name": "get_weather"}}
    response = chat(client, tools=[WEATHER, TIME], tool_choice=choice)
    prompt = engine.tokenizer.decode(engine.last_prompt_ids)
    assert prompt.endswith("<think>\n</think>\n\n<tool_call>\n<function=get_weather>\n")
    calls = response.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments) == {"city": "Oslo"}
    _, _, streamed_calls, finish = streamed(client, tools=[WEATHER, TIME], tool_choice=choice)
    assert streamed_calls[0][0] == "get_weather" and json.loads(streamed_calls[0][1]) == {"city": "Oslo"}
    assert finish == "tool_calls"


def test_required_tool_choice(engine, client):
    engine.script = "get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call>"
    calls = chat(client, tools=[WEATHER, TIME], tool_choice="required").choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"]
    assert engine.tokenizer.decode(engine.last_prompt_ids).endswith("<tool_call>\n<function=")


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "not in tools"),
    (dict(tool_choice="required"), "needs a non-empty `tools`"),
    (dict(extra_body={"chat_template_kwargs": {"tokenize": True}}), "may not set"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"properties": [1, 2]}}}]),
     "tools[0].function.parameters.properties must be an object"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"properties": 5}}}]),
     "got 5"),
    (dict(tools=[{"type": "function", "function": {"name": "a b>"}}],
          tool_choice={"type": "function", "function": {"name": "a b>"}}), "cannot carry"),
])
def test_bad_tool_requests(engine, client, kwargs, fragment):
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, **kwargs)
    assert fragment in error.value.body["message"]


def test_history_with_tool_calls_and_results_renders(engine, client):
    engine.script = "It is sunny.\n</think>\n\nSunny in Paris."
    history = ASK + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
    ]
    assert chat(client, messages=history, tools=[WEATHER]).choices[0].message.content == "Sunny in Paris."
    prompt = engine.tokenizer.decode(engine.last_prompt_ids)
    assert "<parameter=city>\nParis\n</parameter>" in prompt and "sunny, 24 C" in prompt
    broken = [history[0], {**history[1], "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}]
    with pytest.raises(openai.BadRequestError, match="arguments is not valid JSON"):
        chat(client, messages=broken)


def test_engine_failure_gives_500_and_the_server_recovers(engine, server, client):
    engine.script = "Fine.\n</think>\n\nOK."
    engine.fail_next_step = True
    response = server.post("/v1/chat/completions", json={"messages": ASK})
    assert response.status_code == 500 and "engine failed" in response.json()["error"]["message"]
    engine.fail_next_step = True
    events = server.post("/v1/chat/completions", json={"messages": ASK, "stream": True}).text.split("\n\n")
    assert any('"error"' in event for event in events) and events[-2] == "data: [DONE]"
    assert chat(client).choices[0].message.content == "OK."
    assert not engine.requests  # the failed requests were aborted in the engine


def test_generation_config_defaults_and_request_overrides(tokenizer):
    engine = ScriptedEngine(tokenizer, script="Hi there, friend.")
    settings = ServerSettings(served_model_names=("scripted",))
    defaults = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 3}
    with ServerThread(make_state(engine, EngineConfig(), settings, defaults)) as server:
        client = server.openai()
        response = client.chat.completions.create(model="scripted", messages=ASK)
        params = engine.last_params
        assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0.6, 20, 0.95, 3)
        assert response.choices[0].finish_reason == "length"
        client.chat.completions.create(model="scripted", messages=ASK, temperature=0.1, max_tokens=7, top_p=0.5)
        params = engine.last_params
        assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0.1, 20, 0.5, 7)
        client.completions.create(model="scripted", prompt="Hi")
        assert engine.last_params.max_tokens == 3  # the default wins over the completions API's 16


def test_stream_interval_and_coalescing(tokenizer):
    """stream_interval 4: the engine thread hands over the first output, every 4th token after it, and the
    last (deltas: the tokens held back go out together). A reader that falls behind gets the queued deltas
    joined into one."""
    engine = ScriptedEngine(tokenizer, script="one two three four five six seven eight nine ten eleven")
    num_tokens = len(tokenizer.encode(engine.script, add_special_tokens=False))

    async def collect(reader_delay: float):
        async_engine = AsyncEngine(engine, stream_interval=4)
        async_engine.start()
        try:
            received = []
            async for output in async_engine.generate("r1", [1, 2, 3], SamplingParams(max_tokens=100)):
                received.append(len(output.outputs[0].token_ids))
                await asyncio.sleep(reader_delay)
            return received
        finally:
            async_engine.shutdown()

    engine.step_seconds = 0.02
    expected = sorted({1, *range(5, num_tokens, 4), num_tokens})  # tokens handed over so far, at each hand-over
    assert list(itertools.accumulate(asyncio.run(collect(reader_delay=0)))) == expected
    engine.step_seconds = 0
    slow = asyncio.run(collect(reader_delay=0.05))
    assert sum(slow) == num_tokens and len(slow) < len(expected)


def test_openai_client_sees_reasoning_over_raw_http_too(engine, server):
    engine.script = "Hmm.\n</think>\n\nYes."
    body = httpx.post(f"{server.base_url}/v1/chat/completions", json={"messages": ASK}).json()
    message = body["choices"][0]["message"]
    assert (message["reasoning"], message["reasoning_content"], message["content"]) == ("Hmm.", "Hmm.", "Yes.")


def test_sampling_defaults_read_like_vllm(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
        "max_new_tokens": 100, "eos_token_id": [1, 2]}))
    assert sampling_defaults(tmp_path, "auto", {}) == {
        "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 100}
    assert sampling_defaults(tmp_path, "vllm", {}) == {}
    assert sampling_defaults(tmp_path / "elsewhere", str(tmp_path), {}) == sampling_defaults(tmp_path, "auto", {})
    override = {"temperature": 0.6, "max_tokens": 16384, "presence_penalty": 1.5, "unknown_key": 1}
    assert sampling_defaults(tmp_path, "auto", override) == {
        "temperature": 0.6, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 16384,
        "presence_penalty": 1.5}
    with pytest.raises(ConfigError, match="top_p must be in"):
        sampling_defaults(tmp_path, "vllm", {"top_p": 2})
    with pytest.raises(ConfigError, match="--generation-config"):
        sampling_defaults(tmp_path, str(tmp_path / "missing"), {})


def test_default_chat_template_kwargs_and_custom_template(tokenizer):
    messages = [ChatMessageIn(role="user", content="Hi")]
    renderer = ChatRenderer(tokenizer, default_kwargs={"enable_thinking": False})
    off = renderer.render(messages, None)
    assert off.prompt.endswith("<think>\n\n</think>\n\n") and not off.thinking_enabled
    on = renderer.render(messages, None, request_kwargs={"enable_thinking": True})
    assert on.prompt.endswith("<think>\n") and on.thinking_enabled and on.thinking_open
    custom = ChatRenderer(tokenizer, chat_template="{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}")
    assert custom.render(messages, None).prompt == "[user] Hi"


@pytest.mark.parametrize("template, fragment", [
    ("{{ raise_exception('needs a system message') }}", "needs a system message"),  # a jinja2.TemplateError
    ("{{ 1 // (messages | length - 1) }}", "division or modulo by zero"),  # ZeroDivisionError
    ("{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}", "maximum recursion depth"),  # RecursionError
    ("{{ messages[0].content.encode('ascii') }}", "codec can't encode"),  # UnicodeEncodeError
])
def test_any_template_failure_is_a_400_naming_messages(tokenizer, template, fragment):
    """Whatever a chat template raises on a request's messages is the request's 400, not the server's 500."""
    renderer = ChatRenderer(tokenizer, chat_template=template)
    with pytest.raises(APIError) as error:
        renderer.render([ChatMessageIn(role="user", content="Hi é")], None)
    assert error.value.status == 400 and error.value.param == "messages"
    assert error.value.message.startswith("the chat template could not render these messages: ")
    assert fragment in error.value.message


def test_the_chat_template_is_rendered_once_at_start_up(tokenizer, monkeypatch, caplog):
    """make_state renders one user message, so that Jinja compiles the template before the first chat request;
    a template that fails on it is logged at start-up and the requests still get their own 400."""
    renders = []
    apply = tokenizer.apply_chat_template
    monkeypatch.setattr(tokenizer, "apply_chat_template", lambda *a, **k: renders.append(1) or apply(*a, **k))
    state = make_state(ScriptedEngine(tokenizer), EngineConfig(), ServerSettings(served_model_names=("s",)))
    assert renders == [1]
    with ServerThread(state) as server:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        assert server.post("/v1/chat/completions", json=body).status_code == 200
    assert renders == [1, 1]
    failing = ServerSettings(served_model_names=("s",), chat_template="{{ raise_exception('needs a system message') }}")
    with caplog.at_level("WARNING", logger="deltaserve.server.chat"):
        state = make_state(ScriptedEngine(tokenizer), EngineConfig(), failing)
    assert "could not render one user message at start-up" in caplog.text and "needs a system message" in caplog.text
    with ServerThread(state) as server:
        error = server.post("/v1/chat/completions", json=body)
        assert error.status_code == 400 and "needs a system message" in error.json()["error"]["message"]


def test_forced_hermes_call_escapes_the_name():
    """A forced call's name goes into the prompt inside a JSON string: quotes and newlines are escaped."""
    from deltaserve.server.chat import tool_call_prefill
    from deltaserve.server.protocol import NamedToolChoice

    choice = NamedToolChoice.model_validate({"type": "function", "function": {"name": 'a"b\n}'}})
    prefill, _ = tool_call_prefill("hermes", choice, thinking_open=False)
    assert json.loads(prefill.removeprefix("<tool_call>\n") + "{}}") == {"name": 'a"b\n}', "arguments": {}}
