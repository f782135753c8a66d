"""Float64 values of the quantized GEMMs and the error bounds of their float32 implementations, for the kernel
tests (the Triton interpreter on the CPU, tests/gpu on the H200).

A sum of L terms accumulated with unit roundoff u is within L * u * sum|terms| of the exact sum, in any order; the
cast to the output dtype adds its unit roundoff times |y|. What differs per implementation is u of the products'
accumulator (u_dot: float32's 2^-24 on the CPU; on Hopper's tensor cores a truncating float32 for 16-bit inputs,
and for FP8 inputs ~14 bits, which is why every FP8 K block is its own dot) and whether the weight is rounded to
16 bits before the dot (the weight-only tiles: u_w per weight).
"""

import math

import torch

from deltaserve.ops.quant_gemm import reference as ref

U32 = 2.0**-24
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def fp8_exact(x, w: ref.Fp8BlockWeight):
    """(y64, terms64 = sum_g s_x s_w sum_k |xq wq|) [M, N] of the FP8 block semantics, the activation quantized as
    specified (reference.quantize_activation, checked against hand-computed codes)."""
    n, k = w.shape
    bk = w.block_size[1]
    xq, s_x = ref.quantize_activation(x, bk)
    s_w = w.row_scales().double()
    y = torch.zeros(x.shape[0], n, dtype=torch.float64, device=x.device)
    terms = torch.zeros_like(y)
    for g in range(s_x.shape[1]):
        cols = slice(g * bk, min(k, (g + 1) * bk))
        a, b = xq[:, cols].double(), w.weight[:, cols].double()
        factor = s_x[:, g, None].double() * s_w[None, :, g]
        y += (a @ b.T) * factor
        terms += (a.abs() @ b.abs().T) * factor
    return y, terms


def fp8_bound(x, w, y64, terms, u_dot=U32):
    """Each K block's dot (bk terms at u_dot), then scaled and added in float32 (G + 3 roundings)."""
    groups = math.ceil(w.shape[1] / w.block_size[1])
    return (min(w.shape[1], w.block_size[1]) * u_dot + (groups + 3) * U32) * terms + _output(x, y64)


def weight_only_exact(x, w):
    """(y64, terms64 = |x| @ |W|^T) of x @ dequant(w)^T, the weight dequantized in float32 (exact for int4, one
    rounding for NVFP4's scale_2) then widened."""
    w64 = w.dequantize(torch.float32).double()
    x64 = x.double()
    return x64 @ w64.T, x64.abs() @ w64.abs().T


def weight_only_bound(x, w, y64, terms, u_dot=U32, u_w=U32, exact_codes=False):
    """K terms accumulated at u_dot, each weight rounded at u_w (16-bit tiles), plus, for the exact int4 codes, the
    offset's cancellation: per group the codes OFFSET + q and the zero (OFFSET + z) * sum(x) are summed at their own
    magnitude, (OFFSET + 16) * scale * |x| a term."""
    k = w.shape[1]
    bound = (k * u_dot + 2 * U32 + u_w) * terms + _output(x, y64)
    if exact_codes:
        offset = {torch.bfloat16: 128.0, torch.float16: 1024.0}.get(x.dtype, 0.0)
        scale = w.scale.double().repeat_interleave(w.group_size, dim=1)  # [N, K] in packed order
        xs = x.double().abs() if w.perm is None else x.double().abs()[:, w.perm]
        bound += 2 * w.group_size * max(u_dot, U32) * (offset + 16) * (xs @ scale.T)
    return bound


def int4_dp4a_bound(x, w, y64, splits=1):
    """cuda_gemv's dp4a one-row int4 GEMV: x in the packed order rounded per group to 16-bit fixed point (within
    2^E of x, 2^E = 2^(floor(log2 max |x|) - 14) of the group, at least 2^-114), the integer dots exact; per group
    and quad of 4 words a float32 product, the zero point's s z v_sum another, all summed in float32 with the split
    partials: (K/32 + 4 + splits) roundings of s (q + z) (|x| + 2^E) a term."""
    k, g = w.shape[1], w.group_size
    xs = x.double() if w.perm is None else x.double()[:, w.perm]  # [M, K], packed order
    step = _fixed_point_steps(xs, g)
    q = ref.unpack_int4(w.packed, k).double()
    zero = 8.0 if w.zero is None else w.zero.double().repeat_interleave(g, dim=1)
    scale = w.scale.double().repeat_interleave(g, dim=1)
    codes = scale * (q + zero)  # [N, K]: the codes and the zero's part, summed apart
    rounding = step @ (scale * (q - zero)).abs().T
    return rounding + (k // 32 + 4 + splits) * U32 * ((xs.abs() + step) @ codes.T) + _output(x, y64)


def _fixed_point_steps(x, group: int):
    """[M, K] float64: 2^E per column, E = floor(log2 max |x|) - 14 of its group of x (at least 2^-114), the
    dp4a kernels' 16-bit fixed point of x (cuda_gemv._x_parts_kernel)."""
    top = x.abs().reshape(x.shape[0], x.shape[1] // group, group).amax(-1)
    e = torch.floor(torch.log2(top)).clamp_min(-100) - 14  # -inf (a zero group) clamps too
    return (2.0 ** e).repeat_interleave(group, dim=1)


def nvfp4_dp4a_bound(x, w, y64, splits=1):
    """cuda_gemv's dp4a one-row NVFP4 GEMV: x rounded per group of 16 to 16-bit fixed point (within one step 2^E,
    the clamp at 2^15 - 1 included), the integer dots exact; per group a float32 product, summed in float32 with the
    split partials and times scale_2 / 2 once: (K/16 + 4 + splits) roundings of |W| (|x| + 2^E) a term, and the
    two of y64's float32 dequantization (scale_2's product)."""
    k = w.shape[1]
    xs = x.double()
    step = _fixed_point_steps(xs, 16)
    w_abs = w.dequantize(torch.float32).double().abs()
    return step @ w_abs.T + (k // 16 + 6 + splits) * U32 * ((xs.abs() + step) @ w_abs.T) + _output(x, y64)


def _output(x, y64):
    return UNIT_ROUNDOFF[x.dtype] * y64.abs() + torch.finfo(x.dtype).tiny


def assert_within(got, y64, bound, what=""):
    err = (got.double() - y64).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"{what}: error {worst:.3g} x its bound (max abs error {err.max().item():.3g})"
