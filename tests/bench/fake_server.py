"""A scripted OpenAI-compatible streaming server for the bench tests (aiohttp, in a background thread).

Every streamed answer has `max_tokens` (or `max_completion_tokens`) chunks " w0", " w1", ...: the first
after `first_delay` (+ `delay_per_turn` x k for a multi-turn request id ending in "-t<k>"), the rest `gap`
apart, then a usage event (prompt_tokens = characters of the prompt or of all message contents;
completion_tokens = the chunk count) unless `usage` is off, then [DONE]. Scripted failures by x-request-id:
`fail_http` ids get HTTP 500, `fail_stream` ids get an error event after their first chunk.
"""

import asyncio
import json
import threading
import time

import aiohttp
from aiohttp import web


class FakeOpenAIServer:
    def __init__(self, models=("fake-model",)):
        self.models = list(models)
        self.first_delay = 0.1
        self.gap = 0.04
        self.delay_per_turn = 0.0
        self.usage = True
        self.api_key: str | None = None  # when set, requests without "Authorization: Bearer <key>" get 401
        self.fail_http: set[str] = set()
        self.bad_request: set[str] = set()  # request ids answered 400
        self.unavailable = 0  # the next this many completion requests are answered 503
        self.fail_stream: set[str] = set()
        self.received: list[tuple[dict, dict]] = []  # (lower-cased headers, body) of every completion request
        self.in_flight = 0
        self.max_in_flight = 0
        self.port: int | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> None:
        """Start in a thread on a free port; return once GET /health answers (polled with a deadline)."""
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(timeout_s)
        deadline = time.monotonic() + timeout_s
        while not self._healthy():
            if time.monotonic() > deadline:
                raise RuntimeError(f"fake server at {self.base_url} did not become healthy in {timeout_s} s")
            time.sleep(0.01)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _healthy(self) -> bool:
        async def probe() -> bool:
            try:
                async with aiohttp.ClientSession() as session:
                    async with session.get(f"{self.base_url}/health") as response:
                        return response.status == 200
            except aiohttp.ClientError:
                return False

        return asyncio.run(probe())

    async def _serve(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    def _refused(self, request: web.Request) -> bool:
        return self.api_key is not None and request.headers.get("Authorization") != f"Bearer {self.api_key}"

    async def _models(self, request: web.Request) -> web.Response:
        if self._refused(request):
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._stream(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._stream(request, chat=True)

    async def _stream(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await request.json()
        request_id = request.headers.get("x-request-id", "")
        self.received.append(({k.lower(): v for k, v in request.headers.items()}, body))
        if self._refused(request):
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        if request_id in self.fail_http:
            return web.json_response({"error": {"message": f"scripted failure for {request_id}"}}, status=500)
        if request_id in self.bad_request:
            return web.json_response({"error": {"message": f"scripted bad request {request_id}"}}, status=400)
        if self.unavailable:
            self.unavailable -= 1
            return web.json_response({"error": {"message": "scripted: not ready"}}, status=503)
        if chat:
            prompt_chars = sum(len(m["content"]) for m in body["messages"])
        else:
            prompt_chars = len(body["prompt"])
        _, turn_mark, turn = request_id.rpartition("-t")  # multi-turn ids end in -t<turn>
        earlier_turns = int(turn) if turn_mark and turn.isdigit() else 0
        num_tokens = body.get("max_completion_tokens") or body["max_tokens"]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.first_delay + self.delay_per_turn * earlier_turns)
            for i in range(num_tokens):
                if i:
                    await asyncio.sleep(self.gap)
                choice = {"index": 0, "delta": {"content": f" w{i}"}} if chat else {"index": 0, "text": f" w{i}"}
                await _send(response, {"choices": [choice]})
                if request_id in self.fail_stream:
                    await _send(response, {"error": {"message": "scripted stream error", "code": 500}})
                    return response
            if self.usage:
                usage = {"prompt_tokens": prompt_chars, "completion_tokens": num_tokens}
                await _send(response, {"choices": [], "usage": usage})
            await response.write(b"data: [DONE]\n\n")
        finally:
            self.in_flight -= 1
        return response


async def _send(response: web.StreamResponse, event: dict) -> None:
    await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
