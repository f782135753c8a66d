"""Where served time goes: the engine's step trace (DELTASERVE_STEP_TRACE, deltaserve/worker/step_trace.py) summed
by kind of step. Decode steps (one token a row) are grouped by their rows; steps with a prefill chunk apart.

    python -m benchmarks.step_trace_summary TRACE_DIR [--window START_NS:END_NS ...]

Under async scheduling step i is launched once step i - 2 is read back, so step i's device time is taken as the
gap between the launches of steps i + 1 and i + 2. Where the trace has the read-backs (engine_collect.tsv), a step's
time is instead the gap between its read-back's return and the previous step's: the device runs the steps in order,
so that is its time on the device (and any idle time before it), whether or not a launch blocked the host (a sync
inside a prompt chunk's launch shifts the launches, not the read-backs). Each kind then also gets the mean time the
host waited in its read-backs: a step's time less that is the host's work between the two read-backs, which the
device hid while it still ran the step (a wait well above 0) and which set the pace where the wait is near 0. Gaps
over --idle-s are the engine waiting for requests and are left out; a step the device began idle (the first of a
run, one after such a gap) is listed apart with the time from its launch to its read-back. Each kind also gets the
mean time its launches took on the host (inputs prepared, the forward enqueued): that is before the launch time, so
outside the launch-to-read-back time of a step begun idle, though a lone request's TTFT holds both. Each --window
(CLOCK_MONOTONIC nanoseconds, as `time.monotonic_ns()` prints them) is summed apart: the runs of one server start.
A served trace also has the requests' way to their first output (requests.tsv): queued for the engine -> added by
the engine thread -> first token in a step's outputs -> delivered to the handler, for the first requests one by one
and as medians of the rest; a client's TTFT beyond their sum was spent before the queue (HTTP, parsing, tokenizing)
or after the handler (the response's first chunk).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from statistics import median

from deltaserve.worker.step_trace import read_collects, read_engine, read_launch_host_ns, read_requests

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def summarize(steps: list[tuple[int, int, int]], idle_s: float,
              collects: list[tuple[int, int] | None] | None = None, launch_ns: list[int] | None = None) -> str:
    """steps: (launched ns, rows, tokens) in order; collects: each step's read-back (began ns, returned ns), None
    where it was not read back, or None for a trace without them; launch_ns: how long each launch took on the host
    (before its launch time), or None."""
    kinds: dict[str, list[tuple[float, int]]] = {}  # kind -> (seconds, rows) of each step
    kind_waits: dict[str, list[float]] = {}  # kind -> read-back waits of its timed steps
    kind_launches: dict[str, list[float]] = {}  # kind -> host launch times of its timed steps
    after_idle: list[tuple[float, int, int]] = []  # (launch to read-back s, tokens, index) of steps begun idle
    tokens_in_prefill = 0
    for i in range(len(steps)):
        if collects is not None:
            if collects[i] is not None and (i == 0 or (collects[i - 1] is not None
                                                       and (steps[i][0] - collects[i - 1][1]) / 1e9 > idle_s)):
                after_idle.append(((collects[i][1] - steps[i][0]) / 1e9, steps[i][2], i))
            if i == 0 or collects[i] is None or collects[i - 1] is None:
                continue
            gap = (collects[i][1] - collects[i - 1][1]) / 1e9
        elif i + 2 < len(steps):
            gap = (steps[i + 2][0] - steps[i + 1][0]) / 1e9
        else:
            continue
        if gap > idle_s:
            continue
        _, rows, tokens = steps[i]
        if tokens > rows:
            kind = "prefill chunk"
            tokens_in_prefill += tokens
        else:
            bucket = next((b for b in ROW_BUCKETS if rows <= b), None)
            kind = f"decode <= {bucket} rows" if bucket else f"decode > {ROW_BUCKETS[-1]} rows"
        kinds.setdefault(kind, []).append((gap, rows))
        if collects is not None:
            kind_waits.setdefault(kind, []).append((collects[i][1] - collects[i][0]) / 1e9)
        if launch_ns is not None:
            kind_launches.setdefault(kind, []).append(launch_ns[i] / 1e9)
    total = sum(gap for timed in kinds.values() for gap, _ in timed)
    lines = [f"{len(steps)} steps, {total:.2f} s busy"]
    for kind in sorted(kinds, key=lambda k: (k != "prefill chunk", len(k), k)):
        seconds = sum(gap for gap, _ in kinds[kind])
        count, rows = len(kinds[kind]), sum(rows for _, rows in kinds[kind])
        line = (f"  {kind:>22}: {count:6d} steps {seconds:8.2f} s ({100 * seconds / total:5.1f}%) "
                f"mean {1e3 * seconds / count:7.2f} ms, {rows / count:6.1f} rows")
        if kind_waits.get(kind):
            line += f", read-back waited {1e3 * sum(kind_waits[kind]) / len(kind_waits[kind]):7.2f} ms"
        if kind_launches.get(kind):
            line += f", launched in {1e3 * sum(kind_launches[kind]) / len(kind_launches[kind]):6.2f} ms"
        lines.append(line)
    if "prefill chunk" in kinds:
        lines.append(f"  prefill chunks carried {tokens_in_prefill} tokens (prompt and decode rows together)")
    if after_idle:  # not timed above (their gap holds the idle time); a first request's slowness shows here
        shown = ", ".join(f"{1e3 * seconds:.1f} ms ({tokens} tokens"
                          + (f", launched in {launch_ns[i] / 1e6:.1f} ms)" if launch_ns is not None else ")")
                          for seconds, tokens, i in after_idle[:8])
        lines.append(f"  steps begun on an idle device, launch to read-back: {shown}"
                     + (f" and {len(after_idle) - 8} more" if len(after_idle) > 8 else ""))
    return "\n".join(lines)


def summarize_requests(requests: list[tuple[int, int, int, int]], first: int = 3) -> str:
    """requests: (queued, added, first token, delivered) ns, by queue time. Each of the first `first` requests'
    three intervals in ms, then the medians of the others'."""
    def intervals(request: tuple[int, int, int, int]) -> tuple[float, float, float]:
        queued, added, token, delivered = request
        return (added - queued) / 1e6, (token - added) / 1e6, (delivered - token) / 1e6

    def shown(parts) -> str:
        return " / ".join(f"{ms:.1f}" for ms in parts)

    lines = ["  requests, queued -> added / -> first token / -> delivered (ms):"]
    lines += [f"    request {i + 1}: {shown(intervals(request))}" for i, request in enumerate(requests[:first])]
    rest = [intervals(request) for request in requests[first:]]
    if rest:
        lines.append(f"    median of the other {len(rest)}: {shown(median(column) for column in zip(*rest))}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace_dir", type=Path)
    parser.add_argument("--window", action="append", default=[], help="START_NS:END_NS")
    parser.add_argument("--idle-s", type=float, default=1.0)
    args = parser.parse_args(argv)
    windows = []
    for window in args.window:
        start, _, end = window.partition(":")
        if not (start.isdigit() and end.isdigit()):
            parser.error(f"--window takes START_NS:END_NS (two integers), got {window!r}")
        windows.append((int(start), int(end)))
    steps = read_engine(args.trace_dir)
    collects = read_collects(args.trace_dir)
    launch_ns = read_launch_host_ns(args.trace_dir)
    requests = read_requests(args.trace_dir)
    windows = windows or [(0, 2**63)]
    for start, end in windows:
        inside = [i for i, step in enumerate(steps) if start <= step[0] < end]
        print(f"window {start}:{end}" if args.window else "whole trace")
        print(summarize([steps[i] for i in inside], args.idle_s,
                        [collects.get(i) for i in inside] if collects else None, [launch_ns[i] for i in inside]))
        served = [request for request in requests if start <= request[0] < end]
        if served:
            print(summarize_requests(served))


if __name__ == "__main__":
    main()
