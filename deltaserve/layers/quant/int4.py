"""int4 W4A16 in compressed-tensors' "pack-quantized" format (the AWQ/GPTQ checkpoints llm-compressor writes).

On disk, per quantized projection, as compressed-tensors' PackedQuantizationCompressor writes it:
    weight_packed      int32 [N, K/8]: column k is bits 4(k%8)..4(k%8)+3 of word k//8, holding q + 8 (q signed)
    weight_scale       bf16/fp16 [N, K/g]
    weight_zero_point  int32 [ceil(N/8), K/g], the zero points' nibbles packed along N (asymmetric schemes only)
    weight_shape       int [2]: (N, K)
    weight_g_idx       int [K], the group of each column (act-order "group" checkpoints only)
W = (q - zero) * scale per row and group of g columns (zero 0, i.e. nibble 8, when symmetric); activations stay
in the model dtype. Each `config_groups` entry is one scheme (its `targets`: "Linear" or names, "re:" regexes);
`ignore` lists what stays bf16, in the same spelling (exact names and "re:" regexes, compressed-tensors'
match_name). Group sizes 32, 64 and 128 (the kernels' tiles).
"""

from __future__ import annotations

import math
import re

import torch

from deltaserve.layers.quant.scheme import (HALF_FLOATS, REPLICATED, Along, Scheme, TpAxes, WeightFormat,
                                            checkpoint_names, expect, stack_rows)
from deltaserve.layers.quant.weight import QuantWeight
from deltaserve.model.errors import WeightLoadError
from deltaserve.ops.quant_gemm import int4_linear, prepare_int4

GROUP_SIZES = (32, 64, 128)
_INTS = (torch.int32, torch.int64)


def ct_name_matches(name: str, target: str) -> bool:
    """compressed-tensors' rule: "re:" + a regex matched at the start of the name, else the exact name."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return name == target


class Int4Scheme(Scheme):
    """int4 weights in groups of `group_size` columns, with zero points unless symmetric; act_order: the
    checkpoint stores each column's group (weight_g_idx)."""

    uses_scratch = True

    def __init__(self, group_size: int, symmetric: bool, act_order: bool = False):
        self.group_size, self.symmetric, self.act_order = group_size, symmetric, act_order
        self.tensors = ("weight_packed", "weight_scale", "weight_shape") + (() if symmetric else ("weight_zero_point",))
        self.tensors += ("weight_g_idx",) if act_order else ()
        self.optional = ("weight_zero_point",) if symmetric else ()

    def _groups(self, prefix: str, k: int) -> int:
        if k % self.group_size:
            raise WeightLoadError(f"'{prefix}': K = {k} is not a multiple of the group size {self.group_size}")
        return k // self.group_size

    def load(self, prefix, tensors, shape):
        n, k = shape
        groups = self._groups(prefix, k)
        stored = tensors["weight_shape"]
        if stored.numel() != 2 or tuple(int(v) for v in stored.reshape(-1).tolist()) != (n, k):
            raise WeightLoadError(f"tensor '{prefix}.weight_shape' is {stored.tolist()}, expected [{n}, {k}]")
        expect(prefix, "weight_packed", tensors["weight_packed"], (n, k // 8), (torch.int32,))
        expect(prefix, "weight_scale", tensors["weight_scale"], (n, groups), HALF_FLOATS)
        loaded = {"weight_packed": tensors["weight_packed"], "weight_scale": tensors["weight_scale"]}
        if "weight_zero_point" in tensors:
            zero = tensors["weight_zero_point"]
            expect(prefix, "weight_zero_point", zero, (math.ceil(n / 8), groups), (torch.int32,))
            loaded["weight_zero_point"] = zero
        if self.act_order:
            g_idx = tensors["weight_g_idx"]
            expect(prefix, "weight_g_idx", g_idx, (k,), _INTS)
            if bool((g_idx < 0).any()) or bool((g_idx >= groups).any()):
                raise WeightLoadError(f"tensor '{prefix}.weight_g_idx' holds groups outside 0..{groups - 1}")
            loaded["weight_g_idx"] = g_idx.to(torch.int32)
        return loaded

    def tp_axes(self, suffix):
        words, groups = Along(1, 8, "packed int4 word"), Along(1, self.group_size, "int4 group")
        return {"weight_packed": TpAxes(Along(0), words), "weight_scale": TpAxes(Along(0), groups),
                "weight_zero_point": TpAxes(Along(0, 8, "int4 zero-point word"), groups),
                "weight_g_idx": TpAxes(None, Along(0))}.get(suffix, REPLICATED)  # weight_shape: rewritten

    def rank_values(self, prefix, suffix, tensor, dim, spans, shape, tp_size):
        if suffix == "weight_shape":  # the rank's (N, K)
            local = tensor.clone()
            local[..., dim] = sum(length for _, length in spans)
            return local
        if suffix in ("weight_g_idx", "g_idx") and dim == 1:
            return local_groups(f"{prefix}.{suffix}", shape, tensor, spans, self.group_size, tp_size)
        return tensor

    def joinable(self, rows_before, first, nxt):
        if rows_before % 8 or ("weight_zero_point" in first) != ("weight_zero_point" in nxt):
            return False  # zero points are packed 8 rows a word
        g_first, g_next = first.get("weight_g_idx"), nxt.get("weight_g_idx")
        return g_first is None or torch.equal(g_first, g_next)  # one column order for the joined rows

    def join(self, parts):
        joined = {name: stack_rows(parts, name) for name in ("weight_packed", "weight_scale", "weight_zero_point")
                  if name in parts[0]}
        if "weight_g_idx" in parts[0]:
            joined["weight_g_idx"] = parts[0]["weight_g_idx"]
        return joined

    def prepare(self, tensors, shape, device):
        on = {name: tensor.to(device) for name, tensor in tensors.items()}
        prepared = prepare_int4(on["weight_packed"], on["weight_scale"], on.get("weight_zero_point"),
                                self.group_size, on.get("weight_g_idx"), shape)
        return QuantWeight(prepared, int4_linear)

    def dummy(self, shape, generator, device):
        n, k = shape
        groups = k // self.group_size
        words = dict(dtype=torch.int32, generator=generator, device=device)
        # (q - zero) of random nibbles has a standard deviation of about 4.6 (6.5 with random zero points)
        spread = 4.6 if self.symmetric else 6.5
        scale = torch.full((n, groups), 1 / (spread * math.sqrt(k)), dtype=torch.bfloat16, device=device)
        tensors = {"weight_packed": torch.randint(-2**31, 2**31, (n, k // 8), **words), "weight_scale": scale}
        if not self.symmetric:
            tensors["weight_zero_point"] = torch.randint(-2**31, 2**31, (math.ceil(n / 8), groups), **words)
        if self.act_order:  # a real permutation, so the column-order path runs
            tensors["weight_g_idx"] = torch.arange(k, device=device).roll(1).div(self.group_size,
                                                                              rounding_mode="floor").int()
        return tensors

    def matrix_bytes(self, n, k):
        """As ops.quant_gemm.Int4Weight holds it: the packed words, 16-bit scales, one byte per zero point, and an
        int64 column permutation for act-order checkpoints."""
        groups = k // self.group_size
        parts = {"int4 packed weights": n * k // 2, "int4 group scales (16-bit)": 2 * n * groups}
        if not self.symmetric:
            parts["int4 zero points"] = n * groups
        if self.act_order:
            parts["int4 act-order permutation"] = 8 * k
        return parts


def local_groups(name: str, shape: list[int], g_idx: torch.Tensor, spans: list[tuple[int, int]], group_size: int,
                 tp_size: int) -> torch.Tensor:
    """A row-parallel rank's slice of act-order groups g_idx [..., K_rank] (of checkpoint tensor `name`, `shape`;
    the rank's columns `spans` of K, concatenated) -> the groups renumbered from 0 in the rank's own group scales. Each span's columns must hold exactly its own
    groups (those of columns start .. start + length in order); act order that mixes them across the ranks'
    columns is refused, naming the tensor."""
    local, at, first_local = torch.empty_like(g_idx), 0, 0
    for start, length in spans:
        chunk = g_idx[..., at:at + length].long()
        first, count = start // group_size, length // group_size
        if start % group_size or length % group_size:
            raise WeightLoadError(f"'{name}' {shape}: this rank's columns [{start}, {start + length}) of "
                                  f"K are not whole int4 groups of {group_size} columns, so it cannot be split over "
                                  f"--tensor-parallel-size {tp_size}")
        if bool((chunk < first).any()) or bool((chunk >= first + count).any()):
            raise WeightLoadError(f"'{name}' {shape}: act-order groups (g_idx, group size {group_size}) "
                                  f"of this rank's columns [{start}, {start + length}) of K are not its own groups "
                                  f"{first}..{first + count - 1}, so it cannot be split over --tensor-parallel-size "
                                  f"{tp_size} (act order reorders columns across the whole K; serve it with "
                                  "--tensor-parallel-size 1)")
        local[..., at:at + length] = (chunk - first + first_local).to(g_idx.dtype)
        at, first_local = at + length, first_local + count
    return local


class CompressedTensorsFormat(WeightFormat):
    """A compressed-tensors checkpoint: (targets, scheme) per config group, and its ignore list."""

    method = "compressed-tensors"
    tensor_parallel = True  # packed words and group scales sliced by whole words and groups (model/tp_slices.py)

    def __init__(self, groups: list[tuple[tuple[str, ...], Int4Scheme]], ignore: list[str]):
        self.groups, self.ignore = groups, tuple(ignore)
        schemes = ", ".join(f"group {s.group_size} {'symmetric' if s.symmetric else 'asymmetric'}"
                            f"{', act order' if s.act_order else ''}" for _, s in groups)
        self.description = f"int4 W4A16, compressed-tensors pack-quantized ({schemes})"

    def scheme_for(self, name):
        spellings = checkpoint_names(name)
        if any(ct_name_matches(spelled, target) for spelled in spellings for target in self.ignore):
            return None
        for targets, scheme in self.groups:  # every projection is an nn.Linear: the "Linear" target takes them all
            if any(t == "Linear" or ct_name_matches(spelled, t) for t in targets for spelled in spellings):
                return scheme
        return None
