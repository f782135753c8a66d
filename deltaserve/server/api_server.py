"""The OpenAI-compatible HTTP server: routes, API-key check, error bodies, lifecycle.

    build_app(state)                   the FastAPI app around a ServerState (tests pass a scripted engine)
    make_state(engine, config, settings)
    run_server(engine_config, settings) load the engine, then serve until SIGTERM / Ctrl-C

Routes: GET /health /version /metrics /v1/models; POST /v1/completions /v1/chat/completions /tokenize
/detokenize; the API's description at /openapi.json, /docs and /redoc (off with --disable-fastapi-docs).
With --api-key, the /v1 routes, /tokenize and /detokenize need "Authorization: Bearer <key>"; the probes
(/health, /version, /metrics) and the description answer without it, as vLLM's do.
A request's body must arrive within --request-body-timeout seconds (body_deadline.py), else a 408.

Shutdown (SIGTERM or Ctrl-C): uvicorn stops accepting connections, in-flight requests get
`graceful_shutdown_seconds` to finish, then the engine aborts the rest (they end with finish_reason
"abort", streams with their [DONE]), the engine thread stops and the process exits 0.
"""

from __future__ import annotations

import logging
import secrets
import signal
import threading
from contextlib import asynccontextmanager
from pathlib import Path

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from deltaserve import __version__
from deltaserve.config import EngineConfig
from deltaserve.server import openapi
from deltaserve.server.async_engine import AsyncEngine, EngineDeadError, EngineError
from deltaserve.server.body_deadline import BodyDeadline
from deltaserve.generation_defaults import sampling_defaults
from deltaserve.server.chat import ChatRenderer
from deltaserve.server.chat_completions import create_chat_completion
from deltaserve.server.completions import create_completion
from deltaserve.server.errors import APIError, bad_request, from_value_error
from deltaserve.server.metrics import CONTENT_TYPE, ServerMetrics
from deltaserve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from deltaserve.server.serving import ServerState, max_chars_per_token, parse_body
from deltaserve.server.settings import ServerSettings

logger = logging.getLogger(__name__)
_OPEN_HOSTS = ("0.0.0.0", "::", "")
# uvicorn's event loop: Python's own asyncio, not uvloop (uvicorn's default where installed). The engine thread
# and the loop thread share one GIL: under asyncio the loop, slowed at each socket send, joins the deltas that
# queued instead of writing one chunk per token per stream (docs/performance.md, "Host work a step").
EVENT_LOOP = "asyncio"
DEAD_ENGINE_EXIT_S = 5.0  # how long a server whose engine went down keeps answering 503 before it exits


def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not state.engine.is_running:
            state.engine.start()
        yield
        state.engine.shutdown()
        state.executor.shutdown(wait=False, cancel_futures=True)

    docs = {} if not state.settings.disable_fastapi_docs else dict(openapi_url=None, docs_url=None, redoc_url=None)
    app = FastAPI(title="deltaserve", version=__version__, lifespan=lifespan, **docs)
    openapi.install(app, [CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest])
    app.state.server = state
    app.add_middleware(BodyDeadline, timeout=state.settings.request_body_timeout)
    _add_error_handlers(app)

    async def check_api_key(request: Request) -> None:
        key = state.settings.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), key.encode()):
            raise APIError(401, "Incorrect or missing API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    protected = [Depends(check_api_key)]

    @app.get("/health", response_class=Response,
             responses={200: {"description": "the engine is running (empty body, as vLLM's)"},
                        503: {"description": "the engine thread has stopped (empty body)"}})
    async def health() -> Response:
        return Response(status_code=200 if state.engine.is_running else 503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text format (vLLM's metric names)"}})
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=protected, responses={200: {"model": ModelList}, **openapi.errors(401)})
    async def list_models() -> JSONResponse:
        cards = [ModelCard(id=name, root=state.model_root, max_model_len=state.max_model_len)
                 for name in state.settings.served_model_names]
        return JSONResponse(ModelList(data=cards).model_dump())

    generation_errors = openapi.errors(400, 401, 404, 408, 500)

    @app.post("/v1/completions", dependencies=protected, openapi_extra=openapi.json_body(CompletionRequest),
              responses={**openapi.streamed(CompletionResponse, "completion"), **generation_errors})
    async def completions(raw_request: Request) -> Response:
        return await create_completion(state, raw_request)

    @app.post("/v1/chat/completions", dependencies=protected, openapi_extra=openapi.json_body(ChatCompletionRequest),
              responses={**openapi.streamed(ChatCompletionResponse, "chat completion"), **generation_errors})
    async def chat_completions(raw_request: Request) -> Response:
        return await create_chat_completion(state, raw_request)

    @app.post("/tokenize", dependencies=protected, openapi_extra=openapi.json_body(TokenizeRequest),
              responses={200: {"model": TokenizeResponse}, **openapi.errors(400, 401, 404, 408)})
    async def tokenize(raw_request: Request) -> JSONResponse:
        request = await parse_body(raw_request, TokenizeRequest)
        state.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise bad_request("give exactly one of `prompt` and `messages`", "prompt")
        if request.messages is not None:
            rendered = await state.off_loop(state.renderer.render, request.messages, request.tools,
                                            request.add_generation_prompt, request.continue_final_message,
                                            request.chat_template_kwargs)
            ids = await state.off_loop(state.encode, rendered.prompt, False, "messages")
        else:
            ids = await state.off_loop(state.encode, request.prompt, request.add_special_tokens, "prompt")
        strs = state.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        body = TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids, token_strs=strs)
        return JSONResponse(body.model_dump())

    @app.post("/detokenize", dependencies=protected, openapi_extra=openapi.json_body(DetokenizeRequest),
              responses={200: {"model": DetokenizeResponse}, **openapi.errors(400, 401, 404, 408)})
    async def detokenize(raw_request: Request) -> JSONResponse:
        request = await parse_body(raw_request, DetokenizeRequest)
        state.check_model(request.model)
        tokenizer = state.require_tokenizer("tokens")
        if request.tokens:
            state.check_token_ids(request.tokens, "tokens")
        text = await state.off_loop(tokenizer.decode, request.tokens)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(ValueError)
    async def value_error(_: Request, exc: ValueError) -> Response:  # the engine refused the request
        return from_value_error(exc).response()

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, exc: EngineDeadError) -> Response:
        return APIError(503, str(exc)).response()

    @app.exception_handler(EngineError)
    async def engine_error(_: Request, exc: EngineError) -> Response:
        return APIError(500, str(exc)).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        response = APIError(exc.status_code, str(exc.detail)).response()
        response.headers.update(exc.headers or {})  # a 405's Allow
        return response

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> Response:
        return APIError(400, str(exc)).response()

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> Response:
        logger.exception("unexpected error while handling a request")
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()


def make_state(engine, engine_config: EngineConfig, settings: ServerSettings, defaults: dict | None = None,
               model_root: str = "") -> ServerState:
    """Wrap an engine (an LLMEngine or a stand-in with the same API) for the server; does not start it."""
    plan = getattr(engine, "memory_plan", None)
    metrics = ServerMetrics(settings.model_name, prefix_caching=engine_config.enable_prefix_caching,
                            cache_info=plan.info_labels() if plan is not None else None)
    async_engine = AsyncEngine(engine, metrics, settings.stream_interval)
    renderer = ChatRenderer(engine.tokenizer, settings.chat_template, settings.default_chat_template_kwargs)
    renderer.warm_up()
    # the engine's max_num_seqs, as the memory plan may have clamped it
    max_num_seqs = getattr(engine.scheduler, "max_num_seqs", engine_config.max_num_seqs)
    return ServerState(async_engine, settings, renderer, metrics, dict(defaults or {}), model_root,
                       settings.max_num_seqs_per_request or default_seqs_per_request(max_num_seqs),
                       max_chars_per_token(engine.tokenizer))


def default_seqs_per_request(max_num_seqs: int) -> int:
    """Half the engine's seats (at least one): one request cannot take them all, so another client's request
    finds a seat at the next step instead of waiting for that request's sequences to finish."""
    return max(1, max_num_seqs // 2)


def warn_if_open(settings: ServerSettings) -> bool:
    """Log a warning (and return True) when the API would be reachable from the network without a key."""
    if settings.host in _OPEN_HOSTS and settings.api_key is None:
        logger.warning("binding to %r without --api-key: the API is open to the network; anyone who can reach "
                       "port %d can use it", settings.host, settings.port)
        return True
    return False


def run_server(engine_config: EngineConfig, settings: ServerSettings) -> None:
    """Load the engine and serve until SIGTERM or Ctrl-C. Raises ConfigError for a bad setting."""
    from deltaserve.engine.llm_engine import LLMEngine

    if engine_config.model is None:
        from deltaserve.demo import demo_model_path
        model_dir = demo_model_path()
    else:
        model_dir = Path(engine_config.model)
    defaults = sampling_defaults(model_dir, engine_config.generation_config,
                                 engine_config.override_generation_config)
    warn_if_open(settings)
    engine = LLMEngine(engine_config)
    state = make_state(engine, engine_config, settings, defaults, str(engine_config.model or model_dir))
    app = build_app(state)
    # uvicorn's own deadline is a backstop: by then our abort has ended every request.
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.uvicorn_log_level,
                            loop=EVENT_LOOP, timeout_graceful_shutdown=settings.graceful_shutdown_seconds + 10)
    # uvicorn re-raises the signal that stopped it once it is done; with these handlers in place that
    # re-raise is a no-op and the process exits 0 after its graceful shutdown.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    logger.info("serving %s as %s on http://%s:%d", model_dir, list(settings.served_model_names),
                settings.host, settings.port)
    _GracefulServer(config, state.engine, settings.graceful_shutdown_seconds).run()


class _GracefulServer(uvicorn.Server):
    """uvicorn, plus: `grace` seconds after the first SIGTERM / Ctrl-C the engine aborts every request still
    in flight, so that they end cleanly instead of being cut off by uvicorn's task cancellation. When the engine
    goes down (a worker rank died) it keeps answering 503 for DEAD_ENGINE_EXIT_S seconds, then exits naming why."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, grace: float):
        super().__init__(config)
        self._engine = engine
        self._grace = grace
        engine.on_dead = self._exit_later

    def _exit_later(self, reason: str) -> None:
        timer = threading.Timer(DEAD_ENGINE_EXIT_S, lambda: setattr(self, "should_exit", True))
        timer.daemon = True
        timer.start()

    def run(self, *args, **kwargs) -> None:
        super().run(*args, **kwargs)
        if self._engine.dead is not None:
            raise SystemExit(f"deltaserve stopped: the engine went down ({self._engine.dead})")

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            logger.info("shutting down: in-flight requests get %.0f s to finish", self._grace)
            timer = threading.Timer(self._grace, self._engine.abort_all)
            timer.daemon = True
            timer.start()
        super().handle_exit(sig, frame)
