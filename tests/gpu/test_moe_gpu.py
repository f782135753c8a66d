"""The fused MoE path (ops/moe) on the GPU: the fused experts and the sparse block with its shared-expert slot
(ops.moe.sparse_block) against the torch reference at Qwen3.5-35B-A3B's shapes (bf16, tiles from the shipped
table; plain prompt chunks on the tiles too), the routing folded into kernel A / the align kernel against the
routing kernel bitwise, CUDA-graph replay against eager, a token against the batch it sits in, stacked quantized
experts (FP8, int4, NVFP4) against the float64 value of their semantics (one token also with kernel A's K split),
and through the engine on tiny MoE checkpoints (the shared expert apart and in the slot). Run by tests/gpu/run.sh
(TESTS=tests/gpu/test_moe_gpu.py ... tests)."""

import dataclasses

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.demo import build_checkpoint
from deltaserve.layers.mlp import SparseMoE
from deltaserve.ops import moe
from deltaserve.ops.moe import configs, quantized, reference
from deltaserve.ops.moe import cuda as moe_cuda
from tests.gpu.logits import prompt
from deltaserve.ops.quant_gemm import reference as quant_ref
from tests.ops.moe_oracle import (combine_exact, experts_bound, quantized_experts_exact, shared_bound,
                                  sparse_block_bound)
from tests.tolerance import assert_within

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Qwen3.5-35B-A3B: hidden, experts, top-k, expert and shared-expert intermediate sizes
HIDDEN, EXPERTS, TOP_K, INTER, SHARED = 2048, 256, 8, 512, 512
QUANT_EXPERTS = 32  # the quantized stacks' expert count: the shapes are 35B-A3B's, fewer experts keep the oracle quick
U_TC16, U_TC8 = 2.0**-23, 2.0**-12  # Hopper's tensor-core accumulation: 16-bit and FP8 inputs (quant_gemm_oracle)


@pytest.fixture(scope="module")
def block_35b():
    """One MoE block of 35B-A3B's shapes in bf16, weights std 1 / sqrt(fan_in) as a trained model's scale."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        block = SparseMoE(HIDDEN, EXPERTS, TOP_K, INTER, SHARED, norm_topk_prob=True)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, param.shape[-1] ** -0.5)
    block = block.to(torch.bfloat16)
    block.fuse()  # as the loader does: router, shared gate and shared gate/up joined into one weight
    block.shared_expert.fuse()
    return block


def inputs(tokens: int, seed: int) -> torch.Tensor:
    return torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed)).to("cuda", torch.bfloat16)


@pytest.mark.parametrize("tokens", [1, 2, 8, 16, 64])
def test_fused_matches_grouped_matmul_at_35b_shapes(block_35b, tokens):
    x = inputs(tokens, tokens)
    experts = block_35b.experts
    gate_up, down = experts.gate_up_proj, experts.down_proj
    with torch.no_grad():
        ids, weights = moe.route(block_35b.gate(x), TOP_K, True)
        assert moe.fused_serves(x, gate_up, down, TOP_K)
        got = moe.experts(x, ids, weights, gate_up, down)
        want = reference.grouped_experts(x, ids, weights, gate_up, down)
        bound = experts_bound(x, ids, weights, gate_up, down, fused_bf16=True, reference_bf16=True)
        assert_within(got, want, bound, f"fused experts, {tokens} tokens")
        shared = (block_35b.shared_expert(x), block_35b.shared_expert_gate(x))
        got = moe.experts(x, ids, weights, gate_up, down, shared)
        want = reference.grouped_experts(x, ids, weights, gate_up, down, shared=shared)
        assert_within(got, want, bound + shared_bound(*shared, torch.bfloat16) + 2 * 2.0**-8 * want.double().abs(),
                      f"fused experts + shared, {tokens} tokens")  # + the final rounding to bf16 of each side


@pytest.mark.parametrize("tokens", [300, 2047])
def test_plain_prompt_chunks_on_the_tiles_match_grouped_matmul_at_35b_shapes(block_35b, tokens):
    """Plain experts' prompt chunks on the fused tiles (taken where the table names the bucket:
    configs.prompt_tiles_tabled): the default tiles and the table's for the bucket against torch's grouped matmul,
    with the gated shared expert, within the bound of both sides' bf16 roundings."""
    x = inputs(tokens, 400 + tokens)
    gate_up, down = block_35b.experts.gate_up_proj, block_35b.experts.down_proj
    with torch.no_grad():
        ids, weights = moe.route(block_35b.gate(x), TOP_K, True)
        shared = (block_35b.shared_expert(x), block_35b.shared_expert_gate(x))
        want = reference.grouped_experts(x, ids, weights, gate_up, down, shared=shared)
        bound = (experts_bound(x, ids, weights, gate_up, down, fused_bf16=True, reference_bf16=True)
                 + shared_bound(*shared, torch.bfloat16) + 2 * 2.0**-8 * want.double().abs())
        for tiles in {configs.default_tiles(tokens), configs.tiles_for(EXPERTS, TOP_K, HIDDEN, INTER, tokens)}:
            got = moe_cuda.fused_experts(x, ids, weights, gate_up, down, tiles, shared)
            assert_within(got, want, bound, f"plain prompt chunk on {tiles}, {tokens} tokens")


@pytest.mark.parametrize("experts,top_k", [(EXPERTS, TOP_K), (512, 10)])  # 35B-A3B's, 122B-A10B's
@pytest.mark.parametrize("tokens", [16, 300, 8192])
def test_align_sorts_the_pairs_of_a_prompt_chunk(experts, top_k, tokens):
    """The align kernel's order (pairs by expert, then pair) is torch's stable sort by expert, and its blocks cover
    it in order, at a decode batch and at prompt chunks whose programs place many chunks each."""
    ids, _ = moe_cuda.route(torch.randn(tokens, experts, device="cuda", generator=torch.Generator("cuda").manual_seed(
        tokens)), top_k, True)
    sorted_pairs, table = moe_cuda.align(ids, experts, 64)
    flat = ids.reshape(-1).long()
    assert torch.equal(sorted_pairs.long(), torch.sort(flat, stable=True).indices)
    used = int((table[2] > 0).sum())
    assert table[2, used:].eq(0).all()
    expert, first, rows = table[:, :used].long()
    assert torch.equal(torch.bincount(expert, weights=rows.double(), minlength=experts).long(),
                       torch.bincount(flat, minlength=experts))
    assert first[0] == 0 and torch.equal(first[1:], first[:-1] + rows[:-1])  # consecutive, in order


@pytest.mark.parametrize("tokens", [65, 300])
def test_prefill_experts_sum_the_grouped_outputs_at_35b_shapes(block_35b, tokens):
    """Above the fused kernels' sizes ops.moe.experts runs torch's grouped matmul, then cuda.combine: its output
    against the exact weighted sum of the same grouped outputs (reference.expert_outputs), with and without the
    gated shared expert, and equal bitwise to cuda.combine over them (the grouped matmul gives the same bits)."""
    x = inputs(tokens, tokens)
    gate_up, down = block_35b.experts.gate_up_proj, block_35b.experts.down_proj
    with torch.no_grad():
        ids, weights = moe.route(block_35b.gate(x), TOP_K, True)
        assert not moe.fused_serves(x, gate_up, down, TOP_K)
        y, pair_rows = reference.expert_outputs(x, ids, gate_up, down)
        for shared in (None, (block_35b.shared_expert(x), block_35b.shared_expert_gate(x))):
            got = moe.experts(x, ids, weights, gate_up, down, shared)
            exact, bound = combine_exact(y, pair_rows, weights, shared)
            assert_within(got, exact, bound, f"prefill experts, {tokens} tokens, shared {shared is not None}")
            assert torch.equal(got, moe_cuda.combine(y, pair_rows, weights, shared))


def distinct_logits(tokens: int, seed: int) -> torch.Tensor:
    """[T, E + 1] bf16: router logits without ties (each row a permutation of E values 0.0925 apart, more than
    bf16's spacing below 16, plus an offset) | the shared gate's logit."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.stack([torch.randperm(EXPERTS, generator=gen) for _ in range(tokens)]).double()
    logits = (rows - EXPERTS / 2) * 0.0925 + torch.randn(tokens, 1, generator=gen, dtype=torch.float64)
    return torch.cat([logits, torch.randn(tokens, 1, generator=gen, dtype=torch.float64)], 1).to("cuda", torch.bfloat16)


def shared_weights(block):
    return block.shared_expert.gate_up_weight, block.shared_expert.down_proj.weight


@pytest.mark.parametrize("tokens", [1, 2, 8, 16, 64])
def test_sparse_block_matches_reference_at_35b_shapes(block_35b, tokens):
    """The shared expert as the fused kernels' slot, the routing inside them, against reference.sparse_block."""
    x, projected = inputs(tokens, 200 + tokens), distinct_logits(tokens, tokens)
    logits, gate = projected[:, :EXPERTS], projected[:, EXPERTS:]  # views of one [T, E + 1] projection
    experts = block_35b.experts
    operands = (experts.gate_up_proj, experts.down_proj, *shared_weights(block_35b))
    with torch.no_grad():
        assert moe.shared_slot_serves(x[:1], *operands, TOP_K)  # the block's weights take the slot
        tiles = configs.tiles_for(EXPERTS, TOP_K, HIDDEN, INTER, tokens)
        got, ids, _ = moe_cuda.fused_moe(x, logits, TOP_K, True, *operands, gate, tiles)
        assert torch.equal(ids.long(), reference.route(logits, TOP_K, True)[0])
        want = reference.sparse_block(x, logits, TOP_K, True, *operands, gate)
        bound = sparse_block_bound(x, logits, TOP_K, True, *operands, gate, fused_bf16=True, reference_bf16=True)
    assert_within(got, want, bound, f"sparse block, {tokens} tokens")


@pytest.mark.parametrize("route_warps", [1, 2, 4])
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_folded_routing_is_the_routing_kernels_bitwise(block_35b, tokens, route_warps):
    """Kernel A's routing (one token) and the align kernel's (more), on other tiles and warps than the routing
    kernel's (whatever its warps), give its ids and weights bit for bit."""
    x, projected = inputs(tokens, 300 + tokens), distinct_logits(tokens, 300 + tokens)
    projected[:, :EXPERTS] += torch.randn(tokens, EXPERTS, device="cuda").to(torch.bfloat16)  # near-ties too
    logits, gate = projected[:, :EXPERTS], projected[:, EXPERTS:]
    experts = block_35b.experts
    operands = (experts.gate_up_proj, experts.down_proj, *shared_weights(block_35b))
    with torch.no_grad():
        tiles = configs.tiles_for(EXPERTS, TOP_K, HIDDEN, INTER, tokens)
        _, ids, weights = moe_cuda.fused_moe(x, logits, TOP_K, True, *operands, gate, tiles)
        want_ids, want_weights = moe_cuda.route(logits, TOP_K, True, route_warps)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)


@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_graph_replay_equals_eager_bitwise(block_35b, tokens):
    x = inputs(tokens, 100 + tokens)
    with torch.no_grad():
        eager = block_35b(x)
        block_35b(x)  # compiled before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = block_35b(x)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(captured, eager)


def test_a_pair_does_not_depend_on_the_batch(block_35b):
    """Token 0 alone and among 64 tokens (the same tiles, the 64-token bucket's): bitwise the same block output."""
    x = inputs(64, 7)
    tiles = configs.tiles_for(EXPERTS, TOP_K, HIDDEN, INTER, 64)
    experts = block_35b.experts
    with torch.no_grad():
        ids, weights = moe.route(block_35b.gate(x), TOP_K, True)
        ids[1:9] = ids[0]  # its experts shared with other tokens
        batch = moe_cuda.fused_experts(x, ids, weights, experts.gate_up_proj, experts.down_proj, tiles)
        alone = moe_cuda.fused_experts(x[:1], ids[:1], weights[:1], experts.gate_up_proj, experts.down_proj, tiles)
    assert torch.equal(batch[:1], alone)


def test_a_token_does_not_depend_on_the_batch_in_the_sparse_block(block_35b):
    """fused_moe: token 0 alone (kernel A routes it) and among 64 tokens (the align kernel routes them; its experts
    and its shared-slot block shared with others), the 64-token bucket's tiles: bitwise the same output."""
    x, projected = inputs(64, 8), distinct_logits(64, 8)
    projected[1:9] = projected[0]
    logits, gate = projected[:, :EXPERTS], projected[:, EXPERTS:]
    experts = block_35b.experts
    operands = (experts.gate_up_proj, experts.down_proj, *shared_weights(block_35b))
    tiles = configs.tiles_for(EXPERTS, TOP_K, HIDDEN, INTER, 64)
    with torch.no_grad():
        batch = moe_cuda.fused_moe(x, logits, TOP_K, True, *operands, gate, tiles)[0]
        alone = moe_cuda.fused_moe(x[:1], logits[:1], TOP_K, True, *operands, gate[:1], tiles)[0]
    assert torch.equal(batch[:1], alone)


@pytest.mark.parametrize("arch,shared_size", [("qwen3_5_moe", None), ("qwen3_next", None), ("qwen3_5_moe", 24),
                                              ("qwen3_next", 24)])
@pytest.mark.parametrize("gemv", [False, True], ids=["tiles", "gemv"])
def test_engine_greedy_tokens_fused_equal_torch_path(arch, shared_size, gemv, tmp_path, monkeypatch):
    """Through the engine, float32 on a tame checkpoint (matrix_gain 0.5, as test_engine_gpu's parity test): the
    fused path (its kernels taking float32 here, with IEEE dots) and the torch path give the same greedy tokens;
    the demo's shared expert (32) apart from the experts (24), or of their size (the shared slot, fused_moe);
    gemv: one token on the GEMV kernels (a table entry's "gemv" at bucket 1), the tiles above.
    (bf16 graphs == eager on the fused path: test_engine_gpu.py::test_cuda_graphs_equal_eager_token_for_token.)"""
    if gemv:
        rows = configs.MoeTiles(16, configs.Tile(8, 32, 4, 1), configs.Tile(8, 32, 4, 1), gemv=True)
        shipped_tiles = moe.tiles_for
        monkeypatch.setattr(moe, "tiles_for", lambda *shape: rows if shape[4] == 1 else shipped_tiles(*shape))
        row_calls = []
        row_products = moe_cuda._row_products
        monkeypatch.setattr(moe_cuda, "_row_products", lambda *args: row_calls.append(1) or row_products(*args))
    overrides = None if shared_size is None else {"shared_expert_intermediate_size": shared_size}
    path = str(build_checkpoint(tmp_path, arch, matrix_gain=0.5, config_overrides=overrides))
    prompts = [prompt(n, 20 + n) for n in (5, 40, 1, 17)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    launched = {"fused_experts": [], "fused_moe": []}

    def recording(name):
        kernel = getattr(moe_cuda, name)

        def record(*args, **kwargs):
            launched[name].append(args[0].shape[0])
            return kernel(*args, **kwargs)
        return record

    monkeypatch.setattr(moe, "FUSED_DTYPES", (torch.float32,))
    for name in launched:
        monkeypatch.setattr(moe_cuda, name, recording(name))
    fused = [o.outputs[0].token_ids for o in LLM(path, dtype="float32", max_num_seqs=8).generate(
        prompts, params, use_tqdm=False)]
    if shared_size is None:  # the experts alone, at every decode batch
        assert launched["fused_experts"] and max(launched["fused_experts"]) <= moe.FUSED_MAX_TOKENS
        assert not launched["fused_moe"]
    else:  # the shared slot up to SHARED_SLOT_MAX_TOKENS tokens, the experts beside the shared expert above
        assert launched["fused_moe"] and max(launched["fused_moe"]) <= moe.SHARED_SLOT_MAX_TOKENS
        assert min(launched["fused_experts"]) > moe.SHARED_SLOT_MAX_TOKENS
    if gemv:
        assert row_calls  # the one-token steps ran the GEMV kernels
    monkeypatch.setattr(moe, "fused_serves", lambda *args: False)
    monkeypatch.setattr(moe, "_route_on_gpu", lambda logits: False)
    torch_path = [o.outputs[0].token_ids for o in LLM(path, dtype="float32", max_num_seqs=8).generate(
        prompts, params, use_tqdm=False)]
    assert fused == torch_path


def random_expert(fmt: str, n: int, k: int, gen: torch.Generator):
    """One expert's prepared [n, k] weight in fmt, on the CPU, of a trained model's scale (std ~ 1 / sqrt(k))."""
    if fmt == "fp8":
        w = torch.randn(n, k, generator=gen) * k**-0.5
        return quant_ref.prepare_fp8_block(*quant_ref.fp8_block_quantize(w, (128, 128)), (128, 128))
    if fmt == "int4":
        packed = torch.randint(-2**31, 2**31 - 1, (n, k // 8), generator=gen, dtype=torch.int32)
        zero = torch.randint(-2**31, 2**31 - 1, (n // 8, k // 128), generator=gen, dtype=torch.int32)
        scale = (torch.rand(n, k // 128, generator=gen) + 0.5) * 0.3 * k**-0.5
        return quant_ref.prepare_int4(packed, scale.to(torch.bfloat16), zero, 128, None, (n, k))
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n, k // 16, generator=gen) * 64 + 16).to(torch.float8_e4m3fn)
    return quant_ref.prepare_nvfp4(packed, scale, torch.rand(n, generator=gen) * 0.01 * k**-0.5 + 1e-4)


def on_gpu(stack):
    return dataclasses.replace(stack, **{f.name: getattr(stack, f.name).cuda() for f in dataclasses.fields(stack)
                                         if isinstance(getattr(stack, f.name), torch.Tensor)})


@pytest.mark.parametrize("fmt", ["fp8", "int4", "nvfp4"])
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_quantized_fused_experts_match_their_semantics_at_35b_shapes(fmt, tokens):
    """The compiled kernels on stacked quantized experts with the shipped tiles, against the oracle's float64 value
    and its bound at the tensor cores' accumulation (tests/ops/moe_oracle.py; the CPU test runs the interpreter)."""
    gen = torch.Generator().manual_seed(tokens)
    gate_up = quantized.stack([random_expert(fmt, 2 * INTER, HIDDEN, gen) for _ in range(QUANT_EXPERTS)])
    down = quantized.stack([random_expert(fmt, HIDDEN, INTER, gen) for _ in range(QUANT_EXPERTS)])
    x = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(QUANT_EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=gen) + 0.1
    weights = weights / weights.sum(-1, keepdim=True)
    tiles = configs.tiles_for(EXPERTS, TOP_K, HIDDEN, INTER, tokens, fmt)  # those the 35B-A3B model would take
    got = moe_cuda.fused_experts(x.cuda(), ids.cuda(), weights.cuda(), on_gpu(gate_up), on_gpu(down), tiles)
    want, bound = quantized_experts_exact(x, ids, weights, gate_up, down, torch.bfloat16,
                                          u_dot=U_TC8 if fmt == "fp8" else U_TC16)
    err = (got.cpu().double() - want).abs()
    assert (err <= bound).all(), f"{fmt}, {tokens} tokens: error {(err / bound).max():.3g} x its bound"
    # at K = 2048 the worst-case bound exceeds values that cancel (it is 1-15x the median |value| here), so it alone
    # would let a wrong expert, scale or zero point pass: those err by the values' own size, 10x this
    assert err.norm() < 0.1 * want.norm(), f"{fmt}, {tokens} tokens: error {err.norm() / want.norm():.3g} of the norm"


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
@pytest.mark.parametrize("split_k", [2, 4])
def test_one_token_kernel_a_split_over_k_at_35b_shapes(fmt, split_k):
    """One token on the tensor-core tiles with kernel A's H split over split_k programs a tile (the table's
    "split_k"; the tile's last split adds the float32 sums, then SiLU and the product), FP8 with its token and
    activation quantized in the kernels and kernel B summing the slots: within the oracle's bound of the float64
    value, as the unsplit launch is, and graph replay the eager bits (the tiles' counters back at 0 after each)."""
    gen = torch.Generator().manual_seed(split_k)
    gate_up = quantized.stack([random_expert(fmt, 2 * INTER, HIDDEN, gen) for _ in range(QUANT_EXPERTS)])
    down = quantized.stack([random_expert(fmt, HIDDEN, INTER, gen) for _ in range(QUANT_EXPERTS)])
    x = torch.randn(1, HIDDEN, generator=gen).to(torch.bfloat16)
    ids = torch.randperm(QUANT_EXPERTS, generator=gen)[:TOP_K][None]
    weights = torch.rand(1, TOP_K, generator=gen) + 0.1
    weights = weights / weights.sum(-1, keepdim=True)
    tiles = configs.tiles_for(EXPERTS, TOP_K, HIDDEN, INTER, 1, fmt)._replace(gemv=False, split_k=split_k)
    if tiles.gate_up.block_n < 16:  # the GEMV kernels' entry: the tensor-core tiles' default instead
        tiles = configs.default_tiles(1)._replace(split_k=split_k)
    args = (x.cuda(), ids.cuda(), weights.cuda(), on_gpu(gate_up), on_gpu(down), tiles)
    eager = moe_cuda.fused_experts(*args)
    want, bound = quantized_experts_exact(x, ids, weights, gate_up, down, torch.bfloat16,
                                          u_dot=U_TC8 if fmt == "fp8" else U_TC16)
    err = (eager.cpu().double() - want).abs()
    assert (err <= bound).all() and err.norm() < 0.1 * want.norm(), f"{fmt}, split {split_k}"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_cuda.fused_experts(*args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
