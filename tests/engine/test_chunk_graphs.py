"""Single-chunk steps on the CUDA-graph runner's static padded buffers (worker/cuda_graph.py). On the CPU the
runner's buffers run eagerly, as with --enforce-eager on the GPU: the same padded batch, the same numbers as the
graphs (tests/gpu/test_engine_gpu.py replays them)."""

from functools import partial

import pytest
import torch

from deltaserve import graph_sizes
from deltaserve.config import ModelConfig
from deltaserve.layers.batch import ForwardBatch
from deltaserve.model.loader import load_model
from deltaserve.worker.cuda_graph import StepGraphs
from deltaserve.worker.kv_cache import CacheShape, bind_caches
from tests.model.helpers import assert_paths_agree, model_bound

pytestmark = pytest.mark.usefixtures("one_torch_thread")


BLOCK_SIZE, TABLE_WIDTH, NUM_BLOCKS = 4, 40, 128


def padded_runner(checkpoint, max_num_seqs: int, slots: int):
    """A float32 CPU model with bound caches and the CUDA-graph runner's buffers over it (run eagerly)."""
    cfg = ModelConfig.from_pretrained(checkpoint)
    model = load_model(checkpoint, cfg, torch.float32, "cpu")
    bind_caches(model, CacheShape(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, num_state_slots=slots,
                                  kv_dtype=torch.float32, ssm_dtype=torch.float32), "cpu")
    graphs = StepGraphs(model, graph_sizes.graph_capture_sizes(max_num_seqs), graph_sizes.chunk_graph_sizes(),
                        block_table_width=TABLE_WIDTH, device="cpu", use_graphs=False, block_size=BLOCK_SIZE)
    return cfg, model, graphs


def cache_tensors(model) -> list[torch.Tensor]:
    caches = [t for layer in model.attention_layers for t in (layer.k_cache, layer.v_cache)]
    return caches + [model.conv_states, model.ssm_states]


def assert_caches_match(caches, expected_caches, bound):
    """Equal within the two float32 paths' bound but for the null KV block 0 and the dummy state slot 0 (which
    padding may write)."""
    for tensor, expected in zip(caches, expected_caches):
        if tensor.dim() == 4 and tensor.shape[0] == NUM_BLOCKS:  # KV: [blocks, block_size, heads, hd]
            assert_paths_agree(tensor[1:], expected[1:], bound, "KV cache")
        else:  # GDN pools: [layers, slots, ...]
            assert_paths_agree(tensor[:, 1:], expected[:, 1:], bound, "GDN pool")


def test_chunk_graphs_are_on_unless_turned_off(monkeypatch):
    monkeypatch.delenv("DELTASERVE_CHUNK_GRAPHS", raising=False)
    all_sizes = [16, 32, 64, 128, 256, 512, 1024]
    assert graph_sizes.chunk_graph_sizes() == all_sizes and graph_sizes.cuda_graph_count(256) == 35 + 7
    monkeypatch.setenv("DELTASERVE_CHUNK_GRAPHS", "0")
    assert graph_sizes.chunk_graph_sizes() == [] and graph_sizes.cuda_graph_count(256) == 35
    monkeypatch.setenv("DELTASERVE_CHUNK_GRAPHS", "1")
    assert graph_sizes.chunk_graph_sizes() == all_sizes
    monkeypatch.setenv("DELTASERVE_CHUNK_GRAPHS", "yes")
    with pytest.raises(ValueError, match="DELTASERVE_CHUNK_GRAPHS must be 0 or 1, got 'yes'"):
        graph_sizes.chunk_graph_sizes()


# (tokens cached before, chunk length, checkpoint offset inside the step or None): padded to 16-128 rows (a fresh
# full chunk, a 128-row bucket); 256- and 512-row padded graphs without a checkpoint, and with one a block before
# the end (fresh, after a prefix); a 20-token chunk with one takes the 256-row graph
@pytest.mark.parametrize("cached, chunk_len, save_at", [(9, 5, None), (0, 16, None), (6, 100, None), (0, 200, None),
                                                         (9, 300, None), (0, 203, 200), (9, 130, 128), (0, 20, 16)])
def test_single_chunk_padded_step_computes_what_the_plain_step_does(ckpt_qwen3_5, monkeypatch, cached, chunk_len,
                                                                    save_at):
    """The single-chunk graph's buffers (the chunk padded by a second sequence on the dummy slot; from 256 rows fla
    over all rows with the padding masked, a checkpoint inside the step taken: layers/batch.PaddedChunk), run
    eagerly: the same logits as the step run plainly, and the same caches (the checkpoint slot 3 included) except
    the dummy state slot 0 and the null KV block 0, whatever earlier steps left in the static buffers."""
    monkeypatch.setenv("DELTASERVE_CHUNK_GRAPHS", "1")
    cfg, model, graphs = padded_runner(ckpt_qwen3_5, max_num_seqs=4, slots=4)
    block_size = BLOCK_SIZE
    assert graphs.chunk_sizes == [16, 32, 64, 128, 256, 512, 1024] and graphs.single_size(1) is None
    saves = [(0, save_at, 3)] if save_at is not None else []
    if saves:
        assert graphs.single_size(chunk_len, saves_inside=True) >= graph_sizes.PADDED_CHUNK_MIN_ROWS
    gen = torch.Generator().manual_seed(cached + chunk_len)
    blocks = [list(range(1, 2 + (cached + chunk_len) // block_size))]
    with torch.no_grad():
        if cached:
            model(torch.randint(0, cfg.vocab_size, (cached,), generator=gen),
                  ForwardBatch.build([0], [cached], blocks, [2], block_size))
    caches = cache_tensors(model)
    before = [t.clone() for t in caches]
    batch = ForwardBatch.build([cached], [chunk_len], blocks, [2], block_size,
                               block_table_width=max(TABLE_WIDTH, len(blocks[0])), mid_saves=saves)
    ids = torch.randint(0, cfg.vocab_size, (chunk_len,), generator=gen)
    with torch.no_grad():
        plain = model.compute_logits(model(ids, batch))[batch.logits_indices]
    plain_caches = [t.clone() for t in caches]
    for tensor, saved in zip(caches, before):
        tensor.copy_(saved)
    # what an earlier step may have left in the static buffers: real KV slots, the real state slot, real blocks, a
    # padded plan stopping elsewhere with a checkpoint
    graphs.single.slot_mapping.copy_(torch.arange(4, 4 + graphs.single.slot_mapping.shape[0]))
    graphs.single.state_slots.fill_(2)
    graphs.single.block_tables.fill_(1)
    graphs.single.has_initial_state.fill_(True)
    graphs.padded.set(256, 100, 97, 3)
    with torch.no_grad():
        single = graphs.run_single(batch, ids, (save_at, 3) if saves else None)
    bound = partial(model_bound, cfg, cached + chunk_len)
    assert_paths_agree(single, plain, bound, "logits")
    assert_caches_match(caches, plain_caches, bound)


def test_padded_graphs_hold_a_block(ckpt_qwen3_5, monkeypatch):
    """A padded graph re-runs its last block's rows: with 512-token blocks the 256-row one is not captured."""
    monkeypatch.setenv("DELTASERVE_CHUNK_GRAPHS", "1")
    cfg = ModelConfig.from_pretrained(ckpt_qwen3_5)
    model = load_model(ckpt_qwen3_5, cfg, torch.float32, "cpu")
    graphs = StepGraphs(model, graph_sizes.graph_capture_sizes(4), graph_sizes.chunk_graph_sizes(), block_table_width=4,
                        device="cpu", use_graphs=False, block_size=512)
    assert graphs.chunk_sizes == [16, 32, 64, 128, 512, 1024] and sorted(graphs.padded.plans) == [512, 1024]
    assert graphs.single_size(200) == 512 and graphs.single_size(20, saves_inside=True) == 512


def test_padded_plans_refuse_a_stop_they_cannot_take(ckpt_qwen3_5, monkeypatch):
    monkeypatch.setenv("DELTASERVE_CHUNK_GRAPHS", "1")
    _, _, graphs = padded_runner(ckpt_qwen3_5, max_num_seqs=4, slots=4)
    assert sorted(graphs.padded.plans) == [256, 512, 1024]
    for chunk_len, stop in ((100, 95), (100, 0), (300, 300)):  # more than a block before the end; none; too long
        with pytest.raises(ValueError, match=f"a padded step of {chunk_len} tokens in 256 rows cannot stop"):
            graphs.padded.set(256, chunk_len, stop, 0)


def test_engine_routes_single_short_chunks_to_the_chunk_graphs(ckpt_qwen3_5, monkeypatch):
    """The runner's routing, on the CPU with the graph runner's buffers attached (run eagerly): fresh prompts and
    prefix-cache hits' suffixes run as single chunks (those with a checkpoint inside the step in a padded graph),
    decodes do not, and the tokens and log-probabilities match an engine without the graph runner (the hits read
    the checkpoint that the padded step saved)."""
    from deltaserve import LLM, SamplingParams

    monkeypatch.setenv("DELTASERVE_CHUNK_GRAPHS", "1")
    padded = LLM(ckpt_qwen3_5, block_size=4, max_num_seqs=4)
    plain = LLM(ckpt_qwen3_5, block_size=4, max_num_seqs=4)
    runner = padded.engine.runner
    runner.graphs = StepGraphs(runner.model, graph_sizes.graph_capture_sizes(4), graph_sizes.chunk_graph_sizes(),
                               block_table_width=-(-padded.engine.max_model_len // 4), device="cpu", use_graphs=False,
                               block_size=4)
    calls, run_single = [], runner.graphs.run_single
    monkeypatch.setattr(runner.graphs, "run_single", lambda batch, ids, mid_save: calls.append(ids.shape[0]) or
                        run_single(batch, ids, mid_save))
    gen = torch.Generator().manual_seed(9)
    base = torch.randint(0, 1000, (150,), generator=gen).tolist()
    # fresh 3 tokens; fresh 150 (its prompt-end checkpoint at 148 saved inside the step: a padded graph); a hit
    # there with 4 new tokens (one block: no checkpoint of its own inside the step); one with 6 saves one inside
    prompts = [base[:3], base, base[:148] + [7, 8, 9, 10], base[:148] + [7, 8, 9, 10, 11, 12]]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=0)
    for llm in (padded, plain):
        outputs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        if llm is padded:
            first = outputs
    assert calls == [3, 150, 4, 6], calls
    assert first[2].num_cached_tokens == first[3].num_cached_tokens == 148
    for a, b in zip(first, outputs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert abs(a.outputs[0].cumulative_logprob - b.outputs[0].cumulative_logprob) < 1e-3
