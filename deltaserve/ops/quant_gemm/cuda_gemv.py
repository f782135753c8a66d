"""Products of few rows (batch-1 decode; int4 / NVFP4 up to MAX_ROWS rows) of the quantized formats on the CUDA
cores: y [M, N] = x [M, K] @ W^T.

At one row a tensor-core tile wastes 15 of its 16 rows, and the int4 / NVFP4 tiles must be rebuilt as bf16 in
the MMA's register layout; here each weight element is decoded from its packed word by a few integer ops straight
into a float32 number, multiplied by x in float32 and accumulated elementwise in a [BLOCK_N, columns] tile that
is reduced once at the end (as ops/linear/cuda.py's bf16 GEMV: a reduction per K block makes the loop
compute-bound). Grid (cdiv(N, BLOCK_N),): every program streams BLOCK_N whole weight rows; each decoded weight
serves all M rows of x (M FMAs a weight: the tensor-core skinny kernels take over as M grows). One row of int4
takes a kernel of its own (_int4_row_kernel): [BLOCK_N, groups, words] tiles in which a thread holds words of
several rows, so that each x column it loads serves them all, and K split over a second grid axis, the float32
partials summed in order by the tile's last program (ops/split_k.py); or, where the table says "dp4a",
_int4_dp4a_row_kernel, which dots the nibbles with x in 16-bit fixed point as integers (dp4a) after
_x_parts_kernel has packed x so (or the norm / SiLU kernel before the product did: a Dp4aActivation, store_x_parts
in both). NVFP4 at one row runs the few-rows kernel, or with "dp4a" _nvfp4_dp4a_row_kernel: its codes looked up
as bytes 12 + 2 e2m1 by prmt and dotted with x in the same fixed point (per 16 columns), 12 sum(v) taken off per
group.

  int4   a word holds columns 8j .. 8j+7 (nibble i: bits 4i..4i+3); the nibbles of its low half, masked in place
         and ORed into the bits of 2048.0, are the floats 2048 + q * 16^(i-3) exactly (2048's ulp is 2^-12);
         subtracting 2048 + z * 16^(i-3) gives (q - z) * 16^(i-3) exactly, and x is taken times 16^(3-i)
         instead (a power of two: exact). The high half is shifted down once. So a nibble costs one mask-or,
         one subtraction and one FMA; the word's 8-term sum is multiplied by its group's scale.
         At one row the nibble at bits p..p+3 of a word (p <= 16; nibbles 5-7 first shifted down by 12) ORed
         into 2048.0 is 2048 + q * 2^(p-12); one FMA by 2^(12-p) less 2048 * 2^(12-p) + z gives q - z exactly,
         and a second FMA adds it times x: one mask-or and two FMAs a weight.
  NVFP4  two codes at once: e2m1's magnitude bits moved to fp16's exponent/mantissa (bits 9-11 of each half)
         and its sign to bit 15 make two fp16 numbers 2^-14 * e2m1 exactly; the 2^14 joins the group scale
         (e4m3 scale * scale_2), applied to each word's sum (a group of 16 is two words).
  FP8    the activation quantized first (cuda_fp8.quantize: the same e4m3 codes and scales as at every M); a
         program's rows share one 128-row scale block (BLOCK_N divides it), so s_x[g] * s_w[block, g] folds into
         the activation: y[n] = sum_k wq[n, k] * (xq[k] * s_x[g] * s_w[g]).
Products are float32 and summed in float32 (in another order than the reference's per-block sums: bounded as
float32 sums over K); the dp4a kernels' integer dots are exact, and they round x (only the values below 2^-7 of
their group's largest, by at most 2^-15 of it: int4's group, NVFP4's 16 columns).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.ops import pdl
from deltaserve.ops.pdl import wait_for_previous_kernel
from deltaserve.ops.quant_gemm.cuda_tiles import tail_arguments, tail_program
from deltaserve.ops.quant_gemm.reference import Dp4aActivation, Fp8Activation, Fp8BlockWeight, Int4Weight
from deltaserve.ops.split_k import store_split, tile_counters

INT4: tl.constexpr = tl.constexpr(0)
NVFP4: tl.constexpr = tl.constexpr(1)
MAGIC_2048: tl.constexpr = tl.constexpr(0x45000000)  # the float32 bits of 2048.0
E2M1_FP16_SCALE: tl.constexpr = tl.constexpr(16384.0)  # 2^14
# Rows the weight-only GEMV takes (each decoded weight multiplied by every row on the CUDA cores)
MAX_ROWS = 8
NVFP4_GROUP = 16  # columns a scale of NVFP4 covers


@triton.jit
def _fp16_halves(h):
    """uint32 h holding two fp16 bit patterns -> (low half, high half) as float32."""
    lo = (h & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (h >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _split8(x3):
    """[..., 8] -> its 8 columns, each [...] (in registers: the 8 are one thread's)."""
    e, o = tl.split(tl.reshape(x3, x3.shape[:-1] + [4, 2]))  # columns 0 2 4 6 / 1 3 5 7
    e0, e1 = tl.split(tl.reshape(e, e.shape[:-1] + [2, 2]))  # 0 4 / 2 6
    o0, o1 = tl.split(tl.reshape(o, o.shape[:-1] + [2, 2]))  # 1 5 / 3 7
    c0, c4 = tl.split(e0)
    c2, c6 = tl.split(e1)
    c1, c5 = tl.split(o0)
    c3, c7 = tl.split(o1)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _word_sum(t, word, z, xs, FORMAT: tl.constexpr):
    """t + per packed word sum_i decode(nibble i) * xs[i], float32 in t's shape (broadcast of word, z and the
    xs): xs the 8 float32 x columns 8j + i of each word j. int4: decode = q - z (z float32, the zero point);
    NVFP4: 2^-14 * e2m1."""
    if FORMAT == INT4:
        hi_word = word >> 16  # nibbles 4..7 into bits 0..15 (the sign bits shifted in are masked off)
        for i in tl.static_range(4):
            step = 16.0 ** (i - 3)  # the weight of nibble i's bits in 2048.0's mantissa
            c = 2048.0 + z * step  # exact
            lo = ((word & (0xF << (4 * i))) | MAGIC_2048).to(tl.float32, bitcast=True) - c  # (q - z) * step
            hi = ((hi_word & (0xF << (4 * i))) | MAGIC_2048).to(tl.float32, bitcast=True) - c
            t += lo * (xs[i] * (1.0 / step))
            t += hi * (xs[4 + i] * (1.0 / step))
    else:
        bits = word.to(tl.uint32, bitcast=True)  # logical shifts
        for p in tl.static_range(4):
            # nibble p in the low half and nibble p + 4 in the high half, moved into fp16 bits (magnitude to
            # bits 9-11, sign to 15)
            if p < 3:
                mag = (bits << (9 - 4 * p)) & 0x0E000E00
            else:
                mag = (bits >> 3) & 0x0E000E00
            lo, hi = _fp16_halves(mag | ((bits << (12 - 4 * p)) & 0x80008000))
            t += lo * xs[p]
            t += hi * xs[4 + p]
    return t


@triton.jit
def _int4_minus_zero(src, pos: tl.constexpr, magic, z):
    """q - z exactly in float32, q the nibble at bits pos..pos+3 of src (pos <= 16), z float32."""
    inv_step: tl.constexpr = 2.0 ** (12 - pos)  # 2048.0's mantissa weighs bit pos at 2^(pos - 12)
    return ((src & (0xF << pos)) | magic).to(tl.float32, bitcast=True) * inv_step - (2048.0 * inv_step + z)


# dp4a (four byte products summed into an int32) as PTX; Triton's CPU interpreter runs no PTX: there it is spelled out
_PTX_DP4A = tl.constexpr(not triton.knobs.runtime.interpret)
# 16-bit fixed point of x: v = round(x / 2^E) with the group's largest |x| below 2^(E + 15); hi byte signed, lo not
X_FRACTION_BITS: tl.constexpr = tl.constexpr(14)


@triton.jit
def _dp4a(a, b, c, B_SIGNED: tl.constexpr):
    """c + sum over bytes i of a's byte i (unsigned) times b's byte i (signed when B_SIGNED), all int32."""
    if _PTX_DP4A:
        if B_SIGNED:
            return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                             is_pure=True, pack=1)
        return tl.inline_asm_elementwise("dp4a.u32.u32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)
    for i in tl.static_range(4):
        b_i = (b >> (8 * i)) & 0xFF
        if B_SIGNED:
            b_i -= (b_i & 0x80) * 2
        c += ((a >> (8 * i)) & 0xFF) * b_i
    return c


# 12 + 2 e2m1 of the codes 0-7 (e2m1 0, 0.5, 1, 1.5, 2, 3, 4, 6) and of 8-15 (their negatives) as prmt's 8-byte
# tables (bytes 0-3 in the first word): the e2m1 codes biased to bytes 0..24
E2M1_POSITIVE: tl.constexpr = tl.constexpr((0x0F0E0D0C, 0x18141210))
E2M1_NEGATIVE: tl.constexpr = tl.constexpr((0x090A0B0C, 0x00040608))
E2M1_BIAS: tl.constexpr = tl.constexpr(12)  # twice e2m1's largest magnitude
NIBBLE_SIGNS: tl.constexpr = tl.constexpr(-0x77777778)  # 0x88888888 as int32: bit 3 of every nibble


@triton.jit
def _prmt(table_lo, table_hi, selectors):
    """PTX prmt (default mode), all int32: byte i of the result is byte (selectors >> 4i) & 7 of the 8 bytes
    table_hi:table_lo, or, where bit 3 of that nibble is set, that byte's top bit repeated (0 for a table of bytes
    below 0x80). Only the low 16 bits of selectors are read."""
    if _PTX_DP4A:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [table_lo, table_hi, selectors],
                                         dtype=tl.int32, is_pure=True, pack=1)
    out = selectors * 0
    for i in tl.static_range(4):
        nibble = (selectors >> (4 * i)) & 0xF
        index = nibble & 7
        byte = tl.where(index < 4, table_lo >> (8 * (index & 3)), table_hi >> (8 * (index & 3))) & 0xFF
        byte = tl.where((nibble & 8) != 0, tl.where((byte & 0x80) != 0, 0xFF, 0), byte)
        out |= byte << (8 * i)
    return out


@triton.jit
def _split4(x4):
    """[..., 4] -> its 4 columns, each [...] (in registers: the 4 are one thread's)."""
    a, b = tl.split(tl.reshape(x4, x4.shape[:-1] + [2, 2]))  # columns 0 2 / 1 3
    c0, c2 = tl.split(a)
    c1, c3 = tl.split(b)
    return c0, c1, c2, c3


@triton.jit
def _quads(t, ROWS: tl.constexpr, GROUPS: tl.constexpr, QUADS: tl.constexpr):
    """A step's words [ROWS, GROUPS * QUADS * 4] (or [GROUPS * QUADS * 4] when ROWS is 1) viewed as [ROWS, GROUPS,
    QUADS, 4]: a group's word quads, 4 consecutive words each."""
    return tl.reshape(t, [ROWS, GROUPS, QUADS, 4])


@triton.jit
def _bytes4(b0, b1, b2, b3):
    """The low bytes of four int32 tensors packed into one int32 tensor, b0 lowest."""
    return (b0 & 0xFF) | ((b1 & 0xFF) << 8) | ((b2 & 0xFF) << 16) | ((b3 & 0xFF) << 24)


@triton.jit
def store_x_parts(xf, parts, x_scale, v_sum, g0, num_groups, K_WORDS, GROUPS: tl.constexpr, GROUP: tl.constexpr,
                  LOW_HIGH: tl.constexpr):
    """Groups g0 .. g0 + GROUPS - 1 of x (xf [GROUPS, GROUP] float32; groups from num_groups on not stored) as
    16-bit fixed point for the dp4a row kernels. x_scale[g] = 2^E, E the group's floor(log2 max |x|) - 14 (at least
    -114: smaller groups round to ~0); v = round(x / 2^E) (|v| <= 32767), split v = 256 hi + lo, hi's bytes signed
    and lo's not; parts [4, K/8] int32: per word j of the packed weight (columns 8j .. 8j+7) the hi bytes of its
    even columns 8j, 8j+2, 8j+4, 8j+6 (row 0), of its odd ones (row 1), the lo bytes alike (rows 2, 3), as dp4a
    pairs them with a word's nibbles 0 2 4 6 and 1 3 5 7 (int4); LOW_HIGH (NVFP4): columns 8j .. 8j+3 in rows 0 and
    2, 8j+4 .. 8j+7 in rows 1 and 3, as prmt makes bytes of a word's nibbles 0-3 and 4-7; v_sum[g] = sum of v.
    Elementwise but for the max and the integer sum, so a group's outputs do not depend on GROUPS or the caller:
    _x_parts_kernel and the norm / SiLU kernels that write them (Dp4aActivation) give the same bits."""
    WPG: tl.constexpr = GROUP // 8
    top = tl.max(tl.abs(xf), axis=1)  # [GROUPS]
    e = tl.maximum(((top.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -100) - X_FRACTION_BITS
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-E, exact
    v = tl.minimum(tl.floor(xf * inv[:, None] + 0.5), 32767.0).to(tl.int32)  # [GROUPS, GROUP]
    gs = g0 + tl.arange(0, GROUPS)  # [GROUPS]
    g_ok = gs < num_groups
    tl.store(x_scale + gs, ((127 + e) << 23).to(tl.float32, bitcast=True), mask=g_ok)
    tl.store(v_sum + gs, tl.sum(v, axis=1), mask=g_ok)
    c0, c1, c2, c3, c4, c5, c6, c7 = _split8(tl.reshape(v, [GROUPS, WPG, 8]))  # [GROUPS, WPG]: column i of each word
    if LOW_HIGH:
        first, second = (c0, c1, c2, c3), (c4, c5, c6, c7)
    else:
        first, second = (c0, c2, c4, c6), (c1, c3, c5, c7)
    out = parts + gs[:, None] * WPG + tl.arange(0, WPG)[None, :]  # [GROUPS, WPG]
    ok = g_ok[:, None]
    tl.store(out, _bytes4(first[0] >> 8, first[1] >> 8, first[2] >> 8, first[3] >> 8), mask=ok)
    tl.store(out + K_WORDS, _bytes4(second[0] >> 8, second[1] >> 8, second[2] >> 8, second[3] >> 8), mask=ok)
    tl.store(out + 2 * K_WORDS, _bytes4(first[0], first[1], first[2], first[3]), mask=ok)
    tl.store(out + 3 * K_WORDS, _bytes4(second[0], second[1], second[2], second[3]), mask=ok)


@triton.jit
def _x_parts_kernel(x, parts, x_scale, v_sum, K_WORDS, GROUP: tl.constexpr, LOW_HIGH: tl.constexpr = False,
                    PDL: tl.constexpr = False):
    """Grid (K / GROUP,): group g of x [K] as store_x_parts writes it."""
    wait_for_previous_kernel(PDL)
    g = tl.program_id(0)
    xf = tl.load(x + g * GROUP + tl.arange(0, GROUP)).to(tl.float32)  # [GROUP]
    store_x_parts(tl.reshape(xf, [1, GROUP]), parts, x_scale, v_sum, g, g + 1, K_WORDS, 1, GROUP, LOW_HIGH)


@triton.jit
def _split_groups(STEPS, GROUPS_PER_STEP: tl.constexpr):
    """(first group, the last step's first group) of this program's split (grid axis 1) of K's STEPS steps of
    GROUPS_PER_STEP groups: split s of S takes steps [s * STEPS // S, (s + 1) * STEPS // S), so the splits differ
    by at most one step and none is empty (S <= STEPS)."""
    split, splits = tl.program_id(1), tl.num_programs(1)
    first = split * STEPS // splits
    end = (split + 1) * STEPS // splits
    return first * GROUPS_PER_STEP, (end - 1) * GROUPS_PER_STEP


@triton.jit
def _int4_dp4a_row_kernel(
    parts, x_scale, v_sum, words, scale, zero, out, partial, counters, N, K_WORDS, STEPS, stride_wn, stride_sn,
    tail_x, tail_w, tail_out, stride_tn, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS_PER_STEP: tl.constexpr,
    HAS_ZERO: tl.constexpr, SPLIT: tl.constexpr, EVEN_N: tl.constexpr, STAGES: tl.constexpr,
    TAIL_ROWS: tl.constexpr = 0, TAIL_K: tl.constexpr = 0, PDL: tl.constexpr = False,
):
    """Grid (cdiv(N, BLOCK_N), splits): out [N] = x [K] @ dequant(W)^T (SPLIT: through float32 partials [splits, N],
    split_k.store_split) over the program's share of K's steps (_split_groups), with x as _x_parts_kernel left it
    (parts, x_scale, v_sum). A word's nibbles are masked into two words of bytes (nibbles 0 2 4 6 and 1 3 5 7) and
    dotted with x's hi and lo bytes by dp4a: 7 instructions for 8 weights, summed in int32 over the 4 words a thread
    holds (exact: |sum| < 2^24). Per row and group: sum_k (q_k - z) x_k = 2^E (sum_k q_k v_k - z v_sum), times the
    group's scale, summed in float32. A step's words are loaded as [BLOCK_N, words] (4 consecutive words a thread, the
    threads along K) and viewed as [BLOCK_N, groups, word quads, 4]: where the step's word quads cover the program's
    threads (block_k >= 1024 x warps) a thread holds its 4 words in every row and each of x's parts it loads serves all
    BLOCK_N rows (no layout conversion through shared memory). The words stream through shared memory STAGES - 1 steps
    ahead, the scales, zero points and x's group scales and sums load one step ahead into registers (loaded where used,
    each step would wait out a memory latency). With TAIL_ROWS, the first TAIL_ROWS programs compute tail_out
    [TAIL_ROWS] = tail_x [K] @ tail_w^T instead (a 16-bit block of rows that reads the same input: GDN's [b|a] beside
    its quantized [q|k|v|z]), one row each (cuda_tiles.tail_program), so that it takes no launch of its own."""
    wait_for_previous_kernel(PDL)
    if tail_program(tail_x, tail_w, tail_out, stride_tn, TAIL_ROWS, TAIL_K):
        return
    tile = tl.program_id(0) - TAIL_ROWS
    WPG: tl.constexpr = GROUP // 8  # words a group
    QUADS: tl.constexpr = WPG // 4  # word quads a group
    ns = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_ok = ns < N
    STEP_WORDS: tl.constexpr = GROUPS_PER_STEP * WPG
    gs = tl.arange(0, GROUPS_PER_STEP)  # [GPS]
    ks = tl.arange(0, STEP_WORDS)  # [SW]
    w_step = words + ns[:, None].to(tl.int64) * stride_wn + ks[None, :]  # [BN, SW]
    s_rows = ns[:, None].to(tl.int64) * stride_sn  # [BN, 1]
    acc = tl.zeros([BLOCK_N, GROUPS_PER_STEP, QUADS], dtype=tl.float32)
    zero_acc = tl.zeros([BLOCK_N, GROUPS_PER_STEP, 1], dtype=tl.float32)
    g_first, g_last = _split_groups(STEPS, GROUPS_PER_STEP)
    s, z = _int4_row_scales(scale, zero, s_rows, n_ok, g_first + gs, HAS_ZERO, EVEN_N)
    xs, v = tl.load(x_scale + g_first + gs), tl.load(v_sum + g_first + gs)  # [GPS]
    for g0 in tl.range(g_first, g_last + 1, GROUPS_PER_STEP, num_stages=STAGES):
        g_next = tl.minimum(g0 + GROUPS_PER_STEP, g_last) + gs  # [GPS]
        s_next, z_next = _int4_row_scales(scale, zero, s_rows, n_ok, g_next, HAS_ZERO, EVEN_N)
        xs_next, v_next = tl.load(x_scale + g_next), tl.load(v_sum + g_next)
        if EVEN_N:
            word = tl.load(w_step + g0 * WPG)  # [BN, SW]
        else:
            word = tl.load(w_step + g0 * WPG, mask=n_ok[:, None], other=0)
        x_words = parts + g0 * WPG + ks  # [SW]
        hi_even = _split4(_quads(tl.load(x_words), 1, GROUPS_PER_STEP, QUADS))
        hi_odd = _split4(_quads(tl.load(x_words + K_WORDS), 1, GROUPS_PER_STEP, QUADS))
        lo_even = _split4(_quads(tl.load(x_words + 2 * K_WORDS), 1, GROUPS_PER_STEP, QUADS))
        lo_odd = _split4(_quads(tl.load(x_words + 3 * K_WORDS), 1, GROUPS_PER_STEP, QUADS))
        w4 = _split4(_quads(word, BLOCK_N, GROUPS_PER_STEP, QUADS))  # [BN, GPS, QUADS] each
        dot_hi = tl.zeros([BLOCK_N, GROUPS_PER_STEP, QUADS], dtype=tl.int32)
        dot_lo = tl.zeros([BLOCK_N, GROUPS_PER_STEP, QUADS], dtype=tl.int32)
        for i in tl.static_range(4):
            even = w4[i] & 0x0F0F0F0F  # nibbles 0 2 4 6 as bytes
            odd = (w4[i] >> 4) & 0x0F0F0F0F  # nibbles 1 3 5 7
            dot_hi = _dp4a(odd, hi_odd[i], _dp4a(even, hi_even[i], dot_hi, True), True)
            dot_lo = _dp4a(odd, lo_odd[i], _dp4a(even, lo_even[i], dot_lo, False), False)
        group_scale = s * xs[None, :, None]  # [BN, GPS, 1]: s * 2^E
        acc += (dot_hi * 256 + dot_lo).to(tl.float32) * group_scale
        zero_acc += z * v.to(tl.float32)[None, :, None] * group_scale
        s, z, xs, v = s_next, z_next, xs_next, v_next
    y = tl.sum(tl.sum(acc, axis=2), axis=1) - tl.sum(tl.sum(zero_acc, axis=2), axis=1)  # [BN]
    if SPLIT:
        store_split(y, out + ns, partial + ns, n_ok, N, counters, tile)
    else:
        tl.store(out + ns, y.to(out.dtype.element_ty), mask=n_ok)


@triton.jit
def _nvfp4_row_scales(scale, s_rows, n_ok, groups, EVEN_N: tl.constexpr):
    """The e4m3 group scales of rows s_rows [BN, 1] at groups [GPS], float32 [BN, GPS]."""
    if EVEN_N:
        return tl.load(scale + s_rows + groups[None, :]).to(tl.float32)
    return tl.load(scale + s_rows + groups[None, :], mask=n_ok[:, None], other=0.0).to(tl.float32)


@triton.jit
def _nvfp4_dp4a_row_kernel(
    parts, x_scale, v_sum, words, scale, scale_2, out, partial, counters, N, K_WORDS, STEPS, stride_wn,
    stride_sn, pos_lo, pos_hi, neg_lo, neg_hi, tail_x, tail_w, tail_out, stride_tn, BLOCK_N: tl.constexpr,
    GROUPS_PER_STEP: tl.constexpr, SPLIT: tl.constexpr, EVEN_N: tl.constexpr, STAGES: tl.constexpr,
    TAIL_ROWS: tl.constexpr = 0, TAIL_K: tl.constexpr = 0, PDL: tl.constexpr = False,
):
    """Grid (cdiv(N, BLOCK_N), splits): out [N] = x [K] @ dequant(W)^T (SPLIT: through float32 partials [splits, N],
    split_k.store_split) over the program's share of K's steps (_split_groups), for NVFP4 (words: the packed bytes as
    int32 [N, K/8], scale [N, K/16] e4m3, scale_2 [N]) with x as _x_parts_kernel (LOW_HIGH, groups of 16) left it
    (parts, x_scale, v_sum). prmt looks a word's nibbles up as the bytes 12 + 2 e2m1 (0..24): the positive codes from
    one table (the negative ones, sign bit set, come out 0), the negative ones from another with the sign bits flipped,
    ORed; dp4a dots them with x's hi and lo bytes, and per group of 16 columns sum 2 e2m1(q) v = that dot - 12 v_sum
    exactly in int32, times the group's scale and 2^E (float32), summed in float32; the row's scale_2 / 2 at the end. A
    step's words are loaded as [BLOCK_N, words] (4 consecutive words a thread, the threads along K: with block_k >= 1024
    x warps each of x's parts a thread loads serves all BLOCK_N rows) and viewed as [BLOCK_N, groups, 2 words]; they
    stream through shared memory STAGES - 1 steps ahead, the scales and x's group scales and sums load one step ahead
    into registers. The tables (E2M1_POSITIVE, E2M1_NEGATIVE) come at run time, as registers. With TAIL_ROWS, the first
    TAIL_ROWS programs compute tail_out [TAIL_ROWS] = tail_x [K] @ tail_w^T instead (a 16-bit block of rows that reads
    the same input: GDN's [b|a] beside its quantized [q|k|v|z]), one row each (cuda_tiles.tail_program), so that it
    takes no launch of its own."""
    wait_for_previous_kernel(PDL)
    if tail_program(tail_x, tail_w, tail_out, stride_tn, TAIL_ROWS, TAIL_K):
        return
    tile = tl.program_id(0) - TAIL_ROWS
    ns = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_ok = ns < N
    STEP_WORDS: tl.constexpr = 2 * GROUPS_PER_STEP
    gs = tl.arange(0, GROUPS_PER_STEP)  # [GPS]
    ks = tl.arange(0, STEP_WORDS)  # [SW]
    w_step = words + ns[:, None].to(tl.int64) * stride_wn + ks[None, :]  # [BN, SW]
    s_rows = ns[:, None].to(tl.int64) * stride_sn  # [BN, 1]
    acc = tl.zeros([BLOCK_N, GROUPS_PER_STEP], dtype=tl.float32)
    g_first, g_last = _split_groups(STEPS, GROUPS_PER_STEP)
    s = _nvfp4_row_scales(scale, s_rows, n_ok, g_first + gs, EVEN_N)
    xs, v = tl.load(x_scale + g_first + gs), tl.load(v_sum + g_first + gs)  # [GPS]
    for g0 in tl.range(g_first, g_last + 1, GROUPS_PER_STEP, num_stages=STAGES):
        g_next = tl.minimum(g0 + GROUPS_PER_STEP, g_last) + gs  # [GPS]
        s_next = _nvfp4_row_scales(scale, s_rows, n_ok, g_next, EVEN_N)
        xs_next, v_next = tl.load(x_scale + g_next), tl.load(v_sum + g_next)
        if EVEN_N:
            word = tl.load(w_step + g0 * 2)  # [BN, SW]
        else:
            word = tl.load(w_step + g0 * 2, mask=n_ok[:, None], other=0)
        x_words = parts + g0 * 2 + ks  # [SW]
        # x's hi bytes of columns 0-3 of each word, then of 4-7, lo bytes alike: [1, GPS] each
        hi_low = tl.split(tl.reshape(tl.load(x_words), [1, GROUPS_PER_STEP, 2]))
        hi_high = tl.split(tl.reshape(tl.load(x_words + K_WORDS), [1, GROUPS_PER_STEP, 2]))
        lo_low = tl.split(tl.reshape(tl.load(x_words + 2 * K_WORDS), [1, GROUPS_PER_STEP, 2]))
        lo_high = tl.split(tl.reshape(tl.load(x_words + 3 * K_WORDS), [1, GROUPS_PER_STEP, 2]))
        w2 = tl.split(tl.reshape(word, [BLOCK_N, GROUPS_PER_STEP, 2]))  # a group's two words: [BN, GPS] each
        dot_hi = tl.zeros([BLOCK_N, GROUPS_PER_STEP], dtype=tl.int32)
        dot_lo = tl.zeros([BLOCK_N, GROUPS_PER_STEP], dtype=tl.int32)
        for i in tl.static_range(2):
            flipped = w2[i] ^ NIBBLE_SIGNS  # the negative codes now select, the positive ones give 0
            low = _prmt(pos_lo, pos_hi, w2[i]) | _prmt(neg_lo, neg_hi, flipped)  # columns 0-3: 12 + 2 e2m1
            high = _prmt(pos_lo, pos_hi, w2[i] >> 16) | _prmt(neg_lo, neg_hi, flipped >> 16)  # columns 4-7
            dot_hi = _dp4a(high, hi_high[i], _dp4a(low, hi_low[i], dot_hi, True), True)
            dot_lo = _dp4a(high, lo_high[i], _dp4a(low, lo_low[i], dot_lo, False), False)
        dot = dot_hi * 256 + dot_lo - E2M1_BIAS * v[None, :]  # [BN, GPS]: sum 2 e2m1(q) v over each group, exact
        acc += dot.to(tl.float32) * (s * xs[None, :])
        s, xs, v = s_next, xs_next, v_next
    y = tl.sum(acc, axis=1) * (tl.load(scale_2 + ns, mask=n_ok, other=0.0) * 0.5)  # [BN]
    if SPLIT:
        store_split(y, out + ns, partial + ns, n_ok, N, counters, tile)
    else:
        tl.store(out + ns, y.to(out.dtype.element_ty), mask=n_ok)


@triton.jit
def _int4_row_kernel(
    x, words, scale, zero, out, partial, counters, N, STEPS, stride_wn, stride_sn, magic, shift,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS_PER_STEP: tl.constexpr, HAS_ZERO: tl.constexpr,
    SPLIT: tl.constexpr, EVEN_N: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = False,
):
    """Grid (cdiv(N, BLOCK_N), splits): out [N] = x [K] @ dequant(W)^T (SPLIT: through float32 partials [splits, N],
    split_k.store_split) over the program's share of K's STEPS steps (_split_groups). words [N, K/8] int32, scale [N,
    K/GROUP], zero [N, K/GROUP] uint8. Tiles [BLOCK_N, groups, words of a group]: a thread holds a few words of several
    rows, so that each x column it loads serves all of them; the scale and zero point load once per row and group. The
    words stream through shared memory STAGES - 1 steps ahead (Triton's pipelining, asked of the loop: by itself it
    pipelines only loads that feed a dot); the scales and zero points, too narrow to copy asynchronously, load one step
    ahead into registers. magic (2048.0's bits) and shift (12) come at run time: as immediates the compiler splits each
    mask-or into two instructions."""
    wait_for_previous_kernel(PDL)
    WPG: tl.constexpr = GROUP // 8  # words a group
    ns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_ok = ns < N
    gs = tl.arange(0, GROUPS_PER_STEP)  # [GPS]
    ws = tl.arange(0, WPG)  # [WPG]
    w_rows = words + ns[:, None, None].to(tl.int64) * stride_wn  # [BN, 1, 1]
    s_rows = ns[:, None].to(tl.int64) * stride_sn  # [BN, 1]
    acc = tl.zeros([BLOCK_N, GROUPS_PER_STEP, WPG], dtype=tl.float32)
    g_first, g_last = _split_groups(STEPS, GROUPS_PER_STEP)
    s, z = _int4_row_scales(scale, zero, s_rows, n_ok, g_first + gs, HAS_ZERO, EVEN_N)
    for g0 in tl.range(g_first, g_last + 1, GROUPS_PER_STEP, num_stages=STAGES):
        # the next step's scales (the last step's again at the end: cached, and never past the split)
        s_next, z_next = _int4_row_scales(scale, zero, s_rows, n_ok, tl.minimum(g0 + GROUPS_PER_STEP, g_last) + gs,
                                          HAS_ZERO, EVEN_N)
        word_ids = (g0 + gs)[:, None] * WPG + ws[None, :]  # [GPS, WPG]
        if EVEN_N:
            word = tl.load(w_rows + word_ids[None, :, :])  # [BN, GPS, WPG]
        else:
            word = tl.load(w_rows + word_ids[None, :, :], mask=n_ok[:, None, None], other=0)
        word_hi = (word.to(tl.uint32, bitcast=True) >> shift).to(tl.int32, bitcast=True)  # nibbles 5..7 at bits 8..19
        # x's columns of the step in one contiguous load, split into the 8 nibble positions [1, GPS, WPG] each
        x3 = tl.load(x + g0 * GROUP + tl.arange(0, GROUPS_PER_STEP * GROUP)).to(tl.float32)
        c0, c1, c2, c3, c4, c5, c6, c7 = _split8(tl.reshape(x3, [GROUPS_PER_STEP, WPG, 8]))
        xs = (c0[None], c1[None], c2[None], c3[None], c4[None], c5[None], c6[None], c7[None])
        t = tl.zeros([BLOCK_N, GROUPS_PER_STEP, WPG], dtype=tl.float32)
        for i in tl.static_range(8):
            if i < 5:
                q_minus_z = _int4_minus_zero(word, 4 * i, magic, z)
            else:
                q_minus_z = _int4_minus_zero(word_hi, 4 * i - 12, magic, z)
            t += q_minus_z * xs[i]
        acc += t * s
        s, z = s_next, z_next
    y = tl.sum(tl.sum(acc, axis=2), axis=1)  # [BN]
    if SPLIT:
        store_split(y, out + ns, partial + ns, n_ok, N, counters, tl.program_id(0))
    else:
        tl.store(out + ns, y.to(out.dtype.element_ty), mask=n_ok)


@triton.jit
def _int4_row_scales(scale, zero, s_rows, n_ok, groups, HAS_ZERO: tl.constexpr, EVEN_N: tl.constexpr):
    """Scale and zero point (8.0 when symmetric) of rows s_rows [BN, 1] at groups [GPS], float32 [BN, GPS, 1]."""
    if EVEN_N:
        s = tl.load(scale + s_rows + groups[None, :]).to(tl.float32)[:, :, None]
    else:
        s = tl.load(scale + s_rows + groups[None, :], mask=n_ok[:, None], other=0.0).to(tl.float32)[:, :, None]
    if HAS_ZERO:
        if EVEN_N:
            z = tl.load(zero + s_rows + groups[None, :]).to(tl.float32)[:, :, None]
        else:
            z = tl.load(zero + s_rows + groups[None, :], mask=n_ok[:, None], other=0).to(tl.float32)[:, :, None]
    else:
        z = tl.full(s.shape, 8.0, tl.float32)
    return s, z


@triton.jit
def _weight_only_gemv_kernel(
    x, words, scale, zero, scale_2, out, M, N, K, stride_xm, stride_om, stride_wn, stride_sn,
    FORMAT: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, PDL: tl.constexpr = False,
):
    """Grid (cdiv(N, BLOCK_N),): out [M, N] = x [M, K] @ dequant(W)^T (M <= BLOCK_M). words [N, K/8] int32 (int4
    packed, or NVFP4's bytes read as words: the same nibble order), scale [N, K/GROUP], zero [N, K/GROUP] uint8
    (int4), scale_2 [N] float32 (NVFP4). K is a multiple of BLOCK_K, BLOCK_K of GROUP. One row (NVFP4's; int4's
    takes _int4_row_kernel) runs in [BN, groups, words] tiles, the scales loaded once per group and broadcast
    along the words and x's columns loaded contiguously and split per nibble in registers, so that the decoded
    weights never change register layout (converting them through shared memory every step would cost more than
    the arithmetic)."""
    wait_for_previous_kernel(PDL)
    W: tl.constexpr = BLOCK_K // 8  # words per row and K block
    WORDS_PER_GROUP: tl.constexpr = GROUP // 8
    ns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_ok = ns < N
    ms = tl.arange(0, BLOCK_M)  # [BM]
    js = tl.arange(0, W)  # [W]
    w_rows = words + ns[:, None].to(tl.int64) * stride_wn  # [BN, 1]
    s_rows = ns[:, None].to(tl.int64) * stride_sn  # [BN, 1]
    if BLOCK_M == 1:
        # [BN, groups, words of a group]: the scales load once per group and broadcast along the words
        GPI: tl.constexpr = W // WORDS_PER_GROUP
        gs = tl.arange(0, GPI)  # [GPI]
        ws = tl.arange(0, WORDS_PER_GROUP)  # [WPG]
        acc1 = tl.zeros([BLOCK_N, GPI, WORDS_PER_GROUP], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            g0 = k0 // GROUP
            word_ids = (g0 + gs)[:, None] * WORDS_PER_GROUP + ws[None, :]  # [GPI, WPG]
            s_ptrs = scale + s_rows + (g0 + gs)[None, :]  # [BN, GPI]
            if EVEN_N:
                word = tl.load(w_rows[:, :, None] + word_ids[None, :, :])  # [BN, GPI, WPG]
                s1 = tl.load(s_ptrs).to(tl.float32)[:, :, None]  # [BN, GPI, 1]
            else:
                word = tl.load(w_rows[:, :, None] + word_ids[None, :, :], mask=n_ok[:, None, None], other=0)
                s1 = tl.load(s_ptrs, mask=n_ok[:, None], other=0.0).to(tl.float32)[:, :, None]
            if FORMAT == INT4 and HAS_ZERO:
                z1 = tl.load(zero + s_rows + (g0 + gs)[None, :], mask=n_ok[:, None], other=0).to(tl.float32)
                z1 = z1[:, :, None]
            else:
                z1 = tl.full([BLOCK_N, GPI, 1], 8.0, tl.float32)
            # x's BLOCK_K columns in one contiguous load, split into the 8 nibble positions [GPI, WPG] each
            x3 = tl.reshape(tl.load(x + k0 + tl.arange(0, BLOCK_K)).to(tl.float32), [GPI, WORDS_PER_GROUP, 8])
            c0, c1, c2, c3, c4, c5, c6, c7 = _split8(x3)
            xs = (c0[None], c1[None], c2[None], c3[None], c4[None], c5[None], c6[None], c7[None])
            t = _word_sum(tl.zeros([BLOCK_N, GPI, WORDS_PER_GROUP], dtype=tl.float32), word, z1, xs, FORMAT)
            acc1 += t * s1
        y = tl.sum(tl.sum(acc1, axis=2), axis=1)[None, :]  # [1, BN]
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, W], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            word_ids = k0 // 8 + js  # [W]
            groups = (word_ids // WORDS_PER_GROUP)[None, :]  # [1, W]
            if EVEN_N:
                word = tl.load(w_rows + word_ids[None, :])  # [BN, W]
                s2 = tl.load(scale + s_rows + groups).to(tl.float32)
            else:
                word = tl.load(w_rows + word_ids[None, :], mask=n_ok[:, None], other=0)
                s2 = tl.load(scale + s_rows + groups, mask=n_ok[:, None], other=0.0).to(tl.float32)
            if FORMAT == INT4 and HAS_ZERO:
                z2 = tl.load(zero + s_rows + groups, mask=n_ok[:, None], other=0).to(tl.float32)
            else:
                z2 = tl.full(word.shape, 8.0, tl.float32)
            x_ptrs = x + ms[:, None, None] * stride_xm + word_ids[None, None, :] * 8  # [BM, 1, W]
            m_ok = (ms < M)[:, None, None]
            xs = (tl.load(x_ptrs, mask=m_ok, other=0.0).to(tl.float32),
                  tl.load(x_ptrs + 1, mask=m_ok, other=0.0).to(tl.float32),
                  tl.load(x_ptrs + 2, mask=m_ok, other=0.0).to(tl.float32),
                  tl.load(x_ptrs + 3, mask=m_ok, other=0.0).to(tl.float32),
                  tl.load(x_ptrs + 4, mask=m_ok, other=0.0).to(tl.float32),
                  tl.load(x_ptrs + 5, mask=m_ok, other=0.0).to(tl.float32),
                  tl.load(x_ptrs + 6, mask=m_ok, other=0.0).to(tl.float32),
                  tl.load(x_ptrs + 7, mask=m_ok, other=0.0).to(tl.float32))
            t = _word_sum(tl.zeros([BLOCK_M, BLOCK_N, W], dtype=tl.float32), word[None, :, :], z2[None, :, :], xs,
                          FORMAT)
            acc += t * s2[None, :, :]
        y = tl.sum(acc, axis=2)  # [BM, BN]
    if FORMAT == NVFP4:
        y = y * (tl.load(scale_2 + ns, mask=n_ok, other=0.0) * E2M1_FP16_SCALE)[None, :]
    tl.store(out + ms[:, None] * stride_om + ns[None, :], y.to(out.dtype.element_ty),
             mask=(ms < M)[:, None] & n_ok[None, :])


@triton.jit
def _fp8_gemv_kernel(
    xq, sx, w, ws, out, N, K, G, BN_W: tl.constexpr, BK: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, STAGES: tl.constexpr = 1,
    PDL: tl.constexpr = False,
):
    """Grid (cdiv(N, BLOCK_N),): out [N] = the block-scaled product of xq [K] e4m3 (scales sx [G]) and w [N, K]
    e4m3 (scales ws [cdiv(N, BN_W), G]); BLOCK_N divides BN_W, BLOCK_K is a multiple of BK. STAGES > 1 streams
    the weight tiles through shared memory STAGES - 1 steps ahead (Triton's pipelining, asked of the loop), more
    bytes in flight a program where few programs share an SM."""
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    ns = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_ok = ns < N
    ws_row = ws + (pid * BLOCK_N // BN_W) * G  # the program's scale-block row
    w_rows = w + ns[:, None].to(tl.int64) * K  # [BN, 1]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)  # [BK]
        k_ok = ks < K
        g = ks // BK
        factor = tl.load(sx + g, mask=k_ok, other=0.0) * tl.load(ws_row + g, mask=k_ok, other=0.0)  # [BK]
        a = tl.load(xq + ks, mask=k_ok, other=0.0).to(tl.float32) * factor
        if EVEN_N and EVEN_K:
            wt = tl.load(w_rows + ks[None, :])  # [BN, BK] e4m3
        else:
            wt = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += wt.to(tl.float32) * a[None, :]
    tl.store(out + ns, tl.sum(acc, axis=1).to(out.dtype.element_ty), mask=n_ok)


def _block_k(k: int, wanted: int, unit: int) -> int | None:
    """The largest power of two <= wanted, >= unit, dividing k; None if there is none."""
    block = triton.next_power_of_2(wanted)
    while block >= unit and k % block:
        block //= 2
    return block if block >= unit else None


def supports(w, config: dict, rows: int = 1) -> bool:
    """Whether the kernel takes this weight at `rows` rows with this config: int4 / NVFP4 up to MAX_ROWS rows and a
    K block that divides K and holds whole scale groups; FP8 one row, scale blocks of K that BLOCK_K covers whole
    and a row block (BLOCK_N) inside one scale block of rows."""
    k = w.shape[1]
    if isinstance(w, Fp8BlockWeight):
        bn, bk = w.block_size
        return rows == 1 and bn % config["block_n"] == 0 and config["block_k"] % bk == 0
    if isinstance(w, Int4Weight) and rows == 1:
        return _row_steps(k, w.group_size, config) is not None
    if rows == 1 and config.get("dp4a"):  # NVFP4's dp4a row kernel: whole groups of 16 a step
        return _row_steps(k, NVFP4_GROUP, config) is not None
    group = w.group_size if isinstance(w, Int4Weight) else NVFP4_GROUP
    return 1 <= rows <= MAX_ROWS and _block_k(k, config["block_k"], group) is not None


def _row_steps(k: int, group: int, config: dict) -> tuple[int, int] | None:
    """(groups a K step, K splits) of the one-row int4 kernels and NVFP4's dp4a kernel (group 16): block_k // group
    groups a step (a power of two, at least 1, dividing K's groups) and config's split_k splits (default 1), at
    most one a step (splits differ by at most one step: _split_groups); None if the group is not a power of two of
    at least 8 columns or does not divide K."""
    if group < 8 or group & (group - 1) or k % group:
        return None
    groups = k // group
    per_step = triton.next_power_of_2(max(1, config["block_k"] // group))
    while per_step > 1 and groups % per_step:
        per_step //= 2
    return per_step, max(1, min(config.get("split_k", 1), groups // per_step))


def gemv(x: torch.Tensor | Fp8Activation | Dp4aActivation, w, config: dict, tail: torch.Tensor | None = None):
    """x [M, K] -> [M, N] in x.dtype, M <= MAX_ROWS (FP8: one row; `supports(w, config, M)` first; the rows
    padded to a power of two: variants for 1, 2, 4, 8). config:
    block_n, block_k, warps, stages. Act order (int4 g_idx) gathers x's columns first. FP8 also takes x already
    quantized (an Fp8Activation of the weight's scale block); int4 and NVFP4 a row with its fixed-point parts (a
    Dp4aActivation), which the dp4a kernels read where they fit (`dp4a_input`) and the others ignore. tail: a
    16-bit [NT, K] block multiplied in the same launch (only by a dp4a kernel reading x's parts: x a Dp4aActivation
    that `dp4a_input` names); the result is then (x @ W^T [1, N], x @ tail^T [1, NT])."""
    from deltaserve.ops.quant_gemm import cuda_fp8

    written = None
    if isinstance(x, Dp4aActivation):
        written, x = (x if dp4a_input(w, config, x.shape[0]) == (x.group, x.low_high) else None), x.x
    if tail is not None and written is None:
        raise ValueError("a tail block is multiplied only by a dp4a kernel reading the row's parts (a Dp4aActivation "
                         "that dp4a_input names)")
    n, k = w.shape
    m = x.shape[0]
    device = x.xq.device if isinstance(x, Fp8Activation) else x.device
    out = torch.empty(m, n, dtype=x.dtype, device=device)
    launch = pdl.launch_args(device)
    block_n = config["block_n"]
    grid = (triton.cdiv(n, block_n),)
    if isinstance(w, Fp8BlockWeight):
        bn_w, bk = w.block_size
        xq, sx = cuda_fp8.quantized(x, bk)  # sx [G, 1]
        block_k = config["block_k"]
        _fp8_gemv_kernel[grid](
            xq, sx, w.weight, w.scale_inv, out, n, k, triton.cdiv(k, bk), BN_W=bn_w, BK=bk, BLOCK_N=block_n,
            BLOCK_K=block_k, EVEN_N=n % block_n == 0, EVEN_K=k % block_k == 0, STAGES=config["stages"],
            num_warps=config["warps"], num_stages=config["stages"], **launch)
        return out
    if isinstance(w, Int4Weight):
        fmt, words, group, zero, scale_2 = INT4, w.packed, w.group_size, w.zero, w.scale
        if w.perm is not None:
            x = x.index_select(1, w.perm)
        if m == 1:
            return _int4_row(x, w, config, out, launch, written, tail)
    else:
        if m == 1 and config.get("dp4a"):
            return _nvfp4_dp4a_row(x, w, config, out, launch, written, tail)
        fmt, words, group, zero, scale_2 = NVFP4, w.packed.view(torch.int32), NVFP4_GROUP, None, w.scale_2
    block_k = _block_k(k, config["block_k"], group)
    _weight_only_gemv_kernel[grid](
        x, words, w.scale, zero if zero is not None else w.scale, scale_2, out, m, n, k, x.stride(0), out.stride(0),
        words.stride(0), w.scale.stride(0), FORMAT=fmt, GROUP=group, HAS_ZERO=zero is not None,
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k, EVEN_N=n % block_n == 0,
        num_warps=config["warps"], num_stages=config["stages"], **launch)
    return out


def dp4a_input(w, config: dict, rows: int) -> tuple[int, bool] | None:
    """(group, low_high) of the fixed-point parts (a Dp4aActivation) that the product of w at `rows` rows by
    `config` reads: one row of int4 without act order or of NVFP4 on a dp4a kernel; None where none does."""
    if rows != 1 or not config.get("dp4a") or not supports(w, config, rows):
        return None
    if isinstance(w, Int4Weight):
        return (w.group_size, False) if w.perm is None else None
    return (NVFP4_GROUP, True) if not isinstance(w, Fp8BlockWeight) else None


def x_parts(x: torch.Tensor, group: int, low_high: bool, launch: dict) -> tuple[torch.Tensor, ...]:
    """(parts [4, K/8] int32, x_scale [K/group] float32, v_sum [K/group] int32) of the row x [1, K] by
    _x_parts_kernel."""
    k = x.shape[1]
    parts, x_scale, v_sum = x_parts_buffers(k, group, x.device)
    _x_parts_kernel[(k // group,)](x, parts, x_scale, v_sum, k // 8, GROUP=group, LOW_HIGH=low_high, **launch)
    return parts, x_scale, v_sum


def x_parts_buffers(k: int, group: int, device) -> tuple[torch.Tensor, ...]:
    """Empty (parts, x_scale, v_sum) for a row of k columns in fixed-point groups of `group`."""
    return (torch.empty(4, k // 8, dtype=torch.int32, device=device),
            torch.empty(k // group, dtype=torch.float32, device=device),
            torch.empty(k // group, dtype=torch.int32, device=device))


def _int4_row(x: torch.Tensor, w: Int4Weight, config: dict, out: torch.Tensor, launch: dict,
              written: Dp4aActivation | None = None, tail: torch.Tensor | None = None):
    """out [1, N] = x [1, K] (columns in the packed order) @ dequant(w)^T by _int4_row_kernel, or with config's
    "dp4a" by _int4_dp4a_row_kernel on x's parts (written's, else _x_parts_kernel's), with tail's rows (gemv);
    split K sums its float32 partials in order in the tile's last program."""
    n, k = w.shape
    group = w.group_size
    per_step, split = _row_steps(k, group, config)
    block_n = config["block_n"]
    grid = (triton.cdiv(n, block_n), split)
    partial = torch.empty(split, n, dtype=torch.float32, device=x.device) if split > 1 else out
    tiles = tile_counters(x.device, grid[0])
    common = dict(GROUP=group, BLOCK_N=block_n, GROUPS_PER_STEP=per_step, HAS_ZERO=w.zero is not None,
                  SPLIT=split > 1, EVEN_N=n % block_n == 0, STAGES=config["stages"], num_warps=config["warps"],
                  **launch)
    zero = w.zero if w.zero is not None else w.scale
    if config.get("dp4a"):
        parts, x_scale, v_sum = ((written.parts, written.x_scale, written.v_sum) if written is not None
                                 else x_parts(x, group, False, launch))
        tail_args, tail_out, tail_constexprs = tail_arguments(x, tail)
        _int4_dp4a_row_kernel[(grid[0] + tail_constexprs.get("TAIL_ROWS", 0), split)](
            parts, x_scale, v_sum, w.packed, w.scale, zero, out, partial, tiles, n, k // 8, k // group // per_step,
            w.packed.stride(0), w.scale.stride(0), *tail_args, **common, **tail_constexprs)
        return out if tail is None else (out, tail_out)
    _int4_row_kernel[grid](
        x, w.packed, w.scale, zero, out, partial, tiles, n, k // group // per_step, w.packed.stride(0),
        w.scale.stride(0), MAGIC_2048.value, 12, **common)
    return out


def _nvfp4_dp4a_row(x: torch.Tensor, w, config: dict, out: torch.Tensor, launch: dict,
                    written: Dp4aActivation | None = None, tail: torch.Tensor | None = None):
    """out [1, N] = x [1, K] @ dequant(w)^T for NVFP4 by _nvfp4_dp4a_row_kernel on x's parts (groups of 16,
    LOW_HIGH: written's, else _x_parts_kernel's), with tail's rows (gemv); split K sums its float32 partials in
    order in the tile's last program."""
    n, k = w.shape
    groups = k // NVFP4_GROUP
    per_step, split = _row_steps(k, NVFP4_GROUP, config)
    block_n = config["block_n"]
    grid = (triton.cdiv(n, block_n), split)
    words = w.packed.view(torch.int32)  # [N, K/8]: nibble i of word j is column 8j + i
    parts, x_scale, v_sum = ((written.parts, written.x_scale, written.v_sum) if written is not None
                             else x_parts(x, NVFP4_GROUP, True, launch))
    partial = torch.empty(split, n, dtype=torch.float32, device=x.device) if split > 1 else out
    tail_args, tail_out, tail_constexprs = tail_arguments(x, tail)
    _nvfp4_dp4a_row_kernel[(grid[0] + tail_constexprs.get("TAIL_ROWS", 0), split)](
        parts, x_scale, v_sum, words, w.scale, w.scale_2, out, partial, tile_counters(x.device, grid[0]), n, k // 8,
        groups // per_step, words.stride(0), w.scale.stride(0), *E2M1_POSITIVE.value, *E2M1_NEGATIVE.value,
        *tail_args, BLOCK_N=block_n, GROUPS_PER_STEP=per_step, SPLIT=split > 1, EVEN_N=n % block_n == 0,
        STAGES=config["stages"], num_warps=config["warps"], **launch, **tail_constexprs)
    return out if tail is None else (out, tail_out)
