"""Causal depthwise conv1d ops over the GDN conv-state pool (prefill over varlen sequences, decode update).

`conv_prefill` / `conv_decode` read each sequence's last W-1 inputs from its slot of the pool and write the new
ones back in place. On CUDA tensors they run the Triton kernels (`deltaserve.ops.conv1d.cuda`, imported only
then); elsewhere the plain-torch reference.
"""

from deltaserve.ops.conv1d.reference import causal_conv1d, causal_conv1d_update, check_split

__all__ = ["causal_conv1d", "causal_conv1d_update", "conv_prefill", "conv_decode"]


def conv_prefill(x, weight, state_pool, state_slots, has_initial_state, cu_seqlens, activation="silu",
                 split=None):
    """x: [T, D]; weight: [D, W]; state_pool: [S, D, W-1], updated in place at `state_slots` [N];
    has_initial_state: [N] bool; cu_seqlens: [N+1]. Returns y: [T, D] in x.dtype, or with `split` (up to three
    channel counts summing to D, e.g. the q, k, v widths) one contiguous [T, d] tensor per count."""
    if x.is_cuda:
        from deltaserve.ops.conv1d.cuda import conv_prefill as cuda_prefill
        return cuda_prefill(x, weight, state_pool, state_slots, has_initial_state, cu_seqlens, activation, split)
    segments = None if split is None else check_split(split, x.shape[1])
    initial = state_pool[state_slots]  # [N, D, W-1]
    initial = initial.masked_fill(~has_initial_state[:, None, None], 0)
    y, final = causal_conv1d(x, weight, initial, cu_seqlens, activation)
    state_pool[state_slots] = final.to(state_pool.dtype)
    return y if segments is None else tuple(part.contiguous() for part in y.split(segments, dim=-1))


def conv_decode(x, weight, state_pool, state_slots, activation="silu"):
    """x: [N, D] one token per sequence; state_pool: [S, D, W-1], updated in place at `state_slots` [N].
    Returns y: [N, D]."""
    if x.is_cuda:
        from deltaserve.ops.conv1d.cuda import conv_decode as cuda_decode
        return cuda_decode(x, weight, state_pool, state_slots, activation)
    state = state_pool[state_slots]  # a gathered copy, shifted in place by the update
    y = causal_conv1d_update(x, state, weight, activation)
    state_pool[state_slots] = state
    return y
