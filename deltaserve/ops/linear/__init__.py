"""Projections fused with the op before them, for small decode batches.

At batch 1 a decode step is ~850 kernels, and the ~600 that are not weight reads cost launch latency rather
than bandwidth. These ops read the prologue's input and apply the prologue (RMS norm with the residual add,
silu_and_mul, the GDN gated norm) inside the matrix-vector product, so the normalised activation is never
written and its kernel never launched. On CUDA, for at most `cuda.GEMV_MAX_ROWS` rows of a 16-bit dtype, one
Triton launch does it; otherwise (and on the CPU) the unfused reference ops run.
"""

import torch.nn.functional as F

from deltaserve.ops.linear import reference

__all__ = ["gated_norm_linear", "linear", "rms_norm_linear", "silu_mul_linear"]


def _fused(x) -> bool:
    if not x.is_cuda:
        return False
    from deltaserve.ops.linear import cuda
    return cuda.supports(x)


def linear(x, weight):
    """x: [M, K] -> x @ weight^T: [M, N] (no prologue: the kernel only where it beats cuBLAS)."""
    if _fused(x):
        from deltaserve.ops.linear import cuda
        return cuda.linear(x, weight)
    return F.linear(x, weight)


def rms_norm_linear(x, norm_weight, eps: float, weight, residual=None):
    """See `reference.rms_norm_linear`."""
    if _fused(x):
        from deltaserve.ops.linear import cuda
        return cuda.rms_norm_linear(x, norm_weight, eps, weight, residual)
    return reference.rms_norm_linear(x, norm_weight, eps, weight, residual)


def silu_mul_linear(x, weight):
    """See `reference.silu_mul_linear`."""
    if _fused(x):
        from deltaserve.ops.linear import cuda
        return cuda.silu_mul_linear(x, weight)
    return reference.silu_mul_linear(x, weight)


def gated_norm_linear(x, gate, norm_weight, eps: float, weight):
    """See `reference.gated_norm_linear`."""
    if _fused(x):
        from deltaserve.ops.linear import cuda
        return cuda.gated_norm_linear(x, gate, norm_weight, eps, weight)
    return reference.gated_norm_linear(x, gate, norm_weight, eps, weight)
