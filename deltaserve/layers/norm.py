"""RMS norms of the Qwen3.5 family.

Two flavours (see the architecture reference, sections 2.4 and 3):
- `RMSNorm`: zero-centred weight, y = norm(x) * (1 + w). Used everywhere except the GDN output.
- `GatedRMSNorm`: plain weight, norm before the gate, y = w * norm(x) * silu(z). The GDN output norm.
Both normalise in float32 and cast back, as transformers does.
"""

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm over the last dim (weight stored as an offset from 1, init zeros)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x: [..., dim]. With `residual`, first adds it (x + residual) and returns (normed, new residual)."""
        if residual is not None:
            x = x + residual
            residual = x
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        # the (1 + w) product is done in float32 before the cast, as transformers does
        y = (y * (1.0 + self.weight.float())).to(x.dtype)
        return y if residual is None else (y, residual)


class GatedRMSNorm(nn.Module):
    """RMSNorm with a plain weight followed by a SiLU gate: w * norm(x) * silu(z), per value head."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate: [..., dim] -> [..., dim] in x's dtype."""
        dtype = x.dtype
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        # transformers casts back to the input dtype before the weight, then gates in float32
        y = self.weight * y
        return (y * F.silu(gate.float())).to(dtype)
