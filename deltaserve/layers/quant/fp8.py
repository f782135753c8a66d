"""FP8, block-scaled: Qwen's official checkpoints (quant_method "fp8") and online FP8 of a bf16 checkpoint.

On disk, per quantized projection (Qwen's Qwen3.5-*-FP8 layout, DeepSeek's before it):
    weight             float8_e4m3fn [N, K]
    weight_scale_inv   float32 [ceil(N/128), ceil(K/128)]: W[n, k] = weight[n, k] * weight_scale_inv[n//128, k//128]
Activations are quantized at run time per token and 128-wide group of K (dynamic scales): W8A8, see
ops.quant_gemm.fp8_block_linear. `modules_to_not_convert` names what stays bf16 (Qwen3.5: lm_head, the embedding,
GDN in_proj_a/b and conv1d, the routers, vision and MTP), each entry a run of whole dotted name components at the
start or the end of a module's name ("mlp.gate" keeps `...mlp.gate`, not `...mlp.gate_proj`), as transformers
reads the field.

`--quantization fp8` on a bf16 checkpoint quantizes each projection at load with the same 128 x 128 blocks
(fp8_block_quantize), after fusing neighbours, so a fused projection is always one weight; it keeps in bf16 what
Qwen's FP8 release keeps (the GDN gate projections in_proj_a/b, Qwen3-Next's in_proj_ba).
"""

from __future__ import annotations

import math

import torch

from deltaserve.layers.quant.scheme import (FLOATS, PLAIN, Along, Scheme, TpAxes, WeightFormat, checkpoint_names,
                                            describe, expect, stack_rows)
from deltaserve.layers.quant.weight import QuantWeight
from deltaserve.model.errors import WeightLoadError
from deltaserve.ops.quant_gemm import fp8_block_linear, fp8_block_quantize, prepare_fp8_block
from deltaserve.ops.quant_gemm.reference import quantize_activation

BLOCK = (128, 128)  # (rows of N, columns of K) per weight scale: the only block size Qwen publishes
# --load-format dummy: a random byte picks one of 256 e4m3 codes, those of the normal distribution's 256 quantiles
# (x 100, inside e4m3's range): about a normal draw's distribution, for a fraction of the host's time that drawing
# normal floats and quantizing them per block takes
DUMMY_CODES = (torch.special.ndtri((torch.arange(256, dtype=torch.float64) + 0.5) / 256) * 100).float() \
    .to(torch.float8_e4m3fn).view(torch.uint8)
DUMMY_CODE_RMS = DUMMY_CODES.view(torch.float8_e4m3fn).float().pow(2).mean().sqrt().item()
ONLINE_KEPT_BF16 = ("linear_attn.in_proj_a", "linear_attn.in_proj_b", "linear_attn.in_proj_ba")


def name_matches(name: str, entry: str) -> bool:
    """`entry` is a run of whole dotted components at the start or the end of `name`."""
    return name == entry or name.startswith(entry + ".") or name.endswith("." + entry)


def _scale_shape(shape: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(shape[0] / BLOCK[0]), math.ceil(shape[1] / BLOCK[1])


class Fp8BlockScheme(Scheme):
    """A checkpoint's e4m3 weight and its per-block float32 inverse scales."""

    tensors = ("weight", "weight_scale_inv")

    def load(self, prefix, tensors, shape):
        expect(prefix, "weight", tensors["weight"], shape, (torch.float8_e4m3fn,))
        scale = tensors["weight_scale_inv"]
        expect(prefix, "weight_scale_inv", scale, _scale_shape(shape), FLOATS)
        scale = scale.float()
        if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
            raise WeightLoadError(f"tensor '{prefix}.weight_scale_inv' holds negative or non-finite scales")
        return {"weight": tensors["weight"], "weight_scale_inv": scale}

    def tp_axes(self, suffix):
        if suffix == "weight_scale_inv":  # a rank's rows and columns must be whole blocks (or end the matrix)
            return TpAxes(Along(0, BLOCK[0], "FP8 128x128 block"), Along(1, BLOCK[1], "FP8 128x128 block"))
        return PLAIN

    def joinable(self, rows_before, first, nxt):
        return rows_before % BLOCK[0] == 0  # a scale block never spans two projections

    def join(self, parts):
        return {"weight": stack_rows(parts, "weight"), "weight_scale_inv": stack_rows(parts, "weight_scale_inv")}

    def prepare(self, tensors, shape, device):
        weight, scale = tensors["weight"].to(device), tensors["weight_scale_inv"].to(device)
        return QuantWeight(prepare_fp8_block(weight, scale, BLOCK), fp8_block_linear)

    def dummy(self, shape, generator, device):
        """Random DUMMY_CODES, scaled so that a row's mean square is about 1/K (as a normal draw over sqrt(K))."""
        n, k = shape
        if k % 4 == 0:  # four codes a random int32 word: a quarter of the draws
            words = torch.randint(-2**31, 2**31, (n, k // 4), generator=generator, device=device, dtype=torch.int32)
            codes = words.view(torch.uint8)
        else:
            codes = torch.randint(0, 256, shape, generator=generator, device=device, dtype=torch.uint8)
        scale = torch.full(_scale_shape(shape), 1 / (DUMMY_CODE_RMS * math.sqrt(k)), device=device)
        weight = torch.take(DUMMY_CODES.to(codes.device), codes.long()).view(torch.float8_e4m3fn)
        return {"weight": weight, "weight_scale_inv": scale}

    def matrix_bytes(self, n, k):
        rows, cols = _scale_shape((n, k))
        return {"fp8 e4m3 weights": n * k, "fp8 block scales (float32)": 4 * rows * cols}

    def round_activation(self, x):
        """x rounded as fp8_block_linear quantizes it (per row and 128 columns, to e4m3 times its scale), back in
        x.dtype: the dequantized weight times this is the W8A8 product (up to x.dtype's rounding of it)."""
        xq, scale = quantize_activation(x, BLOCK[1])  # [M, K] e4m3, [M, ceil(K/128)]
        return (xq.float() * scale.repeat_interleave(BLOCK[1], dim=1)[:, : x.shape[1]]).to(x.dtype)


class Fp8OnlineScheme(Fp8BlockScheme):
    """A bf16 checkpoint's weight, quantized to e4m3 blocks when prepared."""

    tensors = ("weight",)
    stage_on_host = True  # the bf16 sources are twice the prepared weights

    def load(self, prefix, tensors, shape):
        weight = tensors["weight"]
        if tuple(weight.shape) != tuple(shape) or weight.dtype not in FLOATS:
            raise WeightLoadError(f"tensor '{prefix}.weight' is {describe(weight)}, expected {list(shape)} "
                                  "float32/bfloat16/float16 (online fp8 quantizes a bf16 checkpoint)")
        return {"weight": weight}

    def joinable(self, rows_before, first, nxt):
        return True  # quantized after joining: the blocks are the fused weight's

    def join(self, parts):
        return {"weight": stack_rows(parts, "weight")}

    def prepare(self, tensors, shape, device):
        weight, scale = fp8_block_quantize(tensors["weight"].to(device), BLOCK)
        return QuantWeight(prepare_fp8_block(weight, scale, BLOCK), fp8_block_linear)

    def dummy(self, shape, generator, device):
        return {"weight": torch.randn(shape, generator=generator, device=device) / math.sqrt(shape[1])}


class Fp8Format(WeightFormat):
    """Qwen's FP8 checkpoints (kept_bf16: modules_to_not_convert), or online FP8 of a bf16 one (online=True)."""

    method = "fp8"
    tensor_parallel = True  # the scale blocks of a rank's rows are whole 128-blocks (model/tp_slices.py)

    def __init__(self, kept_bf16: list[str], online: bool = False):
        self.kept_bf16 = tuple(kept_bf16)
        self.scheme = Fp8OnlineScheme() if online else Fp8BlockScheme()
        how = "online from the bf16 checkpoint" if online else "Qwen's block-scaled checkpoint"
        self.description = f"fp8 e4m3 W8A8, 128x128 weight blocks ({how})"

    @classmethod
    def online(cls) -> "Fp8Format":
        return cls(list(ONLINE_KEPT_BF16), online=True)

    def scheme_for(self, name):
        if any(name_matches(spelled, entry) for spelled in checkpoint_names(name) for entry in self.kept_bf16):
            return None
        return self.scheme
