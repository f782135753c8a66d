"""Plain-torch gated delta rule: the CPU oracle behind which the GPU kernels drop in.

Gated DeltaNet keeps, per value head, a state S of shape [K, V] ("K-first", the FLA / HF layout) and for each
token t computes

    S   = exp(g_t) * S                  # decay, g_t <= 0 in log space
    u   = beta_t * (v_t - S^T k_t)      # delta-rule correction against the *decayed* state
    S   = S + k_t u^T
    o_t = S^T q_t

after L2-normalising q and k (eps 1e-6, float32) and scaling q by K ** -0.5.

`fused_recurrent_gated_delta_rule` runs one such step per sequence (decode). `chunk_gated_delta_rule` computes
the same result chunk by chunk with the WY / UT-transform form of the delta rule (Yang et al., "Parallelizing
Linear Transformers with the Delta Rule over Sequence Length", 2024, and "Gated Delta Networks", 2025), so that
the work inside a chunk is matmuls and a triangular solve instead of a per-token loop.

Signatures mirror fla-core 0.6 `fla.ops.gated_delta_rule` in varlen form with the options Qwen uses fixed:
use_qk_l2norm_in_kernel=True, default scale, output_final_state=True, state layout [N, HV, K, V].
"""

import torch

from deltaserve.ops.varlen import sequence_bounds

# Added under the square root of the L2 norm, as in FLA's l2norm and HF's torch fallback.
_L2NORM_EPS = 1e-6


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size: int = 64):
    """Gated delta rule over varlen prompts (prefill), chunked.

    Args:
        q, k: [T, HK, K], any float dtype (tokens of N sequences concatenated).
        v: [T, HV, V], any float dtype; HV % HK == 0 and value head h reads key head h // (HV // HK).
        g: [T, HV], float (float32 recommended), log-space decay, <= 0.
        beta: [T, HV], float, post-sigmoid write strength.
        initial_state: [N, HV, K, V] float32, the state before each sequence (zeros for a fresh one).
        cu_seqlens: [N+1] int64, cumulative sequence lengths, cu_seqlens[0] == 0, cu_seqlens[-1] == T.
        chunk_size: tokens per chunk (a positive int; FLA uses 64).

    Returns:
        o: [T, HV, V] in v.dtype.
        final_state: [N, HV, K, V] float32, the state after each sequence's last token.
    """
    num_tokens, _, _ = check_shapes(q, k, v, g, beta, initial_state)
    bounds = sequence_bounds(cu_seqlens, num_tokens, initial_state.shape[0])
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")

    # Head-first float32 copies for batched matmuls over heads.
    q32, k32 = _normalize_qk(q, k, v.shape[1])
    q32, k32 = q32.transpose(0, 1), k32.transpose(0, 1)  # [HV, T, K]
    v32 = v.float().transpose(0, 1)  # [HV, T, V]
    g32 = g.float().transpose(0, 1)  # [HV, T]
    beta32 = beta.float().transpose(0, 1)  # [HV, T]

    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)  # [T, HV, V]
    final_state = torch.empty(initial_state.shape, dtype=torch.float32, device=initial_state.device)
    for seq, (start, end) in enumerate(bounds):
        state = initial_state[seq].float()  # [HV, K, V]
        for chunk_start in range(start, end, chunk_size):
            span = slice(chunk_start, min(chunk_start + chunk_size, end))
            chunk_out, state = _chunk_step(
                q32[:, span], k32[:, span], v32[:, span], g32[:, span], beta32[:, span], state
            )
            out[span] = chunk_out.transpose(0, 1)  # [C, HV, V]
        final_state[seq] = state
    return out.to(v.dtype), final_state


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state):
    """One gated-delta-rule step per sequence (decode).

    Args:
        q, k: [N, HK, K], any float dtype (one token of each of N sequences).
        v: [N, HV, V], any float dtype; HV % HK == 0 (GVA as in `chunk_gated_delta_rule`).
        g, beta: [N, HV], float: log-space decay (<= 0) and post-sigmoid write strength.
        initial_state: [N, HV, K, V] float32; not modified.

    Returns:
        o: [N, HV, V] in v.dtype.
        final_state: [N, HV, K, V] float32, a new tensor.
    """
    num_tokens, _, _ = check_shapes(q, k, v, g, beta, initial_state)
    if num_tokens != initial_state.shape[0]:
        raise ValueError(
            f"decode takes one token per sequence: q has {num_tokens} tokens but initial_state has "
            f"{initial_state.shape[0]} sequences"
        )
    q32, k32 = _normalize_qk(q, k, v.shape[1])  # [N, HV, K]
    decay = g.float().exp()[..., None, None]  # [N, HV, 1, 1]
    state = initial_state.float() * decay  # [N, HV, K, V]
    predicted = torch.einsum("nhkv,nhk->nhv", state, k32)  # [N, HV, V], what S already maps k to
    update = beta.float()[..., None] * (v.float() - predicted)  # [N, HV, V]
    state = state + k32[..., :, None] * update[..., None, :]  # rank-1 write k u^T
    out = torch.einsum("nhkv,nhk->nhv", state, q32)  # [N, HV, V]
    return out.to(v.dtype), state


def _chunk_step(q, k, v, g, beta, state):
    """Advance one chunk of C tokens of one sequence, all value heads at once.

    q, k: [HV, C, K] float32 (normalised, q scaled); v: [HV, C, V]; g, beta: [HV, C]; state: [HV, K, V].
    Returns (o [HV, C, V], state after the chunk [HV, K, V]).

    With G = cumsum(g) inside the chunk and S0 the incoming state, unrolling the recurrence gives
        S_i = exp(G_i) S0 + sum_{j <= i} exp(G_i - G_j) k_j u_j^T.
    Substituting into u_i = beta_i (v_i - exp(g_i) S_{i-1}^T k_i) gives a unit lower-triangular system
        (I + A) U = diag(beta) V - diag(beta * exp(G)) K S0,   A_ij = beta_i exp(G_i - G_j) k_i.k_j  (j < i).
    Solving it once for both right-hand sides (the UT transform) gives U = U_local - W S0, then
        O    = diag(exp(G)) Q S0 + (Q K^T * exp(G_i - G_j), j <= i) U
        S_C  = exp(G_C) S0 + (K * exp(G_C - G_j))^T U.
    """
    chunk_len = q.shape[1]
    value_dim = v.shape[-1]
    log_decay = g.cumsum(dim=-1)  # [HV, C], G
    causal = torch.ones(chunk_len, chunk_len, dtype=torch.bool, device=q.device).tril()  # [C, C], j <= i
    # Mask before exp: above the diagonal G_i - G_j > 0 and could overflow to inf (and inf * 0 = nan).
    pair_decay = (log_decay[:, :, None] - log_decay[:, None, :]).masked_fill(~causal, float("-inf")).exp()

    key_overlap = k @ k.transpose(-1, -2)  # [HV, C, C]
    coupling = (beta[:, :, None] * key_overlap * pair_decay).tril(-1)  # [HV, C, C], A (j < i only)
    system = coupling + torch.eye(chunk_len, device=q.device)  # [HV, C, C], I + A
    rhs = torch.cat([beta[..., None] * v, (beta * log_decay.exp())[..., None] * k], dim=-1)  # [HV, C, V+K]
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    update_local, state_weights = solved.split([value_dim, k.shape[-1]], dim=-1)  # [HV, C, V], [HV, C, K]
    update = update_local - state_weights @ state  # [HV, C, V], U

    intra = (q @ k.transpose(-1, -2)) * pair_decay  # [HV, C, C], j <= i (diagonal included)
    out = log_decay.exp()[..., None] * (q @ state) + intra @ update  # [HV, C, V]

    last = log_decay[:, -1:]  # [HV, 1], G_C
    decayed_keys = k * (last - log_decay).exp()[..., None]  # [HV, C, K], exponents <= 0
    new_state = last.exp()[..., None] * state + decayed_keys.transpose(-1, -2) @ update  # [HV, K, V]
    return out, new_state


def _normalize_qk(q, k, num_value_heads):
    """L2-normalise q and k in float32, scale q by K ** -0.5, expand key heads to value heads (GVA).

    q, k: [T, HK, K] -> two float32 tensors [T, HV, K]; value head h uses key head h // (HV // HK).
    """
    group = num_value_heads // q.shape[1]

    def l2norm(x):
        x = x.float()
        return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + _L2NORM_EPS)

    q32 = l2norm(q) * q.shape[-1] ** -0.5
    k32 = l2norm(k)
    return q32.repeat_interleave(group, dim=1), k32.repeat_interleave(group, dim=1)


def check_shapes(q, k, v, g, beta, state, state_name: str = "initial_state", unit_stride: bool = False):
    """Raise ValueError naming the first inconsistent tensor; return (T, HK, K). `state` is [N or S, HV, K, V]
    (named `state_name` in errors); unit_stride also requires q, k and v contiguous on their last dimension
    (the GPU kernels address it so)."""
    def stride_ok(tensor):
        return not unit_stride or tensor.stride(-1) == 1

    stride_note = " with unit stride on the last dimension" if unit_stride else ""
    if q.dim() != 3 or not stride_ok(q):
        raise ValueError(f"q must be [T, HK, K]{stride_note}, got shape {tuple(q.shape)} strides {q.stride()}")
    num_tokens, key_heads, key_dim = q.shape
    if k.shape != q.shape or not stride_ok(k):
        raise ValueError(f"k must have q's shape {tuple(q.shape)}{stride_note}, got {tuple(k.shape)} "
                         f"strides {k.stride()}")
    if v.dim() != 3 or v.shape[0] != num_tokens or not stride_ok(v):
        raise ValueError(f"v must be [T={num_tokens}, HV, V]{stride_note}, got shape {tuple(v.shape)} "
                         f"strides {v.stride()}")
    value_heads, value_dim = v.shape[1], v.shape[2]
    if value_heads % key_heads != 0:
        raise ValueError(f"v heads ({value_heads}) must be a multiple of q/k heads ({key_heads})")
    for name, tensor in (("g", g), ("beta", beta)):
        if tuple(tensor.shape) != (num_tokens, value_heads):
            raise ValueError(f"{name} must be [T, HV] = {(num_tokens, value_heads)}, got {tuple(tensor.shape)}")
    if state.dim() != 4 or tuple(state.shape[1:]) != (value_heads, key_dim, value_dim):
        raise ValueError(f"{state_name} must be [N, HV, K, V] = [N, {value_heads}, {key_dim}, {value_dim}], "
                         f"got {tuple(state.shape)}")
    return num_tokens, key_heads, key_dim
