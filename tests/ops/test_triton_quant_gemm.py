"""The quantized GEMMs' Triton kernels (ops/quant_gemm: cuda_fp8, cuda_weight_only) in Triton's CPU interpreter,
against the float64 value of each format's semantics, on small odd shapes with small tiles: partial column tiles,
a partial FP8 K block, split K (even and uneven), padded rows, zero points, act order, per-row NVFP4 scale_2.
bf16 and fp16 activations (the bit-trick int4 codes 128 + q and 1024 + q; the interpreter patched to widen bf16
dot operands and to round to bf16 / fp8 as the GPU does), float32 (codes by conversion). The dispatch and the
tuned table too. The compiled kernels: tests/gpu/test_quant_gemm_gpu.py.
"""

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("compiled kernels are tested by tests/gpu/test_quant_gemm_gpu.py", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

import deltaserve.ops.quant_gemm as quant_gemm  # noqa: E402
from deltaserve.ops.quant_gemm import configs, cuda_fp8, cuda_gemv, cuda_weight_only  # noqa: E402
from deltaserve.ops.quant_gemm import reference as ref  # noqa: E402
from tests.ops import quant_gemm_oracle as oracle  # noqa: E402
from tests.ops.interpreter import (patch_interpreter_bf16_dot, patch_interpreter_float_rounding,  # noqa: E402
                                   patch_interpreter_index)
from tests.tolerance import gamma, unit_roundoff  # noqa: E402

patch_interpreter_index()
patch_interpreter_float_rounding()
patch_interpreter_bf16_dot()

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SKINNY = [dict(block_n=16, block_k=32, split_k=1, warps=4, stages=1, quant_x=1),
          dict(block_n=32, block_k=64, split_k=2, warps=4, stages=1, quant_x=0)]
# FP8's skinny tiles copied by TMA (rows of 16-byte multiples; others fall back to pointer loads)
SKINNY_TMA = [dict(block_n=16, block_k=32, split_k=1, warps=4, stages=1, quant_x=0, tma=1),
              dict(block_n=32, block_k=64, split_k=2, warps=4, stages=1, quant_x=1, tma=1)]
GEMM = dict(block_m=16, block_n=16, block_k=64, group_m=2, warps=4, stages=1)
GEMV = dict(block_n=16, block_k=256, warps=4, stages=1)


def fp8_weight(n, k, block, gen):
    q, s = ref.fp8_block_quantize(torch.randn(n, k, generator=gen) * torch.logspace(-2, 0, n)[:, None], block)
    return ref.prepare_fp8_block(q, s, block)


def int4_weight(n, k, g, symmetric, act_order, gen):
    nibbles = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n, k // g, generator=gen) * 0.02 + 0.001).to(torch.float16)
    zero = None
    if not symmetric:
        z = torch.randint(0, 16, (-(-n // 8) * 8, k // g), generator=gen, dtype=torch.uint8)
        zero = ref.pack_int4(z.t().contiguous()).t().contiguous()  # packed along N, as compressed-tensors
    g_idx = None
    if act_order:
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[torch.randperm(k, generator=gen)] = torch.arange(k, dtype=torch.int32) // g
    return ref.prepare_int4(ref.pack_int4(nibbles), scale, zero, g, g_idx, (n, k))


def nvfp4_weight(n, k, per_row, gen):
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n, k // 16, generator=gen) * 8 + 0.005).to(torch.float8_e4m3fn)  # subnormal e4m3 too
    scale_2 = torch.rand(n, generator=gen) * 0.01 + 1e-3 if per_row else 0.0042
    return ref.prepare_nvfp4(packed, scale, scale_2)


def activations(m, k, dtype, gen):
    return (torch.randn(m, k, generator=gen) * torch.logspace(-1, 1, k)).to(dtype)


# ------------------------------------------------------------------------------------------------ FP8


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", SKINNY + SKINNY_TMA)
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("n,k,block", [(40, 300, (128, 128)), (24, 96, (16, 32)), (40, 208, (16, 32))])
def test_fp8_skinny(dtype, config, m, n, k, block):
    """K = 300: three blocks, the last partial, split 2 ways unevenly; N = 40 against 16/32-wide tiles; 17 rows
    pad to 32. TMA tiles copy the K = 96 and 208 weights (rows of 16-byte multiples; 208 ends in a half box,
    zero-filled) and fall back to pointer loads at 300."""
    gen = torch.Generator().manual_seed(m + n)
    w, x = fp8_weight(n, k, block, gen), activations(m, k, dtype, gen)
    y64, terms = oracle.fp8_exact(x, w)
    got = cuda_fp8.skinny(x, w, config)
    assert got.dtype == dtype and got.shape == (m, n)
    oracle.assert_within(got, y64, oracle.fp8_bound(x, w, y64, terms), "fp8 skinny")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [5, 37])
def test_fp8_gemm_and_quantize(dtype, m):
    gen = torch.Generator().manual_seed(m)
    w, x = fp8_weight(40, 300, (128, 128), gen), activations(m, 300, dtype, gen)
    xq, sx = cuda_fp8.quantize(x, 128)
    want_q, want_s = ref.quantize_activation(x, 128)
    assert torch.equal(xq.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(sx.t(), want_s)
    y64, terms = oracle.fp8_exact(x, w)
    got = cuda_fp8.gemm(x, w, dict(GEMM, block_k=128))
    oracle.assert_within(got, y64, oracle.fp8_bound(x, w, y64, terms), "fp8 gemm")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])  # the interpreter has no bf16 arithmetic
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("residual", [False, True])
def test_norm_and_silu_write_the_fp8_activation(dtype, m, residual):
    """The RMS norm, silu_and_mul and gated RMS norm kernels asked for an FP8 activation write the codes and
    scales that the quantize kernel makes of their plain output, bit for bit (rows of 320 columns: 2.5 scale
    groups; silu's 1,408: a second column block of 3 groups; the gated norm's 3 heads of 128, a group each), and
    the norm's residual sum as without. (bf16: on the GPU, tests/gpu/test_quant_gemm_gpu.py.)"""
    from deltaserve.ops.activation import cuda as activation_cuda
    from deltaserve.ops.norm import cuda as norm_cuda

    gen = torch.Generator().manual_seed(m)
    x, w = activations(m, 320, dtype, gen), (torch.randn(320, generator=gen) * 0.1).to(dtype)
    res = activations(m, 320, dtype, gen) if residual else None
    plain = norm_cuda.rms_norm(x, w, 1e-6, res)
    fused = norm_cuda.rms_norm(x, w, 1e-6, res, quant_block=128)
    if residual:
        (plain, h), (fused, h_fused) = plain, fused
        assert torch.equal(h, h_fused)
    gate_up = activations(m, 2 * 1408, dtype, gen)
    heads, gate = (activations(m, 3 * 128, dtype, gen).view(m, 3, 128) for _ in range(2))
    head_w = (torch.randn(128, generator=gen) * 0.1).to(dtype)
    gated = norm_cuda.gated_rms_norm(heads, gate, head_w, 1e-6).reshape(m, 3 * 128)
    for got, unquantized in ((fused, plain), (activation_cuda.silu_and_mul(gate_up, quant_block=128),
                                              activation_cuda.silu_and_mul(gate_up)),
                             (norm_cuda.gated_rms_norm(heads, gate, head_w, 1e-6, quant_block=128), gated)):
        xq, sx = cuda_fp8.quantize(unquantized, 128)
        assert isinstance(got, ref.Fp8Activation) and got.block_k == 128 and got.dtype == dtype
        assert torch.equal(got.xq.view(torch.uint8), xq.view(torch.uint8)) and torch.equal(got.sx, sx)


def test_fp8_skinny_tma_tiles_copy_by_tma_where_rows_align(monkeypatch):
    """A TMA tile makes descriptors over the weight and the quantized activation when their rows are 16-byte
    multiples (K = 96), over neither when not (K = 300), and over the weight alone when the kernel quantizes x."""
    made = []
    real = cuda_fp8.TensorDescriptor.from_tensor
    monkeypatch.setattr(cuda_fp8.TensorDescriptor, "from_tensor",
                        lambda t, block: made.append((t.dtype, tuple(t.shape))) or real(t, block))
    gen = torch.Generator().manual_seed(2)
    for k, config in ((96, SKINNY_TMA[0]), (300, SKINNY_TMA[0]), (96, SKINNY_TMA[1])):
        block = (16, 32) if k == 96 else (128, 128)
        cuda_fp8.skinny(activations(3, k, torch.bfloat16, gen), fp8_weight(24, k, block, gen), config)
    e4m3 = torch.float8_e4m3fn
    assert made == [(e4m3, (3, 96)), (e4m3, (24, 96)), (e4m3, (24, 96))]


@pytest.mark.parametrize("kind", ["gemv", "skinny", "gemm"])
def test_fp8_products_take_a_quantized_activation(kind):
    """The FP8 GEMV, skinny kernel and tiled GEMM given the activation already quantized return what they return
    when they quantize it themselves, bit for bit; a block or config that does not fit is refused by name."""
    gen = torch.Generator().manual_seed(1)
    m = 1 if kind == "gemv" else 3
    w, x = fp8_weight(40, 256, (128, 128), gen), activations(m, 256, torch.bfloat16, gen)
    act = ref.Fp8Activation(*cuda_fp8.quantize(x, 128), 128, x.dtype)
    if kind == "gemv":
        config = dict(GEMV, block_n=8, block_k=256)
        assert torch.equal(cuda_gemv.gemv(act, w, config), cuda_gemv.gemv(x, w, config))
    elif kind == "gemm":
        config = dict(configs.tiled_config("fp8"), block_m=16, block_n=32, warps=4, stages=1)
        assert torch.equal(cuda_fp8.gemm(act, w, config), cuda_fp8.gemm(x, w, config))
        with pytest.raises(ValueError, match="multiple of 4 rows"):
            cuda_fp8.torch_scaled_mm(act, w)
    else:
        config = dict(SKINNY[1], quant_x=0)
        assert torch.equal(cuda_fp8.skinny(act, w, config), cuda_fp8.skinny(x, w, config))
        with pytest.raises(ValueError, match="quant_x 0"):
            cuda_fp8.skinny(act, w, dict(config, quant_x=1))
    with pytest.raises(ValueError, match="blocks of 64 columns"):
        cuda_fp8.quantized(ref.Fp8Activation(act.xq, act.sx, 64, x.dtype), 128)
    with pytest.raises(ValueError, match="does not fit the FP8 product"):
        quant_gemm.fp8_block_linear(ref.Fp8Activation(act.xq, act.sx, 64, x.dtype), w)


@pytest.mark.parametrize("rows", [1, 3])
def test_fp8_prologue_writes_the_activation_the_product_would_quantize(rows, monkeypatch):
    """ops.linear's norm, SiLU and gated-norm projections onto an FP8 QuantWeight (the GPU check patched): the
    prologue kernel writes the quantized activation and the product launches no quantize kernel, with the very
    result of the unfused ops; an int4 weight, and F.scaled_mm's row counts that it pads, keep the unfused path."""
    import deltaserve.ops.linear as linear
    from deltaserve.layers.quant.weight import QuantWeight

    gen = torch.Generator().manual_seed(rows)
    w = QuantWeight(fp8_weight(40, 256, (128, 128), gen), quant_gemm.fp8_block_linear)
    x, res = activations(rows, 256, torch.float16, gen), activations(rows, 256, torch.float16, gen)
    norm_w = (torch.randn(256, generator=gen) * 0.1).to(torch.float16)
    gate_up = activations(rows, 512, torch.float16, gen)
    monkeypatch.setattr(linear, "_on_gpu", lambda t: True)
    monkeypatch.setattr(quant_gemm, "_kernels_serve", lambda t: True)
    monkeypatch.setattr(configs, "tuned_table", lambda: {})  # the defaults: one row the GEMV, then skinny
    quantizations = []
    real_quantize = cuda_fp8.quantize
    monkeypatch.setattr(cuda_fp8, "quantize", lambda *a: quantizations.append(1) or real_quantize(*a))
    heads, gate = (activations(rows, 256, torch.float16, gen).view(rows, 2, 128) for _ in range(2))
    head_w = (torch.randn(128, generator=gen) * 0.1).to(torch.float16)

    def both():
        return (linear.rms_norm_linear(x, norm_w, 1e-6, w), linear.rms_norm_linear(x, norm_w, 1e-6, w, res),
                linear.silu_mul_linear(gate_up, w), linear.gated_norm_linear(heads, gate, head_w, 1e-6, w))
    fused = both()
    assert quantizations == [] and w.fp8_input_block(rows) == 128
    monkeypatch.setattr(linear, "_fp8_input_block", lambda *args, **kwargs: 0)
    unfused = both()
    assert len(quantizations) == 4
    assert torch.equal(fused[0], unfused[0]) and torch.equal(fused[2], unfused[2]) and torch.equal(fused[3], unfused[3])
    assert all(torch.equal(a, b) for a, b in zip(fused[1], unfused[1]))
    # above the decode kernels' rows: the tiled GEMM (w's 40 rows are no 128-row block) quantizes first at any row
    # count, torch's F.scaled_mm at those it takes unpadded
    assert w.fp8_input_block(65) == 128
    w_torch = QuantWeight(fp8_weight(128, 256, (128, 128), gen), quant_gemm.fp8_block_linear)
    assert w_torch.fp8_input_block(65) is None and w_torch.fp8_input_block(68) == 128
    assert QuantWeight(int4_weight(40, 256, 64, False, False, gen), quant_gemm.int4_linear).fp8_input_block(1) is None


def test_split_weight_takes_the_norm_quantized_and_unquantized(monkeypatch):
    """A SplitWeight of an FP8 part and a plain part (GDN's in-projection in Qwen's FP8 checkpoints) behind
    ops.linear's RMS norm (the GPU check patched): the norm kernel writes the activation quantized for the FP8 part
    and keeps it unquantized for the plain one, no quantize kernel runs, and the blocks are the unfused products
    bit for bit; the SiLU and gated-norm prologues, which cannot keep it, leave the SplitWeight unfused."""
    import deltaserve.ops.linear as linear
    from deltaserve.layers.quant.weight import QuantWeight, SplitWeight
    from deltaserve.ops.activation import cuda as activation_cuda
    from deltaserve.ops.norm import cuda as norm_cuda

    gen = torch.Generator().manual_seed(5)
    fp8 = QuantWeight(fp8_weight(40, 256, (128, 128), gen), quant_gemm.fp8_block_linear)
    plain = (torch.randn(8, 256, generator=gen) * 0.05).to(torch.float16)
    split = SplitWeight((fp8, plain))
    assert split.reads_unquantized and not SplitWeight((fp8, fp8)).reads_unquantized
    x, res = activations(3, 256, torch.float16, gen), activations(3, 256, torch.float16, gen)
    norm_w = (torch.randn(256, generator=gen) * 0.1).to(torch.float16)
    monkeypatch.setattr(linear, "_on_gpu", lambda t: True)
    monkeypatch.setattr(quant_gemm, "_kernels_serve", lambda t: True)
    monkeypatch.setattr(configs, "tuned_table", lambda: {})
    quantizations = []
    real_quantize = cuda_fp8.quantize
    monkeypatch.setattr(cuda_fp8, "quantize", lambda *a: quantizations.append(1) or real_quantize(*a))
    blocks, h = linear.rms_norm_linear(x, norm_w, 1e-6, split, res, blocks=True)
    joined, _ = linear.rms_norm_linear(x, norm_w, 1e-6, split, res)
    assert quantizations == [] and split.fp8_input_block(3) == 128
    normed, h_ref = norm_cuda.rms_norm(x, norm_w, 1e-6, res)
    assert torch.equal(h, h_ref) and len(blocks) == 2
    assert torch.equal(blocks[0], fp8.matmul(normed)) and torch.equal(blocks[1], linear.matmul(normed, plain))
    assert torch.equal(joined, torch.cat(blocks, dim=-1))
    kept = norm_cuda.rms_norm(x, norm_w, 1e-6, quant_block=128, keep_unquantized=True)
    assert torch.equal(kept.unquantized, norm_cuda.rms_norm(x, norm_w, 1e-6))
    with pytest.raises(ValueError, match="unquantized rows"):
        split.matmul(norm_cuda.rms_norm(x, norm_w, 1e-6, quant_block=128))
    gate_up = activations(3, 512, torch.float16, gen)
    split_down = SplitWeight((QuantWeight(fp8_weight(40, 256, (128, 128), gen), quant_gemm.fp8_block_linear), plain))
    quantizations.clear()
    fused_down = linear.silu_mul_linear(gate_up, split_down)
    assert quantizations == [1]  # its FP8 part quantized the SiLU's output itself
    assert torch.equal(fused_down, split_down.matmul(activation_cuda.silu_and_mul(gate_up)))


# ------------------------------------------------------------------------------------------------ int4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", SKINNY)
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("symmetric,act_order", [(False, False), (True, False), (False, True)])
def test_int4_skinny(dtype, config, m, symmetric, act_order):
    gen = torch.Generator().manual_seed(m)
    w, x = int4_weight(40, 256, 64, symmetric, act_order, gen), activations(m, 256, dtype, gen)
    y64, terms = oracle.weight_only_exact(x, w)
    got = cuda_weight_only.skinny(x, w, config)
    assert got.dtype == dtype and got.shape == (m, 40)
    bound = oracle.weight_only_bound(x, w, y64, terms, exact_codes=True)
    oracle.assert_within(got, y64, bound, "int4 skinny")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("g,block_k", [(64, 128), (128, 64), (32, 32)])
@pytest.mark.parametrize("symmetric,act_order", [(False, False), (True, True)])
def test_int4_gemm_and_dequantize(dtype, g, block_k, symmetric, act_order):
    """Tiles of two groups, half a group and one group; 37 rows in 16-row tiles."""
    gen = torch.Generator().manual_seed(g)
    w, x = int4_weight(40, 256, g, symmetric, act_order, gen), activations(37, 256, dtype, gen)
    y64, terms = oracle.weight_only_exact(x, w)
    u_w = oracle.UNIT_ROUNDOFF[dtype]
    got = cuda_weight_only.gemm(x, w, dict(GEMM, block_k=block_k))
    oracle.assert_within(got, y64, oracle.weight_only_bound(x, w, y64, terms, u_w=u_w), "int4 gemm")
    got = cuda_weight_only.cublas(x, w)  # the dequantized copy, then torch's matmul
    oracle.assert_within(got, y64, oracle.weight_only_bound(x, w, y64, terms, u_w=u_w), "int4 dequantize + mm")
    torch.testing.assert_close(cuda_weight_only.dequantize(w, torch.float32), w.dequantize_packed_order(),
                               rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ NVFP4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", SKINNY)
@pytest.mark.parametrize("m", [1, 17])
@pytest.mark.parametrize("n,k,per_row", [(40, 96, False), (24, 256, True)])
def test_nvfp4_skinny(dtype, config, m, n, k, per_row):
    """K = 96 takes 32-column blocks (64 does not divide it)."""
    gen = torch.Generator().manual_seed(m + k)
    w, x = nvfp4_weight(n, k, per_row, gen), activations(m, k, dtype, gen)
    y64, terms = oracle.weight_only_exact(x, w)
    got = cuda_weight_only.skinny(x, w, config)
    bound = oracle.weight_only_bound(x, w, y64, terms, u_w=oracle.UNIT_ROUNDOFF[dtype])
    oracle.assert_within(got, y64, bound, "nvfp4 skinny")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_row", [False, True])
def test_nvfp4_gemm_and_dequantize(dtype, per_row):
    gen = torch.Generator().manual_seed(3)
    w, x = nvfp4_weight(40, 192, per_row, gen), activations(37, 192, dtype, gen)
    y64, terms = oracle.weight_only_exact(x, w)
    bound = oracle.weight_only_bound(x, w, y64, terms, u_w=oracle.UNIT_ROUNDOFF[dtype])
    oracle.assert_within(cuda_weight_only.gemm(x, w, GEMM), y64, bound, "nvfp4 gemm")
    oracle.assert_within(cuda_weight_only.cublas(x, w), y64, bound, "nvfp4 dequantize + mm")
    # e2m1 * scale is exact; times scale_2 folded into the group scale: within 2 float32 roundings
    torch.testing.assert_close(cuda_weight_only.dequantize(w, torch.float32), w.dequantize(torch.float32),
                               rtol=2 * oracle.U32, atol=0)


# ------------------------------------------------------------------------------------------------ one-row GEMV


def gemv_bound(x, w, y64, terms, extra_roundings=0):
    """The GEMV's float32 sums run over all of K (not per block): K + 2 roundings a term (+ the scales')."""
    return (w.shape[1] + 2 + extra_roundings) * oracle.U32 * terms + oracle.UNIT_ROUNDOFF[x.dtype] * y64.abs() + \
        torch.finfo(x.dtype).tiny


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("g,n,block_k", [(64, 40, 256), (128, 48, 512), (32, 16, 128)])
@pytest.mark.parametrize("symmetric,act_order", [(False, False), (True, False), (False, True)])
def test_int4_gemv(dtype, m, g, n, block_k, symmetric, act_order):
    """Every nibble position with its own zero point per group (codes and zeros cover 0..15); partial and whole
    row blocks; K blocks of several groups, one K block shorter than asked (K = 256 < 512); 3 rows padded to 4."""
    gen = torch.Generator().manual_seed(g + n + m)
    w, x = int4_weight(n, 256, g, symmetric, act_order, gen), activations(m, 256, dtype, gen)
    y64, terms = oracle.weight_only_exact(x, w)
    config = dict(GEMV, block_k=block_k)
    assert cuda_gemv.supports(w, config, m) and not cuda_gemv.supports(w, config, cuda_gemv.MAX_ROWS + 1)
    got = cuda_gemv.gemv(x, w, config)
    assert got.dtype == dtype and got.shape == (m, n)
    oracle.assert_within(got, y64, gemv_bound(x, w, y64, terms), "int4 gemv")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("symmetric,act_order", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("block_k,split_k,steps", [(64, 3, (2, 3)), (64, 5, (2, 5)), (32, 1, (1, 1)), (512, 8, (8, 3))])
def test_int4_one_row_split_k(dtype, symmetric, act_order, block_k, split_k, steps):
    """The one-row kernel over 24 groups of 32: several groups a K step, K split in 3 or 5 (12 steps: splits of 2
    and 3 steps), or 8 asked of 3 steps (3), the partials summed in order; N = 40 leaves a partial row block."""
    gen = torch.Generator().manual_seed(block_k + split_k)
    w, x = int4_weight(40, 768, 32, symmetric, act_order, gen), activations(1, 768, dtype, gen)
    config = dict(GEMV, block_k=block_k, split_k=split_k)
    assert cuda_gemv._row_steps(768, 32, config) == steps
    y64, terms = oracle.weight_only_exact(x, w)
    oracle.assert_within(cuda_gemv.gemv(x, w, config), y64, gemv_bound(x, w, y64, terms), "int4 one-row gemv")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("symmetric,act_order", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("g,block_k,split_k", [(32, 64, 3), (64, 128, 1), (128, 256, 2)])
def test_int4_one_row_dp4a(dtype, symmetric, act_order, g, block_k, split_k):
    """The dp4a one-row kernel (x as 16-bit fixed point per group, the nibbles dotted in int32) over 768 columns:
    every nibble position and zero point, K split, N = 40 leaving a partial row block. The first g columns are
    zero (a zero group unless act order scatters them); column g, the largest of its group, is 2 - 2^-23: in
    float32 it rounds up to 2^15 steps of the fixed point, clamped to 2^15 - 1 (bf16 and fp16 round it to 2)."""
    gen = torch.Generator().manual_seed(g + split_k)
    w, x = int4_weight(40, 768, g, symmetric, act_order, gen), activations(1, 768, dtype, gen)
    x[0, :g] = 0.0
    x[0, g:2 * g] = x[0, g:2 * g].clamp(-1.0, 1.0)
    x[0, g] = 2.0 - 2.0**-23
    config = dict(GEMV, block_k=block_k, split_k=split_k, dp4a=1)
    assert cuda_gemv.supports(w, config, 1)
    y64, _ = oracle.weight_only_exact(x, w)
    got = cuda_gemv.gemv(x, w, config)
    assert got.dtype == dtype and got.shape == (1, 40)
    splits = cuda_gemv._row_steps(768, g, config)[1]
    oracle.assert_within(got, y64, oracle.int4_dp4a_bound(x, w, y64, splits), "int4 dp4a gemv")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 7])
@pytest.mark.parametrize("n,k,per_row", [(40, 96, False), (24, 256, True)])
def test_nvfp4_gemv(dtype, m, n, k, per_row):
    """All 16 e2m1 codes in all 8 nibble positions (random bytes), subnormal e4m3 scales; K = 96 takes 32-column
    blocks. The group scale times scale_2 and 2^14 are rounded twice more than the reference's dequantization."""
    gen = torch.Generator().manual_seed(n + k + m)
    w, x = nvfp4_weight(n, k, per_row, gen), activations(m, k, dtype, gen)
    y64, terms = oracle.weight_only_exact(x, w)
    got = cuda_gemv.gemv(x, w, GEMV)
    oracle.assert_within(got, y64, gemv_bound(x, w, y64, terms, extra_roundings=3), "nvfp4 gemv")


@pytest.mark.parametrize("dtype,per_row,block_k,split_k,steps",
                         [(dtype, per_row, *config) for dtype in DTYPES for per_row in (False, True)
                          for config in ((64, 3, (4, 3)), (256, 2, (4, 2)))]
                         + [(torch.bfloat16, True, 16, 1, (1, 1))])  # one group a step (12 interpreted steps: once)
def test_nvfp4_one_row_dp4a(dtype, per_row, block_k, split_k, steps):
    """The dp4a one-row NVFP4 kernel (x as 16-bit fixed point per 16 columns, prmt's byte lookup of the e2m1 codes,
    positive and negative apart) over 192 columns: all 16 codes in all 8 nibble positions (random bytes), subnormal
    e4m3 scales, K split in 3 (16 groups a step asked of 12 take 4), or in 2 uneven splits (of 1 and 2 steps), N =
    40 leaving a partial row block. The first group is zero; column 16, the largest of its group, is 2 - 2^-23 (in
    float32 the fixed point's clamp)."""
    gen = torch.Generator().manual_seed(block_k + split_k + per_row)
    w, x = nvfp4_weight(40, 192, per_row, gen), activations(1, 192, dtype, gen)
    x[0, :16] = 0.0
    x[0, 16:32] = x[0, 16:32].clamp(-1.0, 1.0)
    x[0, 16] = 2.0 - 2.0**-23
    config = dict(GEMV, block_k=block_k, split_k=split_k, dp4a=1)
    assert cuda_gemv.supports(w, config, 1) and cuda_gemv._row_steps(192, 16, config) == steps
    y64, _ = oracle.weight_only_exact(x, w)
    got = cuda_gemv.gemv(x, w, config)
    assert got.dtype == dtype and got.shape == (1, 40)
    oracle.assert_within(got, y64, oracle.nvfp4_dp4a_bound(x, w, y64, steps[1]), "nvfp4 dp4a gemv")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt, tma", [("int4", 0), ("nvfp4", 0), ("fp8", 0), ("fp8", 1)])
def test_one_row_kernels_take_a_plain_tail_block(dtype, fmt, tma, monkeypatch):
    """The dp4a one-row kernels' and FP8's skinny kernel's first TAIL_ROWS programs multiply a 16-bit block beside
    the quantized product (as GDN's [b|a] beside [q|k|v|z]): the product's bits are those of its launch alone (K
    split unevenly: int4 20 steps in 3, NVFP4 17 in 2, FP8 10 blocks in 3 of 4, 4, 2), and the block's 7 rows (K: a
    1,024-column load and a partial one) are within a float32 dot's bound of float64, rounded once to x's dtype;
    FP8's tiles by pointer loads and by TMA.
    A row without its parts (FP8: without its unquantized row) is refused; quant_gemm.linear_with_tail, which
    SplitWeight.matmul_blocks takes, runs the same launch."""
    from deltaserve.layers.quant.weight import QuantWeight, SplitWeight

    gen = torch.Generator().manual_seed(7 + len(fmt))
    x = None
    if fmt == "int4":
        k, group, low_high = 1280, 32, False
        n, w, config = 16, int4_weight(16, k, group, False, False, gen), dict(GEMV, block_k=64, split_k=3, dp4a=1)
        op = quant_gemm.int4_linear
    elif fmt == "nvfp4":
        k, group, low_high = 1088, 16, True
        n, w, config = 16, nvfp4_weight(16, k, True, gen), dict(GEMV, block_k=64, split_k=2, dp4a=1)
        op = quant_gemm.nvfp4_linear
    else:
        k = 1280
        n, w = 24, fp8_weight(24, k, (128, 128), gen)
        config = dict(SKINNY[1], kind="skinny", split_k=3, quant_x=0, tma=tma)
        op = quant_gemm.fp8_block_linear
    x = activations(1, k, dtype, gen)
    if fmt == "fp8":
        written = ref.Fp8Activation(*cuda_fp8.quantize(x, 128), 128, x.dtype, unquantized=x)

        def product(act, tail=None):
            return cuda_fp8.skinny(act, w, config, tail=tail)
    else:
        written = ref.Dp4aActivation(x, *cuda_gemv.x_parts(x, group, low_high, {}), group, low_high)

        def product(act, tail=None):
            return cuda_gemv.gemv(act, w, config, tail=tail)
    plain = (torch.randn(7, k, generator=gen) * 0.05).to(dtype)
    alone = product(written)
    got, tail_out = product(written, plain)
    assert torch.equal(got, alone)
    expected = x.double() @ plain.double().T  # [1, 7]
    magnitudes = x.double().abs() @ plain.double().abs().T
    dot = gamma(k + 1, torch.float32) * magnitudes  # the products (exact but for float32's) and the sum
    u = unit_roundoff(dtype) if dtype != torch.float32 else 0.0
    oracle.assert_within(tail_out, expected, dot * (1 + u) + u * expected.abs(), f"{fmt} tail")
    with pytest.raises(ValueError, match="tail block"):
        product(x, plain)
    monkeypatch.setattr(quant_gemm, "_kernels_serve", lambda t: True)
    monkeypatch.setattr(configs, "tuned_table", lambda: {f"{fmt}:{n}:{k}:1": dict(config, kind=config.get("kind",
                                                                                                          "gemv"))})
    launches = []
    real_linear_with_tail = quant_gemm.linear_with_tail
    monkeypatch.setattr(quant_gemm, "linear_with_tail",
                        lambda *args: launches.append(real_linear_with_tail(*args)) or launches[-1])
    both = SplitWeight((QuantWeight(w, op), plain)).matmul_blocks(written)
    assert launches[0] is not None and len(both) == 2
    assert torch.equal(both[0], got) and torch.equal(both[1], tail_out)


DP4A_FORMATS = [("int4", 128, False), ("int4", 32, False), ("nvfp4", 16, True)]  # format, group, low_high


@pytest.mark.parametrize("output", ["fp8", "fp8-kept", "int4", "nvfp4"])
@pytest.mark.parametrize("residual", [False, True])
def test_one_row_norm_in_slices_writes_the_bits_of_one_program(output, residual, monkeypatch):
    """A decode row normed for an FP8 product (quantized, and kept) or with its dp4a parts, by a program per
    ROW_SLICE columns (128 here: 400 columns in 4 slices, the last partial, as are FP8's last block and the last
    slice's groups) writes every output bit for bit as the one-program launch does: each slice sums the whole row's
    squares."""
    from deltaserve.ops.norm import cuda as norm_cuda

    gen = torch.Generator().manual_seed(len(output) + residual)
    dtype = torch.float16
    d = 400 if output.startswith("fp8") else 384  # the parts' groups divide the row
    x, res = activations(1, d, dtype, gen), activations(1, d, dtype, gen) if residual else None
    w = (torch.randn(d, generator=gen) * 0.1).to(dtype)
    kwargs = {"fp8": dict(quant_block=128), "fp8-kept": dict(quant_block=128, keep_unquantized=True),
              "int4": dict(dp4a=(32, False)), "nvfp4": dict(dp4a=(16, True))}[output]

    def outputs():
        got = norm_cuda.rms_norm(x, w, 1e-6, res, **kwargs)
        act, h = got if residual else (got, None)
        if isinstance(act, ref.Fp8Activation):
            tensors = [act.xq.view(torch.uint8), act.sx] + ([act.unquantized] if act.unquantized is not None else [])
        else:
            tensors = [act.x, act.parts, act.x_scale, act.v_sum]
        return tensors + ([h] if residual else [])

    monkeypatch.setattr(norm_cuda, "ROW_SLICE", 1 << 20)
    whole = outputs()
    monkeypatch.setattr(norm_cuda, "ROW_SLICE", 128)
    sliced = outputs()
    assert len(whole) == len(sliced) and all(torch.equal(a, b) for a, b in zip(whole, sliced))


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("residual", [False, True])
def test_prompt_rows_normed_in_chunks_write_the_bits_of_each_row_alone(keep, residual, monkeypatch):
    """Prompt rows normed for an FP8 product (quantized, and kept) with their outputs written PROMPT_OUT_CHUNK
    columns at a time after the sum of squares (256 here: 400 columns in 2 chunks, the last partial, as is FP8's
    last block) write every output bit for bit as each row alone does in its slices (ROW_SLICE 128), the residual
    sum too: the chunks' offsets and the scales' [blocks, rows] layout against the one-row form."""
    from deltaserve.ops.norm import cuda as norm_cuda

    gen = torch.Generator().manual_seed(3 + 2 * keep + residual)
    dtype = torch.float16
    x, res = activations(5, 400, dtype, gen), activations(5, 400, dtype, gen) if residual else None
    w = (torch.randn(400, generator=gen) * 0.1).to(dtype)
    monkeypatch.setattr(norm_cuda, "PROMPT_OUT_CHUNK", 256)
    monkeypatch.setattr(norm_cuda, "ROW_SLICE", 128)

    def outputs(rows):
        got = norm_cuda.rms_norm(x[rows], w, 1e-6, res[rows] if residual else None, quant_block=128,
                                 keep_unquantized=keep)
        act, h = got if residual else (got, None)
        return [act.xq.view(torch.uint8), act.sx.t()] + ([act.unquantized] if keep else []) + ([h] if residual else [])

    together = outputs(slice(None))
    alone = [torch.cat(parts) for parts in zip(*(outputs(slice(i, i + 1)) for i in range(x.shape[0])))]
    assert len(together) == len(alone) and all(torch.equal(a, b) for a, b in zip(together, alone))


@pytest.mark.parametrize("fmt,group,low_high", DP4A_FORMATS)
@pytest.mark.parametrize("residual", [False, True])
def test_prologues_write_the_dp4a_parts(fmt, group, low_high, residual):
    """The RMS norm, silu_and_mul and gated RMS norm kernels asked for a row's fixed-point parts (a Dp4aActivation)
    write the row as without and the parts that _x_parts_kernel makes of that row, bit for bit: a norm row of 384
    columns (a 512-wide block: masked groups past it), silu's 2,304 (a second column block, partly masked), the
    gated norm's 3 heads of 128 (a program a head). fp16: the interpreter has no bf16 arithmetic."""
    from deltaserve.ops.activation import cuda as activation_cuda
    from deltaserve.ops.norm import cuda as norm_cuda

    gen = torch.Generator().manual_seed(group + residual)
    dtype = torch.float16
    x, w = activations(1, 384, dtype, gen), (torch.randn(384, generator=gen) * 0.1).to(dtype)
    res = activations(1, 384, dtype, gen) if residual else None
    plain = norm_cuda.rms_norm(x, w, 1e-6, res)
    written = norm_cuda.rms_norm(x, w, 1e-6, res, dp4a=(group, low_high))
    if residual:
        (plain, h), (written, h_written) = plain, written
        assert torch.equal(h, h_written)
    gate_up = activations(1, 2 * 2304, dtype, gen)
    heads, gate = (activations(1, 3 * 128, dtype, gen).view(1, 3, 128) for _ in range(2))
    head_w = (torch.randn(128, generator=gen) * 0.1).to(dtype)
    cases = [("norm", written, plain),
             ("silu", activation_cuda.silu_and_mul(gate_up, dp4a=(group, low_high)),
              activation_cuda.silu_and_mul(gate_up)),
             ("gated norm", norm_cuda.gated_rms_norm(heads, gate, head_w, 1e-6, dp4a=(group, low_high)),
              norm_cuda.gated_rms_norm(heads, gate, head_w, 1e-6).reshape(1, 3 * 128))]
    for name, got, row in cases:
        assert isinstance(got, ref.Dp4aActivation) and (got.group, got.low_high) == (group, low_high), name
        # the norm's variant may sum its squares in another order (float32, ~1e-7 of rstd): a value may round to
        # the neighbouring fp16, at most one ulp, 2^-10 of it
        assert torch.equal(got.x, row) or name == "norm" and torch.allclose(got.x, row, rtol=2.0**-10, atol=0), name
        for mine, theirs in zip((got.parts, got.x_scale, got.v_sum), cuda_gemv.x_parts(got.x, group, low_high, {})):
            assert torch.equal(mine, theirs), name
    with pytest.raises(ValueError, match="one unquantized row"):
        norm_cuda.rms_norm(activations(2, 384, dtype, gen), w, 1e-6, dp4a=(group, low_high))
    with pytest.raises(ValueError, match="one token"):
        norm_cuda.gated_rms_norm(heads.expand(2, 3, 128), gate.expand(2, 3, 128), head_w, 1e-6, dp4a=(group, False))


@pytest.mark.parametrize("fmt,group,low_high", DP4A_FORMATS)
def test_projections_read_the_parts_their_prologue_wrote(fmt, group, low_high, monkeypatch):
    """ops.linear's norm, SiLU and gated-norm projections onto an int4 / NVFP4 QuantWeight whose one-row product
    runs a dp4a kernel (the GPU check patched, the table naming dp4a tiles): the prologue writes the parts and
    _x_parts_kernel is not launched, the result that of the plain op then the product, bit for bit. A SplitWeight
    of such a part and a plain one (GDN's in-projection) gives its plain part the row; one with a second such part
    not on a dp4a tile asks for none. A float-kernel tile, or two rows, reads no parts."""
    import deltaserve.ops.linear as linear
    from deltaserve.layers.quant.weight import QuantWeight, SplitWeight
    from deltaserve.ops.activation import cuda as activation_cuda
    from deltaserve.ops.norm import cuda as norm_cuda

    gen = torch.Generator().manual_seed(group)
    dtype = torch.float16

    def weight(n, k):
        if fmt == "int4":
            return QuantWeight(int4_weight(n, k, group, False, False, gen), quant_gemm.int4_linear)
        return QuantWeight(nvfp4_weight(n, k, True, gen), quant_gemm.nvfp4_linear)

    up, down, out = weight(40, 256), weight(24, 512), weight(16, 384)
    dp4a = dict(kind="gemv", block_n=8, block_k=128, split_k=2, warps=1, stages=1, dp4a=1)
    table = {f"{fmt}:{n}:{k}:1": dp4a for n, k in ((40, 256), (24, 512), (16, 384))}
    monkeypatch.setattr(linear, "_on_gpu", lambda t: True)
    monkeypatch.setattr(quant_gemm, "_kernels_serve", lambda t: True)
    monkeypatch.setattr(configs, "tuned_table", lambda: table)
    launches = []
    real_x_parts = cuda_gemv.x_parts
    monkeypatch.setattr(cuda_gemv, "x_parts", lambda *a: launches.append(1) or real_x_parts(*a))
    assert up.dp4a_input(1) == (group, low_high) and up.dp4a_input(2) is None
    x, res = activations(1, 256, dtype, gen), activations(1, 256, dtype, gen)
    norm_w = (torch.randn(256, generator=gen) * 0.1).to(dtype)
    plain = (torch.randn(8, 256, generator=gen) * 0.05).to(dtype)
    split = SplitWeight((up, plain))
    assert split.dp4a_input(1) == (group, low_high)
    table[f"{fmt}:8:256:1"] = dict(kind="gemv", block_n=8, block_k=128, warps=1, stages=1)  # the float kernels
    assert SplitWeight((up, weight(8, 256))).dp4a_input(1) is None  # a part on a kernel that reads no parts
    y, h = linear.rms_norm_linear(x, norm_w, 1e-6, up, res)
    blocks, _ = linear.rms_norm_linear(x, norm_w, 1e-6, split, res, blocks=True)
    gate_up = activations(1, 1024, dtype, gen)
    y_down = linear.silu_mul_linear(gate_up, down)
    heads, gate = (activations(1, 384, dtype, gen).view(1, 3, 128) for _ in range(2))
    head_w = (torch.randn(128, generator=gen) * 0.1).to(dtype)
    y_out = linear.gated_norm_linear(heads, gate, head_w, 1e-6, out)
    assert launches == []
    normed = norm_cuda.rms_norm(x, norm_w, 1e-6, res, dp4a=(group, low_high))[0].x  # the row the prologue wrote
    assert torch.equal(h, norm_cuda.rms_norm(x, norm_w, 1e-6, res)[1])
    assert torch.equal(y, up.matmul(normed)) and torch.equal(blocks[0], y)
    assert torch.equal(blocks[1], linear.matmul(normed, plain))
    assert torch.equal(y_down, down.matmul(activation_cuda.silu_and_mul(gate_up)))
    assert torch.equal(y_out, out.matmul(norm_cuda.gated_rms_norm(heads, gate, head_w, 1e-6).reshape(1, 384)))
    assert len(launches) == 3  # the three quantized products above made their own parts
    table.update({key: dict(dp4a, dp4a=0) for key in table} if fmt == "int4" else {})
    if fmt == "int4":  # the float one-row kernel reads the row
        assert up.dp4a_input(1) is None
        launches.clear()
        assert torch.equal(linear.rms_norm_linear(x, norm_w, 1e-6, up, res)[0], up.matmul(normed)) and not launches
        assert torch.equal(up.matmul(norm_cuda.rms_norm(x, norm_w, 1e-6, dp4a=(group, low_high))),
                           up.matmul(norm_cuda.rms_norm(x, norm_w, 1e-6)))


def test_prmt_looks_bytes_up_as_ptx_does():
    """The interpreter's prmt (the kernels' PTX elsewhere) against the PTX manual's default mode, every selector
    nibble: byte (nibble & 7) of the table, or its top bit repeated where the nibble's bit 3 is set."""
    table = [0x00, 0x01, 0x82, 0x03, 0x04, 0xF6, 0x08, 0x0C]  # two bytes with the top bit set
    lo, hi = (int.from_bytes(bytes(table[i:i + 4]), "little", signed=True) for i in (0, 4))
    selectors = torch.arange(0, 1 << 16, 257, dtype=torch.int32)  # each nibble through all 16 values
    got = run_prmt(lo, hi, selectors)
    for sel, word in zip(selectors.tolist(), got.tolist()):
        want = 0
        for i in range(4):
            nibble = (sel >> (4 * i)) & 0xF
            byte = table[nibble & 7]
            want |= ((0xFF if byte & 0x80 else 0) if nibble & 8 else byte) << (8 * i)
        assert word & 0xFFFFFFFF == want, f"selector {sel:#06x}: {word & 0xFFFFFFFF:#010x}, want {want:#010x}"


@triton.jit
def _prmt_kernel(selectors, out, table_lo, table_hi, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out + offs, cuda_gemv._prmt(table_lo, table_hi, tl.load(selectors + offs)))


def run_prmt(lo: int, hi: int, selectors: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(selectors)
    _prmt_kernel[(1,)](selectors, out, lo, hi, BLOCK=selectors.numel())
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,block,config", [(40, 300, (16, 128), dict(GEMV, block_n=8)),
                                              (48, 256, (32, 64), dict(GEMV, block_n=16, block_k=128)),
                                              (48, 512, (32, 64), dict(GEMV, block_n=16, block_k=128, stages=3))])
def test_fp8_gemv(dtype, n, k, block, config):
    """The activation's e4m3 codes and scales as the reference's; a partial last K block (300) and row block
    (40 rows in 8-row programs inside 16-row scale blocks); the scales folded into the activation (one rounding);
    the weight tiles streamed 2 steps ahead (stages 3: the same sums as loaded where used)."""
    gen = torch.Generator().manual_seed(n)
    w, x = fp8_weight(n, k, block, gen), activations(1, k, dtype, gen)
    y64, terms = oracle.fp8_exact(x, w)
    assert cuda_gemv.supports(w, config) and not cuda_gemv.supports(w, dict(config, block_n=64))
    assert not cuda_gemv.supports(w, config, 2)
    got = cuda_gemv.gemv(x, w, config)
    oracle.assert_within(got, y64, gemv_bound(x, w, y64, terms, extra_roundings=2), "fp8 gemv")
    if config["stages"] > 1:
        assert torch.equal(got, cuda_gemv.gemv(x, w, dict(config, stages=1)))


def test_cublas_kind_uses_the_reserved_scratch(monkeypatch):
    """The weight-only prefill's bf16 copy goes into the buffer reserved at warm-up when it fits (graphs keep its
    address), else into memory of its own."""
    gen = torch.Generator().manual_seed(1)
    w, x = int4_weight(40, 256, 64, False, False, gen), activations(5, 256, torch.bfloat16, gen)
    monkeypatch.setattr(cuda_weight_only, "_scratch", {})
    seen = []
    real = cuda_weight_only.dequantize
    monkeypatch.setattr(cuda_weight_only, "dequantize", lambda w, dtype, out=None: seen.append(out) or
                        real(w, dtype, out))
    cuda_weight_only.cublas(x, w)
    cuda_weight_only.reserve_scratch(40 * 256, torch.bfloat16, x.device)
    assert cuda_weight_only.scratch_bytes() == 40 * 256 * 2
    y64, terms = oracle.weight_only_exact(x, w)
    got = cuda_weight_only.cublas(x, w)
    oracle.assert_within(got, y64, oracle.weight_only_bound(x, w, y64, terms, u_w=2.0**-8), "int4 cublas scratch")
    buffer = cuda_weight_only._scratch[(x.device, torch.bfloat16)]
    assert seen[0] is None and seen[1].data_ptr() == buffer.data_ptr()


# ------------------------------------------------------------------------------------------------ dispatch


def test_dispatch_follows_the_table(monkeypatch):
    """With the GPU check patched, each (format, N, K, bucket) runs the kind its table entry names; a shape the
    table lacks runs the skinny kernel up to 64 rows and the tiled GEMM above; CPU inputs run the reference."""
    gen = torch.Generator().manual_seed(0)
    weights = {"fp8": fp8_weight(40, 256, (128, 128), gen), "int4": int4_weight(40, 256, 64, False, False, gen),
               "nvfp4": nvfp4_weight(40, 256, False, gen)}
    ops = {"fp8": quant_gemm.fp8_block_linear, "int4": quant_gemm.int4_linear, "nvfp4": quant_gemm.nvfp4_linear}
    table = {"fp8:40:256:16": dict(SKINNY[1], kind="skinny"), "fp8:40:256:512": {"kind": "torch"},
             "int4:40:256:512": {"kind": "cublas"}, "nvfp4:40:256:8192": dict(GEMM, kind="gemm"),
             "fp8:40:256:1": dict(GEMV, block_n=8, kind="gemv"), "int4:40:256:1": dict(GEMV, kind="gemv"),
             "nvfp4:40:256:1": dict(GEMV, block_n=64, kind="gemv"), "int4:40:256:8": dict(GEMV, kind="gemv")}
    monkeypatch.setattr(configs, "tuned_table", lambda: table)
    calls = []
    for module, names in ((cuda_fp8, ("skinny", "gemm", "torch_scaled_mm")),
                          (cuda_weight_only, ("skinny", "gemm", "cublas")), (cuda_gemv, ("gemv",))):
        for name in names:
            real = getattr(module, name)
            monkeypatch.setattr(module, name, lambda *a, _n=name, _r=real, **kw: calls.append(_n) or _r(*a, **kw))
    monkeypatch.setattr(cuda_fp8, "torch_scaled_mm", lambda x, w: calls.append("torch_scaled_mm") or
                        ref.fp8_block_linear(x, w))
    monkeypatch.setattr(cuda_fp8, "torch_supports", lambda w: True)
    monkeypatch.setattr(quant_gemm, "_kernels_serve", lambda x: True)
    for fmt, rows in [("fp8", 3), ("fp8", 100), ("fp8", 600), ("int4", 2), ("int4", 100), ("int4", 600),
                      ("nvfp4", 64), ("nvfp4", 600), ("fp8", 1), ("int4", 1), ("nvfp4", 1), ("int4", 5),
                      ("nvfp4", 8)]:
        x = activations(rows, 256, torch.float32, gen)
        y64, terms = (oracle.fp8_exact if fmt == "fp8" else oracle.weight_only_exact)(x, weights[fmt])
        got = ops[fmt](x, weights[fmt])
        assert got.shape == (rows, 40) and bool(((got.double() - y64).abs() <= 1e-4 * terms + 1e-6).all()), fmt
    # without an entry: fp8 above 64 rows F.scaled_mm, int4 / NVFP4 up to 8 rows the GEMV, to 64 skinny, above
    # cuBLAS
    assert calls == ["skinny", "torch_scaled_mm", "torch_scaled_mm", "gemv", "cublas", "cublas", "skinny", "gemm",
                     "gemv", "gemv", "gemv", "gemv", "gemv"]
    monkeypatch.setattr(quant_gemm, "_kernels_serve", lambda x: False)
    calls.clear()
    quant_gemm.int4_linear(activations(2, 256, torch.float32, gen), weights["int4"])
    assert calls == []


def test_warm_up_meets_every_variant(monkeypatch):
    """warm_up_rows covers each decode bucket with Triton's three row-count classes (1, a multiple of 16, other)
    and the GEMV's row blocks, and both prefill buckets with two classes each."""
    def variant(rows):
        gemv_rows = 1 << (rows - 1).bit_length() if rows <= cuda_gemv.MAX_ROWS else None
        return configs.row_bucket(rows), "one" if rows == 1 else "16s" if rows % 16 == 0 else "other", gemv_rows

    rows = quant_gemm.warm_up_rows()
    assert sorted({variant(r) for r in rows}) == sorted({variant(r) for r in range(1, 1100)})
    assert len(rows) == len({variant(r) for r in rows})
    seen = []
    monkeypatch.setattr(quant_gemm, "_OPS", {ref.Int4Weight: lambda x, w: seen.append(x.shape)})
    w = int4_weight(8, 64, 32, True, False, torch.Generator().manual_seed(0))
    quant_gemm.warm_up([w], dtype=torch.float32)
    assert seen == [(r, 64) for r in rows]


def test_table_entries_are_checked(tmp_path, monkeypatch):
    assert configs.row_bucket(1) == 1 and configs.row_bucket(2) == 8 and configs.row_bucket(9) == 16
    assert configs.row_bucket(65) == 512
    assert configs.row_bucket(513) == 8192 and configs.row_bucket(100000) == 8192
    for key, entry, message in [("fp9:1:2:16", {"kind": "skinny"}, "format:N:K:rows"),
                                ("int4:1:2:16", {"kind": "torch"}, "needs a \"kind\""),
                                ("fp8:1:2:512", dict(SKINNY[0], kind="skinny"), "does not serve the 512-row"),
                                ("fp8:1:2:8", dict(GEMV, kind="gemv"), "does not serve the 8-row"),
                                ("int4:1:2:16", dict(GEMV, kind="gemv"), "does not serve the 16-row"),
                                ("nvfp4:1:2:8192", dict(GEMM, kind="gemm", warps=0), "warps must be a positive"),
                                ("int4:1:2:8", dict(GEMV, kind="gemv", dp4a=1), "NVFP4 one-row GEMV only"),
                                ("int4:1:2:1", dict(GEMV, kind="gemv", dp4a=2), "must be 0 or 1"),
                                ("nvfp4:1:2:1", dict(GEMV, kind="gemv", split_k=2), "with dp4a only"),
                                ("int4:1:2:16", dict(SKINNY[0], kind="skinny", tma=1), "FP8's skinny kernel only"),
                                ("fp8:1:2:16", dict(SKINNY[0], kind="skinny", tma=2), "must be 0 or 1")]:
        path = tmp_path / "table.json"
        path.write_text(__import__("json").dumps({key: entry}))
        monkeypatch.setenv(configs.ENV_VAR, str(path))
        configs.tuned_table.cache_clear()
        with pytest.raises(ValueError, match=message):
            configs.tuned_table()
    monkeypatch.setenv(configs.ENV_VAR, str(tmp_path / "missing.json"))
    configs.tuned_table.cache_clear()
    with pytest.raises(ValueError, match="no such file"):
        configs.tuned_table()
    monkeypatch.delenv(configs.ENV_VAR)
    configs.tuned_table.cache_clear()
    for key, entry in configs.tuned_table().items():  # the packaged table
        configs.check_entry("configs.json", key, entry)


@pytest.mark.parametrize("fmt", ["fp8", "int4", "nvfp4"])
def test_default_configs_are_valid_entries(fmt):
    """The defaults for shapes the table does not name (wide and narrow, long and short K) are entries the table
    checker takes, and a GEMV default is one the GEMV takes (the int4 one-row kernel's K steps)."""
    for n, k in [(34816, 5120), (5120, 17408), (2048, 4096), (12288, 2048), (512, 2048)]:
        for rows in (1, 2, 8, 16, 64, 512, 8192):
            entry = configs.default_config(fmt, n, k, rows)
            configs.check_entry("default", f"{fmt}:{n}:{k}:{configs.row_bucket(rows)}", entry)
            if fmt == "int4" and rows == 1:
                assert cuda_gemv._row_steps(k, 128, entry) is not None

