"""Build the model and fill its weights: from safetensors checkpoints (single file or sharded) or dummy.

Checkpoint names map onto ours by a few rules (`_map_name`): multimodal Qwen3.5 checkpoints put the text
model under `model.language_model.`; `visual.*` and `mtp.*` tensors are skipped; per-expert MoE tensors
(`mlp.experts.{e}.gate_proj.weight` ...) are stacked into our fused `experts.gate_up_proj` / `down_proj`.
Any missing, unexpected or mis-shaped tensor is an error naming it: nothing partially loaded is served.
Quantized checkpoints (a WeightFormat, layers/quant/) have their projections' tensors routed to quantized modules
by model/quant_loading.py; everything else loads as here, and a quantized tensor where a parameter expects a float
one is an error too.
Under tensor parallelism each rank reads only its slice of the sharded tensors (model/tp_slices.py); quantized
checkpoints of every format slice their packed codes, scales and zero points with their weights (whole words,
groups and blocks), dense projections and routed experts alike.
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from deltaserve.config import ConfigError, ModelConfig
from deltaserve.layers.quant.scheme import WeightFormat
from deltaserve.model.errors import WeightLoadError
from deltaserve.model.quant_loading import QuantTensors, fill_dummy, quantize_modules
from deltaserve.model.qwen3_5 import HybridForCausalLM
from deltaserve.model.tp_slices import read_rank_slice
from deltaserve.worker.distributed import SINGLE, ParallelContext

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "dummy")
_SKIPPED_PREFIXES = ("visual.", "model.visual.", "mtp.", "model.mtp.")
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# fp8 KV-cache scales of fp8 checkpoints, under the names vLLM reads: self_attn.k_scale, self_attn.k_proj.k_scale,
# self_attn.attn.k_scale (and v_scale alike)
_KV_SCALE = re.compile(r"^(model\.layers\.\d+\.self_attn)\.(?:k_proj\.|v_proj\.|attn\.)?([kv])_scale$")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                weight_format: WeightFormat | None = None,
                parallel: ParallelContext = SINGLE) -> HybridForCausalLM:
    """Allocate the model (this rank's part of it) on `device` in `dtype` without initialising it (weights must
    be loaded next); the projections `weight_format` quantizes get quantized modules, which allocate nothing
    until loaded."""
    if weight_format is not None and parallel.tp_size > 1 and not weight_format.tensor_parallel:
        raise ConfigError(f"--tensor-parallel-size {parallel.tp_size} does not support {weight_format.method} "
                          f"checkpoints yet ({weight_format.description}): their packed weights and scales are not "
                          "sliced per rank; serve another format, or --tensor-parallel-size 1")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = HybridForCausalLM(cfg, parallel)
    finally:
        torch.set_default_dtype(previous)
    if weight_format is not None:
        quantize_modules(model, weight_format, device)
    model = model.to_empty(device=device)
    for gdn in model.gdn_layers:  # the decay parameter stays float32 (stored so in checkpoints)
        gdn.A_log.data = gdn.A_log.data.float()
    model.model.rotary.materialize(device)
    if cfg.tie_word_embeddings and model.lm_head is not None and model.model.embed_tokens is not None:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval().requires_grad_(False)


def load_model(path: str | Path | None, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
               load_format: str = "auto", seed: int = 0,
               weight_format: WeightFormat | None = None,
               parallel: ParallelContext = SINGLE) -> HybridForCausalLM:
    """Build the model (this rank's part under `parallel`: its pipeline stage's layers, its tensor-parallel
    slices) and load its weights (`load_format` "auto"/"safetensors" or "dummy"), quantized as `weight_format`
    says (layers/quant/detect.py; None: every weight in `dtype`)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format {load_format!r} is not supported; choose one of {LOAD_FORMATS}")
    model = build_model(cfg, dtype, device, weight_format, parallel)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        load_safetensors(model, Path(path))
    if torch.device(device).type != "meta":
        model.fuse()
    return model


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise WeightLoadError(f"cannot read checkpoint index '{index}': {exc}") from exc
        files = [path / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise WeightLoadError(f"no *.safetensors files in '{path}' (use --load-format dummy for random weights)")
    for file in files:
        if not file.is_file():
            raise WeightLoadError(f"checkpoint file '{file}' is missing (listed in {index.name})")
    return files


def _map_name(name: str) -> str | None:
    """Checkpoint tensor name -> our parameter name, or None for tensors we do not serve."""
    if name.startswith("model.language_model."):
        name = "model." + name[len("model.language_model."):]
    if name.startswith(_SKIPPED_PREFIXES):
        return None
    return name


def _stage_name(model: HybridForCausalLM, name: str) -> str | None:
    """A checkpoint name (after _map_name) -> its parameter name in this pipeline stage's model, or None for a
    tensor of another stage: layer i is the stage's layer i - layer_offset; a tied embedding is the last
    stage's lm_head when the first stage is another."""
    text = model.model
    layer = _LAYER.match(name)
    if layer:
        index = int(layer.group(1)) - text.layer_offset
        if not 0 <= index < len(text.layers):
            return None
        return f"model.layers.{index}.{name[layer.end():]}"
    if name == "model.embed_tokens.weight" and text.embed_tokens is None:
        return "lm_head.weight" if model.config.tie_word_embeddings and model.lm_head is not None else None
    if (name == "model.norm.weight" and text.norm is None) or (name == "lm_head.weight" and model.lm_head is None):
        return None
    return name


def load_safetensors(model: HybridForCausalLM, path: Path) -> None:
    """Fill every parameter of `model` (one pipeline stage's part of the checkpoint) from the directory `path`."""
    params = dict(model.named_parameters())
    # tied: lm_head is the embedding itself, unless this stage holds only lm_head (then loaded from the embedding)
    tied = model.config.tie_word_embeddings and model.model.embed_tokens is not None
    pending = {name for name in params if not (tied and name == "lm_head.weight")}
    # fused expert param -> the (expert, projection) slices loaded so far. A set, not a count, so that a
    # slice repeated in two files cannot stand in for a missing one.
    expert_parts: dict[str, set[tuple[int, str]]] = {}
    skipped = 0
    quantized = QuantTensors(model)
    for file in tqdm(_checkpoint_files(path), desc="Loading safetensors", unit="file", leave=False):
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises several types for corrupt files
            raise WeightLoadError(f"cannot read checkpoint file '{file}': {exc}") from exc
        with handle:
            for raw_name in handle.keys():
                name = _map_name(raw_name)
                name = None if name is None else _stage_name(model, name)
                if name is None or (tied and name == "lm_head.weight"):
                    skipped += 1
                    continue
                tensor = (handle.get_tensor(raw_name) if model.parallel.tp_size == 1
                          else read_rank_slice(handle, raw_name, name, model.config, model.parallel,
                                               quantized.placement(name)))
                kv_scale = _KV_SCALE.match(name)
                if kv_scale:
                    _load_kv_scale(model, kv_scale, tensor, raw_name)
                    continue
                if quantized.take(name, raw_name, tensor):
                    continue
                expert = _EXPERT.match(name)
                if expert:
                    _load_expert_slice(params, expert, tensor, raw_name, expert_parts)
                    continue
                if name not in params:
                    raise WeightLoadError(f"unexpected tensor '{raw_name}' in '{file.name}' (no such parameter)")
                _copy(params[name], tensor, raw_name)
                pending.discard(name)
    quantized.finish()
    for name, loaded in expert_parts.items():
        experts = params[name].shape[0]
        needed = experts * (2 if name.endswith("gate_up_proj") else 1)
        if len(loaded) == needed:
            pending.discard(name)
    if pending:
        missing = sorted(pending)
        raise WeightLoadError(f"checkpoint '{path}' lacks {len(missing)} tensors, e.g. {missing[:5]}")
    if skipped:
        logger.info("skipped %d checkpoint tensors (vision tower, MTP head, tied lm_head or other "
                    "pipeline stages')", skipped)


def _load_kv_scale(model: HybridForCausalLM, match, tensor, raw_name: str) -> None:
    """Set an attention layer's per-tensor fp8 KV scale (used when the KV cache is fp8)."""
    try:
        layer = model.get_submodule(match.group(1))
    except AttributeError:
        layer = None
    if not hasattr(layer, "kv_scales_from_checkpoint"):
        raise WeightLoadError(f"unexpected tensor '{raw_name}': layer '{match.group(1)}' is not an attention layer")
    if tensor.numel() != 1:
        raise WeightLoadError(f"'{raw_name}' must hold one per-tensor scale, got shape {tuple(tensor.shape)}")
    value = float(tensor.float().item())
    if not math.isfinite(value) or value <= 0:
        raise WeightLoadError(f"'{raw_name}' must be a positive finite scale, got {value}")
    setattr(layer, f"{match.group(2)}_scale", value)
    layer.kv_scales_from_checkpoint = True


def _load_expert_slice(params, match, tensor, raw_name, parts) -> None:
    prefix, expert, proj = match.group(1), int(match.group(2)), match.group(3)
    fused = f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
    if fused not in params:
        raise WeightLoadError(f"unexpected tensor '{raw_name}' (layer has no experts)")
    target = params[fused]
    if expert >= target.shape[0]:
        raise WeightLoadError(f"tensor '{raw_name}': expert {expert} >= num_experts {target.shape[0]}")
    inter = target.shape[1] // 2 if proj != "down_proj" else None
    dest = {"gate_proj": lambda t: t[expert, :inter], "up_proj": lambda t: t[expert, inter:],
            "down_proj": lambda t: t[expert]}[proj](target.data)
    _copy_into(dest, tensor, raw_name)
    parts.setdefault(fused, set()).add((expert, proj))


def _copy(param: nn.Parameter, tensor: torch.Tensor, raw_name: str) -> None:
    if param.shape != tensor.shape and param.dim() == 3 and tensor.shape == param.shape[:1] + param.shape[1:][::-1]:
        tensor = tensor.transpose(1, 2)  # fused experts saved as [E, H, 2I] / [E, I, H]
    _copy_into(param.data, tensor, raw_name)


def _copy_into(dest: torch.Tensor, tensor: torch.Tensor, raw_name: str) -> None:
    if tensor.dtype not in _FLOAT_DTYPES:  # copy_ would cast the codes, unscaled
        raise WeightLoadError(f"tensor '{raw_name}' is {str(tensor.dtype).removeprefix('torch.')}, but its module is "
                              "not quantized (the checkpoint's quantization config keeps it in the model dtype)")
    if dest.shape != tensor.shape:
        raise WeightLoadError(f"tensor '{raw_name}' has shape {list(tensor.shape)}, expected {list(dest.shape)}")
    dest.copy_(tensor)


@torch.no_grad()
def init_dummy_weights(model: HybridForCausalLM, seed: int = 0) -> None:
    """Seeded random weights from the config alone (for benchmarks and smoke tests; outputs are noise)."""
    device = next(model.parameters()).device
    if device.type == "meta":  # a shape-only model (sizing, planning) holds no values to fill
        return
    gen = torch.Generator(device=device).manual_seed(seed)
    fill_dummy(model, gen)
    for name, param in model.named_parameters():
        if name.endswith("A_log"):  # decay rates as transformers initialises them: log U(1, 16)
            param.uniform_(1.0, 16.0, generator=gen).log_()
        elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
            param.fill_(1.0)
        elif "norm" in name:  # zero-centred norms: weight 0 means scale 1
            param.zero_()
        else:
            fan_in = param.shape[-1]
            param.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=gen)
