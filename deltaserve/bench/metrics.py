"""Benchmark arithmetic, written to give the same numbers as vLLM's `vllm bench serve`.

Over successful requests only (failed ones add 0 output tokens and nothing else):
- TTFT, E2EL: one value per request.
- TPOT per request = (e2el - ttft) / (output_tokens - 1), only for requests with more than 1 output token.
- ITL: every inter-chunk gap of every request, pooled into one list.
- mean / median / std (population) / percentiles with numpy's default linear interpolation, in ms; an empty
  list reports 0 (vLLM's `np.mean(values or 0)`).
- throughputs divide by the benchmark duration: completed requests, output tokens, input + output tokens.
- goodput: requests meeting every given SLO (ms; ttft, tpot, e2el; a request with <= 1 output token has
  TPOT 0 for this test) per second.
- peak output throughput: the output tokens each chunk carried (first chunk at start + ttft, then one per
  itl), summed in 1-second buckets from the earliest request start; the fullest bucket. vLLM counts every
  chunk as one token: the same where a chunk carries one token, but below the mean throughput where a server
  joins several tokens a chunk (one that falls behind its streams, or --stream-interval N), and one too many
  per chat request (its first chunk carries only the role). A chunk's tokens are its text's tokens, scaled
  so that a request's chunks add up to its output tokens (chunk_token_counts).
- peak concurrent requests: the most requests in flight at once, intervals [start, start + e2el).
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from deltaserve.bench.client import RequestOutput

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class MetricStats:
    """Summary of one latency metric, in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: list[tuple[float, float]]  # (percentile, value)


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    stats: dict[str, MetricStats] = field(default_factory=dict)  # keyed by METRIC_NAMES


def summarize_ms(values_s: Sequence[float], percentiles: Sequence[float]) -> MetricStats:
    """mean / median / std / percentiles of `values_s` (seconds), reported in ms; empty -> all 0."""
    values = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64) * 1000.0
    return MetricStats(
        mean=float(np.mean(values)),
        median=float(np.median(values)),
        std=float(np.std(values)),
        percentiles=[(p, float(np.percentile(values, p))) for p in percentiles],
    )


def output_token_counts(outputs: Sequence[RequestOutput], count_tokens: Callable[[str], int]) -> list[int]:
    """Output tokens per request: the server's usage when reported (and non-zero, as in vLLM), else the
    re-tokenized generated text (reasoning + content); 0 for failed requests."""
    counts = []
    for out in outputs:
        if not out.success:
            counts.append(0)
        elif out.output_tokens:
            counts.append(int(out.output_tokens))
        else:
            counts.append(count_tokens(out.reasoning_text + out.generated_text))
    return counts


def compute_metrics(
    outputs: Sequence[RequestOutput],
    output_lens: Sequence[int],
    duration_s: float,
    percentiles: Sequence[float],
    goodput_slos_ms: dict[str, float] | None = None,
    chunk_tokens: Sequence[np.ndarray] | None = None,
) -> BenchmarkMetrics:
    """All run metrics from per-request outputs and their output token counts (see the module docstring).
    chunk_tokens: per request, the tokens of each chunk (chunk_token_counts); None spreads each request's
    tokens evenly over its chunks."""
    if chunk_tokens is None:
        chunk_tokens = chunk_token_counts(outputs, output_lens, None)
    ttfts, e2els, tpots, itls, tpots_for_goodput = [], [], [], [], []
    total_input = 0
    for out, num_out in zip(outputs, output_lens):
        if not out.success:
            continue
        total_input += int(out.prompt_len or 0)
        tpot = 0.0
        if num_out > 1:
            tpot = (out.latency - out.ttft) / (num_out - 1)
            tpots.append(tpot)
        tpots_for_goodput.append(tpot)
        ttfts.append(out.ttft)
        e2els.append(out.latency)
        itls.extend(out.itl)
    completed = len(ttfts)
    total_output = int(sum(output_lens))

    good = 0
    if goodput_slos_ms:
        per_metric = {"ttft": ttfts, "tpot": tpots_for_goodput, "e2el": e2els}
        checks = [(per_metric[name], slo_ms / 1000.0) for name, slo_ms in goodput_slos_ms.items()]
        good = sum(all(values[i] <= slo_s for values, slo_s in checks) for i in range(completed))

    successes = [out for out in outputs if out.success]
    success_chunk_tokens = [tokens for out, tokens in zip(outputs, chunk_tokens) if out.success]
    return BenchmarkMetrics(
        completed=completed,
        failed=len(outputs) - completed,
        total_input=total_input,
        total_output=total_output,
        request_throughput=completed / duration_s,
        request_goodput=good / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        max_output_tokens_per_s=peak_tokens_per_second(successes, success_chunk_tokens),
        max_concurrent_requests=peak_concurrency(successes),
        stats={
            "ttft": summarize_ms(ttfts, percentiles),
            "tpot": summarize_ms(tpots, percentiles),
            "itl": summarize_ms(itls, percentiles),
            "e2el": summarize_ms(e2els, percentiles),
        },
    )


def chunk_token_counts(
    outputs: Sequence[RequestOutput],
    output_lens: Sequence[int],
    count_texts: Callable[[list[str]], list[int]] | None,
) -> list[np.ndarray]:
    """Per request, the output tokens each of its chunks carried (floats; empty for a failed request): the
    chunk texts' token counts (`count_texts`, a batch tokenizer count), scaled to add up to the request's
    output tokens; where the texts hold no token (or count_texts is None) the tokens are spread evenly."""
    counts = []
    for out, num_out in zip(outputs, output_lens):
        num_chunks = 1 + len(out.itl) if out.success else 0
        texts = out.chunk_texts if len(out.chunk_texts) == num_chunks else []
        tokens = np.asarray(count_texts(texts) if texts and count_texts else [0] * num_chunks, dtype=np.float64)
        total = tokens.sum()
        counts.append(tokens * (num_out / total) if total > 0 else np.full(num_chunks, num_out / max(num_chunks, 1)))
    return counts


def peak_tokens_per_second(successes: Sequence[RequestOutput], chunk_tokens: Sequence[np.ndarray]) -> float:
    """Most output tokens that arrived within one 1-second bucket counted from the earliest start."""
    if not successes:
        return 0.0
    t0 = min(out.start_time for out in successes)
    end = max(out.start_time + out.latency for out in successes)
    buckets = np.zeros(int(np.ceil(end - t0)) + 1)
    for out, tokens in zip(successes, chunk_tokens):
        # chunk arrival times: start + ttft, then each itl after the previous chunk
        arrivals = out.start_time + out.ttft + np.concatenate(([0.0], np.cumsum(out.itl)))
        index = (arrivals - t0).astype(np.int64)
        inside = (index >= 0) & (index < len(buckets))
        np.add.at(buckets, index[inside], tokens[inside])
    return float(buckets.max())


def peak_concurrency(successes: Sequence[RequestOutput]) -> int:
    """Most requests in flight at once; an end and a start at the same instant do not overlap."""
    events = [(out.start_time, 1) for out in successes]
    events += [(out.start_time + out.latency, -1) for out in successes]
    events.sort()  # at equal times -1 sorts before +1: half-open intervals
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak
