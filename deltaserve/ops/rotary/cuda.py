"""Triton q/k norm + partial RoPE in one launch: grid (tokens, n_heads + n_kv), one head row per program.

Each program normalises its row in float32 (rounded to the activation dtype, like the reference), then rotates
the first `rotary_dim` dims against their rotate-half partners, which it reloads rather than shuffles.
`qk_norm_rope_write_kv` fuses the paged KV-cache write into the same launch (at batch 1 a launch costs as much
as the work): each k program also stores its rotated row, and v's row of its kv head, at the token's slot,
computed exactly as `deltaserve.ops.attention.cuda.write_kv_cache` does (x / scale in float32, clamped for
float8_e4m3fn), so the cache holds the same bits as the two ops run one after the other.
"""

import torch
import triton
import triton.language as tl

from deltaserve.ops import pdl
from deltaserve.ops.attention.cuda import (
    QUERY_DTYPES,
    _check_cache,
    _check_devices,
    _check_dtype,
    _check_scale,
    _unit_last_stride,
)
from deltaserve.ops.attention.reference import check_slot_mapping
from deltaserve.ops.pdl import wait_for_previous_kernel
from deltaserve.ops.rotary.reference import check_shapes


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, q_out, k_out,
                         q_tok_stride, q_head_stride, k_tok_stride, k_head_stride, n_heads, n_kv, eps,
                         HEAD_DIM: tl.constexpr, ROT: tl.constexpr,
                         # the cache write, only with WRITE_KV: k_out's and v's rows to k_cache / v_cache
                         v_ptr=None, k_cache=None, v_cache=None, slot_mapping=None, k_scale=1.0, v_scale=1.0,
                         v_tok_stride=0, v_head_stride=0, block_stride=0, slot_stride=0, cache_head_stride=0,
                         BLOCK_SIZE: tl.constexpr = 1, SATURATE: tl.constexpr = 0.0,
                         WRITE_KV: tl.constexpr = False, PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
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
    out = tl.where(cols < ROT, rotated, y).to(dst.dtype.element_ty)  # [HEAD_DIM]
    tl.store(dst + cols, out)
    if WRITE_KV:
        if h >= n_heads:
            slot = tl.load(slot_mapping + t).to(tl.int64)
            if slot >= 0:  # negative slots are padding rows
                kv_head = h - n_heads
                dest = (slot // BLOCK_SIZE) * block_stride + (slot % BLOCK_SIZE) * slot_stride
                dest = dest + kv_head * cache_head_stride + cols  # [HEAD_DIM]
                k_row = out.to(tl.float32) / k_scale
                v_row = tl.load(v_ptr + t * v_tok_stride + kv_head * v_head_stride + cols).to(tl.float32) / v_scale
                if SATURATE > 0:
                    # float8_e4m3fn has no infinity: out-of-range values would become NaN. Clamp to the largest finite.
                    k_row = tl.clamp(k_row, -SATURATE, SATURATE)
                    v_row = tl.clamp(v_row, -SATURATE, SATURATE)
                tl.store(k_cache + dest, k_row.to(k_cache.dtype.element_ty))
                tl.store(v_cache + dest, v_row.to(v_cache.dtype.element_ty))


def qk_norm_rope(q, k, q_weight, k_weight, eps, cos_cache, sin_cache, positions, rotary_dim):
    """See reference.qk_norm_rope; head_dim must be a power of two."""
    q, k = _check_norm_rope(q, k, q_weight, k_weight, cos_cache, sin_cache, positions, rotary_dim)
    T, n_heads, head_dim = q.shape
    n_kv = k.shape[1]
    q_out = torch.empty(T, n_heads, head_dim, dtype=q.dtype, device=q.device)
    k_out = torch.empty(T, n_kv, head_dim, dtype=k.dtype, device=k.device)
    if T == 0:
        return q_out, k_out
    _qk_norm_rope_kernel[(T, n_heads + n_kv)](
        q, k, q_weight, k_weight, cos_cache, sin_cache, positions, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), n_heads, n_kv, eps,
        HEAD_DIM=head_dim, ROT=rotary_dim, num_warps=_num_warps(head_dim), **pdl.launch_args(q.device))
    return q_out, k_out


def qk_norm_rope_write_kv(q, k, v, q_weight, k_weight, eps, cos_cache, sin_cache, positions, rotary_dim,
                          k_cache, v_cache, slot_mapping, *, k_scale: float = 1.0, v_scale: float = 1.0):
    """See reference.qk_norm_rope_write_kv; one launch. v: [T, n_kv, hd], any strides; the caches as
    `deltaserve.ops.attention.cuda.write_kv_cache` takes them. slot_mapping values are trusted (reading them
    back would sync the host): the reference checks their range."""
    q, k = _check_norm_rope(q, k, q_weight, k_weight, cos_cache, sin_cache, positions, rotary_dim)
    T, n_heads, head_dim = q.shape
    n_kv = k.shape[1]
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    _check_dtype("v", v, QUERY_DTYPES)
    _check_cache(k_cache, v_cache, n_kv, head_dim)
    check_slot_mapping(slot_mapping, T)
    _check_scale("k_scale", k_scale)
    _check_scale("v_scale", v_scale)
    _check_devices(q=q, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    q_out = torch.empty(T, n_heads, head_dim, dtype=q.dtype, device=q.device)
    k_out = torch.empty(T, n_kv, head_dim, dtype=k.dtype, device=k.device)
    if T == 0:
        return q_out, k_out
    v = _unit_last_stride(v)
    saturate = torch.finfo(k_cache.dtype).max if k_cache.dtype == torch.float8_e4m3fn else 0.0
    _qk_norm_rope_kernel[(T, n_heads + n_kv)](
        q, k, q_weight, k_weight, cos_cache, sin_cache, positions, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), n_heads, n_kv, eps,
        HEAD_DIM=head_dim, ROT=rotary_dim,
        v_ptr=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping, k_scale=k_scale, v_scale=v_scale,
        v_tok_stride=v.stride(0), v_head_stride=v.stride(1), block_stride=k_cache.stride(0),
        slot_stride=k_cache.stride(1), cache_head_stride=k_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], SATURATE=saturate, WRITE_KV=True, num_warps=_num_warps(head_dim),
        **pdl.launch_args(q.device))
    return q_out, k_out


def _check_norm_rope(q, k, q_weight, k_weight, cos_cache, sin_cache, positions, rotary_dim):
    """`reference.check_shapes` plus what the kernel assumes; returns q and k with unit stride in hd."""
    check_shapes(q, k, q_weight, k_weight, cos_cache, sin_cache, positions, rotary_dim)
    head_dim = q.shape[2]
    if head_dim & (head_dim - 1):
        raise ValueError(f"q and k need a power-of-two head_dim for the Triton kernel, got {head_dim}")
    _check_dtype("q", q, QUERY_DTYPES)
    if k.dtype != q.dtype:
        raise ValueError(f"k must have q's dtype {q.dtype}, got {k.dtype}")
    for name, table in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        if not table.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {table.stride()}")
    _check_devices(q=q, k=k, q_weight=q_weight, k_weight=k_weight, cos_cache=cos_cache, sin_cache=sin_cache,
                   positions=positions)
    return _unit_last_stride(q), _unit_last_stride(k)


def _num_warps(head_dim: int) -> int:
    return 4 if head_dim >= 128 else 1
