"""trace_gaps on a small hand-written Chrome trace: which gaps count, and what the host was doing then."""

import gzip
import json

from benchmarks import trace_gaps


def write_trace(path, events):
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_gaps_are_split_by_size_and_name_the_host_work(tmp_path):
    path = str(tmp_path / "t.trace.json.gz")
    kernel = lambda name, ts, dur, corr: {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,  # noqa: E731
                                          "args": {"correlation": corr}}
    write_trace(path, [
        kernel("a", 0, 100, 1),
        kernel("b", 105, 100, 2),  # 5 us after a: launch latency
        kernel("c", 505, 50, 3),  # 300 us after b: the host was busy
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 500, "dur": 4, "args": {"correlation": 3}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::item", "ts": 190, "dur": 300},
        {"ph": "X", "cat": "cpu_op", "name": "elsewhere", "ts": 600, "dur": 10},
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 50},  # not a duration event: ignored
    ])
    text = trace_gaps.report(path, min_gap_us=20)
    first, gap = text.splitlines()[:2]
    assert "GPU span 0.56 ms, 3 GPU events" in first
    assert "0.01 ms in gaps under 20 us" in first and "0.30 ms in 1 larger gaps" in first
    assert gap.split()[0] == "300" and "before c" in gap
    assert "launched +295 us after the gap began" in gap and "aten::item" in gap and "elsewhere" not in gap


def test_a_trace_without_gpu_events_says_so(tmp_path):
    path = str(tmp_path / "cpu.json")
    with open(path, "w") as f:
        json.dump({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}]}, f)
    assert trace_gaps.report(path).endswith("no GPU events")
