"""Plain-torch q/k norm + partial rotary embedding (the oracle for cuda.py).

Per head: zero-centred RMSNorm over head_dim (see ops/norm), then NeoX-style (rotate-half) RoPE on the first
`rotary_dim` dims; the rest pass through. cos/sin are cast to the activation dtype before use, as
transformers does. `qk_norm_rope_write_kv` also writes the rotated keys and the values into the paged KV cache,
exactly as `deltaserve.ops.attention.reference.write_kv_cache`.
"""

import torch

from deltaserve.ops.attention.reference import write_kv_cache
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
    check_shapes(q, k, q_weight, k_weight, cos_cache, sin_cache, positions, rotary_dim)
    cos = cos_cache[positions].unsqueeze(1)  # [T, 1, rotary_dim / 2]
    sin = sin_cache[positions].unsqueeze(1)
    q = rotate(rms_norm(q, q_weight, eps), cos, sin, rotary_dim)
    k = rotate(rms_norm(k, k_weight, eps), cos, sin, rotary_dim)
    return q, k


def qk_norm_rope_write_kv(q, k, v, q_weight, k_weight, eps: float, cos_cache, sin_cache, positions,
                          rotary_dim: int, k_cache, v_cache, slot_mapping, *, k_scale: float = 1.0,
                          v_scale: float = 1.0):
    """`qk_norm_rope`, then the rotated k and v: [T, n_kv, hd] written into k_cache, v_cache
    ([num_blocks, block_size, n_kv, hd]) at slot_mapping ([T] int64, negative: skipped) as K / k_scale and
    V / v_scale (see `write_kv_cache`). Returns (q, k) as `qk_norm_rope` does."""
    q, k = qk_norm_rope(q, k, q_weight, k_weight, eps, cos_cache, sin_cache, positions, rotary_dim)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    return q, k


def check_shapes(q, k, q_weight, k_weight, cos_cache, sin_cache, positions, rotary_dim: int) -> None:
    """Raise ValueError naming the first argument of `qk_norm_rope` that does not fit the others."""
    if q.dim() != 3:
        raise ValueError(f"q must be [T, n_heads, hd], got shape {tuple(q.shape)}")
    num_tokens, _, head_dim = q.shape
    if k.dim() != 3 or k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k must be [T={num_tokens}, n_kv, hd={head_dim}], got shape {tuple(k.shape)}")
    for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
        if tuple(weight.shape) != (head_dim,):
            raise ValueError(f"{name} must be [hd={head_dim}], got shape {tuple(weight.shape)}")
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or not (
            0 < rotary_dim <= head_dim and rotary_dim % 2 == 0):
        raise ValueError(f"rotary_dim must be an even int in [2, hd={head_dim}], got {rotary_dim!r}")
    if cos_cache.dim() != 2 or cos_cache.shape[1] != rotary_dim // 2:
        raise ValueError(f"cos_cache must be [max_positions, rotary_dim / 2 = {rotary_dim // 2}], "
                         f"got shape {tuple(cos_cache.shape)}")
    if sin_cache.shape != cos_cache.shape:
        raise ValueError(f"sin_cache must have cos_cache's shape {tuple(cos_cache.shape)}, "
                         f"got {tuple(sin_cache.shape)}")
    if tuple(positions.shape) != (num_tokens,) or positions.is_floating_point():
        raise ValueError(f"positions must be an integer [T={num_tokens}] tensor, got dtype {positions.dtype} "
                         f"shape {tuple(positions.shape)}")
