"""The fused q/k norm + partial RoPE kernel against its reference (interpreter on the CPU, kernel on the GPU),
and the reference against transformers' rotary helper."""

import pytest
import torch

triton = pytest.importorskip("triton")

from deltaserve.layers.rotary import PartialRotary  # noqa: E402
from deltaserve.ops.rotary import cuda, reference  # noqa: E402
from tests.tolerance import assert_within, both_sides, gamma  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NORM_ROUNDINGS, ROTATION_ROUNDINGS = 4, 3  # an RMS norm over head_dim: D + 4; x1 cos - x2 sin: 3


def rotation_bound(want: torch.Tensor, reduction: int) -> float:
    """Both sides' rounding of a norm over `reduction` (0: none) then a rotation, on outputs like `want`. A
    rotated pair (x1 cos - x2 sin) has terms of at most its norm, sqrt(2) max |x| <= 2 max |x|."""
    one_side = gamma(reduction + (NORM_ROUNDINGS if reduction else 0) + ROTATION_ROUNDINGS, torch.float32)
    return both_sides(one_side, one_side) * 2 * want.double().abs().max().item()


@pytest.mark.parametrize("head_dim,rotary_dim", [(16, 4), (32, 8), (256, 64)])
def test_qk_norm_rope_kernel_matches_reference(head_dim, rotary_dim):
    g = torch.Generator().manual_seed(head_dim)
    T, n_heads, n_kv = 5, 4, 2
    rot = PartialRotary(head_dim, rotary_dim, 10000.0, 64)
    proj = torch.randn(T, 2 * n_heads * head_dim + 2 * n_kv * head_dim, generator=g).to(DEVICE)
    qg, k, _ = proj.split([2 * n_heads * head_dim, n_kv * head_dim, n_kv * head_dim], -1)
    q = qg.view(T, n_heads, 2 * head_dim)[..., :head_dim]  # strided, as the layer passes it
    k = k.view(T, n_kv, head_dim)
    qw, kw = (0.1 * torch.randn(2, head_dim, generator=g)).to(DEVICE)
    positions = torch.tensor([0, 3, 7, 63, 1]).to(DEVICE)
    cos, sin = rot.cos.to(DEVICE), rot.sin.to(DEVICE)
    got = cuda.qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin, positions, rotary_dim)
    want = reference.qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin, positions, rotary_dim)
    for a, b in zip(got, want):
        assert_within(a, b, rotation_bound(b, head_dim), "qk_norm_rope")


def test_reference_rotation_matches_transformers():
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

    head_dim, rotary_dim, T = 32, 8, 6
    rot = PartialRotary(head_dim, rotary_dim, 10000.0, 16)
    positions = torch.arange(3, 3 + T)
    q, k = torch.randn(T, 4, head_dim), torch.randn(T, 2, head_dim)
    cos = torch.cat([rot.cos[positions]] * 2, -1)[None]  # transformers' [1, T, rotary_dim] layout
    sin = torch.cat([rot.sin[positions]] * 2, -1)[None]
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    c, s = rot.cos[positions].unsqueeze(1), rot.sin[positions].unsqueeze(1)
    for x, x_ref in ((q, q_ref), (k, k_ref)):
        want = x_ref[0].transpose(0, 1)
        assert_within(reference.rotate(x, c, s, rotary_dim), want, rotation_bound(want, 0), "rotate")
