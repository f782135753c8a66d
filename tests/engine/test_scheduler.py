"""The scheduler driven with hand-built model outputs: no model, no tensors.

The prefix-caching tests at the end check where chunks are cut, which state copies a step asks for, and which
prefix a request starts from; tests/engine/test_prefix_cache.py checks that the outputs are exact.
"""

import pytest

from deltaserve.cache.block_pool import BlockPool
from deltaserve.cache.cache_manager import CacheManager
from deltaserve.cache.prefix_cache import PrefixCache
from deltaserve.cache.state_pool import StatePool
from deltaserve.engine.scheduler import Scheduler
from deltaserve.request import Request, RequestStatus
from deltaserve.sampling import SamplingParams
from deltaserve.sched_output import ModelOutput

EOS = 99


def make_scheduler(num_blocks=64, block_size=4, slots=8, max_num_seqs=4, budget=16, max_model_len=1000,
                   checkpoints=None, decode_checkpoint_interval=None):
    """checkpoints None: prefix caching off; else its checkpoint slot budget. Decode checkpoints at every block
    boundary unless decode_checkpoint_interval says otherwise."""
    blocks, states = BlockPool(num_blocks, block_size), StatePool(slots, checkpoints or 0)
    prefix = None if checkpoints is None else PrefixCache(blocks, states, "test-model")
    cache = CacheManager(blocks, states, prefix, decode_checkpoint_interval or block_size)
    return Scheduler(cache, max_num_seqs, budget, max_model_len)


def make_request(rid, prompt_len, max_tokens=4, prompt=None, group=None):
    prompt = list(range(1, prompt_len + 1)) if prompt is None else prompt
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), max_tokens, {EOS}, group=group)


def fake_step(sched, token=7):
    """One step: every row that asks to sample gets `token`. Returns (scheduled rows, updated requests)."""
    out = sched.schedule()
    sampled = {row.request_id: token for row in out.sequences if row.sample}
    updated = sched.update_from_output(out, ModelOutput(sampled, {}, {}))
    return out, updated


def assert_pools_empty(sched):
    pool = sched.cache.block_pool
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert sched.cache.state_pool.num_free_slots == sched.cache.state_pool.num_slots - 1


def test_token_budget_chunks_prefill_and_mixes_decode():
    sched = make_scheduler(budget=10)
    sched.add_request(make_request("a", 4))
    sched.add_request(make_request("b", 25))
    out, _ = fake_step(sched)
    assert [(r.request_id, len(r.token_ids), r.sample) for r in out.sequences] == [("a", 4, True), ("b", 6, False)]
    out, _ = fake_step(sched)  # a decodes one token, b gets the rest of the budget
    assert [(r.request_id, len(r.token_ids), r.num_computed) for r in out.sequences] == [("a", 1, 4), ("b", 9, 6)]
    assert out.num_tokens <= 10
    out, _ = fake_step(sched)
    assert [(r.request_id, len(r.token_ids), r.sample) for r in out.sequences] == [("a", 1, True), ("b", 9, False)]
    out, _ = fake_step(sched)
    assert [(r.request_id, len(r.token_ids), r.sample) for r in out.sequences] == [("a", 1, True), ("b", 1, True)]


def test_max_num_seqs_and_fcfs_order():
    sched = make_scheduler(max_num_seqs=2, budget=100)
    for rid in "abc":
        sched.add_request(make_request(rid, 3, max_tokens=2))
    out, _ = fake_step(sched)
    assert [r.request_id for r in out.sequences] == ["a", "b"]
    fake_step(sched)  # a and b finish (max_tokens 2)
    assert sched.num_running == 0 and sched.num_waiting == 1
    out, _ = fake_step(sched)
    assert [r.request_id for r in out.sequences] == ["c"]


def test_a_request_behind_another_clients_many_sequences_gets_the_first_free_seat():
    """Client a's one request runs 12 sequences (group "a") on 4 seats; b arrives behind a's 8 waiting ones.
    The first seat to free goes to b, not to a#4: b waits for one of a's sequences, not for all of them (in
    arrival order it would have waited for a#4-a#11, two more generations of a). a's sequences still all run."""
    sched = make_scheduler(max_num_seqs=4, budget=100)
    for i in range(12):
        sched.add_request(make_request(f"a#{i}", 3, max_tokens=1 if i == 0 else 5, group="a"))
    out, _ = fake_step(sched)
    assert [r.request_id for r in out.sequences] == ["a#0", "a#1", "a#2", "a#3"]  # a#0 is done after this step
    sched.add_request(make_request("b", 3, max_tokens=2))
    out, _ = fake_step(sched)
    assert [r.request_id for r in out.sequences] == ["a#1", "a#2", "a#3", "b"]
    admitted = ["a#0", "a#1", "a#2", "a#3", "b"]
    while sched.has_unfinished():
        out, _ = fake_step(sched)
        admitted += [r.request_id for r in out.sequences if r.request_id not in admitted]
    assert admitted[5:] == [f"a#{i}" for i in range(4, 12)]  # in their own order
    assert_pools_empty(sched)


def test_groups_take_turns_and_go_in_arrival_order_when_as_many_run():
    """Two clients' requests of 3 sequences each on 4 seats: admitted a, b, a, b (in arrival order where both
    run as many); requests of one sequence each (every group alone) stay first come, first served."""
    sched = make_scheduler(max_num_seqs=4, budget=100)
    for name in "ab":
        for i in range(3):
            sched.add_request(make_request(f"{name}#{i}", 3, group=name))
    out, _ = fake_step(sched)
    assert [r.request_id for r in out.sequences] == ["a#0", "b#0", "a#1", "b#1"]
    single = make_scheduler(max_num_seqs=2, budget=100)
    for rid in "xyz":
        single.add_request(make_request(rid, 3))
    out, _ = fake_step(single)
    assert [r.request_id for r in out.sequences] == ["x", "y"]


def test_finishes_on_max_tokens_eos_stop_ids_and_max_model_len():
    sched = make_scheduler(budget=100, max_model_len=6)
    sched.add_request(make_request("len", 3, max_tokens=10))
    fake_step(sched)
    fake_step(sched)
    _, updated = fake_step(sched)  # tokens: 3 prompt + 3 output = max_model_len 6
    assert updated[0].status == RequestStatus.FINISHED_LENGTH and updated[0].num_output_tokens == 3
    sched = make_scheduler(budget=100)
    sched.add_request(make_request("eos", 3, max_tokens=10))
    _, updated = fake_step(sched, token=EOS)
    assert updated[0].status == RequestStatus.FINISHED_STOPPED and updated[0].stop_reason is None
    req = Request("stopid", [1, 2], SamplingParams(max_tokens=10, stop_token_ids=[5], min_tokens=2), 10, {EOS})
    sched.add_request(req)
    _, updated = fake_step(sched, token=5)
    assert updated[0].status == RequestStatus.RUNNING  # min_tokens not reached yet
    _, updated = fake_step(sched, token=5)
    assert updated[0].status == RequestStatus.FINISHED_STOPPED and updated[0].stop_reason == 5
    assert_pools_empty(sched)


def test_preemption_frees_the_newest_and_resumes_it_from_scratch():
    # 6 usable blocks of 4 tokens: two 8-token prompts fill 4 blocks; growth forces a preemption.
    sched = make_scheduler(num_blocks=7, block_size=4, budget=100)
    a, b = make_request("a", 8, max_tokens=12), make_request("b", 8, max_tokens=12)
    sched.add_request(a)
    sched.add_request(b)
    fake_step(sched)  # prefill both (8 tokens, 2 blocks each), each samples a 9th token
    for _ in range(4):  # tokens 9..12 fit in a third block each: all 6 blocks in use
        fake_step(sched)
    assert b.status == RequestStatus.RUNNING and b.num_computed_tokens == 12
    fake_step(sched)  # a needs a fourth block: b (newest) is preempted
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.block_ids == []
    assert b.num_preemptions == 1 and sched.waiting[0] is b
    assert sched.num_preemptions == 1
    b_tokens = list(b.all_token_ids)
    while a.status == RequestStatus.RUNNING:
        fake_step(sched)
    out, _ = fake_step(sched)  # b is recomputed: prompt + its output so far, then sampled again
    row = out.sequences[0]
    assert row.request_id == "b" and row.token_ids == b_tokens and row.sample
    while sched.has_unfinished():
        fake_step(sched)
    assert b.num_output_tokens == 12
    assert_pools_empty(sched)


def test_preemption_takes_from_the_request_with_the_most_sequences_first():
    """Client a's request runs two sequences, client b's one, admitted after them (the newest). When the pool runs
    out, a's newest sequence gives up its blocks, not b's: one client's fan-out cannot push another client's
    request out of the cache (newest-first alone would preempt b, and again each time it came back)."""
    sched = make_scheduler(num_blocks=10, block_size=4, budget=100)  # 9 usable blocks of 4 tokens
    a0, a1 = (make_request(f"a#{i}", 8, max_tokens=20, group="a") for i in range(2))
    b = make_request("b", 8, max_tokens=20)
    sched.add_request(a0)
    sched.add_request(a1)
    fake_step(sched)
    sched.add_request(b)
    while not any(r.num_preemptions for r in (a0, a1, b)):
        fake_step(sched)
    assert a1.num_preemptions == 1 and b.status == RequestStatus.RUNNING and a0.status == RequestStatus.RUNNING
    while sched.has_unfinished():
        fake_step(sched)
    assert [r.num_output_tokens for r in (a0, a1, b)] == [20, 20, 20]
    assert_pools_empty(sched)


def test_a_request_alone_that_cannot_grow_preempts_itself_without_losing_tokens():
    sched = make_scheduler(num_blocks=3, block_size=4, budget=100)  # 2 usable blocks: 8 tokens
    req = make_request("a", 8, max_tokens=3)
    sched.add_request(req)
    fake_step(sched)  # prefill 8 tokens, sample one: 9 tokens need a third block
    out = sched.schedule()
    assert out.is_empty and req.status == RequestStatus.PREEMPTED and req.num_output_tokens == 1


def test_abort_at_each_stage_frees_everything():
    sched = make_scheduler(budget=5)
    for rid in ["decoding", "prefilling", "waiting"]:
        sched.add_request(make_request(rid, 4 if rid == "decoding" else 9, max_tokens=50))
    fake_step(sched)
    fake_step(sched)
    assert sched.requests["waiting"].status == RequestStatus.WAITING
    sched.abort_request("waiting")
    by_id = dict(sched.requests)
    assert by_id["prefilling"].num_computed_tokens < 9 and by_id["decoding"].num_output_tokens >= 1
    out = sched.schedule()
    sched.abort_request("prefilling")  # aborted while its step is in flight
    updated = sched.update_from_output(out, ModelOutput({r.request_id: 7 for r in out.sequences}, {}, {}))
    assert [r.request_id for r in updated] == ["decoding"]
    sched.abort_request("decoding")
    sched.abort_request("unknown")  # ignored
    assert not sched.has_unfinished()
    assert_pools_empty(sched)


def test_duplicate_request_id_is_refused():
    sched = make_scheduler()
    sched.add_request(make_request("x", 2))
    with pytest.raises(ValueError, match="'x' is already in use"):
        sched.add_request(make_request("x", 2))


# -- prefix caching ----------------------------------------------------------------------------------------

def run_to_end(sched):
    steps = []
    while sched.has_unfinished():
        steps.append(fake_step(sched)[0])
    return steps


def assert_only_cache_entries_left(sched):
    """No request holds anything; what the cache keeps can all be evicted."""
    assert_pools_empty(sched)  # cached-free blocks count as free
    states = sched.cache.state_pool
    prefix = sched.cache.prefix_cache
    assert prefix.num_checkpoints + states.num_free_checkpoint_slots == states.num_checkpoint_slots
    assert len(sched.cache.in_flight) == 0  # every request that started was taken out of it
    for i in range(states.num_checkpoint_slots):  # every checkpoint slot can be taken back
        assert prefix.reserve(bytes([i]) * 16) is not None
    pool = sched.cache.block_pool
    assert sorted(pool.allocate(pool.num_usable_blocks)) == list(range(1, pool.num_blocks))


def test_prompt_end_is_checkpointed_inside_its_step_and_a_resend_starts_there():
    sched = make_scheduler(checkpoints=8)
    a = make_request("a", 10, max_tokens=1)
    sched.add_request(a)
    out, _ = fake_step(sched)
    row = out.sequences[0]
    pool = sched.cache.block_pool
    a_blocks = [pool.cached_block(h) for h in a.block_hashes[:2]]  # a finished: its full blocks stay cached
    # floor((10-1)/4)*4 = 8: the state after 8 tokens goes to checkpoint slot 8 inside the step (slots 1-7 work,
    # 8-15 cache); cutting the chunk there would cost the 2-token tail a step of its own
    assert (len(row.token_ids), row.sample, row.mid_save) == (10, True, (8, 8))
    assert out.state_saves == [] and out.state_restores == [] and a.status.finished
    b = make_request("b", 10, max_tokens=1)
    sched.add_request(b)
    out, _ = fake_step(sched)
    row = out.sequences[0]
    assert (row.num_computed, row.token_ids, b.num_cached_tokens, row.mid_save) == (8, [9, 10], 8, None)
    assert out.state_restores == [(8, row.state_slot)] and out.state_saves == []
    assert row.block_ids[:2] == a_blocks[:2]  # shares a's two cached blocks
    prefix = sched.cache.prefix_cache
    assert (prefix.queries, prefix.hits) == (20, 8)
    assert_only_cache_entries_left(sched)


def test_a_step_can_save_inside_and_at_its_end():
    """A prompt of whole blocks: its prompt-end checkpoint (one block before its end) is saved inside the step,
    and its end, a block boundary past the prompt's last one, gets the request's decode checkpoint."""
    sched = make_scheduler(checkpoints=8)
    a = make_request("a", 8, max_tokens=3)
    sched.add_request(a)
    out, _ = fake_step(sched)
    row = out.sequences[0]
    assert (len(row.token_ids), row.mid_save[0]) == (8, 4)
    assert out.state_saves == [(a.state_slot, out.state_saves[0][1])] and out.state_saves[0][1] != row.mid_save[1]
    run_to_end(sched)
    assert_only_cache_entries_left(sched)


def test_a_target_more_than_a_block_before_the_chunk_end_still_cuts_it():
    """A save inside the step needs its tail (after the target) within one block and its head (from the chunk's
    start) at least one block long; otherwise the chunk is cut at the target, as before."""
    sched = make_scheduler(checkpoints=8)
    cache = sched.cache
    assert cache._saves_mid_chunk(0, 16, 20) and cache._saves_mid_chunk(12, 16, 17)
    assert not cache._saves_mid_chunk(0, 16, 21)  # tail 5 > block 4
    assert not cache._saves_mid_chunk(13, 16, 18)  # head 3 < block 4: the conv window would reach before it


def test_divergence_point_gets_a_checkpoint_that_the_next_branch_hits():
    sched = make_scheduler(checkpoints=8)
    base = list(range(1, 21))
    sched.add_request(make_request("a", 0, max_tokens=1, prompt=base))
    run_to_end(sched)
    # b shares 10 tokens with a: the cached KV chain covers 8, but a left no checkpoint there
    b = make_request("b", 0, max_tokens=1, prompt=base[:10] + [50] * 10)
    sched.add_request(b)
    out, _ = fake_step(sched)
    assert b.num_cached_tokens == 0 and len(out.sequences[0].token_ids) == 8  # cut: 12 tokens follow the target
    assert out.state_saves == [(b.state_slot, out.state_saves[0][1])]
    out, _ = fake_step(sched)  # then to b's end, its prompt end (16) saved inside the step, a decode one at 20
    row = out.sequences[0]
    assert len(row.token_ids) == 12 and row.mid_save[0] == 8 and len(out.state_saves) == 1
    run_to_end(sched)
    c = make_request("c", 0, max_tokens=1, prompt=base[:11] + [60] * 3)
    sched.add_request(c)
    out, _ = fake_step(sched)
    row = out.sequences[0]
    assert c.num_cached_tokens == 8 and row.token_ids == base[8:11] + [60] * 3 and row.mid_save[0] == 4  # at 12


def test_decode_keeps_one_checkpoint_at_its_latest_boundary_for_the_next_turn():
    sched = make_scheduler(checkpoints=8)
    a = make_request("a", 6, max_tokens=9)  # 6 + 9 tokens, 14 computed when it finishes
    sched.add_request(a)
    steps = run_to_end(sched)
    ends = [(s.sequences[0].num_computed, len(s.sequences[0].token_ids), s.sequences[0].mid_save, s.state_saves)
            for s in steps]
    assert [start + mid[0] for start, _, mid, _ in ends if mid] == [4]  # the prompt end, inside the first step
    assert [start + n for start, n, _, copies in ends if copies] == [8, 12]  # then each decode boundary
    prefix = sched.cache.prefix_cache
    assert prefix.num_checkpoints == 2  # the prompt's at 4 and the latest decode one (12) that replaced 8's
    turn2 = a.all_token_ids + [40, 41, 42]
    b = make_request("b", 0, max_tokens=1, prompt=turn2)
    sched.add_request(b)
    out, _ = fake_step(sched)
    row = out.sequences[0]
    assert b.num_cached_tokens == 12 and row.token_ids == turn2[12:18] and row.mid_save[0] == 4  # its end at 16


def test_a_conversation_turn_computes_its_new_message_in_one_step():
    """Each turn resends the conversation: its KV chain ends a few blocks past the last decode checkpoint, too
    close for a divergence checkpoint there to pay, so the turn is one prompt step from its hit to its end
    (with its prompt-end checkpoint saved inside), not a short step to the chain's end first. Farther than an
    interval, a divergence point still gets its own chunk end."""
    sched = make_scheduler(num_blocks=256, checkpoints=8, budget=64, decode_checkpoint_interval=16)
    conversation = list(range(1, 21))
    for turn in range(4):
        request = make_request(f"t{turn}", 0, max_tokens=7, prompt=conversation)
        sched.add_request(request)
        prompt_steps = [s for s in run_to_end(sched) if len(s.sequences[0].token_ids) > 1]
        if turn:
            assert request.num_cached_tokens > 0, turn
            assert len(prompt_steps) == 1, (turn, [len(s.sequences[0].token_ids) for s in prompt_steps])
            assert prompt_steps[0].sequences[0].mid_save is not None, turn  # the prompt end, inside
        conversation = request.all_token_ids + [50 + turn] * 9
    # a branch 24 tokens (> 16) past the hit still cuts at its divergence point
    base = list(range(100, 140))
    sched.add_request(make_request("base", 0, max_tokens=1, prompt=base))
    run_to_end(sched)
    branch = make_request("branch", 0, max_tokens=1, prompt=base[:26] + [9] * 8)  # chain 24, hit 0
    sched.add_request(branch)
    out, _ = fake_step(sched)
    assert branch.num_cached_tokens == 0 and len(out.sequences[0].token_ids) == 24


def test_decode_checkpoints_go_at_multiples_of_the_interval():
    sched = make_scheduler(checkpoints=8, decode_checkpoint_interval=10)  # rounded up to 3 blocks: 12 tokens
    a = make_request("a", 6, max_tokens=25)  # 6 + 25 tokens, 30 computed when it finishes
    sched.add_request(a)
    steps = run_to_end(sched)
    saved_at = [s.sequences[0].num_computed + len(s.sequences[0].token_ids) for s in steps if s.state_saves]
    assert saved_at == [12, 24]  # not at 8, 16, 20, 28
    turn2 = a.all_token_ids + [40, 41, 42]
    b = make_request("b", 0, max_tokens=1, prompt=turn2)
    sched.add_request(b)
    fake_step(sched)
    assert b.num_cached_tokens == 24


def test_a_decode_checkpoint_interval_below_one_token_is_refused():
    blocks, states = BlockPool(8, 4), StatePool(4, 2)
    with pytest.raises(ValueError, match="decode_checkpoint_interval must be a positive number of tokens, got 0"):
        CacheManager(blocks, states, PrefixCache(blocks, states, "test-model"), decode_checkpoint_interval=0)


def test_concurrent_requests_share_blocks_once_computed_and_state_once_saved():
    sched = make_scheduler(checkpoints=8, budget=8)
    prompt = list(range(1, 25))
    a = make_request("a", 0, max_tokens=5, prompt=prompt)
    sched.add_request(a)
    fake_step(sched)
    fake_step(sched)  # a: 16 of its 24 tokens computed
    pool = sched.cache.block_pool
    assert [pool.cached_block(h) for h in a.block_hashes[:5]] == a.block_ids[:4] + [None]  # block 5 not written
    b = make_request("b", 0, max_tokens=2, prompt=list(prompt))
    sched.add_request(b)
    out, _ = fake_step(sched)  # a runs to its end, checkpointing 20 inside the step: no budget left for b
    assert [(r.request_id, len(r.token_ids), r.mid_save) for r in out.sequences] == [("a", 8, (4, 8))]
    out, _ = fake_step(sched)  # b hits a's five blocks and its checkpoint at 20
    assert [(r.request_id, len(r.token_ids)) for r in out.sequences] == [("a", 1), ("b", 4)]
    assert b.num_cached_tokens == 20 and b.block_ids[:5] == a.block_ids[:5] and pool.ref_counts[a.block_ids[0]] == 2
    run_to_end(sched)
    assert_only_cache_entries_left(sched)


def test_preempted_request_resumes_from_its_own_checkpoint_and_checkpoints_survive():
    sched = make_scheduler(num_blocks=7, block_size=4, budget=100, checkpoints=4)
    a, b = make_request("a", 8, max_tokens=12), make_request("b", 8, max_tokens=12)
    sched.add_request(a)
    sched.add_request(b)
    while b.status != RequestStatus.PREEMPTED:
        fake_step(sched)
    assert b.block_ids == [] and b.state_slot is None and sched.cache.prefix_cache.num_checkpoints >= 2
    b_tokens = list(b.all_token_ids)
    out, _ = fake_step(sched)
    while b.status != RequestStatus.RUNNING:
        out, _ = fake_step(sched)
    row = next(r for r in out.sequences if r.request_id == "b")
    # b's decode checkpoint lets it resume at its latest block boundary, not from zero
    resumed_at = (len(b_tokens) - 1) // 4 * 4
    assert row.num_computed == resumed_at > 0 and row.token_ids == b_tokens[resumed_at:]
    assert [dst for _, dst in out.state_restores] == [b.state_slot]
    assert b.num_cached_tokens == 0  # usage reports the first start (with a, in one step: nothing cached yet)
    run_to_end(sched)
    assert b.num_output_tokens == 12
    assert_only_cache_entries_left(sched)


def test_prefix_caching_off_makes_no_copies():
    sched = make_scheduler()
    for rid in "ab":
        sched.add_request(make_request(rid, 10, max_tokens=6))
    for out in run_to_end(sched):
        assert out.state_restores == [] and out.state_saves == []
    assert sched.requests == {} and sched.cache.block_pool.num_cached_blocks == 0


def test_rows_carry_output_tokens_only_for_the_samplers_that_read_them():
    """A long output copied into every row of every step costs O(length) a step: only penalties and min_tokens
    read it."""
    sched = make_scheduler()
    for rid, params in (("plain", SamplingParams(max_tokens=8)), ("penalised", SamplingParams(max_tokens=8,
                        repetition_penalty=1.2)), ("min", SamplingParams(max_tokens=8, min_tokens=1))):
        sched.add_request(Request(rid, [1, 2, 3], params, 8, {EOS}))
    for _ in range(3):
        out, _ = fake_step(sched)
    rows = {row.request_id: row.output_token_ids for row in out.sequences}
    assert rows == {"plain": [], "penalised": [7, 7], "min": [7, 7]}


def test_a_preemption_is_logged_naming_the_full_pool_at_most_once_a_minute(caplog, monkeypatch):
    """A full KV pool preempts every few steps: the first is a warning that names the pool and what gives it more
    room; the next within PREEMPTION_WARNING_INTERVAL_S are only counted (the scheduler's num_preemptions)."""
    import deltaserve.engine.scheduler as scheduler_module

    clock = [1000.0]
    monkeypatch.setattr(scheduler_module.time, "monotonic", lambda: clock[0])
    sched = make_scheduler(num_blocks=7, block_size=4, budget=100)
    for rid in "abcde":  # 8-token prompts growing to 24 tokens, in 6 blocks of 4: 4 preemptions in all
        sched.add_request(make_request(rid, 8, max_tokens=16))
    with caplog.at_level("WARNING", logger="deltaserve.engine.scheduler"):
        while sched.num_preemptions < 2:
            fake_step(sched)
        warned = [r.getMessage() for r in caplog.records if "preempted" in r.getMessage()]
        assert len(warned) == 1, warned
        assert "the KV pool's 6 blocks of 4 tokens were all in use by 3 running requests" in warned[0]
        assert "(preemptions so far: 1)" in warned[0] and "--kv-cache-dtype fp8" in warned[0]
        clock[0] += scheduler_module.PREEMPTION_WARNING_INTERVAL_S
        before = sched.num_preemptions
        while sched.num_preemptions == before and sched.has_unfinished():
            fake_step(sched)
        warned = [r.getMessage() for r in caplog.records if "preempted" in r.getMessage()]
        assert len(warned) == 2 and f"(preemptions so far: {before + 1})" in warned[1]
