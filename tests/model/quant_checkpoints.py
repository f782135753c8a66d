"""Tiny quantized checkpoints in each family's exact on-disk layout, each with its dequantized twin.

A tiny random checkpoint (deltaserve.demo.build_checkpoint, shapes QUANT_SHAPES: every K a multiple of 128 so
that every group size divides it) has its projections quantized here and saved as the family writes them:
    fp8     by hand, Qwen's layout: e4m3 `weight`, float32 `weight_scale_inv` per 128 x 128 block
    ct      by the compressed-tensors package itself (its observer maths, quantize and pack, its config), so
            deltaserve's reading is checked against its writing
    awq     by hand, AutoAWQ's GEMM layout (qweight/qzeros [., N/8] in AWQ's interleaved nibble order, scales)
    gptq    by hand, GPTQ's layout (qweight [K/8, N], qzeros holding zero - 1, scales, g_idx with act order)
    nvfp4   by hand, ModelOpt's layout (uint8 e2m1 pairs, e4m3 scales per 16, float32 weight_scale_2 and
            input_scale), its quantization config in hf_quant_config.json
The quantization configs are the published ones (PUBLISHED: deltaserve/model_configs/qwen3.5-27b-fp8, -awq, -nvfp4, which
test_quant_errors checks them against), so the real spellings of their exclusion lists are what is read. The twin
holds the dequantized weights (float32, the source's names and config):
what transformers runs as the reference. What stays bf16 is as in the public checkpoints: embeddings, lm_head,
norms, conv1d, routers, shared_expert_gate and GDN in_proj_a/b.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from deltaserve.demo import build_checkpoint

# Every K (hidden 128, attention heads x head_dim 256, GDN value dim 128, MLP widths 128) a multiple of 128;
# q (512 rows) | k (64) | v (64) has an fp8 block boundary inside k|v, so fusing it must split there.
QUANT_SHAPES = dict(hidden_size=128, head_dim=64, num_attention_heads=4, num_key_value_heads=1,
                    linear_num_key_heads=2, linear_key_head_dim=32, linear_num_value_heads=4, linear_value_head_dim=32,
                    intermediate_size=128, moe_intermediate_size=128, shared_expert_intermediate_size=128)
_QUANTIZED = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|in_proj_qkv|in_proj_z|out_proj|gate_proj|up_proj|down_proj)"
                        r"\.weight$")
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
KV_SCALES = (0.0625, 0.125)  # the NVFP4 checkpoints' k_scale and v_scale


# The quantization configs of deltaserve/model_configs/qwen3.5-27b-fp8/config.json, -awq/config.json (the ignore list) and
# -nvfp4/hf_quant_config.json, as published.
PUBLISHED = {
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            "modules_to_not_convert": ["lm_head", "model.language_model.embed_tokens", "linear_attn.in_proj_a",
                                       "linear_attn.in_proj_b", "linear_attn.conv1d", "mlp.gate",
                                       "mlp.shared_expert_gate", "model.visual", "mtp"]},
    "ct_ignore": ["lm_head", "re:.*linear_attn.in_proj_a$", "re:.*linear_attn.in_proj_b$", "re:.*mlp.gate$",
                  "re:.*shared_expert_gate$", "re:.*visual.*", "re:.*mtp.*"],
    "nvfp4": {"producer": {"name": "modelopt", "version": "0.37.0"},
              "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8", "group_size": 16,
                               "exclude_modules": ["lm_head", "model.visual*", "mtp*", "*linear_attn.conv1d*",
                                                   "*mlp.gate", "*shared_expert_gate*", "*linear_attn.in_proj_a*",
                                                   "*linear_attn.in_proj_b*"]}},
}


# ------------------------------------------------------------------------------------------- per matrix
# Each takes a float32 weight [N, K] and returns (its on-disk tensors by suffix, the dequantized weight [N, K]).


def fp8_block(w: torch.Tensor):
    n, k = w.shape
    gn, gk = math.ceil(n / 128), math.ceil(k / 128)
    padded = torch.nn.functional.pad(w, (0, gk * 128 - k, 0, gn * 128 - n)).view(gn, 128, gk, 128)
    scale = padded.abs().amax(dim=(1, 3)) / 448  # [gn, gk]
    q = (padded / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    dq = (q.float() * scale[:, None, :, None]).view(gn * 128, gk * 128)[:n, :k]
    return {"weight": q.view(gn * 128, gk * 128)[:n, :k].contiguous(), "weight_scale_inv": scale}, dq


def ct_int4(w: torch.Tensor, group_size: int, symmetric: bool):
    """compressed-tensors does it all: min/max qparams, quantize and pack (its compressor), and the dequantized
    weight is its own decompress (with the scale in float32, so that (q - zero) * scale is exact)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, group_size=group_size, strategy="group")
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    groups = w.view(w.shape[0], -1, group_size)
    scale, zero = calculate_qparams(groups.amin(dim=2), groups.amax(dim=2), args)
    state = {"weight": w, "weight_scale": scale.to(torch.bfloat16), "weight_zero_point": zero.round().to(torch.int8)}
    packed = PackedQuantizationCompressor.compress(state, scheme)
    readback = dict(packed, weight_scale=packed["weight_scale"].float())
    dq = PackedQuantizationCompressor.decompress(readback, scheme)["weight"]
    return {name: packed[name] for name in ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")
            if name in packed}, dq.float()


def _minmax_int4(w: torch.Tensor, groups_of_columns: torch.Tensor, num_groups: int, symmetric: bool):
    """Asymmetric (or symmetric, zero 8) int4 per row and group: q, zero [N, G] ints, scale [N, G] fp16."""
    n = w.shape[0]
    lo = torch.full((n, num_groups), float("inf")).scatter_reduce(1, groups_of_columns.expand(n, -1), w, "amin")
    hi = torch.full((n, num_groups), -float("inf")).scatter_reduce(1, groups_of_columns.expand(n, -1), w, "amax")
    if symmetric:
        scale = (torch.maximum(hi.abs(), lo.abs()) / 7.5).half()
        zero = torch.full((n, num_groups), 8)
    else:
        lo, hi = lo.clamp(max=0), hi.clamp(min=0)
        scale = ((hi - lo) / 15).half()
        zero = (-lo / scale.float()).round().clamp(0, 15).long()
    s, z = scale.float().gather(1, groups_of_columns.expand(n, -1)), zero.gather(1, groups_of_columns.expand(n, -1))
    q = (w / s + z).round().clamp(0, 15).long()
    return q, zero, scale, (q - z) * s


def _pack_words(nibbles: torch.Tensor) -> torch.Tensor:
    """int [..., 8] nibbles -> int32 words, nibble i at bits 4i."""
    words = (nibbles.long() << (4 * torch.arange(8))).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def awq(w: torch.Tensor, group_size: int):
    n, k = w.shape
    q, zero, scale, dq = _minmax_int4(w, (torch.arange(k) // group_size)[None], k // group_size, symmetric=False)

    def pack(values):  # [R, N] -> [R, N/8], column 8j + AWQ_ORDER[i] into nibble i of word j
        return _pack_words(values.view(values.shape[0], -1, 8)[:, :, AWQ_ORDER])

    return {"qweight": pack(q.t()), "qzeros": pack(zero.t()), "scales": scale.t().contiguous()}, dq


def gptq(w: torch.Tensor, group_size: int, act_order: int | None):
    """Symmetric GPTQ v1 (qzeros store zero - 1 = 7). act_order: the number of equal column blocks whose columns
    the groups permute within (1: the whole K; 2: each half, as one row-parallel rank of 2 holds them); None:
    groups in column order (desc_act false)."""
    n, k = w.shape
    if act_order is None:
        order = torch.arange(k)
    else:  # 37 is prime to every block width here
        block = k // act_order
        order = (torch.arange(k) // block) * block + (torch.arange(k) % block * 37) % block
    g_idx = order // group_size
    q, zero, scale, dq = _minmax_int4(w, g_idx[None], k // group_size, symmetric=True)
    qweight = _pack_words(q.t().reshape(k // 8, 8, n).transpose(1, 2))  # [K/8, N]: rows 8j + i in nibble i
    qzeros = _pack_words((zero.t() - 1).reshape(k // group_size, n // 8, 8))  # [K/g, N/8]
    return {"qweight": qweight, "qzeros": qzeros, "scales": scale.t().contiguous(), "g_idx": g_idx.int()}, dq


def nvfp4(w: torch.Tensor, scale_2: float):
    n, k = w.shape
    blocks = w.view(n, k // 16, 16)
    scale = (blocks.abs().amax(dim=2) / 6 / scale_2).to(torch.float8_e4m3fn)  # [N, K/16]
    step = scale.float()[:, :, None] * scale_2
    scaled = (blocks / torch.where(step > 0, step, torch.ones_like(step))).clamp(-6, 6)
    codes = (scaled.abs()[..., None] - E2M1).abs().argmin(-1) | ((scaled < 0).long() << 3)  # nearest e2m1
    values = E2M1[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    pairs = codes.view(n, k // 2, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    return ({"weight": packed, "weight_scale": scale, "weight_scale_2": torch.tensor(scale_2),
             "input_scale": torch.tensor(0.05)}, (values * step).view(n, k))


# ------------------------------------------------------------------------------------------- checkpoints


@dataclass
class QuantizedPair:
    path: Path  # the quantized checkpoint
    reference: Path  # its dequantized twin (float32, for transformers)
    quantized: list[str]  # the names (ours) of the quantized projection weights


def _nvfp4_share(name: str) -> str:
    """Projections ModelOpt calibrates to one weight_scale_2 (fused in its exports): gate/up, GDN qkv/z."""
    return re.sub(r"\.(gate_proj|up_proj|in_proj_qkv|in_proj_z)\.weight$", ".shared", name)


def quantize_checkpoint(source: Path, folder: Path, family: str, group_size: int = 128, symmetric: bool = False,
                        multimodal: bool = False, fused_experts: bool = False,
                        act_order: int | None = 1) -> QuantizedPair:
    """Write `source`'s projections in `family`'s layout to folder/"quantized", the dequantized twin beside it
    (act_order: GPTQ's, as gptq() takes it)."""
    tensors = load_file(source / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    names = sorted(name for name in tensors if _QUANTIZED.search(name))
    shared_amax: dict[str, float] = {}
    for name in names:
        share = _nvfp4_share(name)
        shared_amax[share] = max(shared_amax.get(share, 0.0), tensors[name].abs().max().item())
    on_disk, dequantized = {}, dict(tensors)
    for name in names:
        w = tensors[name].float()
        if family == "fp8":
            parts, dq = fp8_block(w)
        elif family == "ct":
            parts, dq = ct_int4(w, group_size, symmetric)
        elif family == "awq":
            parts, dq = awq(w, group_size)
        elif family == "gptq":
            parts, dq = gptq(w, group_size, act_order)
        else:
            parts, dq = nvfp4(w, shared_amax[_nvfp4_share(name)] / (6 * 448))
        prefix = name.removesuffix(".weight")
        on_disk.update({f"{prefix}.{suffix}": t for suffix, t in parts.items()})
        dequantized[name] = dq
    kept = {name: t for name, t in tensors.items() if name not in names}
    if fused_experts:
        on_disk = _fuse_experts(on_disk, family)
    if family == "nvfp4":  # ModelOpt's FP8 KV-cache scales, per attention layer
        for name in names:
            if name.endswith("self_attn.k_proj.weight"):
                on_disk[name.replace(".weight", ".k_scale")] = torch.tensor(KV_SCALES[0])
                on_disk[name.replace("k_proj.weight", "v_proj.v_scale")] = torch.tensor(KV_SCALES[1])
    out = dict(kept, **on_disk)
    quant_config, extra = _quant_config(family, group_size, symmetric, act_order is not None)
    if multimodal:  # the language model's names, and quantized MTP and vision tensors the loader skips
        out = {re.sub(r"^model\.", "model.language_model.", k): v for k, v in out.items()}
        out.update({f"{prefix}.{suffix}": t for prefix in ("mtp.layers.0.mlp.gate_proj", "model.visual.blocks.0.qkv")
                    for suffix, t in fp8_block(torch.randn(64, 32))[0].items()})
        config = {"model_type": config["model_type"].removesuffix("_text"), "text_config": config,
                  "tie_word_embeddings": config.get("tie_word_embeddings", False)}
    if quant_config is not None:
        config = dict(config, quantization_config=quant_config)
    path = _write(folder / "quantized", source, config, out)
    for file, content in extra.items():
        (path / file).write_text(json.dumps(content))
    reference = _write(folder / "dequantized", source, json.loads((source / "config.json").read_text()), dequantized)
    return QuantizedPair(path, reference, names)


def _fuse_experts(on_disk: dict, family: str) -> dict:
    """Per-expert tensors -> transformers' fused ones: experts.gate_up_proj[_<suffix>] [E, ...] (gate rows first
    along N: dim 0 of [N, ...] layouts, dim 1 of AWQ's and GPTQ's [K, N] ones; act order's g_idx is gate's, which
    up shares; compressed-tensors' weight_shape the joined [2I, H]) and experts.down_proj[_<suffix>] [E, ...];
    `weight` becomes the bare name."""
    per_expert = re.compile(r"^(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)$")
    fused, parts = {}, {}
    for name, tensor in on_disk.items():
        match = per_expert.match(name)
        if match is None:
            fused[name] = tensor
            continue
        prefix, e, proj, suffix = match.group(1), int(match.group(2)), match.group(3), match.group(4)
        parts.setdefault((prefix, suffix), {})[e, proj] = tensor
    for (prefix, suffix), by_expert in parts.items():
        experts = 1 + max(e for e, _ in by_expert)
        tail = "" if suffix == "weight" else "_" + suffix.removeprefix("weight_")

        def gate_up(e):
            gate, up = by_expert[e, "gate_proj"], by_expert[e, "up_proj"]
            if suffix == "g_idx":
                return gate
            if suffix == "weight_shape":
                return torch.stack([gate[0] + up[0], gate[1]])
            return torch.cat([gate, up], dim=1 if family in ("awq", "gptq") else 0)

        fused[f"{prefix}.gate_up_proj{tail}"] = torch.stack([gate_up(e) for e in range(experts)])
        fused[f"{prefix}.down_proj{tail}"] = torch.stack([by_expert[e, "down_proj"] for e in range(experts)])
    return fused


def _quant_config(family: str, group_size: int, symmetric: bool, act_order: bool) -> tuple[dict | None, dict]:
    """(config.json's quantization_config or None, other files to write)."""
    if family == "fp8":
        return dict(PUBLISHED["fp8"]), {}
    if family == "ct":
        from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

        args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, group_size=group_size, strategy="group")
        config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                    format="pack-quantized", quantization_status="compressed",
                                    ignore=PUBLISHED["ct_ignore"])
        return config.model_dump(), {}
    if family == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": ["linear_attn.in_proj_a", "linear_attn.in_proj_b", "visual"]}, {}
    if family == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order, "sym": True,
                "checkpoint_format": "gptq", "dynamic": {r"-:.*linear_attn\.in_proj_[ab]$": {}}}, {}
    return None, {"hf_quant_config.json": PUBLISHED["nvfp4"]}


def _write(folder: Path, source: Path, config: dict, tensors: dict) -> Path:
    folder.mkdir(parents=True)
    for file in source.iterdir():  # tokenizer, generation config
        if file.suffix != ".safetensors" and file.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(file, folder / file.name)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors")
    return folder


def tiny_source(folder: Path, arch: str, matrix_gain: float = 1.5) -> Path:
    """The float32 tiny checkpoint (QUANT_SHAPES) that quantize_checkpoint starts from."""
    return build_checkpoint(folder, arch, seed=0, matrix_gain=matrix_gain, config_overrides=QUANT_SHAPES)
