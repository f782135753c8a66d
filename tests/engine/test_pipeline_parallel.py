"""Pipeline and tensor parallelism through the engine on the CPU (gloo, one spawned process per rank): with float32
weights each layer's arithmetic is the same wherever it runs, so the tokens of PP=2 and PP=3 engines (7 layers:
3, 2, 2, uneven) equal the single-process engine's exactly, over batched, chunked (32-token budget) and
prefix-cached requests, greedy and seeded. TP=2 and TP=2 x PP=2 reorder the all-reduced float32 sums (a few ulps;
tests/model/test_tensor_parallel.py bounds the logits): their greedy tokens equal the single process's.
A tied embedding reaches the last stage's lm_head; a killed rank gives a clear error."""

import os
import signal

import pytest
import torch

from deltaserve.config import EngineConfig
from deltaserve.demo import TINY_CONFIGS, build_checkpoint
from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.sampling import SamplingParams
from deltaserve.worker.executor import RankFailed, cpu_threads_per_rank
from tests.model.quant_checkpoints import QUANT_SHAPES, quantize_checkpoint

PROMPTS = [[(7 * i + 3 * j) % 200 + 1 for j in range(n)] for i, n in enumerate((5, 40, 13, 70))]
SEVEN_LAYERS = dict(num_hidden_layers=7, layer_types=["linear_attention"] * 3 + ["full_attention"]
                    + ["linear_attention"] * 2 + ["full_attention"])


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, greedy)
    engine.add_request("hit", PROMPTS[3][:-4] + [9, 8, 7], greedy)  # a prefix-cache hit on r3's blocks
    engine.add_request("seeded", PROMPTS[1], SamplingParams(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def _engine(path, pp: int, tp: int = 1) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", pipeline_parallel_size=pp,
                                  tensor_parallel_size=tp, max_num_batched_tokens=32, max_model_len=256,
                                  skip_tokenizer_init=True))


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_pipeline_matches_single_process(tmp_path, arch):
    path = build_checkpoint(tmp_path, arch, config_overrides=SEVEN_LAYERS)
    expected = _run(_engine(path, 1))
    assert len(expected) == len(PROMPTS) + 2
    for pp in (2, 3):
        engine = _engine(path, pp)
        try:
            assert _run(engine) == expected, f"pp={pp}"
        finally:
            engine.runner.shutdown()


def test_warm_up_runs_its_steps_through_the_stages(tmp_path):
    """LLMEngine.warm_up under -pp 2, as a GPU start runs it (engine_steps, then the after-warm-up message each
    rank takes; a no-op on the CPU): its steps go through the ranks and leave no request or cached prefix behind,
    and the requests after it get the single process's tokens."""
    path = build_checkpoint(tmp_path, "qwen3_5", config_overrides=SEVEN_LAYERS)
    expected = _run(_engine(path, 1))
    engine = _engine(path, 2)
    try:
        engine.warm_up()
        assert not engine.has_unfinished() and engine.cache_manager.prefix_cache.num_checkpoints == 0
        assert _run(engine) == expected
    finally:
        engine.runner.shutdown()


def test_pipeline_stages_of_an_awq_checkpoint(tmp_path):
    # COMMAND_LINES.md's AWQ 27B over three pipeline stages: each stage loads its layers' packed int4 tensors
    source = build_checkpoint(tmp_path / "source", "qwen3_5", matrix_gain=0.5,
                              config_overrides=dict(QUANT_SHAPES, **SEVEN_LAYERS))
    path = quantize_checkpoint(source, tmp_path, "awq", group_size=64).path
    expected = _run(_engine(path, 1))
    engine = _engine(path, 3)
    try:
        assert _run(engine) == expected
    finally:
        engine.runner.shutdown()


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_next"])
def test_tensor_parallel_engines_match_single_process(tmp_path, arch):
    # Qwen3-Next with one KV head: both TP ranks hold it (replicated)
    overrides = dict(SEVEN_LAYERS, **({"num_key_value_heads": 1} if arch == "qwen3_next" else {}))
    path = build_checkpoint(tmp_path, arch, config_overrides=overrides)
    single = _engine(path, 1)
    expected = _run(single)
    expected.pop("seeded")  # a reordered sum may move a sampled draw across a bucket edge: greedy rows only
    for pp, tp in ((1, 2), (2, 2)):
        engine = _engine(path, pp, tp)
        try:
            # the caches are planned for one rank: its share of the weights, not the whole model
            assert engine.memory_plan.weight_bytes < single.memory_plan.weight_bytes
            done = _run(engine)
            done.pop("seeded")
            assert done == expected, f"pp={pp} tp={tp}"
        finally:
            engine.runner.shutdown()


def test_tied_embedding_and_a_killed_rank(make_checkpoint):
    assert TINY_CONFIGS["qwen3_5_tied"]["tie_word_embeddings"]
    path = make_checkpoint("qwen3_5_tied")
    expected = _run(_engine(path, 1))
    engine = _engine(path, 2)  # the last stage's lm_head is loaded from the first stage's embedding
    try:
        assert _run(engine) == expected
        os.kill(engine.runner._procs[0].pid, signal.SIGKILL)
        engine.add_request("after", PROMPTS[0], SamplingParams(temperature=0, max_tokens=4))
        with pytest.raises(RankFailed, match=r"rank 0 \(pipeline stage 0, tensor-parallel rank 0\) died"):
            while engine.has_unfinished():
                engine.step()
        with pytest.raises(RankFailed, match="rank 0"):  # and every later step says so at once
            engine.step()
    finally:
        engine.runner.shutdown()


def test_cpu_ranks_share_the_host_cores(monkeypatch):
    # each CPU rank takes its share of the threads torch gives one process, at least one
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert [cpu_threads_per_rank(world) for world in (1, 2, 3, 4, 16)] == [8, 4, 2, 2, 1]
