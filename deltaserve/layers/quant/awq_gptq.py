"""AutoAWQ and GPTQ int4 checkpoints, converted at load into compressed-tensors' layout (int4.py), which the
kernels take. Exact: only the bits move; W = (q - zero) * scale before and after.

AutoAWQ, GEMM version (quant_method "awq"), per projection:
    qweight  int32 [K, N/8]    8 columns of N a word, in AWQ's interleaved order: nibble i of word j holds
                               column 8j + AWQ_ORDER[i] (AWQ_ORDER = 0, 2, 4, 6, 1, 3, 5, 7)
    qzeros   int32 [K/g, N/8]  the zero points, packed as qweight
    scales   fp16 [K/g, N]
GPTQ (quant_method "gptq", AutoGPTQ / GPTQModel), per projection:
    qweight  int32 [K/8, N]    8 rows of K a word, nibble i of word j holding row 8j + i
    qzeros   int32 [K/g, N/8]  8 columns a word in order; checkpoint_format "gptq" stores zero - 1 (its v1
                               quirk), "gptq_v2" the zero itself
    scales   fp16 [K/g, N]
    g_idx    int32 [K]         the group of each row of K (act order, desc_act); absent or k // g otherwise
Symmetric GPTQ (sym: zero 8 everywhere) becomes a symmetric compressed-tensors weight (no zero points).
"""

from __future__ import annotations

import math
import re

import torch

from deltaserve.layers.quant.fp8 import name_matches
from deltaserve.layers.quant.int4 import Int4Scheme
from deltaserve.layers.quant.scheme import HALF_FLOATS, Along, TpAxes, WeightFormat, checkpoint_names, expect
from deltaserve.model.errors import WeightLoadError
from deltaserve.ops.quant_gemm.reference import pack_int4, unpack_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i] of its 8


def _awq_unpack(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C/8] in AWQ's order -> nibbles uint8 [R, C] in column order."""
    nibbles = unpack_int4(words, 8 * words.shape[1])  # [R, C]: nibble i of word j at 8j + i
    order = torch.tensor(AWQ_ORDER, device=words.device)
    columns = torch.empty_like(nibbles).view(words.shape[0], -1, 8)
    columns[:, :, order] = nibbles.view(words.shape[0], -1, 8)  # nibble i -> column AWQ_ORDER[i]
    return columns.view(words.shape[0], -1)


def _pack_along_rows(nibbles: torch.Tensor) -> torch.Tensor:
    """uint8 [N, G] -> int32 [ceil(N/8), G]: compressed-tensors' zero-point packing (8 rows a word)."""
    n = nibbles.shape[0]
    padded = torch.nn.functional.pad(nibbles.t(), (0, 8 * math.ceil(n / 8) - n))  # [G, 8 ceil(N/8)]
    return pack_int4(padded).t().contiguous()


def _as_compressed_tensors(q: torch.Tensor, zero: torch.Tensor | None, scale: torch.Tensor, g_idx=None) -> dict:
    """q uint8 [N, K], zero uint8 [N, K/g] or None (symmetric), scale [N, K/g] -> int4.py's loaded layout."""
    tensors = {"weight_packed": pack_int4(q), "weight_scale": scale.contiguous()}
    if zero is not None:
        tensors["weight_zero_point"] = _pack_along_rows(zero)
    if g_idx is not None:
        tensors["weight_g_idx"] = g_idx
    return tensors


class AwqScheme(Int4Scheme):
    """AutoAWQ's GEMM layout (asymmetric, zero points)."""

    def __init__(self, group_size: int):
        super().__init__(group_size, symmetric=False)
        self.tensors, self.optional = ("qweight", "qzeros", "scales"), ()

    def tp_axes(self, suffix):
        groups = Along(0, self.group_size, "int4 group")
        return {"qweight": TpAxes(Along(1, 8, "packed int4 word"), Along(0)),
                "qzeros": TpAxes(Along(1, 8, "packed int4 word"), groups), "scales": TpAxes(Along(1), groups)}[suffix]

    def load(self, prefix, tensors, shape):
        n, k = shape
        groups = self._groups(prefix, k)
        if n % 8:
            raise WeightLoadError(f"'{prefix}': N = {n} is not a multiple of 8 (AWQ packs 8 columns a word)")
        expect(prefix, "qweight", tensors["qweight"], (k, n // 8), (torch.int32,))
        expect(prefix, "qzeros", tensors["qzeros"], (groups, n // 8), (torch.int32,))
        expect(prefix, "scales", tensors["scales"], (groups, n), HALF_FLOATS)
        q = _awq_unpack(tensors["qweight"]).t().contiguous()  # [N, K]
        zero = _awq_unpack(tensors["qzeros"]).t().contiguous()  # [N, K/g]
        return _as_compressed_tensors(q, zero, tensors["scales"].t())


class GptqScheme(Int4Scheme):
    """GPTQ's layout; v1: the checkpoint stores zero - 1 (checkpoint_format "gptq")."""

    def __init__(self, group_size: int, symmetric: bool, act_order: bool, v1: bool):
        super().__init__(group_size, symmetric, act_order)
        self.v1 = v1
        self.tensors, self.optional = ("qweight", "qzeros", "scales"), ("g_idx",)

    def tp_axes(self, suffix):
        groups = Along(0, self.group_size, "int4 group")
        return {"qweight": TpAxes(Along(1), Along(0, 8, "packed int4 word")),
                "qzeros": TpAxes(Along(1, 8, "packed int4 word"), groups), "scales": TpAxes(Along(1), groups),
                "g_idx": TpAxes(None, Along(0))}[suffix]

    def load(self, prefix, tensors, shape):
        n, k = shape
        groups = self._groups(prefix, k)
        if k % 8 or n % 8:
            raise WeightLoadError(f"'{prefix}': [N, K] = [{n}, {k}] must be multiples of 8 (GPTQ packs 8 a word)")
        expect(prefix, "qweight", tensors["qweight"], (k // 8, n), (torch.int32,))
        expect(prefix, "qzeros", tensors["qzeros"], (groups, n // 8), (torch.int32,))
        expect(prefix, "scales", tensors["scales"], (groups, n), HALF_FLOATS)
        q = unpack_int4(tensors["qweight"], k, dim=0).t().contiguous()  # [N, K]
        zero = unpack_int4(tensors["qzeros"], n).t().to(torch.int16) + (1 if self.v1 else 0)  # [N, K/g]
        if bool((zero > 15).any()):
            raise WeightLoadError(f"tensor '{prefix}.qzeros' stores 15 (zero point 16), which int4 cannot hold")
        if self.symmetric:
            if not bool((zero == 8).all()):
                bad = int(zero[zero != 8][0])
                raise WeightLoadError(f"tensor '{prefix}.qzeros' holds zero point {bad}, but the config says sym: "
                                      "true (zero point 8)")
            zero = None
        g_idx = tensors.get("g_idx")
        if g_idx is not None:
            expect(prefix, "g_idx", g_idx, (k,), (torch.int32, torch.int64))
            if bool((g_idx < 0).any()) or bool((g_idx >= groups).any()):
                raise WeightLoadError(f"tensor '{prefix}.g_idx' holds groups outside 0..{groups - 1}")
            trivial = torch.equal(g_idx.long(), torch.arange(k, device=g_idx.device) // self.group_size)
            g_idx = None if trivial and not self.act_order else g_idx.to(torch.int32)
        elif self.act_order:
            raise WeightLoadError(f"checkpoint lacks '{prefix}.g_idx' (desc_act: true needs it)")
        return _as_compressed_tensors(q, None if zero is None else zero.to(torch.uint8), tensors["scales"].t(), g_idx)


class Int4ConvertedFormat(WeightFormat):
    """An AutoAWQ or GPTQ checkpoint: one scheme for every projection but those `kept_bf16` names (the
    `modules_to_not_convert` spelling of fp8.py) and those the GPTQ `dynamic` field excludes ("-:" regexes)."""

    tensor_parallel = True  # packed words and group scales sliced by whole words and groups (model/tp_slices.py)

    def __init__(self, method: str, scheme: Int4Scheme, kept_bf16: list[str], excluded_regexes: list[str],
                 description: str):
        self.method, self.scheme, self.description = method, scheme, description
        self.kept_bf16, self.excluded = tuple(kept_bf16), tuple(excluded_regexes)

    def scheme_for(self, name):
        for spelled in checkpoint_names(name):
            if any(name_matches(spelled, entry) for entry in self.kept_bf16):
                return None
            if any(re.match(pattern, spelled) for pattern in self.excluded):
                return None
        return self.scheme
