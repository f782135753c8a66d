"""Pipeline parallelism with micro-batches: the engine keeps one step per stage in flight, each over its own
sequences, so that stage 0 runs micro-batch i+1 while the last stage runs micro-batch i.

The scheduler tests drive Scheduler(num_micro_batches=...) with hand-built outputs: disjoint micro-batches, even
shares, nothing in flight preempted or scheduled twice, an abort of a sequence in flight. The engine test runs
PP=2 and PP=3 (gloo, spawned ranks, float32: each layer's arithmetic is the same wherever it runs, so greedy and
seeded tokens equal the single process's exactly) over many concurrent requests of different lengths, chunked
(32-token budget), a prefix-cache hit, a KV pool small enough to preempt, and one request aborted while its step
is in flight, then a stage killed with three micro-batches in flight; the ranks' step timelines (worker/step_trace.py) show stage 0 beginning a step before the last
stage has finished the one before it."""

import os
import signal

import pytest

from deltaserve.config import EngineConfig
from deltaserve.demo import build_checkpoint
from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.sampling import SamplingParams
from deltaserve.sched_output import ModelOutput
from deltaserve.worker import step_trace
from deltaserve.worker.executor import RankFailed
from tests.engine.test_pipeline_parallel import SEVEN_LAYERS
from tests.engine.test_scheduler import assert_pools_empty, make_request, make_scheduler


def _micro_batch_scheduler(num_micro_batches, **kwargs):
    sched = make_scheduler(**kwargs)
    sched.num_micro_batches = num_micro_batches
    return sched


def _sampled(out, token=7):
    return ModelOutput({row.request_id: token for row in out.sequences if row.sample}, {}, {})


def _ids(out):
    return [row.request_id for row in out.sequences]


def test_micro_batches_are_disjoint_even_shares_until_their_output_is_taken_in():
    sched = _micro_batch_scheduler(2, budget=64, max_num_seqs=8)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", 3 + i, max_tokens=6))
    first = sched.schedule()
    second = sched.schedule()
    assert _ids(first) == ["r0", "r1", "r2"] and _ids(second) == ["r3", "r4"]  # ceil(5 / 2), then the rest
    assert sched.schedule().is_empty  # every sequence is in a step in flight
    sched.update_from_output(first, _sampled(first))
    third = sched.schedule()
    assert _ids(third) == ["r0", "r1", "r2"]
    assert not any(row.pending_input for row in third.sequences)  # each row's last token is on the host
    assert [row.token_ids for row in third.sequences] == [[7]] * 3
    sched.update_from_output(second, _sampled(second))
    sched.update_from_output(third, _sampled(third))
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update_from_output(out, _sampled(out))
    assert_pools_empty(sched)


def test_a_sequence_in_flight_is_never_preempted_and_its_abort_is_safe():
    # 7 usable blocks of 4 tokens: b's decode outgrows them while a (newer, in flight) holds 3
    sched = _micro_batch_scheduler(2, num_blocks=8, budget=64, max_num_seqs=4)
    sched.add_request(make_request("b", 12, max_tokens=12))
    sched.add_request(make_request("a", 12, max_tokens=20))
    first = sched.schedule()
    in_flight = sched.schedule()
    assert _ids(first) == ["b"] and _ids(in_flight) == ["a"]
    sched.update_from_output(first, _sampled(first))
    blocks_of_a = list(sched.requests["a"].block_ids)
    while sched.requests["b"].num_preemptions == 0:  # the newest running request is a, but a is in flight
        out = sched.schedule()
        assert "a" not in _ids(out)
        sched.update_from_output(out, _sampled(out))
    assert sched.requests["a"].block_ids == blocks_of_a and sched.requests["a"].num_preemptions == 0
    sched.abort_request("a")  # while its step is in flight: its cache is freed, its rows are ignored on return
    assert sched.update_from_output(in_flight, _sampled(in_flight)) == []
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update_from_output(out, _sampled(out))
    assert_pools_empty(sched)


def test_one_micro_batch_schedules_as_before():
    sched = make_scheduler(budget=64)
    sched.add_request(make_request("a", 5))
    first = sched.schedule()
    assert _ids(sched.schedule()) == ["a"]  # async scheduling: the next step is fed the pending sample
    assert first.sequences[0].sample


# -- the engine over spawned ranks ---------------------------------------------------------------------------

GREEDY_LENGTHS = (5, 40, 13, 70, 2, 27, 9, 51)


def _workload(engine: LLMEngine) -> tuple[dict[str, list[int]], dict]:
    """Eight greedy prompts of different lengths and output lengths, a prefix hit, a seeded one with n = 2, a
    penalized one (its sampling reads its output tokens on the host), and "gone",
    aborted while its step is in flight. Returns the finished token ids and what was seen along the way."""
    for i, n in enumerate(GREEDY_LENGTHS):
        prompt = [(7 * i + 3 * j) % 200 + 1 for j in range(n)]
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=4 + i, ignore_eos=True))
    engine.add_request("hit", [(21 + 3 * j) % 200 + 1 for j in range(66)] + [9, 8, 7],
                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))  # r3's blocks
    engine.add_request("seeded", [5, 6, 7, 8], SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=8,
                                                              ignore_eos=True))
    engine.add_request("penalized", [4, 4, 5, 5, 6], SamplingParams(temperature=0, repetition_penalty=1.3,
                                                                    min_tokens=3, max_tokens=8, ignore_eos=True))
    engine.add_request("gone", list(range(1, 30)), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    done, seen = {}, {"preempted": set(), "most_in_flight": 0, "aborted_in_flight": False}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [o.token_ids for o in out.outputs]
        steps += 1
        steps_in_flight = [*engine._micro_batches, *([engine._in_flight] if engine._in_flight else [])]
        in_flight = [{row.request_id for row in scheduled.sequences} for scheduled, _ in steps_in_flight]
        for i, rows in enumerate(in_flight):  # a sequence is never in two steps in flight
            assert not any(rows & other for other in in_flight[i + 1:])
        seen["most_in_flight"] = max(seen["most_in_flight"], len(in_flight))
        seen["preempted"] |= {r.request_id for r in engine.scheduler.waiting if r.num_preemptions}
        if steps > 12 and "gone" in engine.scheduler.requests and any("gone" in rows for rows in in_flight):
            engine.abort_request("gone")
            seen["aborted_in_flight"] = True
    return done, seen


def _kill_a_middle_stage_with_micro_batches_in_flight(engine: LLMEngine) -> None:
    """Every micro-batch in flight when stage 1 dies: the engine names the dead rank (RankFailed), no hang."""
    for i in range(3):
        engine.add_request(f"late{i}", [3 + i] * 10, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    while len(engine._micro_batches) < 3:
        engine.step()
    os.kill(engine.runner._procs[1].pid, signal.SIGKILL)
    with pytest.raises(RankFailed, match=r"rank 1 \(pipeline stage 1, tensor-parallel rank 0\) died"):
        while engine.has_unfinished():
            engine.step()
    with pytest.raises(RankFailed, match="rank 1"):  # and every later step says so at once
        engine.step()


def _engine(path, pp: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", pipeline_parallel_size=pp,
                                  max_num_batched_tokens=32, max_model_len=128, block_size=4,
                                  num_gpu_blocks_override=40, skip_tokenizer_init=True))


def test_micro_batched_stages_overlap_and_match_single_process(tmp_path, monkeypatch):
    path = build_checkpoint(tmp_path, "qwen3_5", config_overrides=SEVEN_LAYERS)
    expected, _ = _workload(_engine(path, 1))
    assert "gone" not in expected and len(expected) == len(GREEDY_LENGTHS) + 3
    for pp in (2, 3):
        trace = tmp_path / f"trace-pp{pp}"
        trace.mkdir()
        monkeypatch.setenv(step_trace.ENV_VAR, str(trace))  # read by the spawned workers
        engine = _engine(path, pp)
        try:
            done, seen = _workload(engine)
            assert done == expected, f"pp={pp}"
            assert seen["most_in_flight"] == pp and seen["aborted_in_flight"] and seen["preempted"], seen
            assert not engine.scheduler.requests and not engine.scheduler._in_flight
            states = engine.cache_manager.state_pool
            assert states.num_free_slots == states.num_slots - 1
            # the steps both ranks have finished (one aborted request's last step may still be in flight)
            first, last = step_trace.read(trace, 0), step_trace.read(trace, pp - 1)
            num_steps = min(len(first), len(last))
            assert num_steps > 10
            # stage 0 began step i + 1 before the last stage finished step i: two steps in the pipeline at once
            overlapped = [i for i in range(num_steps - 1) if first[i + 1][0] < last[i][1]]
            assert overlapped, f"pp={pp}: no step began on stage 0 before the last stage finished the one before"
            if pp == 3:
                _kill_a_middle_stage_with_micro_batches_in_flight(engine)
        finally:
            engine.runner.shutdown()
