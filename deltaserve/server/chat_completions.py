"""POST /v1/chat/completions: chat template -> engine -> reasoning / tool-call parsing, streaming or not.

Each choice gets its own ChatOutputParser (parsers.py). Reasoning goes out under both `reasoning` and
`reasoning_content`. tool_choice: "none" (tools are shown to the template, calls are not parsed), "auto"
(needs --enable-auto-tool-choice and --tool-call-parser), "required" or a named function (the server
writes the opening of the call after the prompt, see chat.tool_call_prefill, and a grammar makes the rest a
call whose arguments match the tool's schema, see structured.py).
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from deltaserve.outputs import CompletionOutput
from deltaserve.server.async_engine import collect_output
from deltaserve.server.chat import tool_call_prefill
from deltaserve.server.errors import bad_request
from deltaserve.server.parsers import ChatOutputParser, ParsedDelta
from deltaserve.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ChatStreamChoice,
    DeltaMessage,
    NamedToolChoice,
    ToolCallOut,
)
from deltaserve.server.serving import (
    SSE_DONE,
    ServerState,
    SSEResponse,
    abort_on_disconnect,
    chat_logprobs,
    merge_streams,
    new_id,
    parse_body,
    resolve_max_tokens,
    sampling_params,
    sse,
    sse_error,
    usage,
)
from deltaserve.server.structured import chat_constraint, constrain


async def create_chat_completion(state: ServerState, raw_request: Request) -> Response:
    request = await parse_body(raw_request, ChatCompletionRequest)
    state.check_model(request.model)
    state.check_num_seqs(1, request.n)
    tool_choice = _tool_choice(state, request)
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    rendered = await state.off_loop(state.renderer.render, request.messages, request.tools,
                                    request.add_generation_prompt, request.continue_final_message,
                                    request.chat_template_kwargs)
    prompt_suffix = parser_prefix = ""
    if tool_choice == "required" or isinstance(tool_choice, NamedToolChoice):
        prompt_suffix, parser_prefix = tool_call_prefill(
            state.settings.tool_call_parser, tool_choice,
            rendered.thinking_open and state.settings.reasoning_parser is not None)
    prompt_ids = await state.off_loop(state.encode_checked, rendered.prompt + prompt_suffix, False, "messages")
    requested, param = request.max_completion_tokens, "max_completion_tokens"
    if requested is None:
        requested, param = request.max_tokens, "max_tokens"
    max_tokens = resolve_max_tokens(requested, param, state.sampling_defaults.get("max_tokens"),
                                    len(prompt_ids), state.max_model_len, "messages")
    params = sampling_params(request, state.sampling_defaults, max_tokens,
                             (request.top_logprobs or 0) if request.logprobs else None)
    params = await constrain(state, params, *chat_constraint(
        request, tool_choice, state.settings.tool_call_parser, state.settings.reasoning_parser,
        rendered.thinking_open))

    def new_parser() -> ChatOutputParser:
        named = tool_choice.model_dump() if isinstance(tool_choice, NamedToolChoice) else tool_choice
        tools = [t.model_dump(exclude_none=True) for t in request.tools or []]
        return ChatOutputParser(state.settings.reasoning_parser, state.settings.tool_call_parser, tools,
                                named, rendered.thinking_enabled)

    request_id = new_id("chatcmpl")
    parsers = [new_parser() for _ in range(request.n)]
    generator = state.engine.generate(request_id, prompt_ids, params)
    if request.stream:
        return SSEResponse(_stream(state, request, request_id, len(prompt_ids), generator, parsers,
                                   parser_prefix))

    watcher = asyncio.create_task(abort_on_disconnect(raw_request, state.engine, [request_id]))
    try:
        final = await collect_output(generator)
    finally:
        watcher.cancel()
    choices = []
    for output, parser in zip(final.outputs, parsers):
        parsed = parser.parse(parser_prefix + output.text)
        reasoning = parsed.reasoning if request.include_reasoning else None
        content = parsed.content
        if content is None and not parsed.tool_calls and reasoning is None:
            content = ""
        message = ChatMessageOut(content=content, reasoning=reasoning, reasoning_content=reasoning,
                                 tool_calls=[ToolCallOut.model_validate(c.to_dict()) for c in parsed.tool_calls])
        logprobs = (ChatLogprobs(content=chat_logprobs(state, output, 0, len(output.token_ids),
                                                       request.top_logprobs or 0))
                    if request.logprobs else None)
        choices.append(ChatChoice(index=output.index, message=message, logprobs=logprobs,
                                  finish_reason=_finish_reason(output, bool(parsed.tool_calls)),
                                  stop_reason=output.stop_reason))
    completion_tokens = sum(len(o.token_ids) for o in final.outputs)
    response = ChatCompletionResponse(id=request_id, model=state.settings.model_name, choices=choices,
                                      usage=usage(len(prompt_ids), completion_tokens, final.num_cached_tokens))
    return JSONResponse(response.model_dump())


def _tool_choice(state: ServerState, request: ChatCompletionRequest) -> str | NamedToolChoice:
    """The effective tool_choice, or a 400 if the server is not set up for it."""
    choice = request.tool_choice
    if not request.tools:
        if choice not in (None, "none"):
            raise bad_request(f"tool_choice {_describe(choice)} needs a non-empty `tools` list", "tool_choice")
        return "none"
    choice = choice or "auto"
    settings = state.settings
    if choice == "auto" and not (settings.enable_auto_tool_choice and settings.tool_call_parser):
        raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                          "set when the server starts", "tool_choice")
    if (choice == "required" or isinstance(choice, NamedToolChoice)) and not settings.tool_call_parser:
        raise bad_request(f"tool_choice {_describe(choice)} requires the server to run with --tool-call-parser",
                          "tool_choice")
    if isinstance(choice, NamedToolChoice):
        names = [t.function.name for t in request.tools]
        if choice.function.name not in names:
            raise bad_request(f"tool_choice names function {choice.function.name!r}, which is not in tools "
                              f"{names}", "tool_choice")
    return choice


def _describe(choice) -> str:
    return repr(choice.function.name) if isinstance(choice, NamedToolChoice) else repr(choice)


def _finish_reason(output: CompletionOutput, called_tools: bool) -> str | None:
    if output.finish_reason == "stop" and called_tools:
        return "tool_calls"
    return output.finish_reason


def _merge(first: ParsedDelta, second: ParsedDelta) -> ParsedDelta:
    def join(a, b):
        return (a or "") + (b or "") or None

    return ParsedDelta(join(first.reasoning, second.reasoning), join(first.content, second.content),
                       first.tool_calls + second.tool_calls)


async def _stream(state: ServerState, request: ChatCompletionRequest, request_id: str, num_prompt_tokens: int,
                  generator, parsers: list[ChatOutputParser], parser_prefix: str):
    model = state.settings.model_name
    n = request.n
    finish_sent, called_tools = [False] * n, [False] * n
    # The forced opening of a tool call (if any) is parsed first; it goes out with the first delta.
    pending = [parser.feed(parser_prefix) if parser_prefix else ParsedDelta() for parser in parsers]
    include_usage = request.stream_options is not None and request.stream_options.include_usage
    continuous = include_usage and request.stream_options.continuous_usage_stats
    completion_tokens = cached_tokens = 0

    def chunk(choices, with_usage=False) -> str:
        body = ChatCompletionChunk(id=request_id, model=model, choices=choices)
        if with_usage:
            body.usage = usage(num_prompt_tokens, completion_tokens, cached_tokens)
        return sse(body)

    def role_chunk() -> str:
        return chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(n)])

    merged = merge_streams([generator])
    role_sent = False
    try:
        async for _, output in merged:
            if not role_sent:  # with the first token, not before: clients time TTFT from the first chunk
                yield role_chunk()
                role_sent = True
            completion_tokens += sum(len(o.token_ids) for o in output.outputs)  # outputs are deltas
            cached_tokens = output.num_cached_tokens
            choices = []
            for o in output.outputs:
                i = o.index
                finishing = o.finish_reason is not None and not finish_sent[i]
                parsed = _merge(pending[i], parsers[i].feed(o.text)) if o.text else pending[i]
                pending[i] = ParsedDelta()
                if finishing:
                    parsed = _merge(parsed, parsers[i].finish())
                    finish_sent[i] = True
                called_tools[i] = called_tools[i] or bool(parsed.tool_calls)
                reasoning = parsed.reasoning if request.include_reasoning else None
                logprobs = None
                if request.logprobs and o.token_ids:
                    logprobs = ChatLogprobs(content=chat_logprobs(state, o, 0, len(o.token_ids),
                                                                  request.top_logprobs or 0))
                if not (reasoning or parsed.content or parsed.tool_calls or logprobs or finishing):
                    continue
                delta = DeltaMessage(content=parsed.content, reasoning=reasoning, reasoning_content=reasoning,
                                     tool_calls=[c.to_dict() for c in parsed.tool_calls] or None)
                choices.append(ChatStreamChoice(
                    index=i, delta=delta, logprobs=logprobs,
                    finish_reason=_finish_reason(o, called_tools[i]) if finishing else None,
                    stop_reason=o.stop_reason if finishing else None))
            if choices:
                yield chunk(choices, continuous)
        if not role_sent:
            yield role_chunk()
        if include_usage:
            yield chunk([], with_usage=True)
    except Exception as exc:  # the stream has started (status 200): report in-band, then end it
        yield sse_error(exc)
    finally:
        await merged.aclose()
    yield SSE_DONE
