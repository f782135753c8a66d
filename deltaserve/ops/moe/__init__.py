"""The sparse MoE block's ops: routing and the routed experts (with the gated shared expert's sum).

    route(logits, k, renormalize)                -> topk_ids [T, k], topk_weights [T, k] float32
    experts(x, ids, weights, gate_up, down, shared) -> sum_j w_j expert_j(x) (+ sigmoid(g) * shared): [T, H]
    sparse_block(x, logits, k, renormalize, gate_up, down, shared_gate_up, shared_down, shared_gate)
                                                 -> route, then the routed experts + sigmoid(g) * shared(x): [T, H]

On CUDA, routing is one Triton kernel (any T), and for 16-bit batches of up to FUSED_MAX_TOKENS tokens with plain
stacked weights (prompt chunks too where the tile table names their bucket: `configs.prompt_tiles_tabled`) the
experts run the fused kernels of `cuda.py` (tiles from `configs.py`). Elsewhere (the CPU, float32, other prompt
chunks) the plain-torch `reference.py`: sort by expert + torch's grouped matmul, then (on
CUDA in one launch, `cuda.combine`) each token's k outputs weighted and summed with the gated shared expert. Quantized
experts stacked by `quantized.stack` (FP8 block-scaled W8A8, int4 W4A16, NVFP4 weight-only) run the same fused
kernels with the weight format as a parameter, at every batch size, except the prompt chunks whose tile-table bucket
says "grouped" (`dequantized.py`: groups of experts dequantized into torch's grouped matmul); layers/mlp.QuantExperts
dequantizes them for the reference where the kernels do not serve (the CPU, float32).

`sparse_block` is the block after its router in the fewest launches: where the shared expert has the routed experts'
intermediate size (Qwen3.5-35B-A3B, 122B-A10B, Qwen3-Next: `shared_slot_serves`) and their format (plain, or the
quantized stacks' with the same layout), it runs as one more expert slot of the fused kernels, and the routing runs
inside them (kernel A at one token, the align kernel above), so a layer is the router's projection, then kernel A
and B (which at one token sums the slots itself; above, the combine kernel does, after the align kernel and FP8's
two activation quantizations), or, where
the tile table asks for them at one token, the two GEMV kernels A1 and B1 (cuda.py). It serves
up to SHARED_SLOT_MAX_TOKENS tokens: above one token it measured slower than the shared expert apart
(docs/performance.md, MoE). Elsewhere it is `reference.sparse_block`.
"""

import torch

from deltaserve.ops.moe import quantized, reference
from deltaserve.ops.moe.configs import ALL_BUCKETS, FUSED_MAX_TOKENS, ROW_BUCKETS, prompt_tiles_tabled, tiles_for
from deltaserve.ops.moe.quantized import QUANTIZED_EXPERTS
from deltaserve.ops.moe.reference import grouped_experts

__all__ = ["ALL_BUCKETS", "FUSED_MAX_TOKENS", "ROW_BUCKETS", "experts", "fused_serves", "grouped_experts", "route",
           "sparse_block", "SHARED_SLOT_MAX_TOKENS", "shared_slot_serves"]

FUSED_DTYPES = (torch.bfloat16, torch.float16)
MAX_EXPERTS = 1024  # the routing and align kernels hold one row of every expert in registers
SHARED_SLOT_MAX_TOKENS = 1  # the batches sparse_block's shared slot takes (above, the shared expert runs apart)


def _route_on_gpu(logits: torch.Tensor) -> bool:
    return logits.is_cuda and logits.shape[1] <= MAX_EXPERTS and logits.stride(1) == 1


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] -> (topk_ids [T, k] (int32 from the kernel, int64 from torch), topk_weights [T, k] float32):
    softmax in float32, the k largest, renormalised to sum 1 where `renormalize` (see reference.route)."""
    if _route_on_gpu(logits):
        from deltaserve.ops.moe import cuda
        return cuda.route(logits, top_k, renormalize)
    return reference.route(logits, top_k, renormalize)


def fused_serves(x: torch.Tensor, gate_up, down, top_k: int) -> bool:
    """Whether the fused kernels take this call: a CUDA batch of a 16-bit dtype with unit last stride, at most
    MAX_EXPERTS experts, and either plain weight tensors of x's dtype with unit last strides at 1 to
    FUSED_MAX_TOKENS tokens (above, where the tile table names the bucket: configs.prompt_tiles_tabled), or stacked
    quantized experts (quantized.py) of one format at any token count (their only other path dequantizes every
    expert)."""
    if not (x.is_cuda and x.dtype in FUSED_DTYPES and x.shape[0] >= 1 and x.stride(1) == 1
            and gate_up.shape[0] <= MAX_EXPERTS):
        return False
    if isinstance(gate_up, QUANTIZED_EXPERTS):
        return type(gate_up) is type(down) and quantized.fused_layout(gate_up, down)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
            and gate_up.dtype == down.dtype == x.dtype and gate_up.stride(2) == down.stride(2) == 1):
        return False
    E, two_i, H = gate_up.shape
    return x.shape[0] <= FUSED_MAX_TOKENS or prompt_tiles_tabled(E, top_k, H, two_i // 2, x.shape[0])


def experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up, down,
            shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x: [T, H]; topk_ids, topk_weights: [T, k]; gate_up [E, 2I, H] (gate rows first); down [E, H, I];
    shared: (the shared expert's output [T, H], its gate logits [T, 1]) or None.
    Returns sum_j w_j expert_{id_j}(x) (+ sigmoid(gate) * shared): [T, H] in x.dtype."""
    if fused_serves(x, gate_up, down, topk_ids.shape[1]):
        from deltaserve.ops.moe import cuda, dequantized
        E, two_i, H = gate_up.shape
        tiles = tiles_for(E, topk_ids.shape[1], H, two_i // 2, x.shape[0], quantized.format_name(gate_up))
        if tiles.grouped:  # an eager prompt chunk the table sends to the dequantized groups (configs.GROUPED_BUCKETS)
            return dequantized.grouped_experts(x, topk_ids, topk_weights, gate_up, down, shared)
        return cuda.fused_experts(x, topk_ids, topk_weights, gate_up, down, tiles, shared)
    if isinstance(gate_up, QUANTIZED_EXPERTS):
        raise ValueError(f"stacked {quantized.format_name(gate_up)} experts run on the fused kernels only (a CUDA "
                         f"batch of bf16 / fp16); got x {x.dtype} on {x.device}")
    y, pair_rows = reference.expert_outputs(x, topk_ids, gate_up, down)
    if y.is_cuda:
        from deltaserve.ops.moe import cuda
        return cuda.combine(y, pair_rows, topk_weights, shared)
    return reference.combine(y, pair_rows, topk_weights, shared)


def shared_slot_serves(x: torch.Tensor, gate_up, down, shared_gate_up, shared_down, top_k: int) -> bool:
    """Whether `sparse_block` takes the fused kernels: `fused_serves` at up to SHARED_SLOT_MAX_TOKENS tokens, and the
    shared expert's gate_up [2I, H] and down [H, I] plain tensors of the routed experts' intermediate size, dtype and
    row strides, or, beside stacked quantized experts, prepared weights that fit them (quantized.slot_fits)."""
    return (x.shape[0] <= SHARED_SLOT_MAX_TOKENS and fused_serves(x, gate_up, down, top_k)
            and quantized.slot_fits(gate_up, shared_gate_up) and quantized.slot_fits(down, shared_down))


def sparse_block(x: torch.Tensor, logits: torch.Tensor, top_k: int, renormalize: bool, gate_up, down, shared_gate_up,
              shared_down, shared_gate: torch.Tensor) -> torch.Tensor:
    """x: [T, H]; logits [T, E] router outputs; gate_up [E, 2I, H], down [E, H, I] the routed experts (plain, or
    stacked quantized experts with the shared expert's prepared weights of their format);
    shared_gate_up [2I, H], shared_down [H, I] the shared expert, shared_gate [T, 1] its gate logits.
    Returns sum_j w_j expert_{id_j}(x) + sigmoid(shared_gate) * shared(x): [T, H], the routing as `route`."""
    if shared_slot_serves(x, gate_up, down, shared_gate_up, shared_down, top_k) and _route_on_gpu(logits):
        from deltaserve.ops.moe import cuda
        E, two_i, H = gate_up.shape
        tiles = tiles_for(E, top_k, H, two_i // 2, x.shape[0], quantized.format_name(gate_up))
        return cuda.fused_moe(x, logits, top_k, renormalize, gate_up, down, shared_gate_up, shared_down,
                              shared_gate, tiles)[0]
    if isinstance(gate_up, QUANTIZED_EXPERTS):
        raise ValueError(f"stacked {quantized.format_name(gate_up)} experts with a shared slot run on the fused "
                         f"kernels only (shared_slot_serves); got x {tuple(x.shape)} {x.dtype} on {x.device}")
    return reference.sparse_block(x, logits, top_k, renormalize, gate_up, down, shared_gate_up, shared_down,
                               shared_gate)
