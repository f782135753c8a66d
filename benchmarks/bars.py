"""The open issues' bars, served: a `deltaserve serve` start per model (tests/gpu/run.sh's serve mode, dummy weights)
and its workloads through `deltaserve bench serve`, within one device call's time, then each figure beside its bar.

    python -m benchmarks.bars OUTDIR [--only w7,w8-fp8] [--budget-s 540]
    (tests/gpu/run.sh OUTDIR bars: ONLY and BUDGET pass them)

SERVERS lists the starts in the order of what the bars need most; a start is skipped where the card cannot hold the
model with its workloads' KV pool (bf16 35B-A3B on an 80 GB H100) or where its estimated time (an H200's, start-up
included) no longer fits the budget, and each is stopped at the time left. OUTDIR/NAME holds each start's
server.log and serve_bench.log; OUTDIR/bars.txt the figures, the bars and what was skipped, for a second call's
--only.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Bar:
    label: str
    metric: str  # the bench's result line, e.g. "Median TPOT (ms)"
    bar: float | None  # None: a figure the issue asks to report
    higher_is_better: bool = False

    def verdict(self, value: float | None) -> str:
        if value is None:
            return "no figure"
        if self.bar is None:
            return "reported"
        met = value >= self.bar if self.higher_is_better else value <= self.bar
        return f"bar {'>=' if self.higher_is_better else '<='} {self.bar:,g}: {'met' if met else 'not met'}"


@dataclass(frozen=True)
class Server:
    name: str  # OUTDIR/name
    model: str  # a config of deltaserve/model_configs
    runs: tuple[str, ...]  # run.sh's RUNS entries, IN:OUT_LEN:PROMPTS:CONCURRENCY[:RANGE_RATIO]
    bars: tuple[Bar | None, ...]  # one per run
    card_gib: float  # the least device memory that holds the model and its runs' KV pool
    seconds: int  # start-up (a fresh machine's: wheels installed, kernels compiled) and runs, a little over an H200's
    max_model_len: int = 4096
    serve_args: str = ""


def _tpot(label: str, bar: float | None) -> Bar:
    return Bar(label, "Median TPOT (ms)", bar)


SERVERS = (
    Server("w7", "qwen3.5-35b-a3b", ("8192:1024:64:16:0.8", "1024:512:5:1"),
           (Bar("W7 35B-A3B bf16 c=16 total tok/s", "Total Token throughput (tok/s)", 10_000, True),
            _tpot("W8 35B-A3B bf16 TPOT ms", 3.0)), card_gib=100, seconds=200, max_model_len=20_000),
    Server("w8-fp8", "qwen3.5-35b-a3b-fp8", ("1024:512:5:1",), (_tpot("W8 35B-A3B-FP8 TPOT ms", 2.5),),
           card_gib=40, seconds=110),
    Server("27b-fp8", "qwen3.5-27b-fp8", ("1024:512:5:1", "8192:1:5:1"),
           (_tpot("W1 27B FP8 TPOT ms", 7.0), Bar("W3 27B FP8 8K TTFT ms", "Median TTFT (ms)", 450)),
           card_gib=40, seconds=140, max_model_len=10_000),
    Server("27b-awq", "qwen3.5-27b-awq", ("1024:512:5:1",), (_tpot("W1 27B AWQ TPOT ms", 4.3),), card_gib=24,
           seconds=120),
    Server("27b-nvfp4", "qwen3.5-27b-nvfp4", ("1024:512:5:1",), (_tpot("W1 27B NVFP4 TPOT ms", 4.6),), card_gib=24,
           seconds=120),
    Server("27b-fp8-w6", "qwen3.5-27b-fp8", ("1024:512:512:64",),
           (Bar("W6 27B FP8 c=64 output tok/s", "Output token throughput (tok/s)", 3_000, True),), card_gib=40,
           seconds=220),
    # issue 32's other MoE shapes, reported: Qwen3-Next-80B-A3B quantized at load, 122B-A10B-FP8 with 16 state slots
    # (its KV pool 196K tokens on an H200; the plan's default share would give 26 slots and 133K: `deltaserve plan`)
    Server("next-80b-fp8", "qwen3-next-80b-a3b", ("1024:512:5:1",), (_tpot("W8 Qwen3-Next-80B-A3B FP8 TPOT ms", None),),
           card_gib=100, seconds=200, serve_args="--quantization fp8"),
    Server("122b-fp8", "qwen3.5-122b-a10b-fp8", ("1024:512:5:1", "8192:1024:64:16:0.8"),
           (_tpot("W8 122B-A10B-FP8 TPOT ms", None),
            Bar("W7 122B-A10B-FP8 c=16 total tok/s", "Total Token throughput (tok/s)", None, True)),
           card_gib=130, seconds=300, max_model_len=20_000, serve_args="--max-num-seqs 16"),
)
NAMES = tuple(server.name for server in SERVERS)


def results(log: str) -> list[dict[str, float]]:
    """Each `deltaserve bench serve` result block of a serve_bench.log, in order: {result line label: value}."""
    blocks = re.split(r"=+ Serving Benchmark Result =+", log)[1:]
    return [{m.group(1).strip(): float(m.group(2))
             for m in re.finditer(r"^([^:\n]+):\s+([-0-9.]+)\s*$", block, re.MULTILINE)} for block in blocks]


def figures(server: Server, log: str) -> list[tuple[Bar, float | None]]:
    """(bar, the run's figure or None where the run left none) of each of the server's runs that has a bar."""
    blocks = results(log)
    return [(bar, blocks[i].get(bar.metric) if i < len(blocks) else None)
            for i, bar in enumerate(server.bars) if bar is not None]


def card_gib() -> float:
    """The device's memory as nvidia-smi reports it (no CUDA context in this process: the servers need the card)."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0]) / 1024


def run_server(server: Server, outdir: Path, timeout_s: float) -> int:
    """One start of tests/gpu/run.sh's serve mode with the server's runs; its exit status, 124 where it was
    stopped at timeout_s (its whole process group: the server it started too, which would hold the card)."""
    env = dict(os.environ, MODEL=server.model, RUNS=" ".join(server.runs), MAX_MODEL_LEN=str(server.max_model_len),
               SERVE_ARGS=server.serve_args, BUNDLE="0", BASE_TAR="")
    with open(outdir / f"{server.name}.out", "w") as out:
        process = subprocess.Popen(["bash", "tests/gpu/run.sh", str(outdir / server.name), "serve"], cwd=REPO,
                                   env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return 124


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bars", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("outdir")
    parser.add_argument("--only", default="", help=f"comma-separated starts of {', '.join(NAMES)} (default: all)")
    parser.add_argument("--budget-s", type=float, default=540.0, help="start nothing that would end after this")
    args = parser.parse_args(argv)
    only = [name for name in args.only.split(",") if name]
    unknown = [name for name in only if name not in NAMES]
    if unknown:
        parser.error(f"--only: unknown start(s) {', '.join(unknown)}; they are {', '.join(NAMES)}")
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be positive, got {args.budget_s}")
    outdir = Path(args.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    deadline, gib = time.monotonic() + args.budget_s, card_gib()
    lines, status = [], 0
    for server in SERVERS:
        if only and server.name not in only:
            continue
        left = deadline - time.monotonic()
        if gib < server.card_gib:
            lines.append(f"skipped {server.name}: needs a card of {server.card_gib:.0f} GiB, this one has {gib:.0f}")
            continue
        if left < server.seconds:
            lines.append(f"skipped {server.name}: ~{server.seconds} s, {left:.0f} s left")
            continue
        code = run_server(server, outdir, left)
        status = status or code
        log_path = outdir / server.name / "serve_bench.log"
        log = log_path.read_text() if log_path.exists() else ""
        for bar, value in figures(server, log):
            shown = "-" if value is None else f"{value:,.2f}"
            lines.append(f"{bar.label:<40} {shown:>10}   {bar.verdict(value)}" + (f" (exit {code})" if code else ""))
    text = "\n".join(lines) + "\n"
    (outdir / "bars.txt").write_text(text)
    print(text, end="")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
