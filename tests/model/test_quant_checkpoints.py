"""Quantized checkpoints of every family, dense and MoE, loaded by deltaserve against transformers (CPU, float32).

Each tiny checkpoint is written in its family's exact on-disk layout (tests/model/quant_checkpoints.py; the
compressed-tensors one by that package). Truth is transformers on the dequantized twin (the same weights as
floats):
- weight-only formats (int4 W4A16 from compressed-tensors, AutoAWQ and GPTQ; NVFP4): greedy tokens of the engine
  equal transformers' argmax at every step (ties closer than 1e-3 excepted, as tests/engine), and logits agree
  within 1e-3 of the logit scale (float32 rounding against float64, as tests/model/test_parity): the weights are
  exactly the same numbers, so only the order of float32 sums differs.
- FP8 is W8A8 (activations quantized per token and 128 columns): against a plain-torch W8A8 run (transformers
  with each quantized product's input rounded to e4m3 by hooks) greedy tokens agree and logits nearly do (only
  the few elements whose float32 value sits on an e4m3 rounding boundary round the other way). Against the
  dequantized weights with unrounded activations, the logits differ by e4m3's activation rounding. Its bound,
  derived: e4m3 rounds each element to within 2^-4 of itself (3 mantissa bits), as a zero-mean error of rms at
  most 2^-4/sqrt(3) of it; to first order the logits' error is a sum of such independent errors through the
  layers, so its rms over all logits is at most 1/sqrt(3) of the rms change caused by moving every rounded
  element by the full 2^-4 with a random sign. That change is computed on the reference model itself
  (`perturbed_rms`), and the test requires rms(ours - dequantized) <= it (a sqrt(3) margin).
- Online FP8 of a bf16 checkpoint: the same bound with the weights' rounding included (every quantized weight
  element and every rounded activation element moved by 2^-4).
The models use matrix gain 0.5 (tame: a rounding difference stays a rounding difference; see demo.build_checkpoint).
"""

from __future__ import annotations

import json
import math
import types

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from deltaserve import LLM, SamplingParams
from deltaserve.config import ModelConfig
from deltaserve.layers.linear import QuantLinear
from deltaserve.layers.mlp import JOIN_ROW_MULTIPLE, QuantExperts
from deltaserve.layers.quant import SplitWeight, detect_weight_format
from deltaserve.model.loader import load_model
from deltaserve.ops.moe import quantized
from tests.model.helpers import SequenceRunner, model_bound
from tests.model.quant_checkpoints import KV_SCALES, quantize_checkpoint
from tests.tolerance import assert_within

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [5, 17, 300, 2, 900, 41, 77, 12, 500]
STEPS = 8
U = 2.0 ** -4  # e4m3's largest relative rounding error (3 mantissa bits, round to nearest)
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)


@pytest.fixture(scope="module")
def sources(quant_sources):
    return quant_sources


def engine_greedy(path, **engine_args) -> list[int]:
    llm = LLM(str(path), max_num_seqs=4, skip_tokenizer_init=True, **engine_args)
    return llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def our_logits(path, ids, quantization=None) -> torch.Tensor:
    """Our float32 logits [len(ids), V] for one prompt."""
    from deltaserve.worker.kv_cache import CacheShape, bind_caches

    fmt = detect_weight_format(path, quantization)
    model = load_model(path, ModelConfig.from_pretrained(path), torch.float32, "cpu", weight_format=fmt)
    bind_caches(model, CacheShape(num_blocks=16, block_size=4, num_state_slots=2, kv_dtype=torch.float32,
                                  ssm_dtype=torch.float32), "cpu")
    runner = SequenceRunner(model)
    runner.add(1)
    return runner.step({1: ids})[1]


def reference(path, dtype=torch.float32):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    model.config._experts_implementation = "eager"  # the grouped-mm expert kernel has no float64
    return model


def reference_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double()


def assert_greedy_matches(tokens: list[int], logits: torch.Tensor) -> None:
    """tokens: our greedy continuation of PROMPT; logits: the reference's over PROMPT + tokens."""
    for i, token in enumerate(tokens):
        row = logits[len(PROMPT) - 1 + i]
        best = int(row.argmax())
        if token != best:  # allowed only at a near tie of the reference's own logits
            gap = (row[best] - row[token]).item()
            assert gap < 1e-3, f"step {i}: ours {token}, reference {best} (logit gap {gap:.3g})"


def rms(t: torch.Tensor) -> float:
    return t.double().pow(2).mean().sqrt().item()


# ------------------------------------------------------------------------------------ weight-only formats


WEIGHT_ONLY = [  # (family, options): every group size, symmetric and not, act order (GPTQ), both archs
    ("ct", dict(group_size=32)),
    ("ct", dict(group_size=64, symmetric=True)),
    ("awq", dict(group_size=64)),
    ("gptq", dict(group_size=128)),
    ("nvfp4", {}),
]


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("family, options", WEIGHT_ONLY, ids=lambda v: v if isinstance(v, str) else
                         "-".join(f"{k}{v}" for k, v in v.items()) or "default")
def test_weight_only_checkpoint_matches_transformers_on_dequantized_weights(arch, family, options, sources,
                                                                           tmp_path):
    pair = quantize_checkpoint(sources[arch], tmp_path, family, **options)
    tokens = engine_greedy(pair.path)
    truth = reference_logits(reference(pair.reference, torch.float64), PROMPT + tokens)
    assert_greedy_matches(tokens, truth)
    ours = our_logits(pair.path, PROMPT + tokens)
    # the dequantized weights are the twin's exactly: what is left is the float32 model's own rounding
    cfg = ModelConfig.from_pretrained(pair.path)
    assert_within(ours, truth, model_bound(cfg, len(PROMPT + tokens), truth.abs().max().item()),
                  "logits vs transformers on the dequantized twin")


# ------------------------------------------------------------------------------------ FP8 (W8A8)


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Plain-torch W8A8 activation rounding: per row and 128 columns, s = amax / 448, x -> e4m3(x / s) * s."""
    k = x.shape[-1]
    groups = math.ceil(k / 128)
    xg = torch.nn.functional.pad(x.reshape(-1, k).float(), (0, groups * 128 - k)).view(-1, groups, 128)
    scale = xg.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448
    rounded = (xg / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    return rounded.view(-1, groups * 128)[:, :k].reshape(x.shape).to(x.dtype)


def random_signs(generator: torch.Generator):
    """Every element moved by the full 2^-4 of itself, up or down at random."""
    def move(x):
        sign = torch.randint(0, 2, x.shape, generator=generator).to(x.dtype) * 2 - 1
        return x * (1 + U * sign)
    return move


def transform_inputs(model, names: list[str], transform) -> None:
    """Apply `transform` to the input of every quantized product of transformers' `model`: forward pre-hooks on
    the projections, and a copy of its eager experts loop with the transform before each expert matmul."""
    modules = dict(model.named_modules())
    for name in {n.removesuffix(".weight") for n in names if ".experts." not in n}:
        modules[name].register_forward_pre_hook(lambda module, args: (transform(args[0]),))

    def experts_forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for e in range(self.num_experts):
            tokens, slot = torch.where(top_k_index == e)
            gate, up = torch.nn.functional.linear(transform(hidden[tokens]), self.gate_up_proj[e]).chunk(2, dim=-1)
            y = torch.nn.functional.linear(transform(torch.nn.functional.silu(gate) * up), self.down_proj[e])
            out.index_add_(0, tokens, y * top_k_weights[tokens, slot, None])
        return out

    for name, module in modules.items():
        if name.endswith("mlp.experts"):
            module.forward = types.MethodType(experts_forward, module)


def perturbed_rms(path, names, ids, base: torch.Tensor, trials: int = 2, weights: bool = False) -> float:
    """The rms logit change of the reference when every quantized product's input elements (and with weights,
    its weight elements) move by 2^-4 of themselves with random signs; the mean over `trials` draws."""
    generator = torch.Generator().manual_seed(0)
    changes = []
    for _ in range(trials):
        model = reference(path)
        move = random_signs(generator)
        transform_inputs(model, names, move)
        if weights:
            params = dict(model.named_parameters())
            with torch.no_grad():
                for name in {_transformers_param(name) for name in names}:
                    params[name].copy_(move(params[name]))
        changes.append(rms(reference_logits(model, ids) - base))
    return sum(changes) / trials


def _transformers_param(name: str) -> str:
    """A checkpoint weight's parameter in transformers' model: its experts are fused, [E, 2I, H] and [E, H, I]."""
    if ".experts." not in name:
        return name
    proj = "down_proj" if name.endswith("down_proj.weight") else "gate_up_proj"
    return f"{name.split('.experts.')[0]}.experts.{proj}"


@pytest.mark.parametrize("arch, layout", [("qwen3_5", dict(multimodal=True)), ("qwen3_5_moe", {})])
def test_fp8_checkpoint_is_w8a8_and_within_e4m3_rounding_of_dequantized(arch, layout, sources, tmp_path):
    pair = quantize_checkpoint(sources[arch], tmp_path, "fp8", **layout)
    tokens = engine_greedy(pair.path)
    ids = PROMPT + tokens
    w8a8 = reference(pair.reference)
    transform_inputs(w8a8, pair.quantized, round_e4m3)
    w8a8_logits = reference_logits(w8a8, ids)
    assert_greedy_matches(tokens, w8a8_logits)
    ours = our_logits(pair.path, ids).double()
    dequantized = reference_logits(reference(pair.reference), ids)
    bound = perturbed_rms(pair.reference, pair.quantized, ids, dequantized)
    assert rms(ours - dequantized) <= bound, f"rms {rms(ours - dequantized):.3g} beyond e4m3's bound {bound:.3g}"
    # the activations really are rounded as W8A8 says: far nearer the W8A8 run than e4m3's rounding of them
    assert rms(ours - w8a8_logits) <= bound / 10


def test_fused_expert_tensors_load_like_per_expert_ones(sources, tmp_path):
    """transformers' fused layout (experts.gate_up_proj [E, 2I, H] e4m3 and experts.gate_up_proj_scale_inv)."""
    per_expert = quantize_checkpoint(sources["qwen3_5_moe"], tmp_path / "a", "fp8")
    fused = quantize_checkpoint(sources["qwen3_5_moe"], tmp_path / "b", "fp8", fused_experts=True)
    assert "model.layers.0.mlp.experts.gate_up_proj_scale_inv" in load_file(fused.path / "model.safetensors")
    assert torch.equal(our_logits(per_expert.path, PROMPT), our_logits(fused.path, PROMPT))


def test_online_fp8_of_a_bf16_checkpoint_is_within_e4m3_rounding(sources, tmp_path):
    source = sources["qwen3_5_moe"]
    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    for file in source.iterdir():
        if file.suffix != ".safetensors":
            (bf16 / file.name).write_bytes(file.read_bytes())
    tensors = load_file(source / "model.safetensors")
    save_file({k: v if k.endswith("A_log") else v.bfloat16() for k, v in tensors.items()}, bf16 / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    (bf16 / "config.json").write_text(json.dumps(dict(config, dtype="bfloat16")))

    tokens = engine_greedy(bf16, quantization="fp8")
    ids = PROMPT + tokens
    ours = our_logits(bf16, ids, quantization="fp8").double()
    unquantized = our_logits(bf16, ids).double()
    truth = reference_logits(reference(bf16), ids)
    assert (unquantized - truth).abs().max() <= 1e-3 * truth.abs().max()  # the bf16 path itself is exact
    fmt = detect_weight_format(bf16, "fp8")
    quantized = [name for name in tensors if name.endswith(".weight") and _is_projection(name)
                 and fmt.scheme_for(name.removesuffix(".weight")) is not None]
    assert any("in_proj_qkv" in n for n in quantized) and not any("in_proj_a" in n for n in quantized)
    bound = perturbed_rms(bf16, quantized, ids, truth, weights=True)
    assert 0 < rms(ours - truth) <= bound, f"rms {rms(ours - truth):.3g} beyond e4m3's bound {bound:.3g}"


def _is_projection(name: str) -> bool:
    return any(f".{p}.weight" in name for p in ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z",
                                                  "in_proj_a", "in_proj_b", "out_proj", "gate_proj", "up_proj",
                                                  "down_proj"))


# ------------------------------------------------------------------------------------ module layout


@pytest.mark.parametrize("family, options", [("fp8", {}), ("awq", dict(group_size=128))])
def test_quantized_shared_expert_fits_the_experts_slot(family, options, sources, tmp_path):
    """As Qwen's FP8 and AWQ 35B-A3B load: the routed experts stacked, the shared expert's prepared weights in their
    layout (the fused kernels take it as a slot at one token on the GPU), the plain router and shared gate joined."""
    pair = quantize_checkpoint(sources["qwen3_5_moe"], tmp_path, family, **options)
    config = ModelConfig.from_pretrained(pair.path)
    model = load_model(pair.path, config, torch.bfloat16, "cpu", weight_format=detect_weight_format(pair.path))
    block = model.model.layers[0].mlp
    gate_up, down = block.experts.stacks()
    shared_gate_up, shared_down = block.shared_expert.slot_weights()
    assert quantized.slot_fits(gate_up, shared_gate_up) and quantized.slot_fits(down, shared_down)
    rows = -(-(config.num_experts + 1) // JOIN_ROW_MULTIPLE) * JOIN_ROW_MULTIPLE  # router | shared gate | zeros
    assert block.in_weight is None and block.router_weight.shape == (rows, config.hidden_size)


def test_quantized_modules_fuse_only_what_lines_up(sources, tmp_path):
    """FP8: GDN in_proj_qkv|z join (the boundary at 256 rows is a block edge) and in_proj_b|a stay bf16 beside
    them; attention q|k join but v starts inside a 128-row block and stays apart; MLP gate|up join. Nothing keeps
    the checkpoint's tensors once prepared."""
    pair = quantize_checkpoint(sources["qwen3_5"], tmp_path, "fp8")
    model = load_model(pair.path, ModelConfig.from_pretrained(pair.path), torch.float32, "cpu",
                       weight_format=detect_weight_format(pair.path))
    gdn, attention, mlp = model.model.layers[0].linear_attn, model.model.layers[3].self_attn, model.model.layers[0].mlp
    assert isinstance(gdn.in_proj_a, torch.nn.Linear) and isinstance(gdn.in_proj_qkv, QuantLinear)
    assert [type(p).__name__ for p in gdn.in_weight.parts] == ["QuantWeight", "Tensor"]
    assert [p.shape[0] for p in gdn.in_weight.parts] == [256 + 128, 8]
    assert isinstance(attention.in_weight, SplitWeight) and [p.shape[0] for p in attention.in_weight.parts] == [576, 64]
    assert not isinstance(mlp.gate_up_weight, (SplitWeight, torch.Tensor)) and mlp.gate_up_weight.shape == (256, 128)
    assert all(not m.raw for m in model.modules() if isinstance(m, (QuantLinear, QuantExperts)))
    # NVFP4: q, k and v have their own weight_scale_2 (quant_checkpoints.nvfp4), kept per row in one joined weight
    pair = quantize_checkpoint(sources["qwen3_5"], tmp_path / "nvfp4", "nvfp4")
    model = load_model(pair.path, ModelConfig.from_pretrained(pair.path), torch.float32, "cpu",
                       weight_format=detect_weight_format(pair.path))
    attention = model.model.layers[3].self_attn
    assert not isinstance(attention.in_weight, SplitWeight) and attention.in_weight.shape == (640, 128)
    assert len(set(attention.in_weight.prepared.scale_2.tolist())) == 3
    assert attention.kv_scales_from_checkpoint and (attention.k_scale, attention.v_scale) == KV_SCALES
