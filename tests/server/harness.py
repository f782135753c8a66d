"""Test harness: run a deltaserve app in a background thread on 127.0.0.1, and a scripted stand-in engine.

    with ServerThread(state) as server:   # waits for /health (deadline, no bare sleep)
        client = server.openai()           # the official openai client, pointed at it

`ScriptedEngine` has LLMEngine's request API but "generates" a fixed text, one token per step (as deltas when
the request asks, as the AsyncEngine does), so the HTTP layer, the reasoning parser and the tool-call parsers
can be tested end to end on outputs a random tiny model would never produce.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import httpx
import openai
import uvicorn

from deltaserve.outputs import CompletionOutput, RequestOutput
from deltaserve.sampling import RequestOutputKind
from deltaserve.server.api_server import EVENT_LOOP, build_app
from deltaserve.server.serving import ServerState
from deltaserve.structured.compiler import GrammarCompiler


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(condition, timeout: float = 30.0, interval: float = 0.02, what: str = "condition"):
    """Poll `condition()` until it returns a truthy value (returned) or `timeout` seconds pass (error)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout} s")
        time.sleep(interval)


def wait_for_health(base_url: str, timeout: float = 60.0, alive=lambda: True) -> None:
    def healthy():
        if not alive():
            raise RuntimeError("the server exited before answering /health")
        try:
            return httpx.get(f"{base_url}/health", timeout=1.0).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(healthy, timeout, 0.05, f"{base_url}/health")


class ServerThread:
    """A uvicorn server for `state` in a daemon thread; a context manager."""

    def __init__(self, state: ServerState):
        self.state = state
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(build_app(state), host="127.0.0.1", port=self.port, log_level="warning",
                                loop=EVENT_LOOP, timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        wait_for_health(self.base_url, alive=self._thread.is_alive)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=15)

    def openai(self, api_key: str = "unused", **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, timeout=60,
                             **kwargs)

    def post(self, path: str, **kwargs) -> httpx.Response:
        return httpx.post(f"{self.base_url}{path}", timeout=60, **kwargs)

    def metric(self, name: str, labels: str = "") -> float:
        """One sample of /metrics, e.g. metric("vllm:num_requests_running")."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + "{") and labels in line:
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(f"{name}{{{labels}}} not in /metrics")


@dataclass
class _Scripted:
    request_id: str
    prompt_token_ids: list[int]
    params: object
    output_ids: list[int]
    truncated: bool  # max_tokens cut the script short
    num_emitted: int = 0
    text_sent: int = 0  # characters in earlier outputs (deltas)


@dataclass
class ScriptedEngine:
    """Stands in for LLMEngine: each request "generates" `script` (its tokens, one per step, every choice
    the same), finishing with "stop", or with "length" if max_tokens cuts it. `fail_next_step` makes the
    next step() raise, as a broken GPU kernel would; `step_seconds` makes each step take that long."""

    tokenizer: object
    max_model_len: int = 4096
    script: str = "Hello!"
    fail_next_step: bool = False
    step_seconds: float = 0.0
    last_prompt_ids: list[int] | None = None
    last_params: object = None
    groups: dict[str, str] = field(default_factory=dict)  # request id -> the group it was added with
    requests: dict[str, _Scripted] = field(default_factory=dict)

    def __post_init__(self):
        self.model_config = SimpleNamespace(vocab_size=len(self.tokenizer))
        self.scheduler = SimpleNamespace(num_running=0, num_waiting=0, num_preemptions=0)
        self.cache_manager = SimpleNamespace(block_pool=SimpleNamespace(usage=0.0))
        self.config = SimpleNamespace(enable_prefix_caching=False)
        # constraints compile as for a real engine (the script ignores them)
        self.grammar_compiler = GrammarCompiler(self.tokenizer, len(self.tokenizer), {self.tokenizer.eos_token_id})

    def add_request(self, request_id, prompt, params, group=None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.groups[request_id] = request_id if group is None else group
        ids = self.tokenizer.encode(self.script, add_special_tokens=False)
        self.last_prompt_ids, self.last_params = list(prompt), params
        self.requests[request_id] = _Scripted(request_id, list(prompt), params, ids[:params.max_tokens],
                                              len(ids) > params.max_tokens)
        self.scheduler.num_running = len(self.requests)

    def abort_request(self, request_ids) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.requests.pop(request_id, None)
        self.scheduler.num_running = len(self.requests)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("scripted engine failure")
        time.sleep(self.step_seconds)
        outputs = []
        for request in list(self.requests.values()):
            request.num_emitted += 1
            ids = request.output_ids[:request.num_emitted]
            finished = request.num_emitted >= len(request.output_ids)
            reason = None
            if finished:
                reason = "length" if request.truncated else "stop"
                del self.requests[request.request_id]
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            if request.params.output_kind is RequestOutputKind.DELTA:  # what the AsyncEngine asks for
                text, ids, request.text_sent = text[request.text_sent:], ids[-1:], len(text)
            choices = [CompletionOutput(i, text, list(ids), 0.0, None, reason) for i in range(request.params.n)]
            outputs.append(RequestOutput(request.request_id, None, request.prompt_token_ids, choices, finished))
        self.scheduler.num_running = len(self.requests)
        return outputs
