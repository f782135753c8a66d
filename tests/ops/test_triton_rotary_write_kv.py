"""qk_norm_rope_write_kv (q/k norm + RoPE fused with the paged KV-cache write) against the two ops it replaces,
run one after the other: the same bits in q, k and both caches. The Triton path (interpreter on the CPU, kernel on
the GPU) against qk_norm_rope + write_kv_cache of the Triton ops, the reference against the reference ops.

Inputs are shaped as the gated attention layer passes them: q, k and v are strided views of one fused
projection, slot_mapping holds padding rows (-1) and the caches start as NaN, so a stray or missing write shows.
"""

import pytest
import torch

triton = pytest.importorskip("triton")

from deltaserve.layers.rotary import PartialRotary  # noqa: E402
from deltaserve.ops import rotary  # noqa: E402
from deltaserve.ops.attention import cuda as attention_cuda  # noqa: E402
from deltaserve.ops.attention import reference as attention_reference  # noqa: E402
from deltaserve.ops.rotary import cuda, reference  # noqa: E402
from tests.ops.interpreter import patch_interpreter_index  # noqa: E402
from tests.tolerance import assert_within, both_sides, gamma  # noqa: E402

patch_interpreter_index()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NORM_ROUNDINGS, ROTATION_ROUNDINGS = 4, 3  # an RMS norm over head_dim: D + 4; x1 cos - x2 sin: 3
NUM_HEADS, NUM_KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, MAX_POSITIONS = 4, 2, 4, 8, 64
FP8 = torch.float8_e4m3fn
# (cache dtype, k_scale, v_scale): scales that are not powers of two round; small ones push fp8 values past 448
CACHES = [(torch.float32, 0.37, 1.7), (torch.bfloat16, 1.0, 1.0), (torch.bfloat16, 0.37, 1.7), (FP8, 0.37, 1.7),
          (FP8, 0.004, 0.011)]


def make_args(dtype, cache_dtype, head_dim=16, rotary_dim=4, num_tokens=7, seed=0, device=DEVICE):
    """The fused op's positional arguments on `device`: q, k, v views of one projection, weights, cos/sin,
    positions, rotary_dim, NaN-filled caches [NUM_BLOCKS, BLOCK_SIZE, n_kv, hd] and a slot_mapping with padding
    rows."""
    gen = torch.Generator().manual_seed(seed)
    widths = [2 * NUM_HEADS * head_dim, NUM_KV_HEADS * head_dim, NUM_KV_HEADS * head_dim]
    proj = (3 * torch.randn(num_tokens, sum(widths), generator=gen)).to(device, dtype)  # [T, q+gate | k | v]
    qg, k, v = proj.split(widths, -1)
    q = qg.view(num_tokens, NUM_HEADS, 2 * head_dim)[..., :head_dim]  # [T, nH, hd], gate interleaved per head
    k = k.view(num_tokens, NUM_KV_HEADS, head_dim)  # [T, n_kv, hd], token stride = the projection's width
    v = v.view(num_tokens, NUM_KV_HEADS, head_dim)
    q_weight, k_weight = (0.1 * torch.randn(2, head_dim, generator=gen)).to(device, dtype)
    rot = PartialRotary(head_dim, rotary_dim, 10000.0, MAX_POSITIONS)
    positions = torch.randint(0, MAX_POSITIONS, (num_tokens,), generator=gen)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:num_tokens]
    slots[1::3] = -1  # padding rows: written nowhere
    caches = [torch.full((NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, head_dim), float("nan"), device=device)
              .to(cache_dtype) for _ in range(2)]
    return [q, k, v, q_weight, k_weight, 1e-6, rot.cos.to(device), rot.sin.to(device), positions.to(device),
            rotary_dim, *caches, slots.to(device)]


def run_unfused(qk_norm_rope, write_kv_cache, args, k_scale, v_scale):
    """qk_norm_rope then write_kv_cache on fresh copies of the caches; returns (q, k, k_cache, v_cache)."""
    q, k, v, q_weight, k_weight, eps, cos, sin, positions, rotary_dim, k_cache, v_cache, slots = args
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    q_out, k_out = qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin, positions, rotary_dim)
    write_kv_cache(k_out, v, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
    return q_out, k_out, k_cache, v_cache


def run_fused(fused, args, k_scale, v_scale):
    """The fused op on fresh copies of the caches; returns (q, k, k_cache, v_cache)."""
    k_cache, v_cache = args[10].clone(), args[11].clone()
    q_out, k_out = fused(*args[:10], k_cache, v_cache, args[12], k_scale=k_scale, v_scale=v_scale)
    return q_out, k_out, k_cache, v_cache


def assert_same_bits(got, want):
    for name, a, b in zip(("q", "k", "k_cache", "v_cache"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{name} differs"


@pytest.mark.parametrize("cache_dtype,k_scale,v_scale", CACHES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_norm_rope_then_write(dtype, cache_dtype, k_scale, v_scale):
    args = make_args(dtype, cache_dtype)
    want = run_unfused(cuda.qk_norm_rope, attention_cuda.write_kv_cache, args, k_scale, v_scale)
    assert_same_bits(run_fused(cuda.qk_norm_rope_write_kv, args, k_scale, v_scale), want)
    written = (args[12] >= 0).sum().item() * NUM_KV_HEADS * args[0].shape[-1]
    assert (~want[2].float().isnan()).sum() == written  # every valid row written, no other slot
    if cache_dtype == FP8 and k_scale < 0.1:
        assert all((cache.float().abs() == 448).any() for cache in want[2:])  # the saturating clamp was exercised


@pytest.mark.parametrize("cache_dtype,k_scale,v_scale", CACHES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_norm_rope_then_write(dtype, cache_dtype, k_scale, v_scale):
    args = make_args(dtype, cache_dtype, seed=1, device="cpu")
    want = run_unfused(reference.qk_norm_rope, attention_reference.write_kv_cache, args, k_scale, v_scale)
    assert_same_bits(run_fused(reference.qk_norm_rope_write_kv, args, k_scale, v_scale), want)
    assert_same_bits(run_fused(rotary.qk_norm_rope_write_kv, args, k_scale, v_scale), want)  # CPU dispatch


@pytest.mark.parametrize("head_dim,rotary_dim,num_tokens", [(16, 4, 7), (32, 8, 1), (256, 64, 3)])
def test_kernel_matches_reference(head_dim, rotary_dim, num_tokens):
    """float32 throughout: the kernel and the reference differ only by rounding in the norm and the rotation."""
    args = make_args(torch.float32, torch.float32, head_dim, rotary_dim, num_tokens, seed=head_dim)
    got = run_fused(cuda.qk_norm_rope_write_kv, args, 0.37, 1.7)
    want = run_fused(reference.qk_norm_rope_write_kv, args, 0.37, 1.7)
    for a, b in zip(got, want):  # q, k and the caches: a norm over head_dim, the rotation, the scale's divide
        one_side = gamma(head_dim + NORM_ROUNDINGS + ROTATION_ROUNDINGS + 1, torch.float32)
        magnitude = 2 * torch.nan_to_num(b.double(), nan=0.0).abs().max().item()
        assert_within(a, b, both_sides(one_side, one_side) * magnitude, "fused write")


def test_no_tokens_writes_nothing():
    args = make_args(torch.float32, torch.float32, num_tokens=0)
    q_out, k_out, k_cache, v_cache = run_fused(cuda.qk_norm_rope_write_kv, args, 1.0, 1.0)
    assert q_out.shape == (0, NUM_HEADS, 16) and k_out.shape == (0, NUM_KV_HEADS, 16)
    assert k_cache.float().isnan().all() and v_cache.float().isnan().all()


BAD_ARGUMENTS = {  # name -> (index into make_args' list or the keyword, a wrong value for it)
    "q_weight": (3, torch.ones(15, device=DEVICE)),
    "v": (2, torch.ones(7, NUM_KV_HEADS, 8, device=DEVICE)),
    "rotary_dim": (9, 5),
    "cos_cache": (6, torch.ones(MAX_POSITIONS, 3, device=DEVICE)),
    "positions": (8, torch.zeros(6, dtype=torch.long, device=DEVICE)),
    "k_cache": (10, torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, 32, device=DEVICE)),
    "slot_mapping": (12, torch.zeros(7, device=DEVICE)),
    "k_scale": ("k_scale", 0.0),
}


@pytest.mark.parametrize("fused", [cuda.qk_norm_rope_write_kv, reference.qk_norm_rope_write_kv],
                         ids=["kernel", "reference"])
@pytest.mark.parametrize("name", BAD_ARGUMENTS)
def test_wrong_argument_raises_value_error_naming_it(fused, name):
    args = make_args(torch.float32, torch.float32)
    key, bad = BAD_ARGUMENTS[name]
    scales = {"k_scale": 1.0, "v_scale": 1.0}
    if isinstance(key, str):
        scales[key] = bad
    else:
        args[key] = bad
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        fused(*args, **scales)
