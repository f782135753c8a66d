"""Quantized GEMMs: y [M, N] = x [M, K] @ W^T for FP8 block-scaled (W8A8), int4 W4A16 and NVFP4 (weight-only)
weights. `prepare_*` runs once at load and returns the weight in the kernels' layout (reference.py describes
each format and layout); the ops take any M >= 1 and return x.dtype.

On CUDA, for bf16 / fp16 activations, each product runs what configs.py names for its (format, N, K, row bucket):
the tuned table where the probe measured the shape, else the defaults: one row the CUDA-core GEMV (cuda_gemv), up
to 64 rows the skinny tensor-core kernels (cuda_fp8, cuda_weight_only), more rows torch's block-scaled F.scaled_mm
for FP8 and a bf16 dequantization + cuBLAS for the weight-only formats (or the Triton tiled GEMMs where the
table names them). Elsewhere (the CPU, float32 activations, an FP8 scale block tl.dot cannot take) the
plain-torch reference runs.
"""

import torch

from deltaserve.ops.quant_gemm import configs, reference
from deltaserve.ops.quant_gemm.reference import (Dp4aActivation, Fp8BlockWeight, Int4Weight, Nvfp4Weight,
                                                 fp8_block_quantize, prepare_fp8_block, prepare_int4, prepare_nvfp4)

__all__ = ["Dp4aActivation", "Fp8BlockWeight", "Int4Weight", "Nvfp4Weight", "dp4a_input", "fp8_block_linear",
           "fp8_block_quantize", "fp8_input_block", "int4_linear", "linear_with_tail", "nvfp4_linear",
           "prepare_fp8_block", "prepare_int4", "prepare_nvfp4", "warm_up", "warm_up_rows"]


def _kernels_serve(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.shape[0] > 0


def _fp8_config(w: Fp8BlockWeight, rows: int) -> dict:
    """The table's config for `rows` rows, a GEMV that does not take the weight replaced by the skinny default."""
    from deltaserve.ops.quant_gemm import cuda_gemv

    config = configs.config_for("fp8", *w.shape, rows)
    if config["kind"] == "gemv" and not cuda_gemv.supports(w, config, rows):
        config = configs.skinny_config(*w.shape, "fp8")
    return config


def fp8_input_block(w: Fp8BlockWeight, rows: int) -> int | None:
    """The scale block of K (w's) in which the CUDA product at `rows` rows quantizes its activation by a kernel
    of its own first (the GEMV, the skinny kernel with quant_x 0, the tiled GEMM, torch's F.scaled_mm at a row
    count it takes): the kernel before it may write the activation so instead (an Fp8Activation) and save that
    launch and a pass over the activation. None where it does not (in-kernel quantization, a block the kernels
    do not take)."""
    from deltaserve.ops.quant_gemm import cuda_fp8

    if rows < 1 or not cuda_fp8.supports(w):
        return None
    return w.block_size[1] if _quantizes_first(_fp8_config(w, rows), w, rows) else None


def _quantizes_first(config: dict, w: Fp8BlockWeight, rows: int) -> bool:
    """Whether the FP8 product of `config` at `rows` rows reads its activation quantized by cuda_fp8.quantize
    beforehand (torch's F.scaled_mm takes it so only at row counts it needs no padding for)."""
    from deltaserve.ops.quant_gemm import cuda_fp8

    kind = config["kind"]
    if kind == "torch" and cuda_fp8.torch_supports(w):
        return rows % cuda_fp8.TORCH_ROW_MULTIPLE == 0
    return kind in ("gemv", "gemm", "torch") or (kind == "skinny" and not config.get("quant_x", 1))


def fp8_block_linear(x, w: Fp8BlockWeight):
    """x [M, K] -> [M, N] in x.dtype; see reference.fp8_block_linear. x may be an Fp8Activation (on CUDA, where
    `fp8_input_block` named its block for its rows)."""
    from deltaserve.ops.quant_gemm.reference import Fp8Activation

    from deltaserve.ops.quant_gemm import cuda_fp8, cuda_gemv

    quantized = isinstance(x, Fp8Activation)
    if not quantized:
        reference.check_input(x, w.shape[1])
        if not _kernels_serve(x) or not cuda_fp8.supports(w):
            return reference.fp8_block_linear(x, w)
    config = _fp8_config(w, x.shape[0]) if cuda_fp8.supports(w) else None
    if quantized and (config is None or not _quantizes_first(config, w, x.shape[0]) or x.xq.shape[1] != w.shape[1]
                      or x.block_k != w.block_size[1]):
        raise ValueError(f"an activation quantized as {tuple(x.xq.shape)} in blocks of {x.block_k} does not "
                         f"fit the FP8 product of {tuple(w.shape)} at {x.shape[0]} rows")
    if config["kind"] == "gemv":
        return cuda_gemv.gemv(x, w, config)
    if config["kind"] == "skinny":
        return cuda_fp8.skinny(x, w, config)
    if config["kind"] == "torch" and cuda_fp8.torch_supports(w):
        return cuda_fp8.torch_scaled_mm(x, w)
    if config["kind"] != "gemm":
        config = configs.tiled_config("fp8")
    return cuda_fp8.gemm(x, w, config)


def dp4a_input(w, rows: int) -> tuple[int, bool] | None:
    """(group, low_high) of the fixed-point parts of x (a Dp4aActivation) that the CUDA product of an int4 / NVFP4
    weight at `rows` rows reads, making them by a kernel of its own first where they do not come with x (the
    one-row dp4a GEMVs): the kernel before it may write them instead and save that launch. None where it reads
    none."""
    from deltaserve.ops.quant_gemm import cuda_gemv

    if rows != 1 or not isinstance(w, (Int4Weight, Nvfp4Weight)):
        return None
    config = configs.config_for("int4" if isinstance(w, Int4Weight) else "nvfp4", *w.shape, rows)
    return cuda_gemv.dp4a_input(w, config, rows) if config["kind"] == "gemv" else None


def linear_with_tail(x, w, tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x @ dequant(w)^T [1, N], x's row @ tail^T [1, NT]) in one launch, where w's one-row CUDA product takes the
    16-bit block tail [NT, K] (GDN's [b|a] beside its quantized [q|k|v|z]) in its first NT programs, so that block
    takes no launch of its own: an int4 / NVFP4 dp4a GEMV reading x's parts (x a Dp4aActivation), or FP8's skinny
    kernel reading x quantized by the kernel before (an Fp8Activation holding the row unquantized too). None where
    it does not (multiply apart)."""
    from deltaserve.ops.quant_gemm import cuda_fp8, cuda_gemv
    from deltaserve.ops.quant_gemm.reference import Fp8Activation

    if isinstance(x, Dp4aActivation):
        if not _kernels_serve(x.x) or dp4a_input(w, 1) != (x.group, x.low_high) or tail.dtype != x.x.dtype:
            return None
        config = configs.config_for("int4" if isinstance(w, Int4Weight) else "nvfp4", *w.shape, 1)
        return cuda_gemv.gemv(x, w, config, tail=tail)
    if not (isinstance(x, Fp8Activation) and isinstance(w, Fp8BlockWeight) and x.unquantized is not None):
        return None
    row = x.unquantized
    if (not _kernels_serve(row) or row.shape[0] != 1 or tail.dtype != row.dtype
            or fp8_input_block(w, 1) != x.block_k or x.xq.shape[1] != w.shape[1]):
        return None
    config = _fp8_config(w, 1)
    return cuda_fp8.skinny(x, w, config, tail=tail) if config["kind"] == "skinny" else None


def _weight_only(fmt: str, x, w, written: Dp4aActivation | None = None):
    """x's product on the CUDA kernels the table names; written: x with its fixed-point parts (for a dp4a GEMV)."""
    from deltaserve.ops.quant_gemm import cuda_gemv, cuda_weight_only

    config = configs.config_for(fmt, *w.shape, x.shape[0])
    if config["kind"] == "gemv":
        if cuda_gemv.supports(w, config, x.shape[0]):
            return cuda_gemv.gemv(written if written is not None else x, w, config)
        config = configs.skinny_config(*w.shape, fmt)
    if config["kind"] == "skinny":
        return cuda_weight_only.skinny(x, w, config)
    if config["kind"] == "cublas":
        return cuda_weight_only.cublas(x, w)
    return cuda_weight_only.gemm(x, w, config)


def int4_linear(x, w: Int4Weight):
    """x [M, K] -> x @ dequant(w)^T [M, N] in x.dtype; see reference.int4_linear. x may be a Dp4aActivation (its
    parts read where `dp4a_input` named them)."""
    written, x = (x, x.x) if isinstance(x, Dp4aActivation) else (None, x)
    reference.check_input(x, w.shape[1])
    return _weight_only("int4", x, w, written) if _kernels_serve(x) else reference.int4_linear(x, w)


def nvfp4_linear(x, w: Nvfp4Weight):
    """x [M, K] -> x @ dequant(w)^T [M, N] in x.dtype; see reference.nvfp4_linear. x may be a Dp4aActivation, as
    for int4_linear."""
    written, x = (x, x.x) if isinstance(x, Dp4aActivation) else (None, x)
    reference.check_input(x, w.shape[1])
    return _weight_only("nvfp4", x, w, written) if _kernels_serve(x) else reference.nvfp4_linear(x, w)


def warm_up_rows() -> list[int]:
    """Row counts that compile every kernel variant a product can meet: per decode bucket its tile, and Triton's
    specialisation of the row count (1, a multiple of 16, any other), the GEMV's row blocks (1, 2, 4, 8), then a
    prefill count of each kind."""
    rows = [1, 2, 4, 8]
    for smaller, bucket in zip(configs.DECODE_BUCKETS[1:], configs.DECODE_BUCKETS[2:]):
        rows += [smaller + 1, bucket]
    first, _ = configs.PREFILL_BUCKETS
    return rows + [configs.SKINNY_MAX_ROWS + 1, first // 2, first + 1, 2 * first]


_OPS = {Fp8BlockWeight: fp8_block_linear, Int4Weight: int4_linear, Nvfp4Weight: nvfp4_linear}


@torch.no_grad()
def warm_up(weights, dtype=torch.bfloat16) -> None:
    """GPU start-up, before graph capture: reserve the weight-only prefill's scratch buffer for the largest weight
    (graphs keep its address), then multiply each prepared weight once at each of `warm_up_rows`, so that no step
    compiles a kernel while serving."""
    weights = list(weights)
    devices = {(w.weight if isinstance(w, Fp8BlockWeight) else w.packed).device for w in weights}
    weight_only = [w for w in weights if not isinstance(w, Fp8BlockWeight)]
    if weight_only and all(d.type == "cuda" for d in devices):
        from deltaserve.ops.quant_gemm import cuda_weight_only

        for device in devices:
            largest = max(w.shape[0] * w.shape[1] for w in weight_only if w.packed.device == device)
            cuda_weight_only.reserve_scratch(largest, dtype, device)
    for w in weights:
        device = (w.weight if isinstance(w, Fp8BlockWeight) else w.packed).device
        for rows in warm_up_rows():
            _OPS[type(w)](torch.zeros(rows, w.shape[1], dtype=dtype, device=device), w)
