"""NVFP4 checkpoints exported by NVIDIA ModelOpt (quant_method "modelopt", quant_algo "NVFP4").

On disk, per quantized projection:
    weight          uint8 [N, K/2]: two e2m1 values a byte, the low nibble the even column
    weight_scale    float8_e4m3fn [N, K/16]: one scale per 16 columns
    weight_scale_2  float32, one value: the tensor's second-level scale; W = e2m1 * weight_scale * weight_scale_2
                    (joined projections keep theirs per row: ops.quant_gemm takes a [N] weight_scale_2)
    input_scale     float32, one value: the activations' scale for FP4 activations; read and checked, unused
Served weight-only (W4A16, activations in bf16): Hopper has no FP4 tensor cores, so the kernels dequantize the
weight tiles. `exclude_modules` (or `ignore`) lists what stays bf16 as shell globs (fnmatch), as ModelOpt writes
them. Its FP8 KV-cache scales (`k_proj.k_scale`, `v_proj.v_scale`) are read by the loader for --kv-cache-dtype fp8.
"""

from __future__ import annotations

import math
from fnmatch import fnmatchcase

import torch

from deltaserve.layers.quant.scheme import (REPLICATED, Along, Scheme, TpAxes, WeightFormat, checkpoint_names, expect,
                                            scalar, stack_rows)
from deltaserve.layers.quant.weight import QuantWeight
from deltaserve.model.errors import WeightLoadError
from deltaserve.ops.quant_gemm import nvfp4_linear, prepare_nvfp4

GROUP = 16
_E2M1_RMS = 2.93  # root mean square of the 16 e2m1 values (0, 0.5, ..., 6 and their negatives)


class Nvfp4Scheme(Scheme):
    tensors = ("weight", "weight_scale", "weight_scale_2")
    uses_scratch = True
    optional = ("input_scale",)

    def load(self, prefix, tensors, shape):
        n, k = shape
        if k % GROUP:
            raise WeightLoadError(f"'{prefix}': K = {k} is not a multiple of NVFP4's group of {GROUP}")
        expect(prefix, "weight", tensors["weight"], (n, k // 2), (torch.uint8,))
        expect(prefix, "weight_scale", tensors["weight_scale"], (n, k // GROUP), (torch.float8_e4m3fn,))
        loaded = {"weight": tensors["weight"], "weight_scale": tensors["weight_scale"],
                  "weight_scale_2": torch.tensor(scalar(prefix, "weight_scale_2", tensors["weight_scale_2"]))}
        if "input_scale" in tensors:
            scalar(prefix, "input_scale", tensors["input_scale"])  # checked; weight-only serving does not use it
        return loaded

    def tp_axes(self, suffix):
        if suffix == "weight":
            return TpAxes(Along(0), Along(1, 2, "e2m1 byte"))
        if suffix == "weight_scale":
            return TpAxes(Along(0), Along(1, GROUP, "NVFP4 group"))
        return REPLICATED  # weight_scale_2, input_scale: one value a projection

    def joinable(self, rows_before, first, nxt):
        return True  # rows of any scales: each row keeps its own second-level scale

    def join(self, parts):
        per_row = torch.cat([part["weight_scale_2"].reshape(1).expand(part["weight"].shape[0]) for part in parts])
        return {"weight": stack_rows(parts, "weight"), "weight_scale": stack_rows(parts, "weight_scale"),
                "weight_scale_2": per_row}

    def prepare(self, tensors, shape, device):
        on = {name: tensor.to(device) for name, tensor in tensors.items()}
        return QuantWeight(prepare_nvfp4(on["weight"], on["weight_scale"], on["weight_scale_2"]), nvfp4_linear)

    def dummy(self, shape, generator, device):
        n, k = shape
        codes = torch.randint(0, 256, (n, k // 2), generator=generator, device=device, dtype=torch.uint8)
        scales = (0.5 + torch.rand(n, k // GROUP, generator=generator, device=device)).to(torch.float8_e4m3fn)
        return {"weight": codes, "weight_scale": scales, "weight_scale_2": torch.tensor(1 / (_E2M1_RMS * math.sqrt(k)))}

    def matrix_bytes(self, n, k):
        """As ops.quant_gemm.Nvfp4Weight holds it: the codes, the e4m3 scales and a float32 scale_2 per row."""
        return {"nvfp4 e2m1 weights": n * k // 2, "nvfp4 group scales (e4m3)": n * k // GROUP,
                "nvfp4 row scales (float32)": 4 * n}


class Nvfp4Format(WeightFormat):
    method = "modelopt"
    tensor_parallel = True  # packed bytes and 16-column scales sliced by whole groups (model/tp_slices.py)
    description = "nvfp4 e2m1 weights, e4m3 scales per 16 (ModelOpt), served weight-only with bf16 activations"

    def __init__(self, excluded: list[str]):
        self.excluded = tuple(excluded)
        self.scheme = Nvfp4Scheme()

    def scheme_for(self, name):
        if any(fnmatchcase(spelled, glob) for spelled in checkpoint_names(name) for glob in self.excluded):
            return None
        return self.scheme
