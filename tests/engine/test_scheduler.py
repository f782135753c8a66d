"""The scheduler driven with hand-built model outputs: no model, no tensors."""

import pytest

from deltaserve.cache.block_pool import BlockPool
from deltaserve.cache.kv_manager import CacheManager
from deltaserve.cache.state_pool import StatePool
from deltaserve.engine.scheduler import Scheduler
from deltaserve.request import Request, RequestStatus
from deltaserve.sampling import SamplingParams
from deltaserve.sched_output import ModelOutput

EOS = 99


def make_scheduler(num_blocks=64, block_size=4, slots=8, max_num_seqs=4, budget=16, max_model_len=1000):
    cache = CacheManager(BlockPool(num_blocks, block_size), StatePool(slots))
    return Scheduler(cache, max_num_seqs, budget, max_model_len)


def make_request(rid, prompt_len, max_tokens=4):
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), max_tokens, {EOS})


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


def test_finishes_on_max_tokens_eos_stop_ids_and_max_model_len():
    sched = make_scheduler(budget=100, max_model_len=6)
    sched.add_request(make_request("len", 3, max_tokens=10))
    out, updated = fake_step(sched)
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
