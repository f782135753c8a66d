"""BodyDeadline: ASGI middleware that reads each HTTP request's body within a deadline.

uvicorn times out idle keep-alive connections (`timeout_keep_alive`), not a request whose body stops arriving:
a client that sent its headers and half a body held its connection, and a handler waiting on the body, for as
long as it liked. This middleware reads the whole body before the app sees the request (every POST handler
reads its body whole anyway), within `timeout` seconds of the request's start, however the bytes trickle in;
past that the client gets a 408 and the connection is closed. A client that disconnects before its body is in
gets nothing: nobody is left to answer. After the body, `receive` is the server's own again (the handlers
watch it for the client's disconnect).
"""

from __future__ import annotations

import asyncio
from collections import deque

from deltaserve.server.errors import APIError


class BodyDeadline:
    def __init__(self, app, timeout: float):
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        messages: deque[dict] = deque()
        while not messages or messages[-1].get("more_body", False):
            try:
                message = await asyncio.wait_for(receive(), deadline - loop.time())
            except asyncio.TimeoutError:
                error = APIError(408, f"the request body did not arrive within {self.timeout:g} s "
                                      "(--request-body-timeout)", code="request_timeout")
                response = error.response()
                response.headers["connection"] = "close"
                await response(scope, receive, send)
                return
            if message["type"] == "http.disconnect":
                return
            messages.append(message)

        async def replay():
            return messages.popleft() if messages else await receive()

        await self.app(scope, replay, send)
