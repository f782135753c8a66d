"""Partial rotary position embedding (NeoX / rotate-half style on the first `rotary_dim` dims of each head).

Qwen3.5's text RoPE is interleaved M-RoPE; for text-only input all three position rows are equal, so it
reduces exactly to plain 1-D RoPE, which is what this module computes.
"""

import torch
from torch import nn


class PartialRotary(nn.Module):
    """cos/sin cache over positions; `forward` rotates q and k in their first `rotary_dim` dims."""

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

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions: [T] int64; q: [T, n_heads, head_dim]; k: [T, n_kv, head_dim]. Returns rotated (q, k)."""
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, rotary_dim / 2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin, self.rotary_dim), _rotate(k, cos, sin, self.rotary_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    half = rotary_dim // 2
    # transformers casts cos/sin to the activation dtype before multiplying; do the same for exact parity
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)
