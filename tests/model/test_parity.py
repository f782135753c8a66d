"""Our model against transformers on tiny random checkpoints of all three architectures (float32, CPU).

Truth is transformers in float64. Bound: tests.model.helpers.model_bound, derived from the config and the
sequence length (the depth and the reduction chain of each layer, tests/tolerance.py), relative to the
largest truth logit. A wrong layout, norm, gate or cache position is off by 1e-2 of the logit scale or more.
"""

import pytest
import torch

from tests.model.helpers import SequenceRunner, assert_paths_agree, load_pair, model_bound
from tests.tolerance import assert_within

ARCHS = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]


def assert_close(ours: torch.Tensor, truth: torch.Tensor, cfg, seq_len: int) -> None:
    """ours within the derived float32 bound of truth, for sequences of up to seq_len tokens."""
    assert_within(ours, truth, model_bound(cfg, seq_len, truth.abs().max().item()), "logits vs transformers")


def reference_logits(ref, ids, rows=slice(None)):
    return ref.logits(ids)[rows]


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, make_checkpoint):
    return load_pair(make_checkpoint(request.param))


def test_full_prompt_logits_match_transformers(pair):
    ours, ref = pair
    ids = prompt(37, 0, ours.config.vocab_size)
    runner = SequenceRunner(ours)
    runner.add(1)
    assert_close(runner.step({1: ids})[1], reference_logits(ref, ids), ours.config, len(ids))


def test_chunked_prefill_then_decode_matches_full_forward(pair):
    ours, ref = pair
    ids = prompt(75, 1, ours.config.vocab_size)
    expected = reference_logits(ref, ids)
    runner = SequenceRunner(ours)
    runner.add(2)
    got, start = [], 0
    for size in [10, 1, 64 - 11, 3]:  # chunks cross the GDN chunk (64) and KV block boundaries
        got.append(runner.step({2: ids[start:start + size]})[2])
        start += size
    while start < len(ids):  # the rest one token at a time (the decode path)
        got.append(runner.step({2: ids[start:start + 1]})[2])
        start += 1
    assert_close(torch.cat(got), expected, ours.config, len(ids))


def test_token_by_token_from_a_reused_slot(pair):
    """A sequence whose first step has one token must start from zero state, not the slot's old contents."""
    ours, ref = pair
    used = prompt(20, 3, ours.config.vocab_size)
    ids = prompt(9, 4, ours.config.vocab_size)
    runner = SequenceRunner(ours)
    runner.add(5)
    runner.step({5: used})  # leaves state behind in slot 5
    runner.add(5)
    got = torch.cat([runner.step({5: [token]})[5] for token in ids])
    assert_close(got, reference_logits(ref, ids), ours.config, len(ids))


def test_varlen_batch_matches_each_sequence_alone(pair):
    """Sequences of several lengths in one step, then a mixed step (two prompt tails of length 2 beside fresh
    sequences, decode-like rows), then a decode step of all: each sequence's logits equal those of the same
    chunks run alone, within both runs' float32 bounds. Against itself rather than transformers: where a GDN
    head's output cancels (a small S^T q) its gated RMS norm scales that head's rounding up, by a factor the
    stack bound does not model, and how large that rounding is depends on the CPU's matmul kernels (an AVX2
    machine put one such token 18% over the bound against the float64 truth); a batching fault (another slot's
    state, block or position) moves the logits by the logit scale's percent or more."""
    ours, _ = pair
    lengths = {1: 5, 3: 70, 4: 1, 6: 18}
    prompts = {slot: prompt(n, 10 + slot, ours.config.vocab_size) for slot, n in lengths.items()}
    extra = {slot: [7 + slot] for slot in prompts}
    # each step's chunk per sequence: the prompt less its last 2 tokens, those 2 (or a short prompt whole), a decode
    chunks = [{slot: ids[:-2] for slot, ids in prompts.items() if len(ids) > 2},
              {slot: ids[-2:] if len(ids) > 2 else ids for slot, ids in prompts.items()}, extra]
    batched = SequenceRunner(ours)
    for slot in prompts:
        batched.add(slot)
    got = [batched.step(step) for step in chunks]
    for slot, ids in prompts.items():
        alone = SequenceRunner(ours)
        alone.add(slot)
        for step, step_got in zip(chunks, got):
            if slot in step:
                want = alone.step({slot: step[slot]})[slot]
                assert_paths_agree(step_got[slot], want,
                                   lambda magnitude: model_bound(ours.config, len(ids) + 1, magnitude),
                                   f"sequence {slot}: batched vs alone")
