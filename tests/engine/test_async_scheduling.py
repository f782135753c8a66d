"""Async scheduling (step k+1 launched before step k's samples are read back) against the synchronous engine.

On the CPU every launch finishes before it returns, so these tests check the bookkeeping: pending tokens,
rows fed from the previous step's samples, the extra step a stopped request may get, deferred checkpoint
keys, the fallback to waiting for penalties. Outputs must be identical to the synchronous engine's.
"""

import random

import pytest

from deltaserve import LLM, SamplingParams


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def outputs_of(results) -> tuple[list, list[float]]:
    """What a user sees of each completion, and all its logprobs flattened (compared within a tolerance:
    preemption and chunking move float32 values slightly)."""
    seen, logprobs = [], []
    for result in results:
        for o in result.outputs:
            entries = o.logprobs or []
            seen.append((o.token_ids, o.text, o.finish_reason, o.stop_reason, [sorted(e) for e in entries]))
            logprobs += [e[t].logprob for e in entries for t in sorted(e)]
    return seen, logprobs


def mixed_workload(vocab: int, seed: int) -> tuple[list, list[SamplingParams]]:
    """Prompts sharing prefixes, with greedy, seeded, n > 1, stop ids, penalties, min_tokens and logprobs."""
    rng = random.Random(seed)
    base = [rng.randrange(vocab) for _ in range(40)]
    prompts, params = [], []
    for i in range(10):
        prompts.append(base[: rng.randrange(1, 40)] + [rng.randrange(vocab) for _ in range(rng.randrange(1, 20))])
        kind = i % 5
        if kind == 0:
            params.append(SamplingParams(temperature=0, max_tokens=rng.randrange(1, 25), ignore_eos=True))
        elif kind == 1:
            params.append(SamplingParams(temperature=1.0, seed=i, n=2, max_tokens=12, logprobs=2, ignore_eos=True))
        elif kind == 2:  # a stop id that greedy decoding of the tiny model is likely to meet
            params.append(SamplingParams(temperature=0.8, seed=i, max_tokens=30, stop_token_ids=list(range(0, vocab, 7))))
        elif kind == 3:
            params.append(SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3, ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=16, min_tokens=4, ignore_eos=False))
    return prompts, params


@pytest.mark.parametrize("setting", [
    {},
    {"max_num_batched_tokens": 7},  # chunked prefill
    {"block_size": 4, "num_gpu_blocks_override": 40},  # preemption
    {"enable_prefix_caching": False},
])
def test_async_outputs_equal_sync_outputs(make_checkpoint, setting):
    path = str(make_checkpoint("qwen3_5"))
    sync = LLM(path, max_num_seqs=6, async_scheduling=False, **setting)
    overlapped = LLM(path, max_num_seqs=6, async_scheduling=True, **setting)
    for seed in range(2):
        prompts, params = mixed_workload(sync.engine.model_config.vocab_size, seed)
        expected, expected_logprobs = outputs_of(sync.generate(prompts, params, use_tqdm=False))
        seen, logprobs = outputs_of(overlapped.generate(prompts, params, use_tqdm=False))
        assert seen == expected
        assert logprobs == pytest.approx(expected_logprobs, abs=5e-4)
    for llm in (sync, overlapped):
        pool = llm.engine.cache_manager.block_pool
        assert pool.num_free_blocks == pool.num_usable_blocks


def test_async_steps_overlap_and_report_one_call_later(make_checkpoint):
    path = str(make_checkpoint("qwen3_5"))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    reports = {}
    for mode in (False, True):
        engine = LLM(path, async_scheduling=mode).engine
        engine.add_request("r", [1, 2, 3, 4, 5], params)
        counts = []
        while engine.has_unfinished():
            counts.append([len(o.outputs[0].token_ids) for o in engine.step()])
            if mode and engine.has_unfinished():
                assert engine._in_flight is not None, "async mode keeps a step in flight between calls"
        reports[mode] = counts
    assert reports[False] == [[1], [2], [3], [4], [5]]
    # the first call only launches the prefill; the fifth token needs no step of its own (its limit is known)
    assert reports[True] == [[], [1], [2], [3], [4], [5]]


def test_penalties_make_the_engine_wait_for_the_step_in_flight(make_checkpoint):
    engine = LLM(str(make_checkpoint("qwen3_5")), async_scheduling=True).engine
    engine.add_request("plain", [1, 2, 3], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()
    assert not engine._must_wait()
    engine.add_request("penalised", [4, 5, 6], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                             frequency_penalty=0.5))
    engine.step()
    assert engine._must_wait()
    penalised_rows = 0
    while engine.has_unfinished():
        engine.step()
        # a penalised row never runs with a pending input: its history is complete on the host
        if engine._in_flight is not None:
            for row in engine._in_flight[0].sequences:
                if row.request_id == "penalised":
                    assert not row.pending_input
                    penalised_rows += 1
    assert penalised_rows >= 6


def test_stopped_request_gets_at_most_one_extra_step(make_checkpoint):
    """A stop token is seen one step late: the request may run one wasted row, never a wrong token."""
    path = str(make_checkpoint("qwen3_5"))
    llm = LLM(path, async_scheduling=True)
    free = llm.generate([[3, 1, 4, 1, 5]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    stop_at = free[3]
    engine = llm.engine
    engine.add_request("s", [3, 1, 4, 1, 5], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                           stop_token_ids=[stop_at]))
    rows = 0
    while engine.has_unfinished():
        before = engine._in_flight
        final = engine.step()
        rows += engine._in_flight is not None and engine._in_flight is not before
    assert final[0].outputs[0].token_ids == free[: free.index(stop_at) + 1]
    assert rows <= free.index(stop_at) + 2  # one row per token, plus at most the wasted one


@pytest.mark.parametrize("ending", ["stop id", "abort"])
def test_a_new_request_may_reuse_the_id_of_one_whose_step_is_in_flight(make_checkpoint, ending):
    """A request that stops (or is aborted) has a step in flight for it; a new request with the same id,
    added before that step is read back, gets none of its samples (they were once appended to the newcomer)."""
    llm = LLM(str(make_checkpoint("qwen3_5")), async_scheduling=True)
    prompt, greedy = [3, 1, 4, 1, 5], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    free = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    engine = llm.engine
    if ending == "stop id":
        engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                       stop_token_ids=[free[2]]))
        while engine.has_unfinished():
            engine.step()
    else:
        engine.add_request("r", prompt, greedy)
        for _ in range(4):
            engine.step()
        engine.abort_request("r")
    assert engine._in_flight is not None  # the old request's last step has not been read back
    engine.add_request("r", prompt, greedy)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == free


def test_a_step_that_failed_is_not_processed_again(make_checkpoint, monkeypatch):
    """An exception while reading back a step fails that call; the server then aborts the requests, and the
    engine serves new ones (the failed step is dropped, not retried forever)."""
    engine = LLM(str(make_checkpoint("qwen3_5")), async_scheduling=True).engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("doomed", [1, 2, 3], params)
    engine.step()  # the prefill is in flight
    real_update = engine.scheduler.update_from_output

    def fail_on_doomed(scheduled, output):  # a bug that every step holding "doomed" would hit
        if any(row.request_id == "doomed" for row in scheduled.sequences):
            raise RuntimeError("boom")
        return real_update(scheduled, output)

    monkeypatch.setattr(engine.scheduler, "update_from_output", fail_on_doomed)
    with pytest.raises(RuntimeError, match="boom"):
        engine.step()
    engine.abort_request("doomed")  # what the server does when a step fails
    engine.add_request("next", [4, 5, 6], params)
    done, failures = [], 0
    while engine.has_unfinished():
        try:
            done += [o for o in engine.step() if o.finished]
        except RuntimeError:
            failures += 1  # the one other step launched with "doomed" in it fails too, once
            assert failures <= 1, "a failed step is being processed again"
    assert [o.request_id for o in done] == ["next"] and len(done[0].outputs[0].token_ids) == 4
