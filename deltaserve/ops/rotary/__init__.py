"""q/k RMSNorm + partial RoPE for the gated attention layer.

On CUDA tensors (with a power-of-two head_dim) one Triton launch (`cuda.py`, imported only then) does both
for every head; elsewhere the plain-torch reference.
"""

from deltaserve.ops.rotary import reference

__all__ = ["qk_norm_rope"]


def qk_norm_rope(q, k, q_weight, k_weight, eps: float, cos_cache, sin_cache, positions, rotary_dim: int):
    """See `reference.qk_norm_rope` for shapes."""
    head_dim = q.shape[-1]
    if q.is_cuda and head_dim & (head_dim - 1) == 0:
        from deltaserve.ops.rotary import cuda
        return cuda.qk_norm_rope(q, k, q_weight, k_weight, eps, cos_cache, sin_cache, positions, rotary_dim)
    return reference.qk_norm_rope(q, k, q_weight, k_weight, eps, cos_cache, sin_cache, positions, rotary_dim)
