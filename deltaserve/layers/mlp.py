"""Feed-forward blocks: the dense SwiGLU MLP and the sparse MoE block with a gated shared expert.

MoE routing (architecture reference, section 4.1): softmax over experts in float32, top-k, renormalise the
k weights (always for Qwen3.5-MoE, if norm_topk_prob for Qwen3-Next), weighted sum of the chosen experts,
plus sigmoid(shared_expert_gate(x)) * shared_expert(x). The routing and the experts with that sum are
`ops.moe` ops: Triton kernels on the GPU (fused experts at decode sizes; where the shared expert has the experts'
intermediate size, `ops.moe.sparse_block` runs it as a slot of theirs, with the routing), torch's grouped matmul
elsewhere.

Quantized checkpoints: projections are QuantLinears (layers/linear.py), routed experts a QuantExperts, whose
stacked FP8 / int4 / NVFP4 weights the same fused kernels read with the format as a parameter (elsewhere it dequantizes
every expert for the grouped matmul: correct, not fast); the routers (`gate`, `shared_expert_gate`) always stay in
the model dtype.

Tensor parallelism shards every expert (and the shared expert, and a dense MLP) by its intermediate size: gate
and up are column-parallel, down row-parallel; the router is replicated, and the decoder layer all-reduces the
block's output once (routed experts plus shared expert).
"""

import torch
from torch import nn

from deltaserve.layers.linear import fuse_linear_blocks, fuse_linears, project
from deltaserve.layers.quant.weight import QuantWeight, fuse_quantized
from deltaserve.ops import moe
from deltaserve.ops.linear import linear, silu_mul_linear
from deltaserve.ops.moe.reference import grouped_experts
from deltaserve.worker.distributed import SINGLE, ParallelContext


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
        """After loading: gate and up projections become one matmul (unless a parent's fuse joined them already)."""
        if self.gate_up_weight is None:
            self.gate_up_weight = fuse_linears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(project(x, self.gate_up_weight))

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [T, 2I], the fused gate/up projection's output -> down(silu(gate) * up): [T, H]."""
        return silu_mul_linear(gate_up, self.down_proj.weight)

    def slot_weights(self) -> tuple:
        """(gate_up [2I, H], down [H, I]) as an MoE block's shared slot takes them: plain tensors, or quantized
        ones' prepared weights (ops.quant_gemm's); a split weight as it is (no slot takes it)."""
        weights = (self.gate_up_weight, self.down_proj.weight)
        return tuple(w.prepared if isinstance(w, QuantWeight) else w for w in weights)


class Experts(nn.Module):
    """All routed experts as stacked weights: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x: [T, H]; topk_ids, topk_weights: [T, k]; shared: (shared expert output [T, H], its gate logits [T, 1])
        or None. Returns sum_j w_j * expert_{id_j}(x) (+ sigmoid(gate) * shared): [T, H] (ops.moe.experts: the
        fused kernels on the GPU at decode sizes, else the grouped matmul)."""
        return moe.experts(x, topk_ids, topk_weights, self.gate_up_proj, self.down_proj, shared)

    def fused_serves(self, x: torch.Tensor, top_k: int) -> bool:
        """Whether a forward over x, each token routed to top_k experts, takes the fused kernels."""
        return moe.fused_serves(x, self.gate_up_proj, self.down_proj, top_k)

    def stacks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, H], down [E, H, I]) as the fused kernels take them."""
        return self.gate_up_proj, self.down_proj


class QuantExperts(nn.Module):
    """Routed experts stored quantized: per expert its [gate | up] weight ([2I, H]) and its down weight ([H, I]),
    each of its scheme (`schemes`: projection -> Scheme). `raw` holds the loaded tensors until `fuse`: per
    (expert, projection) for per-expert checkpoints, or per fused name ("gate_up_proj", "down_proj") with a
    leading expert dimension. Where the formats allow (ops.moe.quantized.stack: FP8 block-scaled, int4 without act
    order, NVFP4), `fuse` stacks every expert's weights into one tensor per part, which the fused MoE kernels read on
    the GPU at any batch size; the per-expert weights become views into the stacks. Elsewhere (the CPU, float32,
    formats the kernels do not take) every forward dequantizes all experts into the grouped matmul, a W8A8 scheme's
    activations rounded as its op would (`Scheme.round_activation`)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, schemes: dict, device):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.schemes, self.device = schemes, torch.device(device)
        self.raw: dict = {}
        self.gate_up: list = []  # [E] weights of [2I, H]
        self.down: list = []  # [E] weights of [H, I]
        self.gate_up_stack = self.down_stack = None  # ops.moe.quantized stacks of [E, 2I, H] and [E, H, I]

    def projection_shape(self, proj: str) -> tuple[int, int]:
        """[N, K] of one expert's projection ("gate_proj", "up_proj", "down_proj", or the fused "gate_up_proj")."""
        H, inter = self.hidden_size, self.intermediate_size
        return {"gate_proj": (inter, H), "up_proj": (inter, H), "gate_up_proj": (2 * inter, H),
                "down_proj": (H, inter)}[proj]

    def fuse(self) -> None:
        """After loading: every expert's weights prepared (gate and up joined where their blocks line up), then
        stacked where the fused kernels take them."""
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
        self._stack()

    def _stack(self) -> None:
        """Both projections stacked (one format, a layout the kernels take), each expert's weight then a view."""
        if not all(isinstance(w, QuantWeight) for w in self.gate_up + self.down):
            return
        gate_up = moe.quantized.stack([w.prepared for w in self.gate_up])
        down = moe.quantized.stack([w.prepared for w in self.down])
        if gate_up is None or type(gate_up) is not type(down) or not moe.quantized.fused_layout(gate_up, down):
            return
        self.gate_up_stack, self.down_stack = gate_up, down
        self.gate_up = [QuantWeight(gate_up.expert(e), w.op) for e, w in enumerate(self.gate_up)]
        self.down = [QuantWeight(down.expert(e), w.op) for e, w in enumerate(self.down)]

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """As Experts.forward: the fused kernels on the stacks where they serve, else the dequantized reference."""
        if self.fused_serves(x, topk_ids.shape[1]):
            return moe.experts(x, topk_ids, topk_weights, self.gate_up_stack, self.down_stack, shared)
        gate_up = torch.stack([w.dequantize(x.dtype) for w in self.gate_up])  # [E, 2I, H]
        down = torch.stack([w.dequantize(x.dtype) for w in self.down])  # [E, H, I]
        return grouped_experts(x, topk_ids, topk_weights, gate_up, down, self.schemes["down_proj"].round_activation,
                               shared)

    def fused_serves(self, x: torch.Tensor, top_k: int) -> bool:
        """Whether a forward over x takes the fused kernels (stacked experts, ops.moe.fused_serves)."""
        return self.gate_up_stack is not None and moe.fused_serves(x, self.gate_up_stack, self.down_stack, top_k)

    def stacks(self) -> tuple:
        """(gate_up, down) as the fused kernels take them: ops.moe.quantized stacks (None where not stacked)."""
        return self.gate_up_stack, self.down_stack


JOIN_ROW_MULTIPLE = 16  # SparseMoE.fuse pads each block of its joined rows to this


def join_padded(rows: int) -> int:
    """The rows a block of `rows` takes in SparseMoE.fuse's joined weight: padded to JOIN_ROW_MULTIPLE."""
    return -(-rows // JOIN_ROW_MULTIPLE) * JOIN_ROW_MULTIPLE


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
        # [router | shared gate | 0 | shared gate/up | 0] rows, set by fuse() where all are plain linears
        self.in_weight: torch.Tensor | None = None
        # [router | shared gate | 0] rows, set by fuse() where the two are plain linears (in_weight's first rows if set)
        self.router_weight: torch.Tensor | None = None

    def fuse(self) -> None:
        """After loading (before the shared expert's own fuse): the router, the shared expert's gate and its
        gate/up projections, which all read x, become one [R + 2I_shared, H] weight, the parameters views of its
        rows, the router and the shared gate (E + 1 rows) padded with zero rows to R, a multiple of
        JOIN_ROW_MULTIPLE (an odd row count leaves the product's output rows unaligned, and cuBLAS then takes its
        slow alignment-1 kernels). Every step multiplies it once (one launch instead of three a layer), or, where
        the shared expert runs as a slot of the fused experts (ops.moe.sparse_block), only its first R rows. With a
        quantized shared expert (the plain router and shared gate of Qwen's FP8 / AWQ checkpoints) the router and
        the shared gate alone become one [R, H] weight."""
        if self.shared_expert is None:
            return
        router = (self.gate, self.shared_expert_gate)
        shared = (self.shared_expert.gate_proj, self.shared_expert.up_proj)
        if all(type(linear) is nn.Linear for linear in router + shared):
            self.in_weight = fuse_linear_blocks(router, shared, row_multiple=JOIN_ROW_MULTIPLE)
            rows = join_padded(self.gate.out_features + 1)
            self.router_weight = self.in_weight[:rows]
            self.shared_expert.gate_up_weight = self.in_weight[rows:rows + 2 * shared[0].out_features]
        elif all(type(linear) is nn.Linear for linear in router):
            self.router_weight = fuse_linear_blocks(router, row_multiple=JOIN_ROW_MULTIPLE)

    def split_projection(self, projected: torch.Tensor) -> tuple:
        """x times in_weight ([T, R + 2I_shared]) or router_weight ([T, R]) -> (router logits [T, E], shared gate
        logits [T, 1], the shared expert's gate/up [T, 2I_shared] or, from router_weight, None): views."""
        E, rows = self.gate.out_features, self.router_weight.shape[0]
        shared_gate_up = None
        if projected.shape[1] > rows:
            shared_gate_up = projected[:, rows:rows + self.shared_expert.gate_up_weight.shape[0]]
        return projected[:, :E], projected[:, E:E + 1], shared_gate_up

    def shared_slot(self, x: torch.Tensor) -> bool:
        """Whether the shared expert runs as a slot of the fused experts for this batch (ops.moe.sparse_block)."""
        if self.router_weight is None or not self.experts.fused_serves(x, self.top_k):
            return False
        return moe.shared_slot_serves(x, *self.experts.stacks(), *self.shared_expert.slot_weights(), self.top_k)

    def input_weight(self, slot: bool) -> torch.Tensor | None:
        """The joined weight that forward multiplies x [T, H] by first (router_weight, or in_weight with the shared
        expert's gate/up), given shared_slot(x), which the norm before the block may multiply in its own launch
        (ops.linear.rms_norm_and_linear, then forward's `projected`); None where there is none."""
        return self.router_weight if slot or self.in_weight is None else self.in_weight

    def forward(self, x: torch.Tensor, projected: torch.Tensor | None = None, slot: bool | None = None) -> torch.Tensor:
        """x: [T, H] -> [T, H]. projected: x @ input_weight(slot)^T where the caller multiplied it already; slot:
        shared_slot(x) where the caller decided it already."""
        if slot is None:
            slot = self.shared_slot(x)
        if projected is None and (weight := self.input_weight(slot)) is not None:
            projected = linear(x, weight)
        if slot:
            gate_up, down = self.experts.stacks()
            shared_gate_up, shared_down = self.shared_expert.slot_weights()
            logits, gate, _ = self.split_projection(projected)
            return moe.sparse_block(x, logits, self.top_k, self.norm_topk_prob, gate_up, down, shared_gate_up,
                                    shared_down, gate)
        # shared: (the shared expert's output [T, H], its gate logits [T, 1]), summed in by the experts' op
        if self.in_weight is not None:
            logits, gate, shared_gate_up = self.split_projection(projected)
            shared = (self.shared_expert.down(shared_gate_up), gate)
        elif self.router_weight is not None:  # a quantized shared expert
            logits, gate, _ = self.split_projection(projected)
            shared = (self.shared_expert(x), gate)
        else:
            logits = self.gate(x)  # [T, E]
            shared = None if self.shared_expert is None else (self.shared_expert(x), self.shared_expert_gate(x))
        ids, weights = moe.route(logits, self.top_k, self.norm_topk_prob)  # [T, k] each, weights float32
        return self.experts(x, ids, weights, shared)

    @torch.no_grad()
    def warm_up_fused(self, max_rows: int) -> None:
        """GPU start-up: a forward at every token bucket of the fused experts' tile table up to max_rows (a step's
        token budget; each bucket's tiles are a kernel variant, nothing else the kernels take varies with the
        batch; quantized experts run prompt chunks fused too, plain ones where the table names the bucket), so
        that no eager step compiles one while serving.
        A prompt-chunk bucket runs at an odd size too: Triton compiles another variant where its integer arguments
        (the rows, pairs and blocks) are not multiples of 16, and eager chunks come in every size."""
        for bucket in moe.ALL_BUCKETS:
            for rows in (bucket,) if bucket <= moe.FUSED_MAX_TOKENS else (bucket - 1, bucket):
                rows = min(rows, max_rows)
                x = torch.zeros(rows, self.gate.in_features, dtype=self.gate.weight.dtype,
                                device=self.gate.weight.device)
                if self.experts.fused_serves(x, self.top_k):  # plain experts: decode, and the tabled prompt buckets
                    self(x)
                if rows == max_rows:
                    return
