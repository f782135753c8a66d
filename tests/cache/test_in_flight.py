"""The index of prompts being computed (cache/in_flight.py) without a scheduler."""

from deltaserve.cache.in_flight import InFlightPrompts
from deltaserve.cache.prefix_cache import extend_block_hashes
from deltaserve.request import Request
from deltaserve.sampling import SamplingParams

BS = 4
SEED = b"seed"


def started(prompt, outputs=()):
    """A request with `outputs` already sampled (a preempted one starting again), its full blocks hashed."""
    request = Request(f"r{prompt[0]}", prompt, SamplingParams(max_tokens=8), 8, set())
    for token in outputs:
        request.append_token(token)
    extend_block_hashes(request.block_hashes, request.all_token_ids, BS, SEED)
    return request


def test_prompt_blocks_their_parents_and_checkpoints_to_save_are_indexed_until_the_request_stops():
    index = InFlightPrompts(BS, SEED)
    a = started(list(range(1, 11)), outputs=[7] * 6)  # 2 full prompt blocks; blocks 2 and 3 hold outputs
    h = a.block_hashes
    index.add(a, 0, [h[1]])
    assert [index.has_block(x) for x in h] == [True, True, False, False]  # outputs are no prompt's branch
    assert index.has_child(SEED) and index.has_child(h[0]) and not index.has_child(h[1])
    assert index.is_to_be_saved(h[1], 8) and not index.is_to_be_saved(h[0], 4)
    a.num_computed_tokens = 8
    assert not index.is_to_be_saved(h[1], 8)  # computed past it: saved already, or not at all
    b = started(list(range(1, 9)) + [50, 51])  # shares a's two prompt blocks, starts at its hit after block 0
    index.add(b, 1, [])
    index.remove(a)  # what is left is b's: nothing before its hit
    assert [index.has_block(x) for x in h] == [False, True, False, False] and not index.has_child(SEED)
    assert index.has_child(h[0]) and not index.is_to_be_saved(h[1], 8) and len(index) == 1
    index.remove(b)
    index.remove(b)  # ignored: not indexed any more
    assert not index.has_block(h[1]) and not index.has_child(h[0]) and len(index) == 0
