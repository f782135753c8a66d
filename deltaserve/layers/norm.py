"""RMS norms of the Qwen3.5 family.

Two flavours (see the architecture reference, sections 2.4 and 3):
- `RMSNorm`: zero-centred weight, y = norm(x) * (1 + w). Used everywhere except the GDN output.
- `GatedRMSNorm`: plain weight, norm before the gate, y = w * norm(x) * silu(z). The GDN output norm.
Both normalise in float32 and cast back, as transformers does.
"""

import torch
from torch import nn

from deltaserve.ops.norm import gated_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm over the last dim (weight stored as an offset from 1, init zeros)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x: [..., dim]. With `residual`, first adds it (x + residual) and returns (normed, new residual)."""
        return rms_norm(x, self.weight, self.eps, residual)


class GatedRMSNorm(nn.Module):
    """RMSNorm with a plain weight followed by a SiLU gate: w * norm(x) * silu(z), per value head."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate: [..., dim] -> [..., dim] in x's dtype. On the GPU [T, heads, dim] inputs are read in place
        whatever their token and head strides (e.g. the gate as a view of the GDN input projection)."""
        return gated_rms_norm(x, gate, self.weight, self.eps)
