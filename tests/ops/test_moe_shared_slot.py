"""The sparse block in the fewest launches (ops/moe.sparse_block, cuda.fused_moe): the shared expert as one more
slot of the fused kernels and the routing folded into kernel A (one token) or the align kernel, against the torch
reference (reference.sparse_block); its routing bitwise the routing kernel's; a token's output independent of its
batch; the launches of a SparseMoE layer on this path and on the one it replaces; the fallback where the shared
expert's size differs. The Triton interpreter on the CPU in float32 (tests/gpu/test_moe_gpu.py: bf16, real shapes)."""

import pytest
import torch

triton = pytest.importorskip("triton")

from deltaserve.layers import mlp  # noqa: E402
from deltaserve.layers.mlp import SparseMoE  # noqa: E402
from deltaserve.ops import moe  # noqa: E402
from deltaserve.ops.moe import cuda as moe_cuda  # noqa: E402
from deltaserve.ops.moe import reference  # noqa: E402
from deltaserve.ops.moe.configs import MoeTiles, Tile  # noqa: E402
from tests.ops.interpreter import patch_interpreter_index  # noqa: E402
from tests.ops.moe_oracle import sparse_block_bound  # noqa: E402
from tests.tolerance import assert_within  # noqa: E402

patch_interpreter_index()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# one block holds 16 pairs: T > 16 puts a popular expert in two blocks and the shared slot in two
SMALL = MoeTiles(16, Tile(16, 16, 4, 1), Tile(16, 16, 4, 1))
ROWS = MoeTiles(16, Tile(8, 32, 4, 1), Tile(8, 32, 4, 1), gemv=True)  # one token on the GEMV kernels


def block_operands(tokens: int, experts: int, hidden: int, inter: int, seed: int):
    """x [T, H], logits [T, E] spread enough to have no near-ties, the experts' and the shared expert's weights,
    and the shared gate's logits [T, 1] (a view of a wider projection, as SparseMoE passes it)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    projected = torch.randn(tokens, experts + 1, generator=gen) * 2  # [T, E + 1]: router logits | shared gate
    gate_up = 0.2 * torch.randn(experts, 2 * inter, hidden, generator=gen)
    down = 0.2 * torch.randn(experts, hidden, inter, generator=gen)
    shared_gate_up = 0.2 * torch.randn(2 * inter, hidden, generator=gen)
    shared_down = 0.2 * torch.randn(hidden, inter, generator=gen)
    tensors = (x, projected, gate_up, down, shared_gate_up, shared_down)
    x, projected, gate_up, down, shared_gate_up, shared_down = (t.to(DEVICE) for t in tensors)
    return x, projected[:, :experts], gate_up, down, shared_gate_up, shared_down, projected[:, experts:]


# (experts, top_k, hidden, intermediate) as test_moe_experts.SHAPES, and 35B-A3B's expert count and top-k
SHAPES = [(7, 1, 40, 24), (7, 3, 40, 24), (11, 8, 40, 24), (9, 2, 32, 48), (256, 8, 32, 16)]


@pytest.mark.parametrize("experts,top_k,hidden,inter", SHAPES)
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens", [1, 2, 5, 33])
def test_fused_moe_matches_reference(experts, top_k, hidden, inter, renormalize, tokens):
    x, logits, gate_up, down, shared_gate_up, shared_down, shared_gate = block_operands(
        tokens, experts, hidden, inter, seed=100 * tokens + experts + top_k)
    got, ids, weights = moe_cuda.fused_moe(x, logits, top_k, renormalize, gate_up, down, shared_gate_up,
                                           shared_down, shared_gate, SMALL)
    want_ids, _ = reference.route(logits, top_k, renormalize)
    assert torch.equal(ids.long(), want_ids)  # the same experts (no near-ties in this data)
    want = reference.sparse_block(x, logits, top_k, renormalize, gate_up, down, shared_gate_up, shared_down,
                                  shared_gate)
    bound = sparse_block_bound(x, logits, top_k, renormalize, gate_up, down, shared_gate_up, shared_down,
                               shared_gate)
    assert_within(got, want, bound, "fused sparse block")


@pytest.mark.parametrize("experts,top_k,hidden,inter", SHAPES)
@pytest.mark.parametrize("renormalize", [True, False])
def test_one_token_gemv_kernels_match_reference(experts, top_k, hidden, inter, renormalize):
    """One token on the GEMV kernels (rows and K steps the sizes do not divide): the routing they fold in is the
    routing kernel's bitwise and the sparse block within the reference's bound."""
    x, logits, gate_up, down, shared_gate_up, shared_down, shared_gate = block_operands(
        1, experts, hidden, inter, seed=experts + top_k + hidden)
    got, ids, weights = moe_cuda.fused_moe(x, logits, top_k, renormalize, gate_up, down, shared_gate_up,
                                           shared_down, shared_gate, ROWS)
    want_ids, want_weights = moe_cuda.route(logits, top_k, renormalize)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
    want = reference.sparse_block(x, logits, top_k, renormalize, gate_up, down, shared_gate_up, shared_down,
                                  shared_gate)
    bound = sparse_block_bound(x, logits, top_k, renormalize, gate_up, down, shared_gate_up, shared_down,
                               shared_gate)
    assert_within(got, want, bound, "sparse block on the GEMV kernels")


@pytest.mark.parametrize("experts,top_k", [(7, 3), (256, 8), (512, 10)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens", [1, 20])
def test_folded_routing_is_the_routing_kernels_bitwise(experts, top_k, renormalize, tokens):
    """The routing inside kernel A (one token) and inside the align kernel (20 tokens: two of its 16-token steps at
    E = 256) gives the routing kernel's ids and weights bit for bit: its sums do not depend on the tile."""
    x, logits, gate_up, down, shared_gate_up, shared_down, shared_gate = block_operands(
        tokens, experts, 16, 16, seed=experts + tokens)
    _, ids, weights = moe_cuda.fused_moe(x, logits, top_k, renormalize, gate_up, down, shared_gate_up, shared_down,
                                         shared_gate, SMALL)
    want_ids, want_weights = moe_cuda.route(logits, top_k, renormalize)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)


def test_a_token_does_not_depend_on_the_batch():
    """Token 0 alone (kernel A routes it, no align) and in a batch of 29 whose other tokens share its experts and
    its shared-slot block: bitwise the same output."""
    x, logits, gate_up, down, shared_gate_up, shared_down, shared_gate = block_operands(29, 7, 40, 24, seed=5)
    logits[1:4] = logits[0]  # its experts, with other inputs
    logits[4] = logits[0].flip(0)
    args = (gate_up, down, shared_gate_up, shared_down)
    batch = moe_cuda.fused_moe(x, logits, 3, True, *args, shared_gate, SMALL)[0]
    alone = moe_cuda.fused_moe(x[:1], logits[:1], 3, True, *args, shared_gate[:1], SMALL)[0]
    assert torch.equal(batch[:1], alone)


def test_fused_moe_rejects_a_shared_expert_of_another_size():
    x, logits, gate_up, down, shared_gate_up, shared_down, shared_gate = block_operands(2, 7, 40, 24, seed=1)
    with pytest.raises(ValueError, match="do not fit"):
        moe_cuda.fused_moe(x, logits, 3, True, gate_up, down, shared_gate_up[:40], shared_down[:, :20], shared_gate,
                           SMALL)
    assert not moe.shared_slot_serves(x, gate_up, down, shared_gate_up[:40], shared_down[:, :20], 3)


def sparse_moe(shared_size: int, seed: int) -> SparseMoE:
    """A SparseMoE of odd sizes (hidden 40, 7 experts, top-3, intermediate 24) with random weights, fused as the
    loader leaves it."""
    gen = torch.Generator().manual_seed(seed)
    block = SparseMoE(40, 7, 3, 24, shared_size, norm_topk_prob=True)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(0.3 * torch.randn(param.shape, generator=gen))
    block.to(DEVICE)  # before fuse(), as the loader does: the fused weights are plain attributes .to() does not move
    block.fuse()
    block.shared_expert.fuse()
    return block


def count_launches(monkeypatch) -> list[str]:
    """Record, in order, each Triton kernel launch of ops/moe/cuda and each projection or shared-expert op a
    SparseMoE forward calls (every one at least one GPU launch; the shared expert's SiLU + down is one launch at
    one token (the fused GEMV) and two above)."""
    launched = []

    class Counted:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launched.append(self.name)
            return self.kernel[grid]

    for name in ("_route_kernel", "_align_kernel", "_gate_up_kernel", "_down_kernel", "_combine_kernel"):
        monkeypatch.setattr(moe_cuda, name, Counted(name, getattr(moe_cuda, name)))
    linear, shared_down = mlp.linear, mlp.SwiGLU.down
    monkeypatch.setattr(mlp, "linear", lambda *args: launched.append("linear") or linear(*args))
    monkeypatch.setattr(mlp.SwiGLU, "down", lambda *args: launched.append("shared down") or shared_down(*args))
    monkeypatch.setattr(moe, "_route_on_gpu", lambda logits: True)
    monkeypatch.setattr(moe, "fused_serves", lambda *args: True)
    monkeypatch.setattr(moe, "tiles_for", lambda *shape: SMALL)
    return launched


SLOT_LAUNCHES = ["linear", "_gate_up_kernel", "_down_kernel"]  # one token: kernel B sums the slots
SEPARATE_LAUNCHES = {1: ["linear", "shared down", "_route_kernel", "_gate_up_kernel", "_down_kernel",
                         "_combine_kernel"],
                     6: ["linear", "shared down", "_route_kernel", "_align_kernel", "_gate_up_kernel",
                         "_down_kernel", "_combine_kernel"]}


@pytest.mark.parametrize("tokens", [1])
def test_sparse_moe_launches_and_output_on_the_shared_slot(monkeypatch, tokens):
    """Shared intermediate 24 = the experts', one token: the layer is the router's projection (E + 1 rows) and the
    fused kernels A and B, 3 launches (the path it replaces: 6 ops), and its output is the torch path's within the
    sparse block's bound."""
    assert tokens <= moe.SHARED_SLOT_MAX_TOKENS
    block = sparse_moe(24, seed=tokens)
    x = torch.randn(tokens, 40, generator=torch.Generator().manual_seed(tokens + 1)).to(DEVICE)
    with torch.no_grad():
        want = block(x)  # the CPU: the torch path
        launched = count_launches(monkeypatch)
        got = block(x)
    assert launched == SLOT_LAUNCHES
    with torch.no_grad():
        logits, gate, _ = block.split_projection(x @ block.router_weight.T)
    experts, shared = block.experts, block.shared_expert
    bound = sparse_block_bound(x, logits, 3, True, experts.gate_up_proj, experts.down_proj,
                               shared.gate_up_weight, shared.down_proj.weight, gate)
    assert_within(got, want, bound.detach(), "SparseMoE on the shared slot vs torch")


@pytest.mark.parametrize("shared_size,tokens", [(20, 1), (20, 6), (24, 6)])
def test_sparse_moe_falls_back_where_the_shared_expert_differs(monkeypatch, shared_size, tokens):
    """Shared intermediate 20 != 24, or more tokens than the shared slot takes: the shared expert runs apart (the
    joined projection, its own down, the sum in the combine)."""
    assert shared_size != 24 or tokens > moe.SHARED_SLOT_MAX_TOKENS
    block = sparse_moe(shared_size, seed=tokens)
    x = torch.randn(tokens, 40, generator=torch.Generator().manual_seed(tokens + 1)).to(DEVICE)
    launched = count_launches(monkeypatch)
    with torch.no_grad():
        block(x)
    assert launched == SEPARATE_LAUNCHES[tokens]
