"""What a quantized projection holds once loaded, and how neighbours that share an input become one weight.

`QuantWeight` is one prepared matrix and its `ops.quant_gemm` op; `SplitWeight` a fused projection whose row
blocks could not become one weight (a bf16 block beside quantized ones, as GDN's in_proj_b/a beside in_proj_qkv/z
in Qwen's FP8 checkpoints, or quantized blocks whose scales do not line up): its product is the parts' products
side by side. Both have `.shape` ([N, K]), `.matmul(x)`, `.dequantize(dtype)` and `.nbytes`, and `ops.linear`
dispatches any weight that is not a plain tensor to its `.matmul` after the prologue op (norm, SiLU, gated norm);
an FP8 QuantWeight's `fp8_input_block` lets the norm or SiLU kernel hand it the activation quantized (a
SplitWeight's too: the norm then keeps the unquantized rows for its other parts), an int4 / NVFP4 one's `dp4a_input`
lets it hand one row with the fixed-point parts its dp4a GEMV reads, and `SplitWeight.matmul_blocks` returns the
parts' products without the copy that joins them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from deltaserve.layers.quant.scheme import Scheme
from deltaserve.ops.linear import matmul


@dataclass(frozen=True)
class QuantWeight:
    """A prepared quantized [N, K] matrix (an ops.quant_gemm *Weight) and the op that multiplies by it."""

    prepared: Any
    op: Callable[[torch.Tensor, Any], torch.Tensor]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.prepared.shape)

    @property
    def nbytes(self) -> int:
        return self.prepared.nbytes

    def matmul(self, x) -> torch.Tensor:
        """x: [M, K] (for FP8 also an ops.quant_gemm Fp8Activation, for int4 / NVFP4 a Dp4aActivation) -> x @ W^T:
        [M, N] in x.dtype."""
        return self.op(x, self.prepared)

    @property
    def is_fp8(self) -> bool:
        """Whether this is an FP8 block-scaled weight multiplied by its FP8 product (which may take an
        Fp8Activation)."""
        from deltaserve.ops import quant_gemm

        return isinstance(self.prepared, quant_gemm.Fp8BlockWeight) and self.op is quant_gemm.fp8_block_linear

    def fp8_input_block(self, rows: int) -> int | None:
        """For an FP8 weight, the scale block of K in which its product at `rows` rows takes its activation
        already quantized (ops.quant_gemm.fp8_input_block); None otherwise."""
        from deltaserve.ops import quant_gemm

        return quant_gemm.fp8_input_block(self.prepared, rows) if self.is_fp8 else None

    @property
    def takes_dp4a(self) -> bool:
        """Whether this is an int4 / NVFP4 weight multiplied by its op (which may take a Dp4aActivation)."""
        from deltaserve.ops import quant_gemm

        return self.op in (quant_gemm.int4_linear, quant_gemm.nvfp4_linear)

    def dp4a_input(self, rows: int) -> tuple[int, bool] | None:
        """For an int4 / NVFP4 weight, (group, low_high) of the fixed-point parts its product at `rows` rows reads
        (ops.quant_gemm.dp4a_input); None otherwise."""
        from deltaserve.ops import quant_gemm

        return quant_gemm.dp4a_input(self.prepared, rows) if self.takes_dp4a else None

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.prepared.dequantize(dtype)


@dataclass(frozen=True)
class SplitWeight:
    """Row blocks [n_i, K] (plain tensors or QuantWeights) of one fused projection, multiplied one by one."""

    parts: tuple

    @property
    def shape(self) -> tuple[int, int]:
        return sum(part.shape[0] for part in self.parts), self.parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    @property
    def reads_unquantized(self) -> bool:
        """Whether a part reads the activation unquantized (a plain or non-FP8 part): an Fp8Activation handed to
        matmul must then hold it (its `unquantized`)."""
        return not all(_is_fp8(part) for part in self.parts)

    def fp8_input_block(self, rows: int) -> int | None:
        """The scale block in which every FP8 part's product at `rows` rows takes its activation already quantized
        (QuantWeight.fp8_input_block); None where some FP8 part does not, or there is none."""
        blocks = {part.fp8_input_block(rows) for part in self.parts if _is_fp8(part)}
        return blocks.pop() if len(blocks) == 1 and None not in blocks else None

    def dp4a_input(self, rows: int) -> tuple[int, bool] | None:
        """The fixed-point parts (group, low_high) that the int4 / NVFP4 parts' products at `rows` rows read, where
        they all read the same (QuantWeight.dp4a_input; the other parts read the row itself); None otherwise."""
        specs = {part.dp4a_input(rows) for part in self.parts if _takes_dp4a(part)}
        return specs.pop() if len(specs) == 1 and None not in specs else None

    def matmul(self, x) -> torch.Tensor:
        """x: [M, K] (or an Fp8Activation, see matmul_blocks) -> [M, sum n_i]."""
        return torch.cat(self.matmul_blocks(x), dim=-1)

    def matmul_blocks(self, x) -> tuple[torch.Tensor, ...]:
        """x: [M, K] -> the parts' products [M, n_i], not joined. x may be an Fp8Activation of the block
        `fp8_input_block` named: the FP8 parts read it, the others its `unquantized`; or a Dp4aActivation: the int4
        / NVFP4 parts read it, the others its row. A quantized block and a plain one run in the quantized product's
        launch where its kernel takes the plain rows (quant_gemm.linear_with_tail)."""
        from deltaserve.ops.quant_gemm.reference import Dp4aActivation, Fp8Activation

        if not isinstance(x, (Dp4aActivation, Fp8Activation)):
            return tuple(matmul(x, part) for part in self.parts)
        if len(self.parts) == 2 and (_is_fp8(self.parts[0]) or _takes_dp4a(self.parts[0])) and isinstance(
                self.parts[1], torch.Tensor):
            from deltaserve.ops.quant_gemm import linear_with_tail

            both = linear_with_tail(x, self.parts[0].prepared, self.parts[1])  # one launch for both blocks
            if both is not None:
                return both
        if isinstance(x, Dp4aActivation):
            return tuple(matmul(x if _takes_dp4a(part) else x.x, part) for part in self.parts)
        if x.unquantized is None and self.reads_unquantized:
            raise ValueError("a SplitWeight with a plain or non-FP8 part needs the Fp8Activation's unquantized rows")
        return tuple(matmul(x if _is_fp8(part) else x.unquantized, part) for part in self.parts)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([part.to(dtype) if isinstance(part, torch.Tensor) else part.dequantize(dtype)
                          for part in self.parts])


def _is_fp8(part) -> bool:
    return isinstance(part, QuantWeight) and part.is_fp8


def _takes_dp4a(part) -> bool:
    return isinstance(part, QuantWeight) and part.takes_dp4a


def fuse_quantized(scheme_parts: list[tuple[Scheme, dict[str, torch.Tensor], int]], k: int, device):
    """Loaded projections (scheme, tensors, rows) that read the same [*, k] input, in row order -> one QuantWeight,
    or a SplitWeight of the fewest that can be joined (consecutive parts of one scheme whose joints line up)."""
    runs: list[list[tuple[Scheme, dict, int]]] = []
    for part in scheme_parts:
        run = runs[-1] if runs else None
        if run and part[0] is run[0][0] and part[0].joinable(sum(p[2] for p in run), run[0][1], part[1]):
            run.append(part)
        else:
            runs.append([part])
    weights = []
    for run in runs:
        scheme, rows = run[0][0], sum(p[2] for p in run)
        tensors = run[0][1] if len(run) == 1 else scheme.join([p[1] for p in run])
        weights.append(scheme.prepare(tensors, (rows, k), device))
    return weights[0] if len(weights) == 1 else SplitWeight(tuple(weights))


def plain_parts(weight) -> list[torch.Tensor]:
    """The plain-tensor matrices a projection multiplies by: the weight itself, a SplitWeight's tensor parts."""
    if isinstance(weight, torch.Tensor):
        return [weight]
    if isinstance(weight, SplitWeight):
        return [part for part in weight.parts if isinstance(part, torch.Tensor)]
    return []


def quantized_parts(weight) -> list[QuantWeight]:
    """The QuantWeights a projection multiplies by."""
    if isinstance(weight, QuantWeight):
        return [weight]
    if isinstance(weight, SplitWeight):
        return [part for part in weight.parts if isinstance(part, QuantWeight)]
    return []


def held_quantized_weights(model: torch.nn.Module) -> list[QuantWeight]:
    """Every QuantWeight the modules of `model` hold (as attributes, in lists, in SplitWeights), each once."""
    held: dict[int, QuantWeight] = {}
    for module in model.modules():
        for value in vars(module).values():
            for weight in value if isinstance(value, list) else [value]:
                held.update({id(part): part for part in quantized_parts(weight)})
    return list(held.values())
