"""Triton paged-attention ops: the GPU path of `deltaserve.ops.attention` (same contract as `reference.py`).

    write_kv_cache    one program per token scatters its K/V rows into the cache, cast to the cache dtype
    paged_attention   max_query_len == 1: flash-decoding with split KV (`cuda_decode.py`);
                      otherwise: flash-attention forward over varlen queries (`cuda_prefill.py`), split
                      over KV too when its grid is small and the block table wide (short chunks over
                      long cached prefixes)
    attention_output_gate   one program per token: o * sigmoid(gate), the gated layer's output
The cuDNN paths for long chunks (fresh prompts; one chunk after its cached prefix) are in `cuda_sdpa.py`.

Gated attention: `gate=` makes each path return o * sigmoid(gate) rounded as torch computes
`o * torch.sigmoid(gate)` in the activation dtype: the paged kernels apply it in their final store.

Caches may be bf16, float16, float32 or float8_e4m3fn; queries bf16, float16 or float32. An fp8 cache stores
x / scale per tensor (`k_scale`, `v_scale`, Python floats); the kernels multiply the scale back in (K's into
the softmax scale, V's into the output), so any cache dtype accepts them. Scores and softmax are float32.

Only shapes are checked here: reading seq_lens, cu_seqlens_q, slot_mapping or block_tables back to validate
them would sync the host and break CUDA-graph capture. Their values are trusted (out-of-range block ids or
slots corrupt memory); the reference raises on them, so test new callers on the CPU first.
"""

import math

import torch
import triton
import triton.language as tl

from deltaserve.ops.attention.cuda_decode import launch_decode
from deltaserve.ops.attention.cuda_prefill import launch_prefill, output_gate
from deltaserve.ops.attention.reference import _check_shapes, check_gate, check_slot_mapping

__all__ = ["attention_output_gate", "paged_attention", "write_kv_cache"]

QUERY_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
_TRITON_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
WRITE_NUM_WARPS = 4
GATE_NUM_WARPS = 8


@triton.jit
def _write_kv_kernel(
    k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, stride_block, stride_slot, stride_kv_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, SATURATE: tl.constexpr,
):
    """Grid (T,). Token t's [n_kv, hd] K and V rows go to slot_mapping[t]; negative slots are padding."""
    token = tl.program_id(0).to(tl.int64)  # token * stride may pass 2^31 in large batches
    slot = tl.load(slot_mapping + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    dest = (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_slot
    dest = dest + heads[:, None] * stride_kv_head + dims[None, :]  # [HP, D]
    k_row = tl.load(k + token * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :], mask=mask)
    v_row = tl.load(v + token * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :], mask=mask)
    k_row = k_row.to(tl.float32) / k_scale
    v_row = v_row.to(tl.float32) / v_scale
    if SATURATE > 0:
        # float8_e4m3fn has no infinity: out-of-range values would become NaN. Clamp to the largest finite.
        k_row = tl.clamp(k_row, -SATURATE, SATURATE)
        v_row = tl.clamp(v_row, -SATURATE, SATURATE)
    tl.store(k_cache + dest, k_row.to(k_cache.dtype.element_ty), mask=mask)
    tl.store(v_cache + dest, v_row.to(v_cache.dtype.element_ty), mask=mask)


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, *, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Scatter new keys/values into the paged cache in place, storing x / scale cast to the cache dtype.

    Args:
        k, v: [T, n_kv, hd], bf16 / float16 / float32.
        k_cache, v_cache: [num_blocks, block_size, n_kv, hd], same dtype and strides, unit stride in hd.
        slot_mapping: [T] integer, slot = block_id * block_size + offset; slot < 0 rows are skipped.
        k_scale, v_scale: per-tensor scales (for fp8 caches); an fp8 store saturates at +-448.
    """
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"k and v must both be [T, n_kv, hd], got {tuple(k.shape)} and {tuple(v.shape)}")
    _check_dtype("k", k, QUERY_DTYPES)
    _check_dtype("v", v, QUERY_DTYPES)
    _check_cache(k_cache, v_cache, k.shape[1], k.shape[2])
    check_slot_mapping(slot_mapping, k.shape[0])
    _check_scale("k_scale", k_scale)
    _check_scale("v_scale", v_scale)
    _check_devices(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = _unit_last_stride(k), _unit_last_stride(v)
    saturate = torch.finfo(k_cache.dtype).max if k_cache.dtype == torch.float8_e4m3fn else 0.0
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1], SATURATE=saturate,
        num_warps=WRITE_NUM_WARPS,
    )


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale: float,
                    max_query_len: int | None = None, *, k_scale: float = 1.0, v_scale: float = 1.0,
                    num_splits: int | None = None, gate=None, quant_block: int = 0,
                    dp4a: tuple[int, bool] | None = None):
    """Causal attention of varlen queries over the paged cache; shapes and semantics as `reference.paged_attention`.

    max_query_len: the longest query of the batch, if known. 1 runs the split-KV decode kernel (every
        sequence must then have at most one query token); None or more runs the prefill kernel, which also
        serves decode rows and needs no host sync either.
    k_scale, v_scale: the cache holds K / k_scale and V / v_scale (fp8).
    num_splits: programs sharing each query block's KV positions; None picks it from the grid size and
        block_tables width (graph-safe); 1 never splits.
    gate: None, or [T, n_heads, hd] in q.dtype with any strides: returns o * sigmoid(gate), applied in the
        kernels' final store (no extra launch).
    quant_block, dp4a: what the output projection's product reads (FP8's scale block; an int4 / NVFP4 one-row
        GEMV's fixed-point parts), written by the decode kernels' merge where it runs (`launch_decode`).

    Returns o: [T, n_heads, hd] in q.dtype, or where the decode merge wrote the product's input, that (an
    Fp8Activation or Dp4aActivation of o as [T, n_heads * hd]).
    """
    num_tokens, _, _ = _check_shapes(q, k_cache, v_cache, block_tables, seq_lens)
    _check_dtype("q", q, QUERY_DTYPES)
    _check_cache(k_cache, v_cache, k_cache.shape[2], q.shape[2])
    num_seqs = block_tables.shape[0]
    if tuple(cu_seqlens_q.shape) != (num_seqs + 1,) or cu_seqlens_q.is_floating_point():
        raise ValueError(
            f"cu_seqlens_q must be an integer [N+1={num_seqs + 1}] tensor, got dtype {cu_seqlens_q.dtype} "
            f"shape {tuple(cu_seqlens_q.shape)}"
        )
    if max_query_len is not None and (not isinstance(max_query_len, int) or max_query_len < 0):
        raise ValueError(f"max_query_len must be a non-negative int or None, got {max_query_len!r}")
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    _check_scale("k_scale", k_scale)
    _check_scale("v_scale", v_scale)
    _check_devices(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, cu_seqlens_q=cu_seqlens_q,
                   seq_lens=seq_lens)
    check_gate(gate, q)

    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    q, block_tables = _unit_last_stride(q), _unit_last_stride(block_tables)
    gate = None if gate is None else _unit_last_stride(gate)
    # The dots run in q's dtype when the cache holds the same dtype or fp8 (exactly representable in bf16 and
    # float16); a float32 operand keeps them in float32 ("ieee": no TF32 rounding) so nothing is rounded.
    if k_cache.dtype in (q.dtype, torch.float8_e4m3fn):
        dot_dtype = q.dtype
    else:
        dot_dtype = torch.float32
    if k_cache.dtype == torch.float8_e4m3fn and q.dtype == torch.bfloat16 and max_query_len == 1:
        # Decode over fp8 KV dots in float16: e4m3 -> f16 is one instruction, -> bf16 several, and the upcast
        # bounds this kernel, not memory (docs/performance.md, 'Decode attention'). q rounds to float16 (more
        # mantissa than bf16), saturated at +-65504 in the kernel.
        dot_dtype = torch.float16
    precision = "ieee" if dot_dtype == torch.float32 else "tf32"
    qk_scale = scale * k_scale * math.log2(math.e)  # the kernels exponentiate with exp2
    args = (q, k_cache, v_cache, out, block_tables, cu_seqlens_q, seq_lens, qk_scale, v_scale,
            _TRITON_DTYPES[dot_dtype], precision)
    if max_query_len == 1:
        return launch_decode(*args, num_splits=num_splits, gate=gate, quant_block=quant_block, dp4a=dp4a)
    launch_prefill(*args, num_splits=num_splits, gate=gate)
    return out


@triton.jit
def _output_gate_kernel(
    o, gate, out, stride_o_tok, stride_o_head, stride_g_tok, stride_g_head, stride_out_tok, stride_out_head,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    """Grid (T,). out[t] = o[t] * sigmoid(gate[t]) over [n_heads, hd], rounded as `output_gate` says."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)[:, None]  # [HP, 1]
    dims = tl.arange(0, HEAD_DIM_PAD)[None, :]  # [1, D]
    mask = (heads < NUM_HEADS) & (dims < HEAD_DIM)  # [HP, D]
    o_tile = tl.load(o + token * stride_o_tok + heads * stride_o_head + dims, mask=mask).to(tl.float32)
    gated = output_gate(o_tile, gate + token * stride_g_tok + heads * stride_g_head + dims, mask,
                        out.dtype.element_ty)
    tl.store(out + token * stride_out_tok + heads * stride_out_head + dims, gated, mask=mask)


def attention_output_gate(o, gate, out=None):
    """o * sigmoid(gate) in one launch, as torch computes `o.to(gate.dtype) * torch.sigmoid(gate)`: o rounded
    to gate's dtype, sigmoid(float32 gate) rounded to it, their float32 product rounded to it.

    o: [T, n_heads, hd], any float dtype (float32 folds in the cast to gate's dtype); gate: [T, n_heads, hd]
    bf16 / float16 / float32; out: None (a new tensor) or [T, n_heads, hd] in gate's dtype with unit stride
    in hd, which may be o. o and gate may have any strides. Returns out.
    """
    check_gate(gate, o, same_dtype=False)
    _check_dtype("gate", gate, QUERY_DTYPES)
    if out is None:
        out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    check_gate(out, gate, name="out")
    if out.stride(-1) != 1:
        raise ValueError(f"out must have unit stride in hd, got strides {out.stride()}")
    num_tokens, num_heads, head_dim = gate.shape
    if num_tokens == 0:
        return out
    o, gate = _unit_last_stride(o), _unit_last_stride(gate)
    _output_gate_kernel[(num_tokens,)](
        o, gate, out, o.stride(0), o.stride(1), gate.stride(0), gate.stride(1), out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEADS_PAD=triton.next_power_of_2(num_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim), num_warps=GATE_NUM_WARPS,
    )
    return out


def _check_dtype(name, tensor, allowed) -> None:
    if tensor.dtype not in allowed:
        raise ValueError(f"{name} has dtype {tensor.dtype}; supported: {', '.join(map(str, allowed))}")


def _check_cache(k_cache, v_cache, num_kv_heads, head_dim) -> None:
    """Both caches [num_blocks, block_size, n_kv, hd] of one supported dtype, equal strides, unit stride in hd."""
    expected = f"[num_blocks, block_size, n_kv={num_kv_heads}, hd={head_dim}]"
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"k_cache and v_cache must both be {expected}, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    _check_dtype("k_cache", k_cache, CACHE_DTYPES)
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache and v_cache must share a dtype, got {k_cache.dtype} and {v_cache.dtype}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError(f"k_cache and v_cache must have equal strides with unit stride in hd, got "
                         f"{k_cache.stride()} and {v_cache.stride()}")


def _check_scale(name, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite float, got {value!r}")


def _check_devices(**tensors) -> None:
    devices = {name: tensor.device for name, tensor in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def _unit_last_stride(tensor):
    """The kernels address the last dimension as contiguous; copy the rare tensor that is not."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()
