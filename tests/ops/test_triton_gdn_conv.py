"""Our Triton kernels (conv1d prefill/decode, gated-delta-rule decode) against the reference pool ops, on CPU.

Triton's interpreter runs the kernels on CPU tensors with numpy, so CI checks the kernel logic (indexing,
masks, in-place pool updates, GVA) on tiny odd shapes. It says nothing about races between GPU threads or
speed: tests/gpu/test_gdn_conv_gpu.py runs the compiled kernels.

The interpreter is chosen when a kernel is decorated, so TRITON_INTERPRET must be set before the kernel
modules are imported. On a machine with CUDA this module is skipped rather than switching the whole test
process to the interpreter (the GPU tests cover the compiled kernels there).
"""

import os
import sys
import types

import numpy as np
import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("compiled kernels are tested by tests/gpu/test_gdn_conv_gpu.py", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from deltaserve.ops import conv1d, gdn  # the reference path on CPU tensors
from deltaserve.ops.conv1d import cuda as conv_kernels
from deltaserve.ops.gdn import cuda as gdn_kernels
from tests.ops.interpreter import patch_interpreter_index
from tests.tolerance import assert_within, both_sides, gamma, recurrence_bound, unit_roundoff

patch_interpreter_index()  # the recurrent prefill loops over tokens cu_seqlens[n] .. cu_seqlens[n+1]

# Lengths include 0 (an empty sequence), lengths below W-1 (the state keeps old columns) and 40 (a sequence
# spanning two 32-token blocks of the prefill kernel). Slots are out of order; slots 1, 4 and 9 belong to
# nobody and must come back bit-identical.
LENGTHS = [1, 2, 3, 5, 17, 0, 40]
SLOTS = [5, 0, 8, 2, 7, 3, 6]
HAS_INITIAL = [False, True, True, False, True, True, False]
NUM_SLOTS = 10

# Kernel vs reference, both rounded (tests/tolerance.py). float32: the conv is a W-term dot product (plus
# SiLU's roundings), the gated delta rule a non-expansive recurrence: token by token on one side (a key-dim
# chain per token), chunked on the other where the reference runs (key dim + 2 chunk per chunk), the longer;
# bf16: the same float32 results stored to bf16 can land one ulp (2 u relative) apart. A wrong decay, beta or
# tap is off by 10% or more.
SILU_ROUNDINGS, SILU_GAIN = 8, 1.1
GDN_CHUNK = 64  # the reference's chunk; the kernels' own chains are no longer


def largest(*tensors) -> float:
    """The largest finite magnitude among tensors (fresh pool slots hold NaN)."""
    return max(torch.nan_to_num(t.double(), nan=0.0).abs().max().item() for t in tensors)


def stored_rounding(expected, dtype):
    """Two float32 results stored to dtype: one ulp apart at most (elementwise), none in float32."""
    return 2 * unit_roundoff(dtype) * torch.nan_to_num(expected.double(), nan=0.0).abs() if dtype != torch.float32 \
        else 0.0


def conv_bound(expected, dtype, width, magnitude):
    """Conv kernel vs reference: gamma(W + SiLU's roundings) on sum |w| |x| <= `magnitude`, both sides."""
    one_side = SILU_GAIN * gamma(width + SILU_ROUNDINGS, torch.float32) * magnitude
    return both_sides(one_side, one_side) + stored_rounding(expected, dtype)


def gdn_bound(expected, dtype, steps, key_dim, state_magnitude):
    """GDN kernel vs reference over `steps` tokens on states up to state_magnitude: both sides' recurrence bound
    (the output adds its last key-dim reduction: |q|_1 <= 1 after the l2 norm and key_dim^-0.5)."""
    one_side = max(recurrence_bound(steps, key_dim, state_magnitude, torch.float32),
                   recurrence_bound(-(-steps // GDN_CHUNK), key_dim + 2 * GDN_CHUNK, state_magnitude, torch.float32))
    one_side += gamma(key_dim, torch.float32) * state_magnitude
    return both_sides(one_side, one_side) + stored_rounding(expected, dtype)



def reference_decode(q, k, v, g, beta, pool, slots):
    """The reference decode step on the pool slots, from precomputed gates g and beta."""
    out, final = gdn.fused_recurrent_gated_delta_rule(q, k, v, g, beta, pool[slots].float())
    pool[slots] = final.to(pool.dtype)
    return out

def varlen_batch(lengths, slots, has_initial):
    """cu_seqlens [N+1] int64, state_slots [N] int64, has_initial_state [N] bool."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return cu, torch.tensor(slots), torch.tensor(has_initial)


def random_pool(shape, dtype, slots, has_initial, gen):
    """A random pool whose slots without an initial state hold NaN, as freshly allocated memory may: the ops
    must never read them."""
    pool = torch.randn(shape, generator=gen).to(dtype)
    for slot, has in zip(slots, has_initial):
        if not has:
            pool[slot] = float("nan")
    return pool


def assert_pools_match(actual, expected, bound):
    """Whole-pool comparison (NaN == NaN, so untouched fresh slots compare too)."""
    assert_within(actual, expected, bound, "pool")


# ---------------------------------------------------------------- conv1d


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("activation", ["silu", None])
def test_conv_prefill_then_decode_matches_reference(dtype, width, activation):
    gen = torch.Generator().manual_seed(width)
    channels = 300  # two channel blocks of the decode kernel, three of the prefill kernel, a ragged last one
    cu, slots, has_initial = varlen_batch(LENGTHS, SLOTS, HAS_INITIAL)
    x = torch.randn(int(cu[-1]), channels, generator=gen).to(dtype)
    weight = torch.randn(channels, width, generator=gen).to(dtype)
    pool = random_pool((NUM_SLOTS, channels, width - 1), dtype, SLOTS, HAS_INITIAL, gen)
    expected_pool, actual_pool = pool.clone(), pool.clone()

    expected = conv1d.conv_prefill(x, weight, expected_pool, slots, has_initial, cu, activation)
    actual = conv_kernels.conv_prefill(x, weight, actual_pool, slots, has_initial, cu, activation)
    magnitude = largest(x, pool) * weight.double().abs().sum(-1).max().item()  # >= sum |w| |x| of any output
    assert_within(actual, expected, conv_bound(expected, dtype, width, magnitude), "conv prefill")
    # The new state is a copy of inputs (no arithmetic): exact, NaN-free in every touched slot.
    assert torch.equal(actual_pool[slots], expected_pool[slots])
    assert not actual_pool[slots].isnan().any()
    untouched = [s for s in range(NUM_SLOTS) if s not in SLOTS]
    assert torch.equal(actual_pool[untouched], pool[untouched])

    # Three decode steps continue from the prefilled states (one token per sequence, same slots).
    for _ in range(3):
        step = torch.randn(len(SLOTS), channels, generator=gen).to(dtype)
        expected = conv1d.conv_decode(step, weight, expected_pool, slots, activation)
        actual = conv_kernels.conv_decode(step, weight, actual_pool, slots, activation)
        magnitude = largest(step, expected_pool) * weight.double().abs().sum(-1).max().item()
        assert_within(actual, expected, conv_bound(expected, dtype, width, magnitude), "conv decode")
        assert torch.equal(actual_pool.nan_to_num(), expected_pool.nan_to_num())
    assert torch.equal(actual_pool[untouched], pool[untouched])


# q | k | v widths summing to 300: segments that end inside a 128-channel block, then empty segments.
@pytest.mark.parametrize("split", [(48, 48, 204), (128, 172), (0, 300, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [2, 4])
def test_conv_prefill_writes_contiguous_segments(split, dtype, width):
    """With split, y comes back as one contiguous [T, d] tensor per segment, cut one after another from one
    allocation: equal bit for bit to the columns of the unsplit output, and close to the reference's."""
    gen = torch.Generator().manual_seed(width)
    channels = 300
    cu, slots, has_initial = varlen_batch(LENGTHS, SLOTS, HAS_INITIAL)
    num_tokens = int(cu[-1])
    x = torch.randn(num_tokens, channels + 20, generator=gen).to(dtype)[:, 7:7 + channels]  # strided rows
    weight = torch.randn(channels, width, generator=gen).to(dtype)
    pool = random_pool((NUM_SLOTS, channels, width - 1), dtype, SLOTS, HAS_INITIAL, gen)
    expected_pool, split_pool, whole_pool = pool.clone(), pool.clone(), pool.clone()

    parts = conv_kernels.conv_prefill(x, weight, split_pool, slots, has_initial, cu, split=split)
    whole = conv_kernels.conv_prefill(x, weight, whole_pool, slots, has_initial, cu)
    expected = conv1d.conv_prefill(x, weight, expected_pool, slots, has_initial, cu, split=split)
    assert len(parts) == len(split)
    offset = 0
    for part, width_d in zip(parts, split):
        assert part.shape == (num_tokens, width_d) and part.is_contiguous()
        assert part.untyped_storage().data_ptr() == parts[0].untyped_storage().data_ptr()
        assert part.storage_offset() == offset
        offset += num_tokens * width_d
    assert torch.equal(torch.cat(parts, dim=-1), whole)
    magnitude = largest(x, pool) * weight.double().abs().sum(-1).max().item()
    for part, reference in zip(parts, expected):
        assert_within(part, reference, conv_bound(reference, dtype, width, magnitude), "conv segment")
    assert torch.equal(split_pool.nan_to_num(), whole_pool.nan_to_num())
    assert torch.equal(split_pool[slots], expected_pool[slots])


@pytest.mark.parametrize("width", [2, 3, 4])
def test_conv_prefill_sums_taps_in_reference_order(width):
    """Without the activation the float32 kernel equals the reference bit for bit: every token, whether its
    program reads the initial state (a sequence's first W-1 tokens) or not, sums w[tap] * input in tap order."""
    gen = torch.Generator().manual_seed(11)
    channels = 200
    cu, slots, has_initial = varlen_batch(LENGTHS, SLOTS, HAS_INITIAL)
    x = torch.randn(int(cu[-1]), channels, generator=gen)
    weight = torch.randn(channels, width, generator=gen)
    pool = random_pool((NUM_SLOTS, channels, width - 1), torch.float32, SLOTS, HAS_INITIAL, gen)
    expected_pool, actual_pool = pool.clone(), pool.clone()
    expected = conv1d.conv_prefill(x, weight, expected_pool, slots, has_initial, cu, activation=None)
    actual = conv_kernels.conv_prefill(x, weight, actual_pool, slots, has_initial, cu, activation=None)
    assert torch.equal(actual, expected)


def test_conv_prefill_rejects_a_bad_split():
    x, weight, pool = torch.randn(3, 6), torch.randn(6, 4), torch.zeros(2, 6, 3)
    args = (torch.tensor([0]), torch.tensor([True]), torch.tensor([0, 3]))
    for split in [(2, 2), (1, 1, 1, 3), (7, -1)]:
        for prefill in (conv_kernels.conv_prefill, conv1d.conv_prefill):
            with pytest.raises(ValueError, match="split"):
                prefill(x, weight, pool, *args, split=split)


def test_conv_prefill_reads_the_state_it_was_given():
    """A single-token prefill with an initial state equals a decode step from that state (both paths)."""
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(5, 4, generator=gen)
    pool = torch.randn(3, 5, 3, generator=gen)
    x = torch.randn(1, 5, generator=gen)
    decoded_pool = pool.clone()
    decoded = conv_kernels.conv_decode(x, weight, decoded_pool, torch.tensor([2]))
    cu = torch.tensor([0, 1])
    prefilled = conv_kernels.conv_prefill(x, weight, pool, torch.tensor([2]), torch.tensor([True]), cu)
    torch.testing.assert_close(prefilled, decoded)
    torch.testing.assert_close(pool, decoded_pool)


def test_conv_kernels_reject_bad_input():
    x, weight = torch.randn(2, 6), torch.randn(6, 4)
    pool = torch.randn(4, 3, 6).transpose(1, 2)  # right shape [4, 6, 3], not contiguous
    with pytest.raises(ValueError, match="state_pool must be contiguous"):
        conv_kernels.conv_decode(x, weight, pool, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="activation"):
        conv_kernels.conv_decode(x, weight, pool.contiguous(), torch.tensor([0, 1]), activation="gelu")
    with pytest.raises(ValueError, match="has_initial_state"):
        conv_kernels.conv_prefill(x, weight, pool.contiguous(), torch.tensor([0]), torch.tensor([1]),
                                  torch.tensor([0, 2]))


# ---------------------------------------------------------------- gated delta rule decode


def gdn_step_inputs(num_seqs, key_heads, value_heads, key_dim, value_dim, dtype, gen):
    """One token per sequence: q, k [N, HK, K]; v [N, HV, V]; g [N, HV] float32 <= 0; beta [N, HV]."""
    q = torch.randn(num_seqs, key_heads, key_dim, generator=gen).to(dtype)
    k = torch.randn(num_seqs, key_heads, key_dim, generator=gen).to(dtype)
    v = torch.randn(num_seqs, value_heads, value_dim, generator=gen).to(dtype)
    g = torch.nn.functional.logsigmoid(torch.randn(num_seqs, value_heads, generator=gen) + 2)
    beta = torch.rand(num_seqs, value_heads, generator=gen).to(dtype)
    return q, k, v, g, beta


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "key_heads, value_heads, key_dim, value_dim, block_v",
    [(2, 6, 16, 16, 16), (1, 4, 32, 32, 8), (3, 3, 16, 32, 16), (2, 4, 32, 16, 32)],
)
def test_gdn_decode_matches_reference(pool_dtype, key_heads, value_heads, key_dim, value_dim, block_v):
    gen = torch.Generator().manual_seed(key_dim + value_dim + block_v)
    slots = torch.tensor([4, 0, 8, 2, 6])
    untouched = [1, 3, 5, 7]
    # float32 inputs with a float32 pool for a tight check of the math; bf16 inputs with a bf16 pool.
    dtype = pool_dtype
    pool = torch.randn(9, value_heads, key_dim, value_dim, generator=gen).to(pool_dtype)
    actual_pool = pool.clone()
    for _ in range(3):  # three steps, so a state written to the wrong place shows up in the next outputs
        # Each step starts the reference from the kernel's pool, so bf16 rounding differences don't compound.
        expected_pool = actual_pool.clone()
        q, k, v, g, beta = gdn_step_inputs(len(slots), key_heads, value_heads, key_dim, value_dim, dtype, gen)
        expected = reference_decode(q, k, v, g, beta, expected_pool, slots)
        actual = gdn_kernels.gdn_decode(q, k, v, g, beta, actual_pool, slots, block_v=block_v)
        assert actual.dtype == v.dtype and actual.shape == v.shape
        states = largest(actual_pool, expected_pool, pool)
        assert_within(actual, expected, gdn_bound(expected, dtype, 1, key_dim, states), "decode output")
        assert_pools_match(actual_pool, expected_pool, gdn_bound(expected_pool, pool_dtype, 1, key_dim, states))
    assert torch.equal(actual_pool[untouched], pool[untouched])


def test_gdn_decode_reads_strided_views():
    """q, k, v as column slices of one [N, 2*HK*K + HV*V] projection, as the layer passes them."""
    gen = torch.Generator().manual_seed(3)
    key_heads, value_heads, dim = 2, 4, 16
    qkv = torch.randn(3, 2 * key_heads * dim + value_heads * dim, generator=gen)
    q, k, v = qkv.split([key_heads * dim, key_heads * dim, value_heads * dim], dim=-1)
    q, k, v = q.view(3, key_heads, dim), k.view(3, key_heads, dim), v.view(3, value_heads, dim)
    g = -torch.rand(3, value_heads, generator=gen)
    beta = torch.rand(3, value_heads, generator=gen)
    pool = torch.randn(4, value_heads, dim, dim, generator=gen)
    slots = torch.tensor([3, 1, 0])
    expected_pool, actual_pool = pool.clone(), pool.clone()
    expected = reference_decode(q, k, v, g, beta, expected_pool, slots)
    actual = gdn_kernels.gdn_decode(q, k, v, g, beta, actual_pool, slots)
    bound = gdn_bound(expected, torch.float32, 1, dim, largest(pool, expected_pool))
    assert_within(actual, expected, bound, "decode output")
    assert_within(actual_pool, expected_pool, bound, "pool")


def test_gdn_decode_rejects_bad_input():
    gen = torch.Generator().manual_seed(0)
    q, k, v, g, beta = gdn_step_inputs(2, 1, 2, 16, 16, torch.float32, gen)
    pool = torch.zeros(3, 2, 16, 16)
    with pytest.raises(ValueError, match="state_pool must be contiguous"):
        gdn_kernels.gdn_decode(q, k, v, g, beta, pool.transpose(2, 3), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="one token per sequence"):
        gdn_kernels.gdn_decode(q, k, v, g, beta, pool, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="block_v"):
        gdn_kernels.gdn_decode(q, k, v, g, beta, pool, torch.tensor([0, 1]), block_v=12)


def test_gdn_decode_computes_raw_gates_like_the_reference():
    """With A_log / dt_bias the kernel takes the raw projections a, b (strided views) and forms the gates."""
    g = torch.Generator().manual_seed(11)
    n, hk, hv, dk, dv = 3, 2, 4, 16, 16
    q, k = torch.randn(2, n, hk, dk, generator=g)
    v = torch.randn(n, hv, dv, generator=g)
    ab = torch.randn(n, 3 * hv, generator=g) * 4  # a, b as strided column slices; some a + dt_bias > 20
    a, b = ab[:, :hv], ab[:, hv:2 * hv]
    a[0, 0] = 30.0
    A_log = torch.rand(hv, generator=g).mul(15).add(1).log()
    dt_bias = torch.randn(hv, generator=g)
    pool = torch.randn(5, hv, dk, dv, generator=g)
    slots = torch.tensor([4, 1, 2])
    expected_pool, actual_pool = pool.clone(), pool.clone()
    expected = gdn.gdn_decode(q, k, v, a, b, A_log, dt_bias, expected_pool, slots)  # CPU: reference path
    actual = gdn_kernels.gdn_decode(q, k, v, a, b, actual_pool, slots, A_log=A_log, dt_bias=dt_bias)
    bound = gdn_bound(expected, torch.float32, 1, dk, largest(pool, expected_pool))
    assert_within(actual, expected, bound, "decode output")
    assert_within(actual_pool, expected_pool, bound, "pool")


# ---------------------------------------------------------------- gated delta rule prefill (recurrent kernel)

# Short chunks of a prefix-cache hit and fresh prompts: lengths 0 to 70 (past the default threshold of 64 too,
# which the tests raise: the kernel itself has no limit), out-of-order slots, some without initial state.
RECURRENT_LENGTHS = [16, 1, 0, 70, 5, 64, 2, 0, 33]
RECURRENT_SLOTS = [3, 10, 0, 7, 12, 5, 1, 9, 4]
RECURRENT_HAS_INITIAL = [True, False, True, True, False, True, True, False, False]
RECURRENT_NUM_SLOTS = 14  # 2, 6, 8, 11 and 13 belong to nobody


def prefill_inputs(lengths, key_heads, value_heads, key_dim, value_dim, dtype, gen):
    """q, k, v as strided column views of one [T, 2*HK*K + HV*V] tensor (as the layer slices the conv
    output), g [T, HV] float32 <= 0, beta [T, HV]."""
    num_tokens = sum(lengths)
    qkv = torch.randn(num_tokens, 2 * key_heads * key_dim + value_heads * value_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([key_heads * key_dim, key_heads * key_dim, value_heads * value_dim], dim=-1)
    q, k = q.view(num_tokens, key_heads, key_dim), k.view(num_tokens, key_heads, key_dim)
    v = v.view(num_tokens, value_heads, value_dim)
    g = torch.nn.functional.logsigmoid(torch.randn(num_tokens, value_heads, generator=gen) + 2)
    beta = torch.rand(num_tokens, value_heads, generator=gen).to(dtype)
    return q, k, v, g, beta


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "key_heads, value_heads, key_dim, value_dim",
    [(2, 6, 16, 16), (1, 4, 32, 32), (3, 3, 16, 32)],  # GVA 3, GVA 4 over two value blocks, no GVA
)
def test_gdn_recurrent_prefill_matches_reference(monkeypatch, pool_dtype, key_heads, value_heads, key_dim,
                                                 value_dim):
    """The recurrent kernel against the chunked reference: outputs, every touched slot's final state (fresh
    slots hold NaN, which must not leak), untouched slots bit-identical; then a second chunk continues."""
    monkeypatch.setattr(gdn_kernels, "RECURRENT_PREFILL_MAX_LEN", max(RECURRENT_LENGTHS))
    gen = torch.Generator().manual_seed(key_heads + value_heads + key_dim + value_dim)
    cu, slots, has_initial = varlen_batch(RECURRENT_LENGTHS, RECURRENT_SLOTS, RECURRENT_HAS_INITIAL)
    shape = (RECURRENT_NUM_SLOTS, value_heads, key_dim, value_dim)
    pool = random_pool(shape, pool_dtype, RECURRENT_SLOTS, RECURRENT_HAS_INITIAL, gen)
    expected_pool, actual_pool = pool.clone(), pool.clone()
    dtype = pool_dtype  # float32 inputs for a tight check of the math; bf16 inputs with a bf16 pool

    inputs = prefill_inputs(RECURRENT_LENGTHS, key_heads, value_heads, key_dim, value_dim, dtype, gen)
    expected = gdn.gdn_prefill(*inputs, expected_pool, slots, has_initial, cu)
    actual = gdn_kernels.gdn_prefill(*inputs, actual_pool, slots, has_initial, cu,
                                     max_query_len=max(RECURRENT_LENGTHS))
    assert actual.dtype == dtype and actual.shape == inputs[2].shape
    states = largest(pool, expected_pool)
    steps = max(RECURRENT_LENGTHS)
    assert_within(actual, expected, gdn_bound(expected, dtype, steps, key_dim, states), "prefill output")
    assert_pools_match(actual_pool, expected_pool, gdn_bound(expected_pool, pool_dtype, steps, key_dim, states))
    assert not actual_pool[slots].isnan().any()
    untouched = [s for s in range(RECURRENT_NUM_SLOTS) if s not in RECURRENT_SLOTS]
    assert torch.equal(actual_pool[untouched].nan_to_num(), pool[untouched].nan_to_num())

    # The next chunk continues every sequence from the kernel's states (the reference from the same ones, so
    # bf16 rounding differences do not compound).
    lengths = [3, 0, 1, 9, 2, 1, 0, 4, 1]
    cu, _, has_initial = varlen_batch(lengths, RECURRENT_SLOTS, [True] * len(lengths))
    expected_pool = actual_pool.clone()
    inputs = prefill_inputs(lengths, key_heads, value_heads, key_dim, value_dim, dtype, gen)
    expected = gdn.gdn_prefill(*inputs, expected_pool, slots, has_initial, cu)
    actual = gdn_kernels.gdn_prefill(*inputs, actual_pool, slots, has_initial, cu, max_query_len=max(lengths))
    states = largest(actual_pool, expected_pool)
    assert_within(actual, expected, gdn_bound(expected, dtype, max(lengths), key_dim, states), "next chunk")
    assert_pools_match(actual_pool, expected_pool, gdn_bound(expected_pool, pool_dtype, max(lengths), key_dim, states))


def fake_fla_module() -> types.ModuleType:
    """A stand-in for fla-core's gated delta rule module that runs our reference on fla's [1, T, ...] layout."""
    def chunk_gated_delta_rule(q, k, v, g, beta, initial_state, cu_seqlens, **kwargs):
        out, final = gdn.chunk_gated_delta_rule(q[0], k[0], v[0], g[0], beta[0], initial_state, cu_seqlens)
        return out[None], final

    module = types.ModuleType("fla.ops.gated_delta_rule")
    module.chunk_gated_delta_rule = chunk_gated_delta_rule
    return module


@pytest.mark.parametrize("max_query_len", [70, None])  # the recurrent kernel (gates in it), fla (gates first)
def test_gdn_prefill_with_raw_gates_matches_gates_computed_first(monkeypatch, max_query_len):
    """With A_log and dt_bias, g and beta are the raw projections a and b, as the layer passes them."""
    monkeypatch.setattr(gdn_kernels, "RECURRENT_PREFILL_MAX_LEN", max(RECURRENT_LENGTHS))
    gen = torch.Generator().manual_seed(11)
    cu, slots, has_initial = varlen_batch(RECURRENT_LENGTHS, RECURRENT_SLOTS, RECURRENT_HAS_INITIAL)
    pool = random_pool((RECURRENT_NUM_SLOTS, 6, 16, 16), torch.float32, RECURRENT_SLOTS, RECURRENT_HAS_INITIAL, gen)
    expected_pool, actual_pool = pool.clone(), pool.clone()
    q, k, v, _, _ = prefill_inputs(RECURRENT_LENGTHS, 2, 6, 16, 16, torch.float32, gen)
    a, b = torch.randn(q.shape[0], 6, generator=gen), torch.randn(q.shape[0], 6, generator=gen)
    A_log, dt_bias = torch.randn(6, generator=gen), torch.randn(6, generator=gen)
    expected = gdn.gdn_prefill(q, k, v, *gdn.gdn_gates(a, b, A_log, dt_bias), expected_pool, slots, has_initial, cu)
    if max_query_len is None:  # the fla path: a stand-in that runs the reference on what it is given
        monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", fake_fla_module())
    actual = gdn_kernels.gdn_prefill(q, k, v, a, b, actual_pool, slots, has_initial, cu, max_query_len=max_query_len,
                                     A_log=A_log, dt_bias=dt_bias)
    bound = gdn_bound(expected, torch.float32, max(RECURRENT_LENGTHS), 16, largest(pool, expected_pool))
    assert_within(actual, expected, bound, "prefill output")
    assert_pools_match(actual_pool, expected_pool, bound)


@pytest.mark.parametrize("lengths", [
    [1, 20, 1, 3, 12, 0, 1],  # the long sequences apart: their rows are gathered
    [1, 0, 3, 1, 20, 12],  # adjacent at the end (a new prompt's chunk after decoding sequences): a view
])
@pytest.mark.parametrize("raw_gates", [False, True])
def test_gdn_prefill_splits_short_and_long_sequences(monkeypatch, lengths, raw_gates):
    """With the offsets on the host, sequences of at most RECURRENT_PREFILL_MAX_LEN tokens take the recurrent
    kernel and only the longer ones go to fla (a stand-in that records what it gets): the result is the
    reference's, fresh slots' NaN does not leak, and slots of nobody stay bit-identical."""
    monkeypatch.setattr(gdn_kernels, "RECURRENT_PREFILL_MAX_LEN", 8)
    monkeypatch.setattr(gdn_kernels, "SPLIT_MIN_SHORT_SEQS", 4)  # these batches have 4 and 5 short sequences
    fla_calls = []
    fake = fake_fla_module()
    reference_fla = fake.chunk_gated_delta_rule

    def recording_fla(q, k, v, g, beta, initial_state, cu_seqlens, **kwargs):
        fla_calls.append(kwargs["cu_seqlens_cpu"].tolist())
        # the chunk index comes built (fla would copy it from pageable memory: a sync)
        assert torch.equal(kwargs["chunk_indices"], torch.tensor([[0, 0], [1, 0]]))  # 20 and 12 tokens, chunk 64
        return reference_fla(q, k, v, g, beta, initial_state, cu_seqlens, **kwargs)

    fake.chunk_gated_delta_rule = recording_fla
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", fake)
    gen = torch.Generator().manual_seed(len(lengths) + raw_gates)
    slots = [5, 0, 8, 2, 7, 3, 6][:len(lengths)]
    has_initial = [True, False, True, True, False, True, True][:len(lengths)]
    cu, slots_t, has_initial_t = varlen_batch(lengths, slots, has_initial)
    pool = random_pool((10, 6, 16, 16), torch.float32, slots, has_initial, gen)
    expected_pool, actual_pool = pool.clone(), pool.clone()
    q, k, v, g, beta = prefill_inputs(lengths, 2, 6, 16, 16, torch.float32, gen)
    gates = {}
    if raw_gates:
        g, beta = torch.randn(q.shape[0], 6, generator=gen), torch.randn(q.shape[0], 6, generator=gen)
        gates = {"A_log": torch.randn(6, generator=gen), "dt_bias": torch.randn(6, generator=gen)}
    expected = gdn.gdn_prefill(q, k, v, *(gdn.gdn_gates(g, beta, gates["A_log"], gates["dt_bias"]) if raw_gates
                                         else (g, beta)), expected_pool, slots_t, has_initial_t, cu)
    actual = gdn_kernels.gdn_prefill(q, k, v, g, beta, actual_pool, slots_t, has_initial_t, cu, cu_seqlens_cpu=cu,
                                     max_query_len=max(lengths), **gates)
    assert fla_calls == [[0, 20, 32]]  # the two long sequences, nothing else
    bound = gdn_bound(expected, torch.float32, max(lengths), 16, largest(pool, expected_pool))
    assert_within(actual, expected, bound, "prefill output")
    assert_pools_match(actual_pool, expected_pool, bound)
    untouched = [s for s in range(10) if s not in slots]
    assert torch.equal(actual_pool[untouched].nan_to_num(), pool[untouched].nan_to_num())


def test_gdn_prefill_keeps_a_few_short_sequences_in_the_fla_call(monkeypatch):
    """Below SPLIT_MIN_SHORT_SEQS short sequences (a prompt's checkpointed tail beside its head) fla takes all."""
    calls = []

    def chunk_gated_delta_rule(q, k, v, g, beta, initial_state, **kwargs):
        calls.append(kwargs["cu_seqlens_cpu"].tolist())
        return v.clone()[None], initial_state

    fake_fla = types.ModuleType("fla.ops.gated_delta_rule")
    fake_fla.chunk_gated_delta_rule = chunk_gated_delta_rule
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", fake_fla)
    lengths = [gdn_kernels.RECURRENT_PREFILL_MAX_LEN + 100] + [16] * (gdn_kernels.SPLIT_MIN_SHORT_SEQS - 1)
    gen = torch.Generator().manual_seed(8)
    inputs = prefill_inputs(lengths, 1, 2, 16, 16, torch.float32, gen)
    cu, slots, has_initial = varlen_batch(lengths, list(range(len(lengths))), [True] * len(lengths))
    pool = torch.randn(len(lengths), 2, 16, 16, generator=gen)
    gdn_kernels.gdn_prefill(*inputs, pool, slots, has_initial, cu, cu_seqlens_cpu=cu, max_query_len=max(lengths))
    assert calls == [cu.tolist()]


def test_gdn_prefill_derives_its_host_plan_once_per_step(monkeypatch):
    """Every GDN layer of a step passes the same offsets tensor: the split plan and fla's chunk index are built
    for the first layer and reused (the same tensors reach fla); a new step's offsets build new ones."""
    monkeypatch.setattr(gdn_kernels, "RECURRENT_PREFILL_MAX_LEN", 8)
    monkeypatch.setattr(gdn_kernels, "SPLIT_MIN_SHORT_SEQS", 2)
    monkeypatch.setattr(gdn_kernels, "_per_step", gdn_kernels._PerStepCache())
    seen = []

    def chunk_gated_delta_rule(q, k, v, g, beta, initial_state, **kwargs):
        seen.append((kwargs["cu_seqlens_cpu"], kwargs["chunk_indices"]))
        return v.clone(), initial_state

    fake_fla = types.ModuleType("fla.ops.gated_delta_rule")
    fake_fla.chunk_gated_delta_rule = chunk_gated_delta_rule
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", fake_fla)
    lengths = [1, 20, 1]
    gen = torch.Generator().manual_seed(12)
    inputs = prefill_inputs(lengths, 1, 2, 16, 16, torch.float32, gen)
    pool = torch.randn(3, 2, 16, 16, generator=gen)
    _, slots, has_initial = varlen_batch(lengths, [0, 1, 2], [True] * 3)
    for step in range(2):
        cu, _, _ = varlen_batch(lengths, [0, 1, 2], [True] * 3)  # each step builds its own offsets
        for _layer in range(2):
            gdn_kernels.gdn_prefill(*inputs, pool, slots, has_initial, cu, cu_seqlens_cpu=cu, max_query_len=20)
    assert seen[0][0] is seen[1][0] and seen[0][1] is seen[1][1]  # layers of one step
    assert seen[2][0] is not seen[1][0] and seen[2][1] is not seen[1][1]  # the next step
    assert seen[0][0].tolist() == [0, 20] and seen[0][1].tolist() == [[0, 0]]


def test_fla_chunk_index_lists_every_chunk_of_every_sequence():
    """As fla's prepare_chunk_indices: (sequence, chunk within it) for each 64-token chunk, none for an empty
    sequence (checked against fla 0.6's own on these offsets)."""
    offsets = [0, 1, 65, 65, 200, 8392]
    expected = [(n, c) for n, (a, b) in enumerate(zip(offsets, offsets[1:])) for c in range(-(-(b - a) // 64))]
    index = gdn_kernels.fla_chunk_indices(np.array(offsets))
    assert index.dtype == np.int64 and [tuple(row) for row in index.tolist()] == expected


def test_gdn_recurrent_prefill_of_single_tokens_equals_decode():
    """One token per sequence with an initial state: the varlen loop and the decode step are the same math."""
    gen = torch.Generator().manual_seed(5)
    slots = torch.tensor([2, 0, 3])
    q, k, v, g, beta = gdn_step_inputs(3, 2, 4, 16, 32, torch.float32, gen)
    pool = torch.randn(4, 4, 16, 32, generator=gen)
    decoded_pool, prefilled_pool = pool.clone(), pool.clone()
    decoded = gdn_kernels.gdn_decode(q, k, v, g, beta, decoded_pool, slots)
    cu, _, has_initial = varlen_batch([1, 1, 1], [2, 0, 3], [True] * 3)
    prefilled = gdn_kernels.gdn_prefill(q, k, v, g, beta, prefilled_pool, slots, has_initial, cu, max_query_len=1)
    torch.testing.assert_close(prefilled, decoded, atol=0, rtol=0)
    torch.testing.assert_close(prefilled_pool, decoded_pool, atol=0, rtol=0)


def test_gdn_recurrent_prefill_without_tokens_zeroes_fresh_slots():
    """A batch of empty sequences: fresh slots (NaN garbage) become zeros, the others keep their state."""
    gen = torch.Generator().manual_seed(6)
    slots, has_initial = torch.tensor([1, 2]), torch.tensor([False, True])
    pool = random_pool((3, 2, 16, 16), torch.float32, [1, 2], [False, True], gen)
    expected_pool = pool.clone()
    expected_pool[1] = 0.0
    q, k, v, g, beta = gdn_step_inputs(0, 1, 2, 16, 16, torch.float32, gen)
    out = gdn_kernels.gdn_prefill(q, k, v, g, beta, pool, slots, has_initial, torch.tensor([0, 0, 0]),
                                  max_query_len=0)
    assert out.shape == (0, 2, 16)
    assert torch.equal(pool, expected_pool)


def test_gdn_prefill_takes_fla_for_long_or_unknown_lengths(monkeypatch):
    """max_query_len above RECURRENT_PREFILL_MAX_LEN, or unknown, runs fla's chunked path (a stand-in here)."""
    calls = []

    def chunk_gated_delta_rule(q, k, v, g, beta, initial_state, **kwargs):
        calls.append(q.shape[1])  # tokens of the [1, T, H, D] varlen input
        return v.clone(), initial_state

    fake_fla = types.ModuleType("fla.ops.gated_delta_rule")
    fake_fla.chunk_gated_delta_rule = chunk_gated_delta_rule
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", fake_fla)
    gen = torch.Generator().manual_seed(7)
    longest = gdn_kernels.RECURRENT_PREFILL_MAX_LEN
    lengths = [longest + 1, 3]
    inputs = prefill_inputs(lengths, 1, 2, 16, 16, torch.float32, gen)
    cu, slots, has_initial = varlen_batch(lengths, [0, 1], [True, True])
    pool = torch.randn(2, 2, 16, 16, generator=gen)
    for max_query_len in (longest + 1, None):
        gdn_kernels.gdn_prefill(*inputs, pool, slots, has_initial, cu, max_query_len=max_query_len)
    assert calls == [sum(lengths)] * 2
    # At the threshold the recurrent kernel runs (it would run this batch correctly whatever its lengths).
    gdn_kernels.gdn_prefill(*inputs, pool, slots, has_initial, cu, max_query_len=longest)
    assert len(calls) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_l2_normalize_matches_fla_formula(dtype):
    """q and k before fla's chunked rule: each head row over its L2 norm, eps 1e-6 under the root, in float32;
    rows beyond a program's block (37 rows of 16) and a zero row (no NaN) included."""
    x = torch.randn(37, 3, 32, generator=torch.Generator().manual_seed(8)).to(dtype)
    x[5, 1] = 0
    x32 = x.float()
    expected = (x32 * (1 / torch.sqrt((x32 * x32).sum(-1, keepdim=True) + 1e-6))).to(dtype)
    actual = gdn_kernels.l2_normalize(x)
    assert actual.dtype == dtype and not actual.isnan().any()
    # a sum of 32 squares, the sqrt, divide and product per side (relative), then the store to dtype
    one_side = gamma(32 + 3, torch.float32) * expected.double().abs()
    assert_within(actual, expected, both_sides(one_side, one_side) + stored_rounding(expected, dtype), "l2 norm")
    with pytest.raises(ValueError, match="contiguous"):
        gdn_kernels.l2_normalize(x.transpose(0, 1))
