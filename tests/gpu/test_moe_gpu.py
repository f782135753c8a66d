"""The fused MoE path (ops/moe) on the GPU: against the grouped-matmul reference at Qwen3.5-35B-A3B's shapes
(bf16, tiles from the shipped table), CUDA-graph replay against eager, a pair against the batch it sits in, and
through the engine on a tiny MoE checkpoint. Run by tests/gpu/run.sh (TESTS=tests/gpu/test_moe_gpu.py ... tests)."""

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.demo import build_checkpoint
from deltaserve.layers.mlp import SparseMoE
from deltaserve.ops import moe
from deltaserve.ops.moe import configs, reference
from deltaserve.ops.moe import cuda as moe_cuda
from tests.gpu.logits import prompt
from tests.ops.moe_oracle import experts_bound, shared_bound
from tests.tolerance import assert_within

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Qwen3.5-35B-A3B: hidden, experts, top-k, expert and shared-expert intermediate sizes
HIDDEN, EXPERTS, TOP_K, INTER, SHARED = 2048, 256, 8, 512, 512


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
        assert moe.fused_serves(x, gate_up, down)
        got = moe.experts(x, ids, weights, gate_up, down)
        want = reference.grouped_experts(x, ids, weights, gate_up, down)
        bound = experts_bound(x, ids, weights, gate_up, down, fused_bf16=True, reference_bf16=True)
        assert_within(got, want, bound, f"fused experts, {tokens} tokens")
        shared = (block_35b.shared_expert(x), block_35b.shared_expert_gate(x))
        got = moe.experts(x, ids, weights, gate_up, down, shared)
        want = reference.add_shared_expert(want, *shared)
        assert_within(got, want, bound + shared_bound(*shared, torch.bfloat16) + 3 * 2.0**-8 * want.double().abs(),
                      f"fused experts + shared, {tokens} tokens")  # + the reference's bf16 sum and ours, once each


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


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_next"])
def test_engine_greedy_tokens_fused_equal_torch_path(arch, tmp_path, monkeypatch):
    """Through the engine, float32 on a tame checkpoint (matrix_gain 0.5, as test_engine_gpu's parity test): the
    fused path (its kernels taking float32 here, with IEEE dots) and the torch path give the same greedy tokens.
    (bf16 graphs == eager on the fused path: test_engine_gpu.py::test_cuda_graphs_equal_eager_token_for_token.)"""
    path = str(build_checkpoint(tmp_path, arch, matrix_gain=0.5))
    prompts = [prompt(n, 20 + n) for n in (5, 40, 1, 17)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    launched = []
    fused_experts = moe_cuda.fused_experts

    def recording(*args, **kwargs):
        launched.append(args[0].shape[0])
        return fused_experts(*args, **kwargs)

    monkeypatch.setattr(moe, "FUSED_DTYPES", (torch.float32,))
    monkeypatch.setattr(moe_cuda, "fused_experts", recording)
    fused = [o.outputs[0].token_ids for o in LLM(path, dtype="float32", max_num_seqs=8).generate(
        prompts, params, use_tqdm=False)]
    assert launched and max(launched) <= moe.FUSED_MAX_TOKENS
    monkeypatch.setattr(moe, "fused_serves", lambda *args: False)
    monkeypatch.setattr(moe, "_route_on_gpu", lambda logits: False)
    torch_path = [o.outputs[0].token_ids for o in LLM(path, dtype="float32", max_num_seqs=8).generate(
        prompts, params, use_tqdm=False)]
    assert fused == torch_path
