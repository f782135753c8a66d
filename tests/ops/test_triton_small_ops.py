"""The Triton RMS norms and silu_and_mul against their references (the Triton interpreter on the CPU in CI,
the real kernels on the GPU)."""

import pytest
import torch

triton = pytest.importorskip("triton")
tl = triton.language

from deltaserve.ops.activation import cuda as act_cuda  # noqa: E402
from deltaserve.ops.norm import cuda as norm_cuda, reference as norm_ref  # noqa: E402
from tests.tolerance import assert_within, both_sides, gamma, silu_chain  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter has no bfloat16 arithmetic (numpy lacks the type): bf16 is checked on the GPU only
BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(DEVICE == "cpu", reason="bf16 needs the GPU"))
# Per side, in float32: the sum of D squares, the sqrt, divide and scale (D + 4 roundings, relative), SiLU's
# for the gated norm (tests.tolerance.silu_chain); in bf16 also up to BF16_ROUNDINGS roundings of
# intermediates and the output to bf16 (normed, scaled, gate, result). All relative: norms are products.
NORM_EXTRA, BF16_ROUNDINGS = 4, 4


def norm_bound(reference: torch.Tensor, dim: int, dtype: torch.dtype, gate: torch.Tensor | None = None):
    """Elementwise bound of kernel vs reference RMS norm over rows of dim (both sides rounded), gated by
    silu(gate) when given."""
    relative = gamma(dim + NORM_EXTRA + (silu_chain(gate) if gate is not None else 0), torch.float32)
    if dtype == torch.bfloat16:
        relative += gamma(BF16_ROUNDINGS, torch.bfloat16)
    one_side = relative * reference.double().abs()
    return both_sides(one_side, one_side)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("dim", [16, 48, 100])
def test_rms_norm_with_and_without_residual(dtype, dim):
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(7, 3, dim, generator=g).to(DEVICE, dtype)
    res = torch.randn(7, 3, dim, generator=g).to(DEVICE, dtype)
    w = (0.1 * torch.randn(dim, generator=g)).to(DEVICE, dtype)
    want = norm_ref.rms_norm(x, w, 1e-6)
    assert_within(norm_cuda.rms_norm(x, w, 1e-6), want, norm_bound(want, dim, dtype), "rms_norm")
    y, h = norm_cuda.rms_norm(x, w, 1e-6, res)
    y_ref, h_ref = norm_ref.rms_norm(x, w, 1e-6, res)
    torch.testing.assert_close(h, h_ref, atol=0, rtol=0)
    assert_within(y, y_ref, norm_bound(y_ref, dim, dtype), "rms_norm with residual")


def test_rms_norm_reads_strided_rows():
    """q/k norms are applied to a strided view of the fused projection output."""
    x = torch.randn(5, 4, 2 * 16).to(DEVICE)[..., :16]  # every row of 16 sits in a row of 32
    w = torch.randn(16).to(DEVICE)
    want = norm_ref.rms_norm(x, w, 1e-6)
    assert_within(norm_cuda.rms_norm(x, w, 1e-6), want, norm_bound(want, 16, torch.float32), "strided rms_norm")


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_gated_rms_norm(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 4, 32, generator=g).to(DEVICE, dtype)
    z = torch.randn(9, 4, 32, generator=g).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(32, generator=g)).to(DEVICE, dtype)
    want = norm_ref.gated_rms_norm(x, z, w, 1e-6)
    assert_within(norm_cuda.gated_rms_norm(x, z, w, 1e-6), want, norm_bound(want, 32, dtype, z), "gated")


@triton.jit
def _gated_norm_one_row(x_ptr, g_ptr, w_ptr, y_ptr, D, x_stride, g_stride, eps, BLOCK: tl.constexpr):
    """The gated norm as it was before it tiled rows (one program per row): the bitwise oracle below."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    xf = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    normed = (xf * rstd).to(y_ptr.dtype.element_ty)
    scaled = (tl.load(w_ptr + cols, mask=mask, other=0.0) * normed).to(tl.float32)
    g = tl.load(g_ptr + row * g_stride + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * D + cols, (scaled * (g / (1.0 + tl.exp(-g)))).to(y_ptr.dtype.element_ty), mask=mask)


def gated_norm_one_row(x, gate, weight, eps):
    x2, g2 = x.reshape(-1, x.shape[-1]).contiguous(), gate.reshape(-1, x.shape[-1]).contiguous()
    y = torch.empty_like(x2)
    _gated_norm_one_row[(x2.shape[0],)](x2, g2, weight, y, x2.shape[1], x2.stride(0), g2.stride(0), eps,
                                        BLOCK=triton.next_power_of_2(x2.shape[1]))
    return y.view(x.shape)


# (tokens, heads, D): rows that end inside a tile of 16, a ragged D, GDN's 48 heads of 128, and a row of 2048
# (one row a program).
@pytest.mark.parametrize("tokens,heads,dim", [(7, 3, 100), (5, 48, 128), (3, 2, 2048)])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_gated_rms_norm_reads_strided_heads(tokens, heads, dim, dtype):
    """The layer passes z as a [T, HV, dv] view of the projection output (token stride = its width) and the
    kernel reads it in place; x here also has a head stride of 2 * D. The result matches the reference; in
    the interpreter it also equals, bit for bit, the result for contiguous inputs and that of the
    one-row-per-program kernel (a GPU may sum the squares in another order)."""
    g = torch.Generator().manual_seed(dim)
    proj = torch.randn(tokens, 3 + 2 * heads * dim, generator=g).to(DEVICE, dtype)
    z = proj[:, 3 + heads * dim:].view(tokens, heads, dim)  # [T, H, D], token stride 3 + 2 H D
    x = (3 * torch.randn(tokens, heads, 2 * dim, generator=g)).to(DEVICE, dtype)[..., dim:]  # head stride 2 D
    w = (1 + 0.1 * torch.randn(dim, generator=g)).to(DEVICE, dtype)
    y = norm_cuda.gated_rms_norm(x, z, w, 1e-6)
    assert y.shape == x.shape and y.is_contiguous()
    want = norm_ref.gated_rms_norm(x, z, w, 1e-6)
    assert_within(y, want, norm_bound(want, dim, dtype, z), "strided gated norm")
    if DEVICE == "cpu":
        assert torch.equal(y, norm_cuda.gated_rms_norm(x.contiguous(), z.contiguous(), w, 1e-6))
        assert torch.equal(y, gated_norm_one_row(x, z, w, 1e-6))


def test_gated_rms_norm_takes_rows_and_rejects_mismatched_gate():
    x, z, w = torch.randn(5, 24).to(DEVICE), torch.randn(5, 24).to(DEVICE), torch.randn(24).to(DEVICE)
    want = norm_ref.gated_rms_norm(x, z, w, 1e-6)
    assert_within(norm_cuda.gated_rms_norm(x, z, w, 1e-6), want, norm_bound(want, 24, torch.float32, z))
    with pytest.raises(ValueError, match="gate"):
        norm_cuda.gated_rms_norm(x, z[:4], w, 1e-6)


@pytest.mark.parametrize("heads,dim,max_tokens,expected", [(48, 128, 8192, [1, 43, 86, 171, 342]),
                                                            (4, 16, 600, [1, 512]), (32, 128, 20, [1])])
def test_gated_norm_warm_up_counts_reach_every_variant(heads, dim, max_tokens, expected):
    """Start-up runs the gated norm at these token counts: one per rows-per-program variant that any step of
    up to max_tokens tokens launches (27B's 48 heads of 128 first)."""
    counts = norm_cuda.gated_norm_warm_up_token_counts(heads, dim, max_tokens)
    assert counts == expected
    block = triton.next_power_of_2(dim)
    variant = [norm_cuda._gated_block_rows(t * heads, block) for t in range(1, max_tokens + 1)]
    assert [variant[t - 1] for t in counts] == sorted(set(variant))
    assert all(variant.index(variant[t - 1]) == t - 1 for t in counts)  # each the first of its variant


@pytest.mark.parametrize("inter", [24, 1500])
def test_silu_and_mul(inter):
    x = torch.randn(5, 2 * inter).to(DEVICE)
    gate, up = x.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    one_side = gamma(silu_chain(gate), torch.float32) * want.double().abs()  # SiLU, then the product
    assert_within(act_cuda.silu_and_mul(x), want, both_sides(one_side, one_side), "silu_and_mul")
