"""Whether a prefill's matmuls and its memory-bound kernels can overlap on this GPU: a long bf16 GEMM and a
bandwidth-bound copy, each alone, then both at once on two CUDA streams.

    python -m benchmarks.overlap_probe [--seconds 5] [--m 8192] [--n 34816] [--k 5120] [--copy-mib 1024]

A prompt step of 8,192 tokens spends ~560 ms in matmuls (HBM nearly idle) and ~110 ms in kernels bound by
memory or latency (tensor cores idle; docs/performance.md, eleventh session). Running two halves of a step on
two streams would overlap the two kinds, unless the board's power cap (700 W on the H200, which already lowers
the SM clock under long matmuls) takes back what the overlap gives. This measures it: TFLOP/s of the GEMM and
TB/s of the copy (bytes read + written) in each setting, with the SM clock and board power that nvidia-smi
samples meanwhile (when it is there). The default GEMM is 27B's MLP gate/up projection at 8,192 rows.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import time
from collections.abc import Callable

import torch


def mean_samples(text: str) -> dict[str, float]:
    """Means of nvidia-smi's `clocks.sm,power.draw` CSV lines (no header, no units); {} without samples."""
    rows = []
    for line in text.splitlines():
        try:
            rows.append([float(field) for field in line.split(",")])
        except ValueError:
            continue  # a partial or odd line
    rows = [row for row in rows if len(row) == 2]
    if not rows:
        return {}
    return {"sm_mhz": sum(r[0] for r in rows) / len(rows), "power_w": sum(r[1] for r in rows) / len(rows)}


class Sampler:
    """nvidia-smi sampling this process's GPU (by UUID) for its SM clock and board power every 100 ms while the
    block runs; `means` stays empty without nvidia-smi or samples."""

    def __init__(self, device_uuid: str):
        self.device_uuid = device_uuid
        self.means: dict[str, float] = {}

    def __enter__(self):
        self.process = None
        if shutil.which("nvidia-smi"):
            self.process = subprocess.Popen(
                ["nvidia-smi", "-i", self.device_uuid, "--query-gpu=clocks.sm,power.draw",
                 "--format=csv,noheader,nounits", "-lms", "100"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc):
        if self.process is not None:
            self.process.send_signal(signal.SIGINT)  # as Ctrl-C: nvidia-smi flushes what it sampled
            try:
                output = self.process.communicate(timeout=5)[0]
            except subprocess.TimeoutExpired:
                self.process.kill()
                output = self.process.communicate()[0]
            self.means = mean_samples(output)


def timed_streams(work: dict[str, tuple[Callable[[], object], int]]) -> dict[str, float]:
    """Queue each entry's function `count` times on its own stream, interleaved in proportion (the launch
    queue holds ~1,000 kernels: one stream's whole run queued first would starve the other); seconds from the
    common start to each stream's end."""
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    streams = {name: torch.cuda.Stream() for name in work}
    for stream in streams.values():
        stream.wait_event(start)
    launched, ends = dict.fromkeys(work, 0), {}
    for _ in range(sum(count for _, count in work.values())):
        name = min((n for n in work if launched[n] < work[n][1]), key=lambda n: launched[n] / work[n][1])
        fn, count = work[name]
        with torch.cuda.stream(streams[name]):
            fn()
            launched[name] += 1
            if launched[name] == count:
                ends[name] = torch.cuda.Event(enable_timing=True)
                ends[name].record()
    torch.cuda.synchronize()
    return {name: start.elapsed_time(end) / 1e3 for name, end in ends.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overlap_probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="how long each setting runs (about)")
    parser.add_argument("--m", type=int, default=8192)
    parser.add_argument("--n", type=int, default=34816)
    parser.add_argument("--k", type=int, default=5120)
    parser.add_argument("--copy-mib", type=int, default=1024, help="the copy's size (MiB; bf16)")
    args = parser.parse_args(argv)
    for name in ("m", "n", "k", "copy_mib"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.seconds <= 0:
        parser.error(f"--seconds must be positive, got {args.seconds}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")

    a = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(args.k, args.n, device="cuda", dtype=torch.bfloat16)
    product = torch.empty(args.m, args.n, device="cuda", dtype=torch.bfloat16)
    source = torch.randn(args.copy_mib << 19, device="cuda", dtype=torch.bfloat16)
    target = torch.empty_like(source)
    kinds = {"gemm": (lambda: torch.mm(a, b, out=product), 2 * args.m * args.n * args.k / 1e12, "TFLOP/s"),
             "copy": (lambda: target.copy_(source), 2 * source.numel() * 2 / 1e12, "TB/s")}
    counts = {}
    for name, (fn, _, _) in kinds.items():  # calibrate on ~0.5 s after a warm-up: how many calls fill --seconds
        timed_streams({name: (fn, 1)})
        calls = max(1, round(0.5 / timed_streams({name: (fn, 1)})[name]))
        counts[name] = max(1, round(args.seconds * calls / timed_streams({name: (fn, calls)})[name]))
    uuid = getattr(torch.cuda.get_device_properties(0), "uuid", None)  # nvidia-smi's numbering may differ
    device_uuid = f"GPU-{uuid}" if uuid is not None else str(torch.cuda.current_device())
    ends = {}
    for title, names in [("gemm alone", ["gemm"]), ("copy alone", ["copy"]), ("both at once", ["gemm", "copy"])]:
        time.sleep(1)  # let the clock recover between settings
        with Sampler(device_uuid) as sampler:
            seconds = timed_streams({name: (kinds[name][0], counts[name]) for name in names})
        ends[title] = max(seconds.values())
        rates = ", ".join(f"{name} {counts[name] * kinds[name][1] / seconds[name]:.2f} {kinds[name][2]} "
                          f"over {seconds[name]:.2f} s" for name in names)
        clock = (f"; SM {sampler.means['sm_mhz']:.0f} MHz, {sampler.means['power_w']:.0f} W"
                 if sampler.means else "; no nvidia-smi samples")
        print(f"{title}: {rates}{clock}", flush=True)
    alone = ends["gemm alone"] + ends["copy alone"]
    print(f"the same work: {ends['both at once']:.2f} s at once against {alone:.2f} s one after the other "
          f"({overlap_saving(alone, ends['both at once']):.0%} saved)", flush=True)
    return 0


def overlap_saving(alone: float, together: float) -> float:
    """The share of the one-after-the-other time that running at once saves (0: none, 0.5: perfect for two
    equal parts)."""
    return (alone - together) / alone


if __name__ == "__main__":
    raise SystemExit(main())
