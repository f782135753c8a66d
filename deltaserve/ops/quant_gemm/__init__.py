"""Quantized GEMMs: y [M, N] = x [M, K] @ W^T for FP8 block-scaled (W8A8), int4 W4A16 and NVFP4 (weight-only)
weights. `prepare_*` runs once at load and returns the weight in the kernels' layout (reference.py describes
each format and layout); the ops take any M >= 1. Everything runs the plain-torch reference for now.
"""

from deltaserve.ops.quant_gemm import reference
from deltaserve.ops.quant_gemm.reference import (Fp8BlockWeight, Int4Weight, Nvfp4Weight, fp8_block_quantize,
                                                 prepare_fp8_block, prepare_int4, prepare_nvfp4)

__all__ = ["Fp8BlockWeight", "Int4Weight", "Nvfp4Weight", "fp8_block_linear", "fp8_block_quantize", "int4_linear",
           "nvfp4_linear", "prepare_fp8_block", "prepare_int4", "prepare_nvfp4"]


def fp8_block_linear(x, w: Fp8BlockWeight):
    """x [M, K] -> [M, N] in x.dtype; see reference.fp8_block_linear."""
    return reference.fp8_block_linear(x, w)


def int4_linear(x, w: Int4Weight):
    """x [M, K] -> x @ dequant(w)^T [M, N] in x.dtype."""
    return reference.int4_linear(x, w)


def nvfp4_linear(x, w: Nvfp4Weight):
    """x [M, K] -> x @ dequant(w)^T [M, N] in x.dtype."""
    return reference.nvfp4_linear(x, w)
