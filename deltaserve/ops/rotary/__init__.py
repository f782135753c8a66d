"""q/k RMSNorm + partial RoPE for the gated attention layer, optionally fused with the paged KV-cache write.

On CUDA tensors (with a power-of-two head_dim) one Triton launch (`cuda.py`, imported only then) does it all
for every head; elsewhere the plain-torch reference (and the KV-cache write of `deltaserve.ops.attention`).
"""

from deltaserve.ops.attention import write_kv_cache
from deltaserve.ops.rotary import reference

__all__ = ["qk_norm_rope", "qk_norm_rope_write_kv"]


def qk_norm_rope(q, k, q_weight, k_weight, eps: float, cos_cache, sin_cache, positions, rotary_dim: int):
    """See `reference.qk_norm_rope` for shapes."""
    if _kernel_serves(q):
        from deltaserve.ops.rotary import cuda
        return cuda.qk_norm_rope(q, k, q_weight, k_weight, eps, cos_cache, sin_cache, positions, rotary_dim)
    return reference.qk_norm_rope(q, k, q_weight, k_weight, eps, cos_cache, sin_cache, positions, rotary_dim)


def qk_norm_rope_write_kv(q, k, v, q_weight, k_weight, eps: float, cos_cache, sin_cache, positions,
                          rotary_dim: int, k_cache, v_cache, slot_mapping, *, k_scale: float = 1.0,
                          v_scale: float = 1.0):
    """`qk_norm_rope` followed by `write_kv_cache` of the rotated k and v (one launch on CUDA); returns (q, k).
    See `reference.qk_norm_rope_write_kv` for shapes."""
    if _kernel_serves(q):
        from deltaserve.ops.rotary import cuda
        return cuda.qk_norm_rope_write_kv(q, k, v, q_weight, k_weight, eps, cos_cache, sin_cache, positions,
                                          rotary_dim, k_cache, v_cache, slot_mapping, k_scale=k_scale,
                                          v_scale=v_scale)
    q, k = qk_norm_rope(q, k, q_weight, k_weight, eps, cos_cache, sin_cache, positions, rotary_dim)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    return q, k


def _kernel_serves(q) -> bool:
    """The Triton kernel takes CUDA tensors with a power-of-two head_dim."""
    return q.is_cuda and q.dim() == 3 and q.shape[2] & (q.shape[2] - 1) == 0
