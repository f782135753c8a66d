"""Quantized routed experts stacked for the fused MoE kernels: one projection of every expert in one tensor per
part, the layouts of ops.quant_gemm's prepared weights with a leading expert dimension.

    Fp8Experts   weight [E, N, K] float8_e4m3fn, scale_inv [E, ceil(N/128), ceil(K/128)] float32 (Qwen's FP8
                 checkpoints: W8A8, the activations quantized per row and 128 columns as fp8_block_linear does)
    Int4Experts  packed [E, N, K/8] int32, scale [E, N, K/g] fp16/bf16, zero [E, N, K/g] uint8 or None (W4A16:
                 compressed-tensors pack-quantized, AWQ / GPTQ without act order)
    Nvfp4Experts packed [E, N, K/2] uint8 (two e2m1 codes a byte), scale [E, N, K/16] float8_e4m3fn, scale_2 [E, N]
                 float32 (ModelOpt NVFP4, served weight-only: the tiles dequantized for 16-bit activations)

`stack` builds one from the experts' prepared weights (None where they cannot share a layout: another format, an
FP8 block other than the kernels' K block, act order); `expert(e)` is expert e's prepared weight as views into the
stack, so the stack is the only copy held. `slot_fits` says whether a weight held apart (the shared expert's) runs
as one more slot of a stack's kernels, `as_stack` viewing it as a one-expert stack.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from deltaserve.ops.quant_gemm.reference import Fp8BlockWeight, Int4Weight, Nvfp4Weight

FP8_BLOCK = (128, 128)  # the (N, K) scale block the fused kernels take: Qwen publishes no other


@dataclass(frozen=True)
class Fp8Experts:
    weight: torch.Tensor  # [E, N, K] float8_e4m3fn
    scale_inv: torch.Tensor  # [E, ceil(N/128), ceil(K/128)] float32

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.weight.shape)

    def expert(self, e: int) -> Fp8BlockWeight:
        return Fp8BlockWeight(self.weight[e], self.scale_inv[e], FP8_BLOCK)


@dataclass(frozen=True)
class Int4Experts:
    packed: torch.Tensor  # [E, N, K/8] int32
    scale: torch.Tensor  # [E, N, K/g] fp16/bf16
    zero: torch.Tensor | None  # [E, N, K/g] uint8, None: symmetric (8)
    group_size: int

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, words = self.packed.shape
        return e, n, 8 * words

    def expert(self, e: int) -> Int4Weight:
        zero = None if self.zero is None else self.zero[e]
        return Int4Weight(self.packed[e], self.scale[e], zero, self.group_size, None, self.shape[1:])


@dataclass(frozen=True)
class Nvfp4Experts:
    packed: torch.Tensor  # [E, N, K/2] uint8
    scale: torch.Tensor  # [E, N, K/16] float8_e4m3fn
    scale_2: torch.Tensor  # [E, N] float32

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, half = self.packed.shape
        return e, n, 2 * half

    def expert(self, e: int) -> Nvfp4Weight:
        return Nvfp4Weight(self.packed[e], self.scale[e], self.scale_2[e], self.shape[1:])


def stack(weights: list) -> Fp8Experts | Int4Experts | Nvfp4Experts | None:
    """Prepared weights of one projection, expert by expert (ops.quant_gemm's *Weight objects, one [N, K] each)
    -> the stacked experts, or None where the fused kernels cannot take them."""
    if all(isinstance(w, Fp8BlockWeight) and tuple(w.block_size) == FP8_BLOCK for w in weights):
        return Fp8Experts(torch.stack([w.weight for w in weights]), torch.stack([w.scale_inv for w in weights]))
    if all(isinstance(w, Nvfp4Weight) for w in weights):
        return Nvfp4Experts(torch.stack([w.packed for w in weights]), torch.stack([w.scale for w in weights]),
                            torch.stack([w.scale_2 for w in weights]))
    if not all(isinstance(w, Int4Weight) and w.perm is None for w in weights):
        return None
    first = weights[0]
    if any(w.group_size != first.group_size or (w.zero is None) != (first.zero is None)
           or w.scale.dtype != first.scale.dtype for w in weights):
        return None
    zero = None if first.zero is None else torch.stack([w.zero for w in weights])
    return Int4Experts(torch.stack([w.packed for w in weights]), torch.stack([w.scale for w in weights]), zero,
                       first.group_size)


QUANTIZED_EXPERTS = (Fp8Experts, Int4Experts, Nvfp4Experts)


def as_stack(w) -> Fp8Experts | Int4Experts | Nvfp4Experts | None:
    """One expert's prepared weight as a one-expert stack of views (no copy), None where `stack` would refuse it."""
    if isinstance(w, Fp8BlockWeight) and tuple(w.block_size) == FP8_BLOCK:
        return Fp8Experts(w.weight[None], w.scale_inv[None])
    if isinstance(w, Nvfp4Weight):
        return Nvfp4Experts(w.packed[None], w.scale[None], w.scale_2[None])
    if isinstance(w, Int4Weight) and w.perm is None:
        return Int4Experts(w.packed[None], w.scale[None], None if w.zero is None else w.zero[None], w.group_size)
    return None


def slot_fits(experts, w) -> bool:
    """Whether w runs as a slot of these stacked experts' kernels: a plain [N, K] tensor beside plain experts
    [E, N, K], or a prepared weight of the quantized stacks' format; per tensor an expert's shape, dtype and strides
    (the kernels index the slot with the experts' strides)."""
    if isinstance(experts, torch.Tensor):
        return isinstance(w, torch.Tensor) and _expert_layout(experts) == _expert_layout(w[None])
    one = as_stack(w)
    if type(one) is not type(experts):
        return False
    for field in fields(experts):
        mine, its = getattr(experts, field.name), getattr(one, field.name)
        tensors = isinstance(mine, torch.Tensor) + isinstance(its, torch.Tensor)
        if tensors == 1 or (tensors == 0 and mine != its):  # a zero point on one side only, another group size
            return False
        if tensors == 2 and _expert_layout(mine) != _expert_layout(its):
            return False
    return True


def _expert_layout(t: torch.Tensor) -> tuple:
    """An expert's shape, strides (of dimensions longer than 1: the others are never stepped) and dtype in
    t [E, ...]."""
    strides = tuple(stride for stride, size in zip(t.stride()[1:], t.shape[1:]) if size > 1)
    return tuple(t.shape[1:]), strides, t.dtype


def format_name(w) -> str:
    """"fp8", "int4", "nvfp4", or "bf16" for plain tensors (the tile table's format)."""
    return {Fp8Experts: "fp8", Int4Experts: "int4", Nvfp4Experts: "nvfp4"}.get(type(w), "bf16")


def fused_layout(gate_up, down) -> bool:
    """Whether the kernels take these stacks: FP8 gate and up rows in separate 128-row scale blocks (I a multiple
    of 128); int4 H and I multiples of their groups (always, as prepare_int4 checks K); NVFP4 always (its K is a
    multiple of the 16-column scale group)."""
    inter = gate_up.shape[1] // 2
    if isinstance(gate_up, Fp8Experts):
        return inter % FP8_BLOCK[0] == 0
    if isinstance(gate_up, Nvfp4Experts):
        return True
    return gate_up.shape[2] % gate_up.group_size == 0 and inter % down.group_size == 0
