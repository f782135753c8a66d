"""The engine end to end on tiny checkpoints (CPU, float32).

Greedy outputs are checked against transformers (a plain greedy loop over full forwards), and every engine
trick against the plain path: batched == alone, chunked prefill == unchunked, preempted == not.
"""

import pytest
import torch
import transformers

from deltaserve import LLM, RequestOutputKind, SamplingParams
from deltaserve.config import ModelConfig
from deltaserve.engine import tokenize
from deltaserve.outputs import OutputAccumulator
from deltaserve.ops.gdn.cuda import SPLIT_MIN_SHORT_SEQS
from tests.model.helpers import model_bound

ARCHS = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts(vocab: int, lengths=(5, 23, 1, 40, 17)) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def transformers_greedy(path, prompt: list[int], n: int) -> tuple[list[int], list[float], list[float]]:
    """transformers' greedy continuation; per step, the gap between its two best logits, and the near-tie
    threshold under which two float32 evaluations (ours and transformers') may rank them differently: each
    logit of each side within model_bound of the exact one, so the gap within 4 bounds (tests/tolerance.py)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = ModelConfig.from_pretrained(path)
    ids, gaps, ties = list(prompt), [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            top = torch.topk(logits, 2).values
            gaps.append((top[0] - top[1]).item())
            ties.append(4 * model_bound(cfg, len(ids), logits.abs().max().item()))
            ids.append(int(logits.argmax()))
    return ids[len(prompt):], gaps, ties


@pytest.fixture(scope="module", params=ARCHS)
def arch_llm(request, make_checkpoint):
    path = make_checkpoint(request.param)
    return path, LLM(str(path), max_num_seqs=8)


def test_batched_greedy_equals_each_alone_and_transformers(arch_llm):
    path, llm = arch_llm
    ps = prompts(llm.engine.model_config.vocab_size)
    batched = token_ids(llm.generate(ps, GREEDY, use_tqdm=False))
    alone = [token_ids(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in ps]
    assert batched == alone
    for prompt, ours in zip(ps[:3], batched):
        ref, gaps, ties = transformers_greedy(path, prompt, GREEDY.max_tokens)
        if ours != ref:  # allowed only at a near tie of transformers' own logits (within float32 rounding)
            i = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)
            assert gaps[i] < ties[i], f"diverged from transformers at step {i} (top-2 gap {gaps[i]:.3g})"


def test_chunked_prefill_and_preemption_give_identical_outputs(make_checkpoint):
    path = str(make_checkpoint("qwen3_5"))
    base = LLM(path, max_num_seqs=8)
    ps = prompts(base.engine.model_config.vocab_size, lengths=(30, 45, 12, 33, 28, 9))
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = token_ids(base.generate(ps, params, use_tqdm=False))
    chunked = LLM(path, max_num_seqs=8, max_num_batched_tokens=7)
    assert token_ids(chunked.generate(ps, params, use_tqdm=False)) == expected
    # 12 blocks of 4 tokens cannot hold six 40-60 token sequences at once: requests get preempted
    tight = LLM(path, max_num_seqs=8, block_size=4, num_gpu_blocks_override=20)
    assert token_ids(tight.generate(ps, params, use_tqdm=False)) == expected
    engine = tight.engine  # run again step by step to see the preemptions happen
    for i, p in enumerate(ps):
        engine.add_request(f"p{i}", p, params)
    seen = set()
    while engine.has_unfinished():
        engine.step()
        seen |= {r.request_id for r in engine.scheduler.waiting if r.num_preemptions}
    assert seen, "the tight pool should have forced at least one preemption"
    pool = engine.cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_seeded_sampling_is_reproducible_whatever_the_batch(make_checkpoint):
    llm = LLM(str(make_checkpoint("qwen3_5")), max_num_seqs=8)
    ps = prompts(llm.engine.model_config.vocab_size)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=1234, ignore_eos=True)
    alone = token_ids(llm.generate([ps[1]], seeded, use_tqdm=False))[0]
    others = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    mixed = llm.generate([ps[0], ps[1], ps[2]], [others, seeded, others], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    different = token_ids(llm.generate([ps[1]], SamplingParams(temperature=1.0, max_tokens=10, seed=99,
                                                                  ignore_eos=True), use_tqdm=False))[0]
    assert different != alone


def test_n_samples_and_logprobs(make_checkpoint):
    llm = LLM(str(make_checkpoint("qwen3_5")), max_num_seqs=8)
    out = llm.generate([prompts(1024)[1]], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6,
                                                           logprobs=2, ignore_eos=True), use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1, "three seeded samples should not all agree"
    for o in out.outputs:
        assert len(o.logprobs) == 6
        for token, entry in zip(o.token_ids, o.logprobs):
            assert token in entry and len(entry) <= 3 and entry[token].logprob <= 0
        assert o.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(o.token_ids, o.logprobs)))
    plain = llm.generate([prompts(1024)[1]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert plain.outputs[0].cumulative_logprob is None and plain.outputs[0].logprobs is None  # as in vLLM


def test_stop_strings_and_stop_token_ids(make_checkpoint):
    llm = LLM(str(make_checkpoint("qwen3_5")), max_num_seqs=8)
    prompt = "The quick brown fox"
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    text, ids = free.outputs[0].text, free.outputs[0].token_ids
    stop = text[3:6]
    cut = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.index(stop)]
    by_id = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                  stop_token_ids=[ids[4]]), use_tqdm=False)[0].outputs[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids == ids[: ids.index(ids[4]) + 1]


def test_streamed_text_never_shows_what_a_stop_string_removes(make_checkpoint):
    """Outputs are cumulative and a stream sends each one's new characters: every text the engine reports must
    be a prefix of the final one. A tail that may start a stop string is held back until the next tokens
    decide it (the engine once reported it, so a streaming client got characters the final text lacks)."""
    llm = LLM(str(make_checkpoint("qwen3_5")), max_num_seqs=8)
    engine, prompt = llm.engine, "The quick brown fox"
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    text = free.outputs[0].text
    held_back = 0  # steps that ended with a tail held back (the case this test is about)
    for start in range(1, len(text) - 3):
        stop = text[start:start + 3]
        engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]))
        reported = []
        while engine.has_unfinished():
            reported += [o.outputs[0].text for o in engine.step()]
            held_back += any(child.detok._held for parent in engine._parents.values() for child in parent.children)
        final = text[:text.index(stop)]
        assert reported[-1] == final
        assert all(final.startswith(shown) for shown in reported), (stop, reported)
    assert held_back


def test_delta_outputs_add_up_to_the_cumulative_ones_and_final_only_sends_one(make_checkpoint):
    """The three output kinds on one workload (n > 1, logprobs, stop strings, stop ids): the deltas of each
    request, joined, equal its last cumulative output, each delta holds only the step's new tokens, and
    FINAL_ONLY reports each request once, finished, with the same content."""
    llm = LLM(str(make_checkpoint("qwen3_5")), max_num_seqs=8)
    engine = llm.engine
    free = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    workload = [("The quick brown fox", dict(temperature=0, stop=[free.text[4:7]])),
                ("The quick brown fox", dict(temperature=0, stop=[free.text[4:7]], include_stop_str_in_output=True)),
                ([5, 6, 7], dict(temperature=1.0, seed=3, n=2, logprobs=2)),
                ([9, 8], dict(temperature=0, stop_token_ids=[free.token_ids[5]]))]

    def run(kind: RequestOutputKind) -> dict[str, list]:
        reported = {}
        for i, (prompt, kwargs) in enumerate(workload):
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=16, ignore_eos=True, output_kind=kind,
                                                              **kwargs))
        while engine.has_unfinished():
            for output in engine.step():
                reported.setdefault(output.request_id, []).append(output)
        return reported

    def content(output):
        return [(o.text, o.token_ids, o.logprobs, o.cumulative_logprob, o.finish_reason, o.stop_reason)
                for o in output.outputs]

    cumulative, deltas, finals = (run(kind) for kind in RequestOutputKind)
    for request_id, outputs in cumulative.items():
        joined = OutputAccumulator()
        for delta in deltas[request_id]:
            assert all(len(o.token_ids) <= 1 for o in delta.outputs)  # one token a step: never the history
            joined.add(delta)
        assert content(joined.result()) == content(outputs[-1])
        assert len(finals[request_id]) == 1 and finals[request_id][0].finished
        assert content(finals[request_id][0]) == content(outputs[-1])
    assert cumulative["0"][-1].outputs[0].stop_reason == free.text[4:7]  # the stops did stop


def test_too_long_prompt_is_rejected_and_others_finish(make_checkpoint):
    llm = LLM(str(make_checkpoint("qwen3_5")), max_num_seqs=4, max_model_len=64)
    engine = llm.engine
    engine.add_request("ok", prompts(1024)[1], SamplingParams(temperature=0, max_tokens=5))
    with pytest.raises(ValueError, match="maximum context length is 64 tokens, you requested 65 tokens"):
        engine.add_request("long", list(range(65)), SamplingParams())
    with pytest.raises(ValueError, match="prompt token id 5000 is out of range"):
        engine.add_request("bad", [1, 5000], SamplingParams())
    with pytest.raises(ValueError, match="the prompt is empty"):
        engine.add_request("empty", tokenize.CheckedTokenIds(), SamplingParams())
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == ["ok"] and len(done[0].outputs[0].token_ids) <= 5


def test_an_id_in_use_by_a_child_is_refused_and_changes_nothing(make_checkpoint):
    """n > 1 runs children "x#0", "x#1": a new request "x#0" is refused before it touches them (it once
    remapped the child to itself, and "x" never finished)."""
    engine = LLM(str(make_checkpoint("qwen3_5")), max_num_seqs=4).engine
    engine.add_request("x", [1, 2, 3], SamplingParams(temperature=1.0, seed=1, n=2, max_tokens=4))
    for used in ("x#0", "x#1", "x"):
        with pytest.raises(ValueError, match=f"request id '{used}' is already in use"):
            engine.add_request(used, [1, 2, 3], SamplingParams())
    finished = []
    for _ in range(20):  # 4 tokens take 6 steps
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["x"] and [len(c.token_ids) for c in finished[0].outputs] == [4, 4]
    assert not engine.has_unfinished()


def test_abort_frees_everything(make_checkpoint):
    llm = LLM(str(make_checkpoint("qwen3_5")), max_num_seqs=4, max_num_batched_tokens=8)
    engine = llm.engine
    for i, p in enumerate(prompts(1024)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request([f"r{i}" for i in range(5)])
    assert not engine.has_unfinished() and not engine.scheduler.has_unfinished()
    pool = engine.cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert engine.cache_manager.state_pool.num_free_slots == engine.cache_manager.state_pool.num_slots - 1


def test_generate_without_params_uses_the_generation_config(make_checkpoint, tmp_path):
    """As vLLM's LLM: no sampling params -> the checkpoint's generation_config.json defaults."""
    import json
    import shutil

    path = shutil.copytree(make_checkpoint("qwen3_5"), tmp_path / "ckpt")
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.0, "max_new_tokens": 7}))
    llm = LLM(str(path), max_num_seqs=4)
    assert llm.get_default_sampling_params().temperature == 0.0
    out = llm.generate([prompts(1024)[1]], use_tqdm=False)[0].outputs[0]
    greedy = llm.generate([prompts(1024)[1]], SamplingParams(temperature=0, max_tokens=7), use_tqdm=False)
    assert out.token_ids == greedy[0].outputs[0].token_ids and len(out.token_ids) <= 7
    plain = LLM(str(path), max_num_seqs=4, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()


def test_cuda_graphs_only_where_capturable(make_checkpoint):
    """torch's grouped matmul copies group offsets to the host except in bfloat16: float32 MoE runs eagerly."""
    from deltaserve.config import ModelConfig
    from deltaserve.model.loader import build_model
    from deltaserve.worker.model_runner import graphs_supported

    for arch, dtype, expected in (("qwen3_5", torch.float32, True), ("qwen3_5_moe", torch.float32, False),
                                  ("qwen3_next", torch.float32, False), ("qwen3_5_moe", torch.bfloat16, True)):
        model = build_model(ModelConfig.from_pretrained(make_checkpoint(arch)), dtype, "cpu")
        assert graphs_supported(model) is expected, (arch, dtype)


def test_warm_up_runs_each_kind_of_step_and_leaves_the_engine_as_it_found_it(make_checkpoint):
    """The warm-up (run at startup on the GPU) takes a chunk over a cached prefix, a mixed step and a prefix
    hit; afterwards no cache is held or indexed, the counters are zero and outputs are a fresh engine's."""
    path, settings = str(make_checkpoint("qwen3_5")), dict(max_num_seqs=12, max_num_batched_tokens=256, block_size=4)
    expected = LLM(path, **settings).generate(prompts(1024), GREEDY)
    llm = LLM(path, **settings)
    engine, steps = llm.engine, []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        steps.append([(row.num_computed, len(row.token_ids)) for row in out.sequences])
        return out

    engine.scheduler.schedule = recording_schedule
    engine.warm_up()
    assert any(computed > 0 and n > 1 for step in steps for computed, n in step)  # a chunk after a prefix
    # a prompt chunk beside enough decode rows for the GDN op to split the batch
    assert any(sum(n == 1 for _, n in step) >= SPLIT_MIN_SHORT_SEQS and max(n for _, n in step) > 128
               for step in steps)
    assert engine.cache_manager.prefix_cache_queries == 0  # the hit happened, then the counters were zeroed
    assert engine.grammar_compiler._compiler is not None  # structured output's view of the vocabulary is built
    cache = engine.cache_manager
    assert not engine.has_unfinished() and not engine.scheduler.has_unfinished()
    assert cache.block_pool.num_free_blocks == cache.block_pool.num_usable_blocks
    assert cache.block_pool.num_cached_blocks == 0 and cache.prefix_cache.num_checkpoints == 0
    assert cache.state_pool.num_free_slots == cache.state_pool.num_slots - 1
    outputs = llm.generate(prompts(1024), GREEDY)
    assert token_ids(outputs) == token_ids(expected)
    assert [o.num_cached_tokens for o in outputs] == [o.num_cached_tokens for o in expected]


def test_reset_prefix_cache_forgets_prefixes_only_when_idle(make_checkpoint):
    llm = LLM(str(make_checkpoint("qwen3_5")), max_num_seqs=4, block_size=4)
    prompt = prompts(1024, lengths=(30,))[0]
    llm.generate([prompt], GREEDY)
    assert llm.generate([prompt], GREEDY)[0].num_cached_tokens == 28  # the resend hits its prompt-end checkpoint
    engine = llm.engine
    engine.add_request("running", prompt, GREEDY)
    assert not engine.reset_prefix_cache()  # a request is unfinished: nothing changes
    while engine.has_unfinished():
        engine.step()
    assert llm.reset_prefix_cache()
    assert engine.cache_manager.prefix_cache_hits == 0
    assert llm.generate([prompt], GREEDY)[0].num_cached_tokens == 0


def test_torch_modules_imported_by_start_up_are_frozen_too(make_checkpoint):
    """Building the model imports torch's compiler stack (dynamo, inductor, sympy: ~140K objects) after the freeze
    unless the freeze imports it first; full collections while serving then walked them all (W6 c=256 on the H200:
    pauses of up to 144 ms). In a fresh process, as a server runs: after start-up and a request, the collector
    tracks almost none of torch's or sympy's functions."""
    import subprocess
    import sys

    script = (
        "import gc, sys\n"
        "from deltaserve import LLM, SamplingParams\n"
        f"llm = LLM({str(make_checkpoint('qwen3_5'))!r}, max_num_seqs=2)\n"
        "llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)\n"
        "gc.collect()\n"
        "names = [getattr(o, '__module__', '') or '' for o in gc.get_objects() if type(o).__name__ == 'function']\n"
        "print(sum(n.startswith(('torch.', 'sympy')) for n in names))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) < 500  # 12 with the import first, ~28,000 without


def test_startup_objects_are_frozen_out_of_the_collector_once(make_checkpoint, monkeypatch):
    """The first engine of a process freezes what is alive when it starts (so full collections while serving
    skip torch's objects), not its own objects: a dropped engine is freed. A second engine does not freeze
    again."""
    import gc
    import weakref

    from deltaserve.engine import llm_engine

    monkeypatch.setattr(llm_engine, "_startup_frozen", False)
    gc.unfreeze()
    try:
        llm = LLM(str(make_checkpoint("qwen3_5")), max_num_seqs=2)
        frozen = gc.get_freeze_count()
        assert frozen > 10_000  # torch's objects, at least
        refs = [weakref.ref(x) for x in (llm, llm.engine, llm.engine.runner.model)]
        for obj in (llm, llm.engine):
            obj.self_reference = obj  # cycles: only the collector frees them, and only if not frozen
        del llm, obj
        gc.collect()
        assert all(ref() is None for ref in refs)
        LLM(str(make_checkpoint("qwen3_5")), max_num_seqs=2)
        assert gc.get_freeze_count() <= frozen  # not grown: frozen objects may still be freed by refcount
    finally:
        gc.unfreeze()


def test_checked_token_ids_are_taken_as_they_are_and_give_the_same_tokens(make_checkpoint):
    """The server's checked ids skip the engine's scan (the same object comes back) and decode as a plain list."""
    llm = LLM(str(make_checkpoint("qwen3_5")), max_num_seqs=4, max_model_len=128)
    prompt = prompts(1024)[3]
    checked = tokenize.CheckedTokenIds(prompt)
    assert llm.engine._encode(checked) is checked and llm.engine._encode(prompt) is not prompt
    params = SamplingParams(temperature=0, max_tokens=8)
    assert token_ids(llm.generate([checked], params)) == token_ids(llm.generate([prompt], params))
