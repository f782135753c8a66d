"""Plain-torch paged attention: the CPU oracle behind which the GPU kernels drop in.

The KV cache of every attention layer is a pool of fixed-size blocks:

    k_cache, v_cache: [num_blocks, block_size, n_kv, hd]
    token p of sequence n lives in block block_tables[n, p // block_size] at offset p % block_size,
    i.e. at flat slot  block_id * block_size + offset  (the slot_mapping written by `write_kv_cache`).

`paged_attention` serves prefill with a cached prefix and decode alike: the new tokens' K/V are written first,
then each query attends causally to every KV position up to its own. Names follow nano-vllm / vLLM
(slot_mapping, block_tables, cu_seqlens_q, seq_lens). Gated attention multiplies the output by sigmoid(gate):
`paged_attention(gate=...)` and `attention_output_gate` define that in plain torch.

The cache may be bf16, fp16, fp32 or float8_e4m3fn. It stores K / k_scale and V / v_scale (per-tensor
scales, Python floats, 1.0 unless the checkpoint provides them) and attention reads back cache * scale,
upcast to float32: an fp8 cache is never dequantized into a full-size copy beyond the blocks being read.
"""

import math

import torch

from deltaserve.ops.varlen import sequence_bounds

_FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, *, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Scatter new keys/values into the paged cache, in place.

    Args:
        k, v: [T, n_kv, hd], any float dtype.
        k_cache, v_cache: [num_blocks, block_size, n_kv, hd]; written as k / k_scale, v / v_scale cast to their
            dtype (an fp8 store saturates at +-448).
        slot_mapping: [T] int64, slot = block_id * block_size + offset; rows with slot < 0 (padding) are skipped.
        k_scale, v_scale: positive per-tensor scales.
    """
    _check_scale("k_scale", k_scale)
    _check_scale("v_scale", v_scale)
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"k and v must both be [T, n_kv, hd], got {tuple(k.shape)} and {tuple(v.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or tuple(k_cache.shape[2:]) != tuple(k.shape[1:]):
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, n_kv={k.shape[1]}, hd={k.shape[2]}], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    check_slot_mapping(slot_mapping, k.shape[0])
    num_blocks, block_size = k_cache.shape[:2]
    valid = slot_mapping >= 0  # [T]
    slots = slot_mapping[valid].long()  # [T_valid]
    if slots.numel() and slots.max() >= num_blocks * block_size:
        raise ValueError(
            f"slot_mapping holds slot {slots.max().item()} but the cache has only {num_blocks * block_size} slots"
        )
    # Index by (block, offset) rather than a flat view so that non-contiguous caches are written too.
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = _quantize(k[valid], k_scale, k_cache.dtype)
    v_cache[blocks, offsets] = _quantize(v[valid], v_scale, v_cache.dtype)


def check_slot_mapping(slot_mapping, num_tokens: int) -> None:
    """ValueError unless slot_mapping is an integer [num_tokens] tensor (its values are not read back)."""
    if tuple(slot_mapping.shape) != (num_tokens,) or slot_mapping.is_floating_point():
        raise ValueError(f"slot_mapping must be an integer [T={num_tokens}] tensor, got dtype {slot_mapping.dtype} "
                         f"shape {tuple(slot_mapping.shape)}")


def _quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in `dtype`. float8_e4m3fn has no infinity and casts of out-of-range values are not
    saturating on every device, so fp8 stores are clamped to the largest finite value first."""
    x = x.float() / scale
    if dtype == torch.float8_e4m3fn:
        x = x.clamp(-_FP8_MAX, _FP8_MAX)
    return x.to(dtype)


def _check_scale(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale: float,
                    *, k_scale: float = 1.0, v_scale: float = 1.0, gate=None):
    """Causal attention of varlen queries over a paged KV cache (prefill with cached prefix, and decode).

    Args:
        q: [T, n_heads, hd], any float dtype; query head h uses kv head h // (n_heads // n_kv) (GQA).
        k_cache, v_cache: [num_blocks, block_size, n_kv, hd], already holding the new tokens' K/V (as K / k_scale
            and V / v_scale, see `write_kv_cache`).
        block_tables: [N, max_blocks] int32, each sequence's block ids in order (unused entries 0).
        cu_seqlens_q: [N+1] int64, cumulative query lengths, cu_seqlens_q[0] == 0, cu_seqlens_q[-1] == T.
        seq_lens: [N] int64, total KV length of each sequence including its new tokens.
        scale: multiplier of q.k (usually hd ** -0.5).
        k_scale, v_scale: the cache's per-tensor scales; keys and values are read back as cache * scale.
        gate: None, or [T, n_heads, hd] in q.dtype (any strides): the output is then o * torch.sigmoid(gate).

    Query i of sequence n (q_len = cu_seqlens_q[n+1] - cu_seqlens_q[n]) sits at position
    seq_lens[n] - q_len + i and attends to KV positions [0, that position]. Softmax in float32.

    Returns:
        o: [T, n_heads, hd] in q.dtype.
    """
    num_tokens, num_heads, head_dim = _check_shapes(q, k_cache, v_cache, block_tables, seq_lens)
    check_gate(gate, q)
    _check_scale("k_scale", k_scale)
    _check_scale("v_scale", v_scale)
    num_seqs = block_tables.shape[0]
    bounds = sequence_bounds(cu_seqlens_q, num_tokens, num_seqs, "cu_seqlens_q")
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    group = num_heads // num_kv_heads

    out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
    for seq, ((start, end), kv_len) in enumerate(zip(bounds, seq_lens.tolist())):
        q_len = end - start
        if q_len == 0:
            continue
        if q_len > kv_len:
            raise ValueError(f"sequence {seq} has q_len {q_len} > seq_lens[{seq}] = {kv_len}")
        blocks_used = -(-kv_len // block_size)
        if blocks_used > block_tables.shape[1]:
            raise ValueError(
                f"seq_lens[{seq}] = {kv_len} needs {blocks_used} blocks but block_tables has "
                f"{block_tables.shape[1]} columns"
            )
        block_ids = block_tables[seq, :blocks_used].long()  # [B_n]
        if block_ids.min() < 0 or block_ids.max() >= num_blocks:
            raise ValueError(f"block_tables[{seq}] holds block ids outside [0, {num_blocks}): {block_ids.tolist()}")
        # upcast only this sequence's blocks: [S, n_kv, hd] float32 each
        keys = k_cache[block_ids].reshape(-1, num_kv_heads, head_dim)[:kv_len].float() * k_scale
        values = v_cache[block_ids].reshape(-1, num_kv_heads, head_dim)[:kv_len].float() * v_scale
        queries = q[start:end].float().reshape(q_len, num_kv_heads, group, head_dim)  # [Q, n_kv, G, hd]

        scores = torch.einsum("qkgd,skd->kgqs", queries, keys) * scale  # [n_kv, G, Q, S]
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)  # [Q]
        visible = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]  # [Q, S]
        # Every row sees at least position 0, so no row is all -inf and softmax stays finite.
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)  # [n_kv, G, Q, S]
        attended = torch.einsum("kgqs,skd->qkgd", probs, values)  # [Q, n_kv, G, hd]
        out[start:end] = attended.reshape(q_len, num_heads, head_dim)
    if gate is None:
        return out.to(q.dtype)
    return out.to(q.dtype) * torch.sigmoid(gate)


def attention_output_gate(o, gate, out=None):
    """o * sigmoid(gate) as torch computes `o.to(gate.dtype) * torch.sigmoid(gate)`, the gated attention output.

    Args:
        o: [T, n_heads, hd], any float dtype (an attention output, maybe still float32).
        gate: [T, n_heads, hd], the activation dtype.
        out: None, or [T, n_heads, hd] in gate.dtype to write into (it may be o itself).

    Returns:
        out, or a new [T, n_heads, hd] tensor in gate.dtype.
    """
    check_gate(gate, o, same_dtype=False)
    if out is not None:
        check_gate(out, gate, name="out")
        return out.copy_(o.to(gate.dtype) * torch.sigmoid(gate))
    return o.to(gate.dtype) * torch.sigmoid(gate)


def check_gate(gate, like, name: str = "gate", same_dtype: bool = True) -> None:
    """Raise ValueError unless gate is None or matches `like` in shape, device and (same_dtype) dtype."""
    if gate is None:
        return
    if tuple(gate.shape) != tuple(like.shape) or gate.device != like.device:
        raise ValueError(f"{name} must be [T, n_heads, hd] = {tuple(like.shape)} on {like.device}, got "
                         f"{tuple(gate.shape)} on {gate.device}")
    if same_dtype and gate.dtype != like.dtype:
        raise ValueError(f"{name} must have dtype {like.dtype}, got {gate.dtype}")
    if not gate.is_floating_point():
        raise ValueError(f"{name} must be a float tensor, got dtype {gate.dtype}")


def _check_shapes(q, k_cache, v_cache, block_tables, seq_lens):
    """Raise ValueError naming the first inconsistent argument; return q's (T, n_heads, hd)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [T, n_heads, hd], got shape {tuple(q.shape)}")
    num_tokens, num_heads, head_dim = q.shape
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[3] != head_dim:
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, n_kv, hd={head_dim}], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if num_heads % k_cache.shape[2] != 0:
        raise ValueError(f"q heads ({num_heads}) must be a multiple of kv heads ({k_cache.shape[2]})")
    if block_tables.dim() != 2 or block_tables.is_floating_point():
        raise ValueError(
            f"block_tables must be an integer [N, max_blocks] tensor, got dtype {block_tables.dtype} "
            f"shape {tuple(block_tables.shape)}"
        )
    if tuple(seq_lens.shape) != (block_tables.shape[0],) or seq_lens.is_floating_point():
        raise ValueError(
            f"seq_lens must be an integer [N={block_tables.shape[0]}] tensor, got dtype {seq_lens.dtype} "
            f"shape {tuple(seq_lens.shape)}"
        )
    return num_tokens, num_heads, head_dim
