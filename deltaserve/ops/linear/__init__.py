"""Projections fused with the op before them, for decode batches.

At batch 1 a decode step is ~850 kernels, and the ~600 that are not weight reads cost launch latency rather
than bandwidth. These ops read the prologue's input and apply the prologue (RMS norm with the residual add,
silu_and_mul, the GDN gated norm) inside the matrix-vector product, so the normalised activation is never
written and its kernel never launched. On CUDA, for 16-bit inputs, each shape takes what was measured fastest on
an H200 for its row count: the prologue op and then the skinny tensor-core GEMM (`cuda_skinny`, its table
`skinny_configs.json`, 1 to 64 rows), else at one row the fused GEMV (`cuda`, its table `configs.json`), else
the prologue op and cuBLAS. Elsewhere (the CPU, float32, larger batches) the unfused reference ops run.

A weight that is not a plain tensor (a quantized one, layers/quant/weight.py) runs the prologue op and then its
own `.matmul` (the ops.quant_gemm kernels); before an FP8 product that would quantize its activation first the
norm or SiLU kernel writes it quantized as that product reads it, so that its quantize kernel is not launched, and
before a one-row int4 / NVFP4 product on a dp4a kernel it writes the row's fixed-point parts besides the row.
"""

import torch
import torch.nn.functional as F

from deltaserve.ops.linear import reference

__all__ = ["gated_norm_linear", "linear", "matmul", "matmul_blocks", "product_inputs", "rms_norm_and_linear",
           "rms_norm_linear", "silu_mul_linear", "warm_up_skinny", "skinny_warm_up_rows"]


def _on_gpu(x) -> bool:
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


def _skinny_config(x, weight):
    """The skinny GEMM's tuned tile for x @ weight^T, or None (also for an x without a unit last stride, and for
    a quantized weight)."""
    if not _on_gpu(x) or x.stride(-1) != 1 or not isinstance(weight, torch.Tensor):
        return None
    from deltaserve.ops.linear import cuda_skinny
    return cuda_skinny.config_for(*weight.shape, x.shape[0])


def _gemv_serves(prologue: str, x, weight) -> bool:
    """Whether the batch-1 fused GEMV takes this product: measured to beat the unfused ops, and the skinny GEMM
    not measured to beat it."""
    if not _on_gpu(x) or x.shape[0] != 1 or not isinstance(weight, torch.Tensor):
        return False
    if _skinny_config(x, weight) is not None:
        return False
    from deltaserve.ops.linear import cuda
    return cuda.config_for(prologue, *weight.shape) is not None


def matmul(x, weight):
    """x: [M, K] -> x @ weight^T: [M, N] (the skinny GEMM where tuned, else cuBLAS; a quantized weight's own
    product)."""
    if not isinstance(weight, torch.Tensor):
        return weight.matmul(x)
    config = _skinny_config(x, weight)
    if config is not None:
        from deltaserve.ops.linear import cuda_skinny
        return cuda_skinny.linear(x, weight, config)
    return F.linear(x, weight)


def linear(x, weight):
    """x: [M, K] -> x @ weight^T: [M, N] (no prologue)."""
    if _gemv_serves("none", x, weight):
        from deltaserve.ops.linear import cuda
        return cuda.linear(x, weight)
    return matmul(x, weight)


def matmul_blocks(x, weight) -> tuple:
    """x @ weight^T as column blocks: a SplitWeight's parts' products apart (no copy joins them), any other
    weight's product as the one block."""
    blocks = getattr(weight, "matmul_blocks", None)
    return blocks(x) if blocks is not None else (matmul(x, weight),)


def _fp8_input_block(x, weight, keeps_unquantized: bool = False) -> int:
    """The FP8 scale block of K in which `weight`'s product at x's rows (x.shape[0]) wants its activation already
    quantized (an FP8 QuantWeight, or a SplitWeight's FP8 parts, whose product would quantize it by a kernel of its
    own first); 0 otherwise, and where other parts read the activation unquantized and the prologue cannot keep
    it (keeps_unquantized)."""
    takes = getattr(weight, "fp8_input_block", None)
    if takes is None or not _on_gpu(x) or (getattr(weight, "reads_unquantized", False) and not keeps_unquantized):
        return 0
    return takes(x.shape[0]) or 0


def _dp4a_input(x, weight, rows: int) -> tuple[int, bool] | None:
    """The fixed-point parts (group, low_high) that `weight`'s product at `rows` rows reads (an int4 / NVFP4
    QuantWeight, or a SplitWeight's such parts, on a one-row dp4a kernel), which the prologue kernel may write;
    None otherwise."""
    takes = getattr(weight, "dp4a_input", None)
    return takes(rows) if takes is not None and _on_gpu(x) else None


def product_inputs(x, weight) -> tuple[int, tuple[int, bool] | None]:
    """(quant_block, dp4a): what `weight`'s product at x's rows (x [M, ...] 16-bit on the GPU) reads that the
    kernel making x may write for it, as the norm kernels take them: the FP8 scale block of an activation it would
    quantize first (else 0), and the fixed-point parts of a one-row dp4a GEMV (else None)."""
    return _fp8_input_block(x, weight), _dp4a_input(x, weight, x.shape[0])


def rms_norm_linear(x, norm_weight, eps: float, weight, residual=None, blocks: bool = False):
    """See `reference.rms_norm_linear`. Before an FP8 product that would quantize its activation first, the norm
    kernel writes it quantized instead (one launch and a pass over the activation fewer; beside a SplitWeight's
    plain part also unquantized). blocks: the product as `matmul_blocks`'s column blocks."""
    product = matmul_blocks if blocks else matmul
    if _gemv_serves("rms_norm", x, weight):
        from deltaserve.ops.linear import cuda
        out = cuda.rms_norm_linear(x, norm_weight, eps, weight, residual)
        if not blocks:
            return out
        return ((out[0],), out[1]) if residual is not None else (out,)
    if x.dim() == 2 and (block_k := _fp8_input_block(x, weight, keeps_unquantized=True)):
        from deltaserve.ops.norm import cuda as norm_cuda
        keep = getattr(weight, "reads_unquantized", False)
        if residual is None:
            return product(norm_cuda.rms_norm(x, norm_weight, eps, quant_block=block_k, keep_unquantized=keep), weight)
        act, h = norm_cuda.rms_norm(x, norm_weight, eps, residual, quant_block=block_k, keep_unquantized=keep)
        return product(act, weight), h
    if x.dim() == 2 and (parts := _dp4a_input(x, weight, x.shape[0])):
        from deltaserve.ops.norm import cuda as norm_cuda
        if residual is None:
            return product(norm_cuda.rms_norm(x, norm_weight, eps, dp4a=parts), weight)
        act, h = norm_cuda.rms_norm(x, norm_weight, eps, residual, dp4a=parts)
        return product(act, weight), h
    return reference.rms_norm_linear(x, norm_weight, eps, weight, residual, matmul=product)


def rms_norm_and_linear(x, norm_weight, eps: float, weight: torch.Tensor, residual=None):
    """See `reference.rms_norm_and_linear`: the normed rows as well as their product by a plain weight, at one row
    from one launch where the fused GEMV's table names the shape (the normed row written by its first program)."""
    if _gemv_serves("rms_norm", x, weight):
        from deltaserve.ops.linear import cuda
        return cuda.rms_norm_and_linear(x, norm_weight, eps, weight, residual)
    return reference.rms_norm_and_linear(x, norm_weight, eps, weight, residual, matmul=linear)


def silu_mul_linear(x, weight):
    """See `reference.silu_mul_linear`; before an FP8 product, as rms_norm_linear."""
    if _gemv_serves("silu_mul", x, weight):
        from deltaserve.ops.linear import cuda
        return cuda.silu_mul_linear(x, weight)
    if x.dim() == 2 and (block_k := _fp8_input_block(x, weight)):
        from deltaserve.ops.activation import cuda as activation_cuda
        return weight.matmul(activation_cuda.silu_and_mul(x, quant_block=block_k))
    if x.dim() == 2 and (parts := _dp4a_input(x, weight, x.shape[0])):
        from deltaserve.ops.activation import cuda as activation_cuda
        return weight.matmul(activation_cuda.silu_and_mul(x, dp4a=parts))
    return reference.silu_mul_linear(x, weight, matmul=matmul)


def gated_norm_linear(x, gate, norm_weight, eps: float, weight):
    """See `reference.gated_norm_linear`; before an FP8 product whose scale block is the head size, as
    rms_norm_linear (a head's row is one scale group)."""
    if _gemv_serves("gated_norm", x, weight):
        from deltaserve.ops.linear import cuda
        return cuda.gated_norm_linear(x, gate, norm_weight, eps, weight)
    if x.dim() == 3 and _fp8_input_block(x, weight) == x.shape[-1]:
        from deltaserve.ops.norm import cuda as norm_cuda
        return weight.matmul(norm_cuda.gated_rms_norm(x, gate, norm_weight, eps, quant_block=x.shape[-1]))
    if x.dim() == 3 and (parts := _dp4a_input(x, weight, x.shape[0])) and _gated_parts_fit(x, parts[0]):
        from deltaserve.ops.norm import cuda as norm_cuda
        return weight.matmul(norm_cuda.gated_rms_norm(x, gate, norm_weight, eps, dp4a=parts))
    return reference.gated_norm_linear(x, gate, norm_weight, eps, weight, matmul=matmul)


def _gated_parts_fit(x, group: int) -> bool:
    """Whether the gated norm writes fixed-point parts in groups of `group` for x [T, H, D]: one token, D a power
    of two that the group divides."""
    d = x.shape[-1]
    return x.shape[0] == 1 and d & (d - 1) == 0 and d % group == 0


def skinny_warm_up_rows() -> list[int]:
    """Row counts that launch every variant of the skinny GEMM a product can meet: per row bucket its own tile,
    and Triton's specialization of the row count (1, a multiple of 16, any other), i.e. 1, 2, 16, 17, 32, 33, 64."""
    from deltaserve.ops.linear.cuda_skinny import ROW_BUCKETS
    rows = [1]
    for smaller, bucket in zip(ROW_BUCKETS, ROW_BUCKETS[1:]):
        rows += [smaller + 1, bucket]
    return rows


@torch.no_grad()
def warm_up_skinny(weights) -> None:
    """GPU start-up: multiply each weight ([N, K]) once at each of `skinny_warm_up_rows` where the skinny GEMM
    serves, so that no step compiles a variant while serving. Decode graphs cover only their own batch sizes;
    an eager step (a few short prompts, the rows that sample in a prompt step) may have any count up to 64."""
    for weight in weights:
        for rows in skinny_warm_up_rows():
            x = torch.zeros(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
            if _skinny_config(x, weight) is not None:
                matmul(x, weight)
