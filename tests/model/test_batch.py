"""ForwardBatch.build: the flattened per-step tensors and the host-side facts the layers choose paths by."""

import torch

from deltaserve.layers.batch import ForwardBatch


def test_build_flattens_sequences_and_records_host_facts():
    batch = ForwardBatch.build(num_computed=[0, 20], query_lens=[3, 2], block_ids=[[4], [1, 2]], state_slots=[5, 6],
                               block_size=16)
    assert batch.positions.tolist() == [0, 1, 2, 20, 21]
    assert batch.cu_seqlens_q.tolist() == [0, 3, 5] and batch.cu_seqlens_cpu.tolist() == [0, 3, 5]
    assert batch.seq_lens.tolist() == [3, 22]
    assert batch.slot_mapping.tolist() == [64, 65, 66, 2 * 16 + 4, 2 * 16 + 5]  # block 4; then block 2, offsets 4-5
    assert batch.logits_indices.tolist() == [2, 4] and batch.has_initial_state.tolist() == [False, True]
    assert (batch.max_query_len, batch.is_decode, batch.num_computed_cpu) == (3, False, (0, 20))
    assert not batch.prefix_free
    fresh = ForwardBatch.build([0, 0], [4, 1], [[1], [2]], [1, 2], 16)
    assert fresh.prefix_free and not fresh.is_decode  # a one-token first step still takes the prefill path
    decode = ForwardBatch.build([7, 9], [1, 1], [[1], [2]], [1, 2], 16)
    assert decode.is_decode and not decode.prefix_free and decode.max_query_len == 1
    graph_batch = ForwardBatch(decode.positions, decode.cu_seqlens_q, decode.seq_lens, decode.block_tables,
                               decode.slot_mapping, decode.state_slots, decode.has_initial_state,
                               decode.logits_indices, 1, None, True)
    assert not graph_batch.prefix_free  # unknown (no host copy): never claimed
    assert torch.equal(batch.block_tables, torch.tensor([[4, 0], [1, 2]], dtype=torch.int32))
