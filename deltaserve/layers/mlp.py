"""Feed-forward blocks: the dense SwiGLU MLP and the sparse MoE block with a gated shared expert.

MoE routing (architecture reference, section 4.1): softmax over experts in float32, top-k, renormalise the
k weights (always for Qwen3.5-MoE, if norm_topk_prob for Qwen3-Next), weighted sum of the chosen experts,
plus sigmoid(shared_expert_gate(x)) * shared_expert(x).
"""

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.layers.linear import fuse_linears
from deltaserve.ops.activation import silu_and_mul
from deltaserve.ops.linear import silu_mul_linear


# (S, K) x grouped (E, K, N) -> (S, N); torch >= 2.10 names it F.grouped_mm, older releases torch._grouped_mm
grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), with transformers' parameter names."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up_weight: torch.Tensor | None = None  # [gate | up] rows, set by fuse()

    def fuse(self) -> None:
        """After loading: gate and up projections become one matmul."""
        self.gate_up_weight = fuse_linears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.linear(x, self.gate_up_weight))

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [T, 2I], the fused gate/up projection's output -> down(silu(gate) * up): [T, H]."""
        return silu_mul_linear(gate_up, self.down_proj.weight)


class Experts(nn.Module):
    """All routed experts as stacked weights: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x: [T, H]; topk_ids, topk_weights: [T, k]. Returns sum_j w_j * expert_{id_j}(x): [T, H].

        The T*k (token, expert) pairs are sorted by expert and run as one grouped matmul per projection
        (torch's grouped_mm): no host sync and no loop over experts, so it also runs inside CUDA graphs.
        """
        k = topk_ids.shape[1]
        sorted_ids, order = torch.sort(topk_ids.reshape(-1), stable=True)  # [T*k]
        rows = order // k  # [T*k] source token of each sorted pair
        experts = torch.arange(self.gate_up_proj.shape[0], device=x.device)
        # [E] end of each expert's group (searchsorted, unlike bincount, needs no host sync)
        offs = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)
        h = grouped_mm(x[rows], self.gate_up_proj.transpose(1, 2), offs=offs)  # [T*k, 2I]
        y = grouped_mm(silu_and_mul(h), self.down_proj.transpose(1, 2), offs=offs)  # [T*k, H]
        y = y * topk_weights.reshape(-1)[order].unsqueeze(1).to(y.dtype)
        return torch.zeros_like(x).index_add_(0, rows, y)


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 shared_intermediate_size: int, norm_topk_prob: bool):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden_size, intermediate_size)
        self.shared_expert = SwiGLU(hidden_size, shared_intermediate_size) if shared_intermediate_size else None
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared_intermediate_size else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> [T, H]."""
        logits = self.gate(x)  # [T, E]
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.experts(x, ids, weights.to(logits.dtype))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
