"""Triton matrix-vector products with a fused prologue, for batch-1 decode (one row; the dispatch in
`ops/linear/__init__.py` sends larger batches to the skinny GEMM or cuBLAS).

y[n] = sum_k a[k] * W[n, k], where a is the prologue's output computed on the fly from its inputs:
  PROLOGUE_NONE        a = x
  PROLOGUE_RMS_NORM    a = rms_norm(x + residual) * (1 + w); program 0 also writes h = x + residual (and, for
                       rms_norm_and_linear, a itself: the product's input that others read too, as the MoE
                       experts read the row their router multiplies)
  PROLOGUE_SILU_MUL    a = silu(x[:, :K]) * x[:, K:]
  PROLOGUE_GATED_NORM  a = w * norm(x) * silu(gate) per group of D columns (whole groups per K block)
  (x, residual, gate: one row each)
Each a value is rounded exactly as the unfused kernel rounds it (ops/norm, ops/activation), so the product
differs from the unfused path only by the order of the float32 sums (the RMS norm's too: each program sums
the row's squares itself, in K blocks).

Grid: cdiv(N, BLOCK_N) programs; each reads BLOCK_N whole weight rows once, K block after K block. Decode is
bound by reading W (27B: ~50 GB a step), and W is read exactly once; the prologue's inputs are a few KB that
every program re-reads from L2. Faster than the prologue kernel + cuBLAS for some of 27B's projection shapes
(configs.json says which; docs/performance.md, 'Decode GEMMs').
"""

import functools
from pathlib import Path

import torch
import triton
import triton.language as tl

from deltaserve.ops import pdl
from deltaserve.ops.linear import reference
from deltaserve.ops.pdl import wait_for_previous_kernel
from deltaserve.ops.tuned_table import read_tuned_table

PROLOGUE_NONE: tl.constexpr = tl.constexpr(0)
PROLOGUE_RMS_NORM: tl.constexpr = tl.constexpr(1)
PROLOGUE_SILU_MUL: tl.constexpr = tl.constexpr(2)
PROLOGUE_GATED_NORM: tl.constexpr = tl.constexpr(3)

# (BLOCK_N, BLOCK_K, num_warps, num_stages): a reasonable tile, for tests (num_stages does not matter here:
# no dot to pipeline).
DEFAULT_CONFIG = (16, 256, 4, 1)
# The tuned table, measured on an H200 by `python -m benchmarks.gemv_probe`: "prologue:N:K" -> a config,
# or null where cuBLAS after the unfused prologue op was faster. A shape missing from it runs unfused: the
# kernel is used only where it was measured to win. DELTASERVE_GEMV_CONFIGS names another file.
CONFIGS_FILE = Path(__file__).with_name("configs.json")


@functools.cache
def _tuned_configs() -> dict:
    """The table, checked: a file named by DELTASERVE_GEMV_CONFIGS must exist and hold "prologue:N:K" keys with
    [BLOCK_N, BLOCK_K, warps, stages] of positive ints or null."""
    return read_tuned_table("DELTASERVE_GEMV_CONFIGS", CONFIGS_FILE, _check_entry)


def _check_entry(where: str, key: str, config) -> None:
    is_config = isinstance(config, list) and len(config) == 4 and all(isinstance(v, int) and v > 0 for v in config)
    if key.count(":") != 2 or not (config is None or is_config):
        raise ValueError(f"{where}: entry {key!r}: {config!r} is not a [BLOCK_N, BLOCK_K, warps, stages] list "
                         "of positive ints or null under a \"prologue:N:K\" key")


def config_for(prologue: str, n: int, k: int) -> tuple[int, int, int, int] | None:
    """The launch config of W [n, k] after `prologue`, or None: run the unfused ops."""
    config = _tuned_configs().get(f"{prologue}:{n}:{k}")
    return tuple(config) if config is not None else None


@triton.jit
def _gemv_kernel(
    x, res, res_out, gate, norm_w, weight, out, a_out,
    N, K, eps, stride_x_h, stride_gate_h, stride_w_n,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    WRITE_A: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """Grid (cdiv(N, BLOCK_N),), one row: x [K] ([2K] for silu-mul; [K / GROUP, GROUP] with head stride
    stride_x_h for the gated norm, gate alike); W: [N, K]; out: [N]; WRITE_A (the RMS norm): program 0 writes the
    normed row a to a_out [K] too.

    Products accumulate elementwise in a [BLOCK_N, BLOCK_K] float32 tile and are reduced once at the end:
    a reduction per K block (shuffles across the tile) makes the loop compute-bound."""
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    ns = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output columns = weight rows
    n_ok = ns < N
    dtype = out.dtype.element_ty

    if PROLOGUE == PROLOGUE_RMS_NORM:  # the whole row's mean square first, K block by K block
        sum_sq = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            h = tl.load(x + ks, mask=ks < K, other=0.0)
            if HAS_RESIDUAL:
                h = h + tl.load(res + ks, mask=ks < K, other=0.0)
            hf = h.to(tl.float32)
            sum_sq += hf * hf
        rstd = 1.0 / tl.sqrt(tl.sum(sum_sq, axis=0) / K + eps)

    if PROLOGUE == PROLOGUE_GATED_NORM:
        # Whole groups per K block: [BLOCK_N, HEADS, GROUP] weight tiles against [HEADS, GROUP] activations,
        # so each group's norm is a reduction over its own GROUP columns (K % BLOCK_K == 0 here).
        HEADS: tl.constexpr = BLOCK_K // GROUP
        dims = tl.arange(0, GROUP)  # [G]
        acc3 = tl.zeros([BLOCK_N, HEADS, GROUP], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            heads = k0 // GROUP + tl.arange(0, HEADS)  # [HEADS]
            xf = tl.load(x + heads[:, None] * stride_x_h + dims[None, :]).to(tl.float32)  # [HEADS, G]
            group_rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / GROUP + eps)  # [HEADS]
            scaled = (tl.load(norm_w + dims)[None, :] * (xf * group_rstd[:, None]).to(dtype)).to(tl.float32)
            g = tl.load(gate + heads[:, None] * stride_gate_h + dims[None, :]).to(tl.float32)
            a = (scaled * (g / (1.0 + tl.exp(-g)))).to(dtype).to(tl.float32)  # [HEADS, G]
            cols = heads[:, None] * GROUP + dims[None, :]  # [HEADS, G] columns of W
            w_ptrs = weight + ns[:, None, None].to(tl.int64) * stride_w_n + cols[None, :, :]  # [BN, HEADS, G]
            if EVEN_N:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=n_ok[:, None, None], other=0.0)
            acc3 += w.to(tl.float32) * a[None, :, :]
        tl.store(out + ns, tl.sum(tl.sum(acc3, axis=2), axis=1).to(dtype), mask=n_ok)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)  # [BK]
            k_ok = ks < K
            if PROLOGUE == PROLOGUE_NONE:
                a = tl.load(x + ks, mask=k_ok, other=0.0).to(tl.float32)
            elif PROLOGUE == PROLOGUE_RMS_NORM:
                h = tl.load(x + ks, mask=k_ok, other=0.0)
                if HAS_RESIDUAL:
                    h = h + tl.load(res + ks, mask=k_ok, other=0.0)
                    tl.store(res_out + ks, h, mask=k_ok & (pid == 0))
                w_norm = tl.load(norm_w + ks, mask=k_ok, other=0.0).to(tl.float32)
                a_rounded = (h.to(tl.float32) * rstd * (1.0 + w_norm)).to(dtype)
                if WRITE_A:
                    tl.store(a_out + ks, a_rounded, mask=k_ok & (pid == 0))
                a = a_rounded.to(tl.float32)
            else:  # PROLOGUE_SILU_MUL
                g = tl.load(x + ks, mask=k_ok, other=0.0).to(tl.float32)
                up = tl.load(x + K + ks, mask=k_ok, other=0.0)
                a = ((g / (1.0 + tl.exp(-g))).to(dtype) * up).to(tl.float32)
            w_ptrs = weight + ns[:, None].to(tl.int64) * stride_w_n + ks[None, :]  # [BN, BK]
            if EVEN_N and EVEN_K:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc += w.to(tl.float32) * a[None, :]
        tl.store(out + ns, tl.sum(acc, axis=1).to(dtype), mask=n_ok)


def _launch(prologue, x, weight, *, res=None, res_out=None, gate=None, norm_w=None, eps=0.0, group=1,
            config=DEFAULT_CONFIG, a_out=None):
    """out [1, N] = W @ prologue(x) for one row x. K is the weight's width; config (BLOCK_N, BLOCK_K, warps,
    stages); a_out [1, K]: where the RMS norm's output goes too."""
    N, K = weight.shape
    if weight.stride(1) != 1:
        raise ValueError(f"weight must have a unit last stride, got strides {tuple(weight.stride())}")
    block_n, block_k, num_warps, num_stages = config
    if prologue == PROLOGUE_GATED_NORM and (block_k % group or K % block_k):
        block_k = group  # whole groups, and whole K blocks
    out = torch.empty(1, N, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x, res if res is not None else x, res_out if res_out is not None else out,
        gate if gate is not None else x, norm_w if norm_w is not None else weight, weight, out,
        a_out if a_out is not None else out, N, K, eps, x.stride(1) if x.dim() == 3 else 0,
        gate.stride(1) if gate is not None else 0, weight.stride(0),
        PROLOGUE=prologue, HAS_RESIDUAL=res is not None, GROUP=group, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_N=N % block_n == 0, EVEN_K=K % block_k == 0, WRITE_A=a_out is not None, num_warps=num_warps,
        num_stages=num_stages,
        **pdl.launch_args(x.device),
    )
    return out


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _check_row_input(name, x, weight, width):
    _require(x.dim() == 2 and x.shape == (1, width) and x.stride(1) == 1,
             f"{name} must be [1, {width}] with a unit last stride, got {tuple(x.shape)} strides {tuple(x.stride())}")
    _require(x.dtype == weight.dtype, f"{name} dtype {x.dtype} differs from the weight's {weight.dtype}")


# config: the launch config, "tuned" for the table's (None there runs the unfused reference ops instead).


def linear(x, weight, config="tuned"):
    """x: [1, K] -> x @ W^T: [1, N] (no prologue)."""
    _check_row_input("x", x, weight, weight.shape[1])
    config = config_for("none", *weight.shape) if config == "tuned" else config
    if config is None:
        return torch.nn.functional.linear(x, weight)
    return _launch(PROLOGUE_NONE, x, weight, config=config)


def rms_norm_linear(x, norm_weight, eps, weight, residual=None, config="tuned"):
    """See reference.rms_norm_linear."""
    K = weight.shape[1]
    _check_row_input("x", x, weight, K)
    config = config_for("rms_norm", *weight.shape) if config == "tuned" else config
    if config is None:
        return reference.rms_norm_linear(x, norm_weight, eps, weight, residual)
    if residual is None:
        return _launch(PROLOGUE_RMS_NORM, x, weight, norm_w=norm_weight, eps=eps, config=config)
    _check_row_input("residual", residual, weight, K)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = _launch(PROLOGUE_RMS_NORM, x, weight, res=residual, res_out=h, norm_w=norm_weight, eps=eps,
                  config=config)
    return out, h


def rms_norm_and_linear(x, norm_weight, eps, weight, residual=None, config="tuned"):
    """See reference.rms_norm_and_linear: (the normed row [1, K], its product [1, N], h = x + residual or None)
    from one launch (the config of the "rms_norm" prologue's entry)."""
    K = weight.shape[1]
    _check_row_input("x", x, weight, K)
    config = config_for("rms_norm", *weight.shape) if config == "tuned" else config
    if config is None:
        return reference.rms_norm_and_linear(x, norm_weight, eps, weight, residual)
    normed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is None:
        out = _launch(PROLOGUE_RMS_NORM, x, weight, norm_w=norm_weight, eps=eps, config=config, a_out=normed)
        return normed, out, None
    _check_row_input("residual", residual, weight, K)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = _launch(PROLOGUE_RMS_NORM, x, weight, res=residual, res_out=h, norm_w=norm_weight, eps=eps,
                  config=config, a_out=normed)
    return normed, out, h


def silu_mul_linear(x, weight, config="tuned"):
    """See reference.silu_mul_linear."""
    _check_row_input("x", x, weight, 2 * weight.shape[1])
    config = config_for("silu_mul", *weight.shape) if config == "tuned" else config
    if config is None:
        return reference.silu_mul_linear(x, weight)
    return _launch(PROLOGUE_SILU_MUL, x, weight, config=config)


def gated_norm_linear(x, gate, norm_weight, eps, weight, config="tuned"):
    """See reference.gated_norm_linear. x, gate: [1, H, D] with unit last strides (any head stride)."""
    M, H, D = x.shape
    _require(M == 1, f"x must hold one row, got {M}")
    _require(tuple(gate.shape) == (M, H, D), f"gate shape {tuple(gate.shape)} differs from x's {(M, H, D)}")
    _require(H * D == weight.shape[1], f"x has {H} x {D} columns but the weight takes {weight.shape[1]}")
    _require(x.stride(2) == 1 and gate.stride(2) == 1, "x and gate need a unit last stride")
    _require(D >= 16 and D & (D - 1) == 0, f"the group (head) size must be a power of two >= 16, got {D}")
    config = config_for("gated_norm", *weight.shape) if config == "tuned" else config
    if config is None:
        return reference.gated_norm_linear(x, gate, norm_weight, eps, weight)
    return _launch(PROLOGUE_GATED_NORM, x, weight, gate=gate, norm_w=norm_weight, eps=eps, group=D,
                   config=config)
