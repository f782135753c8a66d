"""Plain-torch MoE (the oracle for cuda.py, and the path of the CPU, of prefill-sized batches and of quantized
experts): routing by softmax + top-k, the routed experts as sort-by-expert + torch's grouped matmul, and their
weighted sum with the gated shared expert in float32 (`combine`).
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


def expert_outputs(x: torch.Tensor, topk_ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                   round_input=None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, H]; topk_ids: [T, k]; gate_up [E, 2I, H]; down [E, H, I] -> (y [T*k, H] in x.dtype: each (token,
    expert) pair's expert output, the pairs sorted by expert; pair_rows [T*k]: the row of y that holds pair
    p = t*k + j). round_input: applied to each projection's input rows (dequantized W8A8 weights: the activations'
    rounding).

    The pairs sorted by expert run as one grouped matmul per projection (torch's grouped_mm): no host sync and no
    loop over experts, so it also runs inside CUDA graphs.
    """
    k = topk_ids.shape[1]
    sorted_ids, order = torch.sort(topk_ids.reshape(-1), stable=True)  # [T*k]: order[i] = the pair in row i
    rows = order // k  # [T*k] source token of each sorted pair
    experts = torch.arange(gate_up.shape[0], device=x.device)
    # [E] end of each expert's group (searchsorted, unlike bincount, needs no host sync)
    offs = torch.searchsorted(sorted_ids, experts.to(sorted_ids.dtype), right=True).to(torch.int32)
    if round_input is not None:  # per-row rounding: the same before or after the gather
        x = round_input(x)
    h = grouped_mm(x[rows], gate_up.transpose(1, 2), offs=offs)  # [T*k, 2I]
    act = silu_and_mul(h)
    y = grouped_mm(act if round_input is None else round_input(act), down.transpose(1, 2), offs=offs)  # [T*k, H]
    pair_rows = torch.empty_like(order)
    pair_rows[order] = torch.arange(order.numel(), device=order.device)  # the inverse permutation
    return y, pair_rows


def combine(y: torch.Tensor, pair_rows: torch.Tensor, topk_weights: torch.Tensor,
            shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """y [P, H] expert outputs; pair_rows [T*k] the row of y of pair t*k + j; topk_weights [T, k]; shared: (the
    shared expert's output [T, H], its gate logits [T, 1]) or None -> [T, H] in y.dtype:
    sum_{j = 0..k-1} w[t, j] y[pair_rows[t*k + j]] (+ sigmoid(gate_t) shared_t), in float32 (or y's wider dtype) in
    that order, rounded once. Each pair's row is read, not scattered: no atomics, the same bits on every run."""
    T, k = topk_weights.shape
    rows = pair_rows.view(T, k)
    acc_dtype = torch.promote_types(y.dtype, torch.float32)
    acc = torch.zeros(T, y.shape[1], dtype=acc_dtype, device=y.device)
    for j in range(k):
        acc += topk_weights[:, j, None].to(acc_dtype) * y[rows[:, j]].to(acc_dtype)
    if shared is not None:
        out, gate = shared
        acc += torch.sigmoid(gate.to(acc_dtype)) * out.to(acc_dtype)
    return acc.to(y.dtype)


def grouped_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, round_input=None,
                    shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x: [T, H]; topk_ids, topk_weights: [T, k]; gate_up [E, 2I, H]; down [E, H, I]; shared as `combine` takes it
    -> sum_j w_j expert_j(x) (+ sigmoid(gate) * shared): [T, H] (`expert_outputs`, then `combine`)."""
    return combine(*expert_outputs(x, topk_ids, gate_up, down, round_input), topk_weights, shared)


def sparse_block(x: torch.Tensor, logits: torch.Tensor, top_k: int, renormalize: bool, gate_up: torch.Tensor,
              down: torch.Tensor, shared_gate_up: torch.Tensor, shared_down: torch.Tensor,
              shared_gate: torch.Tensor) -> torch.Tensor:
    """The block after its router (ops.moe.sparse_block): route, the routed experts, and the shared expert
    down(silu(x Wg^T) * (x Wu^T)) gated by sigmoid(shared_gate): [T, H]."""
    ids, weights = route(logits, top_k, renormalize)
    shared = silu_and_mul(x @ shared_gate_up.T) @ shared_down.T  # [T, H]
    return grouped_experts(x, ids, weights, gate_up, down, shared=(shared, shared_gate))
