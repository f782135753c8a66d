"""What the completion and chat handlers share: the server state, request parsing, prompt checks,
sampling parameters, logprobs and usage formatting, SSE framing and client-disconnect handling.
"""

from __future__ import annotations

import asyncio
import json
import math
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.responses import StreamingResponse

from deltaserve.engine import tokenize
from deltaserve.outputs import CompletionOutput
from deltaserve.sampling import SamplingParams
from deltaserve.server import json_limits
from deltaserve.server.async_engine import AsyncEngine
from deltaserve.server.chat import ChatRenderer
from deltaserve.server.errors import APIError, as_api_error, bad_request, from_validation_error, from_value_error
from deltaserve.server.json_limits import JSONLimitError
from deltaserve.server.metrics import ServerMetrics
from deltaserve.server.protocol import (
    CompletionLogprobs,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
    _SamplingFields,
)
from deltaserve.server.settings import ServerSettings

Model = TypeVar("Model", bound=BaseModel)
SSE_DONE = "data: [DONE]\n\n"


def max_chars_per_token(tokenizer) -> int:
    """Twice the longest vocabulary entry (1 without a tokenizer): no token covers more characters of a text. Read
    at start-up: reading a vocabulary of Qwen3.5's size takes a large part of a second, which a first request would
    wait."""
    if tokenizer is None:
        return 1
    return 2 * max((len(token) for token in tokenizer.get_vocab()), default=1)


@dataclass
class ServerState:
    """Everything a handler needs; one per app."""

    engine: AsyncEngine
    settings: ServerSettings
    renderer: ChatRenderer
    metrics: ServerMetrics
    sampling_defaults: dict = field(default_factory=dict)
    model_root: str = ""
    max_num_seqs_per_request: int = 256  # prompts x n (make_state sets it from the settings or the engine)
    # no token covers more characters of a text than this (make_state: twice the longest vocabulary entry)
    max_chars_per_token: int = 1
    # Tokenizing and template rendering run here, off the event loop and one at a time (HF fast
    # tokenizers must not be reconfigured from two threads at once).
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "deltaserve-tokenize"))
    _token_texts: dict[int, str] = field(default_factory=dict)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        model_config = getattr(self.engine.engine, "model_config", None)
        return model_config.vocab_size if model_config is not None else len(self.tokenizer)

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.settings.served_model_names:
            raise APIError(404, f"The model `{name}` does not exist; this server serves "
                                f"{list(self.settings.served_model_names)}", "model", "model_not_found")

    async def off_loop(self, fn, *args):
        """Run a tokenizer / template call on the tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def require_tokenizer(self, param: str):
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer: send token ids instead of text", param)
        return self.tokenizer

    def encode(self, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        tokenizer = self.require_tokenizer(param)
        # A text too long for the context whatever its tokens is refused before tokenizing it: tokenizing tens of
        # megabytes takes the tokenizer thread, which every request shares, for tens of seconds.
        if len(text) > self.max_model_len * self.max_chars_per_token:
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens, and {param} has "
                              f"{len(text):,} characters: more than that many tokens can hold", param,
                              "context_length_exceeded")
        try:
            return tokenize.encode(tokenizer, text, add_special_tokens)
        except (UnicodeError, TypeError, ValueError) as exc:  # e.g. lone surrogates from "\ud800"
            raise bad_request(f"{param} could not be tokenized: {exc}", param) from exc

    def encode_checked(self, text: str, add_special_tokens: bool, param: str) -> tokenize.CheckedTokenIds:
        """encode, then check_token_ids (the tokenizer's ids may reach past the model's vocabulary)."""
        return self.check_token_ids(self.encode(text, add_special_tokens, param), param)

    def check_num_seqs(self, num_prompts: int, n: int) -> None:
        """400 for a request that asks for more sequences than one request may run."""
        total = num_prompts * n
        limit = self.max_num_seqs_per_request
        if total > limit:
            asked = f"{num_prompts} prompts x n={n} = {total:,} sequences" if num_prompts > 1 else f"n={n} sequences"
            raise bad_request(f"this request asks for {asked}; a request may run at most {limit} "
                              "(--max-num-seqs-per-request)", "n" if n > 1 else "prompt")

    def check_token_ids(self, ids: list[int], param: str, label: str | None = None) -> tokenize.CheckedTokenIds:
        """ids (ints: the tokenizer's, or a request's as pydantic parsed them) as checked token ids; 400 naming
        `label` (the element, e.g. prompt[2]; default the field) for empty or out-of-vocab ids."""
        label = label or param
        if not ids:
            raise bad_request(f"{label} must not be empty", param)
        vocab = self.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"{label}: token id {bad} is out of range [0, {vocab})", param)
        return tokenize.CheckedTokenIds(ids)

    def token_text(self, token_id: int) -> str:
        """The text of one token (cached), as logprobs report it."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"token_id:{token_id}"
            self._token_texts[token_id] = text
        return text


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def parse_body(raw_request: Request, model: type[Model]) -> Model:
    """The request body as `model`: 400 for invalid UTF-8, malformed JSON, a non-object or wrong fields."""
    body = await raw_request.body()
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"the request body is not valid UTF-8 (byte {exc.start})") from exc
    try:
        data = json_limits.loads(text)
    except JSONLimitError as exc:  # too deep, or an integer too long to read (named by its path)
        param = str(exc.path[0]) if exc.path else None
        raise bad_request(str(exc) if exc.path else f"the request body is {exc}", param) from exc
    except ValueError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc


def resolve_max_tokens(requested: int | None, param: str, default: int | None, prompt_len: int,
                       max_model_len: int, prompt_param: str) -> int:
    """Output budget of one request; 400 if the prompt plus an explicit request does not fit the context.

    A default (the generation config's, or the full remaining context) is clamped to what fits instead.
    `param` / `prompt_param` name the request fields an error points at.
    """
    room = max_model_len - prompt_len
    if room <= 0:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens, you requested "
                          f"{prompt_len} tokens in the prompt, which leaves no room for output", prompt_param,
                          "context_length_exceeded")
    if requested is None:
        return room if default is None else min(default, room)
    if requested < 1:
        raise bad_request(f"{param} must be >= 1, got {requested}", param)
    if prompt_len + requested > max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens, you requested "
                          f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in the "
                          f"completion); lower {param} or shorten the prompt", param, "context_length_exceeded")
    return requested


def sampling_params(request: _SamplingFields, defaults: dict, max_tokens: int,
                    logprobs: int | None) -> SamplingParams:
    """SamplingParams from a request: request fields, else the generation-config defaults, else vLLM's."""
    if request.logit_bias:
        raise bad_request("logit_bias is not supported yet", "logit_bias")
    if request.best_of is not None and request.best_of != request.n:
        raise bad_request(f"best_of={request.best_of} != n is not supported", "best_of")
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")

    def pick(name: str, fallback: Any) -> Any:
        value = getattr(request, name)
        return value if value is not None else defaults.get(name, fallback)

    try:
        return SamplingParams(
            n=request.n, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0), min_p=pick("min_p", 0.0),
            presence_penalty=pick("presence_penalty", 0.0), frequency_penalty=pick("frequency_penalty", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0), seed=request.seed, max_tokens=max_tokens,
            min_tokens=request.min_tokens, stop=request.stop, stop_token_ids=request.stop_token_ids or [],
            ignore_eos=request.ignore_eos, logprobs=logprobs, skip_special_tokens=request.skip_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output)
    except ValueError as exc:
        raise from_value_error(exc) from exc


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


# JSON has no -inf or NaN: a logprob of -inf (a token the sampler masked out) or NaN (logits that overflowed) is
# reported as this floor, as in vLLM, instead of failing the response after the request has run.
MIN_LOGPROB = -9999.0


def _json_logprob(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def completion_logprobs(state: ServerState, output: CompletionOutput, start: int, end: int,
                        text_offset: int) -> CompletionLogprobs:
    """Legacy-completions logprobs of output tokens [start, end); offsets count from `text_offset`."""
    result = CompletionLogprobs()
    for token_id, entry in zip(output.token_ids[start:end], output.logprobs[start:end]):
        text = state.token_text(token_id)
        result.tokens.append(text)
        result.token_logprobs.append(_json_logprob(entry[token_id].logprob))
        result.top_logprobs.append({state.token_text(t): _json_logprob(lp.logprob) for t, lp in entry.items()})
        result.text_offset.append(text_offset)
        text_offset += len(text)
    return result


def chat_logprobs(state: ServerState, output: CompletionOutput, start: int, end: int,
                  top_n: int) -> list[TokenLogprob]:
    """Chat logprobs of output tokens [start, end): the sampled token and its `top_n` best alternatives."""
    result = []
    for token_id, entry in zip(output.token_ids[start:end], output.logprobs[start:end]):
        ranked = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank is not None)[:top_n]
        top = [_top_logprob(state, t, logprob) for _, t, logprob in ranked]
        result.append(TokenLogprob(**_top_logprob(state, token_id, entry[token_id].logprob).model_dump(),
                                   top_logprobs=top))
    return result


def _top_logprob(state: ServerState, token_id: int, logprob: float) -> TopLogprob:
    text = state.token_text(token_id)
    return TopLogprob(token=text, logprob=_json_logprob(logprob), bytes=list(text.encode("utf-8", errors="replace")))


def sse(payload: BaseModel | dict) -> str:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


def sse_error(error: Exception) -> str:
    """An error that happens after a stream has started: one error event (the stream then ends)."""
    return sse(as_api_error(error).body())


class SSEResponse(StreamingResponse):
    """text/event-stream; the body generator is always closed at the end, so its cleanup (aborting the
    request of a client that went away) runs at once rather than whenever the generator is collected."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str]):
        super().__init__(content, headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def merge_streams(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave async iterators, yielding (iterator index, item) as items arrive. Closing this closes all."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()
        return
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[index]))] = index
                yield index, item
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


async def abort_on_disconnect(raw_request: Request, engine: AsyncEngine, request_ids: list[str]) -> None:
    """Wait for the client to go away, then abort its requests. Run as a task beside a non-streaming
    handler and cancel it when the handler is done."""
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass
    for request_id in request_ids:
        engine.abort(request_id)
