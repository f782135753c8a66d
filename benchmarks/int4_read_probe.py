"""How fast the one-row int4 GEMV's weight reads alone run: the packed words of Qwen3.5-27B's MLP gate/up
projection (34,816 x 5,120 int4, 89 MB) read in the GEMV's tiles (rows a program, words a K step, warps, stages)
and reduced by XOR, nothing decoded, beside torch's row sum of the same words.

    python -m benchmarks.int4_read_probe [--rows 34816] [--cols 5120]

The int4 GEMVs (ours with either decode, and torch's tinygemm) all stop at 1.7-1.9 TB/s while the bf16 GEMV and
the FP8 skinny GEMM read their weights at 3.6-3.8 TB/s; the dp4a decode cut the instructions a weight ~3x without
gaining time. If the reads alone in the same tiles reach ~4 TB/s, the GEMV loop is at fault; if they stop near
1.9, the tiles (their chunks of a row, their programs) are.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from benchmarks.timing import graph_time_us

COPIES_BYTES = 400e6  # enough copies of the weight that L2 (50 MB) holds none of the one being read


@triton.jit
def _read_kernel(words, out, N, WORDS_PER_SPLIT, stride_n, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                 STAGES: tl.constexpr):
    """Grid (cdiv(N, BLOCK_N), splits): XOR of each row's words [BLOCK_N, BLOCK_W] a step over the split's words."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    ptrs = words + rows[:, None].to(tl.int64) * stride_n + tl.arange(0, BLOCK_W)[None, :]  # [BN, BW]
    acc = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.int32)
    first = tl.program_id(1) * WORDS_PER_SPLIT
    for w0 in tl.range(first, first + WORDS_PER_SPLIT, BLOCK_W, num_stages=STAGES):
        acc ^= tl.load(ptrs + w0, mask=(rows < N)[:, None], other=0)
    tl.store(out + tl.program_id(1) * N + rows, tl.xor_sum(acc, axis=1), mask=rows < N)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=34816)
    parser.add_argument("--cols", type=int, default=5120, help="int4 columns (8 a word)")
    args = parser.parse_args(argv)
    n, k_words = args.rows, args.cols // 8
    copies = [torch.randint(-2**31, 2**31 - 1, (n, k_words), dtype=torch.int32, device="cuda")
              for _ in range(max(2, int(COPIES_BYTES // (4 * n * k_words))))]
    nbytes = copies[0].nbytes
    t = graph_time_us([lambda c=c: c.sum(dim=1) for c in copies])
    print(f"torch row sum of int32 [{n}, {k_words}]: {t:7.1f} us  {nbytes / t / 1e6:.2f} TB/s", flush=True)
    results = []
    for block_n, block_w, warps in [(8, 64, 2), (8, 128, 4), (16, 16, 2), (16, 64, 4), (16, 128, 4),
                                    (32, 16, 2), (32, 32, 2), (32, 64, 4), (64, 16, 2), (64, 16, 4),
                                    (64, 32, 4), (128, 16, 8), (128, 32, 8), (256, 16, 8), (8, 256, 4),
                                    (16, 32, 4)]:
        for stages in (1, 3):
            for split in (1, 2, 5):
                if k_words % (split * block_w):
                    continue
                out = torch.empty(split, n, dtype=torch.int32, device="cuda")
                grid = (triton.cdiv(n, block_n), split)

                def run(c, grid=grid, out=out, split=split, block_n=block_n, block_w=block_w, warps=warps,
                        stages=stages):
                    _read_kernel[grid](c, out, n, k_words // split, c.stride(0), BLOCK_N=block_n,
                                       BLOCK_W=block_w, STAGES=stages, num_warps=warps)
                t = graph_time_us([lambda c=c: run(c) for c in copies])
                label = (f"rows {block_n:>3} x {4 * block_w:>4} B a step, {warps} warps, stages {stages}, "
                         f"split {split} ({grid[0] * grid[1]} programs)")
                results.append((t, label))
                print(f"{label}: {t:7.1f} us  {nbytes / t / 1e6:.2f} TB/s", flush=True)
    results.sort()
    print("fastest:", *[f"{t:.1f} us {nbytes / t / 1e6:.2f} TB/s  {label}" for t, label in results[:5]], sep="\n  ")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
