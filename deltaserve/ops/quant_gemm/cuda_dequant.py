"""Weight tiles of the weight-only formats (int4 W4A16, NVFP4) dequantized in registers, for the Triton GEMMs of
cuda_weight_only.py; the layouts are reference.py's.

Hopper has no int4 or FP4 tensor cores: a tile is turned into 16-bit values and multiplied by bf16 / fp16
activations. Two forms:
  int4_codes   the codes alone, OFFSET + q exactly, built by bit tricks instead of integer-to-float conversions:
               for bf16 the bits 0x4300 | q are the number 128 + q (0x6400 | q: 1024 + q in fp16). The kernel
               multiplies one scale group per tl.dot and applies (. - (OFFSET + zero) * sum(x)) * scale to the
               float32 result, so nothing is rounded but the float32 sums.
  int4_tile / nvfp4_tile
               the dequantized weight, (q - zero) * scale or e2m1 * scale * scale_2 in float32, rounded to the
               activation dtype (relative 2^-9 for bf16), for tiles of several groups.
e2m1 to float: the code's magnitude bits e1 e0 m placed in fp16's exponent/mantissa (bits 11-9) and its sign in
bit 15 make fp16 2^-14 * e2m1 exactly (code 1, 0.5, becomes an fp16 subnormal); the 2^14 joins the scales.
"""

import triton
import triton.language as tl

INT4: tl.constexpr = tl.constexpr(0)
NVFP4: tl.constexpr = tl.constexpr(1)
E2M1_FP16_SCALE: tl.constexpr = tl.constexpr(16384.0)  # 2^14


@triton.jit
def _int4_nibbles(packed, ns, n_ok, k0, stride_pn, BK: tl.constexpr, MASK_N: tl.constexpr):
    """int32 [BN, BK / 8, 8]: the nibbles of columns k0 .. k0 + BK of rows ns (0 where masked)."""
    words = k0 // 8 + tl.arange(0, BK // 8)  # [BK/8]
    ptrs = packed + ns[:, None].to(tl.int64) * stride_pn + words[None, :]  # [BN, BK/8]
    if MASK_N:
        w = tl.load(ptrs, mask=n_ok[:, None], other=0)
    else:
        w = tl.load(ptrs)
    return (w[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF


@triton.jit
def int4_codes(packed, ns, n_ok, k0, stride_pn, BK: tl.constexpr, CODE_BASE: tl.constexpr, dtype: tl.constexpr,
               MASK_N: tl.constexpr):
    """[BN, BK] in dtype: OFFSET + q per column (q the stored nibble 0..15), exact. CODE_BASE is the 16-bit pattern
    whose low bits take q (0x4300 for bf16, 0x6400 for fp16), 0 for a plain conversion (float32)."""
    q = _int4_nibbles(packed, ns, n_ok, k0, stride_pn, BK, MASK_N)  # [BN, BK/8, 8]
    if CODE_BASE != 0:
        v = (q | CODE_BASE).to(tl.int16).to(dtype, bitcast=True)
    else:
        v = q.to(dtype)
    return tl.reshape(v, [q.shape[0], BK])


@triton.jit
def int4_tile(packed, scale, zero, ns, n_ok, k0, stride_pn, stride_sn, GROUP: tl.constexpr, BK: tl.constexpr,
              HAS_ZERO: tl.constexpr, MASK_N: tl.constexpr, dtype: tl.constexpr):
    """[BN, BK] in dtype: (q - zero) * scale of columns k0 .. k0 + BK (BK a multiple or a divisor of GROUP)."""
    PER_TILE: tl.constexpr = BK // GROUP if BK >= GROUP else 1  # scale groups in the tile
    q = _int4_nibbles(packed, ns, n_ok, k0, stride_pn, BK, MASK_N)
    groups = k0 // GROUP + tl.arange(0, PER_TILE)  # [PER_TILE]
    s_ptrs = ns[:, None].to(tl.int64) * stride_sn + groups[None, :]  # [BN, PER_TILE]
    s = tl.load(scale + s_ptrs, mask=n_ok[:, None], other=0.0).to(tl.float32)
    if HAS_ZERO:
        z = tl.load(zero + s_ptrs, mask=n_ok[:, None], other=0).to(tl.float32)
    else:
        z = tl.full(s.shape, 8.0, tl.float32)
    q3 = tl.reshape(q, [q.shape[0], PER_TILE, BK // PER_TILE]).to(tl.float32)  # [BN, PER_TILE, cols per group]
    w = (q3 - z[:, :, None]) * s[:, :, None]
    return tl.reshape(w, [q.shape[0], BK]).to(dtype)


@triton.jit
def _e2m1_times_2_pow_m14(code):
    """int32 e2m1 codes (0..15) -> float32 2^-14 * e2m1(code), exactly."""
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def nvfp4_tile(packed, scale, scale_2, ns, n_ok, k0, stride_pn, stride_sn, BK: tl.constexpr, MASK_N: tl.constexpr,
               dtype: tl.constexpr):
    """[BN, BK] in dtype: e2m1 * scale * scale_2 of columns k0 .. k0 + BK (BK a multiple of 16); packed [N, K/2]
    uint8, scale [N, K/16] e4m3, scale_2 [N] float32."""
    GROUPS: tl.constexpr = BK // 16
    j = tl.arange(0, GROUPS)  # [GROUPS]
    offs = k0 // 2 + j[:, None] * 8 + tl.arange(0, 8)[None, :]  # [GROUPS, 8] bytes
    rows = ns[:, None, None].to(tl.int64) * stride_pn  # [BN, 1, 1]
    if MASK_N:
        p = tl.load(packed + rows + offs[None, :, :], mask=n_ok[:, None, None], other=0)
    else:
        p = tl.load(packed + rows + offs[None, :, :])
    p = p.to(tl.int32)  # [BN, GROUPS, 8]
    s = tl.load(scale + ns[:, None].to(tl.int64) * stride_sn + (k0 // 16 + j)[None, :], mask=n_ok[:, None],
                other=0.0).to(tl.float32)  # [BN, GROUPS]
    s2 = tl.load(scale_2 + ns, mask=n_ok, other=0.0) * E2M1_FP16_SCALE  # [BN]
    gs = (s * s2[:, None])[:, :, None]  # [BN, GROUPS, 1]
    lo = _e2m1_times_2_pow_m14(p & 0xF) * gs  # even columns
    hi = _e2m1_times_2_pow_m14(p >> 4) * gs  # odd columns
    return tl.reshape(tl.join(lo, hi), [p.shape[0], BK]).to(dtype)  # [BN, GROUPS, 8, 2] -> [BN, BK]
