"""SamplingParams validation; the Sampler: greedy, filters, penalties, seeds, min_tokens, logprobs."""

import math
import random
import re

import numpy as np
import pytest
import torch

from deltaserve.sampling import SamplingParams
from deltaserve.worker.sampler import Sampler, make_generator
from tests.tolerance import assert_within, both_sides, gamma

SAMPLER = Sampler()
SIGMAS = 5  # a frequency of n draws lies within 5 binomial standard deviations of its probability
LOG_SOFTMAX_ROUNDINGS = 8  # beyond the V-term sum: the max subtraction, exp (within ~4 ulp), log, subtraction


def frequency_bound(probabilities: torch.Tensor, draws: int) -> torch.Tensor:
    """Elementwise: SIGMAS * sqrt(p (1 - p) / draws), the sampling noise of an empirical frequency."""
    return SIGMAS * (probabilities.double() * (1 - probabilities.double()) / draws).sqrt()


def log_softmax_bound(logits: torch.Tensor) -> float:
    """Two float32 log-softmaxes of the same logits [V]: a V-term sum of exps and a few roundings each, on
    magnitudes up to max |z - max z| + |logsumexp|."""
    magnitude = (logits - logits.max()).abs().max().item() + logits.logsumexp(-1).abs().item()
    one_side = gamma(logits.shape[-1] + LOG_SOFTMAX_ROUNDINGS, torch.float32) * magnitude
    return both_sides(one_side, one_side)


def run(logits, params, generators=None, prompts=None, outputs=None, eos=None):
    """Call the sampler with empty histories and no generators unless given."""
    n = logits.shape[0]
    return SAMPLER(logits, params, generators or [None] * n, prompts or [[] for _ in range(n)],
                   outputs or [[] for _ in range(n)], eos or [set() for _ in range(n)])


# ---- SamplingParams ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1.0), "temperature must be >= 0, got -1.0"),
    (dict(temperature=float("nan")), "temperature must be a finite number, got nan"),
    (dict(temperature=float("inf")), "temperature must be a finite number, got inf"),
    (dict(repetition_penalty=10**400), "repetition_penalty must be a finite number, got 1000"),
    (dict(temperature="hot"), "temperature must be a finite number, got 'hot'"),
    (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
    (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
    (dict(top_k=-2), "top_k must be -1, 0 (disabled) or >= 1, got -2"),
    (dict(top_k=2.5), "top_k must be an integer, got 2.5"),
    (dict(min_p=-0.1), "min_p must be in [0, 1], got -0.1"),
    (dict(min_p=1.1), "min_p must be in [0, 1], got 1.1"),
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5"),
    (dict(frequency_penalty=-3), "frequency_penalty must be in [-2, 2], got -3.0"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0, got 0.0"),
    (dict(n=0), "n must be >= 1, got 0"),
    (dict(n=True), "n must be an integer, got True"),
    (dict(max_tokens=0), "max_tokens must be >= 1 or None, got 0"),
    (dict(max_tokens="16"), "max_tokens must be an integer or None, got '16'"),
    (dict(min_tokens=-1), "min_tokens must be >= 0, got -1"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens must be <= max_tokens (4), got 5"),
    (dict(logprobs=21), "logprobs must be in [0, 20], got 21"),
    (dict(logprobs=-1), "logprobs must be in [0, 20], got -1"),
    (dict(seed=1.5), "seed must be an integer or None, got 1.5"),
    (dict(seed=2**63), f"seed must be in [-2**63, 2**63) (vLLM's range), got {2**63}"),
    (dict(seed=2**64), f"seed must be in [-2**63, 2**63) (vLLM's range), got {2**64}"),
    (dict(seed=-2**63 - 1), f"seed must be in [-2**63, 2**63) (vLLM's range), got {-2**63 - 1}"),
    (dict(stop=""), "stop must be a list of non-empty strings, got ['']"),
    (dict(stop=["a", ""]), "stop must be a list of non-empty strings, got ['a', '']"),
    (dict(stop=5), "stop must be a string, a list of strings or None, got 5"),
    (dict(stop_token_ids=[3, -1]), "stop_token_ids must be a list of integers >= 0, got [3, -1]"),
    (dict(ignore_eos=1), "ignore_eos must be a bool, got 1"),
    (dict(output_kind="delta"), "output_kind must be a RequestOutputKind (CUMULATIVE, DELTA, FINAL_ONLY), got 'delta'"),
])
def test_params_reject_bad_fields(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**kwargs)


def test_params_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.stop, p.logprobs) == \
        (1, 1.0, 1.0, 0, 0.0, 16, [], None)
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b"), stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(max_tokens=None, min_tokens=100, top_k=-1).max_tokens is None
    assert isinstance(SamplingParams(temperature=1).temperature, float)
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy


# ---- greedy and filters --------------------------------------------------------------------------------

def test_greedy_is_argmax_with_lowest_id_on_ties():
    torch.manual_seed(0)
    logits = torch.randn(8, 50)
    logits[3, 7] = logits[3, 30] = logits[3].max() + 1.0  # a tie: the lower id wins, as torch.argmax
    out = run(logits, [SamplingParams(temperature=0.0)] * 8)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.token_ids[3] == 7
    bf16 = run(logits.bfloat16(), [SamplingParams(temperature=0.0)] * 8)
    assert bf16.token_ids == logits.bfloat16().float().argmax(dim=-1).tolist()


def test_greedy_without_logprobs_skips_only_the_logprobs():
    """Greedy rows that ask for no logprobs take the argmax of the logits as given (no float32 copy, no
    softmax): the same tokens as the full path (forced here by one row asking for logprobs), logprobs None."""
    torch.manual_seed(1)
    logits = torch.randn(6, 40).bfloat16()
    logits[2, 5] = logits[2, 9] = logits[2].max() + 1  # a tie
    fast = run(logits, [SamplingParams(temperature=0.0)] * 6)
    full = run(logits, [SamplingParams(temperature=0.0)] * 5 + [SamplingParams(temperature=0.0, logprobs=0)])
    assert fast.token_ids == full.token_ids and fast.token_ids[2] == 5
    assert fast.logprobs == [None] * 6 and all(lp is not None for lp in full.logprobs)
    # a row whose logits a penalty edits keeps the full path
    penalised = run(logits, [SamplingParams(temperature=0.0)] * 5 + [SamplingParams(temperature=0.0,
                                                                                      presence_penalty=2.0)],
                    outputs=[[]] * 5 + [[int(full.token_ids[5])]])
    assert all(lp is not None for lp in penalised.logprobs)


def test_top_k_1_equals_greedy():
    torch.manual_seed(1)
    logits = torch.randn(64, 100) * 3
    out = run(logits, [SamplingParams(temperature=1.5, top_k=1)] * 64)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    with_top_p = run(logits, [SamplingParams(temperature=1.5, top_k=1, top_p=0.9)] * 64)
    assert with_top_p.token_ids == logits.argmax(dim=-1).tolist()


PROBS = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04])


FILTER_CASES = [  # (params, tokens that may be drawn from PROBS)
    (dict(), [0, 1, 2, 3, 4]),
    (dict(top_k=2), [0, 1]),
    (dict(top_k=4), [0, 1, 2, 3]),
    (dict(top_p=0.75), [0, 1, 2]),  # mass before token 3 is 0.9 >= 0.75
    (dict(top_p=0.35), [0]),
    (dict(min_p=0.4), [0, 1, 2]),  # keeps p >= 0.16
    (dict(min_p=0.6), [0, 1]),  # keeps p >= 0.24
    (dict(top_k=3, top_p=0.75), [0, 1]),  # top-p over the top 3 renormalised: mass before token 2 is 0.78
    (dict(top_k=4, min_p=0.25), [0, 1, 2]),  # keeps p >= 0.1
]


def test_filters_sample_only_allowed_tokens_in_proportion():
    # All cases share one batch: rows with different filters must not leak settings into each other.
    torch.manual_seed(2)
    draws = 3000
    params = [SamplingParams(**kwargs) for kwargs, _ in FILTER_CASES for _ in range(draws)]
    out = run(PROBS.log().expand(len(params), -1), params)
    tokens = torch.tensor(out.token_ids).view(len(FILTER_CASES), draws)
    for (kwargs, allowed), row_tokens in zip(FILTER_CASES, tokens):
        counts = torch.bincount(row_tokens, minlength=5).float()
        assert counts.nonzero().flatten().tolist() == allowed, kwargs
        expected = torch.zeros(5)
        expected[allowed] = PROBS[allowed] / PROBS[allowed].sum()
        assert_within(counts / draws, expected, frequency_bound(expected, draws), str(kwargs))


def test_temperature_sharpens_the_distribution():
    torch.manual_seed(3)
    draws = 4000
    out = run(PROBS.log().expand(draws, -1), [SamplingParams(temperature=0.5)] * draws)
    frequency = torch.bincount(torch.tensor(out.token_ids), minlength=5).float() / draws
    expected = PROBS**2 / (PROBS**2).sum()
    assert_within(frequency, expected, frequency_bound(expected, draws), "temperature 0.5")


# ---- penalties, min_tokens, logprobs -------------------------------------------------------------------

def test_penalties_match_hand_computed_logits():
    raw = torch.tensor([1.0, -1.0, 2.0, 0.5, -0.5, 0.0])
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5,
                             presence_penalty=0.25, logprobs=6),
              SamplingParams(temperature=0.0, logprobs=6)]
    out = run(raw.expand(2, -1), params, prompts=[[0, 1], [0, 1]], outputs=[[2, 2, 4], [2, 2, 4]])
    # repetition over prompt+output {0, 1, 2, 4}: 1.0/2, -1.0*2, 2.0/2, -0.5*2
    # then output counts {2: 2, 4: 1}: token 2: 1.0 - (0.5*2 + 0.25); token 4: -1.0 - (0.5*1 + 0.25)
    expected = torch.tensor([0.5, -2.0, -0.25, 0.5, -1.75, 0.0])
    got = dict(out.top_logprobs[0])
    assert_within(torch.tensor([got[t] for t in range(6)]), expected.log_softmax(-1), log_softmax_bound(expected))
    assert out.token_ids[0] == 0  # tie between tokens 0 and 3 after penalties: lowest id
    # The row without penalties shares the batch but keeps its raw logits.
    got = dict(out.top_logprobs[1])
    assert_within(torch.tensor([got[t] for t in range(6)]), raw.log_softmax(-1), log_softmax_bound(raw))
    assert out.token_ids[1] == 2
    # Histories may also come as numpy arrays.
    as_arrays = run(raw.expand(2, -1), params, prompts=[np.array([0, 1])] * 2,
                    outputs=[np.array([2, 2, 4])] * 2)
    assert as_arrays.top_logprobs == out.top_logprobs


def test_min_tokens_blocks_eos_and_stop_ids():
    eos, stop_id = 9, 5
    logits = torch.zeros(4, 10)
    logits[:, eos], logits[:, stop_id], logits[:, 2] = 10.0, 9.0, 1.0
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop_id], logprobs=1)] * 4
    outputs = [[1] * length for length in range(4)]
    out = run(logits, params, outputs=outputs, eos=[{eos}] * 4)
    assert out.token_ids == [2, 2, 2, eos]
    # Logprobs see the masked distribution: token 2 (logit 1) against 7 zeros, EOS and the stop id gone.
    assert out.logprobs[:3] == pytest.approx([1.0 - math.log(math.e + 7)] * 3, abs=1e-5)
    # Sampled rows respect it too.
    sampled = [SamplingParams(min_tokens=3, stop_token_ids=[stop_id])] * 200
    out = run(logits[:1].expand(200, -1), sampled, outputs=[[]] * 200, eos=[{eos}] * 200)
    assert eos not in out.token_ids and stop_id not in out.token_ids
    # With ignore_eos the EOS stops nothing, so (as in vLLM) only the stop ids stay blocked.
    ignoring = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop_id], ignore_eos=True)]
    assert run(logits[:1], ignoring, eos=[{eos}]).token_ids == [eos]


def test_logprobs_are_log_softmax_before_temperature_and_top_sorted():
    torch.manual_seed(4)
    logits = torch.randn(6, 40) * 2
    params = [SamplingParams(temperature=0.7, top_k=5, logprobs=3), SamplingParams(logprobs=0),
              SamplingParams(), SamplingParams(temperature=0.0, logprobs=20),
              SamplingParams(top_p=0.5, logprobs=1), SamplingParams(temperature=0.0)]
    out = run(logits, params)
    reference = logits.log_softmax(dim=-1)
    for row, token in enumerate(out.token_ids):
        assert out.logprobs[row] == pytest.approx(reference[row, token].item(), abs=1e-5)
    assert [t is None for t in out.top_logprobs] == [False, False, True, False, False, True]
    assert out.top_logprobs[1] == []
    for row, count in ((0, 3), (3, 20), (4, 1)):
        top = out.top_logprobs[row]
        values, ids = reference[row].topk(count)
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-5)
        assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))
    assert out.top_logprobs[3][0][0] == out.token_ids[3]  # greedy: the sampled token is the top one


# ---- seeds ---------------------------------------------------------------------------------------------

def test_seeded_rows_do_not_depend_on_the_batch():
    vocab, steps = 1000, 6
    torch.manual_seed(5)
    step_logits = {name: [torch.randn(vocab) for _ in range(steps)] for name in "ABCDE"}
    params = {"A": SamplingParams(seed=7, top_p=0.95), "B": SamplingParams(seed=11, temperature=1.3),
              "C": SamplingParams(), "D": SamplingParams(top_k=50), "E": SamplingParams(seed=7, min_p=0.01)}

    def generate(names, shuffle_seed):
        generators = {n: make_generator(params[n].seed, "cpu") for n in names if params[n].seed is not None}
        outputs = {n: [] for n in names}
        order = list(names)
        for step in range(steps):
            random.Random(shuffle_seed + step).shuffle(order)
            logits = torch.stack([step_logits[n][step] for n in order])
            out = run(logits, [params[n] for n in order], generators=[generators.get(n) for n in order],
                      outputs=[outputs[n] for n in order])
            for n, token in zip(order, out.token_ids):
                outputs[n].append(token)
        return outputs

    alone = {n: generate([n], 0)[n] for n in "ABE"}
    for shuffle_seed in (1, 2):
        batched = generate(list("ABCDE"), shuffle_seed)
        assert {n: batched[n] for n in "ABE"} == alone
    assert alone["A"] != alone["B"]  # different seeds really give different streams


def test_make_generator_accepts_any_int_seed():
    first = torch.rand(4, generator=make_generator(2**70 + 3, "cpu"))
    assert torch.equal(first, torch.rand(4, generator=make_generator(2**70 + 3, "cpu")))
    torch.rand(4, generator=make_generator(-5, "cpu"))


def test_every_seed_in_vllms_range_gets_its_own_torch_seed():
    """The accepted seeds, [-2**63, 2**63), map one to one onto torch's 64-bit seeds: the edges and their
    neighbours all differ (no seed stands in for another, as 2**64 once stood in for 0). (Torch's CPU generator,
    mt19937, then keeps the low 32 bits; CUDA's Philox keeps all 64.)"""
    seeds = [-2**63, -2**63 + 1, -1, 0, 1, 2**63 - 1]
    for seed in seeds:
        SamplingParams(seed=seed)
    torch_seeds = [make_generator(seed, "cpu").initial_seed() for seed in seeds]
    assert torch_seeds == [seed % 2**64 for seed in seeds] and len(set(torch_seeds)) == len(seeds)


def test_sampler_rejects_mismatched_lists():
    with pytest.raises(ValueError, match=r"generators must have one entry per logits row \(2\), got 1"):
        SAMPLER(torch.zeros(2, 5), [SamplingParams()] * 2, [None], [[], []], [[], []], [set(), set()])
