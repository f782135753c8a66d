"""Plain-torch RMS norms of the Qwen3.5 family (the oracle for the Triton kernels in cuda.py).

Both normalise in float32 and cast back, as transformers does.
"""

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Zero-centred RMSNorm over the last dim: y = norm(x) * (1 + weight).

    x: [..., D]; weight: [D]. With `residual` ([..., D], x's dtype) it first forms h = x + residual and
    returns (y, h); otherwise returns y. y has x's dtype.
    """
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = (y * (1.0 + weight.float())).to(x.dtype)  # (1 + w) in float32 before the cast, as transformers
    return y if residual is None else (y, residual)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Norm before gate, plain weight: y = weight * norm(x) * silu(gate). x, gate: [..., D]; weight: [D]."""
    dtype = x.dtype
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    y = weight * y  # transformers applies the weight in the input dtype, then gates in float32
    return (y * F.silu(gate.float())).to(dtype)
