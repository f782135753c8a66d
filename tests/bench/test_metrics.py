"""Pure-function tests of the benchmark arithmetic, the SSE recorder, payloads and the report layout."""

import numpy as np
import pytest

from deltaserve.bench.client import Endpoint, RequestInput, RequestOutput, StreamError, StreamRecorder, build_payload
from deltaserve.bench.metrics import (chunk_token_counts, compute_metrics, output_token_counts, peak_concurrency,
                                      summarize_ms)
from deltaserve.bench.report import format_errors, format_table, percentile_word, summary_dict
from deltaserve.bench.traffic import arrival_offsets


def _outputs() -> list[RequestOutput]:
    """Hand-made timings (seconds) of four requests, one failed."""
    a = RequestOutput(success=True, prompt_len=10, output_tokens=4, start_time=0.0, ttft=0.1,
                      itl=[0.02, 0.03, 0.05], latency=0.2)
    b = RequestOutput(success=True, prompt_len=20, output_tokens=None, generated_text="x y z",
                      start_time=0.1, ttft=0.2, itl=[0.1], latency=0.4)
    failed = RequestOutput(success=False, prompt_len=30, error="HTTP 500 boom")
    single = RequestOutput(success=True, prompt_len=5, output_tokens=1, start_time=1.2, ttft=0.05, latency=0.05)
    return [a, b, failed, single]


def _count_words(text: str) -> int:
    return len(text.split())


def test_metrics_hand_made_timings_exact():
    outputs = _outputs()
    lens = output_token_counts(outputs, _count_words)
    assert lens == [4, 3, 0, 1]  # b has no usage: its text is counted; the failed request adds 0

    m = compute_metrics(outputs, lens, duration_s=2.0, percentiles=[50, 99], goodput_slos_ms={"ttft": 150, "tpot": 40})
    assert (m.completed, m.failed, m.total_input, m.total_output) == (3, 1, 35, 8)
    assert m.request_throughput == 1.5
    assert m.output_throughput == 4.0
    assert m.total_token_throughput == 21.5
    # goodput: a (ttft 100, tpot 33.3) and single (ttft 50, tpot counted as 0) pass, b (ttft 200) does not
    assert m.request_goodput == 1.0

    ttft = m.stats["ttft"]
    assert ttft.mean == pytest.approx(1000 * (0.1 + 0.2 + 0.05) / 3)
    assert ttft.median == pytest.approx(100.0)
    # TPOT only for requests with > 1 output token: a = (0.2 - 0.1) / 3, b = (0.4 - 0.2) / 2
    tpots_ms = [100 / 3, 100.0]
    assert m.stats["tpot"].mean == pytest.approx(np.mean(tpots_ms))
    assert m.stats["tpot"].std == pytest.approx(np.std(tpots_ms))
    # ITL pools every gap: [20, 30, 50, 100] ms; p99 by linear interpolation = 50 + 0.97 * 50
    itl = m.stats["itl"]
    assert itl.mean == pytest.approx(50.0)
    assert itl.median == pytest.approx(40.0)
    assert dict(itl.percentiles)[99] == pytest.approx(98.5)
    assert dict(itl.percentiles)[50] == pytest.approx(40.0)
    assert m.stats["e2el"].mean == pytest.approx(1000 * (0.2 + 0.4 + 0.05) / 3)
    # chunks: a at 0.1 .. 0.2 (4 chunks, 4 tokens), b at 0.3, 0.4 (2 chunks, 3 tokens) in second 0; single at
    # 1.25 in second 1. No chunk texts: each request's tokens spread evenly over its chunks.
    assert m.max_output_tokens_per_s == 7.0
    assert m.max_concurrent_requests == 2  # a [0, 0.2) overlaps b [0.1, 0.5)


def test_usage_of_zero_tokens_falls_back_to_counting_text():
    out = RequestOutput(success=True, output_tokens=0, generated_text="a b", reasoning_text="r ")
    assert output_token_counts([out], _count_words) == [3]


def test_empty_metrics_report_zero():
    stats = summarize_ms([], [99])
    assert (stats.mean, stats.median, stats.std, stats.percentiles) == (0.0, 0.0, 0.0, [(99, 0.0)])
    m = compute_metrics([RequestOutput(error="down")], [0], 1.0, [99])
    assert (m.completed, m.failed, m.max_output_tokens_per_s, m.max_concurrent_requests) == (0, 1, 0.0, 0)


def _count_texts(texts: list[str]) -> list[int]:
    return [_count_words(text) for text in texts]


def test_chunk_tokens_follow_the_chunk_texts_and_add_up_to_the_usage():
    out = RequestOutput(success=True, output_tokens=8, chunk_texts=["", "t1 t2 t3", "t4"], itl=[0.1, 0.1])
    failed = RequestOutput(error="down")
    words = chunk_token_counts([out, failed], [8, 0], _count_texts)  # the server said 8, the texts hold 4
    assert [w.tolist() for w in words] == [[0.0, 6.0, 2.0], []]  # the role-only chat chunk carries nothing
    silent = RequestOutput(success=True, chunk_texts=["", ""], itl=[0.1])
    assert chunk_token_counts([silent], [3], _count_texts)[0].tolist() == [1.5, 1.5]
    assert chunk_token_counts([out], [8], None)[0].tolist() == pytest.approx([8 / 3] * 3)


def test_peak_output_throughput_counts_tokens_not_chunks():
    """A server that joins two tokens a chunk (one falling behind its streams): 8 streams of 100 tokens in
    50 chunks each, one chunk every 0.1 s from t = 1.005 s. Counting chunks (vLLM) halves the peak, below the
    mean throughput; the tokens give 8 x 2 x 10 = 160 tok/s in every full second."""
    outputs = [RequestOutput(success=True, prompt_len=1, output_tokens=100, start_time=0.0, ttft=1.005 + i / 1000,
                             itl=[0.1] * 49, latency=5.905 + i / 1000, chunk_texts=["a b"] * 50) for i in range(8)]
    lens = output_token_counts(outputs, _count_words)
    m = compute_metrics(outputs, lens, 6.0, [99], chunk_tokens=chunk_token_counts(outputs, lens, _count_texts))
    assert m.output_throughput == pytest.approx(800 / 6.0)
    assert m.max_output_tokens_per_s == 160.0 >= m.output_throughput


def test_peak_concurrency_uses_half_open_intervals():
    def req(start, latency):
        return RequestOutput(success=True, start_time=start, latency=latency)

    assert peak_concurrency([req(0, 1), req(1, 1)]) == 1
    assert peak_concurrency([req(0, 1), req(0.5, 1), req(0.9, 0.05)]) == 3


def test_arrival_offsets():
    assert arrival_offsets(4, float("inf"), 1.0, seed=0) == [0.0] * 4
    offsets = arrival_offsets(50, 10.0, 1.0, seed=0)
    assert offsets[-1] == pytest.approx(5.0)  # rescaled: num / rate
    assert all(later > earlier for earlier, later in zip(offsets, offsets[1:]))
    assert offsets == arrival_offsets(50, 10.0, 1.0, seed=0)
    assert offsets != arrival_offsets(50, 10.0, 1.0, seed=1)
    assert arrival_offsets(3, 2.0, float("inf"), seed=0) == pytest.approx([0.5, 1.0, 1.5])

    def gap_spread(burstiness):
        gaps = np.diff(arrival_offsets(400, 10.0, burstiness, seed=0))
        return np.std(gaps) / np.mean(gaps)

    assert gap_spread(0.25) > 1.5 > gap_spread(1.0) > 0.5 > gap_spread(20.0)


def test_stream_recorder_completions_and_chat():
    out = RequestOutput(start_time=10.0)
    rec = StreamRecorder(out)
    rec.on_event({"choices": [{"text": "Hel"}]}, 10.5)
    rec.on_event({"choices": [{"text": "lo"}]}, 10.7)
    rec.on_event({"choices": [{"text": None}]}, 11.0)  # a chunk with empty text still counts (vLLM)
    rec.on_event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}, 11.5)
    rec.finish()
    assert out.success and out.generated_text == "Hello" and out.chunk_texts == ["Hel", "lo", ""]
    assert out.ttft == 0.5 and out.itl == pytest.approx([0.2, 0.3])
    assert out.latency == 1.0  # the usage event after the last token does not extend E2EL
    assert (out.prompt_len, out.output_tokens) == (7, 3)

    chat = RequestOutput(start_time=0.0)
    rec = StreamRecorder(chat)
    rec.on_event({"choices": [{"delta": {"role": "assistant", "reasoning_content": "think"}}]}, 1.0)
    rec.on_event({"choices": [{"delta": {"content": "ok"}}]}, 2.0)
    rec.finish()
    assert (chat.generated_text, chat.reasoning_text, chat.ttft, chat.itl) == ("ok", "think", 1.0, [1.0])
    assert chat.chunk_texts == ["think", "ok"]

    with pytest.raises(StreamError, match="overloaded"):
        StreamRecorder(RequestOutput()).on_event({"error": {"message": "overloaded"}}, 0.0)
    empty = RequestOutput()
    StreamRecorder(empty).finish()
    assert not empty.success and "without any token" in empty.error


def test_payload_fields():
    def endpoint(backend, ignore_eos, extra):
        return Endpoint("http://x/v1/completions", backend, "m", {}, extra, ignore_eos)

    request = RequestInput("hi", 1, 16, "r0")
    body = build_payload(endpoint("openai", True, {"temperature": 0.0, "top_k": 5}), request)
    assert body == {"model": "m", "prompt": "hi", "max_tokens": 16, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0, "top_k": 5}
    body = build_payload(endpoint("openai-chat", False, {"max_tokens": 3}), request)
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    assert "ignore_eos" not in body and "prompt" not in body
    assert body["max_completion_tokens"] == 16 and body["max_tokens"] == 3  # --extra-body wins


def test_report_layout_and_keys():
    outputs = _outputs()
    lens = output_token_counts(outputs, _count_words)
    m = compute_metrics(outputs, lens, 2.0, [99, 99.9])
    table = format_table(m, 2.0, ["ttft", "itl"], max_concurrency=4, request_rate=float("inf"), goodput=False)
    lines = table.splitlines()
    assert lines[0] == "=" * 12 + " Serving Benchmark Result " + "=" * 12
    assert lines[-1] == "=" * 50
    assert "{:<40} {:<10}".format("Successful requests:", 3) in lines
    assert "{:<40} {:<10}".format("Maximum request concurrency:", 4) in lines
    assert "{:<40} {:<10.2f}".format("P99.9 ITL (ms):", dict(m.stats["itl"].percentiles)[99.9]) in lines
    assert "Time to First Token" in table and "Inter-token Latency" in table
    assert "Time per Output Token" not in table and "Request goodput" not in table

    result = summary_dict(m, 2.0, goodput=False)
    assert result["request_goodput"] is None
    for name in ("ttft", "tpot", "itl", "e2el"):
        for key in ("mean", "median", "std", "p99", "p99.9"):
            assert f"{key}_{name}_ms" in result
    assert percentile_word(50.0) == "50" and percentile_word(99.5) == "99.5"

    errors = format_errors(outputs + [RequestOutput(error="HTTP 500 boom")])
    assert errors.splitlines() == ["2 failed requests, 1 distinct errors:", "  [2x] HTTP 500 boom"]
