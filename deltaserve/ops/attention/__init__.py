"""Paged KV-cache attention ops (cache write, causal attention over block tables).

On CUDA tensors they run the Triton kernels (`deltaserve.ops.attention.cuda`, imported only then); elsewhere
the plain-torch reference, which is the oracle.
"""

from deltaserve.ops.attention import reference

__all__ = ["attention_output_gate", "chunk_over_prefix_attention", "fresh_causal_attention", "paged_attention",
           "write_kv_cache"]


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, *, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """See `reference.write_kv_cache` for shapes; the cache stores K / k_scale and V / v_scale."""
    if k.is_cuda:
        from deltaserve.ops.attention.cuda import write_kv_cache as cuda_write
        return cuda_write(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    return reference.write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale: float, max_query_len=None,
                    *, k_scale: float = 1.0, v_scale: float = 1.0, gate=None, quant_block: int = 0,
                    dp4a: tuple[int, bool] | None = None):
    """See `reference.paged_attention` for shapes. `max_query_len` (an int, optional) lets the GPU kernel size
    its grid without reading cu_seqlens back to the CPU; 1 selects the decode kernel. The cache holds
    K / k_scale and V / v_scale. gate ([T, n_heads, hd] in q.dtype, optional): returns o * sigmoid(gate),
    fused into the kernels' final store on the GPU. quant_block / dp4a: what the output projection's product
    reads, which the GPU's decode kernels may write instead of o or besides it (then returned: see
    `cuda.paged_attention`)."""
    if q.is_cuda:
        from deltaserve.ops.attention.cuda import paged_attention as cuda_attention
        return cuda_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, max_query_len,
                              k_scale=k_scale, v_scale=v_scale, gate=gate, quant_block=quant_block, dp4a=dp4a)
    return reference.paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                                     k_scale=k_scale, v_scale=v_scale, gate=gate)


def attention_output_gate(o, gate, out=None):
    """o * sigmoid(gate) in gate's dtype, as torch computes `o.to(gate.dtype) * torch.sigmoid(gate)`; see
    `reference.attention_output_gate` for shapes. One Triton launch on the GPU."""
    if o.is_cuda:
        from deltaserve.ops.attention.cuda import attention_output_gate as cuda_gate
        return cuda_gate(o, gate, out=out)
    return reference.attention_output_gate(o, gate, out=out)


def fresh_causal_attention(q, k, v, cu_seqlens_cpu, scale: float, gate=None, v_scale: float = 1.0):
    """GPU only: causal attention of prompts that all start at position 0, on their new K/V (see
    `cuda_sdpa.fresh_causal_attention`); the paged path computes the same (the reference is `paged_attention`).
    gate: as in `paged_attention`; v_scale multiplies the output (K/V read from an fp8 cache)."""
    from deltaserve.ops.attention.cuda_sdpa import fresh_causal_attention as cuda_fresh
    return cuda_fresh(q, k, v, cu_seqlens_cpu, scale, gate=gate, v_scale=v_scale)


def chunk_over_prefix_attention(q, k, v, k_cache, v_cache, block_table_row, prefix_len: int, scale: float,
                                gate=None, v_scale: float = 1.0):
    """GPU only: one sequence's chunk after prefix_len cached tokens through cuDNN (see
    `cuda_sdpa.chunk_over_prefix_attention`), or None where that is unavailable (use `paged_attention`).
    gate: as in `paged_attention`; an fp8 cache: scale holds k_scale, v_scale multiplies the output."""
    from deltaserve.ops.attention.cuda_sdpa import chunk_over_prefix_attention as cuda_chunk
    return cuda_chunk(q, k, v, k_cache, v_cache, block_table_row, prefix_len, scale, gate=gate, v_scale=v_scale)
