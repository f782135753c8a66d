"""The HTTP API on a real (tiny, random) model, through the official openai client and raw HTTP.

One server for the module: the tiny qwen3_5 checkpoint served as "tiny" and "tiny-alias".
"""

import concurrent.futures
import json

import httpx
import openai
import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.config import EngineConfig
from deltaserve.engine.tokenize import CheckedTokenIds
from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.server.api_server import make_state
from deltaserve.server.json_limits import MAX_JSON_DEPTH, nested_deeper_than
from deltaserve.server.settings import ServerSettings
from tests.server.harness import ServerThread, wait_until

ENGINE_ARGS = dict(max_model_len=2048, max_num_seqs=8)
MAX_MODEL_LEN = ENGINE_ARGS["max_model_len"]
PROMPT = "The traveller walked from the mountains to the sea"
MESSAGES = [{"role": "user", "content": "Where are you going?"}]
LONG_RUN = 2000  # output tokens of a request that is still running when the test interrupts it


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    return make_checkpoint("qwen3_5")


@pytest.fixture(scope="module")
def server(checkpoint):
    config = EngineConfig(model=str(checkpoint), enable_prefix_caching=True, **ENGINE_ARGS)
    settings = ServerSettings(served_model_names=("tiny", "tiny-alias"))
    with ServerThread(make_state(LLMEngine(config), config, settings, model_root=str(checkpoint))) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


@pytest.fixture(scope="module")
def offline(checkpoint):
    return LLM(str(checkpoint), **ENGINE_ARGS)


def test_models_health_version(server, client, checkpoint):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny", "tiny-alias"]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert models[0].model_extra["root"] == str(checkpoint)
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/version").json()["version"]


def test_greedy_completion_matches_offline_generate(client, offline):
    expected = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    response = client.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=24)
    assert response.choices[0].text == expected.outputs[0].text
    assert response.choices[0].finish_reason == expected.outputs[0].finish_reason
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_greedy_chat_matches_offline_generate(client, offline):
    prompt = offline.get_tokenizer().apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    expected = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=20)
    assert response.choices[0].message.content == expected.outputs[0].text
    assert response.choices[0].message.role == "assistant"
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_streaming_equals_non_streaming_with_usage(client):
    whole = client.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=20)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=20,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason

    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=20)
    stream = list(client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=20,
                                                 stream=True, stream_options={"include_usage": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat.choices[0].message.content
    assert stream[-1].usage.total_tokens == chat.usage.total_tokens


def test_streaming_without_include_usage_sends_no_usage(client):
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, stream=True))
    assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)


def test_alias_and_unknown_model(client):
    assert client.completions.create(model="tiny-alias", prompt=PROMPT, max_tokens=2).model == "tiny"
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    assert error.value.body["param"] == "model" and "nope" in error.value.body["message"]


def test_n_seed_and_reproducibility(client):
    def sample(seed, n=1):
        return client.completions.create(model="tiny", prompt=PROMPT, temperature=1.0, max_tokens=12, seed=seed, n=n,
                                         extra_body={"ignore_eos": True})

    first, again, other = sample(1234), sample(1234), sample(99)
    assert first.choices[0].text == again.choices[0].text
    assert first.choices[0].text != other.choices[0].text
    three = sample(7, n=3)
    assert sorted(c.index for c in three.choices) == [0, 1, 2]
    assert len({c.text for c in three.choices}) > 1  # each choice draws its own samples
    assert three.usage.completion_tokens == 36
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, n=2, max_tokens=4, seed=3)
    assert [c.index for c in chat.choices] == [0, 1]


def test_stop_string_cuts_the_output(client):
    full = client.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=24).choices[0].text
    stop = full[8:11]
    assert stop and stop in full
    cut = client.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=24, stop=[stop])
    assert cut.choices[0].text == full[:full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].model_extra["stop_reason"] == stop


def test_streamed_text_with_stop_strings_equals_the_whole_text(client):
    """A stream never sends what a stop string later cuts: its pieces join to the non-streamed text, for stops
    starting anywhere in the output (a stop's first characters are held back until the next tokens decide)."""
    full = client.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=16).choices[0].text
    for start in range(1, len(full) - 2, 2):
        stop = full[start:start + 3]
        whole = client.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=16, stop=[stop])
        chunks = client.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=16, stop=[stop],
                                           stream=True)
        assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text == full[:full.index(stop)]


def test_logprobs(client):
    response = client.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=6, logprobs=2)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert "".join(logprobs.tokens) == response.choices[0].text
    for lp, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert 2 <= len(top) <= 3 and lp <= 0
        assert lp == pytest.approx(max(top.values()))  # greedy: the sampled token is the most likely
    assert logprobs.text_offset[0] == 0

    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=5,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token


def test_batched_token_and_echo_prompts(server, client):
    tokens = server.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_text = client.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=8)
    batch = client.completions.create(model="tiny", prompt=[tokens, tokens[:3]], temperature=0, max_tokens=8, n=2)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    assert [c.text for c in batch.choices if c.index < 2] == [by_text.choices[0].text] * 2
    texts = client.completions.create(model="tiny", prompt=["Hello", PROMPT], temperature=0, max_tokens=8)
    assert [c.index for c in sorted(texts.choices, key=lambda c: c.index)] == [0, 1]
    assert next(c.text for c in texts.choices if c.index == 1) == by_text.choices[0].text
    echo = client.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=8, echo=True)
    assert echo.choices[0].text == PROMPT + by_text.choices[0].text


def test_the_servers_checked_ids_reach_the_engine(server, client, monkeypatch):
    """Text, token-id and chat prompts reach the engine as the server checked them, which the engine does not
    scan again."""
    engine = server.state.engine.engine
    seen, encode = [], engine._encode
    monkeypatch.setattr(engine, "_encode", lambda prompt: seen.append(type(prompt)) or encode(prompt))
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1)
    client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=1)
    client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
    assert seen == [CheckedTokenIds] * 3


def test_tokenize_detokenize(server):
    tokenized = server.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) == len(tokenized["token_strs"])
    assert tokenized["max_model_len"] == MAX_MODEL_LEN
    assert server.post("/detokenize", json={"tokens": tokenized["tokens"]}).json()["prompt"] == PROMPT
    chat = server.post("/tokenize", json={"messages": MESSAGES}).json()
    assert chat["count"] > tokenized["count"] - 10  # the template wraps the message
    assert server.post("/detokenize", json={"tokens": [10**6]}).status_code == 400


def test_non_finite_logprobs_are_reported_as_the_floor():
    """A token the sampler masked out has logprob -inf, and overflowing logits give NaN; JSON carries neither, so
    both are reported as MIN_LOGPROB (as vLLM does) rather than failing the response after the request ran."""
    from types import SimpleNamespace

    from deltaserve.outputs import CompletionOutput, Logprob
    from deltaserve.server.serving import MIN_LOGPROB, chat_logprobs, completion_logprobs

    state = SimpleNamespace(token_text=lambda token_id: f"t{token_id}")
    output = CompletionOutput(0, "t1t2", [1, 2], None, [
        {1: Logprob(float("-inf"), 1), 3: Logprob(float("nan"), 2)},
        {2: Logprob(-0.5, 1)},
    ])
    legacy = completion_logprobs(state, output, 0, 2, 0)
    assert legacy.token_logprobs == [MIN_LOGPROB, -0.5]
    assert legacy.top_logprobs[0] == {"t1": MIN_LOGPROB, "t3": MIN_LOGPROB}
    chat = chat_logprobs(state, output, 0, 2, top_n=2)
    assert [entry.logprob for entry in chat] == [MIN_LOGPROB, -0.5]
    assert [top.logprob for top in chat[0].top_logprobs] == [MIN_LOGPROB, MIN_LOGPROB]


_LONG = "word " * 2100  # > MAX_MODEL_LEN tokens


def _nested(depth: int) -> str:
    """Tool-call arguments (a JSON object as text) holding `depth` - 1 nested arrays."""
    return '{"a": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"


def _with_arguments(arguments: str) -> list[dict]:
    """A conversation whose assistant turn called a tool with these arguments."""
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "done", "tool_call_id": "call_1"}]

ERROR_CASES = [
    # (path, raw body, status, param, message fragment)
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi",', 400, None, "not valid JSON"),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None, "UTF-8"),
    ("/v1/completions", b'["not", "an", "object"]', 400, None, "JSON object"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature", "valid number"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens", "integer"),
    ("/v1/completions", {"prompt": "hi", "n": 100000}, 400, "n", "128"),
    # at most half of max_num_seqs (8 here) sequences a request: 64 prompts x 128 would have queued 8,192
    ("/v1/completions", {"prompt": ["hi"] * 64, "n": 128}, 400, "n",
     "64 prompts x n=128 = 8,192 sequences; a request may run at most 4 (--max-num-seqs-per-request)"),
    ("/v1/completions", {"prompt": [[5]] * 5}, 400, "prompt", "5 prompts x n=1 = 5 sequences"),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 5}, 400, "n", "n=5 sequences; a request may run at most 4"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens",
     f"maximum context length is {MAX_MODEL_LEN} tokens, you requested"),
    ("/v1/completions", {"prompt": _LONG}, 400, "prompt", f"maximum context length is {MAX_MODEL_LEN}"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": _LONG}]}, 400, "messages",
     f"maximum context length is {MAX_MODEL_LEN}"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", "top_p must be in (0, 1]"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature", "temperature must be >= 0"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "must not be empty"),
    ("/v1/completions", {"prompt": ["a", ""]}, 400, "prompt", "prompt[1] must not be empty"),
    ("/v1/completions", {"prompt": [5, 10**7]}, 400, "prompt", "out of range"),
    # echo decodes the prompt: the ids are checked first (a C long would overflow on these)
    ("/v1/completions", {"prompt": [-1], "echo": True, "max_tokens": 2}, 400, "prompt", "token id -1 is out of range"),
    ("/v1/completions", {"prompt": [2**32], "echo": True, "max_tokens": 2}, 400, "prompt", "out of range"),
    ("/v1/completions", {"prompt": [[5], [2**64]], "echo": True, "max_tokens": 2}, 400, "prompt",
     f"prompt[1]: token id {2**64} is out of range"),
    ("/v1/completions", b'{"prompt": "\\ud800 lone surrogate"}', 400, "prompt", "tokenized"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 1}}, 400, "logit_bias", "not supported"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**64}, 400, "seed", "seed must be in [-2**63, 2**63)"),
    ("/v1/chat/completions", {"messages": MESSAGES, "seed": -2**63 - 1}, 400, "seed", "vLLM's range"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options", ""),
    ("/v1/completions", {}, 400, "prompt", "Field required"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "at least 1"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages", "role"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages", "role"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 10**6}, 400,
     "max_completion_tokens", "maximum context length"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tool_choice", "--enable-auto-tool-choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages", "text only"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                        {"type": "text"}]}]}, 400,
     "messages", "messages[0].content[1]: a text content part needs `text`, a string"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "nothing"}}}}, 400, "response_format", 'Unsupported type "nothing"'),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 50, "logprobs": True}, 400,
     "top_logprobs", ""),
    ("/v1/completions", b'{"prompt": "hi", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, None, "nested too deeply"),
    # deeper than MAX_JSON_DEPTH, shallower than any Python's parser limit: refused on 3.11 and 3.12 alike
    ("/v1/completions", b'{"prompt": "hi", "x": ' + b"[" * 300 + b"]" * 300 + b"}", 400, None, "nested too deeply"),
    ("/v1/completions", b'{"prompt": "hi", "seed": ' + b"7" * 5000 + b"}", 400, "seed",
     "seed: an integer of 5,000 digits is longer than this server reads (4,300 digits)"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi", "x": [1, ' + b"7" * 5001 + b"]}]}",
     400, "messages", "messages.0.x.1: an integer of 5,001 digits"),
    ("/v1/completions", b'{"prompt": "hi", "seed": ' + b"7" * 5000 + b", }", 400, None, "not valid JSON"),
    # JSON inside a string (tool-call arguments) is bounded as the body is: the template recursed past Python's
    # limit on ~489 levels (a 500), and json.loads itself past ~1,000
    ("/v1/chat/completions", {"messages": _with_arguments(_nested(489))}, 400, "messages",
     "messages[1].tool_calls[0].function.arguments: nested too deeply (more than 256 levels)"),
    ("/tokenize", {"messages": _with_arguments(_nested(489))}, 400, "messages", "arguments: nested too deeply"),
    ("/tokenize", {"messages": _with_arguments(_nested(5000))}, 400, "messages", "arguments: nested too deeply"),
    ("/tokenize", {"messages": _with_arguments('{"a": ' + "7" * 5001 + "}")}, 400, "messages",
     "arguments: a: an integer of 5,001 digits"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": 1e999}', 400, "temperature", "finite number"),
    ("/v1/completions", b'{"prompt": "hi", "model": "\\ud800"}', 404, "model", "\\ud800"),  # echoed, escaped
    ("/v1/nowhere", {}, 404, None, "Not Found"),
]


def test_wrong_method_is_a_405_with_allow(server):
    """RFC 9110: a 405 says which methods the resource takes."""
    for method, path, allowed in [("GET", "/v1/completions", {"POST"}), ("DELETE", "/v1/chat/completions", {"POST"}),
                                  ("POST", "/health", {"GET"}), ("PUT", "/v1/models", {"GET"})]:
        response = httpx.request(method, f"{server.base_url}{path}")
        assert response.status_code == 405 and response.json()["error"]["type"] == "invalid_request_error"
        assert {m.strip() for m in response.headers["allow"].split(",")} == allowed, (method, path)


def test_json_nesting_depth_is_counted_without_recursion():
    nested = {"a": [1, [2, {"b": []}]]}  # object, list, list, object, list: 5 levels
    assert not nested_deeper_than(nested, 5) and nested_deeper_than(nested, 4)
    assert not nested_deeper_than({}, 1) and not nested_deeper_than("text", 1)
    deep: list = []
    for _ in range(20000):  # deeper than Python's recursion limit: built in a loop, walked without recursing
        deep = [deep]
    assert nested_deeper_than(deep, MAX_JSON_DEPTH) and not nested_deeper_than(deep, 20001)


@pytest.mark.parametrize("path, body, status, param, fragment", ERROR_CASES,
                         ids=[f"{i}-{c[0].rsplit('/', 1)[-1]}" for i, c in enumerate(ERROR_CASES)])
def test_errors_are_openai_shaped_and_the_server_keeps_serving(server, client, path, body, status, param,
                                                               fragment):
    if isinstance(body, bytes):
        response = server.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = server.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert fragment in error["message"]
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices[0].text is not None


def test_a_text_too_long_for_any_tokenization_is_refused_before_tokenizing(server, checkpoint):
    """More characters than max_model_len tokens can hold (twice the longest vocabulary entry each): refused at
    once, chat messages included; a text just under that bound is tokenized (and refused for its tokens)."""
    from transformers import AutoTokenizer

    bound = MAX_MODEL_LEN * 2 * max(len(token) for token in AutoTokenizer.from_pretrained(checkpoint).get_vocab())
    for path, body in [("/v1/completions", {"prompt": "a" * (bound + 1)}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * (bound + 1)}]})]:
        error = server.post(path, json=body).json()["error"]
        assert error["code"] == "context_length_exceeded" and "characters" in error["message"]  # chat: + template
    error = server.post("/v1/completions", json={"prompt": "a " * (bound // 2)}).json()["error"]
    assert "characters" not in error["message"] and "you requested" in error["message"]


def test_stream_disconnect_aborts_and_frees_blocks(server):
    aborted_before = server.metric("vllm:request_success_total", 'finished_reason="abort"')
    body = {"prompt": PROMPT, "max_tokens": LONG_RUN, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert server.metric("vllm:num_requests_running") == 1
        assert server.metric("vllm:kv_cache_usage_perc") > 0
    # Leaving the block closed the connection mid-stream.
    wait_until(lambda: server.metric("vllm:num_requests_running") == 0, 20, what="the request aborted")
    wait_until(lambda: server.metric("vllm:kv_cache_usage_perc") == 0, 20, what="blocks freed")
    assert server.metric("vllm:request_success_total", 'finished_reason="abort"') == aborted_before + 1


def test_non_streaming_disconnect_aborts_and_frees_blocks(server):
    """With n = 2 the aborted request counts twice, as a finished one counts each choice."""
    aborted_before = server.metric("vllm:request_success_total", 'finished_reason="abort"')
    body = {"prompt": PROMPT, "max_tokens": LONG_RUN, "ignore_eos": True, "n": 2}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
    wait_until(lambda: server.metric("vllm:request_success_total", 'finished_reason="abort"') == aborted_before + 2,
               20, what="the request aborted")
    assert server.metric("vllm:num_requests_running") == 0
    assert server.metric("vllm:kv_cache_usage_perc") == 0


def test_a_small_request_beside_a_max_size_fan_out_runs_in_its_own_steps(server):
    """Fair admission: a request at --max-num-seqs-per-request (by default half the seats) runs long; a small
    request sent meanwhile is admitted at the first step after it arrives and finishes in the steps its own
    tokens take (the scheduler's rule: ceil(prompt / (budget - the fan-out's decode rows)) prompt chunks, then one
    step per further token), while the fan-out is still running: it waits for neither the fan-out's sequences
    nor a seat. With a limit of every seat it would wait for a fan-out sequence to end (LONG_RUN steps)."""
    engine = server.state.engine.engine
    scheduler = engine.scheduler
    limit = server.state.max_num_seqs_per_request
    steps: list[tuple[dict[str, str], set[str]]] = []  # per step: {id: group} before it, the ids it scheduled
    original = scheduler.schedule

    def recording():
        present = {r.request_id: r.group for r in [*scheduler.waiting, *scheduler.running]}
        out = original()
        steps.append((present, {row.request_id for row in out.sequences}))
        return out

    fan_out = {"prompt": PROMPT, "max_tokens": LONG_RUN, "ignore_eos": True, "stream": True, "n": limit}
    small_prompt = [11, 523, 87, 301, 42, 9]  # no prefix shared with PROMPT
    small_tokens = 4
    scheduler.schedule = recording
    try:
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=fan_out, timeout=60) as response:
            lines = response.iter_lines()  # held: a collected iterator closes the connection
            assert next(line for line in lines if line.startswith("data: "))
            wait_until(lambda: server.metric("vllm:num_requests_running") == limit, 20, what="the fan-out running")
            small = server.post("/v1/completions", json={"prompt": small_prompt, "max_tokens": small_tokens,
                                                         "ignore_eos": True, "temperature": 0})
            assert small.status_code == 200, small.text
    finally:
        del scheduler.schedule
    small_group = small.json()["id"]
    first = next(i for i, (present, _) in enumerate(steps) if small_group in present.values())
    small_id = next(rid for rid, group in steps[first][0].items() if group == small_group)
    ran = [i for i, (_, scheduled) in enumerate(steps) if small_id in scheduled]
    prompt_chunks = -(-len(small_prompt) // (scheduler.max_num_batched_tokens - limit))
    assert ran == list(range(first, first + prompt_chunks + small_tokens - 1)), (first, ran)
    fan_out_group = next(group for group in steps[first][0].values() if group != small_group)
    assert any(fan_out_group in present.values() for present, _ in steps[ran[-1] + 1:]), "the fan-out ended first"
    wait_until(lambda: server.metric("vllm:num_requests_running") == 0, 20, what="the fan-out aborted")


def test_cached_tokens_are_reported(server, client):
    """The engine caches prompt prefixes: a repeated prompt reports its cached tokens in usage and /metrics."""
    prompt = "A prompt long enough to fill a few cache blocks, sent twice in a row. " * 3
    hits_before = server.metric("vllm:prefix_cache_hits_total")
    queries_before = server.metric("vllm:prefix_cache_queries_total")
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens
    assert server.metric("vllm:prefix_cache_hits_total") == \
        hits_before + first.usage.prompt_tokens_details.cached_tokens + cached
    assert server.metric("vllm:prefix_cache_queries_total") == queries_before + 2 * first.usage.prompt_tokens
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=2, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached


def test_server_side_abort_ends_requests_cleanly(server):
    """What shutdown does once its grace period is over: every request ends with finish_reason "abort"."""
    body = {"prompt": PROMPT, "max_tokens": LONG_RUN, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        server.state.engine.abort_all()
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in rest[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "abort"
    assert 0 < chunks[-1]["usage"]["completion_tokens"] < LONG_RUN

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(server.post, "/v1/completions",
                              json={"prompt": PROMPT, "max_tokens": LONG_RUN, "ignore_eos": True})
        wait_until(lambda: server.metric("vllm:num_requests_running") == 1, 20, what="the request running")
        server.state.engine.abort_all()
        response = pending.result(timeout=30)
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "abort"


def test_metrics_count_tokens_and_latency(server, client):
    before = server.metric("vllm:generation_tokens_total")
    prompt_before = server.metric("vllm:prompt_tokens_total")
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5,
                                          extra_body={"ignore_eos": True})
    assert server.metric("vllm:generation_tokens_total") == before + 5
    assert server.metric("vllm:prompt_tokens_total") == prompt_before + response.usage.prompt_tokens
    text = httpx.get(f"{server.base_url}/metrics").text
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:num_requests_waiting"):
        assert name in text
    # the memory plan, as vLLM's cache_config_info
    info = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
    assert 'block_size="16"' in info and 'max_model_len="' in info and info.endswith(" 1.0")


def test_api_key(checkpoint):
    config = EngineConfig(model=str(checkpoint), max_model_len=128, max_num_seqs=2)
    settings = ServerSettings(served_model_names=("tiny",), api_key="s3cret")
    with ServerThread(make_state(LLMEngine(config), config, settings)) as server:
        with pytest.raises(openai.AuthenticationError):
            server.openai(api_key="wrong").models.list()
        missing = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "hi"})
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
        assert server.post("/tokenize", json={"prompt": "hi"}).status_code == 401
        assert httpx.get(f"{server.base_url}/health").status_code == 200  # probes need no key
        assert server.openai(api_key="s3cret").completions.create(model="tiny", prompt="hi", max_tokens=2)


def test_sse_framing(server):
    body = {"prompt": PROMPT, "max_tokens": 3, "stream": True}
    raw = server.post("/v1/completions", json=body)
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = raw.text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ") and json.loads(event[len("data: "):])["object"] == "text_completion"
