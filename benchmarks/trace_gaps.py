"""Where the GPU waits for the host: idle gaps in a profiler timeline and what the host was doing then.

    python -m benchmarks.trace_gaps TRACE.json[.gz] [--min-gap-us 20] [--top 15]

Reads a Chrome trace written by torch.profiler (`offline --profile --profile-dir DIR` writes them gzipped),
orders the GPU's kernels, copies and memsets in time, and reports the idle time between them: in total, in
gaps under the threshold (launch latency between back-to-back kernels) and in the larger gaps one by one. For
each large gap it names the kernel after it, when the host launched that kernel (a launch later than the
gap's start means the GPU waited for the host) and the host operations running during the gap.
"""

from __future__ import annotations

import argparse
import gzip
import json
from dataclasses import dataclass

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATEGORIES = {"cpu_op", "python_function", "user_annotation"}


@dataclass
class Event:
    name: str
    start: float  # microseconds
    end: float
    correlation: int | None = None


def load_events(path: str) -> tuple[list[Event], list[Event], dict[int, Event]]:
    """(GPU events by start, host operations, runtime launch calls by correlation id) of a Chrome trace."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    gpu, host, launches = [], [], {}
    for raw in trace.get("traceEvents", []):
        if raw.get("ph") != "X":
            continue
        event = Event(raw["name"], float(raw["ts"]), float(raw["ts"]) + float(raw.get("dur", 0)),
                      raw.get("args", {}).get("correlation"))
        category = raw.get("cat", "")
        if category in GPU_CATEGORIES:
            gpu.append(event)
        elif category == "cuda_runtime" or category == "cuda_driver":
            if event.correlation is not None:
                launches[event.correlation] = event
        elif category in HOST_CATEGORIES:
            host.append(event)
    gpu.sort(key=lambda e: e.start)
    return gpu, host, launches


def report(path: str, min_gap_us: float = 20.0, top: int = 15) -> str:
    """The trace's GPU span and idle time, and its `top` largest gaps of at least min_gap_us, as text."""
    gpu, host, launches = load_events(path)
    if not gpu:
        return f"{path}: no GPU events"
    lines = []
    span = max(e.end for e in gpu) - gpu[0].start
    busy_until = gpu[0].end
    small_idle, gaps = 0.0, []
    for event in gpu[1:]:
        gap = event.start - busy_until
        if gap > 0:
            if gap < min_gap_us:
                small_idle += gap
            else:
                gaps.append((gap, busy_until, event))
        busy_until = max(busy_until, event.end)
    large_idle = sum(g for g, _, _ in gaps)
    idle = small_idle + large_idle
    lines.append(f"{path}: GPU span {span / 1e3:.2f} ms, {len(gpu)} GPU events; idle {idle / 1e3:.2f} ms: "
                 f"{small_idle / 1e3:.2f} ms in gaps under {min_gap_us:g} us (launch latency), "
                 f"{large_idle / 1e3:.2f} ms in {len(gaps)} larger gaps")
    for gap, start, after in sorted(gaps, key=lambda g: -g[0])[:top]:
        launch = launches.get(after.correlation)
        launched = (f"launched {launch.start - start:+.0f} us after the gap began" if launch is not None
                    else "launch not found")
        during = [h for h in host if h.start < after.start and h.end > start]
        # the host operations that overlap the gap, the longest overlap first
        during.sort(key=lambda h: -(min(h.end, after.start) - max(h.start, start)))
        names = ", ".join(dict.fromkeys(h.name[:60] for h in during[:6]))
        lines.append(f"  {gap:8.0f} us at +{(start - gpu[0].start) / 1e3:8.2f} ms before {after.name[:50]} "
                     f"({launched}); host: {names or '-'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.trace_gaps", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", help="Chrome trace files (.json or .json.gz)")
    parser.add_argument("--min-gap-us", type=float, default=20.0, help="gaps listed one by one from this size")
    parser.add_argument("--top", type=int, default=15, help="how many of the largest gaps to list")
    args = parser.parse_args(argv)
    for path in args.traces:
        print(report(path, args.min_gap_us, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
