"""silu_and_mul: y = silu(x[..., :I]) * x[..., I:] for the fused [gate | up] projection output.

On CUDA tensors a Triton kernel (`cuda.py`, imported only then) does it in one pass; elsewhere plain torch.
"""

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2I] -> [..., I] in x's dtype."""
    if x.is_cuda:
        from deltaserve.ops.activation.cuda import silu_and_mul as cuda_silu_and_mul
        return cuda_silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
