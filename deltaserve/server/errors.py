"""OpenAI-shaped errors: one exception type for every client-visible failure, and its JSON body.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}

Handlers raise `APIError` (or let a `ValueError` from SamplingParams / the engine through, which becomes a 400);
api_server.py turns it into the response. The server keeps serving after any of them.
"""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse
from pydantic import ValidationError

# Parameter names a ValueError message may start with ("temperature must be >= 0, got -1.0"), so that the
# 400 can name the parameter in its `param` field too.
_SAMPLING_FIELDS = frozenset({
    "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos",
    "logprobs", "skip_special_tokens", "include_stop_str_in_output",
})

# Request fields other than sampling parameters that a ValueError message may start with.
_REQUEST_FIELDS = frozenset({"tools", "tool_choice", "messages"})

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error",
          503: "server_error"}


class APIError(Exception):
    """An error the client sees as an HTTP status and an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        # A message may quote the client's input, lone surrogates (valid JSON escapes, not UTF-8) included:
        # escaped here, or rendering the response would fail.
        message = self.message.encode("utf-8", "backslashreplace").decode("utf-8")
        return {"error": {"message": message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def as_api_error(error: Exception) -> APIError:
    """Any exception as the error the client sees: ValueErrors are the request's fault (400), others 500."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, ValueError):
        return from_value_error(error)
    return APIError(500, str(error))


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def from_value_error(error: ValueError) -> APIError:
    """A 400 for a ValueError raised by SamplingParams or the engine, naming the parameter when it can."""
    message = str(error)
    first_word = re.match(r"[a-z_]*", message).group()  # "temperature must be ...", "tools[0].function ..."
    param = first_word if first_word in _SAMPLING_FIELDS or first_word in _REQUEST_FIELDS else None
    code = "context_length_exceeded" if "maximum context length" in message else None
    return APIError(400, message, param, code)


def from_validation_error(error: ValidationError) -> APIError:
    """A 400 naming the first invalid field of a request body (its path, e.g. `messages.0.role`)."""
    first = error.errors()[0]
    location = [str(part) for part in first["loc"]]
    param = location[0] if location else None
    where = ".".join(location) or "body"
    return APIError(400, f"{where}: {first['msg']} (got {_short(first.get('input'))})", param)


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
