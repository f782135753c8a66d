"""Structured output on the GPU: bf16 with CUDA graphs, the grammar mask applied outside the graphs by xgrammar's
Triton kernel, the bitmask copied from pinned memory while the forward runs (async scheduling).

Run on an H200 by tests/gpu/run.sh (the compile test in the first, fresh process, beside the engine's)."""

import json

import jsonschema
import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.structured import StructuredOutputsParams as Constraint
from tests.structured.schemas import random_schema

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = ["Give me the record as JSON:", "The traveller walked from the mountains to the sea", "{"]


def _params(seed: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0 if seed % 2 else 1.0, seed=seed, max_tokens=600,
                          structured_outputs=Constraint(json=random_schema(seed)), **kwargs)


@pytest.fixture(scope="module")
def graphs(make_checkpoint):
    return LLM(str(make_checkpoint("qwen3_5")), dtype="bfloat16", max_num_seqs=64, enforce_eager=False)


def test_fifty_random_schemas_validate_with_graphs(graphs):
    outputs = graphs.generate([PROMPTS[i % 3] for i in range(50)], [_params(i) for i in range(50)], use_tqdm=False)
    for i, output in enumerate(outputs):
        assert output.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(output.outputs[0].text), random_schema(i))


def test_graphs_equal_eager_and_free_rows_are_untouched(make_checkpoint, graphs):
    """Greedy: graphs and eager run the same padded batch, so give the same tokens. Free rows beside 17
    constrained ones get the tokens they get beside 17 free twins of them: every row runs 40 steps either way
    (the constrained rows' array cannot end sooner), so every step has the same shape and the free rows the
    same logits, bit for bit, in bf16 too."""
    eager = LLM(str(make_checkpoint("qwen3_5")), dtype="bfloat16", max_num_seqs=64, enforce_eager=True)
    # the same schedule in both: the module's engine has cached the 17-token prompt's first block in the tests
    # before, and a prefix hit prefills its rest from a GDN checkpoint (other bf16 roundings than from scratch)
    assert graphs.reset_prefix_cache()
    prompts = [PROMPTS[i % 3] for i in range(17)] + PROMPTS

    def tokens(llm, params):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    constrained = [SamplingParams(temperature=0, max_tokens=300, structured_outputs=Constraint(
        json=random_schema(seed))) for seed in range(1, 18)]  # 17 rows: neither 1 nor a multiple of 16
    assert tokens(graphs, constrained + [free] * 3) == tokens(eager, constrained + [free] * 3)
    endless = Constraint(json={"type": "array", "minItems": 200, "items": random_schema(5)})
    beside_constrained = tokens(graphs, [SamplingParams(temperature=0, max_tokens=40, structured_outputs=endless)] * 17
                                + [free] * 3)
    beside_free = tokens(graphs, [free] * 20)
    assert all(len(t) == 40 for t in beside_constrained)
    assert beside_constrained[17:] == beside_free[17:]


def test_constrained_traffic_compiles_no_kernel_after_start_up(make_checkpoint, monkeypatch):
    """The mask kernel's variants (1 row, a multiple of 16, any other count) are compiled at start-up; a
    constrained row count of each class after it compiles nothing. Meaningful only in a fresh process (Triton
    keeps what it compiled), as tests/gpu/run.sh runs it."""
    import triton

    llm = LLM(str(make_checkpoint("qwen3_5")), dtype="bfloat16", max_num_seqs=32, enforce_eager=False)
    compiled = []

    def record(*, fn, compile, **_):
        compiled.append(f"{fn.name}: {compile['signature']} {compile['configs']} {compile.get('constants')}")
        return False

    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", record)
    for count in (1, 3, 16, 17):
        prompts = [PROMPTS[i % 3] for i in range(count + 2)]
        params = [_params(100 + i, ignore_eos=False) for i in range(count)]
        params += [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 2
        llm.generate(prompts, params, use_tqdm=False)
    assert not compiled, "\n".join(compiled)
