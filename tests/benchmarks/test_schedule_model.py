"""The scheduling cost model (benchmarks/schedule_model.py): a case counted by hand, and W6 as the docs quote it."""

import pytest

from benchmarks import schedule_model
from benchmarks.schedule_model import StepCosts, Traffic, simulate, simulate_staggered


def test_one_client_two_requests_by_hand():
    """One client, two requests of 16 prompt tokens and 3 output tokens: each is a prompt step (its first token)
    and two decode steps of one row, the second request sent when the first finishes."""
    costs = StepCosts()
    result = simulate(Traffic(concurrency=1, prompts=2, input_len=16, output_len=3), costs)
    assert result.steps["prompt"][0] == 2 and result.steps["decode"][0] == 4 and result.steps["mixed"][0] == 0
    expected_ms = 2 * (costs.prompt_fixed_ms + costs.prompt_us * 16 / 1000) + 4 * costs.decode_ms_1
    assert result.seconds * 1000 == pytest.approx(expected_ms)
    assert result.output_tokens == 6


def test_w6_as_the_docs_quote_it(capsys):
    """Concurrency 64: 36 prompt steps and 2,020 decode-only steps, 1,981 tok/s (the H200 runs: 36, 2,023, 1,950-1,955)."""
    plain = simulate(Traffic(), StepCosts())
    assert plain.steps["prompt"][0] == 36 and plain.steps["decode"][0] == 2020
    assert plain.tokens_per_second == pytest.approx(1981, abs=1)
    assert schedule_model.main(["--prompts", "8", "--concurrency", "4", "--input-len", "64", "--output-len", "4"]) == 0
    assert "output tok/s" in capsys.readouterr().out


def test_bad_traffic_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        schedule_model.main(["--concurrency", "0"])
    assert "--concurrency must be at least 1, got 0" in capsys.readouterr().err


def test_staggered_bound_by_hand():
    """Two seats, three requests of 4 prompt tokens and 2 outputs, 4 prompt tokens a step: the first prompt fills
    step 1 (its last chunk samples output 1), step 2 carries its decode and the second prompt, and so on; a
    finished request's seat takes the third prompt at once."""
    costs = StepCosts()
    result = simulate_staggered(Traffic(concurrency=2, prompts=3, input_len=4, output_len=2), costs, chunk_tokens=4)
    # steps: P1 | d1 + P2 (1 finishes) | d2 + P3 (2 finishes) | d3 (3 finishes)
    assert result.steps["mixed"][0] == 3 and result.steps["decode"][0] == 1 and result.steps["prompt"][0] == 0
    chunk_ms = costs.mixed_extra_ms + costs.chunk_us * 4 / 1000
    expected_ms = 3 * costs.decode_ms_1 + 3 * chunk_ms + costs.decode_ms_1
    assert result.seconds * 1000 == pytest.approx(expected_ms)
    assert result.output_tokens == 6


def test_w6_staggered_bound_as_the_docs_quote_it(capsys):
    """docs/performance.md (eighteenth session): 128-token chunks need ~35 us a token for W6's 2,100 tok/s."""
    assert simulate_staggered(Traffic(), StepCosts(chunk_us=30), 128).tokens_per_second == pytest.approx(2152, abs=1)
    assert simulate_staggered(Traffic(), StepCosts(chunk_us=45), 128).tokens_per_second == pytest.approx(2021, abs=1)
    assert simulate_staggered(Traffic(), StepCosts(chunk_us=45), 192).tokens_per_second == pytest.approx(2113, abs=1)
    assert schedule_model.main(["--staggered-chunk-tokens", "64", "--prompts", "8", "--concurrency", "4"]) == 0
    assert "mixed" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        schedule_model.main(["--staggered-chunk-tokens", "-1"])
    assert "--staggered-chunk-tokens must be 0 (none) or more, got -1" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"chunk_tokens must be at least 1 .*got 0"):
        simulate_staggered(Traffic(), StepCosts(), 0)
