"""Triton RMS norms: one program per row, the whole row in registers (D <= 16384).

Same numerics as reference.py: float32 statistics, (1 + w) applied in float32 for the zero-centred norm;
for the gated norm the normalised row is rounded to the input dtype before the weight, as transformers does.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr, D, x_stride, res_stride, y_stride, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)  # rounded like torch's add
        tl.store(res_out_ptr + row * D + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * y_stride + cols, (xf * rstd * (1.0 + w)).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_rms_norm_kernel(x_ptr, g_ptr, w_ptr, y_ptr, D, x_stride, g_stride, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    xf = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    normed = (xf * rstd).to(y_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    scaled = (w * normed).to(tl.float32)
    g = tl.load(g_ptr + row * g_stride + cols, mask=mask, other=0.0).to(tl.float32)
    y = scaled * (g / (1.0 + tl.exp(-g)))
    tl.store(y_ptr + row * D + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """View as [rows, D] with a unit last stride (a copy only if the input is not row-strided)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def rms_norm(x, weight, eps, residual=None):
    """See reference.rms_norm."""
    shape, D = x.shape, x.shape[-1]
    x2 = _rows(x)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(D)
    if residual is not None:
        r2 = _rows(residual)
        h = torch.empty_like(y)
        _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, y, h, D, x2.stride(0), r2.stride(0), y.stride(0), eps,
                                         HAS_RESIDUAL=True, BLOCK=block, num_warps=_warps(block))
        return y.view(shape), h.view(shape)
    _rms_norm_kernel[(x2.shape[0],)](x2, x2, weight, y, y, D, x2.stride(0), 0, y.stride(0), eps,
                                     HAS_RESIDUAL=False, BLOCK=block, num_warps=_warps(block))
    return y.view(shape)


def gated_rms_norm(x, gate, weight, eps):
    """See reference.gated_rms_norm."""
    shape, D = x.shape, x.shape[-1]
    x2, g2 = _rows(x), _rows(gate)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(D)
    _gated_rms_norm_kernel[(x2.shape[0],)](x2, g2, weight, y, D, x2.stride(0), g2.stride(0), eps,
                                           BLOCK=block, num_warps=_warps(block))
    return y.view(shape)
