"""Triton GEMMs of the weight-only formats (int4 W4A16, NVFP4) with bf16 / fp16 activations: the weight tiles are
dequantized in registers (cuda_dequant.py) and multiplied on the 16-bit tensor cores.

  decode (1..64 rows)  `_skinny_kernel`: W tile [BLOCK_N, BLOCK_K] x x^T tile [BLOCK_K, BLOCK_M] (rows padded to
                       16); int4 takes one scale group per K step (BLOCK_K = the group) as exact codes and applies
                       zero and scale to the float32 product; NVFP4 dequantizes with its scales. K may be split
                       among SPLIT_K programs whose partial sums the tile's last program adds in order
                       (ops/split_k.py).
  prefill              `_gemm_kernel`: [BLOCK_M, BLOCK_N] output tiles of x @ dequant(W tile)^T, grouped along M for
                       L2 reuse; or `dequantize` the whole weight into a bf16 scratch buffer and cuBLAS (the
                       "cublas" kind: one buffer of the largest weight's N * K * 2 bytes, `reserve_scratch`).
Activation order (int4 g_idx) is a permutation of x's columns, gathered before the kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.ops import pdl
from deltaserve.ops.pdl import wait_for_previous_kernel
from deltaserve.ops.quant_gemm.cuda_tiles import grouped_tile
from deltaserve.ops.quant_gemm.cuda_dequant import INT4, NVFP4, int4_codes, int4_tile, nvfp4_tile
from deltaserve.ops.quant_gemm.reference import Int4Weight, Nvfp4Weight
from deltaserve.ops.split_k import store_split, tile_counters

# (bit pattern, offset) of the exact int4 codes per activation dtype: OFFSET + q = the 16-bit number CODE_BASE | q
_CODES = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0), torch.float32: (0, 0.0)}


@triton.jit
def _weight_tile(packed, scale, zero, scale_2, ns, n_ok, k0, stride_pn, stride_sn, FORMAT: tl.constexpr,
                 GROUP: tl.constexpr, BK: tl.constexpr, HAS_ZERO: tl.constexpr, MASK_N: tl.constexpr,
                 dtype: tl.constexpr):
    """[BN, BK] in dtype: the dequantized weight rows ns, columns k0 .. k0 + BK."""
    if FORMAT == INT4:
        w = int4_tile(packed, scale, zero, ns, n_ok, k0, stride_pn, stride_sn, GROUP, BK, HAS_ZERO, MASK_N, dtype)
    else:
        w = nvfp4_tile(packed, scale, scale_2, ns, n_ok, k0, stride_pn, stride_sn, BK, MASK_N, dtype)
    return w


@triton.jit(do_not_specialize=["k_iters"])
def _skinny_kernel(
    x, packed, scale, zero, scale_2, out, partial, counters, M, N, k_iters, stride_xm, stride_out_m, stride_pn,
    stride_sn,
    FORMAT: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, CODE_BASE: tl.constexpr,
    CODE_OFFSET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BK: tl.constexpr,
    SPLIT: tl.constexpr, EVEN_N: tl.constexpr, PDL: tl.constexpr = False,
):
    """Grid (cdiv(N, BLOCK_N), SPLIT_K): out[:, n block] (or partial [SPLIT_K, M, N] float32) over the program's
    k_iters K blocks of BK columns (K = SPLIT_K * k_iters * BK exactly). x [M, K]; the weight as reference.py."""
    wait_for_previous_kernel(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns = weight rows
    ms = tl.arange(0, BLOCK_M)  # [BM]
    n_ok = ns < N
    m_ok = ms < M
    dtype = x.dtype.element_ty
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for i in range(0, k_iters):
        k0 = (pid_k * k_iters + i) * BK
        ks = k0 + tl.arange(0, BK)
        xt = tl.load(x + ms[None, :] * stride_xm + ks[:, None], mask=m_ok[None, :], other=0.0)  # [BK, BM]
        if FORMAT == INT4:  # one scale group: exact codes, zero and scale on the float32 product
            codes = int4_codes(packed, ns, n_ok, k0, stride_pn, BK, CODE_BASE, dtype, not EVEN_N)  # [BN, BK]
            part = tl.dot(codes, xt)  # [BN, BM] = sum (OFFSET + q) x
            x_sum = tl.sum(xt.to(tl.float32), axis=0)  # [BM]
            s_ptrs = ns.to(tl.int64) * stride_sn + k0 // GROUP
            s = tl.load(scale + s_ptrs, mask=n_ok, other=0.0).to(tl.float32)  # [BN]
            if HAS_ZERO:
                z = tl.load(zero + s_ptrs, mask=n_ok, other=0).to(tl.float32) + CODE_OFFSET
            else:
                z = tl.full([BLOCK_N], 8.0 + CODE_OFFSET, tl.float32)
            acc += (part - z[:, None] * x_sum[None, :]) * s[:, None]
        else:
            wt = nvfp4_tile(packed, scale, scale_2, ns, n_ok, k0, stride_pn, stride_sn, BK, not EVEN_N, dtype)
            acc = tl.dot(wt, xt, acc)
    ok = m_ok[None, :] & n_ok[:, None]
    out_block = out + ms[None, :] * stride_out_m + ns[:, None]  # [BN, BM]
    if not SPLIT:
        tl.store(out_block, acc.to(out.dtype.element_ty), mask=ok)
    else:
        partial_block = partial + ms[None, :].to(tl.int64) * N + ns[:, None]  # [BN, BM] of split 0
        store_split(acc, out_block, partial_block, ok, M * N, counters, tl.program_id(0))


@triton.jit
def _gemm_kernel(
    x, packed, scale, zero, scale_2, out, M, N, K, stride_xm, stride_out_m, stride_pn, stride_sn,
    FORMAT: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr = False,
):
    """Grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),): out [M, N] = x [M, K] @ dequant(W)^T (K a multiple of BK)."""
    wait_for_previous_kernel(PDL)
    ms, ns = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)  # [BM], [BN]
    m_ok = ms < M
    n_ok = ns < N
    x_rows = x + ms[:, None].to(tl.int64) * stride_xm
    dtype = x.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(x_rows + k0 + tl.arange(0, BK)[None, :], mask=m_ok[:, None], other=0.0)  # [BM, BK]
        wt = _weight_tile(packed, scale, zero, scale_2, ns, n_ok, k0, stride_pn, stride_sn, FORMAT, GROUP, BK,
                          HAS_ZERO, True, dtype)  # [BN, BK]
        acc = tl.dot(a, tl.trans(wt), acc)
    tl.store(out + ms[:, None].to(tl.int64) * stride_out_m + ns[None, :], acc.to(out.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _dequant_kernel(packed, scale, zero, scale_2, out, N, K, stride_pn, stride_sn, FORMAT: tl.constexpr,
                    GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_N: tl.constexpr, BK: tl.constexpr,
                    PDL: tl.constexpr = False):
    """Grid (cdiv(N, BLOCK_N), K // BK): out [N, K] = the dequantized weight in out's dtype."""
    wait_for_previous_kernel(PDL)
    ns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    k0 = tl.program_id(1) * BK
    w = _weight_tile(packed, scale, zero, scale_2, ns, n_ok, k0, stride_pn, stride_sn, FORMAT, GROUP, BK, HAS_ZERO,
                     True, out.dtype.element_ty)
    tl.store(out + ns[:, None].to(tl.int64) * K + k0 + tl.arange(0, BK)[None, :], w, mask=n_ok[:, None])


def _operands(w):
    """(format, packed, scale, zero, scale_2, group) of a prepared weight, placeholders where a format has none."""
    if isinstance(w, Int4Weight):
        zero = w.zero if w.zero is not None else w.scale
        return INT4, w.packed, w.scale, zero, w.scale, w.group_size
    return NVFP4, w.packed, w.scale, w.scale, w.scale_2, 16


def _block_k(k: int, wanted: int, unit: int) -> int:
    """The largest power of two <= wanted that divides k and is a multiple of `unit` (16 or the int4 group)."""
    block = triton.next_power_of_2(wanted)
    while block > unit and k % block:
        block //= 2
    return block


def _gathered(x, w):
    """x with act order's column permutation applied (int4 with g_idx), else x."""
    return x.index_select(1, w.perm) if isinstance(w, Int4Weight) and w.perm is not None else x


def skinny(x: torch.Tensor, w, config: dict) -> torch.Tensor:
    """x [M <= 64, K] -> x @ dequant(w)^T [M, N] in x.dtype. config: block_n, block_k (NVFP4; int4 takes its
    group), split_k, warps, stages."""
    fmt, packed, scale, zero, scale_2, group = _operands(w)
    n, k = w.shape
    x = _gathered(x, w)
    m = x.shape[0]
    block_k = group if fmt == INT4 else _block_k(k, config["block_k"], 16)
    blocks = k // block_k
    split_k = max(1, min(config["split_k"], blocks))
    while blocks % split_k:
        split_k -= 1
    block_n = config["block_n"]
    block_m = max(16, triton.next_power_of_2(m))
    code_base, code_offset = _CODES[x.dtype]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    partial = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    launch = pdl.launch_args(x.device)
    grid = (triton.cdiv(n, block_n), split_k)
    _skinny_kernel[grid](
        x, packed, scale, zero, scale_2, out, partial, tile_counters(x.device, grid[0]), m, n, blocks // split_k,
        x.stride(0), out.stride(0),
        packed.stride(0), scale.stride(0), FORMAT=fmt, GROUP=group, HAS_ZERO=fmt == INT4 and w.zero is not None,
        CODE_BASE=code_base, CODE_OFFSET=code_offset, BLOCK_M=block_m, BLOCK_N=block_n, BK=block_k,
        SPLIT=split_k > 1, EVEN_N=n % block_n == 0, num_warps=config["warps"], num_stages=config["stages"], **launch)
    return out


def gemm(x: torch.Tensor, w, config: dict) -> torch.Tensor:
    """x [M, K] -> x @ dequant(w)^T [M, N] in x.dtype, tiled. config: block_m, block_n, block_k, group_m, warps,
    stages."""
    fmt, packed, scale, zero, scale_2, group = _operands(w)
    n, k = w.shape
    x = _gathered(x, w)
    m = x.shape[0]
    block_k = _block_k(k, config["block_k"], 16 if fmt == NVFP4 else min(group, 32))
    block_m, block_n = config["block_m"], config["block_n"]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _gemm_kernel[grid](
        x, packed, scale, zero, scale_2, out, m, n, k, x.stride(0), out.stride(0), packed.stride(0), scale.stride(0),
        FORMAT=fmt, GROUP=group, HAS_ZERO=fmt == INT4 and w.zero is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BK=block_k, GROUP_M=config["group_m"], num_warps=config["warps"], num_stages=config["stages"],
        **pdl.launch_args(x.device))
    return out


def dequantize(w, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, K] in dtype (16-bit), columns in the packed order (act order's permutation applied); into `out` (a
    contiguous [N, K] tensor of dtype) when given."""
    fmt, packed, scale, zero, scale_2, group = _operands(w)
    n, k = w.shape
    out = torch.empty(n, k, dtype=dtype, device=packed.device) if out is None else out
    block_n, block_k = 32, _block_k(k, 128, 16 if fmt == NVFP4 else min(group, 32))
    _dequant_kernel[(triton.cdiv(n, block_n), k // block_k)](
        packed, scale, zero, scale_2, out, n, k, packed.stride(0), scale.stride(0), FORMAT=fmt, GROUP=group,
        HAS_ZERO=fmt == INT4 and w.zero is not None, BLOCK_N=block_n, BK=block_k, num_warps=4,
        **pdl.launch_args(packed.device))
    return out


# The "cublas" kind's bf16 / fp16 copy of a weight: one buffer per (device, dtype), sized by `reserve_scratch` at
# start-up (warm-up, before any graph is captured, so that graphs keep its address) for the largest weight.
_scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def reserve_scratch(numel: int, dtype: torch.dtype, device: torch.device) -> None:
    """Make the scratch buffer of (device, dtype) hold at least `numel` elements (grown only here)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, dtype)
    if key not in _scratch or _scratch[key].numel() < numel:
        _scratch.pop(key, None)
        _scratch[key] = torch.empty(numel, dtype=dtype, device=device)


def scratch_bytes() -> int:
    """Bytes the scratch buffers hold on the GPU."""
    return sum(t.nbytes for t in _scratch.values())


def cublas(x: torch.Tensor, w) -> torch.Tensor:
    """x [M, K] -> x @ dequant(w)^T by cuBLAS on a bf16 (x.dtype) copy of the weight: in the reserved scratch
    buffer where it is large enough, else in memory taken for this call."""
    n, k = w.shape
    buffer = _scratch.get((x.device, x.dtype))
    out = buffer[: n * k].view(n, k) if buffer is not None and buffer.numel() >= n * k else None
    return torch.nn.functional.linear(_gathered(x, w), dequantize(w, x.dtype, out))
