"""The Triton RMS norms and silu_and_mul against their references (the Triton interpreter on the CPU in CI,
the real kernels on the GPU)."""

import pytest
import torch

triton = pytest.importorskip("triton")

from deltaserve.ops.activation import cuda as act_cuda  # noqa: E402
from deltaserve.ops.norm import cuda as norm_cuda, reference as norm_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter has no bfloat16 arithmetic (numpy lacks the type): bf16 is checked on the GPU only
BF16 = pytest.param(torch.bfloat16, 2e-2, marks=pytest.mark.skipif(DEVICE == "cpu", reason="bf16 needs the GPU"))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), BF16])
@pytest.mark.parametrize("dim", [16, 48, 100])
def test_rms_norm_with_and_without_residual(dtype, tol, dim):
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(7, 3, dim, generator=g).to(DEVICE, dtype)
    res = torch.randn(7, 3, dim, generator=g).to(DEVICE, dtype)
    w = (0.1 * torch.randn(dim, generator=g)).to(DEVICE, dtype)
    torch.testing.assert_close(norm_cuda.rms_norm(x, w, 1e-6), norm_ref.rms_norm(x, w, 1e-6), atol=tol, rtol=tol)
    y, h = norm_cuda.rms_norm(x, w, 1e-6, res)
    y_ref, h_ref = norm_ref.rms_norm(x, w, 1e-6, res)
    torch.testing.assert_close(h, h_ref, atol=0, rtol=0)
    torch.testing.assert_close(y, y_ref, atol=tol, rtol=tol)


def test_rms_norm_reads_strided_rows():
    """q/k norms are applied to a strided view of the fused projection output."""
    x = torch.randn(5, 4, 2 * 16).to(DEVICE)[..., :16]  # every row of 16 sits in a row of 32
    w = torch.randn(16).to(DEVICE)
    torch.testing.assert_close(norm_cuda.rms_norm(x, w, 1e-6), norm_ref.rms_norm(x, w, 1e-6), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), BF16])
def test_gated_rms_norm(dtype, tol):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 4, 32, generator=g).to(DEVICE, dtype)
    z = torch.randn(9, 4, 32, generator=g).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(32, generator=g)).to(DEVICE, dtype)
    torch.testing.assert_close(norm_cuda.gated_rms_norm(x, z, w, 1e-6), norm_ref.gated_rms_norm(x, z, w, 1e-6),
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("inter", [24, 1500])
def test_silu_and_mul(inter):
    x = torch.randn(5, 2 * inter).to(DEVICE)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(act_cuda.silu_and_mul(x), torch.nn.functional.silu(gate) * up, atol=1e-6, rtol=1e-5)
