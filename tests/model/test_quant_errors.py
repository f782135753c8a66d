"""Quantized checkpoints deltaserve cannot serve fail at load with an error naming the key or tensor and its value.

Config level (layers/quant/detect.py, ConfigError): an unsupported family or format, a group or block size the
kernels do not take, a --quantization that contradicts the checkpoint. Tensor level (WeightLoadError): a missing
scale, a tensor of the wrong shape or dtype, a tensor where the config keeps its module unquantized. Also: the
published -fp8/-awq/-nvfp4 configs are read as their families, with the modules public checkpoints keep in bf16.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaserve import LLM
from deltaserve.config import ConfigError, EngineConfig, ModelConfig
from deltaserve.layers.quant import detect_weight_format
from deltaserve.model.loader import WeightLoadError, load_model
from deltaserve.model_configs import CONFIGS_DIR
from tests.model.quant_checkpoints import PUBLISHED, quantize_checkpoint



def with_quant_config(folder: Path, quant: dict | None, hf_quant: dict | None = None) -> Path:
    """A config-only checkpoint directory (tiny qwen3_5 shapes) with this quantization config."""
    from deltaserve.demo import TINY_CONFIGS

    folder.mkdir(parents=True, exist_ok=True)
    raw = dict(TINY_CONFIGS["qwen3_5"], model_type="qwen3_5_text")
    if quant is not None:
        raw["quantization_config"] = quant
    (folder / "config.json").write_text(json.dumps(raw))
    if hf_quant is not None:
        (folder / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    return folder


def ct_config(**weights) -> dict:
    args = dict(dict(num_bits=4, type="int", symmetric=False, group_size=128, strategy="group"), **weights)
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": args}}, "ignore": ["lm_head"]}


# ------------------------------------------------------------------------------------ config level


@pytest.mark.parametrize("quant, hf_quant, message", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, None, "quant_method 'bitsandbytes' is not supported"),
    (None, {"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}},
     "hf_quant_config.json quantization: quant_algo = 'FP8' is not supported (NVFP4 only)"),
    (dict(ct_config(), format="float-quantized"), None,
     "config_groups.group_0: format = 'float-quantized' is not supported (pack-quantized int4 W4A16 only)"),
    ({**ct_config(), "config_groups": {"group_0": {"targets": ["Linear"], "weights": ct_config()["config_groups"][
        "group_0"]["weights"], "input_activations": {"num_bits": 8, "type": "int"}}}}, None,
     "input_activations = {'num_bits': 8, 'type': 'int'} is not supported (weight-only W4A16"),
    (ct_config(group_size=256), None,
     "config_groups.group_0.weights: group_size = 256 is not supported (the int4 kernels take (32, 64, 128))"),
    (ct_config(num_bits=8), None, "num_bits = 8 is not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": -1, "sym": True}, None,
     "quantization_config: group_size = -1 is not supported (the int4 kernels take (32, 64, 128))"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, None,
     "version = 'gemv' is not supported (AutoAWQ's GEMM layout only)"),
    (dict(PUBLISHED["fp8"], weight_block_size=[64, 64]), None,
     "weight_block_size = [64, 64] is not supported (block-scaled [128, 128] only)"),
    (dict(PUBLISHED["fp8"], activation_scheme="static"), None, "activation_scheme = 'static' is not supported"),
    (None, {"quantization": dict(PUBLISHED["nvfp4"]["quantization"], group_size=32)},
     "group_size = 32 is not supported (NVFP4 scales every 16 elements)"),
])
def test_unsupported_quantization_configs_name_the_key_and_value(quant, hf_quant, message, tmp_path):
    folder = with_quant_config(tmp_path / "ckpt", quant, hf_quant)
    with pytest.raises(ConfigError) as error:
        detect_weight_format(folder)
    assert message in str(error.value)


def test_quantization_flag_must_agree_with_the_checkpoint(tmp_path):
    ct = with_quant_config(tmp_path / "ct", ct_config())
    with pytest.raises(ConfigError, match=r"--quantization awq contradicts the checkpoint: config.json "
                                          r"quantization_config has quant_method 'compressed-tensors' \(leave "
                                          r"--quantization out, or give --quantization compressed-tensors\)"):
        detect_weight_format(ct, "awq")
    assert detect_weight_format(ct, "compressed-tensors").method == "compressed-tensors"
    nvfp4 = with_quant_config(tmp_path / "nvfp4", None, PUBLISHED["nvfp4"])
    assert detect_weight_format(nvfp4, "modelopt_fp4").method == detect_weight_format(nvfp4, "modelopt").method
    with pytest.raises(ConfigError, match="--quantization fp8 contradicts the checkpoint"):
        detect_weight_format(nvfp4, "fp8")
    bf16 = with_quant_config(tmp_path / "bf16", None)
    assert detect_weight_format(bf16) is None and "online" in detect_weight_format(bf16, "fp8").description
    with pytest.raises(ConfigError, match="--quantization gptq: the checkpoint has no quantization config"):
        detect_weight_format(bf16, "gptq")
    with pytest.raises(ConfigError, match="--quantization 'int8' is not supported; choose one of"):
        EngineConfig(quantization="int8")


def test_quantization_config_under_text_config_is_found(tmp_path):
    from deltaserve.demo import TINY_CONFIGS

    folder = tmp_path / "vl"
    folder.mkdir()
    text = dict(TINY_CONFIGS["qwen3_5"], model_type="qwen3_5_text", quantization_config=PUBLISHED["fp8"])
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": text}))
    assert detect_weight_format(folder).method == "fp8"


@pytest.mark.parametrize("name, method", [("qwen3.5-27b-fp8", "fp8"), ("qwen3.5-35b-a3b-fp8", "fp8"),
                                          ("qwen3.5-122b-a10b-fp8", "fp8"), ("qwen3.5-27b-awq", "compressed-tensors"),
                                          ("qwen3.5-35b-a3b-awq", "compressed-tensors"),
                                          ("qwen3.5-27b-nvfp4", "modelopt"), ("qwen3.5-35b-a3b-nvfp4", "modelopt")])
def test_published_configs_are_read_with_their_bf16_exceptions(name, method):
    folder = CONFIGS_DIR / name
    fmt = detect_weight_format(folder)
    assert fmt.method == method
    for kept in ("model.layers.0.linear_attn.in_proj_a", "model.layers.0.linear_attn.in_proj_b"):
        assert fmt.scheme_for(kept) is None, kept
    for quantized in ("model.layers.0.linear_attn.in_proj_qkv", "model.layers.0.linear_attn.in_proj_z",
                      "model.layers.0.linear_attn.out_proj", "model.layers.3.self_attn.q_proj",
                      "model.layers.3.self_attn.o_proj", "model.layers.0.mlp.gate_proj",
                      "model.layers.0.mlp.experts.7.down_proj", "model.layers.0.mlp.shared_expert.up_proj"):
        assert fmt.scheme_for(quantized) is not None, quantized
    # what tests/model/quant_checkpoints.py writes is what is published
    raw = json.loads((folder / "config.json").read_text())["quantization_config"]
    if method == "fp8":
        assert raw == PUBLISHED["fp8"]
    elif method == "compressed-tensors":
        assert raw["ignore"] == PUBLISHED["ct_ignore"]
    else:
        assert json.loads((folder / "hf_quant_config.json").read_text()) == PUBLISHED["nvfp4"]


# ------------------------------------------------------------------------------------ tensor level


@pytest.fixture(scope="module")
def checkpoints(quant_sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("quant-bad")
    return {"fp8": quantize_checkpoint(quant_sources["qwen3_5"], root / "fp8", "fp8", multimodal=True).path,
            "ct": quantize_checkpoint(quant_sources["qwen3_5"], root / "ct", "ct", group_size=64).path,
            "nvfp4": quantize_checkpoint(quant_sources["qwen3_5_moe"], root / "nvfp4", "nvfp4").path,
            "gptq": quantize_checkpoint(quant_sources["qwen3_5"], root / "gptq", "gptq").path}


def edited(source: Path, folder: Path, edit, config_edit=None) -> Path:
    """A copy of the checkpoint `source` whose tensors dict went through `edit` (and config dict `config_edit`)."""
    shutil.copytree(source, folder)
    tensors = load_file(source / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")
    if config_edit is not None:
        config = json.loads((folder / "config.json").read_text())
        config_edit(config)
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def load(path: Path):
    return load_model(path, ModelConfig.from_pretrained(path), torch.float32, "cpu",
                      weight_format=detect_weight_format(path))


QKV = "model.language_model.layers.0.linear_attn.in_proj_qkv"  # the fp8 checkpoint's (multimodal) spelling


def test_a_missing_scale_is_named(checkpoints, tmp_path):
    path = edited(checkpoints["fp8"], tmp_path / "a", lambda t: t.pop(f"{QKV}.weight_scale_inv"))
    with pytest.raises(WeightLoadError, match=rf"checkpoint lacks '{QKV}.weight_scale_inv' \(each quantized "
                                              r"projection of this checkpoint needs \['weight', 'weight_scale_inv'\]"):
        load(path)
    expert = "model.layers.0.mlp.experts.4.down_proj.weight_scale_2"
    path = edited(checkpoints["nvfp4"], tmp_path / "b", lambda t: t.pop(expert))
    with pytest.raises(WeightLoadError, match=f"checkpoint lacks '{expert}'"):
        load(path)


def test_mis_shaped_and_mis_typed_tensors_are_named(checkpoints, tmp_path):
    def wrong_scale(t):
        t[f"{QKV}.weight_scale_inv"] = torch.ones(3, 1)

    with pytest.raises(WeightLoadError, match=rf"tensor '{QKV}.weight_scale_inv' is \[3, 1\] float32, expected "
                                              r"\[2, 1\] float32 or bfloat16 or float16"):
        load(edited(checkpoints["fp8"], tmp_path / "a", wrong_scale))

    def unquantized(t):
        t[f"{QKV}.weight"] = t[f"{QKV}.weight"].float()

    with pytest.raises(WeightLoadError, match=rf"tensor '{QKV}.weight' is \[256, 128\] float32, expected \[256, 128\] "
                                              "float8_e4m3fn"):
        load(edited(checkpoints["fp8"], tmp_path / "b", unquantized))
    # written with groups of 64, read as groups of 32: the scales have twice too few columns
    group_32 = edited(checkpoints["ct"], tmp_path / "c", lambda t: None, lambda c: c["quantization_config"][
        "config_groups"]["group_0"]["weights"].update(group_size=32))
    with pytest.raises(WeightLoadError, match=r"tensor 'model.layers.0.linear_attn.in_proj_qkv.weight_scale' is "
                                              r"\[256, 2\] bfloat16, expected \[256, 4\] bfloat16 or float16"):
        load(group_32)

    def wrong_shape(t):
        t["model.layers.3.self_attn.o_proj.weight_shape"] = torch.tensor([128, 512])

    with pytest.raises(WeightLoadError, match=r"tensor 'model.layers.3.self_attn.o_proj.weight_shape' is \[128, 512\], "
                                              r"expected \[128, 256\]"):
        load(edited(checkpoints["ct"], tmp_path / "d", wrong_shape))

    def asymmetric_zero(t):
        t["model.layers.0.mlp.down_proj.qzeros"] = torch.zeros_like(t["model.layers.0.mlp.down_proj.qzeros"])

    with pytest.raises(WeightLoadError, match=r"tensor 'model.layers.0.mlp.down_proj.qzeros' holds zero point 1, but "
                                              r"the config says sym: true \(zero point 8\)"):
        load(edited(checkpoints["gptq"], tmp_path / "e", asymmetric_zero))


def test_tensors_the_config_does_not_expect_are_named(checkpoints, tmp_path):
    kept = "model.language_model.layers.0.linear_attn.in_proj_a"  # modules_to_not_convert keeps it bf16

    def quantized_in_proj_a(t):
        t[f"{kept}.weight"] = t[f"{kept}.weight"].to(torch.float8_e4m3fn)

    with pytest.raises(WeightLoadError, match=rf"tensor '{kept}.weight' is float8_e4m3fn, but its module is not "
                                              "quantized"):
        load(edited(checkpoints["fp8"], tmp_path / "a", quantized_in_proj_a))

    def extra(t):
        t["model.layers.0.mlp.up_proj.weight_global_scale"] = torch.ones(1)

    with pytest.raises(WeightLoadError, match=r"unexpected tensor 'model.layers.0.mlp.up_proj.weight_global_scale': "
                                              r"this checkpoint's quantized projections have \['weight_packed', "):
        load(edited(checkpoints["ct"], tmp_path / "b", extra))


def test_the_engine_refuses_at_start_up(checkpoints, tmp_path):
    path = edited(checkpoints["fp8"], tmp_path / "a", lambda t: t.pop(f"{QKV}.weight_scale_inv"))
    with pytest.raises(WeightLoadError, match=f"checkpoint lacks '{QKV}.weight_scale_inv'"):
        LLM(str(path), skip_tokenizer_init=True)
    with pytest.raises(ConfigError, match="--quantization gptq contradicts the checkpoint"):
        LLM(str(checkpoints["fp8"]), quantization="gptq", skip_tokenizer_init=True)
