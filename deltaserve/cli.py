"""`deltaserve serve [MODEL] [flags]` (a drop-in for `vllm serve`), `deltaserve bench ...`, `deltaserve plan ...`.

Flags keep vLLM's names, defaults and meanings. Each one maps onto an EngineConfig field (engine) or a
ServerSettings field (HTTP server). Three kinds of flags need care:
- NOT_BUILT: flags whose feature does not exist yet. They parse, and startup then fails with one line
  naming the flag, its value and "not supported yet" (exit code 2). A later issue deletes its row here.
- NO_EFFECT: flags that change nothing in this engine; accepted so that vLLM command lines run as they are.
- everything else is honoured; a bad value fails with one line naming the flag (exit code 2).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deltaserve import __version__
from deltaserve.config import (DEVICES, DTYPES, KV_CACHE_DTYPES, QUANTIZATION_FLAGS, SSM_CACHE_DTYPES, ConfigError,
                               EngineConfig)
from deltaserve.model_configs import resolve_model
from deltaserve.server.parsers import REASONING_PARSERS, TOOL_PARSERS
from deltaserve.server.settings import DEMO_MODEL_NAME, UVICORN_LOG_LEVELS, ServerSettings

logger = logging.getLogger("deltaserve")

API_KEY_ENV_VARS = ("DELTASERVE_API_KEY", "VLLM_API_KEY")
# Commands that live in their own modules: name -> (module with main(argv) -> int, one-line help).
# Imported only when used, so `deltaserve serve` does not load them.
OTHER_COMMANDS = {
    "bench": ("deltaserve.bench.cli", "benchmarks against a running server (`deltaserve bench serve --help`)"),
    "plan": ("deltaserve.cache.plan_cli", "print the memory plan of a model and flags (no GPU, no weights)"),
}


@dataclass(frozen=True)
class NotBuilt:
    dest: str  # the argparse destination
    flag: str
    refuses: Callable[[Any], bool]  # True for the values that need the missing feature
    refused_values: str  # those values, in words, for --help
    feature: str


# The one table of flags whose feature is not built yet. Delete a row when its feature lands.
NOT_BUILT = (
    NotBuilt("enable_chunked_prefill", "--no-enable-chunked-prefill", lambda v: v is False, "off",
             "turning chunked prefill off (it is always on)"),
    NotBuilt("api_server_count", "--api-server-count", lambda v: v > 1, "> 1", "several API server processes"),
    NotBuilt("mm_processor_kwargs", "--mm-processor-kwargs", lambda v: v is not None, "any",
             "multimodal input (text only)"),
)
_NOT_BUILT_BY_DEST = {row.dest: row for row in NOT_BUILT}

# Accepted and ignored: what they control does not exist here, so they cannot change a result.
NO_EFFECT = {
    "trust_remote_code": "the model code is built in; no remote code is ever run",
    "language_model_only": "only the language model is ever served (text in, text out)",
    "optimization_level": "there is no torch.compile stage to tune",
    "mamba_cache_mode": "the prefix cache places GDN state checkpoints itself (where prompts end and branch), "
                        "not on vLLM's block grid",
    "mamba_block_size": "the prefix cache places GDN state checkpoints itself, not on a block grid",
}


class NotSupportedYet(Exception):
    """A flag asks for a feature that is not built yet."""


def human_int(text: str) -> int:
    """An integer, also written as vLLM allows: 1k = 1000, 1K = 1024 (k/m/g/t decimal, K/M/G/T binary)."""
    match = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*([kmgtKMGT]?)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected an integer such as 4096, 32k or 8G, got {text!r}")
    number, suffix = match.groups()
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
             "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[suffix]
    value = float(number) * scale
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(value)


def model_len(text: str) -> int | None:
    """--max-model-len: a size, or -1 / auto for "as long as the model and the cache allow"."""
    if text.strip().lower() in ("auto", "-1"):
        return None
    return human_int(text)


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _not_built_help(dest: str, text: str) -> str:
    row = _NOT_BUILT_BY_DEST.get(dest)
    return f"{text} [{row.refused_values}: not supported yet ({row.feature})]" if row else text


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" only where there is a default worth showing and the help does not give one."""

    def _get_help_string(self, action):
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The `serve` flags, grouped as in vLLM's --help."""
    h = _not_built_help
    parser.add_argument("model", nargs="?", default=None,
                        help="checkpoint directory (config.json + safetensors + tokenizer), or a hub id: its copy "
                             "in the local Hugging Face cache, or with --load-format dummy its published config "
                             "shipped with deltaserve (nothing is downloaded); omitted: the built-in tiny demo "
                             "model (a toy trained on a few dozen simple topics)")
    parser.add_argument("--model", dest="model_flag", metavar="MODEL", default=None,
                        help="the same as the positional MODEL (older vLLM spelling)")

    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1",
                        help="address to bind; 0.0.0.0 opens the API to the network (use --api-key)")
    server.add_argument("--port", type=int, default=8000, help="port to listen on")
    server.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="name(s) the API answers to; the first is reported in responses "
                             "(default: MODEL as given, or 'demo')")
    server.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' (default: $DELTASERVE_API_KEY or "
                             "$VLLM_API_KEY if set, else no key)")
    server.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS,
                        help="log level of the HTTP server")
    server.add_argument("--stream-interval", type=int, default=1,
                        help="stream every N tokens (the first and the last go out at once)")
    server.add_argument("--api-server-count", type=int, default=1, help=h("api_server_count",
                        "number of API server processes"))
    server.add_argument("--max-num-seqs-per-request", type=int, default=None, metavar="N",
                        help="most sequences (prompts x n) one request may ask for (default: half of --max-num-seqs, so "
                             "that one request leaves seats for other clients)")
    server.add_argument("--request-body-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="seconds a request's body may take to arrive, else a 408")
    server.add_argument("--disable-fastapi-docs", action="store_true",
                        help="serve no /docs, /redoc, /openapi.json (they answer without --api-key)")

    chat = parser.add_argument_group("chat, reasoning and tools")
    chat.add_argument("--chat-template", default=None,
                      help="Jinja chat template: a file, or the template text (default: the tokenizer's)")
    chat.add_argument("--default-chat-template-kwargs", type=json_object, default=None, metavar="JSON",
                      help='template variables for every request, e.g. \'{"enable_thinking": false}\'; '
                           "a request's chat_template_kwargs override them")
    chat.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                      help="split <think>...</think> into the `reasoning` (and `reasoning_content`) field")
    chat.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                      help="parse the model's tool calls into OpenAI `tool_calls`")
    chat.add_argument("--enable-auto-tool-choice", action="store_true",
                      help='allow tool_choice "auto" (needs --tool-call-parser)')
    chat.add_argument("--generation-config", default="auto",
                      help="'auto': sampling defaults from the checkpoint's generation_config.json; 'vllm': "
                           "ignore it; or a folder holding a generation_config.json")
    chat.add_argument("--override-generation-config", type=json_object, default=None, metavar="JSON",
                      help="sampling defaults on top of the generation config, e.g. '{\"temperature\": 0.6}' "
                           "(temperature, top_p, top_k, min_p, repetition/presence/frequency penalties, "
                           "max_tokens); request fields still win")

    model = parser.add_argument_group("model")
    model.add_argument("--tokenizer", default=None,
                       help="tokenizer directory or hub id (default: MODEL; for a shipped config, which has none, "
                            "a synthetic tokenizer of its vocabulary)")
    model.add_argument("--dtype", default="auto", choices=DTYPES,
                       help="weight and activation dtype (auto: the checkpoint's on GPU, float32 on CPU)")
    model.add_argument("--seed", type=int, default=0, help="random seed (dummy weights, unseeded sampling)")
    model.add_argument("--load-format", default="auto", choices=("auto", "safetensors", "dummy"),
                       help="'dummy' gives random weights of the checkpoint's shapes (config.json only)")
    model.add_argument("-q", "--quantization", default=None, choices=tuple(QUANTIZATION_FLAGS),
                       help="the checkpoint's quantization (default: read from its config; a value that contradicts "
                            "it is refused); fp8 on a bf16 checkpoint quantizes it at load (docs/quantization.md)")
    model.add_argument("--device", default="auto", choices=DEVICES, help="where to run (auto: cuda if present)")
    model.add_argument("--max-model-len", type=model_len, default=None,
                       help="context length in tokens (e.g. 32768, 32k); default: the model's, capped by "
                            "the KV cache")
    model.add_argument("--trust-remote-code", action="store_true",
                       help=f"accepted, no effect: {NO_EFFECT['trust_remote_code']}")
    model.add_argument("--language-model-only", action="store_true",
                       help=f"accepted, no effect: {NO_EFFECT['language_model_only']}")
    model.add_argument("--mm-processor-kwargs", type=json_object, default=None, metavar="JSON",
                       help=h("mm_processor_kwargs", "multimodal processor options"))

    cache = parser.add_argument_group("cache")
    cache.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    cache.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="fraction of GPU memory this server may use")
    cache.add_argument("--kv-cache-memory-bytes", type=human_int, default=None,
                       help="bytes for the KV cache and the GDN states (e.g. 8G); overrides "
                            "--gpu-memory-utilization for them")
    cache.add_argument("--num-gpu-blocks-override", type=int, default=None, help="exact number of KV blocks")
    cache.add_argument("--kv-cache-dtype", default="auto",
                       choices=KV_CACHE_DTYPES + ("fp8_e5m2",),
                       help=h("kv_cache_dtype", "KV cache dtype (auto: the model's; fp8 = fp8_e4m3 with scale 1.0)"))
    cache.add_argument("--mamba-ssm-cache-dtype", default="auto", choices=SSM_CACHE_DTYPES,
                       help="dtype of the GDN recurrent state (auto: the checkpoint's mamba_ssm_dtype, "
                            "else the model dtype, as vLLM)")
    cache.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                       help="reuse the KV blocks and GDN states of shared prompt prefixes (default: on)")
    cache.add_argument("--mamba-cache-mode", default=None, choices=("none", "all", "align"),
                       help=f"accepted, no effect: {NO_EFFECT['mamba_cache_mode']}")
    cache.add_argument("--mamba-block-size", type=int, default=None,
                       help=f"accepted, no effect: {NO_EFFECT['mamba_block_size']}")

    sched = parser.add_argument_group("scheduler and execution")
    sched.add_argument("--max-num-seqs", type=int, default=256, help="most requests running at once")
    sched.add_argument("--max-num-batched-tokens", type=human_int, default=None,
                       help="token budget of one step (long prompts are prefilled in chunks of it); default 8192, "
                            "16384 with --performance-mode throughput")
    sched.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                       help=h("enable_chunked_prefill", "chunked prefill (always on here)"))
    sched.add_argument("--enforce-eager", action="store_true", help="never use CUDA graphs")
    sched.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                       help="schedule and launch the next step before the current one's tokens are read back "
                            "(on by default; output is identical either way)")
    sched.add_argument("--performance-mode", default="balanced",
                       choices=("balanced", "interactivity", "throughput"),
                       help="tuning preset for what is left unset: interactivity = a CUDA graph for every decode "
                            "batch size up to 32; throughput = 16384 batched tokens per step; balanced = neither")
    sched.add_argument("-O", "--optimization-level", type=int, default=None, choices=(0, 1, 2, 3),
                       help=f"accepted, no effect: {NO_EFFECT['optimization_level']}")
    sched.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                       help=h("tensor_parallel_size", "GPUs to shard each layer over"))
    sched.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1,
                       help=h("pipeline_parallel_size", "pipeline stages"))
    sched.add_argument("--distributed-executor-backend", default="mp",
                       help="how ranks run: 'mp', one worker process per rank (the only backend)")


def check_not_built(args: argparse.Namespace) -> None:
    """Raise NotSupportedYet naming every flag (and its value) that asks for a feature not built yet."""
    refused = []
    for row in NOT_BUILT:
        value = getattr(args, row.dest)
        if value is None or not row.refuses(value):
            continue
        shown = row.flag if isinstance(value, bool) else f"{row.flag} {_show(value)}"
        refused.append(f"{shown} is not supported yet ({row.feature})")
    if refused:
        raise NotSupportedYet("; ".join(refused))


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, dict) else str(value)


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerSettings]:
    """EngineConfig + ServerSettings from parsed `serve` flags. Raises NotSupportedYet or ConfigError."""
    from deltaserve.server.chat import load_chat_template

    check_not_built(args)
    if args.model is not None and args.model_flag is not None and args.model != args.model_flag:
        raise ConfigError(f"MODEL given twice: {args.model!r} and --model {args.model_flag!r}")
    model = args.model or args.model_flag
    # a hub id becomes its local folder here, so the server reads that folder's generation_config.json too
    model_path = None if model is None else str(resolve_model(model, need_weights=args.load_format != "dummy"))
    engine = EngineConfig(
        model=model_path, tokenizer=args.tokenizer, dtype=args.dtype, seed=args.seed, load_format=args.load_format,
        quantization=args.quantization, device=args.device, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        num_gpu_blocks_override=args.num_gpu_blocks_override, tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size, distributed_executor_backend=args.distributed_executor_backend, kv_cache_dtype=args.kv_cache_dtype,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype, enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling, performance_mode=args.performance_mode,
        generation_config=args.generation_config, override_generation_config=args.override_generation_config or {},
        # unset: the engine's default
        **({} if args.enable_prefix_caching is None else {"enable_prefix_caching": args.enable_prefix_caching}))
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser")
    api_key = args.api_key or next((os.environ[v] for v in API_KEY_ENV_VARS if os.environ.get(v)), None)
    try:
        settings = ServerSettings(
            host=args.host, port=args.port,
            served_model_names=tuple(args.served_model_name or [model or DEMO_MODEL_NAME]),
            api_key=api_key, chat_template=load_chat_template(args.chat_template),
            enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            default_chat_template_kwargs=args.default_chat_template_kwargs or {},
            stream_interval=args.stream_interval, uvicorn_log_level=args.uvicorn_log_level,
            max_num_seqs_per_request=args.max_num_seqs_per_request, request_body_timeout=args.request_body_timeout,
            disable_fastapi_docs=args.disable_fastapi_docs)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    return engine, settings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deltaserve",
                                     description="Serve hybrid linear-attention LLMs (Qwen3.5, Qwen3-Next).")
    parser.add_argument("--version", action="version", version=__version__)  # the bare version, as `vllm --version`
    commands = parser.add_subparsers(dest="command", required=True, metavar="{serve,bench,plan}")
    serve = commands.add_parser("serve", help="start the OpenAI-compatible server (flags as `vllm serve`)",
                                description="Start the OpenAI-compatible server. Flags follow `vllm serve`.",
                                formatter_class=_HelpFormatter)
    add_serve_args(serve)
    for name, (_, help_text) in OTHER_COMMANDS.items():
        commands.add_parser(name, add_help=False, help=help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in OTHER_COMMANDS:
        module = importlib.import_module(OTHER_COMMANDS[argv[0]][0])
        return module.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        engine_config, settings = configs_from_args(args)
        for dest, why in NO_EFFECT.items():
            if getattr(args, dest) not in (None, False):
                logger.info("--%s has no effect here: %s", dest.replace("_", "-"), why)
        from deltaserve.server.api_server import run_server
        run_server(engine_config, settings)
    except (NotSupportedYet, ConfigError) as exc:
        print(f"deltaserve serve: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
