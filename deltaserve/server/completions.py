"""POST /v1/completions: text or token-id prompts (one or a batch), n choices each, streaming or not.

Choice index = prompt index * n + choice: the OpenAI numbering for batched prompts.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from deltaserve.outputs import OutputAccumulator, RequestOutput
from deltaserve.server.errors import bad_request
from deltaserve.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from deltaserve.server.serving import (
    SSE_DONE,
    ServerState,
    SSEResponse,
    abort_on_disconnect,
    completion_logprobs,
    merge_streams,
    new_id,
    parse_body,
    resolve_max_tokens,
    sampling_params,
    sse,
    sse_error,
    usage,
)
from deltaserve.server.structured import constrain, requested_constraint

_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for legacy completions


@dataclass
class _Prompt:
    text: str  # for echo
    token_ids: list[int]


async def create_completion(state: ServerState, raw_request: Request) -> Response:
    request = await parse_body(raw_request, CompletionRequest)
    state.check_model(request.model)
    if request.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if request.echo and request.logprobs is not None:
        raise bad_request("echo together with logprobs is not supported yet (no prompt logprobs)", "echo")
    state.check_num_seqs(len(_prompt_items(request.prompt)), request.n)
    prompts = await state.off_loop(_tokenize_prompts, state, request)
    default = state.sampling_defaults.get("max_tokens", _DEFAULT_MAX_TOKENS)
    params = [sampling_params(request, state.sampling_defaults,
                              resolve_max_tokens(request.max_tokens, "max_tokens", default, len(p.token_ids),
                                                 state.max_model_len, "prompt"),
                              request.logprobs)
              for p in prompts]
    constraint = requested_constraint(request)
    params = [await constrain(state, p, *constraint) for p in params]
    request_id = new_id("cmpl")
    engine_ids = [f"{request_id}-{i}" for i in range(len(prompts))]
    streams = [state.engine.generate(engine_id, p.token_ids, sp, group=request_id)  # one client request
               for engine_id, p, sp in zip(engine_ids, prompts, params)]
    if request.stream:
        return SSEResponse(_stream(state, request, request_id, prompts, streams))

    watcher = asyncio.create_task(abort_on_disconnect(raw_request, state.engine, engine_ids))
    joined = [OutputAccumulator() for _ in prompts]  # the engine's outputs are deltas
    try:
        async for index, output in merge_streams(streams):
            joined[index].add(output)
    finally:
        watcher.cancel()
    finals = {index: outputs.result() for index, outputs in enumerate(joined)}
    return JSONResponse(_response(state, request, request_id, prompts, finals).model_dump())


def _prompt_items(raw) -> list:
    """The prompts of a request: one text or token-id list, or a batch of them."""
    return [raw] if isinstance(raw, str) or raw and isinstance(raw[0], int) else list(raw)


def _tokenize_prompts(state: ServerState, request: CompletionRequest) -> list[_Prompt]:
    items = _prompt_items(request.prompt)
    if not items:
        raise bad_request("prompt must not be empty", "prompt")
    prompts = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            ids = state.encode(item, request.add_special_tokens)
            text = item
        else:
            ids = list(item)
        # before echo decodes them: the tokenizer takes ids as C integers, and overflows on others
        ids = state.check_token_ids(ids, "prompt", f"prompt[{i}]" if len(items) > 1 else "prompt")
        if not isinstance(item, str):
            text = state.tokenizer.decode(ids) if request.echo and state.tokenizer is not None else ""
        prompts.append(_Prompt(text, ids))
    return prompts


def _response(state: ServerState, request: CompletionRequest, request_id: str, prompts: list[_Prompt],
              finals: dict[int, RequestOutput]) -> CompletionResponse:
    choices = []
    prompt_tokens = completion_tokens = cached_tokens = 0
    for index, prompt in enumerate(prompts):
        final = finals[index]
        prompt_tokens += len(prompt.token_ids)
        cached_tokens += final.num_cached_tokens
        for output in final.outputs:
            completion_tokens += len(output.token_ids)
            echo = prompt.text if request.echo else ""
            logprobs = (completion_logprobs(state, output, 0, len(output.token_ids), len(echo))
                        if request.logprobs is not None else None)
            choices.append(CompletionChoice(index=index * request.n + output.index, text=echo + output.text,
                                            logprobs=logprobs, finish_reason=output.finish_reason,
                                            stop_reason=output.stop_reason))
    return CompletionResponse(id=request_id, model=state.settings.model_name, choices=choices,
                              usage=usage(prompt_tokens, completion_tokens, cached_tokens))


async def _stream(state: ServerState, request: CompletionRequest, request_id: str, prompts: list[_Prompt],
                  streams: list):
    model = state.settings.model_name
    num_choices = len(prompts) * request.n
    text_sent = [0] * num_choices  # characters of each choice's text already streamed (logprobs' text offsets)
    finish_sent = [False] * num_choices
    echo_pending = [request.echo] * num_choices
    completion_tokens = [0] * len(prompts)
    cached_tokens = [0] * len(prompts)
    include_usage = request.stream_options is not None and request.stream_options.include_usage
    continuous = include_usage and request.stream_options.continuous_usage_stats
    merged = merge_streams(streams)
    try:
        async for index, output in merged:
            completion_tokens[index] += sum(len(o.token_ids) for o in output.outputs)  # outputs are deltas
            cached_tokens[index] = output.num_cached_tokens
            choices = []
            for o in output.outputs:
                choice = index * request.n + o.index
                text = o.text
                finishing = o.finish_reason is not None and not finish_sent[choice]
                if not (text or o.token_ids or finishing):
                    continue
                offset = text_sent[choice]
                if echo_pending[choice]:
                    text = prompts[index].text + text
                    echo_pending[choice] = False
                logprobs = (completion_logprobs(state, o, 0, len(o.token_ids), offset)
                            if request.logprobs is not None else None)
                text_sent[choice] += len(o.text)
                finish_sent[choice] = finish_sent[choice] or finishing
                choices.append(CompletionChoice(index=choice, text=text, logprobs=logprobs,
                                                finish_reason=o.finish_reason if finishing else None,
                                                stop_reason=o.stop_reason if finishing else None))
            if choices:
                chunk = CompletionResponse(id=request_id, model=model, choices=choices)
                if continuous:
                    chunk.usage = _usage_so_far(prompts, completion_tokens, cached_tokens)
                yield sse(chunk)
        if include_usage:
            yield sse(CompletionResponse(id=request_id, model=model, choices=[],
                                         usage=_usage_so_far(prompts, completion_tokens, cached_tokens)))
    except Exception as exc:  # the stream has started (status 200): report in-band, then end it
        yield sse_error(exc)
    finally:
        await merged.aclose()
    yield SSE_DONE


def _usage_so_far(prompts: list[_Prompt], completion_tokens: list[int], cached_tokens: list[int]):
    return usage(sum(len(p.token_ids) for p in prompts), sum(completion_tokens), sum(cached_tokens))
