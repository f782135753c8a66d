"""The quantized GEMMs' plain-torch semantics (ops/quant_gemm/reference.py) against float64 computations written
here from the formats' definitions, against hand-computed e4m3 / e2m1 values, and (int4) against the
compressed-tensors package's own packing and dequantization.

Tolerances: a float32 sum of L terms is within (L - 1) * 2^-24 * sum|terms| of the exact sum, whatever the
order; the cast to the output dtype adds its unit roundoff times |y|.
"""

import math

import pytest
import torch

from deltaserve.ops.quant_gemm import reference as ref

U32 = 2.0**-24
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def assert_within(got, want64, abs_terms64, sum_len, dtype):
    """got (x.dtype) vs the float64 value: |got - want| <= (sum_len + 2) u32 sum|terms| + u_out |want|
    (+ the smallest subnormal step of the output dtype, for results that round to zero)."""
    bound = (sum_len + 2) * U32 * abs_terms64 + UNIT_ROUNDOFF[dtype] * want64.abs() + torch.finfo(dtype).tiny
    err = (got.double() - want64).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error {worst:.3g} x the bound (max abs error {err.max().item():.3g})"


# -------------------------------------------------------------------------------------------- e4m3 by hand


def test_e4m3_rounding_matches_hand_computed_codes():
    values = torch.tensor([448.0, 1.0, 2.0**-9, 1.0625, 1.1875, -3.5, 0.0, 2.0**-6 * 1.125, 460.0])
    # 1.0625 is halfway between 1.0 and 1.125: even mantissa (1.0); 1.1875 between 1.125 and 1.25: 1.25;
    # 460 (in [448, 464)) rounds to the largest finite 448
    want_codes = [0x7E, 0x38, 0x01, 0x38, 0x3A, 0xC6, 0x00, 0x09, 0x7E]
    codes = values.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    assert codes == want_codes


def test_activation_quantization_by_hand():
    """One row, two groups of 4: group 0 amax 896 -> scale 2; group 1 all zeros -> the floor scale, zeros."""
    x = torch.tensor([[896.0, 2.125, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    xq, scale = ref.quantize_activation(x, 4)
    assert scale[0, 0].item() == 2.0
    assert scale[0, 1].item() == pytest.approx(ref.ACT_AMAX_FLOOR / 448, rel=1e-6)
    # 2.125 / 2 = 1.0625 -> 1.0 (ties to even); -1/2 = -0.5 exact
    assert xq.float().tolist() == [[448.0, 1.0, -0.5, 0.0, 0.0, 0.0, 0.0, 0.0]]


@pytest.mark.parametrize("shape,block", [((200, 300), (128, 128)), ((37, 50), (16, 32)), ((5, 7), (128, 128))])
def test_fp8_block_quantize_round_trip(shape, block):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=gen) * torch.logspace(-3, 1, shape[1])  # column magnitudes spread
    w[: block[0], : block[1]] = 0.0  # an all-zero block: scale 0, zeros
    q, scale = ref.fp8_block_quantize(w, block)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.shape == (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
    assert scale[0, 0].item() == 0.0
    deq = ref.prepare_fp8_block(q, scale, block).dequantize(torch.float32)
    s = scale.repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]]
    # e4m3: 3 mantissa bits (half an ulp = 2^-4 relative), subnormal steps of 2^-9 (half: 2^-10), times the scale
    assert bool(((deq - w).abs() <= torch.maximum(w.abs() * 2.0**-4, s * 2.0**-10) * (1 + 1e-6)).all())
    # each block's largest magnitude maps to +-448 exactly
    flat = (q.float().abs() == 448.0).sum().item()
    assert flat >= scale.numel() - 1


# -------------------------------------------------------------------------------------------- FP8 block linear


def fp8_oracle(x, q, scale, block):
    """float64 y, float64 sum|terms| of the FP8 block semantics, written from the definition column by column."""
    bn, bk = block
    m, k = x.shape
    xf = x.float()
    y = torch.zeros(m, q.shape[0], dtype=torch.float64)
    terms = torch.zeros_like(y)
    w_rows = q.double() * 1.0
    for g in range(math.ceil(k / bk)):
        cols = list(range(g * bk, min(k, (g + 1) * bk)))
        s_x = torch.clamp(xf[:, cols].abs().amax(1), min=ref.ACT_AMAX_FLOOR) / 448.0  # float32, as specified
        xq = (xf[:, cols] / s_x[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn).double()
        s_w = torch.tensor([scale[n // bn, g].item() for n in range(q.shape[0])], dtype=torch.float64)
        prod = xq[:, None, :] * w_rows[None, :, cols]  # [M, N, len]
        factor = s_x.double()[:, None] * s_w[None, :]
        y += prod.sum(2) * factor
        terms += prod.abs().sum(2) * factor
    return y, terms


@pytest.mark.parametrize("dtype", OUT_DTYPES)
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("n,k,block", [(200, 300, (128, 128)), (37, 96, (16, 32)), (9, 5, (128, 128))])
def test_fp8_block_linear_matches_float64(dtype, m, n, k, block):
    gen = torch.Generator().manual_seed(m * n + k)
    q, scale = ref.fp8_block_quantize(torch.randn(n, k, generator=gen) * 0.05, block)
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-2, 1, k)).to(dtype)  # groups of different ranges
    w = ref.prepare_fp8_block(q, scale, block)
    y64, terms = fp8_oracle(x, q, scale, block)
    got = ref.fp8_block_linear(x, w)
    assert got.dtype == dtype and got.shape == (m, n)
    groups = math.ceil(k / block[1])
    assert_within(got, y64, terms, min(k, block[1]) + 2 * groups, dtype)


def test_fp8_prepare_names_bad_tensors():
    q = torch.zeros(10, 20, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"weight_scale_inv must be \(1, 1\)"):
        ref.prepare_fp8_block(q, torch.ones(2, 1), (128, 128))
    with pytest.raises(ValueError, match="weight must be a 2-D float8_e4m3fn"):
        ref.prepare_fp8_block(torch.zeros(10, 20), torch.ones(1, 1), (128, 128))
    w = ref.prepare_fp8_block(q, torch.ones(1, 1), (128, 128))
    with pytest.raises(ValueError, match=r"x must be \[M, 20\]"):
        ref.fp8_block_linear(torch.zeros(2, 21), w)
    assert w.shape == (10, 20) and w.nbytes == 200 + 4
    assert ref.fp8_block_linear(torch.zeros(0, 20), w).shape == (0, 10)  # an empty batch, not an error


# -------------------------------------------------------------------------------------------- int4 W4A16


def _int4_checkpoint(n, k, g, symmetric, gen):
    """Signed int4 values q [N, K] and zero points z [N, K/g] (int8 in -8..7, as compressed-tensors quantizes),
    scales bf16 [N, K/g]."""
    q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    z = None if symmetric else torch.randint(-8, 8, (n, k // g), generator=gen, dtype=torch.int8)
    scale = (torch.rand(n, k // g, generator=gen) * 0.02 + 0.001).to(torch.bfloat16)
    return q, z, scale


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("n,k,g", [(37, 256, 128), (16, 96, 32), (9, 128, 64)])
def test_int4_unpacks_as_compressed_tensors_does(symmetric, n, k, g):
    """Packed by compressed-tensors' own pack_to_int32; our dequantize equals its decompressor bit for bit."""
    ct_pack = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    q, z, scale = _int4_checkpoint(n, k, g, symmetric, torch.Generator().manual_seed(n + k))
    packed = ct_pack.pack_to_int32(q, 4)
    zero_packed = None if z is None else ct_pack.pack_to_int32(z, 4, packed_dim=0)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=g)
    state = {"weight_packed": packed, "weight_scale": scale, "weight_shape": torch.tensor([n, k])}
    if zero_packed is not None:
        state["weight_zero_point"] = zero_packed
    ct_weight = PackedQuantizationCompressor.decompress(state, QuantizationScheme(targets=["Linear"], weights=args))
    w = ref.prepare_int4(packed, scale, zero_packed, g, None, (n, k))
    assert torch.equal(w.dequantize(torch.bfloat16), ct_weight["weight"])
    # and our own nibble order: column k is nibble k % 8 of word k // 8, holding q + 8
    assert torch.equal(ref.unpack_int4(packed, k).to(torch.int16) - 8, q.to(torch.int16))
    assert torch.equal(ref.pack_int4(ref.unpack_int4(packed, k)), packed)


def int4_oracle64(q, z, scale, g, g_idx):
    """float64 W [N, K] = (q - z[group]) * scale[group], group = g_idx[k] (k // g without act order)."""
    k = q.shape[1]
    group = torch.arange(k) // g if g_idx is None else g_idx.long()
    zero = torch.zeros(q.shape[0], k, dtype=torch.float64) if z is None else z.double()[:, group]
    return (q.double() - zero) * scale.double()[:, group]


@pytest.mark.parametrize("dtype", OUT_DTYPES)
@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("symmetric,act_order", [(True, False), (False, False), (False, True), (True, True)])
def test_int4_linear_matches_float64(dtype, m, symmetric, act_order):
    n, k, g = 37, 256, 64
    gen = torch.Generator().manual_seed(m)
    q, z, scale = _int4_checkpoint(n, k, g, symmetric, gen)
    g_idx = None
    if act_order:  # GPTQ's: the columns of each group scattered over K
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[torch.randperm(k, generator=gen)] = torch.arange(k, dtype=torch.int32) // g
    nibbles = (q.to(torch.int16) + 8).to(torch.uint8)
    zero_packed = None if z is None else _pack_rows(z)
    w = ref.prepare_int4(ref.pack_int4(nibbles), scale, zero_packed, g, g_idx, (n, k))
    assert (w.perm is not None) == act_order
    w64 = int4_oracle64(q, z, scale, g, g_idx)
    assert torch.equal(w.dequantize(torch.float32).double(), w64)  # exact in float32
    x = torch.randn(m, k, generator=gen).to(dtype)
    got = ref.int4_linear(x, w)
    assert got.dtype == dtype
    assert_within(got, x.double() @ w64.T, x.double().abs() @ w64.abs().T, k, dtype)


def _pack_rows(z):
    """Zero points [N, G] int8 packed along N into int32 [ceil(N/8), G], N padded with (signed) zeros."""
    n, groups = z.shape
    padded = torch.zeros(math.ceil(n / 8) * 8, groups, dtype=torch.int16)
    padded[:n] = z.to(torch.int16)
    return ref.pack_int4((padded + 8).to(torch.uint8).t().contiguous()).t().contiguous()


def test_int4_prepare_names_bad_tensors():
    packed, scale = torch.zeros(4, 16, dtype=torch.int32), torch.ones(4, 1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="group_size must be one of"):
        ref.prepare_int4(packed, scale, None, 100, None, (4, 128))
    with pytest.raises(ValueError, match=r"weight_scale must be \(4, 2\)"):
        ref.prepare_int4(packed, scale, None, 64, None, (4, 128))
    with pytest.raises(ValueError, match="weight_packed must be"):
        ref.prepare_int4(packed[:, :8], scale, None, 128, None, (4, 128))
    with pytest.raises(ValueError, match="weight_zero_point must be"):
        ref.prepare_int4(packed, scale, torch.zeros(4, 1, dtype=torch.int32), 128, None, (4, 128))
    with pytest.raises(ValueError, match="g_idx must put exactly 64"):
        ref.prepare_int4(packed, torch.ones(4, 2, dtype=torch.bfloat16), None, 64, torch.zeros(128), (4, 128))


# -------------------------------------------------------------------------------------------- NVFP4


def e2m1_by_formula(code: int) -> float:
    sign = -1.0 if code & 8 else 1.0
    e, m = (code >> 1) & 3, code & 1
    return sign * (m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1))


def test_e2m1_table_and_nibble_order_by_hand():
    assert list(ref.E2M1_VALUES) == [e2m1_by_formula(c) for c in range(16)]
    # one row of 16 columns: bytes (low nibble = even column, high = odd)
    row = [0x21, 0xF7, 0x00, 0x8B, 0x34, 0x56, 0x9A, 0xCD]
    weight = torch.tensor([row], dtype=torch.uint8)
    scale = torch.tensor([[0x40]], dtype=torch.uint8).view(torch.float8_e4m3fn)  # e4m3 0x40 = 2.0
    w = ref.prepare_nvfp4(weight, scale, torch.tensor(0.5))
    want = [0.5, 1.0, 6.0, -6.0, 0.0, 0.0, -1.5, -0.0, 2.0, 1.5, 4.0, 3.0, -1.0, -0.5, -3.0, -2.0]
    assert w.dequantize(torch.float32).tolist() == [want]  # times 2.0 * 0.5
    assert w.nbytes == 8 + 1 + 4


@pytest.mark.parametrize("dtype", OUT_DTYPES)
@pytest.mark.parametrize("m", [1, 4, 19])
@pytest.mark.parametrize("n,k", [(37, 48), (8, 256)])
def test_nvfp4_linear_matches_float64(dtype, m, n, k):
    gen = torch.Generator().manual_seed(m + n)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    weight = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    scale = (torch.rand(n, k // 16, generator=gen) * 4 + 0.01).to(torch.float8_e4m3fn)
    # one second-level scale, or one per row (a fused projection)
    scale_2 = torch.tensor([0.0123]) if n % 2 else torch.rand(n, generator=gen) * 0.02 + 0.001
    w = ref.prepare_nvfp4(weight, scale, scale_2)
    values = torch.tensor([e2m1_by_formula(c) for c in range(16)], dtype=torch.float64)[codes]
    w64 = values * scale.double().repeat_interleave(16, 1) * scale_2.double()[:, None]
    x = torch.randn(m, k, generator=gen).to(dtype)
    got = ref.nvfp4_linear(x, w)
    assert got.dtype == dtype and got.shape == (m, n)
    # the float32 weight: e2m1 * scale is exact, times scale_2 rounds once (relative 2^-24 more per term)
    assert_within(got, x.double() @ w64.T, x.double().abs() @ w64.abs().T, k + 1, dtype)


def test_nvfp4_prepare_names_bad_tensors():
    with pytest.raises(ValueError, match="weight must be 2-D uint8"):
        ref.prepare_nvfp4(torch.zeros(4, 8, dtype=torch.int8), torch.zeros(4, 1), 1.0)
    with pytest.raises(ValueError, match=r"weight_scale must be \(4, 1\) float8_e4m3fn"):
        ref.prepare_nvfp4(torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 1), 1.0)
    with pytest.raises(ValueError, match="multiple of 16"):
        ref.prepare_nvfp4(torch.zeros(4, 9, dtype=torch.uint8), torch.zeros(4, 1), 1.0)
    with pytest.raises(ValueError, match=r"weight_scale_2 must be a scalar or \[4\]"):
        ref.prepare_nvfp4(torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.float8_e4m3fn),
                          torch.ones(2))
    with pytest.raises(ValueError, match="weight_scale_2 must be finite"):
        ref.prepare_nvfp4(torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.float8_e4m3fn),
                          float("nan"))
