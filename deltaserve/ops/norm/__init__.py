"""RMS norm ops: zero-centred RMSNorm with an optional fused residual add, and the gated RMSNorm of GDN.

On CUDA tensors they run the Triton kernels (`cuda.py`, imported only then); elsewhere the reference.
"""

from deltaserve.ops.norm import reference

__all__ = ["rms_norm", "gated_rms_norm"]


def rms_norm(x, weight, eps: float, residual=None):
    """See `reference.rms_norm` for shapes."""
    if x.is_cuda:
        from deltaserve.ops.norm import cuda
        return cuda.rms_norm(x, weight, eps, residual)
    return reference.rms_norm(x, weight, eps, residual)


def gated_rms_norm(x, gate, weight, eps: float):
    """See `reference.gated_rms_norm` for shapes."""
    if x.is_cuda:
        from deltaserve.ops.norm import cuda
        return cuda.gated_rms_norm(x, gate, weight, eps)
    return reference.gated_rms_norm(x, gate, weight, eps)
