"""GPU timing shared by the kernel probes, and the check that keeps a broken candidate out of their tables."""

import torch

# A candidate whose output strays from the reference's by more than this share of the reference's largest |value| is
# broken (a wrong tile, a miscompiled variant), not rounded another way: the probes report it and never choose it.
# Precision is the GPU tests' concern; this catches garbage before a table ships it.
BROKEN_SHARE = 0.02


class BrokenOutput(ValueError):
    """A candidate's output is not the reference's (see BROKEN_SHARE)."""


def _tensors(out) -> list[torch.Tensor]:
    """The tensors a call returned: it, or a tuple's (None entries skipped)."""
    return [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if t is not None]


def check_output(actual, expected) -> None:
    """Raise BrokenOutput unless each tensor of `actual` (a tensor or a tuple) has the shape of its counterpart in
    `expected` and lies within BROKEN_SHARE of that counterpart's largest |value|."""
    got, want = _tensors(actual), _tensors(expected)
    if len(got) != len(want):
        raise BrokenOutput(f"{len(got)} outputs where the reference returns {len(want)}")
    for i, (a, b) in enumerate(zip(got, want)):
        if a.shape != b.shape:
            raise BrokenOutput(f"output {i}: shape {tuple(a.shape)}, the reference's {tuple(b.shape)}")
        scale = b.double().abs().max().item() if b.numel() else 0.0
        err = (a.double() - b.double()).abs().max().item() if b.numel() else 0.0
        if not err <= BROKEN_SHARE * scale:  # also NaN
            raise BrokenOutput(f"output {i}: max error {err:.3g} against |reference| <= {scale:.3g}")


def checked_time_us(calls, expected) -> float:
    """graph_time_us(calls) after checking the first call's output against `expected` (check_output)."""
    check_output(calls[0](), expected)
    return graph_time_us(calls)


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
