"""Paged attention reference ops against dense float64 causal attention over contiguous K/V."""

import math

import pytest
import torch

from deltaserve.ops.attention import (
    attention_output_gate,
    paged_attention,
    write_kv_cache,
)

from tests.tolerance import assert_within, attention_bound, unit_roundoff

# The op gathers float32 K/V and computes a float32 softmax; the oracle is float64 on the same values. The
# bound is tests.tolerance.attention_bound over the longest sequence's keys, from the tensors' magnitudes.

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 8
# (kv length, query length): prefills with and without a cached prefix, decode rows (q_len 1), odd lengths.
SEQUENCES = [(37, 37), (23, 5), (1, 1), (50, 1), (16, 16), (33, 1), (9, 4)]


def dense_oracle(q, keys, values, q_lens, kv_lens, scale):
    """float64 causal attention per sequence from contiguous K/V ([S_total, n_kv, hd], sequences concatenated)."""
    group = q.shape[1] // keys.shape[1]
    outputs, q_start, kv_start = [], 0, 0
    for q_len, kv_len in zip(q_lens, kv_lens):
        qs = q[q_start : q_start + q_len].double()  # [Q, H, hd]
        ks = keys[kv_start : kv_start + kv_len].double().repeat_interleave(group, dim=1)  # [S, H, hd]
        vs = values[kv_start : kv_start + kv_len].double().repeat_interleave(group, dim=1)  # [S, H, hd]
        scores = torch.einsum("qhd,shd->hqs", qs, ks) * scale
        positions = torch.arange(kv_len - q_len, kv_len)
        mask = torch.arange(kv_len)[None, :] > positions[:, None]  # future keys
        probs = scores.masked_fill(mask, -math.inf).softmax(-1)
        outputs.append(torch.einsum("hqs,shd->qhd", probs, vs))
        q_start, kv_start = q_start + q_len, kv_start + kv_len
    return torch.cat(outputs)


def build_case(block_size, seed=0, cache_dtype=torch.float32):
    """Random q and K/V, a shuffled block assignment, and the cache filled through write_kv_cache.

    The cached prefix and the new tokens are written in two calls, as an engine does across steps.
    """
    gen = torch.Generator().manual_seed(seed)
    kv_lens = [kv for kv, _ in SEQUENCES]
    q_lens = [ql for _, ql in SEQUENCES]
    keys = torch.randn(sum(kv_lens), NUM_KV_HEADS, HEAD_DIM, generator=gen)
    values = torch.randn(sum(kv_lens), NUM_KV_HEADS, HEAD_DIM, generator=gen)
    q = torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM, generator=gen)

    blocks_per_seq = [-(-kv // block_size) for kv in kv_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks that nobody owns
    free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(SEQUENCES), max(blocks_per_seq) + 1, dtype=torch.int32)
    slots = []  # per sequence, [kv_len] slot of each position
    for seq, count in enumerate(blocks_per_seq):
        owned = [free_blocks.pop() for _ in range(count)]
        block_tables[seq, :count] = torch.tensor(owned, dtype=torch.int32)
        positions = torch.arange(kv_lens[seq])
        slots.append(torch.tensor(owned)[positions // block_size] * block_size + positions % block_size)

    k_cache = torch.full((num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM), float("nan"), dtype=cache_dtype)
    v_cache = k_cache.clone()  # NaN everywhere a sequence does not own: reading past its length would show
    starts = torch.tensor([0] + kv_lens).cumsum(0).tolist()
    for is_new in (False, True):
        rows, slot_rows = [], []
        for seq, (kv_len, q_len) in enumerate(SEQUENCES):
            span = range(kv_len - q_len, kv_len) if is_new else range(kv_len - q_len)
            rows += [starts[seq] + p for p in span]
            slot_rows.append(slots[seq][list(span)])
        rows = torch.tensor(rows, dtype=torch.long)
        write_kv_cache(keys[rows], values[rows], k_cache, v_cache, torch.cat(slot_rows))

    cu_seqlens_q = torch.tensor([0] + q_lens).cumsum(0)
    seq_lens = torch.tensor(kv_lens)
    return q, keys, values, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens


@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_attention_matches_dense_oracle(block_size):
    q, keys, values, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens = build_case(block_size)
    scale = HEAD_DIM**-0.5
    out = paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale)
    want = dense_oracle(q, keys, values, [ql for _, ql in SEQUENCES], seq_lens.tolist(), scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    assert_within(out, want, attention_bound(q, keys, values, scale, max(seq_lens.tolist()), torch.float32))


def test_gqa_maps_query_heads_to_kv_heads_in_groups():
    """Query heads 0-2 read kv head 0, heads 3-5 kv head 1: with identical queries the groups agree."""
    q, keys, values, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens = build_case(4, seed=1)
    q = q[:, :1].expand_as(q).contiguous()  # the same query in every head
    out = paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, 0.5)
    torch.testing.assert_close(out[:, 1], out[:, 0], atol=0, rtol=0)
    torch.testing.assert_close(out[:, 5], out[:, 3], atol=0, rtol=0)
    assert (out[:, 3] - out[:, 0]).abs().max() > 1e-2


def test_bfloat16_cache_and_queries():
    q, keys, values, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens = build_case(
        16, seed=2, cache_dtype=torch.bfloat16
    )
    q = q.bfloat16()
    out = paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, HEAD_DIM**-0.5)
    assert out.dtype == torch.bfloat16
    # Oracle on the bf16-rounded K/V the cache actually holds; the op computes in float32, then rounds to bf16.
    want = dense_oracle(
        q, keys.bfloat16(), values.bfloat16(), [ql for _, ql in SEQUENCES], seq_lens.tolist(), HEAD_DIM**-0.5
    )
    compute = attention_bound(q, keys.bfloat16(), values.bfloat16(), HEAD_DIM**-0.5, max(seq_lens.tolist()),
                              torch.float32)
    assert_within(out, want, compute + unit_roundoff(torch.bfloat16) * (want.abs() + compute))


def test_gate_multiplies_by_its_sigmoid_in_the_output_dtype():
    """gate= is exactly torch's `o * torch.sigmoid(gate)` on the ungated bf16 output; attention_output_gate too."""
    q, _, _, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens = build_case(16, seed=4, cache_dtype=torch.bfloat16)
    q = q.bfloat16()
    gate = torch.randn(q.shape[0], NUM_HEADS, 2 * HEAD_DIM).bfloat16()[..., HEAD_DIM:]  # strided, as in the layer
    args = (q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, HEAD_DIM**-0.5)
    plain = paged_attention(*args)
    expected = plain * torch.sigmoid(gate)
    assert torch.equal(paged_attention(*args, gate=gate), expected)
    assert torch.equal(attention_output_gate(plain, gate), expected)
    with pytest.raises(ValueError, match="gate must have dtype"):
        paged_attention(*args, gate=gate.float())
    with pytest.raises(ValueError, match="gate must be"):
        paged_attention(*args, gate=gate[:-1])


def test_write_kv_cache_skips_negative_slots_and_casts():
    k_cache = torch.zeros(3, 4, 2, 5, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(4, 2, 5)
    v = torch.randn(4, 2, 5)
    slot_mapping = torch.tensor([9, -1, 0, -1])  # 9 = block 2, offset 1
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    torch.testing.assert_close(k_cache[2, 1], k[0].bfloat16(), atol=0, rtol=0)
    torch.testing.assert_close(v_cache[0, 0], v[2].bfloat16(), atol=0, rtol=0)
    written = torch.zeros(3, 4, dtype=torch.bool)
    written[2, 1] = written[0, 0] = True
    assert (k_cache[~written] == 0).all() and (v_cache[~written] == 0).all()


def test_write_kv_cache_into_a_non_contiguous_cache():
    """K and V as views of one [num_blocks, 2, ...] buffer (vLLM's layout) are not contiguous; writes must land."""
    combined = torch.zeros(3, 2, 4, 2, 5)  # [num_blocks, k|v, block_size, n_kv, hd]
    k_cache, v_cache = combined[:, 0], combined[:, 1]
    assert not k_cache.is_contiguous()
    k = torch.randn(2, 2, 5)
    write_kv_cache(k, -k, k_cache, v_cache, torch.tensor([5, 11]))
    torch.testing.assert_close(k_cache[1, 1], k[0], atol=0, rtol=0)
    torch.testing.assert_close(v_cache[2, 3], -k[1], atol=0, rtol=0)


def test_bad_inputs_raise_value_errors_naming_the_field():
    q, _, _, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens = build_case(4, seed=3)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache(q[:2, :2], q[:2, :2], k_cache, v_cache, torch.tensor([0, k_cache.shape[0] * 4]))
    with pytest.raises(ValueError, match="q_len"):
        paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, torch.ones_like(seq_lens), 1.0)
    with pytest.raises(ValueError, match="block_tables"):
        paged_attention(q, k_cache, v_cache, block_tables[:, :2], cu_seqlens_q, seq_lens, 1.0)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q[:-1], seq_lens, 1.0)
    with pytest.raises(ValueError, match="kv heads"):
        paged_attention(q[:, :5], k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, 1.0)
