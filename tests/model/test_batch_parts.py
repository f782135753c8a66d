"""A batch run in two parts (ForwardBatch.parts: its decoding sequences on the decode kernels, the rest on the
prefill ones, as the CUDA-graph runner's mixed steps do) computes what the same batch computes in one part:
logits, KV cache and both GDN state pools, on every architecture (float32, CPU reference ops)."""

import dataclasses

import pytest
import torch

from deltaserve.config import ModelConfig
from deltaserve.layers.batch import ForwardBatch
from deltaserve.model.loader import load_model
from deltaserve.worker.kv_cache import CacheShape, bind_caches
from tests.model.helpers import BLOCK_SIZE

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def split_decodes(batch: ForwardBatch, num_decodes: int) -> ForwardBatch:
    """`batch` with `parts` set: its first num_decodes sequences (one token each, with cached state) as the decode
    part, the others as the prefill part (what worker/cuda_graph.py builds on its static buffers)."""
    cu = batch.cu_seqlens_q
    decode = ForwardBatch(
        positions=batch.positions[:num_decodes], cu_seqlens_q=cu[:num_decodes + 1],
        seq_lens=batch.seq_lens[:num_decodes], block_tables=batch.block_tables[:num_decodes],
        slot_mapping=batch.slot_mapping[:num_decodes], state_slots=batch.state_slots[:num_decodes],
        has_initial_state=batch.has_initial_state[:num_decodes], logits_indices=cu[:num_decodes],
        max_query_len=1, cu_seqlens_cpu=None, is_decode=True)
    rest_cu = cu[num_decodes:] - num_decodes  # [P+1] offsets within the prefill part's rows
    prefill = ForwardBatch(
        positions=batch.positions[num_decodes:], cu_seqlens_q=rest_cu, seq_lens=batch.seq_lens[num_decodes:],
        block_tables=batch.block_tables[num_decodes:], slot_mapping=batch.slot_mapping[num_decodes:],
        state_slots=batch.state_slots[num_decodes:], has_initial_state=batch.has_initial_state[num_decodes:],
        logits_indices=rest_cu[1:] - 1, max_query_len=batch.max_query_len,
        cu_seqlens_cpu=batch.cu_seqlens_cpu[num_decodes:] - num_decodes, is_decode=False,
        num_computed_cpu=batch.num_computed_cpu[num_decodes:])
    return dataclasses.replace(batch, parts=(decode, prefill))


def cache_tensors(model) -> list[torch.Tensor]:
    """Every tensor a step writes besides its outputs: KV caches and the stacked GDN pools."""
    kv = [t for layer in model.attention_layers for t in (layer.k_cache, layer.v_cache)]
    return kv + [model.conv_states, model.ssm_states]


def test_split_layout():
    batch = split_decodes(ForwardBatch.build([5, 9, 3, 0], [1, 1, 6, 4], [[1, 2], [3, 4, 5], [6, 7, 8], [9]],
                                             [4, 2, 3, 1], BLOCK_SIZE), 2)
    decode, prefill = batch.parts
    assert decode.num_seqs == 2 and decode.is_decode and not prefill.is_decode
    assert decode.cu_seqlens_q.tolist() == [0, 1, 2] and decode.state_slots.tolist() == [4, 2]
    assert prefill.cu_seqlens_q.tolist() == [0, 6, 10] and prefill.cu_seqlens_cpu.tolist() == [0, 6, 10]
    assert prefill.positions.tolist() == [3, 4, 5, 6, 7, 8, 0, 1, 2, 3]
    assert prefill.has_initial_state.tolist() == [True, False] and prefill.num_computed_cpu == (3, 0)
    assert prefill.logits_indices.tolist() == [5, 9] and prefill.max_query_len == 6


def test_two_parts_compute_what_one_part_does(tiny_checkpoint):
    cfg = ModelConfig.from_pretrained(tiny_checkpoint)
    model = load_model(tiny_checkpoint, cfg, torch.float32, "cpu")
    bind_caches(model, CacheShape(num_blocks=64, block_size=BLOCK_SIZE, num_state_slots=8,
                                  kv_dtype=torch.float32, ssm_dtype=torch.float32), "cpu")
    gen = torch.Generator().manual_seed(3)
    vocab = cfg.vocab_size
    # Three sequences prefilled first (slots 1-3), so that they decode from cached KV and state.
    blocks = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15], [16, 17, 18, 19, 20], [21, 22, 23]]
    slots = [1, 2, 3, 4, 5]
    prompt_lens = [7, 11, 5, 6]
    with torch.no_grad():
        first = ForwardBatch.build([0] * 4, prompt_lens, blocks[:4], slots[:4], BLOCK_SIZE)
        model(torch.randint(0, vocab, (sum(prompt_lens),), generator=gen), first)
    # The mixed step: three decodes, then sequence 4's second chunk and a fresh prompt in slot 5.
    computed, lengths = [7, 11, 5, 6, 0], [1, 1, 1, 9, 4]
    ids = torch.randint(0, vocab, (sum(lengths),), generator=gen)
    before = [t.clone() for t in cache_tensors(model)]

    def run(batch):
        for tensor, saved in zip(cache_tensors(model), before):
            tensor.copy_(saved)
        with torch.no_grad():
            logits = model.compute_logits(model(ids, batch))
        return logits, [t.clone() for t in cache_tensors(model)]

    whole = ForwardBatch.build(computed, lengths, blocks, slots, BLOCK_SIZE)
    one_logits, one_caches = run(whole)
    two_logits, two_caches = run(split_decodes(whole, 3))
    torch.testing.assert_close(two_logits, one_logits, atol=1e-4, rtol=1e-4)
    for two, one in zip(two_caches, one_caches):
        torch.testing.assert_close(two, one, atol=1e-5, rtol=1e-5)
    assert not torch.equal(one_caches[-1], before[-1])  # the step did write the recurrent states
