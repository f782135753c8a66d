"""ServerSettings: the options of `deltaserve serve` that belong to the HTTP server, not to the engine.

The engine's options live in `deltaserve.config.EngineConfig`; cli.py fills both from one command line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
DEMO_MODEL_NAME = "demo"  # what /v1/models calls the built-in demo model unless --served-model-name is given


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = ()  # the names the API answers to; the first is reported
    api_key: str | None = None  # when set, requests must send "Authorization: Bearer <key>"
    chat_template: str | None = None  # template text (--chat-template FILE is read at startup)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    default_chat_template_kwargs: dict = field(default_factory=dict)
    stream_interval: int = 1  # stream every N tokens (the first token and the last always go out at once)
    uvicorn_log_level: str = "info"
    # Seconds that in-flight requests get to finish after SIGTERM before they are aborted.
    graceful_shutdown_seconds: float = 10.0
    # Seconds a request's body may take to arrive, from the end of its headers (then a 408).
    request_body_timeout: float = 30.0
    disable_fastapi_docs: bool = False  # no /docs, /redoc, /openapi.json (they answer without the key)
    # Sequences one request may ask for (prompts x n); None: half the engine's max_num_seqs
    # (api_server.default_seqs_per_request), so that one request leaves seats for other clients.
    max_num_seqs_per_request: int | None = None

    def __post_init__(self):
        if not self.served_model_names:
            raise ValueError("served_model_names must hold at least one name")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port!r}")
        if not isinstance(self.stream_interval, int) or self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be a positive integer, got {self.stream_interval!r}")
        limit = self.max_num_seqs_per_request
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"--max-num-seqs-per-request must be a positive integer, got {limit!r}")
        timeout = self.request_body_timeout
        if isinstance(timeout, bool) or not (isinstance(timeout, (int, float)) and 0 < timeout < math.inf):
            raise ValueError(f"--request-body-timeout must be a positive number of seconds, got {timeout!r}")
        if self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise ValueError(f"--uvicorn-log-level {self.uvicorn_log_level!r} is not one of {UVICORN_LOG_LEVELS}")

    @property
    def model_name(self) -> str:
        """The primary name: what responses report in their `model` field."""
        return self.served_model_names[0]
