"""Plain-torch MoE (the oracle for cuda.py, and the path of the CPU, of prefill-sized batches and of quantized
experts): routing by softmax + top-k, the routed experts as sort-by-expert + torch's grouped matmul, and the
gated shared expert's sum.
"""

import torch
import torch.nn.functional as F

from deltaserve.ops.activation import silu_and_mul

# (S, K) x grouped (E, K, N) -> (S, N); torch >= 2.10 names it F.grouped_mm, older releases torch._grouped_mm
grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] router outputs -> (topk_ids [T, k] int64, topk_weights [T, k] float32): softmax in float32,
    the k largest probabilities (torch.topk's order), divided by their sum where `renormalize`."""
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def grouped_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, round_input=None) -> torch.Tensor:
    """x: [T, H]; topk_ids, topk_weights: [T, k]; gate_up [E, 2I, H]; down [E, H, I] -> sum_j w_j expert_j(x): [T, H].
    round_input: applied to each projection's input rows (dequantized W8A8 weights: the activations' rounding).

    The T*k (token, expert) pairs are sorted by expert and run as one grouped matmul per projection
    (torch's grouped_mm): no host sync and no loop over experts, so it also runs inside CUDA graphs.
    """
    k = topk_ids.shape[1]
    sorted_ids, order = torch.sort(topk_ids.reshape(-1), stable=True)  # [T*k]
    rows = order // k  # [T*k] source token of each sorted pair
    experts = torch.arange(gate_up.shape[0], device=x.device)
    # [E] end of each expert's group (searchsorted, unlike bincount, needs no host sync)
    offs = torch.searchsorted(sorted_ids, experts.to(sorted_ids.dtype), right=True).to(torch.int32)
    if round_input is not None:  # per-row rounding: the same before or after the gather
        x = round_input(x)
    h = grouped_mm(x[rows], gate_up.transpose(1, 2), offs=offs)  # [T*k, 2I]
    act = silu_and_mul(h)
    y = grouped_mm(act if round_input is None else round_input(act), down.transpose(1, 2), offs=offs)  # [T*k, H]
    y = y * topk_weights.reshape(-1)[order].unsqueeze(1).to(y.dtype)
    return torch.zeros_like(x).index_add_(0, rows, y)


def add_shared_expert(routed: torch.Tensor, shared: torch.Tensor, shared_gate: torch.Tensor) -> torch.Tensor:
    """routed, shared: [T, H]; shared_gate: [T, 1] logits -> routed + sigmoid(shared_gate) * shared: [T, H]."""
    return routed + torch.sigmoid(shared_gate) * shared


def sparse_block(x: torch.Tensor, logits: torch.Tensor, top_k: int, renormalize: bool, gate_up: torch.Tensor,
              down: torch.Tensor, shared_gate_up: torch.Tensor, shared_down: torch.Tensor,
              shared_gate: torch.Tensor) -> torch.Tensor:
    """The block after its router (ops.moe.sparse_block): route, the routed experts, and the shared expert
    down(silu(x Wg^T) * (x Wu^T)) gated by sigmoid(shared_gate): [T, H]."""
    ids, weights = route(logits, top_k, renormalize)
    routed = grouped_experts(x, ids, weights, gate_up, down)
    shared = silu_and_mul(x @ shared_gate_up.T) @ shared_down.T  # [T, H]
    return add_shared_expert(routed, shared, shared_gate)
