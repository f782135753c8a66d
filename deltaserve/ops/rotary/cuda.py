"""Triton q/k norm + partial RoPE in one launch: grid (tokens, n_heads + n_kv), one head row per program.

Each program normalises its row in float32 (rounded to the activation dtype, like the reference), then rotates
the first `rotary_dim` dims against their rotate-half partners, which it reloads rather than shuffles.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, q_out, k_out,
                         q_tok_stride, q_head_stride, k_tok_stride, k_head_stride, n_heads, n_kv, eps,
                         HEAD_DIM: tl.constexpr, ROT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cols = tl.arange(0, HEAD_DIM)
    half = ROT // 2
    partner = tl.where(cols < half, cols + half, cols - half)
    if h < n_heads:
        src = q_ptr + t * q_tok_stride + h * q_head_stride
        dst = q_out + (t * n_heads + h) * HEAD_DIM
        w_ptr = qw_ptr
    else:
        src = k_ptr + t * k_tok_stride + (h - n_heads) * k_head_stride
        dst = k_out + (t * n_kv + (h - n_heads)) * HEAD_DIM
        w_ptr = kw_ptr
    x = tl.load(src + cols).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / HEAD_DIM + eps)
    y = (x * rstd * (1.0 + tl.load(w_ptr + cols).to(tl.float32))).to(dst.dtype.element_ty).to(tl.float32)
    xp = tl.load(src + partner, mask=cols < ROT, other=0.0).to(tl.float32)
    yp = (xp * rstd * (1.0 + tl.load(w_ptr + partner, mask=cols < ROT, other=0.0).to(tl.float32)))
    yp = yp.to(dst.dtype.element_ty).to(tl.float32)
    pos = tl.load(pos_ptr + t)
    freq = tl.where(cols < half, cols, cols - half)
    cos = tl.load(cos_ptr + pos * half + freq, mask=cols < ROT, other=1.0).to(dst.dtype.element_ty).to(tl.float32)
    sin = tl.load(sin_ptr + pos * half + freq, mask=cols < ROT, other=0.0).to(dst.dtype.element_ty).to(tl.float32)
    rotated = tl.where(cols < half, y * cos - yp * sin, y * cos + yp * sin)
    out = tl.where(cols < ROT, rotated, y)
    tl.store(dst + cols, out.to(dst.dtype.element_ty))


def qk_norm_rope(q, k, q_weight, k_weight, eps, cos_cache, sin_cache, positions, rotary_dim):
    """See reference.qk_norm_rope. q/k rows need a unit last stride; head_dim a power of two."""
    T, n_heads, head_dim = q.shape
    n_kv = k.shape[1]
    q_out = torch.empty(T, n_heads, head_dim, dtype=q.dtype, device=q.device)
    k_out = torch.empty(T, n_kv, head_dim, dtype=k.dtype, device=k.device)
    if T == 0:
        return q_out, k_out
    _qk_norm_rope_kernel[(T, n_heads + n_kv)](
        q, k, q_weight, k_weight, cos_cache, sin_cache, positions, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), n_heads, n_kv, eps,
        HEAD_DIM=head_dim, ROT=rotary_dim, num_warps=4 if head_dim >= 128 else 1)
    return q_out, k_out
