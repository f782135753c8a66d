"""Prompt chunks on stacked quantized experts: a group of experts at a time dequantized to the activations' dtype
and multiplied by torch's grouped matmul, then the combine.

    grouped_experts(x, topk_ids, topk_weights, gate_up, down, shared, scratch_bytes)   -> [T, H]

Why. On a chunk of thousands of tokens every expert has hundreds of pairs and the product is bound by the matmul
rate, where the fused kernels (cuda.py, shaped for decode's weight streaming) reached 73 TFLOP/s on FP8 experts at
8,192 tokens (docs/performance.md, MoE). Dequantizing a layer's experts reads their quantized bytes once and writes
them in 16 bits (35B-A3B: ~0.8 GB of FP8 read, 1.6 GB written, ~0.5 ms at 4.8 TB/s), after which the bf16 grouped
matmul runs near the tensor cores' rate. The tile table chooses this path per prompt-chunk bucket ("grouped": 1,
configs.py), where benchmarks/moe_probe.py measured it faster.

The experts go in groups of at most `scratch_bytes` of dequantized weights (one layer's are 1.6 GB for 35B-A3B, 4.8
GB for 122B-A10B: memory the KV cache would lose), so the pairs sorted by expert are cut into the groups' row
ranges: one host sync a call, for those ranges (a prompt chunk's step runs eagerly, outside CUDA graphs).
FP8 experts keep their W8A8 semantics: each projection's input is rounded as the fused kernels quantize it (per row
and 128 columns, to e4m3 times its scale) before the 16-bit product.
"""

from __future__ import annotations

import torch

from deltaserve.ops.activation import silu_and_mul
from deltaserve.ops.moe.quantized import FP8_BLOCK, Fp8Experts, Int4Experts
from deltaserve.ops.moe.reference import grouped_mm
from deltaserve.ops.quant_gemm import cuda_fp8, cuda_weight_only
from deltaserve.ops.quant_gemm.reference import Fp8BlockWeight, Int4Weight, Nvfp4Weight

SCRATCH_BYTES = 256 << 20  # dequantized weights held at once: 40 of 35B-A3B's experts, 13 of 122B-A10B's


def _dequantized(stack, first: int, last: int, dtype: torch.dtype) -> torch.Tensor:
    """Experts [first, last) of a stack (Fp8Experts, Int4Experts or Nvfp4Experts of [E, N, K]) -> [G, N, K] in
    dtype, by one dequantize launch over the group as one [G*N, K] weight (int4 and NVFP4 scale each row; FP8's
    128-row scale blocks line up where N is a multiple of 128, as in every published shape)."""
    _, n, k = stack.shape
    rows = (last - first) * n
    out = torch.empty(last - first, n, k, dtype=dtype, device=_device(stack))
    if isinstance(stack, Fp8Experts) and n % FP8_BLOCK[0]:  # the experts' last scale rows are partial: one by one
        for e in range(first, last):
            cuda_fp8.dequantize(stack.expert(e), dtype, out[e - first])
    elif isinstance(stack, Fp8Experts):
        w = Fp8BlockWeight(stack.weight[first:last].reshape(rows, k),
                           stack.scale_inv[first:last].reshape(-1, stack.scale_inv.shape[2]), FP8_BLOCK)
        cuda_fp8.dequantize(w, dtype, out.view(rows, k))
    elif isinstance(stack, Int4Experts):
        zero = None if stack.zero is None else stack.zero[first:last].reshape(rows, -1)
        w = Int4Weight(stack.packed[first:last].reshape(rows, -1), stack.scale[first:last].reshape(rows, -1), zero,
                       stack.group_size, None, (rows, k))
        cuda_weight_only.dequantize(w, dtype, out.view(rows, k))
    else:
        w = Nvfp4Weight(stack.packed[first:last].reshape(rows, -1), stack.scale[first:last].reshape(rows, -1),
                        stack.scale_2[first:last].reshape(rows), (rows, k))
        cuda_weight_only.dequantize(w, dtype, out.view(rows, k))
    return out


def _device(stack) -> torch.device:
    return (stack.weight if isinstance(stack, Fp8Experts) else stack.packed).device


def _round_fp8(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the FP8 kernels see it: per row and 128 columns, e4m3 times its scale, back in x.dtype."""
    xq, sx = cuda_fp8.quantize(x, 128)  # [M, K] e4m3, [K/128, M]
    return (xq.float() * sx.t().repeat_interleave(128, dim=1)[:, : x.shape[1]]).to(x.dtype)


def grouped_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up, down,
                    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
                    scratch_bytes: int | None = None) -> torch.Tensor:
    """x [T, H]; topk_ids, topk_weights [T, k]; gate_up [E, 2I, H] and down [E, H, I] stacked quantized experts of
    one format (Fp8Experts, Int4Experts, Nvfp4Experts); shared: (the shared expert's output [T, H], its gate logits
    [T, 1]) or None -> sum_j w_j expert_{id_j}(x) (+ sigmoid(gate) * shared): [T, H] in x.dtype. scratch_bytes:
    the dequantized weights held at once (default SCRATCH_BYTES)."""
    from deltaserve.ops.moe import cuda  # the combine kernel

    T, k = topk_ids.shape
    E, two_i, H = gate_up.shape
    inter = two_i // 2
    fp8 = isinstance(gate_up, Fp8Experts)
    sorted_ids, order = torch.sort(topk_ids.reshape(-1), stable=True)  # [P]: order[i] = the pair in row i
    ends = torch.searchsorted(sorted_ids, torch.arange(E, device=x.device, dtype=sorted_ids.dtype), right=True)
    ends = ends.to(torch.int32)  # [E] end of each expert's rows
    inputs = (_round_fp8(x) if fp8 else x)[order // k]  # [P, H] each sorted pair's token
    y = torch.empty(T * k, H, dtype=x.dtype, device=x.device)  # [P, H] each sorted pair's expert output
    scratch = SCRATCH_BYTES if scratch_bytes is None else scratch_bytes
    group = max(1, scratch // ((two_i * H + H * inter) * x.element_size()))
    host_ends = ends.tolist()  # the groups' row ranges
    for first in range(0, E, group):
        last = min(E, first + group)
        start, end = host_ends[first - 1] if first else 0, host_ends[last - 1]
        if end == start:
            continue
        offs = ends[first:last] - start  # [G] within the group's rows
        h = grouped_mm(inputs[start:end], _dequantized(gate_up, first, last, x.dtype).transpose(1, 2), offs=offs)
        act = silu_and_mul(h)  # [rows, I]
        y[start:end] = grouped_mm(_round_fp8(act) if fp8 else act,
                                  _dequantized(down, first, last, x.dtype).transpose(1, 2), offs=offs)
    pair_rows = torch.empty_like(order)
    pair_rows[order] = torch.arange(order.numel(), device=order.device)  # the inverse permutation
    return cuda.combine(y, pair_rows, topk_weights, shared)


__all__ = ["SCRATCH_BYTES", "grouped_experts"]
