"""Triton silu_and_mul: grid (rows, column blocks); the silu rounds to the input dtype before the product,
as torch's F.silu(gate) * up does. Before an FP8 product it may write its result quantized (silu_and_mul's
quant_block), before a one-row dp4a GEMV its fixed-point parts besides it (dp4a)."""

import torch
import triton
import triton.language as tl

from deltaserve.ops import pdl
from deltaserve.ops.pdl import wait_for_previous_kernel
from deltaserve.ops.quant_gemm.cuda_fp8 import fp8_row_buffers, store_fp8_row
from deltaserve.ops.quant_gemm.cuda_gemv import store_x_parts, x_parts_buffers
from deltaserve.ops.quant_gemm.reference import Dp4aActivation, Fp8Activation


@triton.jit
def _silu_and_mul_kernel(x_ptr, y_ptr, sx_ptr, parts_ptr, x_scale_ptr, v_sum_ptr, inter, x_stride, BLOCK: tl.constexpr,
                         QUANT_BK: tl.constexpr = 0, PARTS_GROUP: tl.constexpr = 0, PARTS_LOW_HIGH: tl.constexpr = False,
                         PDL: tl.constexpr = False):
    """Grid (rows, cdiv(inter, BLOCK)). QUANT_BK > 0 (dividing BLOCK): y_ptr takes the result's e4m3 codes and
    sx_ptr [inter / QUANT_BK, rows] its scales (quant_gemm.cuda_fp8's activation quantization), in place of it.
    PARTS_GROUP > 0 (one row; dividing BLOCK and inter): parts_ptr, x_scale_ptr, v_sum_ptr take the result's
    fixed-point parts for the dp4a GEMVs (cuda_gemv.store_x_parts) besides it."""
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    if QUANT_BK:  # this program's BLOCK columns are BLOCK / QUANT_BK whole scale groups
        first = tl.program_id(1) * BLOCK
        store_fp8_row(act * up, y_ptr + row * inter + first, sx_ptr + first // QUANT_BK * tl.num_programs(0), row,
                      tl.num_programs(0), inter - first, BLOCK, QUANT_BK)
    else:
        tl.store(y_ptr + row * inter + cols, act * up, mask=mask)
    if PARTS_GROUP:  # this program's BLOCK columns are groups tl.program_id(1) * GROUPS ..
        GROUPS: tl.constexpr = BLOCK // PARTS_GROUP
        store_x_parts(tl.reshape((act * up).to(tl.float32), [GROUPS, PARTS_GROUP]), parts_ptr, x_scale_ptr,
                      v_sum_ptr, tl.program_id(1) * GROUPS, inter // PARTS_GROUP, inter // 8, GROUPS, PARTS_GROUP,
                      PARTS_LOW_HIGH)


def silu_and_mul(x: torch.Tensor, quant_block: int = 0, dp4a: tuple[int, bool] | None = None):
    """x [..., 2I] -> [..., I]; quant_block > 0 (x [M, 2I]): quantized for an FP8 product, an Fp8Activation with
    scales per quant_block columns (what quant_gemm.fp8_input_block asked for); dp4a (group, low_high; x [1, 2I]):
    [1, I] with its fixed-point parts, a Dp4aActivation (what quant_gemm.dp4a_input asked for)."""
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    block = 1024
    if dp4a and (quant_block or x2.shape[0] != 1 or inter % dp4a[0] or block % dp4a[0]):
        raise ValueError(f"fixed-point parts are written for one unquantized row whose {inter} columns the group "
                         f"{dp4a[0]} divides, got {tuple(x.shape)} and quant_block {quant_block}")
    if quant_block:
        y, sx = fp8_row_buffers(x2[:, :inter], quant_block)
    else:
        y = sx = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)
    parts = x_parts_buffers(inter, dp4a[0], x.device) if dp4a else (y, y, y)
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
        x2, y, sx, *parts, inter, x2.stride(0), BLOCK=block, QUANT_BK=quant_block,
        PARTS_GROUP=dp4a[0] if dp4a else 0, PARTS_LOW_HIGH=bool(dp4a and dp4a[1]), **pdl.launch_args(x.device))
    if dp4a:
        return Dp4aActivation(y, *parts, *dp4a)
    return Fp8Activation(y, sx, quant_block, x.dtype) if quant_block else y.view(*x.shape[:-1], inter)
