"""`projection_weights` names every weight shape that `ops.linear` multiplies, so that start-up can warm up the
skinny GEMM's kernels for each (`ops.linear.warm_up_skinny`); a shape it missed would compile while serving."""

import pytest

import deltaserve.ops.linear as ops_linear
from deltaserve import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_projection_weights_cover_every_product_of_a_step(tiny_checkpoint, monkeypatch):
    multiplied = set()
    choose = ops_linear._skinny_config

    def recording(x, weight):  # every product ops.linear runs asks for the skinny GEMM's tile first
        multiplied.add(tuple(weight.shape))
        return choose(x, weight)

    monkeypatch.setattr(ops_linear, "_skinny_config", recording)
    llm = LLM(str(tiny_checkpoint), max_num_seqs=4)
    llm.generate([[1, 2, 3, 4, 5], [6, 7]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    model = llm.engine.runner.model
    warmed = [tuple(weight.shape) for weight in model.projection_weights()]
    assert multiplied and multiplied == set(warmed)
    assert len(warmed) == len(set(warmed))  # one weight a shape
