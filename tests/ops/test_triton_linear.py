"""The fused small-batch projections (ops/linear) against the unfused reference ops (the Triton interpreter on
the CPU in CI, the real kernel on the GPU)."""

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from deltaserve.ops.linear import cuda as linear_cuda  # noqa: E402
from deltaserve.ops.linear import cuda_skinny as linear_skinny  # noqa: E402
from deltaserve.ops.linear import reference  # noqa: E402
from tests.ops.interpreter import patch_interpreter_index  # noqa: E402
from tests.tolerance import assert_within, both_sides, gamma, silu_chain  # noqa: E402

patch_interpreter_index()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter has no bfloat16 arithmetic: bf16 is checked on the GPU only
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# small tiles keep the interpreter quick; the GPU also runs the default and the tuned tiles
CONFIGS = [(8, 32, 1, 1)] + ([linear_cuda.DEFAULT_CONFIG, "tuned"] if DEVICE == "cuda" else [])


# Fused kernel vs reference, both rounded: per side a K-term GEMM accumulated in float32 over the prologue's
# output (an RMS norm: D + 4 roundings; SiLU and mul: tests.tolerance.silu_chain), relative to |f(x)| @ |W|^T
# (tests/tolerance.py). In bf16 (GPU) also up to BF16_ROUNDINGS roundings to bf16, relative to the same
# magnitudes, per side: the prologue's intermediates (up to 4 for the gated norm), cuBLAS's reduced-precision
# split-K partial sums (the reference), the output.
BF16_ROUNDINGS = 8
NORM_ROUNDINGS = 4


def abs_matmul(a, weight):
    """|a| @ |weight|^T in float64: the magnitudes of a GEMM's terms, passed as a reference's `matmul`."""
    return F.linear(a.double().abs(), weight.double().abs())


def gemm_bound(magnitudes, k: int, dtype, prologue: int = 0):
    """Elementwise bound of kernel vs reference for a k-term GEMM after `prologue` roundings (both sides)."""
    relative = gamma(k + prologue, torch.float32)
    if dtype == torch.bfloat16:
        relative += gamma(BF16_ROUNDINGS, torch.bfloat16)
    return both_sides(relative * magnitudes, relative * magnitudes)


def _rand(*shape, dtype, gen, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen)).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_linear(dtype, config, with_residual):
    gen, rows = torch.Generator().manual_seed(0), 1
    x, res = _rand(rows, 96, dtype=dtype, gen=gen), _rand(rows, 96, dtype=dtype, gen=gen)
    norm_w, weight = _rand(96, dtype=dtype, gen=gen, scale=0.1), _rand(40, 96, dtype=dtype, gen=gen, scale=0.1)
    residual = res if with_residual else None
    got = linear_cuda.rms_norm_linear(x, norm_w, 1e-6, weight, residual, config=config)
    want = reference.rms_norm_linear(x, norm_w, 1e-6, weight, residual)
    magnitudes = reference.rms_norm_linear(x, norm_w, 1e-6, weight, residual, matmul=abs_matmul)
    if with_residual:
        torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)  # h = x + residual, exactly
        got, want, magnitudes = got[0], want[0], magnitudes[0]
    assert_within(got, want, gemm_bound(magnitudes, 96, dtype, 96 + NORM_ROUNDINGS), "rms_norm_linear")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_and_linear_writes_the_normed_row(dtype, config, with_residual):
    """The fused GEMV's RMS norm prologue writing its normed row too (program 0; the MoE router's launch, whose
    experts read that row): the row within the norm's roundings of the reference's (its mean square summed in
    another order), the product as rms_norm_linear's, h exactly x + residual; 40 rows take several programs."""
    gen = torch.Generator().manual_seed(1)
    x, res = _rand(1, 96, dtype=dtype, gen=gen), _rand(1, 96, dtype=dtype, gen=gen)
    norm_w, weight = _rand(96, dtype=dtype, gen=gen, scale=0.1), _rand(40, 96, dtype=dtype, gen=gen, scale=0.1)
    residual = res if with_residual else None
    normed, got, h = linear_cuda.rms_norm_and_linear(x, norm_w, 1e-6, weight, residual, config=config)
    want_normed, want, want_h = reference.rms_norm_and_linear(x, norm_w, 1e-6, weight, residual)
    _, magnitudes, _ = reference.rms_norm_and_linear(x, norm_w, 1e-6, weight, residual, matmul=abs_matmul)
    assert (h is None) == (residual is None) and (h is None or torch.equal(h, want_h))
    relative = gamma(96 + NORM_ROUNDINGS, torch.float32) + (gamma(2, dtype) if dtype == torch.bfloat16 else 0.0)
    row_bound = relative * want_normed.double().abs()
    assert_within(normed, want_normed, both_sides(row_bound, row_bound), "normed row")
    assert_within(got, want, gemm_bound(magnitudes, 96, dtype, 96 + NORM_ROUNDINGS), "its product")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", CONFIGS)
def test_silu_mul_linear(dtype, config):
    gen, rows = torch.Generator().manual_seed(1), 1
    x, weight = _rand(rows, 2 * 72, dtype=dtype, gen=gen), _rand(24, 72, dtype=dtype, gen=gen, scale=0.1)
    bound = gemm_bound(reference.silu_mul_linear(x, weight, matmul=abs_matmul), 72, dtype, silu_chain(x[:, :72]))
    assert_within(linear_cuda.silu_mul_linear(x, weight, config=config), reference.silu_mul_linear(x, weight),
                  bound, "silu_mul_linear")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", CONFIGS)
def test_gated_norm_linear_strided(dtype, config):
    """x and the gate are [1, H, D] views with head strides of wider tensors, as in the GDN layer."""
    gen, rows = torch.Generator().manual_seed(2), 1
    heads, dim = 4, 16  # K = 64: the test tile of 32 columns holds two whole groups
    wide = _rand(rows, heads * dim + 7, dtype=dtype, gen=gen)
    gate = wide[:, : heads * dim].view(rows, heads, dim)  # row stride heads * dim + 7
    x = _rand(rows, heads, 2 * dim, dtype=dtype, gen=gen)[..., :dim]  # head stride 2 * dim
    norm_w, weight = _rand(dim, dtype=dtype, gen=gen, scale=0.1) + 1, _rand(24, heads * dim, dtype=dtype, gen=gen)
    magnitudes = reference.gated_norm_linear(x, gate, norm_w, 1e-6, weight, matmul=abs_matmul)
    bound = gemm_bound(magnitudes, heads * dim, dtype, dim + NORM_ROUNDINGS + silu_chain(gate))
    assert_within(linear_cuda.gated_norm_linear(x, gate, norm_w, 1e-6, weight, config=config),
                  reference.gated_norm_linear(x, gate, norm_w, 1e-6, weight), bound, "gated_norm_linear")


def test_plain_linear_and_uneven_shapes():
    """N and K that the tiles do not divide (masked loads)."""
    gen = torch.Generator().manual_seed(0)
    x, weight = _rand(1, 50, dtype=torch.float32, gen=gen), _rand(37, 50, dtype=torch.float32, gen=gen)
    assert_within(linear_cuda.linear(x, weight, config=(8, 32, 1, 1)), x @ weight.T,
                  gemm_bound(abs_matmul(x, weight), 50, torch.float32), "linear")


def test_bad_inputs_name_themselves():
    weight = torch.zeros(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="x must be"):
        linear_cuda.silu_mul_linear(torch.zeros(1, 16, device=DEVICE), weight)
    with pytest.raises(ValueError, match="x must be"):
        linear_cuda.linear(torch.zeros(2, 16, device=DEVICE), weight)
    with pytest.raises(ValueError, match="gate shape"):
        linear_cuda.gated_norm_linear(torch.zeros(1, 1, 16, device=DEVICE), torch.zeros(1, 2, 16, device=DEVICE),
                                      torch.ones(16, device=DEVICE), 1e-6, weight)


# The skinny tensor-core GEMM (ops/linear/cuda_skinny.py): small tiles for the interpreter, one and two K splits,
# pointer loads and TMA copies (a sixth entry of 1).
SKINNY_TILES = [(16, 32, 1, 4, 1), (16, 32, 2, 4, 1), (16, 32, 1, 4, 1, 1), (16, 32, 2, 4, 1, 1)] + (
    [(64, 128, 1, 4, 4), (128, 128, 2, 4, 4), (64, 128, 1, 4, 4, 1), (128, 64, 2, 8, 3, 1)]
    if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tile", SKINNY_TILES)
@pytest.mark.parametrize("rows", [1, 3, 17, 64])
@pytest.mark.parametrize("k", [104, 101])
def test_skinny_matches_cublas(dtype, tile, rows, k):
    """N = 40 and K that no tile divides; 17 rows pad to a 32-row tile. Rows of K = 101 are not 16-byte aligned,
    which TMA cannot copy: TMA tiles fall back to pointer loads there."""
    gen = torch.Generator().manual_seed(rows)
    x, weight = _rand(rows, k, dtype=dtype, gen=gen), _rand(40, k, dtype=dtype, gen=gen, scale=0.1)
    assert_within(linear_skinny.linear(x, weight, tile), F.linear(x, weight),
                  gemm_bound(abs_matmul(x, weight), k, dtype), "skinny GEMM")


def test_skinny_tma_tiles_take_the_tma_kernel(monkeypatch):
    """A TMA tile over aligned tensors runs the TMA kernel, over unaligned ones the pointer kernel."""
    launched = []
    for name in ("_skinny_kernel", "_skinny_tma_kernel"):
        kernel = getattr(linear_skinny, name)
        monkeypatch.setattr(linear_skinny, name, _Recording(kernel, name, launched))
    for k in (104, 101):
        x, weight = torch.zeros(2, k, device=DEVICE), torch.zeros(8, k, device=DEVICE)
        linear_skinny.linear(x, weight, (16, 32, 1, 4, 1, 1))
    assert launched == ["_skinny_tma_kernel", "_skinny_kernel"]


class _Recording:
    """A Triton kernel whose launches append its name to a list."""

    def __init__(self, kernel, name, launched):
        self.kernel, self.name, self.launched = kernel, name, launched

    def __getitem__(self, grid):
        self.launched.append(self.name)
        return self.kernel[grid]


def test_skinny_table_and_buckets():
    assert [linear_skinny.row_bucket(r) for r in (1, 2, 16, 17, 32, 33, 64)] == [1, 16, 16, 32, 32, 64, 64]
    assert linear_skinny.config_for(8, 16, linear_skinny.SKINNY_MAX_ROWS + 1) is None
    for key, tile in linear_skinny._tuned_configs().items():  # the packaged table: tiles the kernel can take
        assert int(key.split(":")[2]) in linear_skinny.ROW_BUCKETS, key
        assert tile is None or (tile[0] >= 16 and tile[1] >= 16 and tile[2] >= 1), key
    with pytest.raises(ValueError, match="x must be"):
        linear_skinny.linear(torch.zeros(65, 16), torch.zeros(8, 16), (16, 16, 1, 4, 1))


def test_skinny_warm_up_launches_every_variant_a_product_can_meet(monkeypatch):
    """Start-up multiplies each weight at `skinny_warm_up_rows`: one row count per (row bucket, Triton's row-count
    class: 1, a multiple of 16, other) that any count of 1..SKINNY_MAX_ROWS falls in, and only where the table
    has a tile (the interpreter standing in for the GPU)."""
    import deltaserve.ops.linear as ops_linear

    def variant(rows):
        return linear_skinny.row_bucket(rows), "one" if rows == 1 else "16s" if rows % 16 == 0 else "other"

    warm = ops_linear.skinny_warm_up_rows()
    every_count = range(1, linear_skinny.SKINNY_MAX_ROWS + 1)
    assert sorted({variant(r) for r in warm}) == sorted({variant(r) for r in every_count})
    assert len(warm) == len({variant(r) for r in warm})  # none twice
    calls = []
    monkeypatch.setattr(linear_skinny, "linear", lambda x, w, tile: calls.append((x.shape[0], w.shape[0])))
    monkeypatch.setattr(linear_skinny, "_tuned_configs", lambda: {"40:96:16": [16, 32, 1, 4, 1],
                                                                 "40:96:64": [16, 32, 1, 4, 1]})
    monkeypatch.setattr(ops_linear, "_on_gpu", lambda x: True)
    ops_linear.warm_up_skinny([torch.zeros(40, 96), torch.zeros(24, 96)])
    assert calls == [(2, 40), (16, 40), (33, 40), (64, 40)]


def test_gpu_projections_take_the_tuned_kernel(monkeypatch):
    """ops.linear's dispatch (the interpreter standing in for the GPU, the table and the device check patched):
    a product whose (N, K, row bucket) is in the skinny table runs the prologue op and then the skinny GEMM, in
    place of the fused GEMV too; others keep the GEMV at one row (where tuned) or cuBLAS."""
    import deltaserve.ops.linear as ops_linear

    calls = []
    real_linear = linear_skinny.linear
    monkeypatch.setattr(linear_skinny, "linear", lambda x, w, tile: calls.append((x.shape[0], *w.shape)) or
                        real_linear(x, w, tile))
    monkeypatch.setattr(linear_skinny, "_tuned_configs", lambda: {"40:96:16": [16, 32, 1, 4, 1],
                                                                 "24:72:1": [16, 32, 2, 4, 1]})
    monkeypatch.setattr(linear_cuda, "config_for", lambda prologue, n, k: (8, 32, 1, 1))  # the GEMV everywhere
    monkeypatch.setattr(ops_linear, "_on_gpu", lambda x: True)
    gen = torch.Generator().manual_seed(5)
    x, norm_w, weight = (_rand(3, 96, dtype=torch.float32, gen=gen), _rand(96, dtype=torch.float32, gen=gen),
                         _rand(40, 96, dtype=torch.float32, gen=gen))
    norm_bound = gemm_bound(reference.rms_norm_linear(x, norm_w, 1e-6, weight, matmul=abs_matmul), 96,
                            torch.float32, 96 + NORM_ROUNDINGS)
    assert_within(ops_linear.rms_norm_linear(x, norm_w, 1e-6, weight),
                  reference.rms_norm_linear(x, norm_w, 1e-6, weight), norm_bound, "rms_norm_linear")
    gate_up, down = _rand(1, 144, dtype=torch.float32, gen=gen), _rand(24, 72, dtype=torch.float32, gen=gen)
    assert_within(ops_linear.silu_mul_linear(gate_up, down),  # the skinny GEMM beat the GEMV here
                  reference.silu_mul_linear(gate_up, down),
                  gemm_bound(reference.silu_mul_linear(gate_up, down, matmul=abs_matmul), 72, torch.float32,
                             silu_chain(gate_up[:, :72])), "silu_mul_linear")
    assert calls == [(3, 40, 96), (1, 24, 72)]
    assert_within(ops_linear.rms_norm_linear(x[:1], norm_w, 1e-6, weight),  # the GEMV (bucket 1)
                  reference.rms_norm_linear(x[:1], norm_w, 1e-6, weight), norm_bound[:1], "GEMV")
    ops_linear.silu_mul_linear(gate_up.expand(20, 144).contiguous(), down)  # bucket 32: not in the table, cuBLAS
    x_columns = x.T.contiguous().T  # [3, 96] with a column stride of 3: the kernel needs unit strides, cuBLAS runs
    assert_within(ops_linear.matmul(x_columns, weight), x @ weight.T,
                  gemm_bound(abs_matmul(x, weight), 96, torch.float32), "cuBLAS fallback")
    assert len(calls) == 2
