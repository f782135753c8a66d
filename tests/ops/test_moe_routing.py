"""The MoE routing kernel (ops/moe/cuda.route) against torch's softmax + topk + renormalisation (the Triton
interpreter on the CPU, the real kernel on the GPU)."""

import pytest
import torch

triton = pytest.importorskip("triton")

from deltaserve.ops.moe import cuda as moe_cuda  # noqa: E402
from deltaserve.ops.moe import reference  # noqa: E402
from tests.ops.interpreter import patch_interpreter_index  # noqa: E402
from tests.ops.moe_oracle import route_bound  # noqa: E402
from tests.tolerance import assert_within  # noqa: E402

patch_interpreter_index()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def distinct_logits(tokens: int, experts: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """[T, E] logits without ties: each row a random permutation of E values 0.37 apart (exact in bf16 too at
    these sizes), shifted by a random offset, so that torch.topk's order is unique."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.stack([torch.randperm(experts, generator=gen) for _ in range(tokens)]).double()
    offsets = torch.randn(tokens, 1, generator=gen, dtype=torch.float64)
    return ((rows - experts / 2) * 0.37 / 4 + offsets).to(DEVICE, dtype)


@pytest.mark.parametrize("experts,top_k", [(7, 1), (7, 3), (11, 8), (256, 8), (512, 10)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_route_matches_torch(experts, top_k, renormalize, tokens):
    logits = distinct_logits(tokens, experts, seed=experts + top_k + tokens)
    ids, weights = moe_cuda.route(logits, top_k, renormalize)
    want_ids, want_weights = reference.route(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long(), want_ids)  # the same experts in the same (descending) order
    assert_within(weights, want_weights, route_bound(logits, want_weights, top_k, renormalize), "routing weights")


def test_route_reads_bf16_strided_rows():
    """bf16 logits, rows a view with a stride wider than E (the kernel converts to float32 as torch's .float())."""
    wide = distinct_logits(9, 40, seed=3, dtype=torch.bfloat16) if DEVICE == "cuda" else distinct_logits(9, 40, 3)
    logits = wide[:, :37]
    ids, weights = moe_cuda.route(logits, 4, True)
    want_ids, want_weights = reference.route(logits, 4, True)
    assert torch.equal(ids.long(), want_ids)
    assert_within(weights, want_weights, route_bound(logits, want_weights, 4, True), "strided routing weights")


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_ties_pick_the_same_weights_lowest_index_first(renormalize):
    """Equal logits: torch.topk's order among them is not specified, so the SET of selected weights is compared;
    the kernel's documented order among equal probabilities is the lower expert index first."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 0.0, 2.0],
                           [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5],
                           [2.0, 1.0, 2.0, 1.0, 2.0, 1.0, 2.0]], device=DEVICE)
    ids, weights = moe_cuda.route(logits, 3, renormalize)
    want_ids, want_weights = reference.route(logits, 3, renormalize)
    got_sorted, want_sorted = weights.sort(-1).values, want_weights.sort(-1).values
    assert_within(got_sorted, want_sorted, route_bound(logits, want_sorted, 3, renormalize), "tied weights")
    assert torch.equal(logits.gather(1, ids.long()).sort(-1).values, logits.gather(1, want_ids).sort(-1).values)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2], [0, 2, 4]]
    assert all(len(set(row)) == 3 for row in ids.tolist())  # never the same expert twice


def test_route_rejects_bad_arguments():
    logits = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="top_k"):
        moe_cuda.route(logits, 9, True)
    with pytest.raises(ValueError, match="unit last stride"):
        moe_cuda.route(logits.T, 1, True)
