"""HTTP details on a scripted engine: request-body deadlines, the OpenAPI documentation, which routes need the key."""

import socket
import time

import httpx
import pytest

from deltaserve.config import EngineConfig
from deltaserve.server.api_server import make_state
from deltaserve.server.protocol import ErrorResponse
from deltaserve.server.settings import ServerSettings
from tests.server.harness import ScriptedEngine, ServerThread

BODY_TIMEOUT = 0.5  # seconds


@pytest.fixture(scope="module")
def server(tokenizer):
    settings = ServerSettings(served_model_names=("scripted",), request_body_timeout=BODY_TIMEOUT)
    with ServerThread(make_state(ScriptedEngine(tokenizer), EngineConfig(), settings)) as running:
        yield running


def _head(length: int) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def _read_until_closed(sock: socket.socket, limit: float) -> bytes:
    """Everything the server sends until it closes the connection (fails if it does not within `limit` s)."""
    sock.settimeout(limit)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


@pytest.mark.parametrize("trickle", [False, True], ids=["stalled", "trickling"])
def test_a_body_that_does_not_arrive_in_time_gets_a_408_and_the_connection_closes(server, trickle):
    """Headers and half a body, then nothing (or a byte every fifth of the deadline: the deadline is the whole
    body's, not an idle timeout): a 408 naming the flag, the connection closed; the server serves on."""
    body = b'{"prompt": "hi", "max_tokens": 2}'
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(_head(len(body)) + body[:len(body) // 2])
        if trickle:
            for byte in body[len(body) // 2:-1]:
                try:
                    sock.sendall(bytes([byte]))
                except OSError:  # closed by the server once the deadline passed
                    break
                time.sleep(BODY_TIMEOUT / 5)
        reply = _read_until_closed(sock, limit=10)
    elapsed = time.monotonic() - start
    assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
    assert b"--request-body-timeout" in reply and b'"code":"request_timeout"' in reply
    assert BODY_TIMEOUT <= elapsed < BODY_TIMEOUT + 5
    assert server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_body_in_pieces_within_the_deadline_is_served(server):
    body = b'{"prompt": "hi", "max_tokens": 2}'
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(_head(len(body)))
        for piece in (body[:5], body[5:20], body[20:]):
            time.sleep(BODY_TIMEOUT / 10)
            sock.sendall(piece)
        sock.settimeout(10)
        reply = sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 200 "), reply[:200]


def test_a_client_gone_before_its_body_leaves_nothing_behind(server, caplog):
    """No handler runs for it (before, its body read raised ClientDisconnect: a logged 500 to nobody)."""
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(_head(100) + b'{"prompt": ')
    time.sleep(BODY_TIMEOUT * 2)
    assert server.state.engine.engine.requests == {}
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    assert server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan"), True])
def test_request_body_timeout_is_validated_by_name(value):
    with pytest.raises(ValueError, match=r"--request-body-timeout must be a positive number of seconds, got"):
        ServerSettings(served_model_names=("x",), request_body_timeout=value)


def _refs(schema) -> set[str]:
    """The model names a JSON schema refers to ("$ref": "#/components/schemas/NAME")."""
    names, stack = set(), [schema]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            if "$ref" in value:
                names.add(value["$ref"].rsplit("/", 1)[-1])
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return names


def test_openapi_documents_what_the_routes_take_and_answer(server):
    """Each POST route's body (so that /docs can send one) and error bodies are in the document; /health is
    documented empty and /metrics as text, as they answer."""
    document = httpx.get(f"{server.base_url}/openapi.json").json()
    schemas = document["components"]["schemas"]
    for path, model, required in [("/v1/completions", "CompletionRequest", {"prompt"}),
                                  ("/v1/chat/completions", "ChatCompletionRequest", {"messages"}),
                                  ("/tokenize", "TokenizeRequest", set()),
                                  ("/detokenize", "DetokenizeRequest", {"tokens"})]:
        post = document["paths"][path]["post"]
        assert post["requestBody"]["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
        assert set(schemas[model].get("required", [])) == required, model
        assert _refs(schemas[model]) <= set(schemas), model  # every model it refers to is there too
        for status in ("400", "401", "404", "408"):
            assert post["responses"][status]["content"]["application/json"]["schema"] == \
                {"$ref": "#/components/schemas/ErrorResponse"}
    assert "text/event-stream" in document["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    health = document["paths"]["/health"]["get"]["responses"]
    assert "content" not in health["200"] and "503" in health
    assert list(document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]

    assert (response := httpx.get(f"{server.base_url}/health")).status_code == 200 and response.content == b""
    assert httpx.get(f"{server.base_url}/metrics").headers["content-type"].startswith("text/plain")
    ErrorResponse.model_validate(server.post("/v1/completions", json={}).json())


def test_docs_answer_without_the_key_and_can_be_turned_off(tokenizer):
    """As vLLM's: the API key guards the API, not its description; --disable-fastapi-docs removes it."""
    settings = ServerSettings(served_model_names=("scripted",), api_key="s3cret")
    with ServerThread(make_state(ScriptedEngine(tokenizer), EngineConfig(), settings)) as keyed:
        for path in ("/docs", "/redoc", "/openapi.json", "/health", "/version", "/metrics"):
            assert httpx.get(f"{keyed.base_url}{path}").status_code == 200, path
        assert httpx.get(f"{keyed.base_url}/v1/models").status_code == 401
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
            assert keyed.post(path, json={}).status_code == 401, path
    settings = ServerSettings(served_model_names=("scripted",), disable_fastapi_docs=True)
    with ServerThread(make_state(ScriptedEngine(tokenizer), EngineConfig(), settings)) as bare:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(f"{bare.base_url}{path}").status_code == 404, path
        assert httpx.get(f"{bare.base_url}/health").status_code == 200


def test_sequences_per_request_are_bounded_and_one_requests_share_a_group(tokenizer):
    """At most --max-num-seqs-per-request sequences (prompts x n) a request, by default half the engine's
    max_num_seqs (at least one); a request's prompts reach the engine as one group (the scheduler's unit of
    fairness)."""
    engine = ScriptedEngine(tokenizer)
    for max_num_seqs, default in ((8, 4), (3, 1), (1, 1)):
        state = make_state(engine, EngineConfig(max_num_seqs=max_num_seqs), ServerSettings(served_model_names=("s",)))
        assert state.max_num_seqs_per_request == default, max_num_seqs
    settings = ServerSettings(served_model_names=("s",), max_num_seqs_per_request=4)
    with ServerThread(make_state(engine, EngineConfig(), settings)) as server:
        ok = server.post("/v1/completions", json={"prompt": [[5, 6], [7]], "n": 2, "max_tokens": 2})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 4
        assert set(engine.groups) == {f"{ok.json()['id']}-0", f"{ok.json()['id']}-1"}
        assert set(engine.groups.values()) == {ok.json()["id"]}
        for path, body in [("/v1/completions", {"prompt": "hi", "n": 5}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 5})]:
            error = server.post(path, json=body).json()["error"]
            assert error["param"] == "n" and "at most 4 (--max-num-seqs-per-request)" in error["message"]
    with pytest.raises(ValueError, match="--max-num-seqs-per-request must be a positive integer, got 0"):
        ServerSettings(served_model_names=("s",), max_num_seqs_per_request=0)


def test_the_vocabulary_is_read_at_start_up_not_on_the_first_request(tokenizer, monkeypatch):
    """The bound on a text's characters (twice the longest vocabulary entry) is taken when the state is made:
    reading Qwen3.5's 248,320 entries took ~0.35 s, which the first request after start-up used to wait for."""
    engine = ScriptedEngine(tokenizer)
    reads = []
    vocab = tokenizer.get_vocab()
    monkeypatch.setattr(tokenizer, "get_vocab", lambda: reads.append(1) or vocab)
    state = make_state(engine, EngineConfig(), ServerSettings(served_model_names=("s",)))
    assert state.max_chars_per_token == 2 * max(len(token) for token in vocab)
    assert len(reads) == 1
    with ServerThread(state) as server:
        assert server.post("/v1/completions", json={"prompt": "hi there", "max_tokens": 2}).status_code == 200
        assert server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 2}).status_code == 200
    assert len(reads) == 1
