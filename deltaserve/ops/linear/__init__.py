"""Projections fused with the op before them, for decode batches.

At batch 1 a decode step is ~850 kernels, and the ~600 that are not weight reads cost launch latency rather
than bandwidth. These ops read the prologue's input and apply the prologue (RMS norm with the residual add,
silu_and_mul, the GDN gated norm) inside the matrix-vector product, so the normalised activation is never
written and its kernel never launched. On CUDA, for 16-bit inputs, each shape takes what was measured fastest on
an H200 for its row count: the prologue op and then the skinny tensor-core GEMM (`cuda_skinny`, its table
`skinny_configs.json`, 1 to 64 rows), else at one row the fused GEMV (`cuda`, its table `configs.json`), else
the prologue op and cuBLAS. Elsewhere (the CPU, float32, larger batches) the unfused reference ops run.
"""

import torch
import torch.nn.functional as F

from deltaserve.ops.linear import reference

__all__ = ["gated_norm_linear", "linear", "matmul", "rms_norm_linear", "silu_mul_linear"]


def _on_gpu(x) -> bool:
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


def _skinny_config(x, weight):
    """The skinny GEMM's tuned tile for x @ weight^T, or None (also for an x without a unit last stride)."""
    if not _on_gpu(x) or x.stride(-1) != 1:
        return None
    from deltaserve.ops.linear import cuda_skinny
    return cuda_skinny.config_for(*weight.shape, x.shape[0])


def _gemv_serves(prologue: str, x, weight) -> bool:
    """Whether the batch-1 fused GEMV takes this product: measured to beat the unfused ops, and the skinny GEMM
    not measured to beat it."""
    if not _on_gpu(x) or x.shape[0] != 1 or _skinny_config(x, weight) is not None:
        return False
    from deltaserve.ops.linear import cuda
    return cuda.config_for(prologue, *weight.shape) is not None


def matmul(x, weight):
    """x: [M, K] -> x @ weight^T: [M, N] (the skinny GEMM where tuned, else cuBLAS)."""
    config = _skinny_config(x, weight)
    if config is not None:
        from deltaserve.ops.linear import cuda_skinny
        return cuda_skinny.linear(x, weight, config)
    return F.linear(x, weight)


def linear(x, weight):
    """x: [M, K] -> x @ weight^T: [M, N] (no prologue)."""
    if _gemv_serves("none", x, weight):
        from deltaserve.ops.linear import cuda
        return cuda.linear(x, weight)
    return matmul(x, weight)


def rms_norm_linear(x, norm_weight, eps: float, weight, residual=None):
    """See `reference.rms_norm_linear`."""
    if _gemv_serves("rms_norm", x, weight):
        from deltaserve.ops.linear import cuda
        return cuda.rms_norm_linear(x, norm_weight, eps, weight, residual)
    return reference.rms_norm_linear(x, norm_weight, eps, weight, residual, matmul=matmul)


def silu_mul_linear(x, weight):
    """See `reference.silu_mul_linear`."""
    if _gemv_serves("silu_mul", x, weight):
        from deltaserve.ops.linear import cuda
        return cuda.silu_mul_linear(x, weight)
    return reference.silu_mul_linear(x, weight, matmul=matmul)


def gated_norm_linear(x, gate, norm_weight, eps: float, weight):
    """See `reference.gated_norm_linear`."""
    if _gemv_serves("gated_norm", x, weight):
        from deltaserve.ops.linear import cuda
        return cuda.gated_norm_linear(x, gate, norm_weight, eps, weight)
    return reference.gated_norm_linear(x, gate, norm_weight, eps, weight, matmul=matmul)
