"""Triton MoE for decode batches: routing, then the routed experts in two weight-streaming kernels.

    route(logits, k, renormalize)   one program per token: softmax (float32) over its E (finite) logits, the k
                                    largest by k rounds of max over the logits (ties: the lower expert index
                                    first, then the next round takes the other), divided by their sum where
                                    renormalize
    fused_experts(...)              _align_kernel -> _gate_up_kernel (A) -> _down_kernel (B) -> _combine_kernel
    combine(...)                    _combine_kernel alone, gathering: the sum of the grouped matmul's expert outputs
                                    (prefill-sized batches, ops.moe.experts)
    fused_moe(...)                  the same launches less the routing kernel, with the shared expert as a slot
    (one token, tiles)              A -> B, the combine inside B: a column tile's last slot to finish sums them
    (one token, tiles.gemv)         _gate_up_row_kernel (A1) -> _down_row_kernel (B1, the combine inside)

Why this shape (bandwidth). A decode step of 35B-A3B at one token reads per MoE layer 8 experts x 3 x 512 x 2048
bf16 = 50 MB of expert weights and next to nothing else: the limit is bytes / bandwidth, ~10.5 us at 4.8 TB/s.
With T tokens the bytes are those of the DISTINCT selected experts (at most min(E, T*k)), read once each, so the
pairs (token, expert) are grouped by expert and every program owns one expert's weight tile and all of that
expert's pairs: W tile [BLOCK_N, BLOCK_K] times the gathered activations' tile [BLOCK_K, BLOCK_M] on tl.dot, the
pairs padded to BLOCK_M >= 16 (tl.dot's least side). A token picks an expert at most once, so an expert has at
most T pairs and BLOCK_M >= T (the default tiles, configs.py) gives each expert one block: its weights cross HBM
once whatever the batch. Compared with a per-pair GEMV (no padding, but one weight read per pair), the padded
tensor-core tile costs nothing at these sizes (the MMA units idle for want of bytes) and keeps the read-once
property at 64 tokens, where 35B-A3B's 512 pairs fall on ~220 of 256 experts.

The grouping runs on the device without a host sync, so a step captures into a CUDA graph: _align_kernel counts the
pairs per expert (in every program, by histograms: no program waits for another), lays the pairs out sorted by
(expert, pair index), a range of chunks a program (at most ALIGN_PAIR_PROGRAMS programs, so that the counting,
which every program repeats, grows with the pairs and not with their square), and writes a block table (expert,
first sorted pair, valid rows) for a grid sized by the worst case, min(E, T*k) blocks (plus T*k // BLOCK_M where
BLOCK_M < T); blocks past the real count have 0 rows and exit. A single token (batch-1 decode) needs no grouping,
its k experts being distinct: block j is its pair j, and the align launch is skipped.

Kernel A: act[pair] = silu(x_t @ Wg^T) * (x_t @ Wu^T), gate_up stacked [E, 2I, H] with the gate rows first,
float32 accumulators, act rounded once to x's dtype: [T*k, I]. FP8 experts (W8A8) read x and act quantized per 128
columns: by cuda_fp8.quantize before each kernel, or at one token inside every program (QUANT_X, unless the
tiles' quant_x is off: the same bits, two launches fewer). Kernel B: y[pair] = w_pair * (act[pair] @ Wd^T), down
[E, H, I], float32 [T*k, H] (= [T, k, H]). The combine kernel sums each token's k rows in the order j = 0..k-1
and adds the gated shared expert, sigmoid(g_t) * shared_t, in float32, rounding once: no atomic sums, so graphs
equal eager bitwise, and a pair's numbers depend only on its token, its expert and the tiles (not on which other
tokens share the batch or the expert). At one token kernel B's blocks are the token's slots, and the last of them
to finish a column tile adds the tile's rows in that same order (ops/split_k.py's counter: only the arrival is
atomic), one launch fewer (unless the tiles' combine is off).

One token on the GEMV kernels (A1, B1; where the tile table's bucket-1 entry says "gemv"). A [16, BLOCK_N]
tensor-core tile wastes 15 of its 16 rows at one token, and the few programs of a tile per expert (8 experts x I /
BLOCK_N) leave the HBM idle; A1 and B1 give each program BLOCK_N rows of one slot's weight (as small as 4), multiply
them by the token elementwise in float32 and reduce once after the K loop, as ops/quant_gemm/cuda_gemv.py's one-row
kernels do (int4 and NVFP4 decoded per word as there); B1 walks the k + 1 slots for its columns and sums them in
the combine's order, and FP8 quantizes the token and the activation in the kernels (no quantize launches). Their
sums run in another order than the tiles', so a token alone on them is not bitwise itself in a batch; the routing
they fold in is the same.

fused_moe: the shared expert as one more slot. Where it has the routed experts' intermediate size, its T rows are
pairs T*k .. T*k + T - 1 of act and y, taken by cdiv(T, BLOCK_M) blocks after the routed ones (its own weight
pointers, the routed experts' row strides), kernel B weighting them by sigmoid(gate) and the combine adding row
T*k + t after the k routed ones. Its routing runs in kernel A at one token (every program routes the token, its
block b taking the b-th expert; program (0, 0) writes the ids and weights kernel B reads) and in the routing kernel
above one token (before the align kernel). The routing's sums do not depend on the tile's shape or warps (the
softmax's in fixed point, the k weights' in order), so kernel A and the routing kernel give the same bits, and a
token alone (kernel A) equals itself in a batch.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deltaserve.ops import pdl
from deltaserve.ops.moe.configs import MoeTiles
from deltaserve.ops.moe.quantized import (FP8_BLOCK, Fp8Experts, Int4Experts, Nvfp4Experts, as_stack,
                                          slot_fits)
from deltaserve.ops.pdl import wait_for_previous_kernel
from deltaserve.ops.quant_gemm.cuda_dequant import int4_codes, nvfp4_tile
from deltaserve.ops.quant_gemm import cuda_fp8
from deltaserve.ops.quant_gemm.cuda_fp8 import FP8_AMAX_FLOOR, FP8_MAX, quantize_block
from deltaserve.ops.quant_gemm.cuda_gemv import E2M1_FP16_SCALE, NVFP4_GROUP, _split8, _word_sum
from deltaserve.ops.quant_gemm.cuda_gemv import _block_k as _gemv_block_k
from deltaserve.ops.quant_gemm.cuda_gemv import INT4 as CUDA_GEMV_INT4
from deltaserve.ops.quant_gemm.cuda_gemv import NVFP4 as CUDA_GEMV_NVFP4
from deltaserve.ops.quant_gemm.cuda_weight_only import _CODES
from deltaserve.ops.split_k import arrives_last, store_split_of, sum_partials, tile_counters

ALIGN_CHUNK = 32  # pairs (and blocks) the align kernel places at once: [ALIGN_CHUNK, BLOCK_E] one-hot tiles
# pairs the align kernel counts at once, a histogram of their experts: fewer where there are, but a pair a thread at
# least, so that no pair is held by several threads (a case of the histogram's GPU lowering this code does not need)
ALIGN_COUNT = 1024
ALIGN_PAIR_PROGRAMS = 64  # the most programs placing pairs (each counts all of them; beyond, each places more)
ALIGN_WARPS = 4  # a program of the align kernel
COMBINE_BLOCK = 1024
ROUTE_WARPS = 1  # a routing kernel's program (one token)
FIXED_ONE = tl.constexpr(2.0**52)  # the routing softmax sums exp(x - max) <= 1 in this fixed point: exactly, in any order


@triton.jit
def _top_k(x, lane_ok, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
           RENORMALIZE: tl.constexpr):
    """Routing of R tokens: x [R, BE] float32 finite logits (-inf on the padding lanes, lane_ok [1, BE] False there)
    -> (ids [R, BK] int32, weights [R, BK] float32; lanes >= k hold 0). Each round is one reduction (the largest
    remaining logit and, among equal ones, the lowest index); every step is elementwise, exact (max, the softmax
    sum in 2^-52 fixed point) or in a fixed order (the k-term sum), so the result does not depend on R, on the warps
    or on the kernel it is inlined in: the routing kernel and kernel A agree bitwise."""
    es = tl.arange(0, BLOCK_E)[None, :]
    js = tl.arange(0, BLOCK_K)[None, :]
    top = tl.max(x, axis=1)  # [R]
    shifted = tl.exp(x - top[:, None])  # [R, BE] in (0, 1]; 0 on the padding lanes
    total = tl.sum((shifted * FIXED_ONE).to(tl.int64), axis=1).to(tl.float32) * (1.0 / FIXED_ONE)  # [R]
    remaining = tl.where(lane_ok, x, float("-inf"))  # [R, BE]
    chosen_w = tl.zeros([x.shape[0], BLOCK_K], dtype=tl.float32)
    chosen_id = tl.zeros([x.shape[0], BLOCK_K], dtype=tl.int32)
    kept = tl.zeros([x.shape[0]], dtype=tl.float32)  # the sum of the chosen probabilities, j = 0..k-1 in order
    for j in tl.static_range(TOP_K):
        best, expert = tl.max(remaining, axis=1, return_indices=True, return_indices_tie_break_left=True)  # [R]
        w = tl.exp(best - top) / total  # its probability, as the softmax's lane would compute it
        chosen_w = tl.where(js == j, w[:, None], chosen_w)
        chosen_id = tl.where(js == j, expert[:, None], chosen_id)
        kept += w
        remaining = tl.where(es == expert[:, None], float("-inf"), remaining)
    if RENORMALIZE:
        chosen_w = chosen_w / kept[:, None]
    return chosen_id, chosen_w


@triton.jit
def _route_rows(logits, topk_ids, topk_weights, t0, T, E, stride_t, ROWS: tl.constexpr, TOP_K: tl.constexpr,
                BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr, store):
    """Route tokens [t0, t0 + ROWS) (those < T) from logits [t, :E]; where `store`, write topk_ids / topk_weights
    [t, :k]. Returns their ids [ROWS, BK]."""
    ts = t0 + tl.arange(0, ROWS)[:, None]  # [R, 1]
    es = tl.arange(0, BLOCK_E)[None, :]
    lane_ok = es < E
    x = tl.load(logits + ts.to(tl.int64) * stride_t + es, mask=lane_ok & (ts < T), other=0.0).to(tl.float32)
    ids, weights = _top_k(tl.where(lane_ok, x, float("-inf")), lane_ok, TOP_K, BLOCK_E, BLOCK_K, RENORMALIZE)
    js = tl.arange(0, BLOCK_K)[None, :]
    ok = (js < TOP_K) & (ts < T) & store
    tl.store(topk_ids + ts * TOP_K + js, ids, mask=ok)
    tl.store(topk_weights + ts * TOP_K + js, weights, mask=ok)
    return ids


@triton.jit
def _route_kernel(logits, topk_ids, topk_weights, E, stride_t, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (T,): program t reads logits [t, :E] and writes topk_ids [t, :k] (int32), topk_weights [t, :k]."""
    wait_for_previous_kernel(PDL)
    t = tl.program_id(0)
    _route_rows(logits, topk_ids, topk_weights, t, t + 1, E, stride_t, 1, TOP_K, BLOCK_E, BLOCK_K, RENORMALIZE,
                True)


def route(logits: torch.Tensor, top_k: int, renormalize: bool, num_warps: int = ROUTE_WARPS
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] (unit last stride) -> (topk_ids [T, k] int32, topk_weights [T, k] float32), as
    reference.route; a program of num_warps a token (the same bits at any count)."""
    T, E = logits.shape
    _check_routing(logits, top_k)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=logits.device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    if T:
        _route_kernel[(T,)](logits, ids, weights, E, logits.stride(0), TOP_K=top_k,
                            BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(top_k),
                            RENORMALIZE=renormalize, num_warps=num_warps, **pdl.launch_args(logits.device))
    return ids, weights


def _check_routing(logits: torch.Tensor, top_k: int) -> None:
    if logits.stride(1) != 1 or not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"logits {tuple(logits.shape)} stride {logits.stride()}: need a unit last stride and "
                         f"1 <= top_k ({top_k}) <= E")


@triton.jit(do_not_specialize=["num_pairs", "num_blocks", "chunks_per_program"])
def _align_kernel(topk_ids, sorted_pairs, block_expert, block_first, block_rows, num_pairs, num_blocks,
                  chunks_per_program, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
                  COUNT: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (pair_programs + cdiv(num_blocks, CHUNK),): topk_ids [P] (pair p = t*k + j) -> sorted_pairs [P]: the
    pairs sorted by (expert, p); and per block b < num_blocks: block_expert [b], block_first [b] (its first
    position in sorted_pairs) and block_rows [b] (its pairs, <= BLOCK_M; 0 past the last block). Every program
    counts the pairs of each expert (all of them, and those before its own, COUNT at a time); program
    c < pair_programs = cdiv(P, CHUNK * chunks_per_program) then places its chunks_per_program chunks of CHUNK
    pairs, each later one writes CHUNK entries of the block table. Every output element is written exactly once."""
    wait_for_previous_kernel(PDL)
    c = tl.program_id(0)
    pairs_per_program = CHUNK * chunks_per_program
    pair_programs = tl.cdiv(num_pairs, pairs_per_program)
    own_start = tl.where(c < pair_programs, c * pairs_per_program, 0)  # its first pair (block programs: 0, no `before`)
    es = tl.arange(0, BLOCK_E)
    cs = tl.arange(0, CHUNK)
    ns = tl.arange(0, COUNT)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)  # pairs per expert
    before = tl.zeros([BLOCK_E], dtype=tl.int32)  # pairs per expert before this program's first
    for start in range(0, num_pairs, COUNT):
        ids = tl.load(topk_ids + start + ns, mask=start + ns < num_pairs, other=0)  # [COUNT]
        counts += tl.histogram(ids, BLOCK_E, mask=start + ns < num_pairs)
        if start < own_start:
            before += tl.histogram(ids, BLOCK_E, mask=start + ns < own_start)
    pair_end = tl.cumsum(counts, axis=0)  # [BE] end of each expert's pairs in sorted_pairs
    pair_begin = pair_end - counts
    if c < pair_programs:
        # a pair's sorted position: its expert's first, the expert's pairs in earlier chunks, the earlier ones in its
        for chunk in range(0, chunks_per_program):
            ps = own_start + chunk * CHUNK + cs
            ids = tl.load(topk_ids + ps, mask=ps < num_pairs, other=-1)  # [C]
            hit = ids[:, None] == es[None, :]  # [C, BE]
            base = tl.sum(tl.where(hit, (pair_begin + before)[None, :], 0), axis=1)  # [C]
            earlier = (ids[:, None] == ids[None, :]) & (cs[None, :] < cs[:, None])  # [C, C]: q < p, same expert
            rank = tl.sum(earlier.to(tl.int32), axis=1)
            tl.store(sorted_pairs + base + rank, ps, mask=ps < num_pairs)
            before += tl.sum(hit.to(tl.int32), axis=0)  # ids are laid out for the [C, BE] tiles here: no histogram
    else:
        blocks = (counts + BLOCK_M - 1) // BLOCK_M
        block_end = tl.cumsum(blocks, axis=0)  # [BE] end of each expert's blocks
        block_begin = block_end - blocks
        # block b belongs to the expert whose block range holds it: the count of experts ending at or before b
        bs = (c - pair_programs) * CHUNK + cs  # [C]
        expert = tl.sum((block_end[None, :] <= bs[:, None]).to(tl.int32), axis=1)  # [C]; BLOCK_E past the last
        own = expert[:, None] == es[None, :]  # [C, BE]
        first = (tl.sum(tl.where(own, pair_begin[None, :], 0), axis=1)
                 + (bs - tl.sum(tl.where(own, block_begin[None, :], 0), axis=1)) * BLOCK_M)
        end = tl.sum(tl.where(own, pair_end[None, :], 0), axis=1)
        rows = tl.where(expert < BLOCK_E, tl.minimum(end - first, BLOCK_M), 0)
        ok = bs < num_blocks
        tl.store(block_expert + bs, tl.minimum(expert, BLOCK_E - 1), mask=ok)
        tl.store(block_first + bs, tl.where(rows > 0, first, 0), mask=ok)
        tl.store(block_rows + bs, rows, mask=ok)


@triton.jit
def _block_pairs(sorted_pairs, block_first, block_rows, b, routed_blocks, T, TOP_K: tl.constexpr,
                 BLOCK_M: tl.constexpr, ONE_TOKEN: tl.constexpr):
    """Block b's pairs [BM] (0 past its rows), their tokens [BM] and their mask. Blocks b < routed_blocks are the
    routed experts' (ONE_TOKEN: the k pairs of a single token are k distinct experts, so pair b is block b and no
    align kernel ran); from routed_blocks on, the shared expert's slot: block routed_blocks + s takes the tokens
    [s*BM, (s+1)*BM), token t as pair T*k + t."""
    ms = tl.arange(0, BLOCK_M)
    if ONE_TOKEN:  # pair b of token 0, the shared slot's block k its pair k too
        m_ok = ms < 1
        pairs = b + ms * 0
        tokens = ms * 0
    elif b < routed_blocks:
        m_ok = ms < tl.load(block_rows + b)
        pairs = tl.load(sorted_pairs + tl.load(block_first + b) + ms, mask=m_ok, other=0)
        tokens = pairs // TOP_K
    else:
        tokens = (b - routed_blocks) * BLOCK_M + ms
        m_ok = tokens < T
        pairs = T * TOP_K + tokens
    return pairs, tokens, m_ok


@triton.jit
def _block_used(block_rows, b, routed_blocks, ONE_TOKEN: tl.constexpr):
    """Whether block b holds pairs (past the last routed block the align kernel wrote 0 rows; a shared block
    always holds its first token)."""
    if ONE_TOKEN:
        used = b >= 0  # always (a tensor, as the other branch's)
    else:
        used = (b >= routed_blocks) | (tl.load(block_rows + b, mask=b < routed_blocks, other=0) > 0)
    return used


PLAIN: tl.constexpr = tl.constexpr(0)  # weight formats of kernels A and B (WFORMAT)
FP8: tl.constexpr = tl.constexpr(1)
INT4: tl.constexpr = tl.constexpr(2)
NVFP4: tl.constexpr = tl.constexpr(3)


@triton.jit
def _activation_tile(cols, scale_cols, k0, ks, k_ok, m_ok, stride_xg, WFORMAT: tl.constexpr, row,
                     QUANT_X: tl.constexpr = False):
    """The activations' [BK, BM] tile (cols [1, BM]: each pair's row; ks [BK] columns, from k0) for the weight format,
    and its per-pair factor [BM]: PLAIN (the tile, unused), FP8 (the e4m3 tile the quantize kernel wrote, and its
    scales: scale_cols [BM] each row's first group, stride_xg between groups; QUANT_X, one token, whose pairs in a
    block all read one 16-bit row: that row quantized here, the bits of cuda_fp8.quantize, in every lane), INT4 (the
    tile and its column sums, float32, for the zero point), NVFP4 (the tile, unused)."""
    if WFORMAT == FP8 and QUANT_X:  # one row's 128 divisions, not the padded tile's 16 x 128
        xr = tl.load(row + ks, mask=k_ok, other=0.0).to(tl.float32)  # [BK]
        q, s = quantize_block(tl.reshape(xr, [1, xr.shape[0]]), FP8_AMAX_FLOOR, FP8_MAX)  # [1, BK], [1]
        xt = tl.broadcast_to(tl.trans(q), [xr.shape[0], cols.shape[1]])  # [BK, BM]
        factor = tl.broadcast_to(s, [cols.shape[1]])  # [BM]
    else:
        xt = tl.load(cols + ks[:, None], mask=k_ok[:, None] & m_ok[None, :], other=0.0)  # [BK, BM]
        if WFORMAT == FP8:
            factor = tl.load(scale_cols + (k0 // xt.shape[0]) * stride_xg, mask=m_ok, other=0.0)
        elif WFORMAT == INT4:
            factor = tl.sum(xt.to(tl.float32), axis=0)
        else:
            factor = tl.zeros([xt.shape[1]], dtype=tl.float32)
    return xt, factor


@triton.jit
def _weight_product(acc, weights, scales, zeros, rows, n_ok, k0, ks, k_ok, xt, factor, stride_wn, stride_sn,
                    WFORMAT: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, CODE_BASE: tl.constexpr,
                    CODE_OFFSET: tl.constexpr, EVEN: tl.constexpr, PRECISION: tl.constexpr):
    """acc [BN, BM] + W[rows, ks] @ xt for one expert's weight in its format (weights, scales, zeros: that expert's
    tensors; rows [BN] its weight rows, valid where n_ok). PLAIN: the 16-bit (or float32) tile on tl.dot. FP8: an e4m3
    tile of one 128 x 128 scale block (ks one K block) on the FP8 tensor cores, scaled by the block's and the pairs'
    scales. INT4: one scale group (ks the group), the exact codes OFFSET + q on tl.dot, zero and scale applied to the
    float32 product as ops.quant_gemm's skinny kernel does. NVFP4 (zeros: the rows' scale_2): the tile dequantized
    to the activations' dtype (cuda_dequant.nvfp4_tile) on tl.dot; ks whole, never masked (BLOCK_K divides K)."""
    BLOCK_K: tl.constexpr = xt.shape[0]
    if WFORMAT == INT4:
        codes = int4_codes(weights, rows, n_ok, k0, stride_wn, BLOCK_K, CODE_BASE, xt.dtype, not EVEN)  # [BN, BK]
        part = tl.dot(codes, xt, input_precision=PRECISION)  # [BN, BM] = sum (OFFSET + q) x
        s_offs = rows.to(tl.int64) * stride_sn + k0 // GROUP  # [BN]
        s = tl.load(scales + s_offs, mask=n_ok, other=0.0).to(tl.float32)
        if HAS_ZERO:
            z = tl.load(zeros + s_offs, mask=n_ok, other=0).to(tl.float32) + CODE_OFFSET
        else:
            z = tl.full(s.shape, 8.0 + CODE_OFFSET, tl.float32)
        acc += (part - z[:, None] * factor[None, :]) * s[:, None]
    elif WFORMAT == NVFP4:
        w = nvfp4_tile(weights, scales, zeros, rows, n_ok, k0, stride_wn, stride_sn, BLOCK_K, not EVEN, xt.dtype)
        acc = tl.dot(w, xt, acc, input_precision=PRECISION)  # [BN, BM]
    else:
        w_ptrs = weights + rows[:, None].to(tl.int64) * stride_wn + ks[None, :]  # [BN, BK]
        if EVEN:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if WFORMAT == FP8:
            s_w = tl.load(scales + (rows // GROUP).to(tl.int64) * stride_sn + k0 // BLOCK_K, mask=n_ok, other=0.0)
            acc += tl.dot(w, xt) * (s_w[:, None] * factor[None, :])  # one K block from zero
        else:
            acc = tl.dot(w, xt, acc, input_precision=PRECISION)
    return acc


@triton.jit(do_not_specialize=["routed_blocks", "T"])
def _gate_up_kernel(
    x, gate_up, shared_gate_up, act, sorted_pairs, block_expert, block_first, block_rows, routed_blocks, T, H, I,
    stride_x, stride_we, stride_wn, logits, topk_weights, E, stride_logits, scales, zeros, stride_se, stride_sn,
    stride_ze, shared_scales, shared_zeros, x_scales, partial, counters, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr, ONE_TOKEN: tl.constexpr,
    ROUTE: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOP_K: tl.constexpr,
    WFORMAT: tl.constexpr = PLAIN, GROUP: tl.constexpr = 1, HAS_ZERO: tl.constexpr = False,
    CODE_BASE: tl.constexpr = 0, CODE_OFFSET: tl.constexpr = 0.0, QUANT_X: tl.constexpr = False,
    SPLIT_K: tl.constexpr = 1, PDL: tl.constexpr = False,
):
    """Kernel A. Grid (blocks, cdiv(I, BLOCK_N), SPLIT_K): program (b, n) writes act [pair, n block] = silu(x_t Wg^T) *
    (x_t Wu^T) for block b's pairs, Wg / Wu the n block's gate / up rows of its expert's gate_up [2I, H] (the
    shared slot's: shared_gate_up [2I, H], of the routed experts' row stride). ROUTE (one token): every program
    routes the token from logits [0, :E] itself, program (0, 0) writing topk_ids (block_expert) and topk_weights
    for kernel B; no routing kernel ran. WFORMAT FP8 / INT4 / NVFP4: gate_up is the stacked experts' e4m3 weight /
    packed int4 words / packed e2m1 bytes (quantized.py), scales and zeros theirs (NVFP4's zeros: scale_2; expert
    strides stride_we, stride_se, stride_ze; row strides stride_wn, stride_sn), the shared slot's weight of that format
    with shared_scales / shared_zeros (an expert's strides); BLOCK_K the FP8 K block, the int4 group, or (NVFP4) a
    multiple of 16 that divides H. FP8: x is e4m3 [T, H] and x_scales [H / BLOCK_K, T] its scales
    (cuda_fp8.quantize: each token once, not once a program), or with QUANT_X (one token) x is 16-bit, its row
    quantized in every program (no quantize launch). SPLIT_K > 1 (one token; grid axis 2): program
    (b, n, s) sums split s of H's K blocks into partial [SPLIT_K, slots, 2I] (float32 gate and up sums), and the
    last of the tile's splits to finish (counters[b * cdiv(I, BLOCK_N) + n]) adds them in split order, then writes
    silu(gate) * up (ops/split_k.py)."""
    wait_for_previous_kernel(PDL)
    b = tl.program_id(0)
    if ROUTE:
        expert = (b * 0).to(tl.int64)
        if b < routed_blocks:  # the shared slot's programs start on their weights at once
            writes = (b == 0) & (tl.program_id(1) == 0) & (tl.program_id(2) == 0)
            ids = _route_rows(logits, block_expert, topk_weights, 0, 1, E, stride_logits, 1, TOP_K, BLOCK_E,
                              BLOCK_TOP_K, RENORMALIZE, writes)  # [1, BK]
            expert = tl.sum(tl.where(tl.arange(0, BLOCK_TOP_K)[None, :] == b, ids, 0)).to(tl.int64)
    else:
        expert = tl.load(block_expert + b, mask=b < routed_blocks, other=0).to(tl.int64)
    if _block_used(block_rows, b, routed_blocks, ONE_TOKEN):
        pairs, tokens, m_ok = _block_pairs(sorted_pairs, block_first, block_rows, b, routed_blocks, T, TOP_K,
                                           BLOCK_M, ONE_TOKEN)  # [BM] each
        weights = gate_up + expert * stride_we
        expert_scales = scales + expert * stride_se
        expert_zeros = zeros + expert * stride_ze
        if b >= routed_blocks:  # the shared slot
            weights, expert_scales, expert_zeros = shared_gate_up, shared_scales, shared_zeros
        ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] intermediate columns = gate rows
        n_ok = ns < I
        x_cols = x + tokens[None, :].to(tl.int64) * stride_x  # [1, BM] each pair's token row
        scale_cols = x_scales + tokens  # [BM] FP8: each pair's token's first K group's scale
        acc_gate = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        k_first, k_end = 0, H
        if SPLIT_K > 1:
            k_per_split = tl.cdiv(tl.cdiv(H, BLOCK_K), SPLIT_K) * BLOCK_K  # columns of H a split sums
            k_first = tl.program_id(2) * k_per_split
            k_end = tl.minimum(H, k_first + k_per_split)
        for k0 in range(k_first, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)  # [BK]
            k_ok = ks < H
            xt, factor = _activation_tile(x_cols, scale_cols, k0, ks, k_ok, m_ok, T, WFORMAT, x, QUANT_X)  # [BK, BM]
            acc_gate = _weight_product(acc_gate, weights, expert_scales, expert_zeros, ns, n_ok, k0, ks, k_ok, xt,
                                       factor, stride_wn, stride_sn, WFORMAT, GROUP, HAS_ZERO, CODE_BASE,
                                       CODE_OFFSET, EVEN_N and EVEN_K, PRECISION)
            acc_up = _weight_product(acc_up, weights, expert_scales, expert_zeros, ns + I, n_ok, k0, ks, k_ok, xt,
                                     factor, stride_wn, stride_sn, WFORMAT, GROUP, HAS_ZERO, CODE_BASE, CODE_OFFSET,
                                     EVEN_N and EVEN_K, PRECISION)
        mask = n_ok[:, None] & m_ok[None, :]
        if SPLIT_K > 1:  # this split's sums; the tile's last split adds all of them (one token: pair b's row)
            sums = partial + pairs[None, :].to(tl.int64) * (2 * I) + ns[:, None]  # [BN, BM] its gate sums
            split_stride = tl.num_programs(0) * 2 * I  # slots x 2I
            tl.store(sums + tl.program_id(2) * split_stride, acc_gate, mask=mask)
            tl.store(sums + I + tl.program_id(2) * split_stride, acc_up, mask=mask)
            tile = b * tl.num_programs(1) + tl.program_id(1)
            if arrives_last(counters, tile, SPLIT_K):
                acc_gate = sum_partials(sums, mask, split_stride, SPLIT_K)
                acc_up = sum_partials(sums + I, mask, split_stride, SPLIT_K)
                _store_silu_product(act, acc_gate, acc_up, pairs, ns, I, mask)
                tl.store(counters + tile, 0)
        else:
            _store_silu_product(act, acc_gate, acc_up, pairs, ns, I, mask)


@triton.jit
def _store_silu_product(act, acc_gate, acc_up, pairs, ns, I, mask):
    """Kernel A's output tile: act [pair, n] = silu(gate) * up of the float32 sums acc_gate, acc_up [BN, BM]."""
    out = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up  # [BN, BM]
    tl.store(act + pairs[None, :].to(tl.int64) * I + ns[:, None], out.to(act.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["routed_blocks", "T"])
def _down_kernel(
    act, down, shared_down, topk_weights, shared_gate, y, sorted_pairs, block_expert, block_first, block_rows,
    routed_blocks, T, H, I, stride_we, stride_wn, stride_gate, scales, zeros, stride_se, stride_sn, stride_ze,
    shared_scales, shared_zeros, act_scales, num_slots, out, counters, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr, ONE_TOKEN: tl.constexpr,
    WFORMAT: tl.constexpr = PLAIN, GROUP: tl.constexpr = 1, HAS_ZERO: tl.constexpr = False,
    CODE_BASE: tl.constexpr = 0, CODE_OFFSET: tl.constexpr = 0.0, QUANT_X: tl.constexpr = False,
    COMBINE: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """Kernel B. Grid (blocks, cdiv(H, BLOCK_N)): program (b, n) writes y [pair, n block] (float32) =
    w_pair * act[pair] Wd^T for block b's pairs, Wd the n block's rows of its expert's down [H, I]; in the shared
    slot Wd from shared_down [H, I] (the routed experts' row stride) and w = sigmoid(shared_gate [t]). WFORMAT: as
    kernel A's; FP8: act is e4m3 [num_slots, I] and act_scales [I / BLOCK_K, num_slots] its scales, or with
    QUANT_X (one token: block b is pair b) act is 16-bit, row b quantized in every program. COMBINE (one token, its
    slots the grid's blocks): the last of a column tile's blocks to finish adds the tile's y rows in slot order into
    out [1, H] (ops/split_k.py: the combine kernel's sum, no launch of its own; counters: one a column tile)."""
    wait_for_previous_kernel(PDL)
    b = tl.program_id(0)
    if _block_used(block_rows, b, routed_blocks, ONE_TOKEN):
        pairs, tokens, m_ok = _block_pairs(sorted_pairs, block_first, block_rows, b, routed_blocks, T, TOP_K,
                                           BLOCK_M, ONE_TOKEN)  # [BM] each
        expert = tl.load(block_expert + b, mask=b < routed_blocks, other=0).to(tl.int64)
        weights = down + expert * stride_we
        expert_scales = scales + expert * stride_se
        expert_zeros = zeros + expert * stride_ze
        if b < routed_blocks:
            pair_weight = tl.load(topk_weights + pairs, mask=m_ok, other=0.0)  # [BM] float32
        else:  # the shared slot
            weights, expert_scales, expert_zeros = shared_down, shared_scales, shared_zeros
            gate = tl.load(shared_gate + tokens.to(tl.int64) * stride_gate, mask=m_ok, other=0.0).to(tl.float32)
            pair_weight = 1.0 / (1.0 + tl.exp(-gate))
        ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] hidden columns = down rows
        n_ok = ns < H
        a_cols = act + pairs[None, :].to(tl.int64) * I  # [1, BM]
        scale_cols = act_scales + pairs  # [BM] FP8: each pair's first K group's scale
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)  # [BK]
            k_ok = ks < I
            at, factor = _activation_tile(a_cols, scale_cols, k0, ks, k_ok, m_ok, num_slots, WFORMAT, act + b * I,
                                          QUANT_X)
            acc = _weight_product(acc, weights, expert_scales, expert_zeros, ns, n_ok, k0, ks, k_ok, at, factor,
                                  stride_wn, stride_sn, WFORMAT, GROUP, HAS_ZERO, CODE_BASE, CODE_OFFSET,
                                  EVEN_N and EVEN_K, PRECISION)
        if COMBINE:  # slot b's row b of y, then the tile's last slot sums rows 0 .. blocks - 1 into out
            lanes = pairs[None, :] * 0  # [1, BM]: the tile's lanes, of which only the first holds the token
            store_split_of(acc * pair_weight[None, :], out + ns[:, None] + lanes, y + ns[:, None] + lanes,
                           n_ok[:, None] & m_ok[None, :], H, counters, tl.program_id(1), b, tl.num_programs(0))
        else:
            tl.store(y + pairs[None, :].to(tl.int64) * H + ns[:, None], acc * pair_weight[None, :],
                     mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def _combine_kernel(y, out, shared, shared_gate, pair_rows, topk_weights, H, stride_out, stride_shared, stride_gate,
                    TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, SHARED_SLOT: tl.constexpr, GATHER: tl.constexpr,
                    BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (T, cdiv(H, BLOCK)): out [t] = sum_{j=0..k-1} y [t, j] (in that order) + the shared expert: HAS_SHARED
    sigmoid(shared_gate [t]) * shared [t], SHARED_SLOT the shared slot's row y [T*k + t] (gated in kernel B); in
    float32, rounded once to out's dtype. GATHER (the grouped matmul's y, unweighted and sorted by expert): the
    term j is topk_weights [t*k + j] * y [pair_rows [t*k + j]] instead."""
    wait_for_previous_kernel(PDL)
    t = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = hs < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        if GATHER:
            row = tl.load(pair_rows + t * TOP_K + j).to(tl.int64)
            acc += tl.load(topk_weights + t * TOP_K + j) * tl.load(y + row * H + hs, mask=ok, other=0.0).to(tl.float32)
        else:
            acc += tl.load(y + (t * TOP_K + j) * H + hs, mask=ok, other=0.0)
    if HAS_SHARED:
        gate = tl.load(shared_gate + t * stride_gate).to(tl.float32)
        acc += tl.load(shared + t * stride_shared + hs, mask=ok, other=0.0).to(tl.float32) / (1.0 + tl.exp(-gate))
    if SHARED_SLOT:
        acc += tl.load(y + (tl.num_programs(0) * TOP_K + t) * H + hs, mask=ok, other=0.0)
    tl.store(out + t * stride_out + hs, acc.to(out.dtype.element_ty), mask=ok)


def combine(y: torch.Tensor, pair_rows: torch.Tensor, topk_weights: torch.Tensor,
            shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """reference.combine in one launch: y [P, H] (unit strides), pair_rows [T*k], topk_weights [T, k]; shared:
    (output [T, H], gate logits [T, 1]) or None -> [T, H] in y.dtype, the k terms summed in float32 in order."""
    T, k = topk_weights.shape
    H = y.shape[1]
    if not y.is_contiguous() or pair_rows.shape != (T * k,):
        raise ValueError(f"combine takes a contiguous y and pair_rows [{T * k}], got y {tuple(y.shape)} stride "
                         f"{y.stride()} and pair_rows {tuple(pair_rows.shape)}")
    out = torch.empty(T, H, dtype=y.dtype, device=y.device)
    if T == 0:
        return out
    weights = topk_weights.reshape(-1).to(torch.float32)  # [T*k]
    shared_out, gate = shared if shared is not None else (out, out)  # unread without HAS_SHARED
    _combine_kernel[(T, triton.cdiv(H, COMBINE_BLOCK))](
        y, out, shared_out, gate, pair_rows.contiguous(), weights, H, out.stride(0), shared_out.stride(0),
        gate.stride(0), TOP_K=k, HAS_SHARED=shared is not None, SHARED_SLOT=False, GATHER=True, BLOCK=COMBINE_BLOCK,
        **pdl.launch_args(y.device))
    return out


@triton.jit
def _row_acc(BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WFORMAT: tl.constexpr, GROUP: tl.constexpr):
    """The one-token kernels' float32 accumulator: [BN, BK] elementwise products (PLAIN, FP8), or [BN, groups,
    words of a group] word sums (INT4, NVFP4: GROUP its scale group), reduced once after the K loop."""
    if WFORMAT == INT4 or WFORMAT == NVFP4:
        acc = tl.zeros([BLOCK_N, BLOCK_K // GROUP, GROUP // 8], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    return acc


@triton.jit
def _row_activation(row, k0, K, BLOCK_K: tl.constexpr, WFORMAT: tl.constexpr, GROUP: tl.constexpr,
                    EVEN_K: tl.constexpr):
    """Columns [k0, k0 + BK) of one 16-bit activation row as the one-token kernels take them, float32: [BK]
    (PLAIN; FP8 quantized here per 128 columns, BK a multiple of 128, as cuda_fp8.quantize would: its e4m3 codes
    times their scales), or (INT4, NVFP4) the 8 nibble positions' columns, each [1, groups, words]."""
    ks = k0 + tl.arange(0, BLOCK_K)
    if WFORMAT == INT4 or WFORMAT == NVFP4:  # K a multiple of BLOCK_K
        x3 = tl.reshape(tl.load(row + ks).to(tl.float32), [BLOCK_K // GROUP, GROUP // 8, 8])
        c0, c1, c2, c3, c4, c5, c6, c7 = _split8(x3)
        xv = (c0[None], c1[None], c2[None], c3[None], c4[None], c5[None], c6[None], c7[None])
    else:
        if EVEN_K:
            xv = tl.load(row + ks).to(tl.float32)
        else:
            xv = tl.load(row + ks, mask=ks < K, other=0.0).to(tl.float32)
        if WFORMAT == FP8:
            q, scale = quantize_block(tl.reshape(xv, [BLOCK_K // GROUP, GROUP]), FP8_AMAX_FLOOR, FP8_MAX)
            xv = tl.reshape(q.to(tl.float32) * scale[:, None], [BLOCK_K])
    return xv


@triton.jit
def _row_step(acc, weights, scales, zeros, n0, N, K, k0, xv, stride_wn, stride_sn, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, WFORMAT: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
              EVEN: tl.constexpr):
    """acc + rows [n0, n0 + BN) of one weight [N, K] (its format's tensors) times the activation's columns xv
    (_row_activation) over [k0, k0 + BK), elementwise in float32. FP8: BN rows inside one 128-row scale block
    (scales [N / 128, K / 128]); INT4: words [N, K/8] int32, scales and zero points [N, K / GROUP]; NVFP4: e2m1
    bytes read as words [N, K/8], e4m3 scales [N, K/16] (scale_2 applied by _row_sum)."""
    ns = n0 + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    if WFORMAT == INT4 or WFORMAT == NVFP4:
        WPG: tl.constexpr = GROUP // 8
        gs = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)  # [GPI]
        word_ids = gs[:, None] * WPG + tl.arange(0, WPG)[None, :]  # [GPI, WPG]
        w_ptrs = weights + ns[:, None, None].to(tl.int64) * stride_wn + word_ids[None, :, :]
        s_ptrs = scales + ns[:, None].to(tl.int64) * stride_sn + gs[None, :]  # [BN, GPI]
        word = tl.load(w_ptrs, mask=n_ok[:, None, None], other=0)  # [BN, GPI, WPG]
        s = tl.load(s_ptrs, mask=n_ok[:, None], other=0.0).to(tl.float32)[:, :, None]
        if WFORMAT == INT4 and HAS_ZERO:
            z = tl.load(zeros + ns[:, None].to(tl.int64) * stride_sn + gs[None, :], mask=n_ok[:, None],
                        other=0).to(tl.float32)[:, :, None]
        else:
            z = tl.full([BLOCK_N, BLOCK_K // GROUP, 1], 8.0, tl.float32)
        if WFORMAT == INT4:
            t = _word_sum(tl.zeros(acc.shape, dtype=tl.float32), word, z, xv, CUDA_GEMV_INT4)
        else:
            t = _word_sum(tl.zeros(acc.shape, dtype=tl.float32), word, z, xv, CUDA_GEMV_NVFP4)
        acc += t * s
    else:
        ks = k0 + tl.arange(0, BLOCK_K)
        w_ptrs = weights + ns[:, None].to(tl.int64) * stride_wn + ks[None, :]  # [BN, BK]
        if EVEN:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=n_ok[:, None] & (ks < K)[None, :], other=0.0)
        a = xv
        if WFORMAT == FP8:
            a = xv * tl.load(scales + (n0 // GROUP).to(tl.int64) * stride_sn + ks // GROUP, mask=ks < K, other=0.0)
        acc += w.to(tl.float32) * a[None, :]
    return acc


@triton.jit
def _row_sum(acc, zeros, n0, N, BLOCK_N: tl.constexpr, WFORMAT: tl.constexpr):
    """The one-token kernels' accumulator reduced to the rows' products [BN] (NVFP4: times scale_2 (zeros [N])
    and the 2^14 of its fp16 decode)."""
    if WFORMAT == INT4 or WFORMAT == NVFP4:
        y = tl.sum(tl.sum(acc, axis=2), axis=1)
        if WFORMAT == NVFP4:
            ns = n0 + tl.arange(0, BLOCK_N)
            y = y * (tl.load(zeros + ns, mask=ns < N, other=0.0) * E2M1_FP16_SCALE)
    else:
        y = tl.sum(acc, axis=1)
    return y


@triton.jit(do_not_specialize=["stride_logits"])
def _gate_up_row_kernel(
    x, gate_up, shared_gate_up, act, ids, H, I, stride_we, stride_wn, logits, topk_weights, E, stride_logits,
    scales, zeros, stride_se, stride_sn, stride_ze, shared_scales, shared_zeros, TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, ROUTE: tl.constexpr,
    RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOP_K: tl.constexpr, WFORMAT: tl.constexpr = PLAIN,
    GROUP: tl.constexpr = 1, HAS_ZERO: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """Kernel A at one token, as a GEMV on the CUDA cores (a tensor-core tile would waste 15 of its 16 rows).
    Grid (k [+ 1: the shared slot], cdiv(I, BLOCK_N)): program (j, n) writes act [j, n block] = silu(x Wg^T) *
    (x Wu^T), Wg / Wu the n block's rows of expert ids [j]'s gate_up [2I, H] (slot k: shared_gate_up). ROUTE:
    every program routes the token from logits [0, :E] itself, program (0, 0) writing ids and topk_weights (as
    kernel A). Formats as kernel A's, x [1, H] 16-bit (FP8 quantizes it per 128 columns in every program: no
    quantize launch); GROUP: FP8's 128-row and -column scale block, int4's group, NVFP4's 16."""
    wait_for_previous_kernel(PDL)
    b = tl.program_id(0)
    if ROUTE:
        expert = (b * 0).to(tl.int64)
        if b < TOP_K:
            chosen = _route_rows(logits, ids, topk_weights, 0, 1, E, stride_logits, 1, TOP_K, BLOCK_E,
                                 BLOCK_TOP_K, RENORMALIZE, (b == 0) & (tl.program_id(1) == 0))  # [1, BK]
            expert = tl.sum(tl.where(tl.arange(0, BLOCK_TOP_K)[None, :] == b, chosen, 0)).to(tl.int64)
    else:
        expert = tl.load(ids + b, mask=b < TOP_K, other=0).to(tl.int64)
    weights = gate_up + expert * stride_we
    w_scales = scales + expert * stride_se
    w_zeros = zeros + expert * stride_ze
    if b >= TOP_K:  # the shared slot
        weights, w_scales, w_zeros = shared_gate_up, shared_scales, shared_zeros
    n0 = tl.program_id(1) * BLOCK_N
    acc_gate = _row_acc(BLOCK_N, BLOCK_K, WFORMAT, GROUP)
    acc_up = _row_acc(BLOCK_N, BLOCK_K, WFORMAT, GROUP)
    for k0 in range(0, H, BLOCK_K):
        xv = _row_activation(x, k0, H, BLOCK_K, WFORMAT, GROUP, EVEN_K)
        acc_gate = _row_step(acc_gate, weights, w_scales, w_zeros, n0, I, H, k0, xv, stride_wn, stride_sn,
                             BLOCK_N, BLOCK_K, WFORMAT, GROUP, HAS_ZERO, EVEN_N and EVEN_K)
        acc_up = _row_step(acc_up, weights, w_scales, w_zeros, n0 + I, 2 * I, H, k0, xv, stride_wn, stride_sn,
                           BLOCK_N, BLOCK_K, WFORMAT, GROUP, HAS_ZERO, EVEN_N and EVEN_K)
    gate = _row_sum(acc_gate, w_zeros, n0, I, BLOCK_N, WFORMAT)  # [BN]
    up = _row_sum(acc_up, w_zeros, n0 + I, 2 * I, BLOCK_N, WFORMAT)
    ns = n0 + tl.arange(0, BLOCK_N)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(act + b * I + ns, out.to(act.dtype.element_ty), mask=ns < I)


@triton.jit
def _down_row_kernel(
    act, down, shared_down, ids, topk_weights, shared, shared_gate, out, H, I, stride_we, stride_wn, scales, zeros,
    stride_se, stride_sn, stride_ze, shared_scales, shared_zeros, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, HAS_SHARED: tl.constexpr,
    SHARED_SLOT: tl.constexpr, WFORMAT: tl.constexpr = PLAIN, GROUP: tl.constexpr = 1,
    HAS_ZERO: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """Kernel B and the combine at one token, as a GEMV. Grid (cdiv(H, BLOCK_N),): program n writes out [0, n
    block] = sum over the slots j = 0..k-1 in order of w_j * act [j] Wd_j^T (Wd_j the n block's rows of expert
    ids [j]'s down [H, I], w_j topk_weights [j]), then SHARED_SLOT slot k's sigmoid(shared_gate [0]) * act [k]
    shared_down^T, or HAS_SHARED sigmoid(shared_gate [0]) * shared [0]: float32, rounded once (as the combine
    kernel). act [slots, I] 16-bit (FP8 quantizes it per 128 columns here)."""
    wait_for_previous_kernel(PDL)
    n0 = tl.program_id(0) * BLOCK_N
    ns = n0 + tl.arange(0, BLOCK_N)
    n_ok = ns < H
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in range(TOP_K + SHARED_SLOT):
        expert = tl.load(ids + j, mask=j < TOP_K, other=0).to(tl.int64)
        weights = down + expert * stride_we
        w_scales = scales + expert * stride_se
        w_zeros = zeros + expert * stride_ze
        if j < TOP_K:
            pair_weight = tl.load(topk_weights + j)
        else:  # the shared slot
            weights, w_scales, w_zeros = shared_down, shared_scales, shared_zeros
            pair_weight = 1.0 / (1.0 + tl.exp(-tl.load(shared_gate).to(tl.float32)))
        acc = _row_acc(BLOCK_N, BLOCK_K, WFORMAT, GROUP)
        for k0 in range(0, I, BLOCK_K):
            av = _row_activation(act + j * I, k0, I, BLOCK_K, WFORMAT, GROUP, EVEN_K)
            acc = _row_step(acc, weights, w_scales, w_zeros, n0, H, I, k0, av, stride_wn, stride_sn, BLOCK_N,
                            BLOCK_K, WFORMAT, GROUP, HAS_ZERO, EVEN_N and EVEN_K)
        total += _row_sum(acc, w_zeros, n0, H, BLOCK_N, WFORMAT) * pair_weight
    if HAS_SHARED:
        gate = tl.load(shared_gate).to(tl.float32)
        total += tl.load(shared + ns, mask=n_ok, other=0.0).to(tl.float32) / (1.0 + tl.exp(-gate))
    tl.store(out + ns, total.to(out.dtype.element_ty), mask=n_ok)


def num_blocks(num_experts: int, tokens: int, top_k: int, block_m: int) -> int:
    """The align kernel's block-table size: an upper bound of sum_e cdiv(pairs_e, BLOCK_M). With BLOCK_M >= T
    every selected expert is one block (min(E, T*k)); else each may add up to pairs_e // BLOCK_M more."""
    pairs = tokens * top_k
    return min(num_experts, pairs) + (0 if block_m >= tokens else pairs // block_m)


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int,
          routing: tuple[torch.Tensor, torch.Tensor, bool] | None = None, chunk: int = ALIGN_CHUNK,
          num_warps: int = ALIGN_WARPS, count: int = ALIGN_COUNT, pair_programs: int = ALIGN_PAIR_PROGRAMS
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_pairs [T*k] int32: the pairs t*k + j sorted by (expert, pair); block_table
    [3, num_blocks] int32: per block its expert, its first position in sorted_pairs and its rows, 0 past the last
    block). One launch of _align_kernel, no host sync. routing: (logits [T, E], topk_weights [T, k] float32,
    renormalize): the routing kernel first routes the tokens into topk_ids (int32) and topk_weights. chunk and count
    (powers of two), num_warps and pair_programs (the most programs placing pairs): the kernel's shape
    (benchmarks/align_probe.py times them)."""
    T, top_k = topk_ids.shape
    pairs, blocks = T * top_k, num_blocks(num_experts, T, top_k, block_m)
    sorted_pairs = torch.empty(pairs, dtype=torch.int32, device=topk_ids.device)
    block_table = torch.empty(3, blocks, dtype=torch.int32, device=topk_ids.device)
    if routing is not None:
        logits, topk_weights, renormalize = routing
        _route_kernel[(T,)](logits, topk_ids, topk_weights, num_experts, logits.stride(0), TOP_K=top_k,
                            BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_K=triton.next_power_of_2(top_k),
                            RENORMALIZE=renormalize, num_warps=ROUTE_WARPS, **pdl.launch_args(logits.device))
    ids = topk_ids.reshape(-1).to(torch.int32)  # the routing kernel's buffer itself where it routed
    chunks_per_program = triton.cdiv(triton.cdiv(pairs, chunk), pair_programs)
    grid = (triton.cdiv(pairs, chunk * chunks_per_program) + triton.cdiv(blocks, chunk),)
    _align_kernel[grid](ids, sorted_pairs, block_table[0], block_table[1], block_table[2], pairs, blocks,
                        chunks_per_program, BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(num_experts), CHUNK=chunk,
                        COUNT=max(min(count, triton.next_power_of_2(pairs)), 32 * num_warps), num_warps=num_warps,
                        **pdl.launch_args(topk_ids.device))
    return sorted_pairs, block_table


class _Operands(NamedTuple):
    """One projection's stacked experts as kernels A and B take them: the weight tensor (plain [E, N, K], e4m3
    [E, N, K], int4 words [E, N, K/8] or e2m1 bytes [E, N, K/2]), its scales and zeros (NVFP4: scale_2;
    placeholders where the format has none), the scales' expert and row strides and the zeros' expert stride, the
    format's constexprs and the K step it needs (None: the tile's; a function of the tile's for NVFP4)."""

    weight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    stride_se: int
    stride_sn: int
    stride_ze: int
    constexprs: dict
    block_k: int | None


def _operands(w, dtype: torch.dtype) -> _Operands:
    """The kernels' view of w (a plain tensor, Fp8Experts, Int4Experts or Nvfp4Experts) for activations of dtype."""
    if isinstance(w, Fp8Experts):
        scales = w.scale_inv
        return _Operands(w.weight, scales, scales, scales.stride(0), scales.stride(1), scales.stride(0),
                         dict(WFORMAT=FP8, GROUP=FP8_BLOCK[0]), FP8_BLOCK[1])
    if isinstance(w, Int4Experts):
        base, offset = _CODES[dtype]
        zeros = w.zero if w.zero is not None else w.scale
        return _Operands(w.packed, w.scale, zeros, w.scale.stride(0), w.scale.stride(1), w.scale.stride(0),
                         dict(WFORMAT=INT4, GROUP=w.group_size, HAS_ZERO=w.zero is not None, CODE_BASE=base,
                              CODE_OFFSET=offset), w.group_size)
    if isinstance(w, Nvfp4Experts):
        return _Operands(w.packed, w.scale, w.scale_2, w.scale.stride(0), w.scale.stride(1), w.scale_2.stride(0),
                         dict(WFORMAT=NVFP4, GROUP=NVFP4_GROUP), None)
    return _Operands(w, w, w, 0, 0, 0, {}, None)


def _block_k(ops: _Operands, tile_block_k: int, K: int) -> int:
    """The K step of a projection: the format's, else the tile's; NVFP4 tiles are never masked along K, so theirs
    is the largest power of two <= the tile's that divides K (K a multiple of 16: at least 16)."""
    if ops.block_k is not None:
        return ops.block_k
    if ops.constexprs.get("WFORMAT") == NVFP4:
        return math.gcd(tile_block_k, K)
    return tile_block_k


def _check_experts(x: torch.Tensor, gate_up, down, top_k: int, routing_shape) -> None:
    T, H = x.shape
    E, two_i, _ = gate_up.shape
    if gate_up.shape[2] != H or down.shape != (E, H, two_i // 2) or tuple(routing_shape) != (T, top_k):
        raise ValueError(f"x {tuple(x.shape)}, routing {tuple(routing_shape)}, gate_up {tuple(gate_up.shape)}, down "
                         f"{tuple(down.shape)} do not fit [T, H], [T, k], [E, 2I, H], [E, H, I]")
    if type(gate_up) is not type(down):
        raise ValueError(f"gate_up ({type(gate_up).__name__}) and down ({type(down).__name__}) differ in format")
    if isinstance(gate_up, torch.Tensor) and (not (x.dtype == gate_up.dtype == down.dtype)
                                              or min(x.stride(1), gate_up.stride(2), down.stride(2)) != 1):
        raise ValueError(f"x, gate_up and down need one dtype ({x.dtype}, {gate_up.dtype}, {down.dtype}) and unit "
                         "last strides")
    if isinstance(gate_up, Int4Experts) and (H % gate_up.group_size or (two_i // 2) % down.group_size):
        raise ValueError(f"int4 experts: H ({H}) and I ({two_i // 2}) must be multiples of the groups "
                         f"({gate_up.group_size}, {down.group_size})")
    if isinstance(gate_up, Fp8Experts) and (two_i // 2) % FP8_BLOCK[0]:
        raise ValueError(f"fp8 experts: I ({two_i // 2}) must be a multiple of the {FP8_BLOCK[0]}-row scale block "
                         "(gate and up rows in separate blocks)")


def _describe(w) -> str:
    """A weight for an error message: a tensor's shape, dtype and strides, else its type and shape."""
    if isinstance(w, torch.Tensor):
        return f"{tuple(w.shape)} {w.dtype} stride {w.stride()}"
    return f"{type(w).__name__} {tuple(getattr(w, 'shape', ()))}"


def fused_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up, down,
                  tiles: MoeTiles, shared: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> torch.Tensor:
    """x: [T, H]; topk_ids [T, k] (distinct experts per token); topk_weights [T, k]; gate_up [E, 2I, H] (gate rows
    first); down [E, H, I]; shared: (shared expert output [T, H], its gate logits [T, 1]) or None.
    Returns sum_j w_j expert_{id_j}(x) (+ sigmoid(gate) * shared): [T, H] in x.dtype. Any T; weights and x with
    unit last strides, of one dtype; or gate_up and down stacked quantized experts of one format (quantized.py)."""
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} differ")
    _check_experts(x, gate_up, down, topk_ids.shape[1], topk_ids.shape)
    ids = topk_ids.reshape(-1).to(torch.int32)  # [P]
    weights = topk_weights.reshape(-1).to(torch.float32)  # [P]
    return _run_experts(x, gate_up, down, tiles, ids, weights, topk_ids.shape[1], shared_output=shared)


def fused_moe(x: torch.Tensor, logits: torch.Tensor, top_k: int, renormalize: bool, gate_up, down, shared_gate_up,
              shared_down, shared_gate: torch.Tensor, tiles: MoeTiles
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The MoE block after its router: routing, the routed experts and the gated shared expert as one more slot
    of kernels A and B. x: [T, H]; logits [T, E] (unit last stride); gate_up [E, 2I, H]; down [E, H, I];
    shared_gate_up [2I, H], shared_down [H, I] (the shared expert, of the routed experts' intermediate size and row
    strides: plain tensors, or with stacked quantized experts prepared weights that quantized.slot_fits);
    shared_gate [T, 1] logits. Returns (out [T, H] = sum_j w_j expert_{id_j}(x) + sigmoid(gate) *
    shared(x) in x.dtype, topk_ids [T, k] int32, topk_weights [T, k] float32, as `route`). Launches: one token,
    kernel A (which routes) -> kernel B -> combine; more, the routing kernel and the align kernel first."""
    T, H = x.shape
    E, two_i, _ = gate_up.shape
    _check_routing(logits, top_k)
    _check_experts(x, gate_up, down, top_k, (logits.shape[0], top_k))
    fits = slot_fits(gate_up, shared_gate_up) and slot_fits(down, shared_down)
    if logits.shape[1] != E or shared_gate.shape != (T, 1) or not fits:
        raise ValueError(f"logits {tuple(logits.shape)}, shared gate {tuple(shared_gate.shape)}, shared gate_up "
                         f"{_describe(shared_gate_up)}, shared down {_describe(shared_down)} do not fit [T, E], "
                         f"[T, 1], and an expert of the routed experts ({type(gate_up).__name__}: format, shapes, "
                         "dtypes, strides)")
    ids = torch.empty(T, top_k, dtype=torch.int32, device=x.device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=x.device)
    out = _run_experts(x, gate_up, down, tiles, ids.view(-1), weights.view(-1), top_k,
                       routing=(logits, renormalize), shared_slot=(shared_gate_up, shared_down, shared_gate))
    return out, ids, weights


def _run_experts(x, gate_up, down, tiles: MoeTiles, ids, weights, top_k: int, routing=None, shared_output=None,
                 shared_slot=None) -> torch.Tensor:
    """The launches of fused_experts / fused_moe. ids [P] int32, weights [P] float32: the routing, or (routing:
    (logits, renormalize)) the buffers the kernels route into; shared_output: (output [T, H], gate [T, 1]) summed
    by the combine; shared_slot: (gate_up [2I, H], down [H, I], gate [T, 1]) run as blocks of kernels A and B
    (the weights plain, or prepared weights of the routed stacks' format)."""
    T, H = x.shape
    E, two_i, _ = gate_up.shape
    inter = two_i // 2
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    launch = pdl.launch_args(x.device)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    # the tiles are sized for 16-bit operands: float32 ones (tests) take twice the shared memory a stage
    stage_divisor = x.element_size() // 2
    pairs = T * top_k
    one_token = T == 1
    logits, renormalize = routing if routing is not None else (x, False)
    route_in_a = routing is not None and one_token  # kernel A routes the token; else the routing kernel (align)
    if one_token:  # block j = pair j = expert ids [j]: nothing to group, no align launch
        sorted_pairs, block_table, routed_blocks = ids, ids.expand(3, top_k), top_k  # of the table only row 0 is read
    else:
        sorted_pairs, block_table = align(ids.view(T, top_k), E, tiles.block_m,
                                          None if routing is None else (logits, weights, renormalize))
        routed_blocks = block_table.shape[1]
    fp8 = isinstance(gate_up, Fp8Experts)  # W8A8: the activations quantized per 128 columns
    gate_up_ops, down_ops = _operands(gate_up, x.dtype), _operands(down, x.dtype)
    if shared_slot is not None:  # its weights as one-expert stacks: pointers of the routed experts' kinds
        shared_gate_up_ops, shared_down_ops = (_operands(w if isinstance(w, torch.Tensor) else as_stack(w), x.dtype)
                                               for w in shared_slot[:2])
        shared_gate = shared_slot[2]
    else:  # placeholders, unread
        shared_gate_up_ops, shared_down_ops, shared_gate = gate_up_ops, down_ops, x
    slots = pairs + (T if shared_slot is not None else 0)  # rows of act and y: the pairs, then the shared slot's
    blocks = routed_blocks + (triton.cdiv(T, tiles.block_m) if shared_slot is not None else 0)
    act = torch.empty(slots, inter, dtype=x.dtype, device=x.device)
    shared_out, gate_out = shared_output if shared_output is not None else (out, out)  # unread without HAS_SHARED
    row_k = _row_block_ks(tiles, gate_up_ops, down_ops, H, inter) if one_token else None
    if row_k is not None:  # two launches: A1, then B1 with the combine
        _row_products(x, act, out, ids, weights, logits, renormalize, route_in_a, top_k, tiles, row_k, gate_up_ops,
                      down_ops, shared_gate_up_ops, shared_down_ops, shared_slot is not None,
                      shared_gate if shared_slot is not None else gate_out, shared_output is not None, shared_out,
                      launch)
        return out
    # kernel B's blocks are the token's slots: it sums them, where the tiles ask for it
    combine_in_b = one_token and shared_output is None and tiles.combine
    y = _tile_products(x, act, sorted_pairs, block_table, routed_blocks, blocks, slots, weights, logits, renormalize,
                       route_in_a, top_k, tiles, precision, stage_divisor, one_token, gate_up_ops, down_ops,
                       shared_gate_up_ops, shared_down_ops, shared_gate, fp8, launch, out if combine_in_b else None)
    if combine_in_b:
        return out
    _combine_kernel[(T, triton.cdiv(H, COMBINE_BLOCK))](
        y, out, shared_out, gate_out, ids, weights, H, out.stride(0), shared_out.stride(0), gate_out.stride(0),
        TOP_K=top_k, HAS_SHARED=shared_output is not None, SHARED_SLOT=shared_slot is not None, GATHER=False,
        BLOCK=COMBINE_BLOCK, **launch)
    return out


def _tile_products(x, act, sorted_pairs, block_table, routed_blocks, blocks, slots, weights, logits, renormalize,
                   route_in_a, top_k, tiles, precision, stage_divisor, one_token, gate_up_ops, down_ops,
                   shared_gate_up_ops, shared_down_ops, shared_gate, fp8, launch, out=None) -> torch.Tensor:
    """Kernels A and B on tensor-core tiles (any T): act [slots, I] filled, y [slots, H] float32 returned; with out
    (one token, its slots the blocks), kernel B also sums y's rows into out [1, H], as the combine kernel would."""
    T, H = x.shape
    E, inter = gate_up_ops.weight.shape[0], act.shape[1]
    gate_up, down = gate_up_ops.weight, down_ops.weight
    shared_gate_up, shared_down = shared_gate_up_ops.weight, shared_down_ops.weight
    tile = tiles.gate_up
    block_k = _block_k(gate_up_ops, tile.block_k, H)
    quant_x = fp8 and one_token and tiles.quant_x  # the kernels quantize their rows, no quantize launches
    x_in, x_scales = cuda_fp8.quantize(x, block_k) if fp8 and not quant_x else (x, x)  # FP8: e4m3 [T, H], [H/128, T]
    n_tiles = triton.cdiv(inter, tile.block_n)
    split_k = min(tiles.split_k, triton.cdiv(H, block_k)) if one_token else 1  # kernel A's K splits (a tile's)
    # split K: the splits' float32 gate and up sums [split_k, slots, 2I], and a counter a tile
    partial = torch.empty(split_k, blocks, 2 * inter, dtype=torch.float32, device=x.device) if split_k > 1 else act
    counters = tile_counters(x.device, blocks * n_tiles) if split_k > 1 else act
    _gate_up_kernel[(blocks, n_tiles, split_k)](
        x_in, gate_up, shared_gate_up, act, sorted_pairs, block_table[0], block_table[1], block_table[2], routed_blocks,
        T, H, inter, x_in.stride(0), gate_up.stride(0), gate_up.stride(1), logits, weights, E, logits.stride(0),
        gate_up_ops.scales, gate_up_ops.zeros, gate_up_ops.stride_se, gate_up_ops.stride_sn, gate_up_ops.stride_ze,
        shared_gate_up_ops.scales, shared_gate_up_ops.zeros, x_scales, partial, counters,
        TOP_K=top_k, BLOCK_M=tiles.block_m, BLOCK_N=tile.block_n, BLOCK_K=block_k, SPLIT_K=split_k,
        EVEN_N=inter % tile.block_n == 0, EVEN_K=H % block_k == 0, PRECISION=precision, ONE_TOKEN=one_token,
        ROUTE=route_in_a, RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(E),
        BLOCK_TOP_K=triton.next_power_of_2(top_k), QUANT_X=quant_x, num_warps=tile.warps,
        num_stages=max(1, tile.stages // stage_divisor), **gate_up_ops.constexprs, **launch)
    y = torch.empty(slots, H, dtype=torch.float32, device=x.device)  # [T, k, H], then the shared slot's [T, H]
    tile = tiles.down
    block_k = _block_k(down_ops, tile.block_k, inter)
    # FP8 above one token: e4m3 [slots, I] and its scales [I / 128, slots]
    act, act_scales = cuda_fp8.quantize(act, block_k) if fp8 and not quant_x else (act, act)
    column_tiles = triton.cdiv(H, tile.block_n)
    counters = tile_counters(x.device, column_tiles) if out is not None else y  # y: a placeholder, unread
    _down_kernel[(blocks, column_tiles)](
        act, down, shared_down, weights, shared_gate, y, sorted_pairs, block_table[0], block_table[1], block_table[2],
        routed_blocks, T, H, inter, down.stride(0), down.stride(1), shared_gate.stride(0), down_ops.scales,
        down_ops.zeros, down_ops.stride_se, down_ops.stride_sn, down_ops.stride_ze, shared_down_ops.scales,
        shared_down_ops.zeros, act_scales, slots, out if out is not None else y, counters, TOP_K=top_k,
        BLOCK_M=tiles.block_m, BLOCK_N=tile.block_n, BLOCK_K=block_k, EVEN_N=H % tile.block_n == 0,
        EVEN_K=inter % block_k == 0, PRECISION=precision, ONE_TOKEN=one_token, QUANT_X=quant_x,
        COMBINE=out is not None, num_warps=tile.warps, num_stages=max(1, tile.stages // stage_divisor),
        **down_ops.constexprs, **launch)
    return y


def _row_block_ks(tiles: MoeTiles, gate_up_ops: _Operands, down_ops: _Operands, H: int, inter: int
                  ) -> tuple[int, int] | None:
    """The K steps of the one-token row kernels (kernel A over H, kernel B over I) where the tiles ask for them
    (tiles.gemv) and fit the format, else None (the tensor-core kernels serve): FP8 row blocks inside one 128-row
    scale block; int4 / NVFP4 steps of whole scale groups that divide K."""
    if not tiles.gemv:
        return None
    steps = []
    for tile, K, ops in ((tiles.gate_up, H, gate_up_ops), (tiles.down, inter, down_ops)):
        fmt, group = ops.constexprs.get("WFORMAT", PLAIN), ops.constexprs.get("GROUP", 1)
        if fmt == FP8 and (group % tile.block_n or tile.block_k % group):  # rows in one scale block, whole K blocks
            return None
        if fmt in (INT4, NVFP4):
            step = _gemv_block_k(K, tile.block_k, group)
            if step is None or group < 8 or group & (group - 1):
                return None
            steps.append(step)
        else:
            steps.append(tile.block_k)
    return steps[0], steps[1]


def _row_constexprs(ops: _Operands) -> dict:
    """The format's constexprs the row kernels take (int4's code base and offset are the tile kernels')."""
    return {name: value for name, value in ops.constexprs.items() if name in ("WFORMAT", "GROUP", "HAS_ZERO")}


def _row_weight(ops: _Operands) -> torch.Tensor:
    """The weight as the row kernels read it: NVFP4's e2m1 bytes as int32 words (the same nibble order)."""
    return ops.weight.view(torch.int32) if ops.constexprs.get("WFORMAT") == NVFP4 else ops.weight


def _row_products(x, act, out, ids, weights, logits, renormalize, route_in_a, top_k, tiles, row_k, gate_up_ops,
                  down_ops, shared_gate_up_ops, shared_down_ops, shared_slot, shared_gate, has_shared, shared_out,
                  launch) -> None:
    """One token on the CUDA cores: _gate_up_row_kernel fills act [slots, I], _down_row_kernel writes out [1, H]
    (the combine folded in). shared_slot: act's last row is the shared expert's; has_shared: shared_out [1, H]
    gated by shared_gate [1, 1] is added."""
    _, H = x.shape
    E, inter = gate_up_ops.weight.shape[0], act.shape[1]
    gate_up, shared_gate_up = _row_weight(gate_up_ops), _row_weight(shared_gate_up_ops)
    down, shared_down = _row_weight(down_ops), _row_weight(shared_down_ops)
    tile, block_k = tiles.gate_up, row_k[0]
    _gate_up_row_kernel[(act.shape[0], triton.cdiv(inter, tile.block_n))](
        x, gate_up, shared_gate_up, act, ids, H, inter, gate_up.stride(0), gate_up.stride(1), logits, weights, E,
        logits.stride(0), gate_up_ops.scales, gate_up_ops.zeros, gate_up_ops.stride_se, gate_up_ops.stride_sn,
        gate_up_ops.stride_ze, shared_gate_up_ops.scales, shared_gate_up_ops.zeros, TOP_K=top_k,
        BLOCK_N=tile.block_n, BLOCK_K=block_k, EVEN_N=inter % tile.block_n == 0, EVEN_K=H % block_k == 0,
        ROUTE=route_in_a, RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(E),
        BLOCK_TOP_K=triton.next_power_of_2(top_k), num_warps=tile.warps, num_stages=tile.stages,
        **_row_constexprs(gate_up_ops), **launch)
    tile, block_k = tiles.down, row_k[1]
    _down_row_kernel[(triton.cdiv(H, tile.block_n),)](
        act, down, shared_down, ids, weights, shared_out, shared_gate, out, H, inter, down.stride(0), down.stride(1),
        down_ops.scales, down_ops.zeros, down_ops.stride_se, down_ops.stride_sn, down_ops.stride_ze,
        shared_down_ops.scales, shared_down_ops.zeros, TOP_K=top_k, BLOCK_N=tile.block_n, BLOCK_K=block_k,
        EVEN_N=H % tile.block_n == 0, EVEN_K=inter % block_k == 0, HAS_SHARED=has_shared, SHARED_SLOT=shared_slot,
        num_warps=tile.warps, num_stages=tile.stages, **_row_constexprs(down_ops), **launch)
