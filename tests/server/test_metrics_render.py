"""server/metrics.py: the inter-token latency histogram, fed a step at a time, renders exactly as
prometheus_client's own Histogram fed the same samples one by one."""

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from deltaserve.server.metrics import _ITL_BUCKETS, ServerMetrics


def _itl_lines(text: bytes) -> list[str]:
    return [line for line in text.decode().splitlines() if "inter_token_latency" in line]


def test_step_histogram_renders_as_prometheus_histogram():
    steps = [[0.02, 0.02, 0.02], [0.01, 0.3, 100.0], [], [0.025, 0.0]]  # bucket edges, past the last bound
    metrics = ServerMetrics("m")
    reference_registry = CollectorRegistry()
    reference = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens.", ["model_name"],
                          buckets=_ITL_BUCKETS, registry=reference_registry).labels(model_name="m")
    for intervals in steps:
        metrics.on_step(len(intervals), intervals)
        for value in intervals:
            reference.observe(value)
    ours = _itl_lines(metrics.render())
    assert ours == _itl_lines(generate_latest(reference_registry))
    assert 'vllm:inter_token_latency_seconds_count{model_name="m"} 8.0' in ours


def test_a_step_counts_its_generated_tokens_once():
    metrics = ServerMetrics("m")
    metrics.on_step(256, [0.02] * 250)
    metrics.on_step(0, [])
    text = metrics.render().decode()
    assert 'vllm:generation_tokens_total{model_name="m"} 256.0' in text


def test_preemptions_count_what_the_scheduler_added_since_the_last_publish():
    metrics = ServerMetrics("m")
    metrics.set_engine_state(4, 2, 1.0, num_preemptions=0)
    assert 'vllm:num_preemptions_total{model_name="m"} 0.0' in metrics.render().decode()  # present from the start
    for total in (1, 1, 3):  # the scheduler's count since start-up, published every step
        metrics.set_engine_state(4, 2, 1.0, num_preemptions=total)
    assert 'vllm:num_preemptions_total{model_name="m"} 3.0' in metrics.render().decode()
