"""Plain-torch q/k norm + partial rotary embedding (the oracle for cuda.py).

Per head: zero-centred RMSNorm over head_dim (see ops/norm), then NeoX-style (rotate-half) RoPE on the first
`rotary_dim` dims; the rest pass through. cos/sin are cast to the activation dtype before use, as
transformers does.
"""

import torch

from deltaserve.ops.norm.reference import rms_norm


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """x: [T, heads, hd]; cos, sin: [T, 1, rotary_dim / 2] (float32). Returns the rotated x."""
    half = rotary_dim // 2
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


def qk_norm_rope(q, k, q_weight, k_weight, eps: float, cos_cache, sin_cache, positions, rotary_dim: int):
    """q: [T, n_heads, hd], k: [T, n_kv, hd] (may be strided views); q_weight, k_weight: [hd];
    cos_cache, sin_cache: [max_positions, rotary_dim / 2] float32; positions: [T] int64.
    Returns (q, k) normalised and rotated, contiguous, in the input dtype."""
    cos = cos_cache[positions].unsqueeze(1)  # [T, 1, rotary_dim / 2]
    sin = sin_cache[positions].unsqueeze(1)
    q = rotate(rms_norm(q, q_weight, eps), cos, sin, rotary_dim)
    k = rotate(rms_norm(k, k_weight, eps), cos, sin, rotary_dim)
    return q, k
