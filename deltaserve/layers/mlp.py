"""Feed-forward blocks: the dense SwiGLU MLP and the sparse MoE block with a gated shared expert.

MoE routing (architecture reference, section 4.1): softmax over experts in float32, top-k, renormalise the
k weights (always for Qwen3.5-MoE, if norm_topk_prob for Qwen3-Next), weighted sum of the chosen experts,
plus sigmoid(shared_expert_gate(x)) * shared_expert(x).
"""

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), with transformers' parameter names."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """All routed experts as stacked weights: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x: [T, H]; topk_ids, topk_weights: [T, k]. Returns sum_j w_j * expert_{id_j}(x): [T, H].

        Tokens are grouped by expert (one sort), and each expert with tokens runs one batched matmul.
        """
        T, k = topk_ids.shape
        flat_ids = topk_ids.reshape(-1)  # [T*k]
        order = torch.argsort(flat_ids, stable=True)
        token_of = order // k  # [T*k] source token of each sorted assignment
        counts = torch.bincount(flat_ids, minlength=self.gate_up_proj.shape[0]).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = token_of[start:start + count]
            h = x[rows] @ self.gate_up_proj[expert].t()  # [count, 2I]
            gate, up = h.chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ self.down_proj[expert].t()  # [count, H]
            w = topk_weights.reshape(-1)[order[start:start + count]].unsqueeze(1)
            out.index_add_(0, rows, (y * w).to(out.dtype))
            start += count
        return out


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
