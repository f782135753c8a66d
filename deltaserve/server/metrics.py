"""Prometheus metrics under vLLM's names, so that existing dashboards and scrapers work unchanged.

Each server owns its registry (several servers can live in one process, as in the tests). The engine
thread updates the metrics (prometheus_client is thread-safe); GET /metrics renders them. What every running
request adds every step (its generated tokens, its inter-token latency) goes in once a step (`on_step`), not
as a prometheus_client observe and increment per request per step, which would grow the engine thread's host
work with the number of streams.

    gauges      vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc (0..1)
    counters    vllm:prompt_tokens_total, vllm:generation_tokens_total, vllm:request_success_total
                {finished_reason}, vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total (tokens)
    histograms  vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
                vllm:e2e_request_latency_seconds
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import Counter as Tally

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

# Bucket edges as vLLM uses them (seconds).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST
# No `*_created` timestamp series next to every counter and histogram (vLLM turns them off too).
disable_created_metrics()


class _StepHistogram:
    """A histogram fed a step's samples at once, rendered as prometheus_client renders its Histogram (same
    names, labels and cumulative `le` buckets). Thread-safe: the engine thread adds, /metrics reads."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], labels: dict[str, str]):
        self._name, self._documentation, self._labels = name, documentation, labels
        self._bounds = [*buckets, math.inf]
        self._counts = [0] * len(self._bounds)  # per bucket, not cumulative
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe_many(self, values: list[float]) -> None:
        """Add each value to the first bucket whose bound is >= it (a step's values are mostly equal)."""
        tally = Tally(values)
        with self._lock:
            for value, count in tally.items():
                self._counts[bisect.bisect_left(self._bounds, value)] += count
                self._sum += value * count

    def collect(self):
        with self._lock:
            counts, total = list(self._counts), self._sum
        family = HistogramMetricFamily(self._name, self._documentation, labels=list(self._labels))
        cumulative, buckets = 0, []
        for bound, count in zip(self._bounds, counts):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        family.add_metric(list(self._labels.values()), buckets, total)
        yield family


class ServerMetrics:
    def __init__(self, model_name: str, prefix_caching: bool = False, cache_info: dict[str, str] | None = None):
        self.registry = CollectorRegistry()
        self.prefix_caching = prefix_caching
        labels = ["model_name"]
        self._label = {"model_name": model_name}

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=self.registry).labels(**self._label)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=self.registry).labels(**self._label)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(**self._label)

        self.num_running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("vllm:num_preemptions", "Requests preempted (their KV freed, recomputed).")
        self._preemptions_seen = 0
        self._success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                                labels + ["finished_reason"], registry=self.registry)
        for reason in ("stop", "length", "abort"):  # present at 0 from the start, as vLLM does
            self._success.labels(finished_reason=reason, **self._label)
        if cache_info:  # the memory plan's figures as labels of a constant 1, like vLLM's cache_config_info
            Gauge("vllm:cache_config_info", "Information of the cache configuration (the memory plan).",
                  list(cache_info), registry=self.registry).labels(**cache_info).set(1)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = _StepHistogram("vllm:inter_token_latency_seconds", "Time between output tokens.", _ITL_BUCKETS,
                                  self._label)
        self.registry.register(self.itl)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", _E2E_BUCKETS)

    def set_engine_state(self, num_running: int, num_waiting: int, kv_cache_usage: float,
                         num_preemptions: int = 0) -> None:
        """num_preemptions: the scheduler's count since start-up (the counter takes what is new)."""
        self.num_running.set(num_running)
        self.num_waiting.set(num_waiting)
        self.kv_cache_usage.set(kv_cache_usage)
        if num_preemptions > self._preemptions_seen:
            self.num_preemptions.inc(num_preemptions - self._preemptions_seen)
            self._preemptions_seen = num_preemptions

    def on_first_token(self, ttft: float, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """The prompt is done and the first token is out."""
        self.ttft.observe(ttft)
        self.prompt_tokens.inc(num_prompt_tokens)
        if self.prefix_caching:
            self.prefix_cache_queries.inc(num_prompt_tokens)
            self.prefix_cache_hits.inc(num_cached_tokens)

    def on_step(self, num_tokens: int, intervals: list[float]) -> None:
        """A step generated num_tokens in all; intervals: for each request past its first token that got tokens,
        the seconds since its previous ones."""
        if num_tokens:
            self.generation_tokens.inc(num_tokens)
        if intervals:
            self.itl.observe_many(intervals)

    def on_finished(self, e2e: float, finish_reasons: list[str]) -> None:
        """A request ended; one finish reason per choice."""
        self.e2e.observe(e2e)
        for reason in finish_reasons:
            self._success.labels(finished_reason=reason, **self._label).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
