"""Fused projections: several bias-free linears that read the same input run as one matmul.

`fuse_linears` concatenates their weights into one [sum(out), in] tensor and turns each linear's weight into
a view of its rows, so the parameters keep their checkpoint names and values (and their memory) while the
forward pass reads the weights once, in one GEMM / GEMV launch.

A projection of a quantized checkpoint is a `QuantLinear` (no parameters; its checkpoint tensors until fusing,
then a prepared QuantWeight). Fusing joins neighbours of one scheme whose blocks line up into one quantized
weight; neighbours that cannot be joined (a bf16 projection beside quantized ones, misaligned scale blocks) stay
row blocks of a SplitWeight (layers/quant/weight.py).
"""

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.layers.quant.weight import SplitWeight, fuse_quantized


class QuantLinear(nn.Module):
    """A projection [out, in] stored quantized by `scheme`. `raw` holds its loaded checkpoint tensors (in the
    scheme's loaded layout) until fusing; then `weight` is its QuantWeight, or None where the fused weight of
    its parent holds its rows."""

    def __init__(self, in_features: int, out_features: int, scheme, device):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.scheme, self.device = scheme, torch.device(device)
        self.raw: dict[str, torch.Tensor] = {}
        self.weight = None

    def part(self) -> tuple:
        """(scheme, loaded tensors, rows), handed over for fusing: the tensors are released here."""
        raw, self.raw = self.raw, {}
        return self.scheme, raw, self.out_features

    def fuse(self) -> None:
        """After loading and after its parent's fuse: a projection no neighbour took is prepared alone."""
        if self.raw:
            self.weight = fuse_quantized([self.part()], self.in_features, self.device)


def fuse_linear_blocks(*blocks, row_multiple: int = 1) -> torch.Tensor:
    """Plain linears' weights, block after block, each block followed by zero rows up to a multiple of
    row_multiple (so that each block's outputs start at an aligned column): [rows, in_features]. Each linear's
    weight becomes a view of its rows."""
    parts, starts = [], []
    start = 0
    for block in blocks:
        for linear in block:
            parts.append(linear.weight.data)
            starts.append((linear, start))
            start += linear.weight.shape[0]
        pad = -start % row_multiple
        if pad:
            parts.append(parts[-1].new_zeros(pad, parts[-1].shape[1]))
            start += pad
    fused = torch.cat(parts)
    for linear, begin in starts:
        linear.weight = nn.Parameter(fused[begin:begin + linear.weight.shape[0]], requires_grad=False)
    return fused


def fuse_linears(*linears: nn.Module):
    """Returns the fused weight [sum of out_features, in_features]. For plain linears a tensor, each linear's
    weight a view of it; with quantized ones a QuantWeight or a SplitWeight of row blocks."""
    if all(isinstance(linear, nn.Linear) for linear in linears):
        return fuse_linear_blocks(linears)
    runs: list[list[nn.Module]] = []  # consecutive linears of one kind: plain, or quantized
    for linear in linears:
        if runs and isinstance(runs[-1][0], QuantLinear) == isinstance(linear, QuantLinear):
            runs[-1].append(linear)
        else:
            runs.append([linear])
    parts = []
    for run in runs:
        if isinstance(run[0], nn.Linear):
            parts.append(fuse_linear_blocks(run))
            continue
        weight = fuse_quantized([linear.part() for linear in run], run[0].in_features, run[0].device)
        if len(run) == 1:
            run[0].weight = weight
        parts += list(weight.parts) if isinstance(weight, SplitWeight) else [weight]
    return parts[0] if len(parts) == 1 else SplitWeight(tuple(parts))


def split_columns(blocks: tuple[torch.Tensor, ...], sizes: list[int]) -> list[torch.Tensor]:
    """Column blocks [T, n_i] of one product (ops.linear.matmul_blocks) split into pieces of `sizes` columns (summing
    to all of them): each piece a view of the block that holds it, or, where a piece spans blocks, its columns
    joined by a copy."""
    if sum(sizes) != sum(block.shape[-1] for block in blocks):
        raise ValueError(f"pieces of {sizes} columns do not split blocks of {[b.shape[-1] for b in blocks]}")
    pieces, index, taken = [], 0, 0  # taken: the columns of blocks[index] in earlier pieces
    for size in sizes:
        parts = []
        while size > 0:
            width = min(size, blocks[index].shape[-1] - taken)
            parts.append(blocks[index][..., taken:taken + width])
            size, taken = size - width, taken + width
            if taken == blocks[index].shape[-1]:
                index, taken = index + 1, 0
        pieces.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1))
    return pieces


def project(x: torch.Tensor, weight) -> torch.Tensor:
    """x: [T, K] -> x @ weight^T: F.linear for a plain tensor, a quantized weight's own product otherwise."""
    return F.linear(x, weight) if isinstance(weight, torch.Tensor) else weight.matmul(x)
