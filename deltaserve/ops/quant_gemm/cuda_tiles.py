"""Which output tile a program of the quantized tiled GEMMs (cuda_fp8, cuda_weight_only) computes."""

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
