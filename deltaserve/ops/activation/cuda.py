"""Triton silu_and_mul: grid (rows, column blocks); the silu rounds to the input dtype before the product,
as torch's F.silu(gate) * up does."""

import torch
import triton
import triton.language as tl

from deltaserve.ops import pdl
from deltaserve.ops.pdl import wait_for_previous_kernel


@triton.jit
def _silu_and_mul_kernel(x_ptr, y_ptr, inter, x_stride, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    tl.store(y_ptr + row * inter + cols, act * up, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)
    block = 1024
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](x2, y, inter, x2.stride(0), BLOCK=block,
                                                                       **pdl.launch_args(x.device))
    return y.view(*x.shape[:-1], inter)
