"""Plain-torch quantized GEMMs: the semantics of every format, the CPU path and the oracle of the Triton kernels.

Three weight formats, each `prepare_*` (once, at load: checks the checkpoint's tensors and repacks them into the
layout below) and an op `x [M, K] -> x @ W^T [M, N]` in x.dtype with float32 accumulation:

  FP8 block (Qwen "fp8", W8A8)   weight e4m3 [N, K], scale_inv float32 [ceil(N/bn), ceil(K/bk)]; x is quantized
                                 per row and bk-wide group of K to e4m3 (dynamic scales), as at every M.
  int4 W4A16 (compressed-tensors "pack-quantized")
                                 packed int32 [N, K/8]: column k is nibble k % 8 (bits 4*(k%8)..+3) of word k // 8,
                                 holding q + 8 (q the signed int4); scale [N, K/g]; zero uint8 [N, K/g] (the
                                 zero point's nibble, 8 when symmetric); act order (g_idx) is folded into a column
                                 permutation of the weight at load, applied to x at run time.
  NVFP4 weight-only (ModelOpt)   packed uint8 [N, K/2]: low nibble = even k, high = odd k, each e2m1 (sign bit 3);
                                 scale e4m3 [N, K/16]; scale_2 float32 [N], the tensor's second-level scale on
                                 every row (rows of fused projections may carry different ones).

  int4 layout (one weight row, g = 128):
      word:    |  0  |  1  | ... |  15 |  16 | ... |   (int32, little end first)
      columns: 0..7  8..15       120..127 128..     nibble i of word j = column 8j + i
      scale:   |------- group 0 --------|-- group 1 ...   (scale and zero: one per row and group)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

E4M3_MAX = 448.0
# The least activation-group amax: an all-zero group still gets a finite scale (and quantizes to zeros).
ACT_AMAX_FLOOR = 1e-10
INT4_GROUP_SIZES = (32, 64, 128)
NVFP4_GROUP = 16
# e2m1 code -> value: bit 3 the sign, bits 2-1 the exponent, bit 0 the mantissa.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _e2m1_value(codes: torch.Tensor) -> torch.Tensor:
    """E2M1_VALUES[codes] computed from the bits (sign | 2-bit exponent | 1-bit mantissa), float32: no lookup table
    is copied to the device, so this also runs inside CUDA-graph capture."""
    exponent, mantissa = (codes >> 1) & 3, (codes & 1).float()
    magnitude = torch.where(exponent == 0, 0.5 * mantissa, torch.exp2(exponent.float() - 1) * (1 + 0.5 * mantissa))
    return torch.where(codes >= 8, -magnitude, magnitude)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype}"


def check_input(x: torch.Tensor, k: int) -> None:
    """x must be [M, k], 16-bit or float32, with a unit last stride (M = 0 gives an empty product)."""
    _require(x.dim() == 2 and x.shape[1] == k,
             f"x must be [M, {k}], got {tuple(x.shape)}")
    _require(x.dtype in (torch.bfloat16, torch.float16, torch.float32), f"x dtype must be bf16/fp16/fp32, got {x.dtype}")
    _require(x.stride(1) == 1, f"x needs a unit last stride, got strides {tuple(x.stride())}")


# ---------------------------------------------------------------------------------------------------- FP8 block


@dataclass(frozen=True)
class Fp8Activation:
    """An activation already quantized as the FP8 block-scaled products read it (quantize_activation's codes and
    scales), by the kernel before the product (a norm or silu_and_mul) instead of a kernel of its own."""

    xq: torch.Tensor  # [M, K] float8_e4m3fn, contiguous
    sx: torch.Tensor  # [ceil(K/block_k), M] float32: the scales K-group-major, as cuda_fp8.quantize stores them
    block_k: int
    dtype: torch.dtype  # the unquantized activation's, which the product returns
    # [M, K] in dtype: the activation itself, where a product beside the FP8 one reads it too (a SplitWeight's
    # plain block, as GDN's in_proj_b/a beside the FP8 in_proj_qkv/z); None where none does
    unquantized: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.xq.shape)


@dataclass(frozen=True)
class Dp4aActivation:
    """One row of activation with x's 16-bit fixed-point parts, as the one-row dp4a GEMVs of int4 and NVFP4 read
    them (ops.quant_gemm.cuda_gemv.store_x_parts), written by the kernel before the product (a norm or silu_and_mul)
    instead of a kernel of their own."""

    x: torch.Tensor  # [1, K] 16-bit: the activation itself (other products, and other kernels, read it)
    parts: torch.Tensor  # [4, K/8] int32: hi / lo bytes of the fixed point, in the weight words' nibble order
    x_scale: torch.Tensor  # [K/group] float32: 2^E of each group
    v_sum: torch.Tensor  # [K/group] int32: each group's sum of the fixed-point values
    group: int  # columns a fixed-point group (int4's group size, NVFP4's 16)
    low_high: bool  # the parts' column order: NVFP4's (columns 0-3, 4-7 of a word) rather than int4's (even, odd)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.x.shape)


@dataclass(frozen=True)
class Fp8BlockWeight:
    weight: torch.Tensor  # [N, K] float8_e4m3fn, contiguous
    scale_inv: torch.Tensor  # [ceil(N/bn), ceil(K/bk)] float32, contiguous: W = weight * scale_inv[n // bn, k // bk]
    block_size: tuple[int, int]  # (bn, bk)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale_inv.nbytes

    def row_scales(self) -> torch.Tensor:
        """[N, ceil(K/bk)] float32: the scale of every weight row's K blocks."""
        return self.scale_inv.repeat_interleave(self.block_size[0], dim=0)[: self.shape[0]]

    def dequantize(self, dtype=torch.bfloat16) -> torch.Tensor:
        """[N, K] in dtype."""
        k = self.shape[1]
        scales = self.row_scales().repeat_interleave(self.block_size[1], dim=1)[:, :k]
        return (self.weight.float() * scales).to(dtype)


def prepare_fp8_block(weight, weight_scale_inv, block_size=(128, 128)) -> Fp8BlockWeight:
    """weight [N, K] float8_e4m3fn, weight_scale_inv [ceil(N/bn), ceil(K/bk)] float32 (as Qwen's fp8 checkpoints
    store them) -> Fp8BlockWeight (the same tensors, made contiguous)."""
    bn, bk = (int(b) for b in block_size)
    _require(bn >= 1 and bk >= 1, f"block_size must be two positive ints, got {tuple(block_size)}")
    _require(weight.dim() == 2 and weight.dtype == torch.float8_e4m3fn,
             f"weight must be a 2-D float8_e4m3fn tensor, got {_describe(weight)}")
    n, k = weight.shape
    want = (math.ceil(n / bn), math.ceil(k / bk))
    _require(tuple(weight_scale_inv.shape) == want and weight_scale_inv.dtype == torch.float32,
             f"weight_scale_inv must be {want} float32 for a {(n, k)} weight in {(bn, bk)} blocks, "
             f"got {_describe(weight_scale_inv)}")
    return Fp8BlockWeight(weight.contiguous(), weight_scale_inv.contiguous(), (bn, bk))


def fp8_block_quantize(w: torch.Tensor, block_size=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (weight float8_e4m3fn [N, K], weight_scale_inv float32 [ceil(N/bn), ceil(K/bk)]):
    s = amax(|block|) / 448, weight = round_e4m3(w / s) (an all-zero block gets s = 0 and zeros)."""
    bn, bk = block_size
    n, k = w.shape
    gn, gk = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.nn.functional.pad(w.float(), (0, gk * bk - k, 0, gn * bn - n))
    blocks = padded.view(gn, bn, gk, bk)
    scale = blocks.abs().amax(dim=(1, 3)) / E4M3_MAX  # [gn, gk]
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))[:, None, :, None]
    q = (blocks / divisor).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(gn * bn, gk * bk)[:n, :k].contiguous(), scale


def quantize_activation(x: torch.Tensor, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq float8_e4m3fn [M, K], s_x float32 [M, ceil(K/bk)]): per row and bk-wide group of K,
    s_x = max(amax(|x|), ACT_AMAX_FLOOR) / 448 and xq = round_e4m3(x / s_x) (an IEEE division, round to nearest
    even; |x / s_x| <= 448 by construction, clamped against rounding)."""
    m, k = x.shape
    groups = math.ceil(k / bk)
    xg = torch.nn.functional.pad(x.float(), (0, groups * bk - k)).view(m, groups, bk)
    scale = xg.abs().amax(dim=2).clamp(min=ACT_AMAX_FLOOR) / E4M3_MAX  # [M, G]
    xq = (xg / scale[:, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return xq.view(m, groups * bk)[:, :k], scale


def fp8_block_linear(x: torch.Tensor, w: Fp8BlockWeight) -> torch.Tensor:
    """x [M, K] -> [M, N] in x.dtype: y[m, n] = sum_g s_x[m, g] * s_w[n // bn, g] * sum_{k in g} xq[m, k] wq[n, k],
    each group's products summed in float32, groups added in order."""
    n, k = w.shape
    check_input(x, k)
    bk = w.block_size[1]
    xq, x_scale = quantize_activation(x, bk)
    w_scale = w.row_scales()  # [N, G]
    out = torch.zeros(x.shape[0], n, dtype=torch.float32, device=x.device)
    for g in range(x_scale.shape[1]):
        cols = slice(g * bk, min(k, (g + 1) * bk))
        part = xq[:, cols].float() @ w.weight[:, cols].float().T  # [M, N]; e4m3 products are exact in fp32/tf32
        out += part * (x_scale[:, g, None] * w_scale[None, :, g])
    return out.to(x.dtype)


# ---------------------------------------------------------------------------------------------------- int4 W4A16


def unpack_int4(packed: torch.Tensor, count: int, dim: int = 1) -> torch.Tensor:
    """int32 words -> uint8 nibbles along `dim` (nibble i of a word is element 8j + i), the first `count` kept."""
    words = packed if dim == 1 else packed.t()
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)  # [8]
    nibbles = (words[:, :, None] >> shifts) & 0xF  # [R, W, 8]
    out = nibbles.reshape(words.shape[0], -1)[:, :count].to(torch.uint8)
    return out if dim == 1 else out.t().contiguous()


def pack_int4(nibbles: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C] (C a multiple of 8, values 0..15) -> int32 [R, C/8], the inverse of unpack_int4."""
    r, c = nibbles.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=nibbles.device)
    words = (nibbles.view(r, c // 8, 8).to(torch.int64) << shifts).sum(dim=2)  # [R, C/8] in 0..2^32-1
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@dataclass(frozen=True)
class Int4Weight:
    packed: torch.Tensor  # [N, K/8] int32, columns in permuted order when perm is set
    scale: torch.Tensor  # [N, K/g] fp16/bf16
    zero: torch.Tensor | None  # [N, K/g] uint8 (the zero point's nibble), None: symmetric (8)
    group_size: int
    perm: torch.Tensor | None  # [K] int64: column i of `packed` is column perm[i] of the checkpoint's weight
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.packed, self.scale, self.zero, self.perm) if t is not None)

    def dequantize_packed_order(self) -> torch.Tensor:
        """[N, K] float32, columns in `packed`'s order: (q - zero) * scale, exact in float32."""
        n, k = self.shape
        q = unpack_int4(self.packed, k).float()
        zero = 8.0 if self.zero is None else self.zero.float().repeat_interleave(self.group_size, dim=1)
        return (q - zero) * self.scale.float().repeat_interleave(self.group_size, dim=1)

    def dequantize(self, dtype=torch.bfloat16) -> torch.Tensor:
        """[N, K] in dtype, in the checkpoint's column order."""
        w = self.dequantize_packed_order()
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w.to(dtype)


def prepare_int4(weight_packed, weight_scale, weight_zero_point, group_size: int, g_idx, weight_shape) -> Int4Weight:
    """compressed-tensors pack-quantized int4 -> Int4Weight. weight_packed int32 [N, K/8]; weight_scale [N, K/g]
    fp16/bf16; weight_zero_point int32 [ceil(N/8), K/g] (nibbles packed along N, as compressed-tensors writes it)
    or None (symmetric); g_idx [K] int or None (act order: column k belongs to group g_idx[k]); weight_shape (N, K)."""
    n, k = (int(v) for v in weight_shape)
    g = int(group_size)
    _require(g in INT4_GROUP_SIZES, f"group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    _require(n >= 1 and k >= 1 and k % g == 0, f"weight_shape {(n, k)}: K must be a multiple of group_size {g}")
    groups = k // g
    _require(tuple(weight_packed.shape) == (n, k // 8) and weight_packed.dtype == torch.int32,
             f"weight_packed must be {(n, k // 8)} int32, got {_describe(weight_packed)}")
    _require(tuple(weight_scale.shape) == (n, groups) and weight_scale.dtype in (torch.float16, torch.bfloat16),
             f"weight_scale must be {(n, groups)} fp16/bf16, got {_describe(weight_scale)}")
    zero = None
    if weight_zero_point is not None:
        want = (math.ceil(n / 8), groups)
        _require(tuple(weight_zero_point.shape) == want and weight_zero_point.dtype == torch.int32,
                 f"weight_zero_point must be {want} int32 (packed along N), got {_describe(weight_zero_point)}")
        zero = unpack_int4(weight_zero_point, n, dim=0).contiguous()  # [N, G], the scale's layout
    packed, perm = weight_packed.contiguous(), None
    if g_idx is not None:
        _require(tuple(g_idx.shape) == (k,), f"g_idx must be [{k}], got {tuple(g_idx.shape)}")
        g_idx = g_idx.to(device=weight_packed.device, dtype=torch.int64)
        counts = torch.bincount(g_idx, minlength=groups)
        _require(bool((g_idx >= 0).all()) and counts.numel() == groups and bool((counts == g).all()),
                 f"g_idx must put exactly {g} columns in each of {groups} groups, got counts {counts.tolist()[:8]}...")
        if not torch.equal(g_idx, torch.arange(k, device=g_idx.device) // g):
            perm = torch.argsort(g_idx, stable=True)  # packed column i <- checkpoint column perm[i]
            packed = pack_int4(unpack_int4(packed, k)[:, perm])
    return Int4Weight(packed, weight_scale.contiguous(), zero, g, perm, (n, k))


def int4_linear(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """x [M, K] -> x @ dequant(w)^T [M, N] in x.dtype (float32 products and sums)."""
    n, k = w.shape
    check_input(x, k)
    if w.perm is not None:
        x = x.index_select(1, w.perm)
    return (x.float() @ w.dequantize_packed_order().T).to(x.dtype)


# ---------------------------------------------------------------------------------------------------- NVFP4


@dataclass(frozen=True)
class Nvfp4Weight:
    packed: torch.Tensor  # [N, K/2] uint8: low nibble column 2j, high nibble column 2j + 1
    scale: torch.Tensor  # [N, K/16] float8_e4m3fn
    scale_2: torch.Tensor  # [N] float32: each row's second-level scale
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale.nbytes + self.scale_2.nbytes

    def dequantize(self, dtype=torch.bfloat16) -> torch.Tensor:
        """[N, K] in dtype: e2m1(q) * scale * scale_2, in float32."""
        n, k = self.shape
        codes = torch.stack((self.packed & 0xF, self.packed >> 4), dim=2).view(n, k).long()
        values = _e2m1_value(codes)
        group_scale = self.scale.float().repeat_interleave(NVFP4_GROUP, dim=1)
        return (values * group_scale * self.scale_2[:, None]).to(dtype)


def prepare_nvfp4(weight, weight_scale, weight_scale_2) -> Nvfp4Weight:
    """ModelOpt NVFP4: weight uint8 [N, K/2], weight_scale float8_e4m3fn [N, K/16], weight_scale_2 float32: a scalar
    (a float or a one-element tensor) or one per row ([N], for projections fused along N) -> Nvfp4Weight."""
    _require(weight.dim() == 2 and weight.dtype == torch.uint8, f"weight must be 2-D uint8, got {_describe(weight)}")
    n, k = weight.shape[0], 2 * weight.shape[1]
    _require(k % NVFP4_GROUP == 0, f"weight's K ({k}) must be a multiple of {NVFP4_GROUP}")
    want = (n, k // NVFP4_GROUP)
    _require(tuple(weight_scale.shape) == want and weight_scale.dtype == torch.float8_e4m3fn,
             f"weight_scale must be {want} float8_e4m3fn, got {_describe(weight_scale)}")
    scale_2 = torch.as_tensor(weight_scale_2, dtype=torch.float32, device=weight.device).reshape(-1)
    _require(scale_2.numel() in (1, n),
             f"weight_scale_2 must be a scalar or [{n}] (one per row), got shape {tuple(torch.as_tensor(weight_scale_2).shape)}")
    _require(bool(torch.isfinite(scale_2).all()), f"weight_scale_2 must be finite, got {scale_2[:4].tolist()}")
    return Nvfp4Weight(weight.contiguous(), weight_scale.contiguous(), scale_2.expand(n).contiguous(), (n, k))


def nvfp4_linear(x: torch.Tensor, w: Nvfp4Weight) -> torch.Tensor:
    """x [M, K] -> x @ dequant(w)^T [M, N] in x.dtype (float32 products and sums)."""
    check_input(x, w.shape[1])
    return (x.float() @ w.dequantize(torch.float32).T).to(x.dtype)
