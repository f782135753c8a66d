"""Triton GEMM for decode batches (1 to SKINNY_MAX_ROWS rows): y [M, N] = x [M, K] @ W [N, K]^T.

A decode step is bound by reading the weights once (27B: ~50 GB), but cuBLAS picks tiles for such skinny products
that leave the GPU short of loads in flight (docs/performance.md, 'Decode GEMMs'). Here the weight is the wide side
of a tensor-core product (W tile [BLOCK_N, BLOCK_K] times x^T tile [BLOCK_K, BLOCK_M], the rows padded to 16,
tl.dot's least), its loads pipelined over num_stages, either pointer loads or (a sixth config entry of 1) the Hopper
tensor-memory accelerator's bulk tile copies (TMA); K may be split among SPLIT_K programs whose float32 partial sums
the tile's last program adds in a fixed order (ops/split_k.py), so the result does not depend on timing. The table
`skinny_configs.json` (measured by `python -m benchmarks.batch_probe`) names the tile per (N, K, row bucket) and
holds only the shapes where the kernel beat cuBLAS (and, at one row, the fused GEMV of cuda.py) by 2%. A fused
RMS-norm / silu-mul prologue (each program re-reads and normalises the activation) and Stream-K tiling lost
(docs/performance.md, 'Decode GEMMs').
"""

import functools
import json
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from deltaserve.ops import pdl
from deltaserve.ops.pdl import wait_for_previous_kernel
from deltaserve.ops.split_k import store_split, tile_counters


# Rows (sequences) up to which the kernel may serve; larger batches run cuBLAS.
SKINNY_MAX_ROWS = 64
# Row buckets of the table: one row (against the GEMV), then up to 16, 32 and 64 rows (BLOCK_M).
ROW_BUCKETS = (1, 16, 32, 64)
CONFIGS_FILE = Path(__file__).with_name("skinny_configs.json")


def row_bucket(rows: int) -> int:
    """The table's bucket of a batch of `rows` (1 <= rows <= SKINNY_MAX_ROWS)."""
    return next(bucket for bucket in ROW_BUCKETS if rows <= bucket)


@functools.cache
def _tuned_configs() -> dict:
    if not CONFIGS_FILE.exists():
        return {}
    table = json.loads(CONFIGS_FILE.read_text())
    for key, config in table.items():
        if key.count(":") != 2 or not (config is None or (isinstance(config, list) and len(config) in (5, 6))):
            raise ValueError(f"{CONFIGS_FILE}: entry {key!r}: {config!r} is not a [BLOCK_N, BLOCK_K, SPLIT_K, warps, "
                             "stages(, TMA)] list or null under an \"N:K:rows\" key")
    return table


def config_for(n: int, k: int, rows: int) -> tuple[int, ...] | None:
    """The tuned tile of W [n, k] at `rows` rows, or None where the kernel does not serve."""
    if not 1 <= rows <= SKINNY_MAX_ROWS:
        return None
    config = _tuned_configs().get(f"{n}:{k}:{row_bucket(rows)}")
    return tuple(config) if config is not None else None


@triton.jit
def _store_block(acc, out, partial, counters, ms, ns, ok, M, N, stride_out_m, SPLIT_K: tl.constexpr):
    """Store the [BN, BM] float32 sum of output columns ns [BN] and rows ms [BM] (where ok) into out (its dtype):
    directly when K is not split, else through partial [SPLIT_K, M, N] (split_k.store_split)."""
    out_block = out + ms[None, :] * stride_out_m + ns[:, None]  # [BN, BM]
    if SPLIT_K == 1:
        tl.store(out_block, acc.to(out.dtype.element_ty), mask=ok)
    else:
        partial_block = partial + ms[None, :].to(tl.int64) * N + ns[:, None]  # [BN, BM] of split 0
        store_split(acc, out_block, partial_block, ok, M * N, counters, tl.program_id(0))


# Specialised by Triton on the row count (a variant for M == 1, for M % 16 == 0 and for the rest: two per tile
# and row bucket among the decode graphs' sizes): one variant each (fewer compiles at startup) was slower
# (`batch_probe --compare-specialization`: docs/performance.md, 'Decode GEMMs').
@triton.jit
def _skinny_kernel(
    x, weight, out, partial, counters, M, N, K, k_iters, stride_x_m, stride_w_n, stride_out_m,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = False,
):
    """Grid (cdiv(N, BLOCK_N), SPLIT_K): program (n, s) computes out[:, n block] over the s-th range of k_iters
    K blocks (into partial [SPLIT_K, M, N] float32 when SPLIT_K > 1)."""
    wait_for_previous_kernel(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns = weight rows
    ms = tl.arange(0, BLOCK_M)  # [BM] rows of x
    n_ok = ns < N
    m_ok = ms < M
    w_rows = weight + ns[:, None].to(tl.int64) * stride_w_n  # [BN, 1]
    x_cols = x + ms[None, :] * stride_x_m  # [1, BM]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for i in range(0, k_iters):
        ks = (pid_k * k_iters + i) * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK]
        k_ok = ks < K
        if EVEN_N and EVEN_K:
            w = tl.load(w_rows + ks[None, :])  # [BN, BK]
        else:
            w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        xt = tl.load(x_cols + ks[:, None], mask=k_ok[:, None] & m_ok[None, :], other=0.0)  # [BK, BM]
        acc = tl.dot(w, xt, acc, input_precision=PRECISION)  # [BN, BM]
    _store_block(acc, out, partial, counters, ms, ns, m_ok[None, :] & n_ok[:, None], M, N, stride_out_m, SPLIT_K)


@triton.jit
def _skinny_tma_kernel(
    x_desc, w_desc, out, partial, counters, M, N, k_iters, stride_out_m,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr = False,
):
    """_skinny_kernel with its tiles copied by TMA (x_desc over x [M, K] in [BLOCK_M, BLOCK_K] boxes, w_desc over
    W [N, K] in [BLOCK_N, BLOCK_K] boxes; out-of-bounds rows and columns arrive as zeros, so nothing is masked
    but the store)."""
    wait_for_previous_kernel(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for i in range(0, k_iters):
        k0 = (pid_k * k_iters + i) * BLOCK_K
        w = w_desc.load([pid_n * BLOCK_N, k0])  # [BN, BK]
        x = x_desc.load([0, k0])  # [BM, BK]
        acc = tl.dot(w, x.T, acc, input_precision=PRECISION)  # [BN, BM]
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns = weight rows
    ms = tl.arange(0, BLOCK_M)  # [BM]
    _store_block(acc, out, partial, counters, ms, ns, (ms[None, :] < M) & (ns[:, None] < N), M, N, stride_out_m,
                 SPLIT_K)


def tma_ready(t: torch.Tensor) -> bool:
    """Whether TMA can copy tiles of the 2-D tensor t: unit last stride, 16-byte aligned base and row stride."""
    return t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


def linear(x: torch.Tensor, weight: torch.Tensor, config: tuple[int, ...]) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] in x.dtype, 1 <= M <= SKINNY_MAX_ROWS, unit last strides.
    config: (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages[, TMA]); TMA 1 copies the tiles by TMA where both
    tensors' bases and row strides are 16-byte aligned (else pointer loads)."""
    N, K = weight.shape
    M = x.shape[0]
    if x.dim() != 2 or x.shape[1] != K or not 1 <= M <= SKINNY_MAX_ROWS:
        raise ValueError(f"x must be [1..{SKINNY_MAX_ROWS}, {K}], got {tuple(x.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x dtype {x.dtype} differs from the weight's {weight.dtype}")
    if weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"x and weight need unit last strides, got {tuple(x.stride())} and {tuple(weight.stride())}")
    block_n, block_k, split_k, num_warps, num_stages = config[:5]
    use_tma = len(config) > 5 and config[5] == 1 and tma_ready(x) and tma_ready(weight)
    block_m = max(16, triton.next_power_of_2(M))  # tl.dot's least side
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    partial = torch.empty(split_k, M, N, dtype=torch.float32, device=x.device) if split_k > 1 else out
    grid = (triton.cdiv(N, block_n), split_k)
    tiles = tile_counters(x.device, grid[0])
    k_iters = triton.cdiv(K, split_k * block_k)
    launch = pdl.launch_args(x.device)
    if use_tma:
        x_desc = TensorDescriptor.from_tensor(x, [block_m, block_k])
        w_desc = TensorDescriptor.from_tensor(weight, [block_n, block_k])
        _skinny_tma_kernel[grid](
            x_desc, w_desc, out, partial, tiles, M, N, k_iters, out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=block_k, SPLIT_K=split_k, PRECISION=precision, num_warps=num_warps, num_stages=num_stages,
            **launch,
        )
    else:
        _skinny_kernel[grid](
            x, weight, out, partial, tiles, M, N, K, k_iters, x.stride(0), weight.stride(0), out.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
            EVEN_N=N % block_n == 0, EVEN_K=K % (block_k * split_k) == 0,
            PRECISION=precision, num_warps=num_warps, num_stages=num_stages, **launch,
        )
    return out
