"""Fused projections: several bias-free linears that read the same input run as one matmul.

`fuse_linears` concatenates their weights into one [sum(out), in] tensor and turns each linear's weight into
a view of its rows, so the parameters keep their checkpoint names and values (and their memory) while the
forward pass reads the weights once, in one GEMM / GEMV launch.
"""

import torch
from torch import nn


def fuse_linears(*linears: nn.Linear) -> torch.Tensor:
    """Returns the fused weight [sum of out_features, in_features]; each linear's weight becomes a view of it."""
    fused = torch.cat([linear.weight.data for linear in linears])
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight = nn.Parameter(fused[start:start + rows], requires_grad=False)
        start += rows
    return fused
