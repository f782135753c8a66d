"""The console table and the JSON result of a run, laid out like vLLM's `vllm bench serve`.

The table prints the sections of the metrics chosen with --percentile-metrics; the JSON always holds
mean/median/std/pXX for all four metrics (ttft, tpot, itl, e2el), a superset of vLLM's keys.
"""

from collections import Counter
from collections.abc import Sequence

from deltaserve.bench.client import RequestOutput
from deltaserve.bench.metrics import METRIC_NAMES, BenchmarkMetrics

SECTION_TITLES = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
MAX_ERRORS_SHOWN = 10


def percentile_word(p: float) -> str:
    """99.0 -> "99", 99.9 -> "99.9" (vLLM's key spelling: p99_ttft_ms, p99.9_ttft_ms)."""
    return str(int(p)) if int(p) == p else str(p)


def format_table(
    metrics: BenchmarkMetrics,
    duration_s: float,
    selected_metrics: Sequence[str],
    max_concurrency: int | None,
    request_rate: float,
    goodput: bool,
    extra_lines: Sequence[str] = (),
) -> str:
    """The "Serving Benchmark Result" table; `extra_lines` go before the closing rule."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value, fmt: str = "") -> None:
        lines.append("{:<40} {:<10{fmt}}".format(label, value, fmt=fmt))

    row("Successful requests:", metrics.completed)
    row("Failed requests:", metrics.failed)
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    if request_rate != float("inf"):
        row("Request rate configured (RPS):", request_rate, ".2f")
    row("Benchmark duration (s):", duration_s, ".2f")
    row("Total input tokens:", metrics.total_input)
    row("Total generated tokens:", metrics.total_output)
    row("Request throughput (req/s):", metrics.request_throughput, ".2f")
    if goodput:
        row("Request goodput (req/s):", metrics.request_goodput, ".2f")
    row("Output token throughput (tok/s):", metrics.output_throughput, ".2f")
    row("Peak output token throughput (tok/s):", metrics.max_output_tokens_per_s, ".2f")
    row("Peak concurrent requests:", metrics.max_concurrent_requests, ".2f")
    row("Total Token throughput (tok/s):", metrics.total_token_throughput, ".2f")
    for name in METRIC_NAMES:
        if name not in selected_metrics:
            continue
        short, title = SECTION_TITLES[name]
        stats = metrics.stats[name]
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        row(f"Mean {short} (ms):", stats.mean, ".2f")
        row(f"Median {short} (ms):", stats.median, ".2f")
        for p, value in stats.percentiles:
            row(f"P{percentile_word(p)} {short} (ms):", value, ".2f")
    lines.extend(extra_lines)
    lines.append("=" * 50)
    return "\n".join(lines)


def format_errors(outputs: Sequence[RequestOutput]) -> str:
    """Distinct error messages of failed requests with their counts, most frequent first ("" if none)."""
    counts = Counter(out.error or "unknown error" for out in outputs if not out.success)
    if not counts:
        return ""
    lines = [f"{sum(counts.values())} failed requests, {len(counts)} distinct errors:"]
    for message, count in counts.most_common(MAX_ERRORS_SHOWN):
        text = message if len(message) <= 500 else message[:500] + "..."
        lines.append(f"  [{count}x] {text}")
    if len(counts) > MAX_ERRORS_SHOWN:
        lines.append(f"  ... and {len(counts) - MAX_ERRORS_SHOWN} more distinct errors (see --save-detailed)")
    return "\n".join(lines)


def summary_dict(metrics: BenchmarkMetrics, duration_s: float, goodput: bool) -> dict:
    """vLLM's result keys for the run as a whole."""
    result = {
        "duration": duration_s,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput if goodput else None,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
    }
    for name in METRIC_NAMES:
        stats = metrics.stats[name]
        result[f"mean_{name}_ms"] = stats.mean
        result[f"median_{name}_ms"] = stats.median
        result[f"std_{name}_ms"] = stats.std
        for p, value in stats.percentiles:
            result[f"p{percentile_word(p)}_{name}_ms"] = value
    return result


def detailed_dict(outputs: Sequence[RequestOutput], output_lens: Sequence[int]) -> dict:
    """vLLM's per-request lists (--save-detailed), in request order."""
    return {
        "input_lens": [out.prompt_len for out in outputs],
        "output_lens": list(output_lens),
        "ttfts": [out.ttft for out in outputs],
        "itls": [out.itl for out in outputs],
        "latencies": [out.latency for out in outputs],
        "start_times": [out.start_time for out in outputs],
        "generated_texts": [out.generated_text for out in outputs],
        "errors": [out.error for out in outputs],
    }
