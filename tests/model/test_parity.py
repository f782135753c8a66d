"""Our model against transformers on tiny random checkpoints of all three architectures (float32, CPU).

Bound: max |ours - transformers| <= 1e-4 * max |transformers logit|. Both run the same float32 math in a
different order (chunked vs. token-level recurrences, paged vs. dense attention), which differs by ~1e-6
relative; a wrong layout, norm or gate differs by orders of magnitude more.
"""

import pytest
import torch

from tests.model.helpers import SequenceRunner, load_pair, reference_logits

ARCHS = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
REL_TOL = 1e-4


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    scale = ref.abs().max().item()
    err = (ours - ref).abs().max().item()
    assert err <= REL_TOL * scale, f"max abs diff {err:.3g} > {REL_TOL} x logit scale {scale:.3g}"


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
    assert_close(runner.step({1: ids})[1], reference_logits(ref, ids))


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
    assert_close(torch.cat(got), expected)


def test_varlen_batch_matches_each_sequence_alone(pair):
    ours, ref = pair
    lengths = {1: 5, 3: 70, 4: 1, 6: 18}
    prompts = {slot: prompt(n, 10 + slot, ours.config.vocab_size) for slot, n in lengths.items()}
    runner = SequenceRunner(ours)
    for slot in prompts:
        runner.add(slot)
    first = runner.step({slot: ids[:-2] or ids for slot, ids in prompts.items() if len(ids) > 2})
    for slot, ids in prompts.items():
        if len(ids) > 2:
            assert_close(first[slot], reference_logits(ref, ids)[:-2])
    # a mixed step: two prefill tails of length 2 beside fresh sequences (decode-like rows)
    mixed = runner.step({slot: ids[-2:] if len(ids) > 2 else ids for slot, ids in prompts.items()})
    for slot, ids in prompts.items():
        expected = reference_logits(ref, ids)
        assert_close(mixed[slot], expected[-2:] if len(ids) > 2 else expected)
    # one decode step with every sequence at once
    extra = {slot: [7 + slot] for slot in prompts}
    decode = runner.step(extra)
    for slot, ids in prompts.items():
        assert_close(decode[slot], reference_logits(ref, ids + extra[slot])[-1:])
