"""GPU timing shared by the kernel probes."""

import torch


def graph_time_us(calls) -> float:
    """Microseconds per call of the list `calls` (zero-argument functions) replayed in one CUDA graph."""
    for call in calls:  # compile and warm up outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / (5 * len(calls))


def eager_time_us(calls) -> float:
    """Microseconds per call of the list `calls` run eagerly (for work a CUDA graph cannot hold: a host sync),
    between CUDA events over five passes after a warm-up pass."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        for call in calls:
            call()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / (5 * len(calls))
