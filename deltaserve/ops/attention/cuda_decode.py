"""Triton flash-decoding over a paged KV cache: one query token per sequence, the KV length split across programs.

A single sequence at 128K context is 4 KV heads of work: far too little to fill a GPU's SMs (132 on an H200)
unless the KV positions are split. The first kernel runs a grid (N, n_kv, num_splits); each program attends the G query
heads of its KV head group (G = n_heads / n_kv; every K/V tile is loaded once for all G heads) to its share
of the sequence and writes a partial result: the normalized output and its log2-sum-exp. The second kernel
(`merge_splits_kernel`, shared with the prefill kernel's split-KV path) merges the splits of each
(sequence, head), applying the output gate when one is given. A grid of one split (many sequences: 27B's 64
decode rows, or a block table short enough) needs no merge: the first kernel then writes the gated output
itself (DIRECT), bit for bit what the merge of one split writes, and the merge kernel is not launched (it costs
a launch per layer: docs/performance.md, 'Decode attention').

Split rule: num_splits, planned from the batch size and the block_tables width, is only an upper bound. Each
sequence uses as many splits as its own length needs: shares of
    tokens_per_split = max(DECODE_ACTIVE_SPLIT_MIN_TOKENS, cdiv(seq_len, num_splits)), rounded up to BLOCK_N,
so cdiv(seq_len, tokens_per_split) active splits (0 for seq_len 0, whose output is zeros). With a 140K-token
table planned at 66 splits, a 1K-token sequence uses 16 splits of 64 tokens and its merge reads 16 partials,
not 66 (short contexts are latency-bound: more, shorter splits finish sooner). Programs of inactive splits
return at once without writing; the merge computes the same count from seq_lens (`split_share`) and reads only
the active partials.

How many splits (`decode_num_splits`): one wave. The grid gets as many splits as keep its programs within the
slots the device holds at once (the tile's resident programs per SM times the SMs), rounding down: a grid a
little over one wave ends with a second wave of a few programs while the rest of the device idles
(docs/performance.md, 'Decode attention').

CUDA graphs: the launches depend only on shapes. num_splits is fixed for a captured graph (batch size and
block_tables width); the active splits are found on the device from seq_lens, so no host read is needed.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deltaserve.device import sm_count
from deltaserve.ops import pdl
from deltaserve.ops.quant_gemm.cuda_fp8 import fp8_row_buffers
from deltaserve.ops.quant_gemm.cuda_gemv import x_parts_buffers
from deltaserve.ops.quant_gemm.reference import Dp4aActivation, Fp8Activation
from deltaserve.ops.attention.cuda_prefill import (
    MERGE_NUM_WARPS,
    attend_kv_range,
    merge_splits_kernel,
    output_gate,
    split_share,
    split_v_scale,
    store_split_partial,
)

__all__ = ["decode_num_splits", "launch_decode"]


class DecodeTile(NamedTuple):
    block_n: int  # KV positions per loop step
    num_warps: int
    num_stages: int
    resident_per_sm: int  # programs of this tile one SM runs at once (its registers and shared memory; H200)


# Tiles by the cache's bytes per element (16-bit dots), the fastest of `python -m benchmarks.attention_probe
# --decode-sweep` on an H200 (docs/performance.md, 'Decode attention'). fp8 (dots in float16, see cuda.py; the V
# tile upcast before its shared-memory staging, `attend_kv_range`'s V_SCALE_IN_TILE) reads half the bytes of
# bf16 in nearly its time: it is bound by the upcast and the operand shuffles (`python -m benchmarks.sass_probe`),
# not by memory. The query tile is G heads padded to >= 16 rows (the minimum tl.dot size).
# resident_per_sm: read off the same split sweeps, at the grid sizes where the time jumps by a wave.
DECODE_TILES = {2: DecodeTile(64, 4, 3, 2), 1: DecodeTile(64, 4, 2, 3)}
DECODE_TILE_FLOAT32 = DecodeTile(16, 8, 2, 2)  # float32 dots (CUDA cores, 4-byte tiles): a correctness path
DECODE_MIN_TOKENS_PER_SPLIT = 256  # planning: no more splits than the table's capacity / this
DECODE_ACTIVE_SPLIT_MIN_TOKENS = 64  # per sequence: an active split reads at least this many positions
DECODE_MAX_SPLITS = 128


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_kv_len: int, device: torch.device,
                      resident_per_sm: int) -> int:
    """How many programs may share one sequence's KV, from static quantities only (graph-safe): the grid's
    third axis, as many as fit one wave of the device; shorter sequences use fewer of them (see the module
    docstring).

    max_kv_len: the longest sequence block_tables can describe (its width times block_size);
    resident_per_sm: the tile's `DecodeTile.resident_per_sm`.
    """
    programs_per_split = max(1, num_seqs * num_kv_heads)
    one_wave = resident_per_sm * sm_count(device) // programs_per_split
    useful = triton.cdiv(max_kv_len, DECODE_MIN_TOKENS_PER_SPLIT)
    return max(1, min(one_wave, useful, DECODE_MAX_SPLITS))


# stride_table is the width of the step's block table, which eager steps size to their longest sequence:
# specialized, it would compile a new variant in the middle of serving (a step of seconds on a cold Triton cache).
@triton.jit(do_not_specialize=["num_splits", "stride_table"])
def _decode_split_kernel(
    q, k_cache, v_cache, partial_out, partial_lse, out, gate, block_tables, cu_seqlens_q, seq_lens,
    num_heads, num_splits, qk_scale, v_tile_scale, v_out_scale,
    stride_q_tok, stride_q_head, stride_block, stride_slot, stride_kv_head, stride_table,
    stride_o_tok, stride_o_head, stride_g_tok, stride_g_head,
    GROUP: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MIN_TOKENS_PER_SPLIT: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, V_SCALE_IN_TILE: tl.constexpr, DIRECT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Grid (N, n_kv, num_splits). Writes partial_out[seq, head, split, :] and partial_lse[seq, head, split]
    for the sequence's active splits only; or, with DIRECT (num_splits == 1), the finished rows of out (gated
    by sigmoid(gate) when gate is given), as the merge of that one split would: zeros for a sequence of no
    positions."""
    pdl.wait_for_previous_kernel(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q + seq)
    if tl.load(cu_seqlens_q + seq + 1) == q_start:
        return  # an empty query row: the reduce kernel skips it too
    seq_len = tl.load(seq_lens + seq).to(tl.int32)  # int32: a 32-bit loop variable pipelines (see prefill)
    tokens_per_split, num_active = split_share(seq_len, num_splits, MIN_TOKENS_PER_SPLIT, BLOCK_N)
    if split >= num_active:
        if DIRECT:  # seq_len 0: the merge would write zeros
            _store_zero_rows(out, gate, q_start, kv_head, stride_o_tok, stride_o_head, stride_g_tok,
                             stride_g_head, GROUP, HEADS_PAD, HEAD_DIM, HEAD_DIM_PAD)
        return  # the merge reads only the active splits
    kv_lo = split * tokens_per_split
    kv_hi = tl.minimum(kv_lo + tokens_per_split, seq_len)  # > kv_lo: an active split is never empty

    # (after the early return: computed before it, they cost the bf16 loop 7 more SASS instructions)
    rows = tl.arange(0, HEADS_PAD)
    heads = kv_head * GROUP + rows  # [HP] query heads of this KV head
    row_ok = rows < GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q_rows = q_start.to(tl.int64) * stride_q_tok + heads * stride_q_head  # [HP]
    q_mask = row_ok[:, None] & dim_ok[None, :]
    q_tile = tl.load(q + q_rows[:, None] + dims[None, :], mask=q_mask, other=0.0)  # [HP, D]
    if DOT_DTYPE == tl.float16:  # bf16 queries over an fp8 cache dot in float16 (see cuda.py): saturate
        q_tile = tl.minimum(tl.maximum(q_tile.to(tl.float32), -65504.0), 65504.0)
    q_tile = q_tile.to(DOT_DTYPE)
    # The one query sits at position seq_len - 1 and sees the whole sequence; kv_hi bounds the split.
    row_pos = tl.zeros([HEADS_PAD], dtype=tl.int32) + seq_len - 1

    acc = tl.zeros([HEADS_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([HEADS_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([HEADS_PAD], dtype=tl.float32)
    acc, m_i, l_i = attend_kv_range(
        acc, m_i, l_i, q_tile, row_pos, kv_lo, kv_hi, block_tables + seq * stride_table,
        k_cache + kv_head * stride_kv_head, v_cache + kv_head * stride_kv_head, stride_block, stride_slot,
        qk_scale, v_tile_scale, HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_N, DOT_DTYPE, PRECISION, MASKED=True,
        V_SCALE_IN_TILE=V_SCALE_IN_TILE,
    )
    if DIRECT:
        # as store_split_partial then the merge of one split compute it (weight 2^(lse - lse) = 1): bit for bit
        result = acc * (v_out_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]  # [HP, D]
        _store_rows(out, gate, q_start, heads, dims, result, row_ok[:, None] & dim_ok[None, :], stride_o_tok,
                    stride_o_head, stride_g_tok, stride_g_head)
    else:
        index = (seq * num_heads + heads).to(tl.int64) * num_splits + split  # [HP] row of [N, H, splits]
        store_split_partial(partial_out, partial_lse, index, acc, m_i, l_i, v_out_scale, row_ok, dims, HEAD_DIM)


@triton.jit
def _store_zero_rows(out, gate, token, kv_head, stride_o_tok, stride_o_head, stride_g_tok, stride_g_head,
                     GROUP: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HEAD_DIM_PAD: tl.constexpr):
    """The output rows of a query over no positions: zeros (gated: 0 * sigmoid(gate) = 0), as the merge writes."""
    rows = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    zeros = tl.zeros([HEADS_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    mask = (rows < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]
    _store_rows(out, gate, token, kv_head * GROUP + rows, dims, zeros, mask, stride_o_tok, stride_o_head,
                stride_g_tok, stride_g_head)


@triton.jit
def _store_rows(out, gate, token, heads, dims, result, mask, stride_o_tok, stride_o_head, stride_g_tok,
                stride_g_head):
    """out[token, heads, dims] = result [HP, D] (float32) in out's dtype, times sigmoid(gate) where gate is
    given (`output_gate`, as the merge applies it)."""
    o_rows = token.to(tl.int64) * stride_o_tok + heads * stride_o_head  # [HP]
    if gate is None:
        tl.store(out + o_rows[:, None] + dims[None, :], result.to(out.dtype.element_ty), mask=mask)
    else:
        g_rows = token.to(tl.int64) * stride_g_tok + heads * stride_g_head  # [HP]
        gated = output_gate(result, gate + g_rows[:, None] + dims[None, :], mask, out.dtype.element_ty)
        tl.store(out + o_rows[:, None] + dims[None, :], gated, mask=mask)


def launch_decode(q, k_cache, v_cache, out, block_tables, cu_seqlens_q, seq_lens, qk_scale: float,
                  v_scale: float, dot_dtype, precision: str, num_splits: int | None = None, gate=None,
                  quant_block: int = 0, dp4a: tuple[int, bool] | None = None):
    """Fill out [T, n_heads, hd] for a batch whose sequences have at most one query token each, and return it.

    Same preconditions and gate as `launch_prefill`. num_splits: the most splits of one sequence; None plans
    it with `decode_num_splits`. quant_block / dp4a: what the output projection's product reads (the norm
    kernels' arguments of the same names); where the merge kernel runs and the head size takes it (a power of
    two, a multiple of the block or group), it writes that instead (an Fp8Activation [T, n_heads * hd]) or
    besides out (a Dp4aActivation of the one token's row), and that is returned.
    """
    num_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1:3]
    num_seqs = block_tables.shape[0]
    group = num_heads // num_kv_heads
    tile = DECODE_TILE_FLOAT32 if dot_dtype == tl.float32 else DECODE_TILES[k_cache.element_size()]
    if num_splits is None:
        max_kv_len = block_tables.shape[1] * block_size
        num_splits = decode_num_splits(num_seqs, num_kv_heads, max_kv_len, q.device, tile.resident_per_sm)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs every dimension >= 16
    gate_strides = (0, 0) if gate is None else gate.stride()[:2]
    # One split (many sequences, or a short block table): the kernel writes the output itself, no merge kernel.
    direct = num_splits == 1
    if direct:
        partial_out = partial_lse = out  # not written
    else:
        # float32 partials: each split's output normalized by its own sum, and that sum's log2-sum-exp; only
        # the active splits of each sequence are written.
        partial_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        partial_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, partial_out, partial_lse, out, gate, block_tables, cu_seqlens_q, seq_lens,
        num_heads, num_splits, qk_scale, *split_v_scale(v_scale, k_cache.element_size() == 1),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), *gate_strides,
        GROUP=group, HEADS_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size, BLOCK_N=tile.block_n,
        MIN_TOKENS_PER_SPLIT=DECODE_ACTIVE_SPLIT_MIN_TOKENS, DOT_DTYPE=dot_dtype, PRECISION=precision,
        V_SCALE_IN_TILE=k_cache.element_size() == 1, DIRECT=direct, num_warps=tile.num_warps,
        num_stages=tile.num_stages, **pdl.launch_args(q.device),
    )
    if direct:
        return out
    whole_groups = head_dim == head_dim_pad  # a power of two: the block or group, if it divides it, tiles it
    quant_block = quant_block if whole_groups and quant_block and head_dim % quant_block == 0 else 0
    dp4a = dp4a if whole_groups and dp4a and q.shape[0] == 1 and head_dim % dp4a[0] == 0 and not quant_block else None
    rows = out.view(out.shape[0], num_heads * head_dim)
    xq, sx = fp8_row_buffers(rows, quant_block) if quant_block else (None, None)
    parts = x_parts_buffers(num_heads * head_dim, dp4a[0], q.device) if dp4a else (None, None, None)
    merge_splits_kernel[(num_seqs, num_heads)](
        out, partial_out, partial_lse, cu_seqlens_q, seq_lens, gate, num_heads, num_splits,
        out.stride(0), out.stride(1), *gate_strides, xq, sx, *parts, out.shape[0], HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad, MIN_TOKENS_PER_SPLIT=DECODE_ACTIVE_SPLIT_MIN_TOKENS, BLOCK_N=tile.block_n,
        QUANT_BLOCK=quant_block, PARTS_GROUP=dp4a[0] if dp4a else 0, PARTS_LOW_HIGH=bool(dp4a and dp4a[1]),
        num_warps=MERGE_NUM_WARPS, **pdl.launch_args(q.device),
    )
    if quant_block:
        return Fp8Activation(xq, sx, quant_block, out.dtype)
    return Dp4aActivation(rows, *parts, *dp4a) if dp4a else out
