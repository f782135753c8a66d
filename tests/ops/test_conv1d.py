"""Causal depthwise conv1d reference ops against torch's conv1d in float64, with state carried across pieces."""

import pytest
import torch
import torch.nn.functional as F

from deltaserve.ops.conv1d import causal_conv1d, causal_conv1d_update
from tests.tolerance import assert_within, both_sides, gamma, unit_roundoff

# The ops compute in float32, the oracle in float64. Each output is a W-term dot product: its bound is
# gamma(W) * sum |w| |x| (tests/tolerance.py), taken elementwise from the inputs by running the oracle on their
# absolute values. SiLU passes that error on with a gain of at most max |silu'| < 1.1 and adds its own few
# roundings (exp to within ~4 ulp, an add, a divide): SILU_ROUNDINGS more on the chain.
SILU_ROUNDINGS = 8
SILU_GAIN = 1.1

CHANNELS = 12
LENGTHS = [1, 2, 3, 5, 17]


def oracle(x, weight, initial_state, cu_seqlens, activation):
    """float64 F.conv1d (grouped = depthwise) over each sequence left-padded with its state."""
    outputs, finals = [], []
    width = weight.shape[1]
    for seq in range(len(cu_seqlens) - 1):
        start, end = int(cu_seqlens[seq]), int(cu_seqlens[seq + 1])
        padded = torch.cat([initial_state[seq].double(), x[start:end].double().T], dim=1)  # [D, W-1+L]
        y = F.conv1d(padded[None], weight.double()[:, None, :], groups=weight.shape[0])[0]  # [D, L]
        outputs.append(F.silu(y).T if activation == "silu" else y.T)
        finals.append(padded[:, padded.shape[1] - (width - 1) :])
    return torch.cat(outputs), torch.stack(finals)


def bound(x, weight, initial_state, cu_seqlens, activation="silu"):
    """Elementwise float32 bound of the outputs [T, D] of one evaluation (see the module's comment)."""
    magnitudes = oracle(x.abs(), weight.abs(), initial_state.abs(), cu_seqlens, None)[0]  # sum |w| |x|
    width = weight.shape[1]
    if activation == "silu":
        return SILU_GAIN * gamma(width + SILU_ROUNDINGS, torch.float32) * magnitudes
    return gamma(width, torch.float32) * magnitudes


def make_inputs(lengths, width, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lengths), CHANNELS, generator=gen).to(dtype)
    weight = torch.randn(CHANNELS, width, generator=gen).to(dtype)
    initial_state = torch.randn(len(lengths), CHANNELS, width - 1, generator=gen).to(dtype)
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0)
    return x, weight, initial_state, cu_seqlens


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("width", [2, 4])
def test_varlen_matches_torch_conv1d(width, activation):
    x, weight, initial_state, cu_seqlens = make_inputs(LENGTHS, width)
    y, final = causal_conv1d(x, weight, initial_state, cu_seqlens, activation=activation)
    want_y, want_final = oracle(x, weight, initial_state, cu_seqlens, activation)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert final.shape == initial_state.shape and final.dtype == initial_state.dtype
    assert_within(y, want_y, bound(x, weight, initial_state, cu_seqlens, activation), "conv1d output")
    torch.testing.assert_close(final.double(), want_final, atol=0, rtol=0)  # the state is copied inputs


def test_short_sequence_keeps_older_state_columns():
    """One token with W=4: the final state is (state[1], state[2], x), by value."""
    x, weight, initial_state, cu_seqlens = make_inputs([1], 4)
    _, final = causal_conv1d(x, weight, initial_state, cu_seqlens)
    torch.testing.assert_close(final[0], torch.cat([initial_state[0, :, 1:], x.T], dim=1), atol=0, rtol=0)


def test_initial_state_feeds_the_first_outputs():
    x, weight, initial_state, cu_seqlens = make_inputs([5], 4)
    y, _ = causal_conv1d(x, weight, initial_state, cu_seqlens)
    fresh, _ = causal_conv1d(x, weight, torch.zeros_like(initial_state), cu_seqlens)
    assert (y[:3] - fresh[:3]).abs().max() > 1e-2  # the first W-1 outputs read the state
    torch.testing.assert_close(y[3:], fresh[3:], atol=0, rtol=0)  # later outputs do not


@pytest.mark.parametrize("pieces", [[1, 1, 1, 1, 13], [2, 5, 1, 9], [3, 14], [17]])
def test_state_carry_across_pieces_equals_one_call(pieces):
    x, weight, initial_state, _ = make_inputs([17], 4, seed=1)
    whole_y, whole_final = causal_conv1d(x, weight, initial_state, torch.tensor([0, 17]))
    state, outputs, start = initial_state, [], 0
    for length in pieces:
        y, state = causal_conv1d(x[start : start + length], weight, state, torch.tensor([0, length]))
        outputs.append(y)
        start += length
    # Outputs may differ in the last bit (vectorised vs tail-loop SiLU); the state is copied inputs, so exact.
    one_call = bound(x, weight, initial_state, torch.tensor([0, 17]))
    assert_within(torch.cat(outputs), whole_y, both_sides(one_call, one_call), "pieces vs one call")
    torch.testing.assert_close(state, whole_final, atol=0, rtol=0)


@pytest.mark.parametrize("activation", ["silu", None])
def test_update_equals_varlen_on_one_token_sequences(activation):
    x, weight, initial_state, cu_seqlens = make_inputs([1] * 6, 4, seed=2)
    want_y, want_final = causal_conv1d(x, weight, initial_state, cu_seqlens, activation=activation)
    conv_state = initial_state.clone()
    y = causal_conv1d_update(x, conv_state, weight, activation=activation)
    one_call = bound(x, weight, initial_state, cu_seqlens, activation)
    assert_within(y, want_y, both_sides(one_call, one_call), "update vs varlen")
    torch.testing.assert_close(conv_state, want_final, atol=0, rtol=0)  # updated in place


def test_update_steps_continue_a_prefill():
    x, weight, initial_state, _ = make_inputs([9], 4, seed=3)
    whole_y, whole_final = causal_conv1d(x, weight, initial_state, torch.tensor([0, 9]))
    _, conv_state = causal_conv1d(x[:6], weight, initial_state, torch.tensor([0, 6]))
    one_call = bound(x, weight, initial_state, torch.tensor([0, 9]))
    for t in range(6, 9):
        y = causal_conv1d_update(x[t : t + 1], conv_state, weight)
        assert_within(y, whole_y[t : t + 1], both_sides(one_call[t], one_call[t]), f"update step {t}")
    torch.testing.assert_close(conv_state, whole_final, atol=0, rtol=0)


def test_bfloat16_keeps_dtypes():
    x, weight, initial_state, cu_seqlens = make_inputs([4, 2], 4, dtype=torch.bfloat16)
    y, final = causal_conv1d(x, weight, initial_state, cu_seqlens)
    assert y.dtype == torch.bfloat16 and final.dtype == torch.bfloat16
    want_y, _ = oracle(x, weight, initial_state, cu_seqlens, "silu")
    # the same bf16 inputs on both sides: the float32 bound plus the bf16 rounding of the output
    output_rounding = unit_roundoff(torch.bfloat16) * want_y.abs()
    assert_within(y, want_y, bound(x, weight, initial_state, cu_seqlens) + output_rounding, "bf16 output")


def test_bad_inputs_raise_value_errors_naming_the_field():
    x, weight, initial_state, cu_seqlens = make_inputs([3, 4], 4)
    with pytest.raises(ValueError, match="'relu'"):
        causal_conv1d(x, weight, initial_state, cu_seqlens, activation="relu")
    with pytest.raises(ValueError, match="'gelu'"):
        causal_conv1d_update(x[:2], initial_state.clone(), weight, activation="gelu")
    with pytest.raises(ValueError, match="initial_state"):
        causal_conv1d(x, weight, initial_state[:, :, :2], cu_seqlens)
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d(x, weight[:5], initial_state, cu_seqlens)
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_conv1d(x, weight, initial_state, torch.tensor([0, 3, 8]))
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d_update(x[:3], initial_state.clone(), weight)
