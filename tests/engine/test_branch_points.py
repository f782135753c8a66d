"""Hits at branch points, scheduler level (no model): block size 16 and the default 64-token decode-checkpoint
stride, as served.

When prompts branch off a shared prefix, the state at the last block boundary before the branch point is
checkpointed by the first prompt that finds the branch, so that every later prompt sharing the prefix past that
boundary hits it: a prompt sharing n tokens with a prompt that another one left at d <= n (inside a full block
of the first one's prompt) hits floor(d / 16) * 16. A conversation's next turn, whose cached chain ends where
the previous turn ended (tests/engine/test_scheduler.py checks it takes one step) or parts from the previous
turn's output, gets no such checkpoint.
tests/engine/test_prefix_cache.py runs the same branches on a model, with caching on against off.
"""

import pytest

from deltaserve.cache.cache_manager import DECODE_CHECKPOINT_INTERVAL
from tests.engine.test_scheduler import assert_only_cache_entries_left, make_request, make_scheduler, run_to_end

BS = 16
DEPTHS = [17, 33, 50, 95, 130]  # one, two and three blocks in (under one stride), past a stride, past two


def scheduler():
    return make_scheduler(num_blocks=256, block_size=BS, budget=1024, max_num_seqs=8, checkpoints=16,
                          decode_checkpoint_interval=DECODE_CHECKPOINT_INTERVAL)


def branch(base, n, tail, mark):
    """base[:n] then `tail` tokens of its own (from `mark`, far from base's values): differs from base at n."""
    return base[:n] + list(range(mark, mark + tail))


def run(sched, *requests):
    """Add the requests together and run until all of them are done."""
    for request in requests:
        sched.add_request(request)
    return run_to_end(sched)


BASE = list(range(1, 161))  # prompt end checkpoint at 144: past every depth below but 130's 128


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("order", ["sequential", "concurrent"])
def test_a_prompt_sharing_more_than_a_branch_point_hits_the_last_boundary_before_it(depth, order):
    """A and B share `depth` tokens; C shares depth + 10 with A (past the branch point, inside the same block).
    Sequential: B finds A's cached block that differs from its own and saves the state at the boundary before
    it. Concurrent (A and B in one step): B finds the branch on A's prompt being computed beside it."""
    sched = scheduler()
    a = make_request("a", 0, max_tokens=1, prompt=BASE)
    b = make_request("b", 0, max_tokens=1, prompt=branch(BASE, depth, 40, 1000))
    if order == "sequential":
        run(sched, a)
        run(sched, b)
    else:
        first = run(sched, a, b)[0]  # both admitted in one step; b cut at the branch point to save it there
        assert [(r.request_id, len(r.token_ids)) for r in first.sequences] == [("a", 160), ("b", depth // BS * BS)]
    c = make_request("c", 0, max_tokens=1, prompt=branch(BASE, depth + 10, 8, 2000))
    run(sched, c)
    point = depth // BS * BS
    assert (a.num_cached_tokens, b.num_cached_tokens, c.num_cached_tokens) == (0, 0, point)
    assert_only_cache_entries_left(sched)


@pytest.mark.parametrize("depth", DEPTHS)
def test_branches_arriving_together_save_the_branch_point_once(depth):
    """After A, B and C (each sharing `depth` tokens with A, with tails of their own) arrive together: both find
    the branch, B cuts its chunk there and saves it, C computes its prompt in one step; D hits it."""
    sched = scheduler()
    run(sched, make_request("a", 0, max_tokens=1, prompt=BASE))
    b = make_request("b", 0, max_tokens=1, prompt=branch(BASE, depth, 40, 1000))
    c = make_request("c", 0, max_tokens=1, prompt=branch(BASE, depth, 30, 2000))
    first = run(sched, b, c)[0]
    point = depth // BS * BS
    assert (b.num_cached_tokens, c.num_cached_tokens) == (0, 0)
    assert {r.request_id: len(r.token_ids) for r in first.sequences} == {"b": point, "c": c.num_prompt_tokens}
    d = make_request("d", 0, max_tokens=1, prompt=branch(BASE, depth + 5, 8, 3000))
    run(sched, d)
    assert d.num_cached_tokens == point
    assert_only_cache_entries_left(sched)


@pytest.mark.parametrize("order", ["sequential", "concurrent"])
def test_branches_of_branches_hit_the_deepest_branch_point_they_pass(order):
    """A tree: B branches off A at 50, C off B at 95, D off C at 130, E off C at 100. Each later prompt hits
    the deepest branch point's boundary at or below where it leaves the tree. Concurrent: B and C, then D
    and E, arrive in pairs (each pair computed in one step)."""
    sched = scheduler()
    a = make_request("a", 0, max_tokens=1, prompt=BASE)
    b = make_request("b", 0, max_tokens=1, prompt=branch(BASE, 50, 90, 1000))  # 140 tokens
    c = make_request("c", 0, max_tokens=1, prompt=branch(b.prompt_token_ids, 95, 50, 2000))  # 145
    d = make_request("d", 0, max_tokens=1, prompt=branch(c.prompt_token_ids, 130, 20, 3000))
    e = make_request("e", 0, max_tokens=1, prompt=branch(c.prompt_token_ids, 100, 20, 4000))
    run(sched, a)
    if order == "sequential":
        for request in (b, c, d, e):
            run(sched, request)
        # b: A's block 3 differs (saves 48); c: B's block 5 (hits 48, saves 80); d: C's block 8 (hits 80,
        # C's prompt end is 144 > 128: saves 128); e: C's block 6 (hits 80, saves 96)
        assert [r.num_cached_tokens for r in (b, c, d, e)] == [0, 48, 80, 80]
    else:
        run(sched, b, c)  # b finds the branch at 48 on A; c the one at 80 on b's prompt beside it
        run(sched, d, e)  # both hit 80; d saves 128, e 96 (both branch off C's cached blocks)
        assert [r.num_cached_tokens for r in (b, c, d, e)] == [0, 0, 80, 80]
    expected = {"a": (60, 48), "b": (97, 80), "c": (101, 96), "d": (135, 128)}
    for i, (owner, (shared, hit)) in enumerate(expected.items()):
        source = {"a": a, "b": b, "c": c, "d": d}[owner].prompt_token_ids
        later = make_request(f"later{i}", 0, max_tokens=1, prompt=branch(source, shared, 12, 5000 + 100 * i))
        run(sched, later)
        assert later.num_cached_tokens == hit, owner
    assert_only_cache_entries_left(sched)


def test_a_prompt_parting_from_an_earlier_output_is_no_branch_point():
    """A conversation's next turn that parts from the previous turn's output (the chat template strips its
    reasoning, or its text re-tokenizes differently), here inside A's output block [48, 64): no chunk cut for a
    checkpoint that no later turn would hit (the next one hits this turn's prompt end). It starts at A's
    prompt-end checkpoint and prefills to its end in one step."""
    sched = scheduler()
    a = make_request("a", 0, max_tokens=40, prompt=BASE[:40])  # samples token 7 forty times
    run(sched, a)
    b = make_request("b", 0, max_tokens=1, prompt=BASE[:40] + [7] * 20 + list(range(1000, 1100)))
    prompt_steps = [s for s in run(sched, b) if len(s.sequences[0].token_ids) > 1]
    assert b.num_cached_tokens == 32  # A's prompt end, floor(39 / 16) * 16
    assert [(s.sequences[0].num_computed, len(s.sequences[0].token_ids)) for s in prompt_steps] == [(32, 128)]
    assert_only_cache_entries_left(sched)


def test_a_long_cached_chain_without_a_branch_or_a_checkpoint_gets_one_at_its_end():
    """Nothing known continues A's cached chain (160 tokens), but it lies an interval or more past the hit (its
    checkpoint was evicted): B, continuing it, cuts its chunk there and saves it; C, continuing it too, hits it."""
    sched = scheduler()
    a = make_request("a", 0, max_tokens=1, prompt=BASE)
    run(sched, a)
    sched.cache.prefix_cache.drop(a.block_hashes[144 // BS - 1])  # A's prompt-end checkpoint, evicted
    b = make_request("b", 0, max_tokens=1, prompt=BASE + list(range(1000, 1020)))
    first = run(sched, b)[0]
    assert b.num_cached_tokens == 0 and len(first.sequences[0].token_ids) == 160
    c = make_request("c", 0, max_tokens=1, prompt=BASE + list(range(2000, 2020)))
    run(sched, c)
    assert c.num_cached_tokens == 160
    assert_only_cache_entries_left(sched)
