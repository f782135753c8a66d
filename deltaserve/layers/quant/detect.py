"""Which quantized family a checkpoint is, from its config, and whether `--quantization` agrees.

The quantization config is config.json's `quantization_config` (at the top level, or under `text_config`), else
ModelOpt's `hf_quant_config.json` beside it. `--quantization` takes vLLM's names; it must name the checkpoint's
family ("fp8" for quant_method fp8, "modelopt" or "modelopt_fp4" for ModelOpt NVFP4, ...), except that "fp8" on a
bf16 checkpoint quantizes it at load. Anything this engine cannot serve is a ConfigError naming the key and value.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from deltaserve.config import QUANTIZATION_FLAGS as FLAG_METHODS
from deltaserve.config import ConfigError
from deltaserve.layers.quant.awq_gptq import AwqScheme, GptqScheme, Int4ConvertedFormat
from deltaserve.layers.quant.fp8 import BLOCK, Fp8Format
from deltaserve.layers.quant.int4 import GROUP_SIZES, CompressedTensorsFormat, Int4Scheme
from deltaserve.layers.quant.nvfp4 import GROUP as NVFP4_GROUP
from deltaserve.layers.quant.nvfp4 import Nvfp4Format
from deltaserve.layers.quant.scheme import WeightFormat


def read_quantization_config(path: str | Path) -> tuple[dict | None, str]:
    """(the quantization config, where it was found) of a checkpoint directory or config.json; (None, "") if the
    checkpoint is not quantized."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read '{file}': {exc}") from exc
    for where, holder in (("quantization_config", raw), ("text_config.quantization_config", raw.get("text_config"))):
        if isinstance(holder, dict) and holder.get("quantization_config") is not None:
            return _object(holder["quantization_config"], f"{file.name} {where}"), f"{file.name} {where}"
    modelopt = file.parent / "hf_quant_config.json"
    if modelopt.is_file():
        try:
            quant = json.loads(modelopt.read_text()).get("quantization")
        except (OSError, ValueError, AttributeError) as exc:
            raise ConfigError(f"cannot read '{modelopt}': {exc}") from exc
        source = f"{modelopt.name} quantization"
        return dict(_object(quant, source), quant_method="modelopt"), source
    return None, ""


def _object(value: Any, source: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{source} must be an object, got {value!r}")
    return value


def detect_weight_format(path: str | Path, flag: str | None = None) -> WeightFormat | None:
    """The checkpoint's WeightFormat (None: bf16 weights), given --quantization `flag` (None: detect)."""
    if flag is not None and flag not in FLAG_METHODS:
        raise ConfigError(f"--quantization {flag!r} is not supported; choose one of {tuple(FLAG_METHODS)}")
    qc, source = read_quantization_config(path)
    if qc is None:
        if flag is None:
            return None
        if flag == "fp8":
            return Fp8Format.online()
        raise ConfigError(f"--quantization {flag}: the checkpoint has no quantization config (it is not quantized); "
                          "only --quantization fp8 quantizes a bf16 checkpoint at load")
    method = qc.get("quant_method")
    parse = _PARSERS.get(method)
    if parse is None:
        raise ConfigError(f"{source}: quant_method {method!r} is not supported; supported: {sorted(_PARSERS)}")
    if flag is not None and FLAG_METHODS[flag] != method:
        raise ConfigError(f"--quantization {flag} contradicts the checkpoint: {source} has quant_method {method!r} "
                          f"(leave --quantization out, or give {_flags_for(method)})")
    return parse(qc, source)


def _flags_for(method: str) -> str:
    return " or ".join(f"--quantization {flag}" for flag, m in FLAG_METHODS.items() if m == method)


def _refuse(source: str, key: str, value: Any, supported: str) -> ConfigError:
    return ConfigError(f"{source}: {key} = {value!r} is not supported ({supported})")


def _names(qc: dict, key: str, source: str) -> list[str]:
    value = qc.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{source}: {key} must be a list of module names, got {value!r}")
    return value


def _parse_fp8(qc: dict, source: str) -> WeightFormat:
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _refuse(source, "fmt", qc["fmt"], "e4m3 only")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise _refuse(source, "activation_scheme", qc["activation_scheme"], "dynamic activation scales only")
    if qc.get("weight_block_size") != list(BLOCK):
        raise _refuse(source, "weight_block_size", qc.get("weight_block_size"), "block-scaled [128, 128] only")
    return Fp8Format(_names(qc, "modules_to_not_convert", source))


def _parse_compressed_tensors(qc: dict, source: str) -> WeightFormat:
    fmt = qc.get("format")
    if qc.get("quantization_status", "compressed") != "compressed":
        raise _refuse(source, "quantization_status", qc["quantization_status"], "compressed checkpoints only")
    if qc.get("kv_cache_scheme") is not None:
        raise _refuse(source, "kv_cache_scheme", qc["kv_cache_scheme"], "none")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"{source}: config_groups must be a non-empty object, got {groups!r}")
    parsed = []
    for name, group in groups.items():
        where = f"{source} config_groups.{name}"
        group = _object(group, where)
        group_format = group.get("format") or fmt  # a group's own format, else the checkpoint's
        if group_format != "pack-quantized":
            raise _refuse(where, "format", group_format, "pack-quantized int4 W4A16 only")
        for key in ("input_activations", "output_activations"):
            if group.get(key) is not None:
                raise _refuse(where, key, group[key], "weight-only W4A16: activations must stay unquantized")
        weights = _object(group.get("weights"), f"{where}.weights")
        expected = {"num_bits": 4, "type": "int", "strategy": "group", "dynamic": False}
        for key, want in expected.items():
            if weights.get(key, want) != want:
                raise _refuse(f"{where}.weights", key, weights.get(key), f"int4 W4A16 in groups: {key} {want!r}")
        group_size = weights.get("group_size")
        if group_size not in GROUP_SIZES:
            raise _refuse(f"{where}.weights", "group_size", group_size, f"the int4 kernels take {GROUP_SIZES}")
        actorder = weights.get("actorder")
        if actorder not in (None, "weight", "static", "group"):
            raise _refuse(f"{where}.weights", "actorder", actorder, "null, 'weight', 'static' or 'group'")
        targets = group.get("targets") or []
        if not isinstance(targets, list) or not targets:
            raise ConfigError(f"{where}: targets must be a non-empty list, got {targets!r}")
        scheme = Int4Scheme(group_size, bool(weights.get("symmetric", True)), act_order=actorder == "group")
        parsed.append((tuple(targets), scheme))
    return CompressedTensorsFormat(parsed, _names(qc, "ignore", source))


def _int4_group(qc: dict, source: str) -> int:
    if qc.get("bits", 4) != 4:
        raise _refuse(source, "bits", qc["bits"], "4-bit only")
    group_size = qc.get("group_size")
    if group_size not in GROUP_SIZES:
        raise _refuse(source, "group_size", group_size, f"the int4 kernels take {GROUP_SIZES}")
    return group_size


def _parse_awq(qc: dict, source: str) -> WeightFormat:
    group_size = _int4_group(qc, source)
    if str(qc.get("version", "gemm")).lower() != "gemm":
        raise _refuse(source, "version", qc["version"], "AutoAWQ's GEMM layout only")
    if qc.get("zero_point", True) is not True:
        raise _refuse(source, "zero_point", qc["zero_point"], "AWQ with zero points only")
    return Int4ConvertedFormat("awq", AwqScheme(group_size), _names(qc, "modules_to_not_convert", source), [],
                               f"int4 W4A16, AutoAWQ GEMM (group {group_size}), converted to compressed-tensors' "
                               "layout at load")


def _parse_gptq(qc: dict, source: str) -> WeightFormat:
    group_size = _int4_group(qc, source)
    checkpoint_format = qc.get("checkpoint_format", "gptq")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise _refuse(source, "checkpoint_format", checkpoint_format, "'gptq' or 'gptq_v2'")
    excluded = []
    for pattern, override in (qc.get("dynamic") or {}).items():
        if not pattern.startswith("-:"):  # a per-module override of bits or group size
            raise _refuse(source, f"dynamic[{pattern!r}]", override, "only '-:' exclusions")
        excluded.append(pattern[2:])
    symmetric, act_order = bool(qc.get("sym", True)), bool(qc.get("desc_act", False))
    scheme = GptqScheme(group_size, symmetric, act_order, v1=checkpoint_format == "gptq")
    how = f"group {group_size}, {'symmetric' if symmetric else 'asymmetric'}{', act order' if act_order else ''}"
    return Int4ConvertedFormat("gptq", scheme, _names(qc, "modules_to_not_convert", source), excluded,
                               f"int4 W4A16, GPTQ ({how}), converted to compressed-tensors' layout at load")


def _parse_modelopt(qc: dict, source: str) -> WeightFormat:
    algo = qc.get("quant_algo")
    if algo != "NVFP4":
        raise _refuse(source, "quant_algo", algo, "NVFP4 only")
    if qc.get("group_size", NVFP4_GROUP) != NVFP4_GROUP:
        raise _refuse(source, "group_size", qc["group_size"], f"NVFP4 scales every {NVFP4_GROUP} elements")
    if qc.get("kv_cache_quant_algo") not in (None, "FP8"):
        raise _refuse(source, "kv_cache_quant_algo", qc["kv_cache_quant_algo"], "FP8 or none")
    key = "exclude_modules" if "exclude_modules" in qc else "ignore"
    return Nvfp4Format(_names(qc, key, source))


_PARSERS = {"fp8": _parse_fp8, "compressed-tensors": _parse_compressed_tensors, "awq": _parse_awq,
            "gptq": _parse_gptq, "modelopt": _parse_modelopt}
