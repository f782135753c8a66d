"""Streaming requests to an OpenAI-compatible server and the timings they yield (vLLM's definitions).

A request is sent with `stream: true` and `stream_options: {"include_usage": true}`; the server answers with
server-sent events `data: {...}` and ends with `data: [DONE]`. Per request, with t0 = just before sending:
- ttft: arrival of the first event that carries `choices` (a token chunk) - t0.
- itl: the gap between each later token chunk and the one before it (one entry per chunk, so a chunk that
  bundles several tokens counts once, as in vLLM).
- latency (E2EL): arrival of the last token chunk - t0 (the trailing usage event and [DONE] do not count).
- output_tokens: `usage.completion_tokens` when the server reports it (metrics.py re-tokenizes the text
  otherwise); prompt_len: `usage.prompt_tokens` when reported, else the dataset's count.
A request fails on a non-200 answer, an `error` event, a broken connection, or a stream without any token
chunk; the error text is kept for the report.
"""

import json
import time
from dataclasses import dataclass, field

import aiohttp

from deltaserve.bench.errors import BenchInputError

# `vllm bench serve`'s backend names -> the OpenAI API each speaks ("vllm" is the older default's name)
BACKEND_APIS = {"openai": "completions", "vllm": "completions", "openai-chat": "chat", "vllm-chat": "chat"}
BACKENDS = tuple(BACKEND_APIS)
DEFAULT_ENDPOINTS = {name: "/v1/chat/completions" if api == "chat" else "/v1/completions"
                     for name, api in BACKEND_APIS.items()}


@dataclass(frozen=True)
class Endpoint:
    """Where and how every request of a run is sent."""

    api_url: str
    backend: str  # one of BACKENDS
    model: str  # the model name sent in the body
    headers: dict[str, str]
    extra_body: dict  # merged last into every body: sampling flags, then --extra-body
    ignore_eos: bool

    @property
    def chat(self) -> bool:
        """Whether requests go to the chat completions API (messages) rather than completions (a prompt)."""
        return BACKEND_APIS[self.backend] == "chat"


@dataclass
class RequestInput:
    """One request: a completion prompt, or a chat message list (multi-turn chat)."""

    prompt: str | list[dict]
    prompt_len: int | None  # None: counted after the run (multi-turn prompts are built during it)
    output_len: int
    request_id: str


@dataclass
class RequestOutput:
    """What one request measured; times in seconds from time.perf_counter()."""

    success: bool = False
    generated_text: str = ""  # completion text, or chat `content`
    reasoning_text: str = ""  # chat `reasoning_content` / `reasoning` deltas
    prompt_len: int | None = None
    output_tokens: int | None = None  # usage.completion_tokens, when reported
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunk_texts: list[str] = field(default_factory=list)  # the text of each token chunk (content + reasoning)
    latency: float = 0.0
    start_time: float = 0.0
    error: str = ""


def build_payload(endpoint: Endpoint, request: RequestInput) -> dict:
    """The JSON body: vLLM's fields for the backend, then the endpoint's extra body on top."""
    payload: dict = {"model": endpoint.model, "stream": True, "stream_options": {"include_usage": True}}
    if endpoint.chat:
        prompt = request.prompt
        payload["messages"] = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        # vLLM's client sends max_completion_tokens (the current OpenAI name); servers that only know the
        # older max_tokens would then generate to their own default, so both are sent with the same value.
        payload["max_completion_tokens"] = request.output_len
        payload["max_tokens"] = request.output_len
    else:
        payload["prompt"] = request.prompt
        payload["max_tokens"] = request.output_len
    if endpoint.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(endpoint.extra_body)
    return payload


class StreamRecorder:
    """Turns the parsed SSE events of one response into a RequestOutput (see the module docstring)."""

    def __init__(self, output: RequestOutput):
        self.output = output
        self.last_token_time = output.start_time
        self.got_token = False

    def on_event(self, event: dict, now: float) -> None:
        """Record one `data:` JSON object that arrived at `now`."""
        if event.get("error"):
            raise StreamError(_error_text(event["error"]))
        choices = event.get("choices")
        if choices:
            if self.got_token:
                self.output.itl.append(now - self.last_token_time)
            else:
                self.output.ttft = now - self.output.start_time
                self.got_token = True
            self.last_token_time = now
            choice = choices[0]
            if "delta" in choice:  # chat
                delta = choice["delta"] or {}
                content = delta.get("content") or ""
                reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
                self.output.generated_text += content
                self.output.reasoning_text += reasoning
                self.output.chunk_texts.append(reasoning + content)
            else:
                text = choice.get("text") or ""
                self.output.generated_text += text
                self.output.chunk_texts.append(text)
        usage = event.get("usage")
        if usage:
            if usage.get("completion_tokens") is not None:
                self.output.output_tokens = usage["completion_tokens"]
            if usage.get("prompt_tokens") is not None:
                self.output.prompt_len = usage["prompt_tokens"]

    def finish(self) -> None:
        """Close the record once the stream ended normally."""
        self.output.latency = self.last_token_time - self.output.start_time
        if self.got_token:
            self.output.success = True
        else:
            self.output.error = "the stream ended without any token chunk (no `choices` in any event)"


class StreamError(Exception):
    """The server reported an error inside the event stream."""


async def send_request(session: aiohttp.ClientSession, endpoint: Endpoint, request: RequestInput) -> RequestOutput:
    """Send one streaming request and time it; never raises for server or network trouble."""
    headers = {**endpoint.headers, "x-request-id": request.request_id}
    payload = build_payload(endpoint, request)
    output = RequestOutput(prompt_len=request.prompt_len)
    output.start_time = time.perf_counter()
    recorder = StreamRecorder(output)
    try:
        async with session.post(endpoint.api_url, json=payload, headers=headers) as response:
            if response.status != 200:
                body = (await response.text()).strip()
                output.error = f"HTTP {response.status} {response.reason}: {body[:300]}"
                return output
            pending = b""
            async for chunk in response.content.iter_any():
                now = time.perf_counter()  # one arrival time for every event in this network read
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    _feed_line(recorder, line, now)
            _feed_line(recorder, pending, time.perf_counter())
        recorder.finish()
    except StreamError as e:
        output.error = f"error event in the stream: {e}"
    except Exception as e:  # noqa: BLE001 -- any failure of one request is recorded, not raised
        output.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return output


def _feed_line(recorder: StreamRecorder, line: bytes, now: float) -> None:
    """One SSE line: `data: <json>` is recorded; comments, other fields, blanks and [DONE] are skipped."""
    line = line.strip()
    if not line.startswith(b"data:"):
        return
    data = line[len(b"data:"):].strip()
    if not data or data == b"[DONE]":
        return
    recorder.on_event(json.loads(data), now)


def _error_text(error) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


async def list_served_models(base_url: str, headers: dict[str, str]) -> list[str] | None:
    """Model ids from GET {base_url}/v1/models; None when the server does not list its models.

    Raises BenchInputError (naming the URL) when nothing answers at base_url or the key is refused.
    """
    url = f"{base_url}/v1/models"
    timeout = aiohttp.ClientTimeout(total=30)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url, headers=headers) as response:
            if response.status in (401, 403):
                raise BenchInputError(
                    f"the server at {url} refused the request (HTTP {response.status}); "
                    "pass --api-key or set OPENAI_API_KEY"
                )
            if response.status != 200:
                return None
            body = await response.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError) as e:
        raise BenchInputError(f"cannot reach the server at {url}: {type(e).__name__}: {e}") from None
    except json.JSONDecodeError:
        return None
    models = body.get("data") if isinstance(body, dict) else None
    if not isinstance(models, list):
        return None
    return [m["id"] for m in models if isinstance(m, dict) and "id" in m]
