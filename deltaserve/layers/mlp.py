"""Feed-forward blocks: the dense SwiGLU MLP and the sparse MoE block with a gated shared expert.

MoE routing (architecture reference, section 4.1): softmax over experts in float32, top-k, renormalise the
k weights (always for Qwen3.5-MoE, if norm_topk_prob for Qwen3-Next), weighted sum of the chosen experts,
plus sigmoid(shared_expert_gate(x)) * shared_expert(x).

Quantized checkpoints: projections are QuantLinears (layers/linear.py), routed experts a QuantExperts, which
dequantizes every expert's weights for the same grouped matmul at each forward (correct, not fast); the routers
(`gate`, `shared_expert_gate`) always stay in the model dtype.

Tensor parallelism shards every expert (and the shared expert, and a dense MLP) by its intermediate size: gate
and up are column-parallel, down row-parallel; the router is replicated, and the decoder layer all-reduces the
block's output once (routed experts plus shared expert).
"""

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.layers.linear import fuse_linears, project
from deltaserve.layers.quant.weight import fuse_quantized
from deltaserve.ops.activation import silu_and_mul
from deltaserve.ops.linear import silu_mul_linear
from deltaserve.worker.distributed import SINGLE, ParallelContext


# (S, K) x grouped (E, K, N) -> (S, N); torch >= 2.10 names it F.grouped_mm, older releases torch._grouped_mm
grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), with transformers' parameter names."""

    PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # the linears a quantized checkpoint may store quantized

    def __init__(self, hidden_size: int, intermediate_size: int, parallel: ParallelContext = SINGLE,
                 size_field: str = "intermediate_size"):
        super().__init__()
        intermediate_size = parallel.shard(intermediate_size, size_field)[1]  # this rank's
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up_weight: torch.Tensor | None = None  # [gate | up] rows, set by fuse()

    def fuse(self) -> None:
        """After loading: gate and up projections become one matmul."""
        self.gate_up_weight = fuse_linears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(project(x, self.gate_up_weight))

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
        """x: [T, H]; topk_ids, topk_weights: [T, k]. Returns sum_j w_j * expert_{id_j}(x): [T, H]."""
        return grouped_experts(x, topk_ids, topk_weights, self.gate_up_proj, self.down_proj)


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
    offs = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)
    if round_input is not None:  # per-row rounding: the same before or after the gather
        x = round_input(x)
    h = grouped_mm(x[rows], gate_up.transpose(1, 2), offs=offs)  # [T*k, 2I]
    act = silu_and_mul(h)
    y = grouped_mm(act if round_input is None else round_input(act), down.transpose(1, 2), offs=offs)  # [T*k, H]
    y = y * topk_weights.reshape(-1)[order].unsqueeze(1).to(y.dtype)
    return torch.zeros_like(x).index_add_(0, rows, y)


class QuantExperts(nn.Module):
    """Routed experts stored quantized: per expert its [gate | up] weight ([2I, H]) and its down weight ([H, I]),
    each of its scheme (`schemes`: projection -> Scheme). `raw` holds the loaded tensors until `fuse`: per
    (expert, projection) for per-expert checkpoints, or per fused name ("gate_up_proj", "down_proj") with a
    leading expert dimension. Every forward dequantizes all experts into the grouped matmul: E dequantizations
    a projection, correct first (fused quantized MoE kernels are a later step); a W8A8 scheme's activations are
    rounded as its op would (`Scheme.round_activation`)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, schemes: dict, device):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.schemes, self.device = schemes, torch.device(device)
        self.raw: dict = {}
        self.gate_up: list = []  # [E] weights of [2I, H]
        self.down: list = []  # [E] weights of [H, I]

    def projection_shape(self, proj: str) -> tuple[int, int]:
        """[N, K] of one expert's projection ("gate_proj", "up_proj", "down_proj", or the fused "gate_up_proj")."""
        H, inter = self.hidden_size, self.intermediate_size
        return {"gate_proj": (inter, H), "up_proj": (inter, H), "gate_up_proj": (2 * inter, H),
                "down_proj": (H, inter)}[proj]

    def fuse(self) -> None:
        """After loading: every expert's weights prepared (gate and up joined where their blocks line up)."""
        raw, self.raw = self.raw, {}
        H, inter = self.hidden_size, self.intermediate_size
        for e in range(self.num_experts):
            if (e, "gate_proj") in raw:
                parts = [(self.schemes[p], raw.pop((e, p)), inter) for p in ("gate_proj", "up_proj")]
                down = raw.pop((e, "down_proj"))
            else:  # fused: one [2I, H] matrix an expert
                parts = [(self.schemes["gate_up_proj"], raw.pop((e, "gate_up_proj")), 2 * inter)]
                down = raw.pop((e, "down_proj"))
            self.gate_up.append(fuse_quantized(parts, H, self.device))
            self.down.append(fuse_quantized([(self.schemes["down_proj"], down, H)], inter, self.device))

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """As Experts.forward."""
        gate_up = torch.stack([w.dequantize(x.dtype) for w in self.gate_up])  # [E, 2I, H]
        down = torch.stack([w.dequantize(x.dtype) for w in self.down])  # [E, H, I]
        return grouped_experts(x, topk_ids, topk_weights, gate_up, down, self.schemes["down_proj"].round_activation)


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 shared_intermediate_size: int, norm_topk_prob: bool, parallel: ParallelContext = SINGLE):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        local_intermediate = parallel.shard(intermediate_size, "moe_intermediate_size")[1]
        self.experts = Experts(num_experts, hidden_size, local_intermediate)
        self.shared_expert = (SwiGLU(hidden_size, shared_intermediate_size, parallel, "shared_expert_intermediate_size")
                              if shared_intermediate_size else None)
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
