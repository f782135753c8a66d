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

Split KV (short chunks over long prefixes, e.g. a prefix-cache hit: 16 new tokens after 36,864 cached give
one query block per KV head, 4 programs on a 132-SM GPU): a third grid axis of num_splits divides each query
block's visible positions [0, last_pos + 1) into whole-tile shares. Each program writes a float32 partial
(its rows' output normalized by its own sum, and that sum's log2-sum-exp) per (token, head, split), and
`merge_splits_kernel` combines them, one program per (token, head). The decode kernel shares both halves.
num_splits comes from static sizes only (`prefill_num_splits`), so no launch reads a device value back.

Output gate (gated attention): with `gate`, the stores write o * sigmoid(gate) rounded as torch computes
`o.to(dtype) * torch.sigmoid(gate)` (`output_gate`), saving the layer two elementwise launches.
"""

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from deltaserve.device import sm_count
from deltaserve.ops import pdl
from deltaserve.ops.quant_gemm.cuda_fp8 import FP8_AMAX_FLOOR, FP8_MAX, quantize_block
from deltaserve.ops.quant_gemm.cuda_gemv import store_x_parts

__all__ = ["TileConfig", "attend_kv_range", "launch_prefill", "merge_splits_kernel", "output_gate",
           "prefill_num_splits", "prefill_query_blocks", "prefill_tiles", "split_share", "split_v_scale",
           "store_split_partial"]


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

# Split KV: only a grid below one wave of programs is split, each share over at least this many positions of
# the block_tables capacity. A share also writes and rereads BLOCK_M x head_dim float32 partials and runs its
# program's prologue: about as much as reading PREFILL_SPLIT_COST_TOKENS more positions (fitted to
# `attention_probe --prefill-split-sweep` on an H200: docs/performance.md, 'Prefill attention').
PREFILL_MIN_TOKENS_PER_SPLIT = 256
PREFILL_MAX_SPLITS = 128
PREFILL_SPLIT_COST_TOKENS = 256
MERGE_NUM_WARPS = 4

# torch's sigmoid on CUDA is 1 / (1 + expf(-x)) in float32 with IEEE division; libdevice's expf and div_rn
# reproduce it bit for bit (tl.exp and "/" are approximations). Triton's CPU interpreter has no libdevice.
_LIBDEVICE_EXP = tl.constexpr(not triton.knobs.runtime.interpret)


def prefill_tiles(head_dim_pad: int, group: int, float32_dots: bool = False) -> TileConfig:
    """The tile config for this padded head_dim, with BLOCK_M widened to hold at least one token's G heads."""
    if float32_dots:
        tiles = PREFILL_TILES_FLOAT32
    else:
        fitting = [dim for dim in sorted(PREFILL_TILES) if dim >= head_dim_pad]
        tiles = PREFILL_TILES[fitting[0] if fitting else max(PREFILL_TILES)]
    return tiles._replace(block_m=max(tiles.block_m, triton.next_power_of_2(group)))


def prefill_query_blocks(num_tokens: int, num_seqs: int, group: int, tiles: TileConfig) -> int:
    """The prefill grid's query blocks (per KV head): block_m // group tokens of one sequence each, at most one
    more per sequence for its partial block."""
    return num_tokens // (tiles.block_m // group) + num_seqs


def prefill_num_splits(num_programs: int, max_kv_len: int, device: torch.device) -> int:
    """How many programs share one query block's KV, from static quantities only (graph-safe).

    num_programs: the unsplit grid's size; max_kv_len: the longest sequence block_tables can describe (its
    width times block_size). 1 (no split) for a grid that already fills the device or a narrow table.

    A 27B prefill program (head_dim 256) holds a whole SM, so the grid runs in waves of one program per SM and
    a last wave that is barely begun costs as much as a full one. The count minimises waves x (positions per
    share + the cost of a share): 16 tokens after 36,864 cached (4 programs) take 33 shares, one wave (not the
    66 that two programs per SM would ask for), 64 tokens (16 programs) 8 (17 would make three waves), 256
    tokens (52 programs) 5, two full waves (docs/performance.md, 'Prefill attention').
    """
    sms = sm_count(device)
    if num_programs >= sms:
        return 1
    useful = max(1, min(triton.cdiv(max_kv_len, PREFILL_MIN_TOKENS_PER_SPLIT), PREFILL_MAX_SPLITS))

    def cost(splits: int) -> int:
        waves = triton.cdiv(num_programs * splits, sms)
        return waves * (triton.cdiv(max_kv_len, splits) + PREFILL_SPLIT_COST_TOKENS)

    return min(range(1, useful + 1), key=lambda splits: (cost(splits), splits))


@triton.jit
def split_share(kv_len, num_splits, MIN_TOKENS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Cut KV positions [0, kv_len) into at most num_splits shares of whole BLOCK_N tiles and at least
    MIN_TOKENS positions each. Returns (tokens_per_split, the number of non-empty shares: 0 when kv_len is 0)."""
    tokens_per_split = tl.cdiv(tl.maximum(tl.cdiv(kv_len, num_splits), MIN_TOKENS), BLOCK_N) * BLOCK_N
    return tokens_per_split, tl.cdiv(kv_len, tokens_per_split)


@triton.jit
def output_gate(o, gate_ptrs, mask, DTYPE: tl.constexpr):
    """o * sigmoid(gate) in DTYPE, rounded as torch rounds `o.to(DTYPE) * torch.sigmoid(gate)` with gate in
    DTYPE: o and sigmoid(float32 gate) each rounded to DTYPE, their float32 product rounded to DTYPE.

    o: float32 block; gate_ptrs: the gate's matching block of pointers, loaded under mask.
    """
    o = o.to(DTYPE).to(tl.float32)
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    if _LIBDEVICE_EXP:
        denominator = 1.0 + libdevice.exp(-gate)
    else:
        denominator = 1.0 + tl.exp(-gate)
    sigmoid = tl.math.div_rn(tl.full(gate.shape, 1.0, tl.float32), denominator)
    return (o * sigmoid.to(DTYPE).to(tl.float32)).to(DTYPE)


def split_v_scale(v_scale: float, eight_bit_cache: bool) -> tuple[float, float]:
    """(V tile scale, output scale) whose product is v_scale, the factor the cache divided V by. An 8-bit
    cache's V tiles are multiplied in the dot's dtype (see `attend_kv_range`) by a power of two in [2^-14, 1]:
    an e4m3 value times it is exact in float16 and bf16 and cannot overflow float16 (|V| <= 448); the rest
    of v_scale multiplies the float32 output. Other caches: (1, v_scale), the tiles untouched."""
    if not eight_bit_cache:
        return 1.0, v_scale
    tile = 2.0 ** min(0, max(-14, math.floor(math.log2(v_scale))))
    return tile, v_scale / tile


@triton.jit
def attend_kv_range(
    acc, m_i, l_i, q, row_pos, kv_lo, kv_hi,
    block_table_row, k_head, v_head, stride_block, stride_slot, qk_scale, v_tile_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, MASKED: tl.constexpr, V_SCALE_IN_TILE: tl.constexpr,
):
    """Fold KV positions [kv_lo, kv_hi) of one sequence and KV head into the running (acc, m_i, l_i).

    q: [M, HEAD_DIM_PAD] in DOT_DTYPE; row_pos: [M] position of each row's query; acc: [M, HEAD_DIM_PAD],
    m_i, l_i: [M], all float32. block_table_row points at the sequence's block ids; k_head / v_head at the
    cache plus the KV head's offset; strides count elements. MASKED=False promises that every row sees every
    position of the range and that kv_lo, kv_hi are multiples of BLOCK_N (the prefix below the block's first
    query): no bounds or causal masks then.

    V_SCALE_IN_TILE (8-bit caches): each V tile is multiplied by v_tile_scale (float32, a power of two: see
    `split_v_scale`) in DOT_DTYPE before its dot. Besides dequantizing, the multiply keeps Triton from moving
    the upcast after the shared-memory staging: it would then read the 8-bit tile in the dot's transposed
    operand layout one byte at a time (byte-wide shared-memory loads, LDS.U8, in the loop: `python -m
    benchmarks.sass_probe --cache fp8` shows them, tests/benchmarks/test_sass_probe.py guards it).
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
        v = v.to(DOT_DTYPE)  # [N, D]
        if V_SCALE_IN_TILE:
            v = v * tl.cast(v_tile_scale, DOT_DTYPE)  # exact: a power of two
        acc = tl.dot(p.to(DOT_DTYPE), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def store_split_partial(partial_out, partial_lse, index, acc, m_i, l_i, out_scale, row_ok, dims,
                        HEAD_DIM: tl.constexpr):
    """Store one split's rows: the output normalized by the split's own sum, and that sum's log2-sum-exp.

    index: [M] int64 row of each tile row in the [rows, num_splits] partials; acc [M, D], m_i, l_i [M] as
    `attend_kv_range` leaves them. A row that saw no position gets output 0 and lse -inf (weight 0).
    """
    has_keys = l_i > 0  # [M]
    l_safe = tl.where(has_keys, l_i, 1.0)
    result = acc * (out_scale / l_safe)[:, None]  # [M, D]
    lse = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))  # log2 domain, like m_i
    tl.store(partial_lse + index, lse, mask=row_ok)
    mask = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
    tl.store(partial_out + index[:, None] * HEAD_DIM + dims[None, :], result, mask=mask)


@triton.jit(do_not_specialize=["num_splits", "num_tokens"])
def merge_splits_kernel(
    out, partial_out, partial_lse, cu_seqlens_q, seq_lens, gate, num_heads, num_splits,
    stride_o_tok, stride_o_head, stride_g_tok, stride_g_head, xq, sx, x_parts, x_scale, v_sum, num_tokens,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, MIN_TOKENS_PER_SPLIT: tl.constexpr = 0,
    BLOCK_N: tl.constexpr = 0, MERGE_SPLIT_BLOCK: tl.constexpr = 16, QUANT_BLOCK: tl.constexpr = 0,
    PARTS_GROUP: tl.constexpr = 0, PARTS_LOW_HIGH: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """Grid (rows, n_heads): out[token, head] = sum_s w_s * partial_s, w_s proportional to 2^lse_s.

    partial_out: [rows, n_heads, num_splits, HEAD_DIM] and partial_lse: [rows, n_heads, num_splits] float32.
    Row r is token r when cu_seqlens_q is None (split prefill: all num_splits partials, those past the end
    empty); otherwise sequence r, whose one query token is cu_seqlens_q[r] (decode; a sequence without a
    query is skipped) and whose partials are only the first active ones of
    split_share(seq_lens[r], num_splits, MIN_TOKENS_PER_SPLIT, BLOCK_N), as the decode kernel wrote them.
    gate: None, or [T, n_heads, HEAD_DIM] (strides given): out is then o * sigmoid(gate) (`output_gate`).
    For the output projection's input (HEAD_DIM a power of two), as the kernels before it would make it (xq .. v_sum
    None where not asked for): QUANT_BLOCK (dividing HEAD_DIM) writes the rows quantized for its FP8 product
    instead of out, codes to xq [num_tokens, n_heads * HEAD_DIM] and scales to sx [n_heads * HEAD_DIM /
    QUANT_BLOCK, num_tokens] (cuda_fp8.quantize's); PARTS_GROUP (one token, dividing HEAD_DIM) writes out and the
    row's fixed-point parts for its dp4a GEMV to x_parts, x_scale and v_sum (cuda_gemv.store_x_parts).
    """
    pdl.wait_for_previous_kernel(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    if cu_seqlens_q is None:
        token = row
        num_active = num_splits
    else:
        token = tl.load(cu_seqlens_q + row)
        if tl.load(cu_seqlens_q + row + 1) == token:
            return
        seq_len = tl.load(seq_lens + row).to(tl.int32)
        _, num_active = split_share(seq_len, num_splits, MIN_TOKENS_PER_SPLIT, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    first = (row * num_heads + head).to(tl.int64) * num_splits
    acc = tl.zeros([HEAD_DIM_PAD], dtype=tl.float32)
    lse_max = float("-inf")
    weight_sum = 0.0
    # The same online rescaling as the attention loop, MERGE_SPLIT_BLOCK splits per load: decode at batch 1
    # over a long sequence has ~66 splits, and one dependent load per split would make the merge latency-bound.
    for start in range(0, num_active, MERGE_SPLIT_BLOCK):
        splits = start + tl.arange(0, MERGE_SPLIT_BLOCK)  # [SB]
        split_ok = splits < num_active
        lse = tl.load(partial_lse + first + splits, mask=split_ok, other=float("-inf"))  # [SB]
        new_max = tl.maximum(lse_max, tl.max(lse, axis=0))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp2(lse_max - shift)
        weights = tl.exp2(lse - shift)  # [SB], 0 for empty or missing splits
        parts = tl.load(partial_out + (first + splits)[:, None] * HEAD_DIM + dims[None, :],
                        mask=split_ok[:, None] & dim_ok[None, :], other=0.0)  # [SB, D]
        acc = acc * rescale + tl.sum(weights[:, None] * parts, axis=0)
        weight_sum = weight_sum * rescale + tl.sum(weights, axis=0)
        lse_max = new_max
    # weight_sum is 0 only for a query with no keys at all (seq_len 0): write zeros, not NaN.
    result = acc / tl.where(weight_sum > 0, weight_sum, 1.0)  # [D]
    if gate is None:
        result = result.to(out.dtype.element_ty)
    else:
        g_row = token.to(tl.int64) * stride_g_tok + head * stride_g_head
        result = output_gate(result, gate + g_row + dims, dim_ok, out.dtype.element_ty)
    if QUANT_BLOCK:  # the head's HEAD_DIM / QUANT_BLOCK scale groups of the token's row
        GROUPS: tl.constexpr = HEAD_DIM // QUANT_BLOCK
        codes, scales = quantize_block(tl.reshape(result.to(tl.float32), [GROUPS, QUANT_BLOCK]), FP8_AMAX_FLOOR,
                                       FP8_MAX)
        tl.store(xq + (token.to(tl.int64) * num_heads + head) * HEAD_DIM + dims, tl.reshape(codes, [HEAD_DIM]))
        tl.store(sx + (head * GROUPS + tl.arange(0, GROUPS)) * num_tokens + token, scales)
    else:
        tl.store(out + token.to(tl.int64) * stride_o_tok + head * stride_o_head + dims, result, mask=dim_ok)
    if PARTS_GROUP:  # the head's groups of the one token's row
        PARTS_GROUPS: tl.constexpr = HEAD_DIM // PARTS_GROUP
        store_x_parts(tl.reshape(result.to(tl.float32), [PARTS_GROUPS, PARTS_GROUP]), x_parts, x_scale, v_sum,
                      head * PARTS_GROUPS, num_heads * PARTS_GROUPS, num_heads * HEAD_DIM // 8, PARTS_GROUPS,
                      PARTS_GROUP, PARTS_LOW_HIGH)


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


@triton.jit(do_not_specialize=["num_seqs", "num_splits", "stride_table"])  # as _decode_split_kernel's
def _prefill_kernel(
    q, k_cache, v_cache, out, partial_out, partial_lse, block_tables, cu_seqlens_q, seq_lens, gate,
    num_seqs, num_heads, num_splits, qk_scale, v_tile_scale, v_out_scale,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head, stride_g_tok, stride_g_head,
    stride_block, stride_slot, stride_kv_head, stride_table,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    SPLIT_KV: tl.constexpr, V_SCALE_IN_TILE: tl.constexpr, PDL: tl.constexpr = False,
):
    """Grid (T // tokens_per_block + N, n_kv, num_splits). Writes out rows of the program's tokens x G heads
    (times sigmoid(gate) unless gate is None); with SPLIT_KV, their partials over its split instead:
    partial_out [T, n_heads, num_splits, hd] and partial_lse [T, n_heads, num_splits] (num_splits is 1 and
    the partials None without it), and the merge applies the gate."""
    pdl.wait_for_previous_kernel(PDL)
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
    if SPLIT_KV:
        # This program's share of [0, last_pos + 1): whole BLOCK_N tiles from kv_lo, so the unmasked part
        # [kv_lo, unmasked_end) starts and ends on tile multiples and stays below full_end. Every split
        # writes its partial (empty past the end): the merge reads all num_splits of them.
        split = tl.program_id(2)
        tokens_per_split, _ = split_share(last_pos + 1, num_splits, BLOCK_N, BLOCK_N)
        kv_lo = split * tokens_per_split
        unmasked_end = tl.minimum(full_end, kv_lo + tokens_per_split)  # < kv_lo when the split lies above
        masked_start = tl.maximum(kv_lo, unmasked_end)
        kv_hi = tl.minimum(kv_lo + tokens_per_split, last_pos + 1)  # <= kv_lo for splits past the end
    else:
        kv_lo, unmasked_end, masked_start, kv_hi = 0, full_end, full_end, last_pos + 1
    # The stored V was divided by v_scale: the tiles and the output multiply it back (`split_v_scale`).
    acc, m_i, l_i = attend_kv_range(
        acc, m_i, l_i, q_tile, row_pos, kv_lo, unmasked_end, table_row, k_head, v_head, stride_block,
        stride_slot, qk_scale, v_tile_scale, HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_N, DOT_DTYPE, PRECISION,
        MASKED=False, V_SCALE_IN_TILE=V_SCALE_IN_TILE,
    )
    acc, m_i, l_i = attend_kv_range(
        acc, m_i, l_i, q_tile, row_pos, masked_start, kv_hi, table_row, k_head, v_head, stride_block,
        stride_slot, qk_scale, v_tile_scale, HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_N, DOT_DTYPE, PRECISION,
        MASKED=True, V_SCALE_IN_TILE=V_SCALE_IN_TILE,
    )
    if SPLIT_KV:
        index = ((q_start + tokens).to(tl.int64) * num_heads + heads) * num_splits + split  # [M]
        store_split_partial(partial_out, partial_lse, index, acc, m_i, l_i, v_out_scale, row_ok, dims, HEAD_DIM)
    else:
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        result = acc * (v_out_scale / l_safe)[:, None]  # [M, D]
        o_rows = (q_start + tokens).to(tl.int64) * stride_o_tok + heads * stride_o_head  # [M]
        if gate is None:
            result = result.to(out.dtype.element_ty)
        else:
            g_rows = (q_start + tokens).to(tl.int64) * stride_g_tok + heads * stride_g_head  # [M]
            result = output_gate(result, gate + g_rows[:, None] + dims[None, :], q_mask, out.dtype.element_ty)
        tl.store(out + o_rows[:, None] + dims[None, :], result, mask=q_mask)


def launch_prefill(q, k_cache, v_cache, out, block_tables, cu_seqlens_q, seq_lens, qk_scale: float,
                   v_scale: float, dot_dtype, precision: str, num_splits: int | None = None, gate=None) -> None:
    """Fill out [T, n_heads, hd] with causal paged attention; shapes as `reference.paged_attention`.

    qk_scale already holds log2(e) and the K scale; q, out, the caches, block_tables and gate have unit stride
    in their last dimension, and both caches share strides. num_splits: None plans it with
    `prefill_num_splits`; 1 runs the unsplit kernel. gate: None or [T, n_heads, hd] in out's dtype; out then
    holds o * sigmoid(gate).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs every dimension >= 16
    tiles = prefill_tiles(head_dim_pad, group, float32_dots=dot_dtype == tl.float32)
    num_seqs = block_tables.shape[0]
    num_query_blocks = prefill_query_blocks(num_tokens, num_seqs, group, tiles)
    if num_splits is None:
        max_kv_len = block_tables.shape[1] * block_size
        num_splits = prefill_num_splits(num_query_blocks * num_kv_heads, max_kv_len, q.device)
    split_kv = num_splits > 1
    if split_kv:
        partial_out = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        partial_lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        partial_out = partial_lse = None
    gate_strides = (0, 0) if gate is None else gate.stride()[:2]
    _prefill_kernel[(num_query_blocks, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, partial_out, partial_lse, block_tables, cu_seqlens_q, seq_lens,
        None if split_kv else gate, num_seqs, num_heads, num_splits, qk_scale,
        *split_v_scale(v_scale, k_cache.element_size() == 1),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *gate_strides,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, DOT_DTYPE=dot_dtype, PRECISION=precision, SPLIT_KV=split_kv,
        V_SCALE_IN_TILE=k_cache.element_size() == 1, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **pdl.launch_args(q.device),
    )
    if split_kv:
        merge_splits_kernel[(num_tokens, num_heads)](
            out, partial_out, partial_lse, None, None, gate, num_heads, num_splits, out.stride(0), out.stride(1),
            *gate_strides, None, None, None, None, None, num_tokens, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            num_warps=MERGE_NUM_WARPS,
            **pdl.launch_args(q.device),
        )
