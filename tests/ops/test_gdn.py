"""Gated delta rule reference ops against a float64 per-token loop, on odd varlen shapes with GVA."""

import pytest
import torch

from deltaserve.ops.gdn import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from tests.tolerance import assert_within, both_sides, gamma, recurrence_bound, unit_roundoff

# The ops compute in float32, the oracle in float64. Bounds come from tests.tolerance.recurrence_bound: with
# unit keys, betas in [0, 1] and decays <= 1 the state update is non-expansive, so the float32 errors of the
# steps add: T key-dim reductions token by token, ceil(T / C) chains of key dim + 2C when chunked, on the
# largest state the oracle passes through. Outputs are S^T q with |q|_1 <= 1 (q is scaled to norm
# key_dim^-0.5), so they carry the state's error plus one key-dim reduction. An algebra slip (a wrong decay,
# a missing beta) shows up at 1e-2 or more.

KEY_HEADS, VALUE_HEADS = 2, 4
LENGTHS = [1, 3, 63, 64, 65, 130]


def oracle(q, k, v, g, beta, initial_state, cu_seqlens):
    """Straight per-token gated delta rule in float64. Shapes as chunk_gated_delta_rule; returns float64
    (out, final) and the largest state element it passed through (the bounds' magnitude)."""
    group = v.shape[1] // q.shape[1]
    q, k = (x.double().repeat_interleave(group, dim=1) for x in (q, k))  # [T, HV, K]
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    v, g, beta = v.double(), g.double(), beta.double()
    out = torch.zeros(v.shape, dtype=torch.float64)
    final = torch.zeros(initial_state.shape, dtype=torch.float64)
    largest = initial_state.abs().max().item()  # the largest state element seen: the bounds' magnitude
    for seq in range(len(cu_seqlens) - 1):
        state = initial_state[seq].double().clone()  # [HV, K, V]
        for t in range(int(cu_seqlens[seq]), int(cu_seqlens[seq + 1])):
            for h in range(v.shape[1]):
                state[h] = torch.exp(g[t, h]) * state[h]
                u = beta[t, h] * (v[t, h] - state[h].T @ k[t, h])
                state[h] = state[h] + torch.outer(k[t, h], u)
                out[t, h] = state[h].T @ q[t, h]
            largest = max(largest, state.abs().max().item())
        final[seq] = state
    return out, final, largest


def bounds(steps: int, head_dim: int, magnitude: float, chunk_size: int | None = None):
    """(output bound, state bound) of one float32 evaluation over `steps` tokens whose states stay below
    magnitude: chunked when chunk_size is given, token by token otherwise."""
    if chunk_size:
        state = recurrence_bound(-(-steps // chunk_size), head_dim + 2 * chunk_size, magnitude, torch.float32)
    else:
        state = recurrence_bound(steps, head_dim, magnitude, torch.float32)
    return state + gamma(head_dim, torch.float32) * magnitude, state


def make_inputs(lengths, head_dim, seed=0, dtype=torch.float32):
    """Random varlen inputs; per-head decay scales from nearly none to strong so that state carry matters."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, KEY_HEADS, head_dim, generator=gen).to(dtype)
    k = torch.randn(total, KEY_HEADS, head_dim, generator=gen).to(dtype)
    v = torch.randn(total, VALUE_HEADS, head_dim, generator=gen).to(dtype)
    decay_scale = torch.tensor([0.01, 0.1, 0.5, 3.0])  # [HV]
    g = -torch.nn.functional.softplus(torch.randn(total, VALUE_HEADS, generator=gen)) * decay_scale
    beta = torch.rand(total, VALUE_HEADS, generator=gen).to(dtype)
    initial_state = torch.randn(len(lengths), VALUE_HEADS, head_dim, head_dim, generator=gen)
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0)
    return q, k, v, g, beta, initial_state, cu_seqlens


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("head_dim", [8, 16])
def test_chunked_matches_per_token_oracle(chunk_size, head_dim):
    inputs = make_inputs(LENGTHS, head_dim)
    initial_state_before = inputs[5].clone()
    out, final = chunk_gated_delta_rule(*inputs, chunk_size=chunk_size)
    want_out, want_final, largest = oracle(*inputs)
    assert torch.equal(inputs[5], initial_state_before), "initial_state must not be modified"
    assert out.dtype == torch.float32 and final.dtype == torch.float32
    assert out.shape == (sum(LENGTHS), VALUE_HEADS, head_dim)
    assert final.shape == (len(LENGTHS), VALUE_HEADS, head_dim, head_dim)
    out_bound, state_bound = bounds(max(LENGTHS), head_dim, largest, chunk_size)
    assert_within(out, want_out, out_bound, "chunked output")
    assert_within(final, want_final, state_bound, "chunked final state")


def test_initial_state_matters():
    """Guards against a test that passes with the state ignored: a different start changes the output."""
    q, k, v, g, beta, initial_state, cu_seqlens = make_inputs([5, 9], 8)
    out, _ = chunk_gated_delta_rule(q, k, v, g, beta, initial_state, cu_seqlens)
    fresh, _ = chunk_gated_delta_rule(q, k, v, g, beta, torch.zeros_like(initial_state), cu_seqlens)
    assert (out - fresh).abs().max() > 0.1


@pytest.mark.parametrize("split", [1, 37, 64, 129])
def test_chunked_split_in_two_calls_equals_one_call(split):
    q, k, v, g, beta, initial_state, _ = make_inputs([130], 16, seed=1)
    whole_out, whole_final = chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state, torch.tensor([0, 130]), chunk_size=16
    )
    head, tail = slice(0, split), slice(split, 130)
    head_out, mid_state = chunk_gated_delta_rule(
        q[head], k[head], v[head], g[head], beta[head], initial_state, torch.tensor([0, split]), chunk_size=16
    )
    tail_out, tail_final = chunk_gated_delta_rule(
        q[tail], k[tail], v[tail], g[tail], beta[tail], mid_state, torch.tensor([0, 130 - split]), chunk_size=16
    )
    # Both sides are float32 with chunk boundaries in different places: each carries its own rounding.
    largest = oracle(q, k, v, g, beta, initial_state, torch.tensor([0, 130]))[2]
    out_bound, state_bound = bounds(130, 16, largest, chunk_size=16)
    assert_within(torch.cat([head_out, tail_out]), whole_out, both_sides(out_bound, out_bound), "split output")
    assert_within(tail_final, whole_final, both_sides(state_bound, state_bound), "split final state")


def test_empty_sequence_keeps_its_state():
    q, k, v, g, beta, initial_state, _ = make_inputs([4, 0, 3], 8)
    cu_seqlens = torch.tensor([0, 4, 4, 7])
    _, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state, cu_seqlens)
    torch.testing.assert_close(final[1], initial_state[1], atol=0, rtol=0)


@pytest.mark.parametrize("head_dim", [8, 16])
def test_recurrent_matches_per_token_oracle(head_dim):
    num_seqs = 5
    q, k, v, g, beta, initial_state, cu_seqlens = make_inputs([1] * num_seqs, head_dim, seed=2)
    before = initial_state.clone()
    out, final = fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state)
    want_out, want_final, largest = oracle(q, k, v, g, beta, initial_state, cu_seqlens)
    out_bound, state_bound = bounds(1, head_dim, largest)
    assert_within(out, want_out, out_bound, "decode output")
    assert_within(final, want_final, state_bound, "decode state")
    assert torch.equal(initial_state, before), "the decode op must return a new state, not update in place"


def test_decode_steps_continue_a_chunked_prefill():
    """Prefill 70 tokens chunked, then decode 3 tokens one at a time == chunked over all 73 tokens."""
    q, k, v, g, beta, initial_state, _ = make_inputs([73], 16, seed=3)
    whole_out, whole_final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state, torch.tensor([0, 73]))
    _, state = chunk_gated_delta_rule(
        q[:70], k[:70], v[:70], g[:70], beta[:70], initial_state, torch.tensor([0, 70])
    )
    largest = oracle(q, k, v, g, beta, initial_state, torch.tensor([0, 73]))[2]
    whole_bounds = bounds(73, 16, largest, chunk_size=64)
    for t in range(70, 73):
        step = slice(t, t + 1)
        out, state = fused_recurrent_gated_delta_rule(q[step], k[step], v[step], g[step], beta[step], state)
        # chunked over t+1 tokens vs chunked over 70 then token by token: the two sides' bounds add
        mine = bounds(70, 16, largest, chunk_size=64)[1] + bounds(t + 1 - 70, 16, largest)[1]
        assert_within(out, whole_out[step], both_sides(whole_bounds[0], mine + gamma(16, torch.float32)), "decode")
    assert_within(state, whole_final, both_sides(whole_bounds[1], mine), "state after decode")


def test_bfloat16_inputs_give_bfloat16_output_and_float32_state():
    q, k, v, g, beta, initial_state, cu_seqlens = make_inputs([20, 7], 8, dtype=torch.bfloat16)
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state, cu_seqlens)
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    want_out, want_final, largest = oracle(q, k, v, g, beta, initial_state, cu_seqlens)
    # The inputs are the same bf16 values for both; the output adds one bf16 rounding to the float32 bound.
    out_bound, state_bound = bounds(20, 8, largest, chunk_size=64)
    assert_within(out, want_out, out_bound + unit_roundoff(torch.bfloat16) * want_out.abs(), "bf16 output")
    assert_within(final, want_final, state_bound, "float32 state")

    step_out, step_final = fused_recurrent_gated_delta_rule(q[:2], k[:2], v[:2], g[:2], beta[:2], initial_state)
    assert step_out.dtype == torch.bfloat16 and step_final.dtype == torch.float32


def test_bad_inputs_raise_value_errors_naming_the_field():
    q, k, v, g, beta, initial_state, cu_seqlens = make_inputs([3, 4], 8)
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_gated_delta_rule(q, k, v, g, beta, initial_state, torch.tensor([0, 3, 6]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_gated_delta_rule(q, k, v, g, beta, initial_state, torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="initial_state"):
        chunk_gated_delta_rule(q, k, v, g, beta, initial_state[:, :2], cu_seqlens)
    with pytest.raises(ValueError, match="v heads"):
        chunk_gated_delta_rule(q, k, v[:, :3], g[:, :3], beta[:, :3], initial_state[:, :3], cu_seqlens)
    with pytest.raises(ValueError, match="beta"):
        chunk_gated_delta_rule(q, k, v, g, beta[:, :1], initial_state, cu_seqlens)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_gated_delta_rule(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size=0)
    with pytest.raises(ValueError, match="one token per sequence"):
        fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state)
