"""GPU gated delta rule over the GDN state pool (GPU path of `ops.gdn`).

Same contract as `deltaserve.ops.gdn.gdn_prefill` / `gdn_decode` (see `reference.py` for the math):

- `gdn_decode` is our Triton kernel. One program per (sequence, value head, block of BV value columns) loads
  the [K, BV] state tile straight from the sequence's pool slot, takes one gated-delta-rule step and writes
  the tile back in place. Decode is memory-bound (27B: 48 heads x 128 x 128 x 4 B = 3 MiB of float32 state
  per layer per sequence, read once and written once), so the kernel touches nothing else of size.
- `gdn_prefill` calls fla-core 0.6's `chunk_gated_delta_rule` (varlen, B = 1). fla takes and returns dense
  [N, HV, K, V] float32 states, so the slots are gathered before and scattered after; q and k are
  L2-normalised by our `l2_normalize` first (fla's own autotunes dozens of variants). Its Python wrapper
  costs most of a millisecond of CPU per call whatever the chunk size, so batches whose longest sequence has at most
  RECURRENT_PREFILL_MAX_LEN tokens (a prefix-cache hit's short chunk) take the decode kernel's varlen form
  instead: the same program steps through its sequence's tokens with the state tile held in registers.
  A batch that mixes both (decoding sequences beside a prompt chunk: one token each) is split when the
  offsets are known on the host and the short sequences are many: they take the recurrent kernel in place,
  and only the long ones go through fla, whose gather, masking and scatter of 3 MiB states and whose
  per-sequence chunk work would otherwise cost tens of milliseconds of GPU a step on 27B with dozens of decoding
  sequences (docs/performance.md, 'GDN prefill').
"""

import functools
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from deltaserve.device import to_device
from deltaserve.ops import pdl
from deltaserve.ops.gdn.reference import check_shapes
from deltaserve.ops.pdl import wait_for_previous_kernel
from deltaserve.ops.varlen import check_state_pool

# Added under the square root of the L2 norm, as in fla's l2norm and the reference.
_L2NORM_EPS = 1e-6
# Rows of q or k a program of `l2_normalize` scales.
_L2NORM_ROWS = 16
# gdn_prefill runs the recurrent kernel when no sequence has more new tokens than this: one launch and no
# state gather/scatter, but one token after another (fla's chunks are matmuls). fla's chunked path costs about
# a millisecond of host time per call at any size, so the recurrent kernel wins up to at least 128 tokens
# (docs/performance.md, 'GDN prefill').
RECURRENT_PREFILL_MAX_LEN = 128
# A batch with long sequences sends its short ones (<= RECURRENT_PREFILL_MAX_LEN tokens) to the recurrent kernel
# when there are at least this many: each short one costs fla a 3 MiB state gather, mask and scatter (27B) and a
# chunk of its own, but the split costs a few host operations and an output copy per layer. A prompt checkpointed
# inside its step (one 16-token tail beside its head) stays in one fla call.
SPLIT_MIN_SHORT_SEQS = 8
# Value columns per program of the split's recurrent kernel: one width whatever the count of short sequences
# (decode's width for 16 and more), so one kernel variant, compiled at warm-up rather than in a served step.
SPLIT_BLOCK_V = 64
# (value columns, warps) of a recurrent-prefill program when fewer than 8 sequences share the launch (a
# prefix-cache hit's chunk, a single-chunk CUDA graph's chunk and its padding): each program steps through its
# sequence's tokens one after another, so the time is the number of tokens times one step's latency, which
# narrow tiles on one warp keep short (their reductions stay inside the warp).
CHUNK_TILE = (16, 1)
# Tokens per chunk of fla's chunked gated delta rule (its default).
FLA_CHUNK_SIZE = 64


@triton.jit
def _load_token(
    q, k, v, g, beta, token, head, key_head, keys, cols, key_ok, col_ok,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_g_tok, stride_beta_tok, present,
):
    """One token's raw inputs for (value head, value columns): q [BK], k [BK], v [BV], g and beta as stored
    (zeros where `present` is false: a prefetch past the sequence's end)."""
    q_raw = tl.load(q + token * stride_q_tok + key_head * stride_q_head + keys, mask=key_ok & present, other=0.0)
    k_raw = tl.load(k + token * stride_k_tok + key_head * stride_k_head + keys, mask=key_ok & present, other=0.0)
    v_raw = tl.load(v + token * stride_v_tok + head * stride_v_head + cols, mask=col_ok & present, other=0.0)
    g_raw = tl.load(g + token * stride_g_tok + head, mask=present, other=0.0)
    beta_raw = tl.load(beta + token * stride_beta_tok + head, mask=present, other=0.0)
    return q_raw, k_raw, v_raw, g_raw, beta_raw


@triton.jit
def _prepare_token(q_raw, k_raw, v_raw, g_raw, beta_raw, A_log, dt_bias, head, scale, eps, RAW_GATES: tl.constexpr):
    """A token's inputs in float32, ready for `_delta_step`: q [BK] and k [BK] L2-normalised (q also scaled by
    1/sqrt(K)), v [BV], the decay exp(g) and the write strength beta.

    RAW_GATES: g and beta hold the raw projections a and b; the gates are computed here, as the reference
    does: g = -exp(A_log) * softplus(a + dt_bias) (softplus linear above 20, like torch's), beta = sigmoid(b).
    """
    q_vec = q_raw.to(tl.float32)
    k_vec = k_raw.to(tl.float32)
    q_vec = q_vec / tl.sqrt(tl.sum(q_vec * q_vec) + eps) * scale  # [BK]
    k_vec = k_vec / tl.sqrt(tl.sum(k_vec * k_vec) + eps)  # [BK]
    v_vec = v_raw.to(tl.float32)
    g_val = g_raw.to(tl.float32)
    write = beta_raw.to(tl.float32)
    if RAW_GATES:
        x = g_val + tl.load(dt_bias + head).to(tl.float32)
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
        g_val = -tl.exp(tl.load(A_log + head).to(tl.float32)) * softplus
        write = 1.0 / (1.0 + tl.exp(-write))
    decay = tl.exp(g_val)  # g <= 0, so decay is in (0, 1]
    return q_vec, k_vec, v_vec, decay, write


@triton.jit
def _delta_step(state, q_vec, k_vec, v_vec, decay, write):
    """One gated-delta-rule step of the [BK, BV] float32 state tile; returns (new tile, output o [BV])."""
    state = state * decay  # S = exp(g) S
    predicted = tl.sum(state * k_vec[:, None], axis=0)  # [BV], S^T k against the decayed state
    update = write * (v_vec - predicted)  # [BV], u = beta (v - S^T k)
    state += k_vec[:, None] * update[None, :]  # rank-1 write S += k u^T
    o_vec = tl.sum(state * q_vec[:, None], axis=0)  # [BV], o = S^T q
    return state, o_vec


@triton.jit
def _gdn_recurrent_kernel(
    q, k, v, g, beta, A_log, dt_bias, out, state_pool, state_slots, has_initial_state, cu_seqlens, seq_ids,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_g_tok, stride_beta_tok, scale, eps,
    HV: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, RAW_GATES: tl.constexpr, VARLEN: tl.constexpr, SUBSET: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Grid (N, HV, cdiv(V, BV)): the [K, BV] state tile of (sequence, value head, value block) is read from
    the sequence's pool slot, stepped through the sequence's tokens and written back in place.

    VARLEN False (decode): sequence n is token n alone and continues its state; has_initial_state and
    cu_seqlens are None. VARLEN: its tokens are cu_seqlens[n] .. cu_seqlens[n+1] (maybe none), and a sequence
    without has_initial_state[n] starts from zeros. SUBSET (varlen only): program n runs sequence seq_ids[n].
    """
    wait_for_previous_kernel(PDL)
    if SUBSET:
        seq = tl.load(seq_ids + tl.program_id(0))
    else:
        seq = tl.program_id(0)
    head = tl.program_id(1)
    key_head = head // GROUP  # GVA: value head h reads key head h // (HV // HK)
    keys = tl.arange(0, BK)  # [BK]
    cols = tl.program_id(2) * BV + tl.arange(0, BV)  # [BV]
    key_ok = keys < K
    col_ok = cols < V
    slot = tl.load(state_slots + seq).to(tl.int64)
    tile_ptr = state_pool + (slot * HV + head) * (K * V) + keys[:, None] * V + cols[None, :]  # [BK, BV]
    tile_mask = key_ok[:, None] & col_ok[None, :]
    strides = (stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
               stride_g_tok, stride_beta_tok)

    if VARLEN:
        # A fresh slot starts from zeros: masked out of the load, not multiplied by 0 (it may hold NaN garbage,
        # and NaN * 0 is NaN).
        has_state = tl.load(has_initial_state + seq) != 0
        state = tl.load(tile_ptr, mask=tile_mask & has_state, other=0.0).to(tl.float32)  # [BK, BV]
        start = tl.load(cu_seqlens + seq)
        end = tl.load(cu_seqlens + seq + 1)
        # Each token's inputs are loaded one step ahead, so that their memory latency overlaps the previous
        # token's math instead of stalling every step of this sequential loop.
        q_raw, k_raw, v_raw, g_raw, beta_raw = _load_token(
            q, k, v, g, beta, start, head, key_head, keys, cols, key_ok, col_ok, *strides, start < end)
        for token in range(start, end):
            q_vec, k_vec, v_vec, decay, write = _prepare_token(
                q_raw, k_raw, v_raw, g_raw, beta_raw, A_log, dt_bias, head, scale, eps, RAW_GATES)
            q_raw, k_raw, v_raw, g_raw, beta_raw = _load_token(
                q, k, v, g, beta, token + 1, head, key_head, keys, cols, key_ok, col_ok, *strides, token + 1 < end)
            state, o_vec = _delta_step(state, q_vec, k_vec, v_vec, decay, write)
            tl.store(out + (token * HV + head) * V + cols, o_vec.to(out.dtype.element_ty), mask=col_ok)
    else:
        # Decode, in the order it always had: the token's small loads, then the state tile's.
        q_raw, k_raw, v_raw, g_raw, beta_raw = _load_token(
            q, k, v, g, beta, seq, head, key_head, keys, cols, key_ok, col_ok, *strides, seq >= 0)
        q_vec, k_vec, v_vec, decay, write = _prepare_token(
            q_raw, k_raw, v_raw, g_raw, beta_raw, A_log, dt_bias, head, scale, eps, RAW_GATES)
        state = tl.load(tile_ptr, mask=tile_mask, other=0.0).to(tl.float32)  # [BK, BV]
        state, o_vec = _delta_step(state, q_vec, k_vec, v_vec, decay, write)
        tl.store(out + (seq * HV + head) * V + cols, o_vec.to(out.dtype.element_ty), mask=col_ok)

    # Every thread's read of the tile completes before the first write: the update is in place, and a layout
    # may hold one element in two threads.
    tl.debug_barrier()
    tl.store(tile_ptr, state.to(state_pool.dtype.element_ty), mask=tile_mask)


def gdn_decode(q, k, v, g, beta, state_pool, state_slots, block_v: int | None = None, A_log=None, dt_bias=None):
    """One step per sequence, the state updated in place in its pool slot.

    q, k: [N, HK, K]; v: [N, HV, V] (any float dtype, unit stride on the last dim: views of the conv output
    are fine); g: [N, HV] float32 log decay; beta: [N, HV]; state_pool: [S, HV, K, V] float32 or bf16,
    contiguous; state_slots: [N] int64, distinct. With A_log and dt_bias ([HV] each), g and beta are instead
    the raw projections a and b, and the gates are computed in the kernel (one launch instead of seven).
    block_v: value columns per program (a power of two; default by batch size, see `_decode_block_v`).
    Returns o: [N, HV, V] in v.dtype."""
    num_seqs, key_heads, key_dim = _check_gdn_inputs(q, k, v, g, beta, state_pool, state_slots)
    value_heads, value_dim = v.shape[1], v.shape[2]
    if num_seqs != state_slots.shape[0]:
        raise ValueError(f"decode takes one token per sequence: q has {num_seqs} rows but state_slots has "
                         f"{state_slots.shape[0]}")
    if block_v is None:
        block_v = _decode_block_v(num_seqs)
    if block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    g, beta = _unit_last_stride(g), _unit_last_stride(beta)
    if (A_log is None) != (dt_bias is None):
        raise ValueError("A_log and dt_bias come together (raw gates) or not at all")
    out = torch.empty(num_seqs, value_heads, value_dim, dtype=v.dtype, device=v.device)
    if num_seqs == 0:
        return out
    _launch_recurrent(q, k, v, g, beta, out, state_pool, state_slots, None, None, block_v, A_log, dt_bias)
    return out


def _launch_recurrent(q, k, v, g, beta, out, state_pool, state_slots, has_initial_state, cu_seqlens, block_v,
                      A_log=None, dt_bias=None, seq_ids=None, num_warps=None):
    """Run `_gdn_recurrent_kernel` over N = len(state_slots) sequences (varlen when cu_seqlens is given), or
    over the sequences numbered in seq_ids [n] (varlen only). num_warps: by default ~32 state values a thread."""
    key_heads, key_dim = q.shape[1:]
    value_heads, value_dim = v.shape[1:]
    raw_gates = A_log is not None
    block_k = triton.next_power_of_2(key_dim)
    block_v = min(block_v, triton.next_power_of_2(value_dim))
    num_programs = state_slots.shape[0] if seq_ids is None else seq_ids.shape[0]
    grid = (num_programs, value_heads, triton.cdiv(value_dim, block_v))
    _gdn_recurrent_kernel[grid](
        q, k, v, g, beta, A_log if raw_gates else g, dt_bias if raw_gates else g, out, state_pool, state_slots,
        has_initial_state, cu_seqlens, seq_ids,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), key_dim ** -0.5, _L2NORM_EPS,
        HV=value_heads, GROUP=value_heads // key_heads, K=key_dim, V=value_dim, BK=block_k, BV=block_v,
        RAW_GATES=raw_gates, VARLEN=cu_seqlens is not None, SUBSET=seq_ids is not None,
        # about 32 state values per thread (fla's fused_recurrent kernel runs [128, 8] tiles on one warp)
        num_warps=num_warps or max(1, min(4, block_k * block_v // 1024)), **pdl.launch_args(q.device),
    )


def gdn_prefill(q, k, v, g, beta, state_pool, state_slots, has_initial_state, cu_seqlens, cu_seqlens_cpu=None,
                max_query_len: int | None = None, *, A_log=None, dt_bias=None, chunk_indices=None):
    """Gated delta rule over varlen prompts, states read from and written to the pool.

    q, k: [T, HK, K]; v: [T, HV, V]; g: [T, HV] float32 log decay; beta: [T, HV]; state_pool: [S, HV, K, V]
    (float32 or bf16), updated at state_slots [N] int64; has_initial_state: [N] bool; cu_seqlens: [N+1] int64
    on the GPU. max_query_len: the longest sequence's token count, if known; at most RECURRENT_PREFILL_MAX_LEN
    runs our recurrent kernel (one launch), otherwise fla-core's chunked kernels. cu_seqlens_cpu: the same
    offsets on the CPU, optional: without it fla reads cu_seqlens back to the host once (a device sync) to
    build its chunk index; with it, a batch with long sequences and at least SPLIT_MIN_SHORT_SEQS short ones
    (decoding sequences beside a prompt chunk) sends only the long ones to fla. With A_log and dt_bias ([HV]
    each), g and beta are the raw projections a and b (as in `gdn_decode`): the recurrent kernel computes the
    gates itself, the fla path first. chunk_indices: fla's chunk index of cu_seqlens ([NT, 2] int64 on the
    device), kept by the caller (a CUDA graph must read the same tensor at every replay); None: built here once
    a step from cu_seqlens_cpu. Returns o: [T, HV, V] in v.dtype."""
    if (A_log is None) != (dt_bias is None):
        raise ValueError("A_log and dt_bias come together (raw gates) or not at all")
    num_tokens, _, _ = _check_gdn_inputs(q, k, v, g, beta, state_pool, state_slots)
    num_seqs = state_slots.shape[0]
    if tuple(has_initial_state.shape) != (num_seqs,) or has_initial_state.dtype != torch.bool:
        raise ValueError(f"has_initial_state must be a bool [N={num_seqs}] tensor, got {has_initial_state.dtype} "
                         f"{tuple(has_initial_state.shape)}")
    if tuple(cu_seqlens.shape) != (num_seqs + 1,) or cu_seqlens.dtype != torch.int64:
        raise ValueError(f"cu_seqlens must be an int64 [N+1={num_seqs + 1}] tensor, got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)}")
    if max_query_len is not None and (not isinstance(max_query_len, int) or max_query_len < 0):
        raise ValueError(f"max_query_len must be a non-negative int or None, got {max_query_len!r}")
    if max_query_len is not None and max_query_len <= RECURRENT_PREFILL_MAX_LEN:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        if num_seqs > 0:  # also with no tokens: fresh slots still become zeros
            g, beta = _unit_last_stride(g), _unit_last_stride(beta)
            block_v, num_warps = _recurrent_prefill_tile(num_seqs)
            _launch_recurrent(q, k, v, g, beta, out, state_pool, state_slots, has_initial_state, cu_seqlens,
                              block_v, A_log, dt_bias, num_warps=num_warps)
        return out

    lengths = None if cu_seqlens_cpu is None else np.diff(cu_seqlens_cpu.numpy())  # [N]
    num_short = 0 if lengths is None else int((lengths <= RECURRENT_PREFILL_MAX_LEN).sum())
    if SPLIT_MIN_SHORT_SEQS <= num_short < len(lengths):
        return _split_prefill(q, k, v, g, beta, state_pool, state_slots, has_initial_state, cu_seqlens,
                              cu_seqlens_cpu, A_log, dt_bias)
    if A_log is not None:
        from deltaserve.ops.gdn import gdn_gates
        g, beta = gdn_gates(g, beta, A_log, dt_bias)
    return _chunked_prefill(q, k, v, g, beta, state_pool, state_slots, has_initial_state, cu_seqlens,
                            cu_seqlens_cpu, chunk_indices)


@dataclass(frozen=True)
class _SplitPlan:
    """How `_split_prefill` divides a batch, from its host offsets (the same for every GDN layer of a step)."""
    short_ids: torch.Tensor  # [S] the sequences the recurrent kernel runs
    long_ids: torch.Tensor  # [L] the sequences fla runs
    rows: slice | torch.Tensor  # the long sequences' token rows: a slice when they are adjacent
    long_offsets: torch.Tensor  # [L+1] their token offsets on the device
    long_offsets_cpu: torch.Tensor  # [L+1] the same on the host


def _plan_split(offsets: np.ndarray, device) -> _SplitPlan:
    lengths = np.diff(offsets)
    short = lengths <= RECURRENT_PREFILL_MAX_LEN
    long = np.flatnonzero(~short)
    starts, ends = offsets[long], offsets[long + 1]
    if (starts[1:] == ends[:-1]).all():  # adjacent (a new prompt's chunk after the decoding sequences): a view
        rows = slice(int(starts[0]), int(ends[-1]))
    else:
        rows = to_device(np.concatenate([np.arange(a, b) for a, b in zip(starts, ends)]), device)
    long_offsets = np.zeros(len(long) + 1, dtype=np.int64)
    np.cumsum(lengths[long], out=long_offsets[1:])
    return _SplitPlan(to_device(np.flatnonzero(short), device), to_device(long, device), rows,
                      to_device(long_offsets, device), torch.from_numpy(long_offsets))


class _PerStepCache:
    """Values derived from a batch's host offsets tensor, built once and reused by every GDN layer that passes
    the same tensor object: the layers of one step (fla caches its own index the same way). The tensor is
    held, so its id cannot be reused while it is cached."""

    def __init__(self, size: int = 4):
        self._entries: deque = deque(maxlen=size)  # (kind, offsets tensor, device, value)

    def get(self, kind: str, offsets_cpu: torch.Tensor, device, build):
        for entry_kind, key, entry_device, value in self._entries:
            if entry_kind == kind and key is offsets_cpu and entry_device == device:
                return value
        value = build()
        self._entries.append((kind, offsets_cpu, device, value))
        return value


_per_step = _PerStepCache()


def _split_prefill(q, k, v, g, beta, state_pool, state_slots, has_initial_state, cu_seqlens, cu_seqlens_cpu,
                   A_log, dt_bias):
    """gdn_prefill of a batch with sequences on both sides of RECURRENT_PREFILL_MAX_LEN: the short ones by the
    recurrent kernel, in place; the long ones by fla, on their rows."""
    device = v.device
    plan = _per_step.get("split", cu_seqlens_cpu, device, lambda: _plan_split(cu_seqlens_cpu.numpy(), device))
    out = torch.empty(v.shape, dtype=v.dtype, device=device)
    _launch_recurrent(q, k, v, _unit_last_stride(g), _unit_last_stride(beta), out, state_pool,
                      state_slots, has_initial_state, cu_seqlens, SPLIT_BLOCK_V, A_log, dt_bias, seq_ids=plan.short_ids)
    rows = plan.rows
    g_long, beta_long = g[rows], beta[rows]
    if A_log is not None:
        from deltaserve.ops.gdn import gdn_gates
        g_long, beta_long = gdn_gates(g_long, beta_long, A_log, dt_bias)
    out[rows] = _chunked_prefill(q[rows], k[rows], v[rows], g_long, beta_long, state_pool,
                                 state_slots.index_select(0, plan.long_ids),
                                 has_initial_state.index_select(0, plan.long_ids), plan.long_offsets,
                                 plan.long_offsets_cpu)
    return out


@functools.cache
def _pin_fla_configs() -> bool:
    """Once, before fla's first call: its pinned kernel configurations for this GPU, if any (fla_configs.py)."""
    from deltaserve.ops.gdn.fla_configs import use_pinned_configs

    return use_pinned_configs()


def _chunked_prefill(q, k, v, g, beta, state_pool, state_slots, has_initial_state, cu_seqlens, cu_seqlens_cpu,
                     chunk_indices=None):
    """fla-core's chunked gated delta rule over the varlen batch (gates computed), states gathered from the
    pool and scattered back; chunk_indices as `gdn_prefill` takes it. Returns o: [T, HV, V] in v.dtype."""
    _pin_fla_configs()
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # optional dependency, GPU only

    num_seqs, num_tokens = state_slots.shape[0], q.shape[0]
    if num_seqs == 0 or num_tokens == 0:
        # nothing for fla to run: every sequence is empty, so its final state is its (masked) initial one
        _zero_fresh_slots(state_pool, state_slots, has_initial_state)
        return v.new_empty(v.shape)

    # fla builds its chunk index from the host offsets and copies it to the GPU from pageable memory: a stream
    # sync, after which the GPU idles while the host launches fla's kernels. Built here (once a step)
    # and copied from pinned memory, it is queued like any other input.
    if chunk_indices is None and cu_seqlens_cpu is not None:
        chunk_indices = _per_step.get("chunks", cu_seqlens_cpu, v.device, lambda: to_device(
            fla_chunk_indices(cu_seqlens_cpu.numpy()), v.device))  # [NT, 2] int64
    # index_select copies, so the in-place masking never touches the pool; .float() is a no-op on float32.
    initial = state_pool.index_select(0, state_slots).float()  # [N, HV, K, V]
    # masked_fill, not a multiply: a fresh slot may hold NaN garbage, and NaN * 0 is NaN.
    initial.masked_fill_(~has_initial_state[:, None, None, None], 0.0)
    # fla wants time-major [B, T, H, D] with B = 1 for varlen input. Its input_guard makes every tensor argument
    # contiguous: strided q/k/v views would be copied here (the layer's conv writes them contiguous). q and k are
    # L2-normalised by our kernel rather than fla's (use_qk_l2norm_in_kernel), whose autotuning compiles dozens
    # of variants.
    out, final = chunk_gated_delta_rule(
        l2_normalize(q.contiguous())[None], l2_normalize(k.contiguous())[None], v[None], g[None], beta[None],
        initial_state=initial,
        output_final_state=True,
        use_qk_l2norm_in_kernel=False,  # default scale K ** -0.5
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
        chunk_indices=chunk_indices,
    )
    state_pool.index_copy_(0, state_slots, final.to(state_pool.dtype))  # final: [N, HV, K, V] float32
    return out[0].to(v.dtype)  # fla returns q.dtype


@triton.jit(do_not_specialize=["num_rows"])  # the step's token count x heads: one variant for every step
def _l2norm_kernel(x, out, num_rows, eps, D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    """Grid (cdiv(num_rows, ROWS),): rows of D contiguous values scaled to unit L2 norm, in float32, as fla's
    l2norm_fwd computes them (x / sqrt(sum x^2 + eps) as x * (1 / sqrt(...)))."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [R]
    cols = tl.arange(0, BLOCK_D)  # [BD]
    mask = (rows < num_rows)[:, None] & (cols < D)[None, :]
    offsets = rows.to(tl.int64)[:, None] * D + cols[None, :]
    values = tl.load(x + offsets, mask=mask, other=0.0).to(tl.float32)  # [R, BD]
    inverse_norm = 1 / tl.sqrt(tl.sum(values * values, axis=1) + eps)  # [R]
    tl.store(out + offsets, (values * inverse_norm[:, None]).to(out.dtype.element_ty), mask=mask)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] contiguous -> each [D] row over its L2 norm (eps 1e-6 under the root), in x.dtype. What fla's
    chunked rule does with use_qk_l2norm_in_kernel, in one kernel variant: fla's own autotunes 25 launch
    configurations per power-of-two band of T * H (50 compiles at startup, more at a larger token budget)."""
    if not x.is_contiguous():
        raise ValueError(f"x must be contiguous, got strides {x.stride()} for shape {tuple(x.shape)}")
    out = torch.empty_like(x)
    num_rows, dim = x.numel() // x.shape[-1], x.shape[-1]
    if num_rows:
        _l2norm_kernel[(triton.cdiv(num_rows, _L2NORM_ROWS),)](
            x, out, num_rows, _L2NORM_EPS, D=dim, BLOCK_D=triton.next_power_of_2(dim), ROWS=_L2NORM_ROWS,
            num_warps=4)
    return out


def fla_chunk_indices(offsets: np.ndarray, chunk_size: int = FLA_CHUNK_SIZE) -> np.ndarray:
    """fla's chunk index of a varlen batch: [NT, 2] int64 rows (sequence, chunk within it), chunk by chunk.
    offsets: [N+1] token offsets (cu_seqlens) on the host."""
    counts = -(-np.diff(offsets) // chunk_size)  # [N] chunks per sequence; none for an empty one
    sequence = np.repeat(np.arange(len(counts), dtype=np.int64), counts)  # [NT]
    first = np.repeat(np.cumsum(counts) - counts, counts)  # [NT] index of its sequence's first chunk
    return np.stack([sequence, np.arange(len(sequence), dtype=np.int64) - first], axis=1)


def _decode_block_v(num_seqs: int) -> int:
    """Value columns per program, the fastest for decode on an H200 (27B heads, float32 state,
    `python -m benchmarks.batch_probe`: docs/performance.md, 'GDN decode'): 16 below 8 sequences (48 heads x 8
    blocks = 384 programs at batch 1), 32 from 8, 64 from 16."""
    if num_seqs < 8:
        return 16
    return 32 if num_seqs < 16 else 64


def _recurrent_prefill_tile(num_seqs: int) -> tuple[int, int | None]:
    """(value columns, warps) a program of the recurrent prefill: as decode for many sequences; for a few, whose
    tokens one program steps through one after another, CHUNK_TILE (latency, not bandwidth, bounds them)."""
    if num_seqs < 8:
        return CHUNK_TILE
    return _decode_block_v(num_seqs), None


def _unit_last_stride(tensor):
    """The kernel addresses a token's [HV] gates as contiguous; copy the rare tensor that is not."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def _zero_fresh_slots(state_pool, state_slots, has_initial_state):
    """Zero the pool slots of sequences without an initial state (the final state of an empty sequence)."""
    fresh = state_pool.index_select(0, state_slots)  # [N, HV, K, V]
    fresh.masked_fill_(~has_initial_state[:, None, None, None], 0.0)
    state_pool.index_copy_(0, state_slots, fresh)


def _check_gdn_inputs(q, k, v, g, beta, state_pool, state_slots):
    """Raise ValueError naming the first inconsistent argument; return (T, HK, K)."""
    shapes = check_shapes(q, k, v, g, beta, state_pool, "state_pool", unit_stride=True)
    check_state_pool(state_pool, state_slots)
    return shapes
