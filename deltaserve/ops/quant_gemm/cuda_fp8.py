"""Triton kernels of the FP8 block-scaled GEMM (W8A8, reference.fp8_block_linear's semantics) on Hopper's FP8
tensor cores.

Every K block of bk columns (the checkpoint's scale block, 128) is one tl.dot of e4m3 tiles started from zero; its
float32 result is scaled by s_x[m, g] * s_w[n // bn, g] and added to the float32 accumulator, as the reference
does (the tensor cores' own FP8 accumulation never spans more than one block).

  decode (1..64 rows)  `_skinny_kernel`: the weight is the wide side, W tile [BLOCK_N, bk] x xq^T [bk, BLOCK_M]
                       (rows padded to 16); QUANT_X quantizes the activation's K block in the prologue of every
                       program (no extra launch; each program re-reads x from L2), else it reads xq / s_x written
                       by `_quantize_kernel`; K may be split among SPLIT_K programs (the tile's last program adds
                       their partial sums in order: ops/split_k.py). The weight's (and xq's) tiles come by pointer
                       loads or, with TMA, by the Hopper tensor-memory accelerator's bulk copies (as
                       ops/linear/cuda_skinny's bf16 tiles).
  prefill              `_quantize_kernel` once (or the norm / SiLU kernel before the product writes xq / s_x), then
                       `_gemm_kernel`: [BLOCK_M, BLOCK_N] output tiles, grouped along M for L2 reuse of the weight.
                       Or torch's block-scaled F.scaled_mm where it measured faster.
Activation scales are stored K-group-major (s_x [G, M]), the layout F.scaled_mm wants for 1x128 scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from deltaserve.ops import pdl
from deltaserve.ops.linear.cuda_skinny import tma_ready
from deltaserve.ops.pdl import wait_for_previous_kernel
from deltaserve.ops.quant_gemm.cuda_tiles import grouped_tile, tail_arguments, tail_program
from deltaserve.ops.quant_gemm.reference import ACT_AMAX_FLOOR, E4M3_MAX, Fp8Activation, Fp8BlockWeight
from deltaserve.ops.split_k import store_split, tile_counters

FP8_AMAX_FLOOR: tl.constexpr = tl.constexpr(ACT_AMAX_FLOOR)  # the activation quantization's, for store_fp8_row
FP8_MAX: tl.constexpr = tl.constexpr(E4M3_MAX)


@triton.jit
def quantize_block(xf, FLOOR: tl.constexpr, QMAX: tl.constexpr):
    """xf [R, BK] float32 -> (xq [R, BK] e4m3, s [R] float32): s = max(amax, FLOOR) / 448 and xq = x / s, both IEEE
    divisions rounded to nearest as torch computes them (the reference's activation quantization)."""
    amax = tl.maximum(tl.max(tl.abs(xf), axis=1), FLOOR)  # [R]
    s = tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32))
    q = tl.math.div_rn(xf, tl.broadcast_to(s[:, None], xf.shape))
    return tl.clamp(q, -QMAX, QMAX).to(tl.float8e4nv), s


@triton.jit
def _quantize_kernel(x, xq, sx, M, K, stride_xm, BLOCK_M: tl.constexpr, BK: tl.constexpr,
                     FLOOR: tl.constexpr, QMAX: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (cdiv(M, BLOCK_M), cdiv(K, BK)): x [M, K] -> xq [M, K] e4m3 and sx [G, M] float32 for one K group."""
    wait_for_previous_kernel(PDL)
    ms = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    ks = g * BK + tl.arange(0, BK)
    ok = (ms < M)[:, None] & (ks < K)[None, :]
    xf = tl.load(x + ms[:, None].to(tl.int64) * stride_xm + ks[None, :], mask=ok, other=0.0).to(tl.float32)
    q, s = quantize_block(xf, FLOOR, QMAX)
    tl.store(xq + ms[:, None].to(tl.int64) * K + ks[None, :], q, mask=ok)
    tl.store(sx + g * M + ms, s, mask=ms < M)


@triton.jit
def store_fp8_row(y, out_row, sx_ptr, row, rows, D, BLOCK: tl.constexpr, BK: tl.constexpr):
    """Row y [BLOCK] (D valid, the rest zero) of a kernel before an FP8 product, quantized per BK columns as
    _quantize_kernel quantizes an activation: its e4m3 codes to out_row [D], its scales to sx_ptr
    [cdiv(D, BK), rows] at column `row` (so that the product needs no quantize kernel)."""
    q, s = quantize_block(tl.reshape(y.to(tl.float32), [BLOCK // BK, BK]), FP8_AMAX_FLOOR, FP8_MAX)
    cols = tl.arange(0, BLOCK)
    tl.store(out_row + cols, tl.reshape(q, [BLOCK]), mask=cols < D)
    groups = tl.arange(0, BLOCK // BK)
    tl.store(sx_ptr + groups * rows + row, s, mask=groups * BK < D)


def fp8_row_buffers(x2: torch.Tensor, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq [M, D] e4m3, sx [cdiv(D, bk), M] float32) for the quantized rows of x2 [M, D]."""
    m, d = x2.shape
    return (torch.empty(m, d, dtype=torch.float8_e4m3fn, device=x2.device),
            torch.empty(triton.cdiv(d, bk), m, dtype=torch.float32, device=x2.device))


# Not specialised on the loop counts (a variant per shape otherwise); M is (1, a multiple of 16, other), as in
# ops/linear/cuda_skinny.
@triton.jit(do_not_specialize=["G", "k_iters"])
def _skinny_kernel(
    x, xq, sx, w, ws, out, partial, counters, M, N, K, G, k_iters, stride_xm, stride_out_m, tail_x, tail_w, tail_out,
    stride_tn, xq_desc, w_desc, BN_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BK: tl.constexpr,
    SPLIT: tl.constexpr, QUANT_X: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, FLOOR: tl.constexpr,
    QMAX: tl.constexpr, TAIL_ROWS: tl.constexpr = 0, TAIL_K: tl.constexpr = 0, TMA: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """Grid (TAIL_ROWS + cdiv(N, BLOCK_N), SPLIT_K): out[:, n block] (or partial [SPLIT_K, M, N]) over the program's
    k_iters K blocks. x [M, K] (QUANT_X) or xq [M, K] e4m3 + sx [G, M]; w [N, K] e4m3; ws [cdiv(N, BN_W), G] float32.
    With TAIL_ROWS (one row), the first TAIL_ROWS programs compute tail_out [TAIL_ROWS] = tail_x [K] @ tail_w^T
    instead (the row unquantized, by a 16-bit block that reads it too: GDN's [b|a] beside its FP8 [q|k|v|z]), one row
    each (cuda_tiles.tail_program), so that it takes no launch of its own. TMA: w's [BLOCK_N, BK] tiles (and xq's
    [BLOCK_M, BK], unless QUANT_X) come by TMA from w_desc / xq_desc, zero past the tensors' edges."""
    wait_for_previous_kernel(PDL)
    if tail_program(tail_x, tail_w, tail_out, stride_tn, TAIL_ROWS, TAIL_K):
        return
    pid_n = tl.program_id(0) - TAIL_ROWS
    pid_k = tl.program_id(1)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns = weight rows
    ms = tl.arange(0, BLOCK_M)  # [BM]
    n_ok = ns < N
    m_ok = ms < M
    w_rows = w + ns[:, None].to(tl.int64) * K  # [BN, 1]
    ws_rows = ws + (ns // BN_W) * G  # [BN]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for i in range(0, k_iters):
        g = pid_k * k_iters + i
        ks = g * BK + tl.arange(0, BK)  # [BK]
        k_ok = ks < K
        if QUANT_X:
            xf = tl.load(x + ms[:, None] * stride_xm + ks[None, :], mask=m_ok[:, None] & k_ok[None, :],
                         other=0.0).to(tl.float32)  # [BM, BK]
            xt, s_x = quantize_block(xf, FLOOR, QMAX)
        else:
            if TMA:
                xt = xq_desc.load([0, g * BK])  # [BM, BK] e4m3
            else:
                xt = tl.load(xq + ms[:, None] * K + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            s_x = tl.load(sx + g * M + ms, mask=m_ok & (g < G), other=0.0)
        if TMA:
            wt = w_desc.load([pid_n * BLOCK_N, g * BK])  # [BN, BK] e4m3
        elif EVEN_N and EVEN_K:
            wt = tl.load(w_rows + ks[None, :])
        else:
            wt = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if EVEN_N and EVEN_K:
            s_w = tl.load(ws_rows + g)
        else:
            s_w = tl.load(ws_rows + g, mask=n_ok & (g < G), other=0.0)
        part = tl.dot(wt, tl.trans(xt))  # [BN, BM], one K block from zero
        acc += part * (s_x[None, :] * s_w[:, None])
    ok = m_ok[None, :] & n_ok[:, None]
    out_block = out + ms[None, :] * stride_out_m + ns[:, None]  # [BN, BM]
    if not SPLIT:
        tl.store(out_block, acc.to(out.dtype.element_ty), mask=ok)
    else:
        store_split(acc, out_block, partial + ms[None, :].to(tl.int64) * N + ns[:, None], ok, M * N, counters, pid_n)


@triton.jit(do_not_specialize=["G"])
def _gemm_kernel(
    xq, sx, w, ws, out, M, N, K, G, stride_out_m,
    BN_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, PDL: tl.constexpr = False,
):
    """Grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),): out [M, N] = the block-scaled product of xq [M, K] e4m3
    (scales sx [G, M]) and w [N, K] e4m3 (scales ws [cdiv(N, BN_W), G]). Programs walk GROUP_M row tiles per
    column tile so that a column tile of the weight is read from L2 by neighbours."""
    wait_for_previous_kernel(PDL)
    ms, ns = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)  # [BM], [BN]
    m_ok = ms < M
    n_ok = ns < N
    a_rows = xq + ms[:, None].to(tl.int64) * K
    b_rows = w + ns[:, None].to(tl.int64) * K
    ws_rows = ws + (ns // BN_W) * G
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(0, G):
        ks = g * BK + tl.arange(0, BK)
        if EVEN_K:
            a = tl.load(a_rows + ks[None, :], mask=m_ok[:, None], other=0.0)  # [BM, BK]
            b = tl.load(b_rows + ks[None, :], mask=n_ok[:, None], other=0.0)  # [BN, BK]
        else:
            a = tl.load(a_rows + ks[None, :], mask=m_ok[:, None] & (ks < K)[None, :], other=0.0)
            b = tl.load(b_rows + ks[None, :], mask=n_ok[:, None] & (ks < K)[None, :], other=0.0)
        s_x = tl.load(sx + g * M + ms, mask=m_ok, other=0.0)  # [BM]
        s_w = tl.load(ws_rows + g, mask=n_ok, other=0.0)  # [BN]
        part = tl.dot(a, tl.trans(b))  # [BM, BN]
        acc += part * (s_x[:, None] * s_w[None, :])
    tl.store(out + ms[:, None].to(tl.int64) * stride_out_m + ns[None, :], acc.to(out.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _dequant_kernel(weight, scale_inv, out, N, K, stride_sn, BN: tl.constexpr, BK: tl.constexpr,
                    PDL: tl.constexpr = False):
    """Grid (cdiv(N, BN), cdiv(K, BK)), one scale block a program: out [N, K] = weight * its block's scale, in
    float32, rounded once to out's dtype."""
    wait_for_previous_kernel(PDL)
    ns = tl.program_id(0) * BN + tl.arange(0, BN)
    ks = tl.program_id(1) * BK + tl.arange(0, BK)
    ok = (ns < N)[:, None] & (ks < K)[None, :]
    offsets = ns[:, None].to(tl.int64) * K + ks[None, :]
    w = tl.load(weight + offsets, mask=ok, other=0.0).to(tl.float32)
    s = tl.load(scale_inv + tl.program_id(0) * stride_sn + tl.program_id(1))
    tl.store(out + offsets, (w * s).to(out.dtype.element_ty), mask=ok)


def dequantize(w: Fp8BlockWeight, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, K] in dtype (reference Fp8BlockWeight.dequantize's numbers); into `out` (a contiguous [N, K] tensor of
    dtype) when given."""
    n, k = w.shape
    bn, bk = w.block_size
    out = torch.empty(n, k, dtype=dtype, device=w.weight.device) if out is None else out
    _dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
        w.weight, w.scale_inv, out, n, k, w.scale_inv.stride(0), BN=bn, BK=bk, num_warps=4,
        **pdl.launch_args(w.weight.device))
    return out


def supports(w: Fp8BlockWeight) -> bool:
    """Whether the kernels take this weight: a scale block of K that tl.dot can take whole (16..256, a power of
    two) and unit-stride contiguous tensors."""
    bk = w.block_size[1]
    return 16 <= bk <= 256 and bk & (bk - 1) == 0


def quantize(x: torch.Tensor, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq [M, K] e4m3, sx [G, M] float32): reference.quantize_activation, scales K-group-major."""
    m, k = x.shape
    groups = triton.cdiv(k, bk)
    xq, sx = fp8_row_buffers(x, bk)
    block_m = 16
    _quantize_kernel[(triton.cdiv(m, block_m), groups)](
        x, xq, sx, m, k, x.stride(0), BLOCK_M=block_m, BK=bk, FLOOR=ACT_AMAX_FLOOR, QMAX=E4M3_MAX, num_warps=4,
        **pdl.launch_args(x.device))
    return xq, sx


def quantized(x: torch.Tensor | Fp8Activation, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq, sx) of x: quantize's, or those x holds already (an Fp8Activation of scale block bk)."""
    if isinstance(x, Fp8Activation):
        if x.block_k != bk:
            raise ValueError(f"the activation is quantized in blocks of {x.block_k} columns, the weight's are {bk}")
        return x.xq, x.sx
    return quantize(x, bk)


def skinny(x: torch.Tensor | Fp8Activation, w: Fp8BlockWeight, config: dict, tail: torch.Tensor | None = None):
    """x [M <= 64, K] -> [M, N] in x.dtype. config: block_n, split_k, warps, stages, quant_x, tma (configs.py). x may
    be quantized already (an Fp8Activation: then quant_x must be 0). tail: a 16-bit [NT, K] block multiplied in the
    same launch by one row (an Fp8Activation holding it unquantized, its `unquantized` [1, K]); the result is then
    (x @ W^T [1, N], x @ tail^T [1, NT])."""
    n, k = w.shape
    m = x.shape[0]
    bn_w, bk = w.block_size
    groups = triton.cdiv(k, bk)
    split_k = min(config["split_k"], groups)
    k_iters = triton.cdiv(groups, split_k)
    block_m = max(16, triton.next_power_of_2(m))
    block_n = config["block_n"]
    quant_x = bool(config.get("quant_x", 1))
    if isinstance(x, Fp8Activation) and quant_x:
        raise ValueError("a quantized activation takes a skinny config with quant_x 0")
    device = x.xq.device if isinstance(x, Fp8Activation) else x.device
    out = torch.empty(m, n, dtype=x.dtype, device=device)
    partial = torch.empty(split_k, m, n, dtype=torch.float32, device=device) if split_k > 1 else out
    xq, sx = (x, out) if quant_x else quantized(x, bk)
    # x itself is read only when quant_x; else a tensor of its dtype stands in (the launch the warm-up compiled)
    x_in, stride_xm = (x, x.stride(0)) if isinstance(x, torch.Tensor) else (out, k)
    if tail is not None and (not isinstance(x, Fp8Activation) or x.unquantized is None):
        raise ValueError("a tail block is multiplied beside an activation quantized by the kernel before (an "
                         "Fp8Activation) that holds its row unquantized")
    tail_args, tail_out, tail_constexprs = tail_arguments(x.unquantized if tail is not None else out, tail)
    tma = bool(config.get("tma", 0)) and tma_ready(w.weight) and (quant_x or tma_ready(xq))
    xq_desc = TensorDescriptor.from_tensor(xq, [block_m, bk]) if tma and not quant_x else None
    w_desc = TensorDescriptor.from_tensor(w.weight, [block_n, bk]) if tma else None
    launch = pdl.launch_args(device)
    tiles = triton.cdiv(n, block_n)
    _skinny_kernel[(tail_constexprs.get("TAIL_ROWS", 0) + tiles, split_k)](
        x_in, xq, sx, w.weight, w.scale_inv, out, partial, tile_counters(device, tiles), m, n, k, groups, k_iters,
        stride_xm, out.stride(0), *tail_args, xq_desc, w_desc, BN_W=bn_w, BLOCK_M=block_m, BLOCK_N=block_n, BK=bk,
        SPLIT=split_k > 1, QUANT_X=quant_x, EVEN_N=n % block_n == 0, EVEN_K=k % bk == 0 and groups % split_k == 0,
        FLOOR=ACT_AMAX_FLOOR, QMAX=E4M3_MAX, TMA=tma, num_warps=config["warps"], num_stages=config["stages"],
        **launch, **tail_constexprs)
    return out if tail is None else (out, tail_out)


def gemm(x: torch.Tensor | Fp8Activation, w: Fp8BlockWeight, config: dict) -> torch.Tensor:
    """x [M, K] -> [M, N] in x.dtype: the activation quantized by one kernel (unless x is quantized already), then
    the tiled block-scaled GEMM. config: block_m, block_n, group_m, warps, stages (block_k is the weight's scale
    block)."""
    n, k = w.shape
    m = x.shape[0]
    bn_w, bk = w.block_size
    xq, sx = quantized(x, bk)
    out = torch.empty(m, n, dtype=x.dtype, device=xq.device)
    block_m, block_n = config["block_m"], config["block_n"]
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _gemm_kernel[grid](
        xq, sx, w.weight, w.scale_inv, out, m, n, k, triton.cdiv(k, bk), out.stride(0),
        BN_W=bn_w, BLOCK_M=block_m, BLOCK_N=block_n, BK=bk, GROUP_M=config["group_m"], EVEN_K=k % bk == 0,
        num_warps=config["warps"], num_stages=config["stages"], **pdl.launch_args(xq.device))
    return out


# cuBLASLt takes the activation scales [M, K/128] (strides (1, M)) only with M a multiple of 4
TORCH_ROW_MULTIPLE = 4


def torch_supports(w: Fp8BlockWeight) -> bool:
    """Whether torch's block-scaled F.scaled_mm can take the weight: 128 x 128 blocks dividing N and K."""
    n, k = w.shape
    return (hasattr(torch.nn.functional, "scaled_mm") and tuple(w.block_size) == (128, 128)
            and n % 128 == 0 and k % 128 == 0)


def torch_scaled_mm(x: torch.Tensor | Fp8Activation, w: Fp8BlockWeight) -> torch.Tensor:
    """The same product by torch's F.scaled_mm (cuBLASLt) with 1x128 activation and 128x128 weight scales: xq [M, K]
    row-major, s_x [M, K/128] with strides (1, M), W^T column-major, s_w [K/128 rounded up to 4, N/128] with strides
    (1, that). x may be quantized already (an Fp8Activation of TORCH_ROW_MULTIPLE rows)."""
    F = torch.nn.functional
    n, k = w.shape
    m = x.shape[0]
    if m % TORCH_ROW_MULTIPLE:
        if isinstance(x, Fp8Activation):
            raise ValueError(f"F.scaled_mm takes a quantized activation of a multiple of {TORCH_ROW_MULTIPLE} rows, "
                             f"got {m}")
        return torch_scaled_mm(F.pad(x, (0, 0, 0, -m % TORCH_ROW_MULTIPLE)), w)[:m]
    xq, sx = quantized(x, 128)
    groups = k // 128
    sw = w.scale_inv  # [N/128, G]: its transpose has the strides wanted when G is a multiple of 4
    if groups % 4:
        sw = torch.zeros(n // 128, -(-groups // 4) * 4, dtype=torch.float32, device=xq.device)
        sw[:, :groups] = w.scale_inv
    return F.scaled_mm(xq, w.weight.t(), sx.t(), F.ScalingType.BlockWise1x128, sw.t(),
                       F.ScalingType.BlockWise128x128, output_dtype=x.dtype)
