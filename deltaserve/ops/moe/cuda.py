"""Triton MoE for decode batches: routing, then the routed experts in two weight-streaming kernels.

    route(logits, k, renormalize)   one program per token: softmax (float32) over its E logits, the k largest
                                    probabilities by k rounds of max (ties: the lower expert index first, then
                                    the next round takes the other), divided by their sum where renormalize
    fused_experts(...)              _align_kernel -> _gate_up_kernel (A) -> _down_kernel (B) -> _combine_kernel

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

The grouping runs on the device without a host sync, so a step captures into a CUDA graph: _align_kernel (one
program) counts the pairs per expert, lays the pairs out sorted by (expert, pair index) and writes a block table
(expert, first sorted pair, valid rows) for a grid sized by the worst case, min(E, T*k) blocks (plus T*k //
BLOCK_M where BLOCK_M < T); blocks past the real count have 0 rows and exit. A single token (batch-1 decode)
needs no grouping, its k experts being distinct: block j is its pair j, and the align launch is skipped.

Kernel A: act[pair] = silu(x_t @ Wg^T) * (x_t @ Wu^T), gate_up stacked [E, 2I, H] with the gate rows first,
float32 accumulators, act rounded once to x's dtype: [T*k, I]. Kernel B: y[pair] = w_pair * (act[pair] @ Wd^T),
down [E, H, I], float32 [T*k, H] (= [T, k, H]). The combine kernel sums each token's k rows in the order j = 0..k-1
and adds the gated shared expert, sigmoid(g_t) * shared_t, in float32, rounding once: no atomics, so graphs equal
eager bitwise, and a pair's numbers depend only on its token, its expert and the tiles (not on which other tokens
share the batch or the expert).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.ops import pdl
from deltaserve.ops.moe.configs import MoeTiles
from deltaserve.ops.pdl import wait_for_previous_kernel

ALIGN_CHUNK = 32  # pairs (and blocks) the align kernel compares at once: [ALIGN_CHUNK, BLOCK_E] one-hot tiles
COMBINE_BLOCK = 1024


@triton.jit
def _route_kernel(logits, topk_ids, topk_weights, E, stride_t, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (T,): program t reads logits [t, :E] and writes topk_ids [t, :k] (int32), topk_weights [t, :k]."""
    wait_for_previous_kernel(PDL)
    t = tl.program_id(0).to(tl.int64)
    es = tl.arange(0, BLOCK_E)
    ok = es < E
    x = tl.load(logits + t * stride_t + es, mask=ok, other=float("-inf")).to(tl.float32)  # [BE]
    p = tl.exp(x - tl.max(x, axis=0))
    probs = p / tl.sum(p, axis=0)
    remaining = tl.where(ok, probs, -1.0)  # padding lanes below every probability
    js = tl.arange(0, BLOCK_K)
    chosen_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    chosen_id = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(remaining, axis=0)
        expert = tl.min(tl.where(remaining == best, es, BLOCK_E), axis=0)  # the lowest index among ties
        chosen_w = tl.where(js == j, best, chosen_w)
        chosen_id = tl.where(js == j, expert, chosen_id)
        remaining = tl.where(es == expert, -1.0, remaining)
    if RENORMALIZE:
        chosen_w = chosen_w / tl.sum(chosen_w, axis=0)  # lanes >= k hold 0
    tl.store(topk_ids + t * TOP_K + js, chosen_id, mask=js < TOP_K)
    tl.store(topk_weights + t * TOP_K + js, chosen_w, mask=js < TOP_K)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] (unit last stride) -> (topk_ids [T, k] int32, topk_weights [T, k] float32), as
    reference.route."""
    T, E = logits.shape
    if logits.stride(1) != 1 or not 1 <= top_k <= E:
        raise ValueError(f"logits {tuple(logits.shape)} stride {logits.stride()}: need a unit last stride and "
                         f"1 <= top_k ({top_k}) <= E")
    ids = torch.empty(T, top_k, dtype=torch.int32, device=logits.device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    if T:
        _route_kernel[(T,)](logits, ids, weights, E, logits.stride(0), TOP_K=top_k,
                            BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(top_k),
                            RENORMALIZE=renormalize, **pdl.launch_args(logits.device))
    return ids, weights


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _align_kernel(topk_ids, sorted_pairs, block_expert, block_first, block_rows, num_pairs, num_blocks,
                  BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (1,). topk_ids [P] (pair p = t*k + j) -> sorted_pairs [P]: the pairs sorted by (expert, p); and per
    block b < num_blocks: block_expert [b], block_first [b] (its first position in sorted_pairs) and block_rows [b]
    (its pairs, <= BLOCK_M; 0 past the last block). Every output element is written exactly once."""
    wait_for_previous_kernel(PDL)
    es = tl.arange(0, BLOCK_E)
    cs = tl.arange(0, CHUNK)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)  # pairs per expert
    for start in range(0, num_pairs, CHUNK):
        ids = tl.load(topk_ids + start + cs, mask=start + cs < num_pairs, other=-1)  # [C]
        counts += tl.sum((ids[:, None] == es[None, :]).to(tl.int32), axis=0)
    pair_end = tl.cumsum(counts, axis=0)  # [BE] end of each expert's pairs in sorted_pairs
    pair_begin = pair_end - counts
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, axis=0)  # [BE] end of each expert's blocks
    block_begin = block_end - blocks
    # each pair's sorted position: its expert's next free position + earlier pairs of that expert in its chunk
    next_free = pair_begin
    for start in range(0, num_pairs, CHUNK):
        ps = start + cs
        ids = tl.load(topk_ids + ps, mask=ps < num_pairs, other=-1)  # [C]
        hit = ids[:, None] == es[None, :]  # [C, BE]
        base = tl.sum(tl.where(hit, next_free[None, :], 0), axis=1)  # [C]
        earlier = (ids[:, None] == ids[None, :]) & (cs[None, :] < cs[:, None])  # [C, C]: q < p, same expert
        rank = tl.sum(earlier.to(tl.int32), axis=1)
        tl.store(sorted_pairs + base + rank, ps, mask=ps < num_pairs)
        next_free += tl.sum(hit.to(tl.int32), axis=0)
    # block b belongs to the expert whose block range holds it: the count of experts ending at or before b
    for start in range(0, num_blocks, CHUNK):
        bs = start + cs  # [C]
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
def _block_pairs(sorted_pairs, block_expert, block_first, block_rows, b, BLOCK_M: tl.constexpr,
                 ONE_TOKEN: tl.constexpr):
    """Block b's expert (int64), pairs [BLOCK_M] (0 past its rows) and their mask. ONE_TOKEN: the k pairs of a
    single token are k distinct experts, so pair b is block b, its expert block_expert [b] (topk_ids itself) and no
    align kernel ran."""
    ms = tl.arange(0, BLOCK_M)
    if ONE_TOKEN:
        m_ok = ms < 1
        pairs = b + ms * 0
    else:
        m_ok = ms < tl.load(block_rows + b)
        pairs = tl.load(sorted_pairs + tl.load(block_first + b) + ms, mask=m_ok, other=0)
    return tl.load(block_expert + b).to(tl.int64), pairs, m_ok


@triton.jit
def _block_used(block_rows, b, ONE_TOKEN: tl.constexpr):
    """Whether block b holds pairs (past the last block the align kernel wrote 0 rows)."""
    if ONE_TOKEN:
        used = b >= 0  # always (a tensor, as the other branch's)
    else:
        used = tl.load(block_rows + b) > 0
    return used


@triton.jit
def _gate_up_kernel(
    x, gate_up, act, sorted_pairs, block_expert, block_first, block_rows, H, I, stride_x, stride_we, stride_wn,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr, ONE_TOKEN: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Kernel A. Grid (blocks, cdiv(I, BLOCK_N)): program (b, n) writes act [pair, n block] = silu(x_t Wg^T) *
    (x_t Wu^T) for block b's pairs, Wg / Wu the n block's gate / up rows of its expert's gate_up [2I, H]."""
    wait_for_previous_kernel(PDL)
    b = tl.program_id(0)
    if _block_used(block_rows, b, ONE_TOKEN):
        expert, pairs, m_ok = _block_pairs(sorted_pairs, block_expert, block_first, block_rows, b, BLOCK_M,
                                           ONE_TOKEN)  # pairs, m_ok: [BM]
        ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] intermediate columns
        n_ok = ns < I
        gate_rows = gate_up + expert * stride_we + ns[:, None].to(tl.int64) * stride_wn  # [BN, 1]
        up_rows = gate_rows + I * stride_wn
        x_cols = x + (pairs // TOP_K)[None, :].to(tl.int64) * stride_x  # [1, BM] each pair's token row
        acc_gate = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)  # [BK]
            k_ok = ks < H
            if EVEN_N and EVEN_K:
                w_gate = tl.load(gate_rows + ks[None, :])  # [BN, BK]
                w_up = tl.load(up_rows + ks[None, :])
            else:
                w_ok = n_ok[:, None] & k_ok[None, :]
                w_gate = tl.load(gate_rows + ks[None, :], mask=w_ok, other=0.0)
                w_up = tl.load(up_rows + ks[None, :], mask=w_ok, other=0.0)
            xt = tl.load(x_cols + ks[:, None], mask=k_ok[:, None] & m_ok[None, :], other=0.0)  # [BK, BM]
            acc_gate = tl.dot(w_gate, xt, acc_gate, input_precision=PRECISION)
            acc_up = tl.dot(w_up, xt, acc_up, input_precision=PRECISION)
        out = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up  # [BN, BM]
        tl.store(act + pairs[None, :].to(tl.int64) * I + ns[:, None], out.to(act.dtype.element_ty),
                 mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def _down_kernel(
    act, down, topk_weights, y, sorted_pairs, block_expert, block_first, block_rows, H, I, stride_we, stride_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, ONE_TOKEN: tl.constexpr, PDL: tl.constexpr = False,
):
    """Kernel B. Grid (blocks, cdiv(H, BLOCK_N)): program (b, n) writes y [pair, n block] (float32) =
    w_pair * act[pair] Wd^T for block b's pairs, Wd the n block's rows of its expert's down [H, I]."""
    wait_for_previous_kernel(PDL)
    b = tl.program_id(0)
    if _block_used(block_rows, b, ONE_TOKEN):
        expert, pairs, m_ok = _block_pairs(sorted_pairs, block_expert, block_first, block_rows, b, BLOCK_M,
                                           ONE_TOKEN)  # pairs, m_ok: [BM]
        ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] hidden columns
        n_ok = ns < H
        w_rows = down + expert * stride_we + ns[:, None].to(tl.int64) * stride_wn  # [BN, 1]
        a_cols = act + pairs[None, :].to(tl.int64) * I  # [1, BM]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)  # [BK]
            k_ok = ks < I
            if EVEN_N and EVEN_K:
                w = tl.load(w_rows + ks[None, :])  # [BN, BK]
            else:
                w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            at = tl.load(a_cols + ks[:, None], mask=k_ok[:, None] & m_ok[None, :], other=0.0)  # [BK, BM]
            acc = tl.dot(w, at, acc, input_precision=PRECISION)
        weight = tl.load(topk_weights + pairs, mask=m_ok, other=0.0)  # [BM] float32
        tl.store(y + pairs[None, :].to(tl.int64) * H + ns[:, None], acc * weight[None, :],
                 mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def _combine_kernel(y, out, shared, shared_gate, H, stride_out, stride_shared, stride_gate, TOP_K: tl.constexpr,
                    HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (T, cdiv(H, BLOCK)): out [t] = sum_{j=0..k-1} y [t, j] (in that order) + sigmoid(shared_gate [t]) *
    shared [t], in float32, rounded once to out's dtype."""
    wait_for_previous_kernel(PDL)
    t = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = hs < H
    acc = tl.load(y + t * TOP_K * H + hs, mask=ok, other=0.0)
    for j in tl.static_range(1, TOP_K):
        acc += tl.load(y + (t * TOP_K + j) * H + hs, mask=ok, other=0.0)
    if HAS_SHARED:
        gate = tl.load(shared_gate + t * stride_gate).to(tl.float32)
        acc += tl.load(shared + t * stride_shared + hs, mask=ok, other=0.0).to(tl.float32) / (1.0 + tl.exp(-gate))
    tl.store(out + t * stride_out + hs, acc.to(out.dtype.element_ty), mask=ok)


def num_blocks(num_experts: int, tokens: int, top_k: int, block_m: int) -> int:
    """The align kernel's block-table size: an upper bound of sum_e cdiv(pairs_e, BLOCK_M). With BLOCK_M >= T
    every selected expert is one block (min(E, T*k)); else each may add up to pairs_e // BLOCK_M more."""
    pairs = tokens * top_k
    return min(num_experts, pairs) + (0 if block_m >= tokens else pairs // block_m)


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_pairs [T*k] int32: the pairs t*k + j sorted by (expert, pair); block_table
    [3, num_blocks] int32: per block its expert, its first position in sorted_pairs and its rows, 0 past the last
    block). One launch of _align_kernel, no host sync."""
    T, top_k = topk_ids.shape
    pairs, blocks = T * top_k, num_blocks(num_experts, T, top_k, block_m)
    sorted_pairs = torch.empty(pairs, dtype=torch.int32, device=topk_ids.device)
    block_table = torch.empty(3, blocks, dtype=torch.int32, device=topk_ids.device)
    _align_kernel[(1,)](topk_ids.reshape(-1).to(torch.int32), sorted_pairs, block_table[0], block_table[1],
                        block_table[2], pairs, blocks, BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(num_experts),
                        CHUNK=ALIGN_CHUNK, **pdl.launch_args(topk_ids.device))
    return sorted_pairs, block_table


def fused_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, tiles: MoeTiles, shared: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> torch.Tensor:
    """x: [T, H]; topk_ids [T, k] (distinct experts per token); topk_weights [T, k]; gate_up [E, 2I, H] (gate rows
    first); down [E, H, I]; shared: (shared expert output [T, H], its gate logits [T, 1]) or None.
    Returns sum_j w_j expert_{id_j}(x) (+ sigmoid(gate) * shared): [T, H] in x.dtype. Any T; weights and x with
    unit last strides, of one dtype."""
    T, H = x.shape
    E, two_i, _ = gate_up.shape
    inter, top_k = two_i // 2, topk_ids.shape[1]
    if (gate_up.shape[2] != H or down.shape != (E, H, inter) or topk_weights.shape != topk_ids.shape
            or topk_ids.shape[0] != T):
        raise ValueError(f"x {tuple(x.shape)}, topk_ids {tuple(topk_ids.shape)}, topk_weights "
                         f"{tuple(topk_weights.shape)}, gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)} "
                         "do not fit [T, H], [T, k], [T, k], [E, 2I, H], [E, H, I]")
    if not (x.dtype == gate_up.dtype == down.dtype) or min(x.stride(1), gate_up.stride(2), down.stride(2)) != 1:
        raise ValueError(f"x, gate_up and down need one dtype ({x.dtype}, {gate_up.dtype}, {down.dtype}) and unit "
                         "last strides")
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    launch = pdl.launch_args(x.device)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    # the tiles are sized for 16-bit operands: float32 ones (tests) take twice the shared memory a stage
    stage_divisor = x.element_size() // 2
    pairs = T * top_k
    weights = topk_weights.reshape(-1).to(torch.float32)  # [P]
    one_token = T == 1
    if one_token:  # block j = pair j = expert topk_ids [0, j]: nothing to group, no align launch
        ids = topk_ids.reshape(-1).to(torch.int32)
        sorted_pairs, block_table, blocks = ids, ids.expand(3, top_k), top_k  # of the table only row 0 is read
    else:
        sorted_pairs, block_table = align(topk_ids, E, tiles.block_m)
        blocks = block_table.shape[1]
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    tile = tiles.gate_up
    _gate_up_kernel[(blocks, triton.cdiv(inter, tile.block_n))](
        x, gate_up, act, sorted_pairs, block_table[0], block_table[1], block_table[2], H, inter, x.stride(0),
        gate_up.stride(0), gate_up.stride(1), TOP_K=top_k, BLOCK_M=tiles.block_m, BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, EVEN_N=inter % tile.block_n == 0, EVEN_K=H % tile.block_k == 0, PRECISION=precision,
        ONE_TOKEN=one_token, num_warps=tile.warps, num_stages=max(1, tile.stages // stage_divisor), **launch)
    y = torch.empty(pairs, H, dtype=torch.float32, device=x.device)  # [T, k, H]
    tile = tiles.down
    _down_kernel[(blocks, triton.cdiv(H, tile.block_n))](
        act, down, weights, y, sorted_pairs, block_table[0], block_table[1], block_table[2], H, inter,
        down.stride(0), down.stride(1), BLOCK_M=tiles.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        EVEN_N=H % tile.block_n == 0, EVEN_K=inter % tile.block_k == 0, PRECISION=precision,
        ONE_TOKEN=one_token, num_warps=tile.warps, num_stages=max(1, tile.stages // stage_divisor), **launch)
    shared_out, shared_gate = shared if shared is not None else (out, out)  # unread without HAS_SHARED
    _combine_kernel[(T, triton.cdiv(H, COMBINE_BLOCK))](
        y, out, shared_out, shared_gate, H, out.stride(0), shared_out.stride(0), shared_gate.stride(0),
        TOP_K=top_k, HAS_SHARED=shared is not None, BLOCK=COMBINE_BLOCK, **launch)
    return out
