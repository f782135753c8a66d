"""`deltaserve bench serve`: a load generator for any OpenAI-compatible server, compatible with
`vllm bench serve` (flags, console table, JSON keys, metric definitions).

Flow: check flags -> ask the server for its models (clear error if it is unreachable or does not serve the
model) -> load the local tokenizer -> build every prompt (all tokenizer work happens here, before timing)
-> warm up -> timed run (traffic.py) -> metrics (metrics.py) -> error summary, table, JSON (report.py).
"""

import argparse
import asyncio
import json
import os
from datetime import datetime

from deltaserve.bench import datasets, multi_turn
from deltaserve.bench.args import add_serve_args, validate_args
from deltaserve.bench.client import BACKEND_APIS, Endpoint, RequestInput, list_served_models
from deltaserve.bench.errors import BenchInputError
from deltaserve.bench.metrics import chunk_token_counts, compute_metrics, output_token_counts
from deltaserve.bench.randtext import RandomTextGenerator
from deltaserve.bench.report import detailed_dict, format_errors, format_table, summary_dict
from deltaserve.bench.traffic import TimedRun, Workload, run_traffic
from deltaserve.server.settings import DEMO_MODEL_NAME

__all__ = ["add_serve_args", "run_serve"]

# Synthetic prompts ask for an exact output length, so vLLM sends ignore_eos for them without the flag.
IGNORE_EOS_DATASETS = ("random", "multi_turn")


def run_serve(args: argparse.Namespace) -> dict:
    """Run the benchmark described by parsed `bench serve` flags; print the report and return the result
    dict (what --save-result writes). Raises BenchInputError for bad flags, files, server or tokenizer."""
    validate_args(args)
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    headers = dict(args.header_dict)
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"

    model, api_model = asyncio.run(resolve_model(args, base_url, headers))
    tokenizer_path = args.tokenizer or model
    tokenizer = load_tokenizer(tokenizer_path, from_flag="--tokenizer" if args.tokenizer else "--model")
    workload = build_workload(args, tokenizer)
    if args.temperature is None:
        print("Note: no --temperature given; the server's default applies (pass --temperature 0 for greedy).")
    sampling = {} if args.temperature is None else {"temperature": args.temperature}
    endpoint = Endpoint(
        api_url=base_url + args.endpoint, backend=args.backend, model=api_model, headers=headers,
        extra_body={**sampling, **(args.extra_body or {})},
        ignore_eos=args.ignore_eos or args.dataset_name in IGNORE_EOS_DATASETS,
    )
    run = asyncio.run(run_traffic(
        endpoint, workload, request_rate=args.request_rate, burstiness=args.burstiness, seed=args.seed,
        max_concurrency=args.max_concurrency, num_warmups=args.num_warmups,
        ready_check_timeout_s=args.ready_check_timeout_sec, show_progress=not args.disable_tqdm,
    ))
    result = report(args, run, tokenizer, model, tokenizer_path)
    if args.save_result:
        path = _result_path(args, model, result["date"])
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f)
        print(f"Result saved to {path}")
    return result


async def resolve_model(args: argparse.Namespace, base_url: str, headers: dict[str, str]) -> tuple[str, str]:
    """(model, name sent in requests): --model or the server's first model; checked against GET /v1/models
    when the server lists its models."""
    served = await list_served_models(base_url, headers)
    model = args.model
    if model is None:
        if not served:
            raise BenchInputError(f"GET {base_url}/v1/models listed no model; pass --model")
        model = served[0]
    api_model = args.served_model_name or model
    if served is not None and api_model not in served:
        listed = ", ".join(served) or "nothing"
        raise BenchInputError(f"model {api_model!r} is not served at {base_url}; it serves: {listed}")
    return model, api_model


def load_tokenizer(path: str, from_flag: str):
    """transformers.AutoTokenizer from a local directory (the built-in demo model's for the name the server gives
    it, "demo", where no such directory exists); BenchInputError if there is none."""
    if path == DEMO_MODEL_NAME and not os.path.isdir(path):
        from deltaserve.demo import demo_model_path

        path = str(demo_model_path())
    if not os.path.isdir(path):
        hint = "" if from_flag == "--tokenizer" else "; pass --tokenizer DIR (a local tokenizer directory)"
        raise BenchInputError(f"tokenizer missing: {from_flag} {path!r} is not a local directory{hint}")
    from transformers import AutoTokenizer  # slow import, needed only once the flags are known to be good

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise BenchInputError(f"tokenizer missing: cannot load a tokenizer from {path!r}: {e}") from None


def build_workload(args: argparse.Namespace, tokenizer) -> Workload:
    """Every prompt of the run (multi-turn: the random text of every turn), built before any timing."""
    gen = RandomTextGenerator(tokenizer, args.seed)
    if args.dataset_name == "multi_turn":
        sessions = multi_turn.plan_sessions(
            gen, args.multi_turn_sessions, args.multi_turn_num_turns, args.random_input_len,
            args.multi_turn_new_tokens, args.random_output_len,
        )
        # A prompt of its own, so that warm-ups leave nothing in the prefix cache for turn 0 to hit.
        warmup_text = gen.text(args.random_input_len)
        warmup = RequestInput(warmup_text, args.random_input_len, args.random_output_len,
                              f"{args.request_id_prefix}warmup")
        return Workload([], sessions, args.request_id_prefix, warmup)
    requests = [
        RequestInput(sample.prompt, sample.prompt_len, sample.expected_output_len, f"{args.request_id_prefix}{i}")
        for i, sample in enumerate(_single_turn_samples(args, tokenizer, gen))
    ]
    # The first request's lengths on a prompt of its own: vLLM warms up with the first request itself, which a
    # server with prefix caching then answers from its cache in the timed run.
    first = requests[0]
    warmup = RequestInput(gen.text(first.prompt_len), first.prompt_len, first.output_len,
                          f"{args.request_id_prefix}warmup")
    return Workload(requests, [], args.request_id_prefix, warmup)


def report(args: argparse.Namespace, run: TimedRun, tokenizer, model: str, tokenizer_path: str) -> dict:
    """Metrics of a finished run: print the error summary and the table; return the result dict."""

    def count_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    def count_texts(texts: list[str]) -> list[int]:
        return [len(ids) for ids in tokenizer(texts, add_special_tokens=False).input_ids]

    for request, output in zip(run.inputs, run.outputs):
        if output.prompt_len is None:  # a multi-turn prompt, and no usage.prompt_tokens from the server
            output.prompt_len = multi_turn.prompt_token_count(request.prompt, count_tokens)
    output_lens = output_token_counts(run.outputs, count_tokens)
    goodput = bool(args.goodput_slos_ms)
    chunk_tokens = chunk_token_counts(run.outputs, output_lens, count_texts)
    metrics = compute_metrics(run.outputs, output_lens, run.duration_s, args.percentiles, args.goodput_slos_ms,
                              chunk_tokens)

    result = _result_header(args, model, tokenizer_path, len(run.outputs))
    result.update(summary_dict(metrics, run.duration_s, goodput))
    turn_lines = []
    if args.dataset_name == "multi_turn":
        by_turn = multi_turn.ttft_by_turn(run.outputs, run.turn_indices, args.multi_turn_num_turns)
        result.update(by_turn)
        turn_lines = multi_turn.format_turn_lines(by_turn)
    errors = format_errors(run.outputs)
    if errors:
        print(errors)
    print(format_table(metrics, run.duration_s, args.selected_metrics, args.max_concurrency, args.request_rate,
                       goodput, turn_lines))
    if args.save_detailed:
        result.update(detailed_dict(run.outputs, output_lens))
    return result


def _single_turn_samples(args: argparse.Namespace, tokenizer, gen: RandomTextGenerator) -> list:
    name = args.dataset_name
    if name == "random":
        return datasets.sample_random(gen, args.num_prompts, args.random_input_len, args.random_output_len,
                                      args.random_range_ratio, args.random_prefix_len)
    if name == "prefix_repetition":
        return datasets.sample_prefix_repetition(
            gen, args.num_prompts, args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes, args.prefix_repetition_output_len,
        )
    if name == "sharegpt":
        return datasets.sample_sharegpt(args.dataset_path, tokenizer, args.num_prompts, args.sharegpt_output_len,
                                        args.seed)
    # custom: with the chat backend the server applies the chat template itself
    apply_template = BACKEND_APIS[args.backend] == "completions" and not args.skip_chat_template
    return datasets.sample_custom(args.dataset_path, tokenizer, args.num_prompts, args.custom_output_len,
                                  apply_template, args.seed)


def _result_header(args: argparse.Namespace, model: str, tokenizer_path: str, num_requests: int) -> dict:
    """The configuration part of the result JSON (vLLM's keys), then the --metadata pairs."""
    header = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": args.backend,
        "backend": args.backend,
        "label": args.label,
        "model_id": model,
        "tokenizer_id": tokenizer_path,
        "dataset_name": args.dataset_name,
        "num_prompts": num_requests,
    }
    header.update(args.metadata_dict)
    header["request_rate"] = args.request_rate if args.request_rate < float("inf") else "inf"
    header["burstiness"] = args.burstiness
    header["max_concurrency"] = args.max_concurrency
    return header


def _result_path(args: argparse.Namespace, model: str, date: str) -> str:
    """vLLM's default name: {label}-{rate}qps[-concurrencyN]-{model basename}-{date}.json."""
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    model_name = model.rstrip("/").split("/")[-1]
    label = args.label or args.backend
    name = args.result_filename or f"{label}-{args.request_rate}qps{concurrency}-{model_name}-{date}.json"
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    return name
