"""The memory plan of quantized checkpoints: the bytes of each format as the loaded model really holds them, the
published -fp8/-awq/-nvfp4 configs counted from their own quantization configs, and the users' 32 GB-card
configuration (27B AWQ or NVFP4, fp8 KV, 200,000 tokens, 0.94 of the card) planned as fitting while 27B bf16 is
refused, both with their numbers.
"""

import json
import re
from pathlib import Path

import pytest
import torch

from deltaserve.cache.footprint import count_parameters, projection_shapes, quant_scratch_bytes, weight_bytes
from deltaserve.cache.plan_cli import GPUS, main
from deltaserve.cache.planner import plan
from deltaserve.config import EngineConfig, ModelConfig
from deltaserve.demo import TINY_CONFIGS
from deltaserve.layers.quant import detect_weight_format
from deltaserve.layers.quant.weight import held_quantized_weights
from deltaserve.model.loader import load_model
from deltaserve.model_configs import CONFIGS_DIR
from deltaserve.ops.quant_gemm.reference import Fp8BlockWeight
from tests.model.quant_checkpoints import PUBLISHED, QUANT_SHAPES

USERS_FLAGS = ["--max-num-seqs", "128", "--max-model-len", "200000", "--kv-cache-dtype", "fp8",
               "--gpu-memory-utilization", "0.94", "--enable-prefix-caching"]
# quantization configs of each family, as config.json's quantization_config (None: hf_quant_config.json)
FAMILIES = {
    "fp8": PUBLISHED["fp8"],
    "ct-g32-asym": {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": PUBLISHED["ct_ignore"],
                    "config_groups": {"g": {"targets": ["Linear"], "weights": {
                        "num_bits": 4, "type": "int", "symmetric": False, "group_size": 32, "strategy": "group"}}}},
    "ct-g128-sym-actorder": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                             "ignore": PUBLISHED["ct_ignore"], "config_groups": {"g": {
                                 "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                                    "group_size": 128, "strategy": "group",
                                                                    "actorder": "group"}}}},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": ["linear_attn.in_proj_a", "linear_attn.in_proj_b"]},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True},
    "nvfp4": None,
    "online-fp8": "bf16",
}


def shared(name: str) -> Path:
    return CONFIGS_DIR / name


def tiny_quantized(tmp_path: Path, arch: str, family: str):
    """(config, format) of a tiny QUANT_SHAPES model quantized as `family` (a config file only)."""
    raw = dict(TINY_CONFIGS[arch], **QUANT_SHAPES, model_type=arch if arch == "qwen3_next" else f"{arch}_text")
    quant = FAMILIES[family]
    if isinstance(quant, dict):
        raw["quantization_config"] = quant
    elif quant is None:
        (tmp_path / "hf_quant_config.json").write_text(json.dumps(PUBLISHED["nvfp4"]))
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return ModelConfig.from_hf(raw), detect_weight_format(tmp_path, "fp8" if quant == "bf16" else None)


def loaded_bytes(model) -> dict[str, int]:
    """What a loaded model holds: its parameters by dtype and every prepared quantized weight (each once)."""
    held: dict[str, int] = {}
    for param in model.parameters():
        key = str(param.dtype).removeprefix("torch.")
        held[key] = held.get(key, 0) + param.nbytes
    held["quantized"] = sum(weight.nbytes for weight in held_quantized_weights(model))
    return held


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_planned_weight_bytes_are_what_the_loaded_model_holds(arch, family, tmp_path):
    cfg, fmt = tiny_quantized(tmp_path, arch, family)
    model = load_model(None, cfg, torch.float32, "cpu", load_format="dummy", weight_format=fmt)
    held = loaded_bytes(model)
    planned = weight_bytes(cfg, "float32", fmt)  # the model dtype is float32 here: its key holds A_log too
    assert held["quantized"] > 0
    # counted per projection, shared by projections joined into one weight: act order's column permutation, and
    # the block scales of online FP8 (which quantizes the fused weight, so a block may span two projections)
    shared = planned.get("int4 act-order permutation", 0)
    shared += planned["fp8 block scales (float32)"] if family == "online-fp8" else 0
    assert sum(planned.values()) - shared <= held["float32"] + held["quantized"] <= sum(planned.values())
    assert held["float32"] == planned["float32"]


def test_projection_shapes_are_the_linear_parameters():
    for arch in TINY_CONFIGS:
        cfg = ModelConfig.from_hf(dict(TINY_CONFIGS[arch], model_type="qwen3_next" if arch == "qwen3_next"
                                       else f"{arch.removesuffix('_tied')}_text"))
        assert sum(n * k * count for _, n, k, count in projection_shapes(cfg)) == count_parameters(cfg)["linear"]


@pytest.mark.parametrize("name, per_weight", [
    ("qwen3.5-27b-fp8", None), ("qwen3.5-27b-awq", 0.5 + 2 / 128 + 1 / 128), ("qwen3.5-27b-nvfp4", 0.5 + 1 / 16),
    ("qwen3.5-35b-a3b-fp8", None), ("qwen3.5-35b-a3b-awq", 0.5 + 2 / 128 + 1 / 128),
    ("qwen3.5-35b-a3b-nvfp4", 0.5 + 1 / 16)])
def test_published_quantized_configs_count_their_formats(name, per_weight):
    """By hand: every projection but GDN's in_proj_a/b (kept bf16 by all three published configs) quantized:
    fp8 1 byte + a float32 scale per 128 x 128 block; int4 g128 half a byte, a 16-bit scale and a one-byte zero
    point per 128; nvfp4 half a byte and an e4m3 scale per 16, a float32 scale per row. Everything else bf16,
    A_log float32."""
    folder = shared(name)
    cfg, fmt = ModelConfig.from_pretrained(folder), detect_weight_format(folder)
    params = count_parameters(cfg)
    kept = sum(n * k * c for proj, n, k, c in projection_shapes(cfg) if re.search(r"in_proj_[ab]$", proj))
    quantized = params["linear"] - kept
    bf16 = 2 * (params["embed_tokens"] + params["lm_head"] + params["other"] + kept)
    if per_weight is None:  # fp8: scales per whole block, and every published N and K is a multiple of 128
        expected = quantized + 4 * quantized // (128 * 128)
    else:
        expected = quantized * per_weight
    if "nvfp4" in name:  # and a float32 second-level scale per row
        expected += 4 * sum(n * c for proj, n, k, c in projection_shapes(cfg) if not re.search(r"in_proj_[ab]$", proj))
    got = weight_bytes(cfg, "bfloat16", fmt)
    assert got["bfloat16"] == bf16 and got["float32"] == 4 * params["A_log"]
    assert sum(v for k, v in got.items() if k not in ("bfloat16", "float32")) == expected


@pytest.mark.parametrize("name", ["qwen3.5-27b-nvfp4", "qwen3.5-27b-awq"])
def test_users_32gb_card_configuration_fits_with_4_bit_weights(name, capsys):
    """../shared/COMMAND_LINES.md, 1: 27B NVFP4 (or AWQ) on an RTX 5090, 200K context, fp8 KV, 0.94 of the card."""
    assert main([str(shared(name)), "--gpu", "RTX 5090", *USERS_FLAGS, "--served-model-name", "my_model"]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" not in out.split("Common GPUs")[0]
    weights = re.search(r"weights\s+([\d,]+)\s+([\d.]+)\s+26.90B parameters: (.*)", out)
    assert weights and float(weights[2]) < 18, out  # 4-bit projections: 16.6-17.5 GiB of weights
    assert ("nvfp4 e2m1 weights" if "nvfp4" in name else "int4 packed weights") in weights[3]
    assert "=> max_model_len 200,000" in out and "full-length requests at once: 1" in out
    cfg = ModelConfig.from_pretrained(shared(name))
    engine = EngineConfig(max_num_seqs=128, max_model_len=200000, kv_cache_dtype="fp8", gpu_memory_utilization=0.94)
    p = plan(cfg, engine, device_memory_bytes=GPUS["rtx5090"].memory_bytes, weight_format=detect_weight_format(
        shared(name)))
    assert p.error is None and p.pool_tokens >= 200000 and 1 <= p.max_num_seqs < 128
    assert p.fixed_bytes + p.num_state_slots * p.state_bytes_per_slot + p.num_blocks * p.kv_bytes_per_block \
        <= p.budget_bytes  # all of it inside 0.94 of the card


def test_users_32gb_card_configuration_is_refused_with_bf16_weights(capsys):
    assert main([str(shared("qwen3.5-27b")), "--gpu", "RTX 5090", *USERS_FLAGS]) == 1
    out = capsys.readouterr().out
    assert ("DOES NOT FIT: the budget is 29.48 GiB (0.94 x 31.36 GiB); weights take 50.10 GiB and activations, CUDA "
            "graphs and runtime") in out


def test_offline_bench_limits_count_quantized_weights(tmp_path):
    """The benchmarks' bandwidth limit reads the bytes the quantized model holds; its FLOPs are the bf16 model's,
    and an FP8 checkpoint's quantized products (projections and routed experts) count at the FP8 rate."""
    from benchmarks.offline import Limits
    from deltaserve.engine.llm_engine import LLMEngine

    limits = {}
    for family in ("awq", "fp8", None):
        folder = tmp_path / str(family)
        folder.mkdir()
        if family is None:
            raw = dict(TINY_CONFIGS["qwen3_5_moe"], **QUANT_SHAPES, model_type="qwen3_5_moe_text")
            (folder / "config.json").write_text(json.dumps(raw))
        else:
            tiny_quantized(folder, "qwen3_5_moe", family)
        engine = LLMEngine(EngineConfig(model=str(folder), load_format="dummy", skip_tokenizer_init=True,
                                        max_num_seqs=2))
        model = engine.runner.model
        bf16_matrices = sum(p.numel() for n, p in model.named_parameters()
                            if p.dim() >= 2 and "embed_tokens" not in n and "experts" not in n)
        limits[family] = (Limits(engine, 1e12, 1e15), Limits(engine, 1e12, 1e15, 2e15), engine.memory_plan,
                          bf16_matrices)
    (quantized, _, plan, _), (bf16, bf16_fp8_rate, _, _) = limits["awq"], limits[None]
    embedding = 4 * TINY_CONFIGS["qwen3_5_moe"]["vocab_size"] * QUANT_SHAPES["hidden_size"]  # float32 on the CPU
    assert quantized.weight_bytes == plan.weight_bytes - embedding < bf16.weight_bytes
    assert quantized.matmul_params == bf16.matmul_params
    assert quantized.fp8_params == bf16.fp8_params == 0  # weight-only int4 runs its products in bf16
    assert bf16_fp8_rate.prefill(64) == bf16.prefill(64)
    fp8, fp8_at_twice, _, fp8_bf16_matrices = limits["fp8"]
    assert fp8.matmul_params == bf16.matmul_params
    assert 0 < fp8.fp8_params == fp8.matmul_params - fp8_bf16_matrices  # all but the checkpoint's bf16 matrices
    saved = 2 * fp8.fp8_params * 64 / 2e15  # half of the FP8 products' seconds at the bf16 rate
    assert fp8_at_twice.prefill(64) == pytest.approx(fp8.prefill(64) - saved, rel=1e-12)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_planned_quant_scratch_is_what_warm_up_reserves(arch, family, tmp_path):
    """The scratch counted from the shapes is what ops.quant_gemm.warm_up reserves on the GPU for the loaded
    model: its largest int4 / NVFP4 prepared matrix (the joined ones) in the model dtype; none for FP8."""
    cfg, fmt = tiny_quantized(tmp_path, arch, family)
    model = load_model(None, cfg, torch.float32, "cpu", load_format="dummy", weight_format=fmt)
    weight_only = [w.shape[0] * w.shape[1] for w in held_quantized_weights(model)
                   if not isinstance(w.prepared, Fp8BlockWeight)]
    assert bool(weight_only) == ("fp8" not in family)
    assert quant_scratch_bytes(cfg, "bfloat16", fmt) == 2 * max(weight_only, default=0)


@pytest.mark.parametrize("name, scratch", [("qwen3.5-27b-nvfp4", 2 * 17408 * 5120 * 2),
                                           ("qwen3.5-27b-awq", 2 * 17408 * 5120 * 2), ("qwen3.5-27b-fp8", 0)])
def test_plan_counts_the_quant_scratch_on_the_gpu(name, scratch, capsys):
    """27B's largest weight-only matrix is the joined MLP gate/up [2 x 17408, 5120]: a bf16 copy of it (~357 MB)
    is a line of the plan and part of its fixed costs on the GPU; the CPU engine reserves none."""
    cfg, fmt = ModelConfig.from_pretrained(shared(name)), detect_weight_format(shared(name))
    engine = EngineConfig(max_num_seqs=8, max_model_len=4096)
    gpu = plan(cfg, engine, device_memory_bytes=GPUS["h200"].memory_bytes, weight_format=fmt)
    assert gpu.quant_scratch_bytes == scratch
    assert gpu.fixed_bytes == gpu.weight_bytes + scratch + gpu.activation_bytes + gpu.cuda_graph_bytes \
        + gpu.overhead_bytes
    assert plan(cfg, engine, on_gpu=False, weight_format=fmt).quant_scratch_bytes == 0
    assert main([str(shared(name)), "--gpu", "H200", "--max-model-len", "4096"]) == 0
    line = re.search(r"quant GEMM scratch\s+([\d,]+)", capsys.readouterr().out)
    assert (int(line[1].replace(",", "")) if line else 0) == scratch
