"""The cos/sin cache of the partial rotary position embedding (applied by ops/rotary, fused with q/k norm).

Qwen3.5's text RoPE is interleaved M-RoPE; for text-only input all three position rows are equal, so it
reduces exactly to plain 1-D RoPE, which is what this module computes.
"""

import torch
from torch import nn


class PartialRotary(nn.Module):
    """cos/sin cache over positions for rotating the first `rotary_dim` dims of each head (rotate-half)."""

    def __init__(self, head_dim: int, rotary_dim: int, theta: float, max_positions: int):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.theta = theta
        self.max_positions = max_positions
        cos, sin = self._cos_sin(max_positions)
        self.register_buffer("cos", cos, persistent=False)  # [P, rotary_dim / 2] float32
        self.register_buffer("sin", sin, persistent=False)

    def _cos_sin(self, max_positions: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float32,
                                                        device=device) / self.rotary_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=device), inv_freq)
        return freqs.cos(), freqs.sin()

    def materialize(self, device) -> None:
        """(Re)compute the cos/sin cache on `device` (after the module was built on the meta device)."""
        self.cos, self.sin = self._cos_sin(self.max_positions, device)
