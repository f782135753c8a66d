"""Mixed steps (opt-in: DELTASERVE_MIXED_CHUNK_TOKENS): decodes plus one capped prompt chunk (engine/scheduler.py),
run on the CUDA-graph runner's static padded buffers (worker/cuda_graph.py). On the CPU the runner's buffers run eagerly, as with --enforce-eager on the
GPU: the same padded batch, the same numbers as the graphs (tests/gpu/test_engine_gpu.py replays them)."""

import pytest
import torch

from deltaserve.cache import footprint
from deltaserve.config import ModelConfig
from deltaserve.engine import scheduler as scheduler_module
from deltaserve.layers.batch import ForwardBatch
from deltaserve.model.loader import load_model
from deltaserve.worker.cuda_graph import DecodeGraphs
from deltaserve.worker.kv_cache import CacheShape, bind_caches
from tests.engine.test_scheduler import fake_step, make_request, make_scheduler

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def few_decodes(monkeypatch):
    """Mixed steps from 2 decoding requests (8 in production) up to 8 (128)."""
    monkeypatch.setattr(scheduler_module, "MIXED_MIN_DECODES", 2)
    monkeypatch.setattr(scheduler_module, "MIXED_MAX_DECODES", 8)


def decoding(sched, n):
    """n requests of 4 prompt tokens, each past its prompt."""
    for i in range(n):
        sched.add_request(make_request(f"d{i}", 4, max_tokens=50))
    fake_step(sched)


def layout(out):
    return [(row.request_id, len(row.token_ids)) for row in out.sequences]


def test_a_mostly_decoding_step_takes_one_capped_prompt_chunk_after_its_decodes(few_decodes):
    decodes = [(f"d{i}", 1) for i in range(6)]
    sched = make_scheduler(max_num_seqs=10, budget=64, slots=12, num_blocks=128)
    sched.mixed_chunk_tokens = 8
    decoding(sched, 6)
    for rid, length in (("p", 21), ("q", 5), ("r", 5)):
        sched.add_request(make_request(rid, length))
    out, _ = fake_step(sched)  # 6 decoding of 9 with work: below 0.75, the budget decides
    assert layout(out) == decodes + [("p", 21), ("q", 5), ("r", 5)]

    sched = make_scheduler(max_num_seqs=10, budget=64, slots=12, num_blocks=128)
    sched.mixed_chunk_tokens = 8
    decoding(sched, 6)
    sched.add_request(make_request("p", 21))
    out, _ = fake_step(sched)  # 6 of 7: capped, one chunk, after the decodes
    assert layout(out) == decodes + [("p", 8)]
    sched.add_request(make_request("q", 5))
    out, _ = fake_step(sched)  # 6 of 8: p goes on (running, listed after the decodes); q waits its turn
    assert layout(out) == decodes + [("p", 8)]
    assert [r.request_id for r in sched.waiting] == ["q"]
    out, _ = fake_step(sched)
    assert layout(out) == decodes + [("p", 5)] and out.sequences[-1].sample
    out, _ = fake_step(sched)  # p decodes now, before q's chunk
    assert layout(out) == decodes + [("p", 1), ("q", 5)]


def test_no_cap_with_too_few_or_too_many_decodes(few_decodes):
    for count in (1, 9):
        sched = make_scheduler(max_num_seqs=10, budget=64, slots=12, num_blocks=128)
        sched.mixed_chunk_tokens = 8
        decoding(sched, count)
        sched.add_request(make_request("p", 21))
        out, _ = fake_step(sched)
        assert layout(out)[-1] == ("p", 21)


def test_a_capped_chunk_ends_at_the_prompt_checkpoint_instead_of_saving_inside(few_decodes):
    sched = make_scheduler(max_num_seqs=8, budget=32, slots=10, checkpoints=4)
    sched.mixed_chunk_tokens = 8
    decoding(sched, 4)
    sched.add_request(make_request("p", 13, prompt=list(range(50, 63))))  # block 4: prompt checkpoint at 12
    out, _ = fake_step(sched)
    assert layout(out)[-1] == ("p", 8)
    out, _ = fake_step(sched)  # uncapped, 8..13 would save at 12 inside the step; capped, it stops there
    assert layout(out)[-1] == ("p", 4) and out.sequences[-1].mid_save is None
    assert len(out.state_saves) == 1
    out, _ = fake_step(sched)
    assert layout(out)[-1] == ("p", 1) and out.sequences[-1].sample


def test_mixed_graphs_are_opt_in(monkeypatch):
    monkeypatch.delenv("DELTASERVE_MIXED_CHUNK_TOKENS", raising=False)
    monkeypatch.setenv("DELTASERVE_CHUNK_GRAPHS", "0")  # decode graphs alone: 35 at 256 sequences
    assert footprint.mixed_graph_sizes(256) == [] and footprint.cuda_graph_count(256) == 35
    monkeypatch.setenv("DELTASERVE_MIXED_CHUNK_TOKENS", "128")
    assert footprint.mixed_graph_sizes(256) == list(range(8, 129, 8)) and footprint.mixed_graph_sizes(4) == []
    assert footprint.mixed_graph_sizes(13) == [8, 13] and footprint.cuda_graph_count(256) == 35 + 16
    for bad in ("129", "-1", "x"):
        monkeypatch.setenv("DELTASERVE_MIXED_CHUNK_TOKENS", bad)
        with pytest.raises(ValueError, match="DELTASERVE_MIXED_CHUNK_TOKENS"):
            footprint.mixed_chunk_tokens()


BLOCK_SIZE, TABLE_WIDTH, NUM_BLOCKS = 4, 40, 128


def padded_runner(checkpoint, max_num_seqs: int, slots: int):
    """A float32 CPU model with bound caches and the CUDA-graph runner's buffers over it (run eagerly)."""
    cfg = ModelConfig.from_pretrained(checkpoint)
    model = load_model(checkpoint, cfg, torch.float32, "cpu")
    bind_caches(model, CacheShape(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, num_state_slots=slots,
                                  kv_dtype=torch.float32, ssm_dtype=torch.float32), "cpu")
    graphs = DecodeGraphs(model, max_num_seqs=max_num_seqs, block_table_width=TABLE_WIDTH, device="cpu",
                          use_graphs=False, block_size=BLOCK_SIZE)
    return cfg, model, graphs


def cache_tensors(model) -> list[torch.Tensor]:
    caches = [t for layer in model.attention_layers for t in (layer.k_cache, layer.v_cache)]
    return caches + [model.conv_states, model.ssm_states]


def assert_caches_match(caches, expected_caches):
    """Equal but for the null KV block 0 and the dummy state slot 0 (which padding may write)."""
    for tensor, expected in zip(caches, expected_caches):
        if tensor.dim() == 4 and tensor.shape[0] == NUM_BLOCKS:  # KV: [blocks, block_size, heads, hd]
            torch.testing.assert_close(tensor[1:], expected[1:], atol=1e-4, rtol=1e-4)
        else:  # GDN pools: [layers, slots, ...]
            torch.testing.assert_close(tensor[:, 1:], expected[:, 1:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_decodes, chunk_len", [(3, 9), (8, 128)])  # padded rows; none and a full chunk
def test_mixed_padded_step_computes_what_the_plain_step_does(ckpt_qwen3_5, monkeypatch, num_decodes, chunk_len):
    """The mixed graph's buffers (decodes padded to 8 rows, the chunk padded to 128 rows with a second sequence
    on the dummy slot, empty for a full chunk), run eagerly: the same logits as the step run plainly, and the
    same caches except the dummy state slot 0 and the null KV block 0."""
    monkeypatch.setenv("DELTASERVE_MIXED_CHUNK_TOKENS", "128")
    cfg, model, graphs = padded_runner(ckpt_qwen3_5, max_num_seqs=8, slots=10)
    block_size, width = BLOCK_SIZE, TABLE_WIDTH
    assert graphs.mixed_sizes == [8] and graphs.chunk_tokens == 128
    gen = torch.Generator().manual_seed(4)
    prompt_lens = [7, 11, 5, 9, 6, 10, 3, 8][:num_decodes] + [6]  # the last one continues with the chunk
    slots = list(range(1, len(prompt_lens) + 1))
    blocks, next_block = [], 1
    for length in prompt_lens[:-1] + [prompt_lens[-1] + chunk_len]:
        count = -(-(length + 1) // block_size)
        blocks.append(list(range(next_block, next_block + count)))
        next_block += count
    with torch.no_grad():
        model(torch.randint(0, cfg.vocab_size, (sum(prompt_lens),), generator=gen),
              ForwardBatch.build([0] * len(prompt_lens), prompt_lens, blocks, slots, block_size))
    caches = cache_tensors(model)
    before = [t.clone() for t in caches]
    # the decodes, then the last sequence's chunk after its cached prompt
    batch = ForwardBatch.build(prompt_lens, [1] * num_decodes + [chunk_len], blocks, slots, block_size,
                               block_table_width=width)
    ids = torch.randint(0, cfg.vocab_size, (num_decodes + chunk_len,), generator=gen)
    with torch.no_grad():
        plain = model.compute_logits(model(ids, batch))[batch.logits_indices]
    plain_caches = [t.clone() for t in caches]
    for chunk_samples in (True, False):
        for tensor, saved in zip(caches, before):
            tensor.copy_(saved)
        with torch.no_grad():
            mixed = graphs.run_mixed(batch, ids, chunk_samples=chunk_samples)
        torch.testing.assert_close(mixed, plain[: num_decodes + chunk_samples], atol=1e-4, rtol=1e-4)
        # float32 rounding differs by path (the decode rows' GDN step vs the chunked rule) and grows layer by layer
        assert_caches_match(caches, plain_caches)


def test_chunk_graphs_are_on_unless_turned_off(monkeypatch):
    monkeypatch.delenv("DELTASERVE_CHUNK_GRAPHS", raising=False)
    monkeypatch.delenv("DELTASERVE_MIXED_CHUNK_TOKENS", raising=False)
    all_sizes = [16, 32, 64, 128, 256, 512, 1024]
    assert footprint.chunk_graph_sizes() == all_sizes and footprint.cuda_graph_count(256) == 35 + 7
    monkeypatch.setenv("DELTASERVE_CHUNK_GRAPHS", "0")
    assert footprint.chunk_graph_sizes() == [] and footprint.cuda_graph_count(256) == 35
    monkeypatch.setenv("DELTASERVE_CHUNK_GRAPHS", "1")
    assert footprint.chunk_graph_sizes() == all_sizes
    monkeypatch.setenv("DELTASERVE_CHUNK_GRAPHS", "yes")
    with pytest.raises(ValueError, match="DELTASERVE_CHUNK_GRAPHS must be 0 or 1, got 'yes'"):
        footprint.chunk_graph_sizes()


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
    monkeypatch.delenv("DELTASERVE_MIXED_CHUNK_TOKENS", raising=False)
    cfg, model, graphs = padded_runner(ckpt_qwen3_5, max_num_seqs=4, slots=4)
    block_size = BLOCK_SIZE
    assert graphs.chunk_sizes == [16, 32, 64, 128, 256, 512, 1024] and graphs.single_size(1) is None
    saves = [(0, save_at, 3)] if save_at is not None else []
    if saves:
        assert graphs.single_size(chunk_len, saves_inside=True) >= footprint.PADDED_CHUNK_MIN_ROWS
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
    torch.testing.assert_close(single, plain, atol=1e-4, rtol=1e-4)
    assert_caches_match(caches, plain_caches)


def test_padded_graphs_hold_a_block(ckpt_qwen3_5, monkeypatch):
    """A padded graph re-runs its last block's rows: with 512-token blocks the 256-row one is not captured."""
    monkeypatch.setenv("DELTASERVE_CHUNK_GRAPHS", "1")
    cfg = ModelConfig.from_pretrained(ckpt_qwen3_5)
    model = load_model(ckpt_qwen3_5, cfg, torch.float32, "cpu")
    graphs = DecodeGraphs(model, max_num_seqs=4, block_table_width=4, device="cpu", use_graphs=False, block_size=512)
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
    monkeypatch.delenv("DELTASERVE_MIXED_CHUNK_TOKENS", raising=False)
    padded = LLM(ckpt_qwen3_5, block_size=4, max_num_seqs=4)
    plain = LLM(ckpt_qwen3_5, block_size=4, max_num_seqs=4)
    runner = padded.engine.runner
    runner.graphs = DecodeGraphs(runner.model, max_num_seqs=4, block_table_width=-(-padded.engine.max_model_len // 4),
                                 device="cpu", use_graphs=False, block_size=4)
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
