"""Whether asking L2 for a projection's first weight bytes before its prologue op pays in decode.

    python -m benchmarks.prefetch_probe [CONFIG_DIR] [--rows 64] [--megabytes 8,16,32]

A decode step at 64 rows leaves the H200's memory idle while its small kernels run (the RMS norm before each
projection ~3 us, silu-mul, the gated norm, the gaps between kernels, each GEMM's first microseconds): ~1.4 ms of
a ~21.8 ms step. Here every projection of a decode step (the engine's ops, after their prologue op, inside CUDA
graphs, each call on another copy of the weight so that L2 holds none of it) is timed as it runs, and with a bulk
L2 prefetch (`cp.async.bulk.prefetch.L2`) of part of its weight issued before the prologue: by a kernel on the
same stream, or on a second stream forked in the graph so that it runs beside the prologue. Two patterns: the
first bytes of every row of the first wave of column blocks ("head"), or the weight's first megabytes ("front").
"""

from __future__ import annotations

import argparse
import functools

import torch
import triton
import triton.language as tl

from benchmarks.gemv_probe import decode_projections, inputs
from benchmarks.timing import graph_time_us
from deltaserve.config import ModelConfig
from deltaserve.model_configs import CONFIGS_DIR
from deltaserve.ops import linear
from deltaserve.ops.linear import reference


@triton.jit
def _l2_prefetch_kernel(base, num_chunks, chunk_stride, chunk_bytes, BLOCK: tl.constexpr):
    """Ask L2 for chunk_bytes at base + i * chunk_stride (bytes) for each i < num_chunks; returns at once."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] chunk indices
    ok = (i < num_chunks).to(tl.int32)
    addr = (base.to(tl.pointer_type(tl.int8)) + i.to(tl.int64) * chunk_stride).to(tl.int64)
    size = tl.full([BLOCK], 0, tl.int32) + chunk_bytes
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; } mov.u32 $0, 0;",
        "=r,l,r,r", [addr, size, ok], dtype=tl.int32, is_pure=False, pack=1)


def prefetch(weight: torch.Tensor, megabytes: float, pattern: str, first_wave_rows: int) -> None:
    """Issue L2 prefetches of ~megabytes of weight [N, K]: "head" = the first bytes of rows [0, first_wave_rows),
    "front" = the first megabytes, in 64 KB chunks."""
    n, k = weight.shape
    row_bytes = k * weight.element_size()
    total = int(megabytes * 1e6)
    if pattern == "head":
        rows = min(n, first_wave_rows)
        chunk = max(16, min(row_bytes, total // rows) // 16 * 16)
        num, stride = rows, row_bytes
    else:
        chunk = 1 << 16
        num, stride = min(total, n * row_bytes) // chunk, chunk
    block = 256
    _l2_prefetch_kernel[(triton.cdiv(num, block),)](weight, num, stride, chunk, BLOCK=block, num_warps=4)


def _prefetched(call, fn, weight, megabytes, pattern, first_wave_rows, side_stream):
    """call(fn, weight) after a prefetch of weight, on this stream or on side_stream forked beside the prologue."""
    if side_stream is None:
        prefetch(weight, megabytes, pattern, first_wave_rows)
        return call(functools.partial(fn, matmul=linear.matmul), weight)
    main = torch.cuda.current_stream()
    side_stream.wait_stream(main)
    with torch.cuda.stream(side_stream):
        prefetch(weight, megabytes, pattern, first_wave_rows)

    def matmul_after_join(x, w):
        main.wait_stream(side_stream)
        return linear.matmul(x, w)
    return call(functools.partial(fn, matmul=matmul_after_join), weight)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.prefetch_probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=str(CONFIGS_DIR / "qwen3.5-27b"),
                        help="config.json directory (default: the shipped Qwen3.5-27B config)")
    parser.add_argument("--rows", default="64", help="comma-separated decode batch sizes")
    parser.add_argument("--megabytes", default="4,8,16,32", help="comma-separated prefetch sizes")
    args = parser.parse_args(argv)
    cfg = ModelConfig.from_pretrained(args.model)
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    side = torch.cuda.Stream()
    unfused = {"rms_norm": reference.rms_norm_linear, "silu_mul": reference.silu_mul_linear,
               "gated_norm": reference.gated_norm_linear, "none": lambda x, w, matmul: matmul(x, w)}
    with torch.no_grad():
        for rows in (int(r) for r in args.rows.split(",")):
            total_base = total_best = 0.0
            for prologue, n, k in decode_projections(cfg):
                weights, call = inputs(prologue, n, k, cfg.gdn_v_dim, device, rows)
                fn = functools.partial(unfused[prologue], matmul=linear.matmul)
                megabytes = 2 * n * k / 1e6
                base = graph_time_us([functools.partial(call, fn, w) for w in weights])
                results = []
                for mb in (float(m) for m in args.megabytes.split(",")):
                    for pattern in ("head", "front"):
                        for stream_name, stream in (("same", None), ("side", side)):
                            t = graph_time_us([functools.partial(_prefetched, call, unfused[prologue], w, mb, pattern,
                                                                 sms * 64, stream) for w in weights])
                            results.append((t, f"{mb:g} MB {pattern} {stream_name}"))
                best_t, best = min(results)
                total_base, total_best = total_base + base, total_best + min(base, best_t)
                top = ", ".join(f"{label} {t:.1f}" for t, label in sorted(results)[:4])
                print(f"rows {rows} {prologue:>10} N={n:>6} K={k:>6} ({megabytes:.0f} MB): as run {base:.1f} us "
                      f"({megabytes / base:.2f} TB/s); best prefetch {best_t:.1f} us ({best}); top: {top}",
                      flush=True)
            print(f"rows {rows}: one of each projection {total_base:.1f} us as run, {total_best:.1f} us with the best "
                  "prefetch each", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
