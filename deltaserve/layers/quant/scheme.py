"""The interface of a quantized checkpoint family, as the loader, the layers and the planner use it.

A `WeightFormat` is one checkpoint's quantization (parsed from its config by detect.py): for each projection it
names the `Scheme` that stores it, or None where the projection stays in the model dtype. A `Scheme` knows one
kind of quantized matrix: its tensors on disk, how they are checked (errors name the checkpoint tensor), how
neighbours that share an input are joined along N, how they are prepared for the kernels (the
`ops.quant_gemm` contract), random stand-ins for dummy weights, and the bytes they take on the device.

Names given to `scheme_for` are ours (`model.layers.3.mlp.gate_proj`, experts as
`model.layers.3.mlp.experts.0.gate_proj`); the checkpoint lists may spell them either way a checkpoint does, so
both `checkpoint_names` are matched. Modules outside the projections (embeddings, lm_head, routers, norms,
conv1d) are never quantized, whatever a list says: they are not offered to `scheme_for`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from deltaserve.model.errors import WeightLoadError

_MULTIMODAL_PREFIX = "model.language_model."


def checkpoint_names(name: str) -> tuple[str, str]:
    """Our module name as a text-only checkpoint and as a multimodal one spell it."""
    return name, _MULTIMODAL_PREFIX + name.removeprefix("model.")


def describe(tensor: torch.Tensor) -> str:
    return f"{list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


def expect(prefix: str, suffix: str, tensor: torch.Tensor, shape: tuple[int, ...], dtypes) -> None:
    """Raise a WeightLoadError naming `prefix.suffix` unless the tensor has this shape and one of these dtypes."""
    if tuple(tensor.shape) != tuple(shape) or tensor.dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise WeightLoadError(f"tensor '{prefix}.{suffix}' is {describe(tensor)}, expected {list(shape)} {names}")


def scalar(prefix: str, suffix: str, tensor: torch.Tensor) -> float:
    """A per-tensor scale: one positive finite value (a host read: at load only)."""
    if tensor.numel() != 1:
        raise WeightLoadError(f"tensor '{prefix}.{suffix}' must hold one per-tensor scale, got {describe(tensor)}")
    value = float(tensor.float().item())
    if not math.isfinite(value) or value <= 0:
        raise WeightLoadError(f"tensor '{prefix}.{suffix}' must be a positive finite scale, got {value}")
    return value


@dataclass(frozen=True)
class Along:
    """Where one dimension of a quantized matrix [N, K] runs in a checkpoint tensor: the tensor's `dim`, `per` rows
    (or columns) of the matrix per index along it (8 for int32 words of nibbles, g for group scales) and the name
    of that unit, for errors ("packed int4 word", "int4 group")."""

    dim: int
    per: int = 1
    unit: str = ""


@dataclass(frozen=True)
class TpAxes:
    """Where a checkpoint tensor of one projection holds the matrix's N (rows) and K (columns), for slicing it per
    tensor-parallel rank (model/tp_slices.py); None: it does not run along that dimension (read whole)."""

    n: Along | None
    k: Along | None


REPLICATED = TpAxes(None, None)  # per-tensor scales, shapes: every rank reads them whole
PLAIN = TpAxes(Along(0), Along(1))  # a [N, K] tensor of one value per element


FLOATS = (torch.float32, torch.bfloat16, torch.float16)
HALF_FLOATS = (torch.bfloat16, torch.float16)


class Scheme:
    """One kind of quantized matrix [N, K]. Subclasses set `tensors` (the checkpoint's tensors of one projection,
    all required) and `optional`, and implement the methods below."""

    tensors: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    # True where the checkpoint's tensors are larger than the prepared weight (online quantization of bf16):
    # they wait in host memory until `prepare`, instead of on the device
    stage_on_host = False
    # True where prefill dequantizes the matrix into ops/quant_gemm/cuda_weight_only's scratch buffer for cuBLAS
    uses_scratch = False

    def load(self, prefix: str, tensors: dict[str, torch.Tensor], shape: tuple[int, int]) -> dict[str, torch.Tensor]:
        """Check one projection's checkpoint tensors (named `prefix.<suffix>` in errors) for a [N, K] = shape
        matrix and return them in the layout `join` and `prepare` take (converted where the family needs it)."""
        raise NotImplementedError

    def joinable(self, rows_before: int, first: dict[str, torch.Tensor], nxt: dict[str, torch.Tensor]) -> bool:
        """Whether `nxt` can be appended (along N) to a run of loaded projections that starts with `first` and has
        `rows_before` rows: its scale blocks, packed words and per-tensor scales must line up."""
        raise NotImplementedError

    def join(self, parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Loaded projections whose joints are all `joinable` -> one projection of their rows, in order."""
        raise NotImplementedError

    def prepare(self, tensors: dict[str, torch.Tensor], shape: tuple[int, int], device):
        """Loaded tensors -> the QuantWeight the layers multiply by (the tensors moved to `device` first)."""
        raise NotImplementedError

    def dummy(self, shape: tuple[int, int], generator: torch.Generator, device) -> dict[str, torch.Tensor]:
        """Random tensors in the loaded layout, weights of about 1/sqrt(K) (for --load-format dummy)."""
        raise NotImplementedError

    def matrix_bytes(self, n: int, k: int) -> dict[str, int]:
        """Device bytes of one prepared [n, k] matrix, by part (packed values, scales, zero points)."""
        raise NotImplementedError

    def tp_axes(self, suffix: str) -> TpAxes:
        """Where checkpoint tensor `suffix` of one projection holds N and K (for tensor-parallel slicing; only
        formats whose WeightFormat says tensor_parallel implement it)."""
        raise NotImplementedError

    def rank_values(self, prefix: str, suffix: str, tensor: torch.Tensor, dim: int, spans: list[tuple[int, int]],
                    shape: list[int], tp_size: int) -> torch.Tensor:
        """A rank's slice of checkpoint tensor `prefix.suffix` (of `shape`) whose values name positions in the
        matrix, renumbered for the rank's [N, K] (spans: its (start, length) ranges along matrix dim `dim`, 0 = N,
        1 = K); the others as they are (the default)."""
        return tensor

    def round_activation(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] as the scheme's products see it: itself for weight-only schemes (the default). Used where a
        weight is dequantized instead of multiplied by its op (the MoE fallback), to keep the op's semantics."""
        return x


class WeightFormat:
    """One checkpoint's quantization: `method` is its --quantization name, `description` what the logs and the
    memory plan show."""

    method: str = ""
    description: str = ""
    # whether the loader can read a tensor-parallel rank's slice of its tensors (model/tp_slices.py)
    tensor_parallel: bool = False

    def scheme_for(self, name: str) -> Scheme | None:
        """The scheme storing our projection `name`, or None: it stays in the model dtype."""
        raise NotImplementedError


def stack_rows(parts: list[dict[str, torch.Tensor]], suffix: str) -> torch.Tensor:
    """One tensor of every part, concatenated along dim 0."""
    return torch.cat([part[suffix] for part in parts])
