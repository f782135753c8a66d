"""Decode steps of a pipeline stage on its own CUDA-graph buffers (worker/cuda_graph.py): the first stage writes its
(h, residual) to static outputs, the next reads them from static inputs. Both stages run here in one process on
the CPU, eagerly on the padded buffers (the numbers the graphs compute; tests/gpu/test_pipeline_graphs_gpu.py
replays them), against the whole model run plainly."""

from functools import partial

import pytest
import torch

from deltaserve import graph_sizes
from deltaserve.config import ModelConfig
from deltaserve.layers.batch import ForwardBatch
from deltaserve.model.loader import load_model
from deltaserve.worker.cuda_graph import StepGraphs
from deltaserve.worker.distributed import ParallelContext
from deltaserve.worker.kv_cache import CacheShape, bind_caches
from tests.model.helpers import assert_paths_agree, model_bound

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK_SIZE, TABLE_WIDTH, NUM_BLOCKS, SLOTS = 4, 16, 64, 6


def stage_runners(checkpoint, device="cpu", use_graphs=False, dtype=torch.float32):
    """The whole model and the two stages of PP=2, each with bound caches; the stages with their graph buffers."""
    cfg = ModelConfig.from_pretrained(checkpoint)
    shape = CacheShape(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, num_state_slots=SLOTS, kv_dtype=dtype,
                       ssm_dtype=torch.float32)
    models = [load_model(checkpoint, cfg, dtype, device, parallel=parallel)
              for parallel in (ParallelContext(), ParallelContext(pp_rank=0, pp_size=2),
                               ParallelContext(pp_rank=1, pp_size=2))]
    for model in models:
        bind_caches(model, shape, device)
    graphs = [StepGraphs(model, graph_sizes.graph_capture_sizes(4), graph_sizes.chunk_graph_sizes(), TABLE_WIDTH,
                         device, use_graphs=use_graphs, block_size=BLOCK_SIZE) for model in models[1:]]
    return cfg, models, graphs


def prefill(models, prompts: list[list[int]], blocks, device) -> None:
    """Every prompt at once, plainly: the whole model, and stage 0 then stage 1 on its (h, residual)."""
    batch = ForwardBatch.build([0] * len(prompts), [len(p) for p in prompts], blocks, list(range(1, len(prompts) + 1)),
                               BLOCK_SIZE, device=device, block_table_width=TABLE_WIDTH)
    ids = torch.tensor([t for p in prompts for t in p], device=device)
    whole, first, last = models
    whole(ids, batch)
    last(None, batch, None, first(ids, batch))


def decode_both_ways(cfg, models, graphs, device, steps: int = 3):
    """Greedy decode of three prompts: the whole model plainly, and the two stages on their graph buffers.
    Returns both sides' logits of each step, [3, V] each."""
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 9, 3]
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    blocks = [list(range(1 + 4 * i, 5 + 4 * i)) for i in range(len(prompts))]  # 16 tokens each
    prefill(models, prompts, blocks, device)
    whole, *_ = models
    first_graphs, last_graphs = graphs
    plain_steps, staged_steps = [], []
    tokens = [p[-1] for p in prompts]
    for step in range(steps):
        computed = [n + step for n in lengths]
        batch = ForwardBatch.build(computed, [1] * 3, blocks, [1, 2, 3], BLOCK_SIZE, device=device,
                                   block_table_width=TABLE_WIDTH)
        ids = torch.tensor(tokens, device=device)
        plain = whole.compute_logits(whole(ids, batch))
        hidden, residual = first_graphs.run(batch, ids)  # [3, H] each, views of stage 0's static outputs
        staged = last_graphs.run(batch, ids, (hidden, residual))
        plain_steps.append(plain.clone())
        staged_steps.append(staged.clone())
        tokens = plain.argmax(-1).tolist()
    return plain_steps, staged_steps


@torch.inference_mode()
def test_pipeline_stages_decode_on_graph_buffers_as_the_whole_model(ckpt_qwen3_5, monkeypatch):
    """Stage 0 has static outputs and no logits, stage 1 static inputs and logits, neither chunk graphs; three
    greedy decode steps of three sequences through both stages give the whole model's logits."""
    monkeypatch.setenv("DELTASERVE_CHUNK_GRAPHS", "1")
    cfg, models, graphs = stage_runners(ckpt_qwen3_5)
    first, last = graphs
    assert first.stage_input is None and first.stage_output is not None and first.logits is None
    assert last.stage_input is not None and last.stage_output is None and last.logits is not None
    assert first.chunk_sizes == last.chunk_sizes == []
    # what an earlier, larger step left in the padding rows of the static inputs: never read back
    last.stage_input[0].fill_(3.0)
    plain_steps, staged_steps = decode_both_ways(cfg, models, graphs, "cpu")
    bound = partial(model_bound, cfg, 16)
    for plain, staged in zip(plain_steps, staged_steps):
        assert staged.shape == plain.shape == (3, cfg.vocab_size)
        assert_paths_agree(staged, plain, bound, "logits")
