"""The gated attention output o * sigmoid(gate): the Triton op `attention_output_gate` and the cuDNN paths'
gate= argument, against torch, on CPU in Triton's interpreter.

As in test_triton_attention.py: the interpreter truncates float32 -> bf16 casts, so bf16 is not tested
here, and its exp is numpy's (the last float32 bit may differ from torch's), so the bit-for-bit comparisons
run in float16, where the sigmoid is rounded to 11 bits.
"""

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("compiled kernels are tested by tests/gpu/test_attention_gpu.py", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from deltaserve.ops.attention import cuda as kernels
from deltaserve.ops.attention import cuda_sdpa, reference
from tests.ops.interpreter import patch_interpreter_index, use_math_cudnn
from tests.tolerance import assert_within, both_sides, gamma

SIGMOID_ROUNDINGS = 8  # o * sigmoid(gate): exp (within ~4 ulp), add, divide, the product; relative

patch_interpreter_index()


def gate_like(num_tokens, num_heads, head_dim, dtype, seed):
    """A [T, n_heads, hd] gate sliced from a [T, n_heads, 2 * hd] projection, as the layer slices it."""
    gen = torch.Generator().manual_seed(seed)
    wide = (2 * torch.randn(num_tokens, num_heads, 2 * head_dim, generator=gen)).to(dtype)
    return wide[..., head_dim:]


def test_gate_matches_torch_bit_for_bit():
    """6 heads of 24 dims: both padded (to 8 and 32) inside the kernel."""
    gate = gate_like(9, 6, 24, torch.float16, seed=0)
    o = torch.randn(9, 6, 24, generator=torch.Generator().manual_seed(1)).half()
    assert torch.equal(kernels.attention_output_gate(o, gate), o * torch.sigmoid(gate))


def test_float32_output_is_rounded_first_and_out_may_be_o():
    """A float32 o (chunk_over_prefix's accumulator) is rounded to the gate's dtype first, as
    `o.to(gate.dtype) * torch.sigmoid(gate)`; out=o writes in place."""
    gate = gate_like(5, 4, 16, torch.float16, seed=2)
    o32 = torch.randn(5, 4, 16, generator=torch.Generator().manual_seed(3))
    assert torch.equal(kernels.attention_output_gate(o32, gate), o32.half() * torch.sigmoid(gate))
    o = o32.half()
    expected = o * torch.sigmoid(gate)
    assert kernels.attention_output_gate(o, gate, out=o) is o
    assert torch.equal(o, expected)
    assert torch.equal(reference.attention_output_gate(o32, gate), o32.half() * torch.sigmoid(gate))


def test_float32_gate_within_float32_rounding():
    gate = gate_like(7, 3, 16, torch.float32, seed=4)
    o = torch.randn(7, 3, 16, generator=torch.Generator().manual_seed(5))
    expected = o * torch.sigmoid(gate)
    one_side = gamma(SIGMOID_ROUNDINGS, torch.float32) * expected.double().abs()  # exp, add, divide, product
    assert_within(kernels.attention_output_gate(o, gate), expected, both_sides(one_side, one_side), "gate")


def test_empty_and_bad_arguments():
    gate = torch.zeros(0, 2, 16, dtype=torch.float16)
    assert kernels.attention_output_gate(gate.float(), gate).shape == (0, 2, 16)
    o = torch.zeros(3, 2, 16)
    for op in (kernels.attention_output_gate, reference.attention_output_gate):
        with pytest.raises(ValueError, match="gate must be"):
            op(o, torch.zeros(3, 2, 8))
        with pytest.raises(ValueError, match="out must have dtype"):
            op(o, o.half(), out=o)
    with pytest.raises(ValueError, match="unit stride"):
        kernels.attention_output_gate(o, o.half(), out=torch.zeros(3, 2, 32, dtype=torch.float16)[..., ::2])


def test_fresh_prompts_with_gate(monkeypatch):
    """The gate replaces each prompt's copy into the output; PyTorch's math SDPA stands in for cuDNN."""
    from torch.nn.attention import SDPBackend

    monkeypatch.setattr(cuda_sdpa, "_SDPA_BACKENDS", [SDPBackend.MATH])
    monkeypatch.setattr(cuda_sdpa, "SDPA_BUCKET", 16)
    gen = torch.Generator().manual_seed(6)
    lengths = [21, 1, 0, 16]
    q = torch.randn(sum(lengths), 6, 16, generator=gen).half()
    k, v = torch.randn(2, sum(lengths), 2, 16, generator=gen).half()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    gate = gate_like(sum(lengths), 6, 16, torch.float16, seed=7)
    plain = cuda_sdpa.fresh_causal_attention(q, k, v, cu, 0.25)
    assert torch.equal(cuda_sdpa.fresh_causal_attention(q, k, v, cu, 0.25, gate=gate), plain * torch.sigmoid(gate))


def test_chunk_over_prefix_with_gate(monkeypatch):
    """The gate replaces the final cast of the float32 merge; a float64 stand-in for cuDNN's attention."""
    use_math_cudnn(monkeypatch, cuda_sdpa)
    monkeypatch.setattr(cuda_sdpa, "SDPA_BUCKET", 16)
    gen = torch.Generator().manual_seed(8)
    prefix, length, block_size = 37, 11, 16
    keys, values = torch.randn(2, prefix + length, 2, 16, generator=gen).half()
    k_cache = torch.full((4, block_size, 2, 16), float("nan"), dtype=torch.float16)
    v_cache = k_cache.clone()
    table = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    positions = torch.arange(prefix + length)
    blocks = table[positions // block_size].long()
    k_cache[blocks, positions % block_size], v_cache[blocks, positions % block_size] = keys, values
    q = torch.randn(length, 6, 16, generator=gen).half()
    gate = gate_like(length, 6, 16, torch.float16, seed=9)
    args = (q, keys[prefix:], values[prefix:], k_cache, v_cache, table, prefix, 0.25)
    plain = cuda_sdpa.chunk_over_prefix_attention(*args)
    assert torch.equal(cuda_sdpa.chunk_over_prefix_attention(*args, gate=gate), plain * torch.sigmoid(gate))
