"""Flags of `deltaserve bench serve` (vLLM's `vllm bench serve` names and defaults) and their checks."""

import argparse
import json
import math
import uuid

from deltaserve.bench.client import BACKENDS, DEFAULT_ENDPOINTS
from deltaserve.bench.datasets import DATASET_NAMES
from deltaserve.bench.errors import BenchInputError
from deltaserve.bench.metrics import GOODPUT_METRICS, METRIC_NAMES


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Add every `bench serve` flag to `parser`."""
    server = parser.add_argument_group("server")
    server.add_argument("--backend", choices=BACKENDS, default="openai",
                        help="openai or vllm: /v1/completions; openai-chat or vllm-chat: /v1/chat/completions")
    server.add_argument("--base-url", default=None, help="server URL, e.g. http://10.0.0.2:8000 (else --host/--port)")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--endpoint", default=None,
                        help="API path (default /v1/completions or /v1/chat/completions by --backend)")
    server.add_argument("--model", default=None, help="model name (default: the first id of GET /v1/models)")
    server.add_argument("--served-model-name", default=None,
                        help="model name sent in requests, if it differs from --model")
    server.add_argument("--tokenizer", default=None,
                        help="local tokenizer directory (default: --model, when it is a local directory)")
    server.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    server.add_argument("--header", metavar="KEY=VALUE", nargs="*", default=None, help="extra HTTP headers")
    server.add_argument("--request-id-prefix", default=f"bench-{uuid.uuid4().hex[:8]}-",
                        help="x-request-id = prefix + request index (default: bench-<random>-)")

    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset-name", choices=DATASET_NAMES, default="random")
    data.add_argument("--dataset-path", default=None, help="local file for sharegpt (JSON) or custom (JSONL)")
    data.add_argument("--num-prompts", type=int, default=1000)
    data.add_argument("--input-len", type=int, default=None, help="sets --random-input-len")
    data.add_argument("--output-len", type=int, default=None, help="sets every dataset's output length")
    data.add_argument("--random-input-len", type=int, default=1024,
                      help="prompt tokens, exact under the tokenizer (special tokens excluded)")
    data.add_argument("--random-output-len", type=int, default=128, help="max_tokens (random and multi_turn)")
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="lengths uniform in [len*(1-r), len*(1+r)]; 0 = fixed; r in [0, 1)")
    data.add_argument("--random-prefix-len", type=int, default=0, help="shared random prefix before each prompt")
    data.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    data.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    data.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    data.add_argument("--prefix-repetition-output-len", type=int, default=128)
    data.add_argument("--sharegpt-output-len", type=int, default=None,
                      help="fixed output length (default: the dataset reply's length)")
    data.add_argument("--custom-output-len", type=int, default=256)
    data.add_argument("--skip-chat-template", action="store_true",
                      help="custom dataset, completions backends: send prompts without the tokenizer's chat "
                           "template")
    data.add_argument("--multi-turn-num-turns", type=int, default=8)
    data.add_argument("--multi-turn-sessions", type=int, default=4)
    data.add_argument("--multi-turn-new-tokens", type=int, default=2000,
                      help="new random tokens added to each turn after the first (turn 0: --random-input-len)")

    traffic = parser.add_argument_group("traffic")
    traffic.add_argument("--max-concurrency", type=int, default=None,
                         help="most requests in flight (multi_turn: sessions); default unlimited")
    traffic.add_argument("--request-rate", type=float, default=float("inf"),
                         help="requests (multi_turn: sessions) per second; inf = all at once")
    traffic.add_argument("--burstiness", type=float, default=1.0,
                         help="gamma shape of the arrival gaps: 1 = Poisson, < 1 burstier, > 1 more uniform")
    traffic.add_argument("--num-warmups", type=int, default=0)
    traffic.add_argument("--ready-check-timeout-sec", type=int, default=600,
                         help="send the first request once, untimed, until it succeeds (as vLLM: the server ready "
                              "and its first-request costs out of the figures), retrying for up to this many "
                              "seconds; 0 skips it")
    traffic.add_argument("--ignore-eos", action="store_true",
                         help="send ignore_eos (always on for the synthetic random and multi_turn datasets; "
                              "vLLM does the same for random)")
    traffic.add_argument("--temperature", type=float, default=None, help="default: the server's")
    traffic.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into every request body")
    traffic.add_argument("--seed", type=int, default=0)

    report = parser.add_argument_group("report")
    report.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                        help=f"comma-separated subset of {','.join(METRIC_NAMES)}")
    report.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles, e.g. 50,90,99")
    report.add_argument("--goodput", nargs="+", default=None, metavar="KEY:VALUE",
                        help=f"SLOs in ms for goodput, keys {', '.join(GOODPUT_METRICS)}")
    report.add_argument("--save-result", action="store_true")
    report.add_argument("--save-detailed", action="store_true", help="add per-request lists to the result")
    report.add_argument("--result-dir", default=None)
    report.add_argument("--result-filename", default=None)
    report.add_argument("--label", default=None, help="result file prefix (default: --backend)")
    report.add_argument("--metadata", metavar="KEY=VALUE", nargs="*", default=None,
                        help="extra key/values stored in the result JSON")
    report.add_argument("--disable-tqdm", action="store_true")


def validate_args(args: argparse.Namespace) -> None:
    """Check flags that need no server or tokenizer; fill derived fields (endpoint, parsed lists).

    Raises BenchInputError naming the flag and its value.
    """
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.prefix_repetition_output_len = args.output_len
        args.sharegpt_output_len = args.custom_output_len = args.output_len
    if args.endpoint is None:
        args.endpoint = DEFAULT_ENDPOINTS[args.backend]

    _at_least(args, 1, "num_prompts", "max_concurrency", "random_output_len", "prefix_repetition_num_prefixes",
              "prefix_repetition_output_len", "custom_output_len", "sharegpt_output_len",
              "multi_turn_num_turns", "multi_turn_sessions")
    _at_least(args, 0, "random_input_len", "random_prefix_len", "prefix_repetition_prefix_len",
              "prefix_repetition_suffix_len", "multi_turn_new_tokens", "num_warmups", "ready_check_timeout_sec")
    if not 0.0 <= args.random_range_ratio < 1.0:
        raise BenchInputError(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if not args.request_rate > 0:
        raise BenchInputError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    if not args.burstiness > 0:
        raise BenchInputError(f"--burstiness must be > 0, got {args.burstiness}")
    if args.dataset_name == "prefix_repetition" and args.num_prompts < args.prefix_repetition_num_prefixes:
        raise BenchInputError(
            f"--num-prompts {args.num_prompts} is smaller than --prefix-repetition-num-prefixes "
            f"{args.prefix_repetition_num_prefixes}; every prefix needs at least one prompt"
        )
    if args.dataset_name == "multi_turn" and args.random_input_len < 1:
        raise BenchInputError(f"--random-input-len (turn 0 of multi_turn) must be >= 1, got {args.random_input_len}")
    needs_file = args.dataset_name in ("sharegpt", "custom")
    if needs_file and args.dataset_path is None:
        raise BenchInputError(f"--dataset-name {args.dataset_name} needs --dataset-path")
    if not needs_file and args.dataset_path is not None:
        raise BenchInputError(f"--dataset-name {args.dataset_name} takes no --dataset-path ({args.dataset_path})")
    if args.extra_body is not None and not isinstance(args.extra_body, dict):
        raise BenchInputError(f"--extra-body must be a JSON object, got {args.extra_body!r}")

    args.selected_metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    for name in args.selected_metrics:
        if name not in METRIC_NAMES:
            raise BenchInputError(f"--percentile-metrics: unknown metric {name!r}; choose from {METRIC_NAMES}")
    args.percentiles = [_percentile(p) for p in args.metric_percentiles.split(",")]
    args.goodput_slos_ms = _parse_goodput(args.goodput or [])
    args.header_dict = _parse_pairs(args.header or [], "--header")
    args.metadata_dict = _parse_pairs(args.metadata or [], "--metadata")


def _at_least(args: argparse.Namespace, minimum: int, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < minimum:
            raise BenchInputError(f"--{name.replace('_', '-')} must be >= {minimum}, got {value}")


def _percentile(text: str) -> float:
    try:
        p = float(text)
    except ValueError:
        raise BenchInputError(f"--metric-percentiles: {text!r} is not a number") from None
    if not 0 < p <= 100:
        raise BenchInputError(f"--metric-percentiles: {p} is outside (0, 100]")
    return p


def _parse_goodput(pairs: list[str]) -> dict[str, float]:
    slos = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        try:
            slo = float(value)
        except ValueError:
            slo = math.nan
        if not sep or name not in GOODPUT_METRICS or not slo >= 0:
            raise BenchInputError(
                f"--goodput {pair!r}: expected KEY:VALUE with KEY in {GOODPUT_METRICS} and VALUE >= 0 (ms)"
            )
        slos[name] = slo
    return slos


def _parse_pairs(items: list[str], flag: str) -> dict[str, str]:
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise BenchInputError(f"{flag} {item!r}: expected KEY=VALUE")
        pairs[key.strip()] = value.strip()
    return pairs
