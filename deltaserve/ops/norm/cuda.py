"""Triton RMS norms, each row of D whole in registers (D <= 16384).

- `rms_norm`: one program per row (the hidden-size norms: rows of 5120 for 27B); a single decode row written
  quantized for an FP8 product or with its dp4a parts takes a program per ROW_SLICE columns instead, each summing
  the whole row's squares (the same bits) and quantizing its slice.
- `gated_rms_norm`: one program per [BLOCK_ROWS, D] tile (16 rows of GDN's 128-wide heads: one 256-byte row
  per program leaves most of the memory bandwidth unused). It reads x and gate as [T, H, D] with any token
  and head strides, so the gate can be a view of the projection output (no copy).

Same numerics as reference.py: float32 statistics, (1 + w) applied in float32 for the zero-centred norm;
for the gated norm the normalised row is rounded to the input dtype before the weight, as transformers does.
"""

import torch
import triton
import triton.language as tl

from deltaserve.ops import pdl
from deltaserve.ops.pdl import wait_for_previous_kernel
from deltaserve.ops.quant_gemm.cuda_fp8 import (FP8_AMAX_FLOOR, FP8_MAX, fp8_row_buffers, quantize_block,
                                                store_fp8_row)
from deltaserve.ops.quant_gemm.cuda_gemv import store_x_parts, x_parts_buffers
from deltaserve.ops.quant_gemm.reference import Dp4aActivation, Fp8Activation

# Columns a program of a one-row norm writes quantized or with its parts (a multiple of every FP8 block and
# fixed-point group): 27B's 5,120 in 5 programs, 35B-A3B's 2,048 in 2.
ROW_SLICE = 1024
# Columns at a time in which rows written quantized without slices (a prompt step's) are normed and written after
# their sum of squares (OUT_CHUNK, a multiple of the FP8 block): the row is not held in registers past its sum.
PROMPT_OUT_CHUNK = 1024
# Elements per gated-norm program: 16 rows of 128, 16 per thread for 4 warps; rows of 2048 or more go one a
# program, as rms_norm's do.
_GATED_TILE = 2048


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr, sx_ptr, y_kept_ptr, parts_ptr, x_scale_ptr, v_sum_ptr,
                     D, x_stride, res_stride, y_stride, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                     QUANT_BK: tl.constexpr = 0, KEEP_Y: tl.constexpr = False, PARTS_GROUP: tl.constexpr = 0,
                     PARTS_LOW_HIGH: tl.constexpr = False, SLICE: tl.constexpr = 0, OUT_CHUNK: tl.constexpr = 0,
                     PDL: tl.constexpr = False):
    """One row a program. QUANT_BK > 0: y_ptr takes the normed row's e4m3 codes and sx_ptr [D / QUANT_BK, rows]
    its scales per QUANT_BK columns (quant_gemm.cuda_fp8's activation quantization of the row rounded to x's
    dtype), in place of the row; KEEP_Y: y_kept_ptr [rows, D] takes the row as well. PARTS_GROUP > 0 (one row, D a
    multiple of it): parts_ptr, x_scale_ptr, v_sum_ptr take the row's fixed-point parts for the dp4a GEMVs
    (cuda_gemv.store_x_parts) besides the row. SLICE > 0 (one row, a multiple of QUANT_BK and PARTS_GROUP): grid
    (cdiv(D, SLICE),), program p writing columns [p SLICE, (p + 1) SLICE) of every output; each program sums the
    whole row's squares, so that the quantization's work, the bulk of such a row's, spreads over the SMs.
    OUT_CHUNK > 0 (QUANT_BK > 0, a multiple of it, no SLICE or PARTS_GROUP): the outputs are computed and written
    OUT_CHUNK columns at a time from x (and the residual) read again, so that the whole row is not held in registers
    past its sum of squares. Quantized outputs take SLICE or OUT_CHUNK, never the whole row at once: either way the
    row loaded for the sum feeds nothing else, so the compiler lays it out alike and a row's bits are the same in a
    launch of one row or of many (a batch-invariant sum; the whole-row form's layout, and so its sum, differ)."""
    wait_for_previous_kernel(PDL)
    if SLICE:
        row = (tl.program_id(0) * 0).to(tl.int64)
        first = tl.program_id(0) * SLICE
        rows = 1
    else:
        row = tl.program_id(0).to(tl.int64)
        first = 0
        rows = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)  # rounded like torch's add
        if not SLICE:
            tl.store(res_out_ptr + row * D + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    if OUT_CHUNK:
        for first_c in range(0, D, OUT_CHUNK):
            chunk = first_c + tl.arange(0, OUT_CHUNK)
            chunk_ok = chunk < D
            xc = tl.load(x_ptr + row * x_stride + chunk, mask=chunk_ok, other=0.0)
            if HAS_RESIDUAL:
                xc = xc + tl.load(res_ptr + row * res_stride + chunk, mask=chunk_ok, other=0.0)
            wc = tl.load(w_ptr + chunk, mask=chunk_ok, other=0.0).to(tl.float32)
            yc = (xc.to(tl.float32) * rstd * (1.0 + wc)).to(x_ptr.dtype.element_ty)
            store_fp8_row(yc, y_ptr + row * y_stride + first_c, sx_ptr + first_c // QUANT_BK * rows, row, rows,
                          D - first_c, OUT_CHUNK, QUANT_BK)
            if KEEP_Y:
                tl.store(y_kept_ptr + row * D + chunk, yc, mask=chunk_ok)
        return
    if SLICE:  # this program's columns again (from L2), for its share of the outputs
        cols = first + tl.arange(0, SLICE)
        mask = cols < D
        x = tl.load(x_ptr + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            x = x + tl.load(res_ptr + cols, mask=mask, other=0.0)
            tl.store(res_out_ptr + cols, x, mask=mask)
        xf = x.to(tl.float32)
    OUT_BLOCK: tl.constexpr = SLICE if SLICE else BLOCK
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (xf * rstd * (1.0 + w)).to(x_ptr.dtype.element_ty)
    if QUANT_BK:
        store_fp8_row(y, y_ptr + row * y_stride + first, sx_ptr + first // QUANT_BK * rows, row, rows, D - first,
                      OUT_BLOCK, QUANT_BK)
        if KEEP_Y:
            tl.store(y_kept_ptr + row * D + cols, y, mask=mask)
    else:
        tl.store(y_ptr + row * y_stride + cols, y, mask=mask)
    if PARTS_GROUP:  # the columns past D are 0, in groups past D / PARTS_GROUP, which are not stored
        store_x_parts(tl.reshape(y.to(tl.float32), [OUT_BLOCK // PARTS_GROUP, PARTS_GROUP]), parts_ptr, x_scale_ptr,
                      v_sum_ptr, first // PARTS_GROUP, D // PARTS_GROUP, D // 8, OUT_BLOCK // PARTS_GROUP, PARTS_GROUP,
                      PARTS_LOW_HIGH)


@triton.jit(do_not_specialize=["num_rows"])  # the step's token count: one compiled variant for every step
def _gated_rms_norm_kernel(x_ptr, g_ptr, w_ptr, y_ptr, sx_ptr, parts_ptr, x_scale_ptr, v_sum_ptr, num_rows, heads, D,
                           x_tok_stride, x_head_stride, g_tok_stride, g_head_stride, eps, BLOCK_ROWS: tl.constexpr,
                           BLOCK: tl.constexpr, QUANT: tl.constexpr = False, PARTS_GROUP: tl.constexpr = 0,
                           PARTS_LOW_HIGH: tl.constexpr = False, PDL: tl.constexpr = False):
    """Rows r of [T * H, D] (token r // H, head r % H), BLOCK_ROWS per program; y is contiguous. QUANT (D = BLOCK,
    the FP8 product's scale block): y_ptr takes the rows' e4m3 codes and sx_ptr [H, T] a scale a row. PARTS_GROUP
    (one token, D = BLOCK a multiple of it): parts_ptr, x_scale_ptr, v_sum_ptr take the fixed-point parts of the
    token's [H * D] row for the dp4a GEMVs (cuda_gemv.store_x_parts) besides the rows."""
    wait_for_previous_kernel(PDL)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # [BLOCK_ROWS]
    cols = tl.arange(0, BLOCK)  # [BLOCK]
    col_ok = cols < D
    mask = (rows < num_rows)[:, None] & col_ok[None, :]  # [BLOCK_ROWS, BLOCK]
    tok, head = (rows // heads).to(tl.int64), rows % heads  # int32 division, int64 offsets
    rows = rows.to(tl.int64)
    x_rows = x_ptr + tok * x_tok_stride + head * x_head_stride  # [BLOCK_ROWS] row pointers
    xf = tl.load(x_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / D + eps)  # [BLOCK_ROWS]
    normed = (xf * rstd[:, None]).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0)
    scaled = (w[None, :] * normed).to(tl.float32)
    g_rows = g_ptr + tok * g_tok_stride + head * g_head_stride  # [BLOCK_ROWS]
    g = tl.load(g_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = (scaled * (g / (1.0 + tl.exp(-g)))).to(x_ptr.dtype.element_ty)
    if QUANT:  # a row is one scale group of the FP8 product's input (D = its block): codes, and sx [H, T]
        q, s = quantize_block(y.to(tl.float32), FP8_AMAX_FLOOR, FP8_MAX)
        tl.store(y_ptr + rows[:, None] * D + cols[None, :], q, mask=mask)
        tl.store(sx_ptr + head * (num_rows // heads) + tok, s, mask=rows < num_rows)
    else:
        tl.store(y_ptr + rows[:, None] * D + cols[None, :], y, mask=mask)
    if PARTS_GROUP:  # this program's rows (heads) are groups tl.program_id(0) * GROUPS .. of the token's row
        GROUPS: tl.constexpr = BLOCK_ROWS * BLOCK // PARTS_GROUP
        store_x_parts(tl.reshape(y.to(tl.float32), [GROUPS, PARTS_GROUP]), parts_ptr, x_scale_ptr, v_sum_ptr,
                      tl.program_id(0) * GROUPS, num_rows * BLOCK // PARTS_GROUP, num_rows * BLOCK // 8, GROUPS,
                      PARTS_GROUP, PARTS_LOW_HIGH)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """View as [rows, D] with a unit last stride (a copy only if the input is not row-strided)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _heads(t: torch.Tensor) -> torch.Tensor:
    """[T, H, D] as it is, any other rank as [rows, 1, D], with a unit last stride (copied only if need be)."""
    t3 = t if t.dim() == 3 else t.reshape(-1, 1, t.shape[-1])
    return t3 if t3.stride(-1) == 1 else t3.contiguous()


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def rms_norm(x, weight, eps, residual=None, quant_block: int = 0, keep_unquantized: bool = False,
             dp4a: tuple[int, bool] | None = None):
    """See reference.rms_norm. quant_block > 0 (x [M, D]): the normed rows come back quantized for an FP8 product,
    an Fp8Activation with scales per quant_block columns (what quant_gemm.fp8_input_block asked for), not as y;
    keep_unquantized: with y as well, as its `unquantized` (for a product beside the FP8 one that reads it).
    dp4a (group, low_high; x [1, D]): y comes back with its fixed-point parts, a Dp4aActivation (what
    quant_gemm.dp4a_input asked for)."""
    shape, D = x.shape, x.shape[-1]
    x2 = _rows(x)
    if dp4a and (quant_block or x2.shape[0] != 1 or D % dp4a[0]):
        raise ValueError(f"fixed-point parts are written for one unquantized row whose {D} columns the group "
                         f"{dp4a[0]} divides, got rows of {tuple(x.shape)} and quant_block {quant_block}")
    if quant_block:
        y, sx = fp8_row_buffers(x2, quant_block)
    else:
        y = sx = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    kept = torch.empty(x2.shape, dtype=x.dtype, device=x.device) if quant_block and keep_unquantized else y
    parts = x_parts_buffers(D, dp4a[0], x.device) if dp4a else (y, y, y)
    block = max(triton.next_power_of_2(D), quant_block)  # whole scale groups a row
    # one row written quantized or with its parts: slices of ROW_SLICE columns, a program each
    row_slice = ROW_SLICE if x2.shape[0] == 1 and (quant_block or dp4a) and D > ROW_SLICE else 0
    grid = (triton.cdiv(D, row_slice),) if row_slice else (x2.shape[0],)
    # rows written quantized without slices: OUT_CHUNK columns at a time, whole scale blocks, at most the block
    out_chunk = min(block, max(quant_block, PROMPT_OUT_CHUNK // quant_block * quant_block)) if quant_block and not \
        row_slice else 0
    launch = dict(BLOCK=block, QUANT_BK=quant_block, KEEP_Y=kept is not y, PARTS_GROUP=dp4a[0] if dp4a else 0,
                  PARTS_LOW_HIGH=bool(dp4a and dp4a[1]), SLICE=row_slice, OUT_CHUNK=out_chunk, num_warps=_warps(block),
                  **pdl.launch_args(x.device))

    def result(y):
        if dp4a:
            return Dp4aActivation(y, *parts, *dp4a)
        if not quant_block:
            return y.view(shape)
        return Fp8Activation(y, sx, quant_block, x.dtype, unquantized=kept if kept is not y else None)

    if residual is not None:
        r2 = _rows(residual)
        h = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
        _rms_norm_kernel[grid](x2, r2, weight, y, h, sx, kept, *parts, D, x2.stride(0), r2.stride(0), y.stride(0),
                               eps, HAS_RESIDUAL=True, **launch)
        return result(y), h.view(shape)
    _rms_norm_kernel[grid](x2, x2, weight, y, y, sx, kept, *parts, D, x2.stride(0), 0, y.stride(0), eps,
                           HAS_RESIDUAL=False, **launch)
    return result(y)


def _gated_block_rows(num_rows: int, block: int) -> int:
    """Rows a gated-norm program takes (a compile-time constant: each value is its own kernel variant). Many rows
    (prefill): tiles of _GATED_TILE elements; few (decode): fewer rows a program, so that the launch still
    spreads over the SMs (at batch 1, one row a program beats 16-row tiles: docs/performance.md, 'Decode
    kernels')."""
    return max(1, min(_GATED_TILE // block, triton.next_power_of_2(num_rows // 1024 + 1) // 2))


def gated_norm_warm_up_token_counts(heads: int, dim: int, max_tokens: int) -> list[int]:
    """One token count (of [T, heads, dim] inputs, T <= max_tokens) for each kernel variant that steps of up to
    max_tokens tokens launch: running each once at start-up compiles them all before serving."""
    block = triton.next_power_of_2(dim)
    first_of_variant: dict[int, int] = {}
    for tokens in range(1, max_tokens + 1):
        first_of_variant.setdefault(_gated_block_rows(tokens * heads, block), tokens)
    return sorted(first_of_variant.values())


def gated_rms_norm(x, gate, weight, eps, quant_block: int = 0, dp4a: tuple[int, bool] | None = None):
    """See reference.gated_rms_norm. x, gate: [T, H, D] with unit last strides, read in place whatever their
    token and head strides (other ranks as rows of D). Returns y contiguous in x's shape; with quant_block = D
    (x [T, H, D]) the rows as [T, H * D] quantized for an FP8 product instead, an Fp8Activation of scale block D;
    with dp4a (group, low_high; x [1, H, D], D a power of two the group divides) the row [1, H * D] with its
    fixed-point parts, a Dp4aActivation (what quant_gemm.dp4a_input asked for)."""
    if gate.shape != x.shape:
        raise ValueError(f"gate must have x's shape {tuple(x.shape)}, got {tuple(gate.shape)}")
    D = x.shape[-1]
    if quant_block and (quant_block != D or x.dim() != 3):
        raise ValueError(f"quantized rows need x [T, H, D] with D = the scale block {quant_block}, got "
                         f"{tuple(x.shape)}")
    if dp4a and (quant_block or x.dim() != 3 or x.shape[0] != 1 or D & (D - 1) or D % dp4a[0]):
        raise ValueError(f"fixed-point parts are written for one token's unquantized heads [1, H, D], D a power of "
                         f"two the group {dp4a[0]} divides, got {tuple(x.shape)} and quant_block {quant_block}")
    x3, g3 = _heads(x), _heads(gate)
    num_rows = x3.shape[0] * x3.shape[1]
    if quant_block:
        y, sx = fp8_row_buffers(x3.reshape(x3.shape[0], -1), quant_block)
    else:
        y = sx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    parts = x_parts_buffers(num_rows * D, dp4a[0], x.device) if dp4a else (y, y, y)
    block = triton.next_power_of_2(D)
    block_rows = _gated_block_rows(num_rows, block)
    _gated_rms_norm_kernel[(triton.cdiv(num_rows, block_rows),)](
        x3, g3, weight, y, sx, *parts, num_rows, x3.shape[1], D, x3.stride(0), x3.stride(1), g3.stride(0),
        g3.stride(1), eps, BLOCK_ROWS=block_rows, BLOCK=block, QUANT=bool(quant_block),
        PARTS_GROUP=dp4a[0] if dp4a else 0, PARTS_LOW_HIGH=bool(dp4a and dp4a[1]),
        num_warps=_warps(block_rows * block), **pdl.launch_args(x.device))
    if dp4a:
        return Dp4aActivation(y.view(1, num_rows * D), *parts, *dp4a)
    return Fp8Activation(y, sx, quant_block, x.dtype) if quant_block else y
