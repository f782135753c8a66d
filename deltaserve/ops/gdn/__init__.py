"""Gated delta rule ops over the GDN state pool (prefill: chunked over varlen prompts, decode: one step).

The layer-facing entry points `gdn_prefill` / `gdn_decode` read each sequence's recurrent state from its slot
of the pool and write the new state back in place. On CUDA tensors they run the GPU kernels
(`deltaserve.ops.gdn.cuda`, imported only then); elsewhere the plain-torch reference, which is the oracle.
"""

import torch
import torch.nn.functional as F

from deltaserve.ops.gdn.reference import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "gdn_gates", "gdn_prefill", "gdn_decode"]


def gdn_gates(a, b, A_log, dt_bias):
    """a, b: [T, HV] raw projections; A_log, dt_bias: [HV]. Returns (g [T, HV] float32 log decay, beta [T, HV]):
    g = -exp(A_log) * softplus(a + dt_bias) <= 0 in float32, beta = sigmoid(b) in b's dtype."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b)


def gdn_prefill(q, k, v, g, beta, state_pool, state_slots, has_initial_state, cu_seqlens, cu_seqlens_cpu=None,
                max_query_len: int | None = None, *, A_log=None, dt_bias=None, chunk_indices=None):
    """Prefill. q, k: [T, HK, K]; v: [T, HV, V]; g: [T, HV] float32 (log decay); beta: [T, HV];
    state_pool: [S, HV, K, V] (float32 or bf16), updated in place at `state_slots` [N] int64;
    has_initial_state: [N] bool (False: the sequence starts from zero state); cu_seqlens: [N+1] int64 (and
    optionally the same on the CPU, which spares the GPU kernels a device sync). max_query_len: the most
    tokens of any sequence, if known: the GPU path runs short chunks through a recurrent kernel (the
    reference ignores it). With A_log and dt_bias ([HV]), g and beta are the raw projections a and b (see
    `gdn_gates`). chunk_indices: fla's chunk index of cu_seqlens on the device, where the caller keeps one (a
    CUDA graph's); else the GPU path builds it once a step. Returns o: [T, HV, V] in v.dtype."""
    if q.is_cuda:
        from deltaserve.ops.gdn.cuda import gdn_prefill as cuda_prefill
        return cuda_prefill(q, k, v, g, beta, state_pool, state_slots, has_initial_state, cu_seqlens,
                            cu_seqlens_cpu, max_query_len, A_log=A_log, dt_bias=dt_bias, chunk_indices=chunk_indices)
    if A_log is not None:
        g, beta = gdn_gates(g, beta, A_log, dt_bias)
    initial = state_pool[state_slots].float()  # [N, HV, K, V]
    initial.masked_fill_(~has_initial_state[:, None, None, None], 0.0)
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, initial, cu_seqlens)
    state_pool[state_slots] = final.to(state_pool.dtype)
    return o


def gdn_decode(q, k, v, a, b, A_log, dt_bias, state_pool, state_slots):
    """Decode, one token per sequence. q, k: [N, HK, K]; v: [N, HV, V]; a, b: [N, HV] raw gate projections
    (see `gdn_gates`); A_log, dt_bias: [HV]; state_pool: [S, HV, K, V], updated in place at `state_slots` [N].
    Returns o: [N, HV, V]."""
    if q.is_cuda:  # the kernel computes the gates itself
        from deltaserve.ops.gdn.cuda import gdn_decode as cuda_decode
        return cuda_decode(q, k, v, a, b, state_pool, state_slots, A_log=A_log, dt_bias=dt_bias)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    o, final = fused_recurrent_gated_delta_rule(q, k, v, g, beta, state_pool[state_slots].float())
    state_pool[state_slots] = final.to(state_pool.dtype)
    return o
