"""Pipeline parallelism on the CPU (gloo): greedy tokens of PP=2 and PP=4 (uneven: 6 layers as 2, 2, 1, 1)
engines equal the single-process engine's over batched, chunked and prefix-cached requests; a killed rank
gives a clear error, not a hang."""

import os
import signal

import pytest

from deltaserve.config import EngineConfig
from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.sampling import SamplingParams
from deltaserve.worker.executor import RankFailed

PROMPTS = [[(7 * i + 3 * j) % 200 + 1 for j in range(n)] for i, n in enumerate((5, 40, 13, 70))]


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    engine.add_request("hit", PROMPTS[3][:-4] + [9, 8, 7], params)  # shares a prefix with r3
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def _engine(path, pp: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", pipeline_parallel_size=pp,
                                  max_num_batched_tokens=32, max_model_len=256, skip_tokenizer_init=True))


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_pipeline_matches_single_process(make_checkpoint, arch):
    path = make_checkpoint(arch)
    expected = _run(_engine(path, 1))
    for pp in (2, 4):
        engine = _engine(path, pp)
        assert _run(engine) == expected, f"pp={pp}"
        engine.runner.shutdown()


def test_killed_rank_is_reported(make_checkpoint):
    engine = _engine(make_checkpoint("qwen3_5"), 2)
    os.kill(engine.runner._procs[0].pid, signal.SIGKILL)
    engine.add_request("r", PROMPTS[0], SamplingParams(temperature=0, max_tokens=4))
    with pytest.raises(RankFailed, match="rank 0"):
        while engine.has_unfinished():
            engine.step()
    engine.runner.shutdown()
