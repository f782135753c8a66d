"""Plain-torch fused projections (the oracle for cuda.py): y = x' @ W^T where x' is x after a prologue.

Each is exactly the unfused sequence the model runs on the CPU and for large batches on the GPU: the
prologue op (an RMS norm, silu_and_mul, the gated RMS norm) and then F.linear.
"""

import torch.nn.functional as F

from deltaserve.ops.activation import silu_and_mul
from deltaserve.ops.norm import gated_rms_norm, rms_norm


# matmul: the product after the prologue op, F.linear or one with its contract (ops.linear.matmul on the GPU).


def rms_norm_linear(x, norm_weight, eps: float, weight, residual=None, matmul=F.linear):
    """x: [M, K]; norm_weight: [K]; weight: [N, K]; residual: [M, K] or None.
    Returns W @ rms_norm(x + residual) ([M, N]) and, with a residual, also h = x + residual."""
    if residual is None:
        return matmul(rms_norm(x, norm_weight, eps), weight)
    normed, h = rms_norm(x, norm_weight, eps, residual)
    return matmul(normed, weight), h


def rms_norm_and_linear(x, norm_weight, eps: float, weight, residual=None, matmul=F.linear):
    """As rms_norm_linear, for a product whose input other ops read too (the MoE block's router beside its
    experts). Returns (rms_norm(x + residual) [M, K], its product [M, N], h = x + residual or None)."""
    if residual is None:
        normed, h = rms_norm(x, norm_weight, eps), None
    else:
        normed, h = rms_norm(x, norm_weight, eps, residual)
    return normed, matmul(normed, weight), h


def silu_mul_linear(x, weight, matmul=F.linear):
    """x: [M, 2K] (gate | up); weight: [N, K]. Returns W @ (silu(gate) * up): [M, N]."""
    return matmul(silu_and_mul(x), weight)


def gated_norm_linear(x, gate, norm_weight, eps: float, weight, matmul=F.linear):
    """x, gate: [M, H, D]; norm_weight: [D]; weight: [N, H*D]. Returns W @ gated_rms_norm(x, gate): [M, N]."""
    normed = gated_rms_norm(x, gate, norm_weight, eps)
    return matmul(normed.reshape(x.shape[0], -1), weight)
