"""Which part of the output a program of the quantized GEMMs computes.

- `grouped_tile`: the output tile of a program of the tiled GEMMs (cuda_fp8, cuda_weight_only).
- `tail_program`: the plain rows of a one-row product's launch (the one-row dp4a GEMVs of cuda_gemv, FP8's skinny
  kernel): its first TAIL_ROWS programs multiply a 16-bit block that reads the same input (GDN's bf16 [b|a] beside
  its quantized [q|k|v|z]), one row each, so that block takes no launch of its own. `tail_arguments` makes their
  launch arguments.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Rows ms [BLOCK_M] and columns ns [BLOCK_N] of out [M, N] for this program of a 1-D grid of
    cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N): programs walk GROUP_M row tiles per column tile, so that neighbours
    read a column tile of the weight from L2."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    return ms, ns


@triton.jit
def _plain_row(x, w, out, row, stride_wn, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """out [row] = x [K] . w [row, :K] (16-bit), a float32 sum rounded to out's dtype. The K blocks are unrolled,
    so that their loads are all in flight at once."""
    acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    w_row = w + row.to(tl.int64) * stride_wn
    for k0 in tl.static_range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        acc += tl.load(w_row + ks, mask=k_ok, other=0.0).to(tl.float32) * tl.load(x + ks, mask=k_ok,
                                                                                   other=0.0).to(tl.float32)
    tl.store(out + row, tl.sum(acc, axis=0).to(out.dtype.element_ty))


@triton.jit
def tail_program(tail_x, tail_w, tail_out, stride_tn, TAIL_ROWS: tl.constexpr, TAIL_K: tl.constexpr):
    """Whether this program is one of a launch's first TAIL_ROWS (grid axis 0), which multiply a plain block
    instead of the quantized weight: row p of tail_x [K] @ tail_w^T into tail_out (split 0 only; _plain_row). The
    quantized product's programs then take tile tl.program_id(0) - TAIL_ROWS."""
    is_tail = tl.program_id(0) < TAIL_ROWS
    if TAIL_ROWS:
        if is_tail & (tl.program_id(1) == 0):
            _plain_row(tail_x, tail_w, tail_out, tl.program_id(0), stride_tn, TAIL_K, 1024)
    return is_tail


def tail_arguments(x: torch.Tensor, tail: torch.Tensor | None) -> tuple[tuple, torch.Tensor | None, dict]:
    """(the kernel's tail arguments tail_x, tail_w, tail_out, stride_tn; tail_out [1, NT]; its TAIL_ROWS / TAIL_K)
    for x [1, K] @ tail [NT, K]^T in a product's launch; without a tail, x stands in for the pointers the kernel
    then never reads."""
    if tail is None:
        return (x, x, x, 0), None, {}
    nt, k = tail.shape
    if x.shape[0] != 1 or k != x.shape[1] or tail.dtype != x.dtype or tail.stride(1) != 1:
        raise ValueError(f"the tail block must be [rows, {x.shape[1]}] {x.dtype} with unit column stride beside one "
                         f"row, got {tuple(tail.shape)} {tail.dtype} strides {tuple(tail.stride())} beside "
                         f"{tuple(x.shape)}")
    tail_out = torch.empty(1, nt, dtype=x.dtype, device=x.device)
    return (x, tail, tail_out, tail.stride(0)), tail_out, dict(TAIL_ROWS=nt, TAIL_K=k)
