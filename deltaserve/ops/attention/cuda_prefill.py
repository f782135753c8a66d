"""Triton flash-attention forward over varlen queries and a paged KV cache (prefill, chunked prefill, mixed).

Rows of a tile are (token, query head) pairs: a program owns `tokens_per_block = BLOCK_M // G` consecutive
query tokens of one sequence times the G query heads of one KV head (GQA), so every K/V tile it gathers from
the cache serves all G heads at once (the layout of vLLM's unified Triton attention). Row r holds token
r // G and head r % G; the BLOCK_M - tokens_per_block * G leftover rows are padding.

Query blocks are numbered without a host sync: sequence n's blocks start at cu_seqlens_q[n] // tpb + n (an
upper bound of the blocks before it), so a grid of T // tpb + N programs covers every sequence; each program
finds its sequence by binary search and exits if its block lies past the sequence's queries.

`attend_kv_range` is the online-softmax loop over KV positions, shared with the decode kernel: it gathers
BLOCK_N cache rows at a time through the block table (any block_size works: each row computes its own block
id and offset), keeps the running max m, sum l and output acc in float32 and works in the log2 domain (the
scale passed in already holds log2(e), so exp2 replaces exp).
"""

from typing import NamedTuple

import triton
import triton.language as tl

__all__ = ["TileConfig", "attend_kv_range", "launch_prefill", "prefill_tiles"]


class TileConfig(NamedTuple):
    block_m: int  # query rows per program: (token, head) pairs
    block_n: int  # KV positions per loop step
    num_warps: int
    num_stages: int


# Tiles by padded head_dim (the smallest key >= head_dim is used). Starting points for an H100/H200, to be
# tuned there: with head_dim 256 the float32 accumulator alone is BLOCK_M * 256 * 4 bytes of registers.
PREFILL_TILES = {
    64: TileConfig(block_m=128, block_n=64, num_warps=4, num_stages=3),
    128: TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=3),
    256: TileConfig(block_m=128, block_n=32, num_warps=8, num_stages=2),
}

# float32 dots ("ieee" precision runs on CUDA cores, not tensor cores) hold twice the bytes per element: small
# tiles keep them compiling quickly and without spills. A correctness path (tests), not a fast one.
PREFILL_TILES_FLOAT32 = TileConfig(block_m=32, block_n=16, num_warps=4, num_stages=2)


def prefill_tiles(head_dim_pad: int, group: int, float32_dots: bool = False) -> TileConfig:
    """The tile config for this padded head_dim, with BLOCK_M widened to hold at least one token's G heads."""
    if float32_dots:
        tiles = PREFILL_TILES_FLOAT32
    else:
        fitting = [dim for dim in sorted(PREFILL_TILES) if dim >= head_dim_pad]
        tiles = PREFILL_TILES[fitting[0] if fitting else max(PREFILL_TILES)]
    return tiles._replace(block_m=max(tiles.block_m, triton.next_power_of_2(group)))


@triton.jit
def attend_kv_range(
    acc, m_i, l_i, q, row_pos, kv_lo, kv_hi,
    block_table_row, k_head, v_head, stride_block, stride_slot, qk_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, MASKED: tl.constexpr,
):
    """Fold KV positions [kv_lo, kv_hi) of one sequence and KV head into the running (acc, m_i, l_i).

    q: [M, HEAD_DIM_PAD] in DOT_DTYPE; row_pos: [M] position of each row's query; acc: [M, HEAD_DIM_PAD],
    m_i, l_i: [M], all float32. block_table_row points at the sequence's block ids; k_head / v_head at the
    cache plus the KV head's offset; strides count elements. MASKED=False promises that every row sees every
    position of the range and that kv_lo, kv_hi are multiples of BLOCK_N (the prefix below the block's first
    query): no bounds or causal masks then.
    """
    dims = tl.arange(0, HEAD_DIM_PAD)  # [D]
    dim_ok = dims < HEAD_DIM
    for start in range(kv_lo, kv_hi, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N)  # [N]
        if MASKED:
            in_range = positions < kv_hi
            block_ids = tl.load(block_table_row + positions // BLOCK_SIZE, mask=in_range, other=0)
            tile_mask = in_range[:, None] & dim_ok[None, :]
        else:
            block_ids = tl.load(block_table_row + positions // BLOCK_SIZE)
            tile_mask = dim_ok[None, :]
        rows = block_ids.to(tl.int64) * stride_block + (positions % BLOCK_SIZE) * stride_slot  # [N] offsets
        k = tl.load(k_head + rows[:, None] + dims[None, :], mask=tile_mask, other=0.0)  # [N, D]
        scores = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION) * qk_scale  # [M, N]
        if MASKED:
            visible = in_range[None, :] & (positions[None, :] <= row_pos[:, None])
            scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # [M]
        # A row that has seen no visible position yet keeps m = -inf; subtract 0 then so no inf - inf NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)  # [M] rescales what was accumulated under the old max
        p = tl.exp2(scores - m_shift[:, None])  # [M, N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_head + rows[:, None] + dims[None, :], mask=tile_mask, other=0.0)  # [N, D]
        acc = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _find_sequence(cu_seqlens_q, num_seqs, block, TOKENS_PER_BLOCK: tl.constexpr):
    """The last sequence n whose first query block, cu_seqlens_q[n] // TOKENS_PER_BLOCK + n, is <= block."""
    lo = 0
    hi = num_seqs  # invariant: the answer lies in [lo, hi); sequence 0 starts at block 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(cu_seqlens_q + mid) // TOKENS_PER_BLOCK + mid <= block:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit(do_not_specialize=["num_seqs"])
def _prefill_kernel(
    q, k_cache, v_cache, out, block_tables, cu_seqlens_q, seq_lens,
    num_seqs, qk_scale, v_scale,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_block, stride_slot, stride_kv_head, stride_table,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    """Grid (T // tokens_per_block + N, n_kv). Writes out rows of the program's tokens x G heads."""
    TOKENS_PER_BLOCK: tl.constexpr = BLOCK_M // GROUP
    # Launch the last query blocks first: under the causal mask they attend the most positions, and starting
    # the longest programs early leaves short ones to fill the tail of the grid.
    block = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(cu_seqlens_q, num_seqs, block, TOKENS_PER_BLOCK)
    # int32 positions (lengths < 2^31) keep the KV loops' induction variable 32-bit, which Triton pipelines.
    q_start = tl.load(cu_seqlens_q + seq).to(tl.int32)
    q_len = tl.load(cu_seqlens_q + seq + 1).to(tl.int32) - q_start
    first_token = (block - (q_start // TOKENS_PER_BLOCK + seq)) * TOKENS_PER_BLOCK
    if first_token >= q_len:
        return
    seq_len = tl.load(seq_lens + seq).to(tl.int32)
    # Query i of the chunk sits at position seq_len - q_len + i: the cached prefix comes first.
    prefix = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tokens = first_token + rows // GROUP  # [M] token index within the sequence's queries
    heads = kv_head * GROUP + rows % GROUP  # [M] query head
    row_ok = (rows < TOKENS_PER_BLOCK * GROUP) & (tokens < q_len)
    row_pos = prefix + tokens  # [M]
    dims = tl.arange(0, HEAD_DIM_PAD)
    q_rows = (q_start + tokens).to(tl.int64) * stride_q_tok + heads * stride_q_head  # [M]
    q_mask = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
    q_tile = tl.load(q + q_rows[:, None] + dims[None, :], mask=q_mask, other=0.0).to(DOT_DTYPE)  # [M, D]

    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    table_row = block_tables + seq * stride_table
    k_head = k_cache + kv_head * stride_kv_head
    v_head = v_cache + kv_head * stride_kv_head
    # Positions below full_end are visible to every row (the first row sees up to prefix + first_token);
    # only the tiles from there to the last row's position need the causal mask.
    full_end = (prefix + first_token + 1) // BLOCK_N * BLOCK_N
    last_pos = prefix + tl.minimum(first_token + TOKENS_PER_BLOCK, q_len) - 1
    acc, m_i, l_i = attend_kv_range(
        acc, m_i, l_i, q_tile, row_pos, 0, full_end, table_row, k_head, v_head, stride_block, stride_slot,
        qk_scale, HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_N, DOT_DTYPE, PRECISION, MASKED=False,
    )
    acc, m_i, l_i = attend_kv_range(
        acc, m_i, l_i, q_tile, row_pos, full_end, last_pos + 1, table_row, k_head, v_head, stride_block,
        stride_slot, qk_scale, HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_N, DOT_DTYPE, PRECISION, MASKED=True,
    )
    # The stored V was divided by v_scale (fp8 caches); the weights sum to 1, so scaling the output suffices.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    result = acc * (v_scale / l_safe)[:, None]
    o_rows = (q_start + tokens).to(tl.int64) * stride_o_tok + heads * stride_o_head
    tl.store(out + o_rows[:, None] + dims[None, :], result.to(out.dtype.element_ty), mask=q_mask)


def launch_prefill(q, k_cache, v_cache, out, block_tables, cu_seqlens_q, seq_lens, qk_scale: float,
                   v_scale: float, dot_dtype, precision: str) -> None:
    """Fill out [T, n_heads, hd] with causal paged attention; shapes as `reference.paged_attention`.

    qk_scale already holds log2(e) and the K scale; q, out, the caches and block_tables have unit stride in
    their last dimension, and both caches share strides.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs every dimension >= 16
    tiles = prefill_tiles(head_dim_pad, group, float32_dots=dot_dtype == tl.float32)
    tokens_per_block = tiles.block_m // group
    num_seqs = block_tables.shape[0]
    grid = (num_tokens // tokens_per_block + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q, seq_lens,
        num_seqs, qk_scale, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, DOT_DTYPE=dot_dtype, PRECISION=precision,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
