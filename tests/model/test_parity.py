"""Our model against transformers on tiny random checkpoints of all three architectures (float32, CPU).

Truth is transformers in float64. Bound: max |ours - truth| <= max(1e-4 * logit scale, 4 * max |transformers
float32 - truth|). Our float32 math runs in another order than transformers' (chunked vs. token-level
recurrences, paged vs. dense attention); we may stray from the truth as far as transformers' own float32 run
does, times four, but no further. Measured: dense ~1e-6 relative; the tiny MoE checkpoints amplify float32
rounding to ~3e-4 relative in transformers itself (the chunked delta rule is
ill-conditioned there), and ours lands within 0.5x-3.2x of that. A wrong layout, norm or gate is off by orders of magnitude more.
"""

import pytest
import torch

from tests.model.helpers import SequenceRunner, load_pair

ARCHS = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
REL_TOL = 1e-4
FP32_FLOOR_FACTOR = 4


def assert_close(ours: torch.Tensor, ref: tuple[torch.Tensor, torch.Tensor]) -> None:
    truth, fp32 = ref
    scale = truth.abs().max().item()
    bound = max(REL_TOL * scale, FP32_FLOOR_FACTOR * (fp32 - truth).abs().max().item())
    err = (ours.double() - truth).abs().max().item()
    assert err <= bound, f"max abs diff {err:.3g} > bound {bound:.3g} (logit scale {scale:.3g})"


def reference_logits(ref, ids, rows=slice(None)):
    truth, fp32 = ref.logits(ids)
    return truth[rows], fp32[rows]


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
    assert_close(got, reference_logits(ref, ids))


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
            assert_close(first[slot], reference_logits(ref, ids, slice(None, -2)))
    # a mixed step: two prefill tails of length 2 beside fresh sequences (decode-like rows)
    mixed = runner.step({slot: ids[-2:] if len(ids) > 2 else ids for slot, ids in prompts.items()})
    for slot, ids in prompts.items():
        expected = reference_logits(ref, ids)
        assert_close(mixed[slot], (expected[0][-2:], expected[1][-2:]) if len(ids) > 2 else expected)
    # one decode step with every sequence at once
    extra = {slot: [7 + slot] for slot in prompts}
    decode = runner.step(extra)
    for slot, ids in prompts.items():
        assert_close(decode[slot], reference_logits(ref, ids + extra[slot], slice(-1, None)))
