"""int4 W4A16 checkpoints (compressed-tensors, AutoAWQ, GPTQ) under tensor parallelism, on the CPU in float32.

Each checkpoint is a tiny one in its family's exact on-disk layout (tests/model/quant_checkpoints.py; the
compressed-tensors one written by that package), dense and MoE, groups of 32 and 128 (shapes whose shards are
whole groups), per-expert and fused ([E, ...]) experts, GPTQ with and without act order.
- Loaded weights: every rank's quantized projections dequantize to exactly (bitwise) the dequantized twin's
  slice, and the ranks' shards put back where their rows or columns came from are exactly the tp_size 1
  model's dequantized weights, every element covered. Exact, not within a bound: (q - zero) * scale of an int4
  code and a 16-bit scale is exact in float32, whoever computes it.
- End to end: two gloo processes serve each checkpoint; greedy tokens equal the tp_size 1 model's, and rank 0's
  logits are within test_tensor_parallel's bound of them (the runs differ only in the order of float32 sums:
  each row-parallel product adds two partial sums; see there for the derivation).
- A rank's columns that would split a group, and act order that mixes groups across the ranks' columns, are
  refused with an error naming the tensor, its shape, the group size and the tensor-parallel size.
"""

import pytest
import torch

from deltaserve.config import ModelConfig
from deltaserve.demo import build_checkpoint
from deltaserve.layers.linear import QuantLinear
from deltaserve.layers.mlp import QuantExperts
from deltaserve.model.errors import WeightLoadError
from deltaserve.model.tp_slices import rank_ranges
from deltaserve.worker.distributed import SINGLE, ParallelContext
from tests.model.quant_checkpoints import QUANT_SHAPES, quantize_checkpoint
from tests.model.tp_harness import TP, assert_within_reordered_sums, dequantize, load_rank, serve_sharded_and_single

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Groups of 32: QUANT_SHAPES' row-parallel inputs are 64 or 128 columns a rank. Groups of 128: GDN value heads of
# 64 and MLP widths of 256, so that every rank's inputs are 128 columns (o_proj: 2 heads x 64).
GROUP_128_SHAPES = dict(QUANT_SHAPES, linear_value_head_dim=64, intermediate_size=256, moe_intermediate_size=256,
                        shared_expert_intermediate_size=256)
# name -> (family, arch, quantize_checkpoint options): each family with both group sizes and both architectures
CASES = {
    "ct-g32-dense": ("ct", "qwen3_5", dict(group_size=32)),
    "ct-g128-moe-fused": ("ct", "qwen3_5_moe", dict(group_size=128, symmetric=True, fused_experts=True)),
    "awq-g128-dense": ("awq", "qwen3_5", dict(group_size=128)),
    "awq-g32-moe-fused": ("awq", "qwen3_5_moe", dict(group_size=32, fused_experts=True)),
    "gptq-g128-moe-act-order": ("gptq", "qwen3_5_moe", dict(group_size=128, act_order=TP)),  # within each half
    "gptq-g32-dense": ("gptq", "qwen3_5", dict(group_size=32, act_order=None)),
}
PREFILL = [{0: 7, 1: 5}]  # {state slot: prompt tokens}: two prompts prefilled in one batch
DECODE_STEPS = 4


def _source(root, arch: str, group_size: int):
    shapes = GROUP_128_SHAPES if group_size == 128 else QUANT_SHAPES
    return build_checkpoint(root / f"src-{arch}-{group_size}", arch, seed=0, matrix_gain=0.5, config_overrides=shapes)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """name -> QuantizedPair of every CASE."""
    root = tmp_path_factory.mktemp("tp-int4")
    sources = {}
    out = {}
    for name, (family, arch, options) in CASES.items():
        key = arch, options["group_size"]
        sources.setdefault(key, _source(root, *key))
        out[name] = quantize_checkpoint(sources[key], root / name, family, **options)
    return out


def _dequantized_weights(model) -> dict[str, torch.Tensor]:
    """Our name of each quantized projection's weight (as rank_ranges takes it; experts one by one, gate and up
    apart) -> the float32 [N, K] its loaded tensors hold."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            out[f"{name}.weight"] = dequantize(module.scheme, module.raw, (module.out_features, module.in_features))
        elif isinstance(module, QuantExperts):
            inter = module.intermediate_size
            for e in range(module.num_experts):
                if (e, "gate_up_proj") in module.raw:  # fused checkpoint: one [2I, H] matrix, gate rows first
                    gate_up = dequantize(module.schemes["gate_up_proj"], module.raw[e, "gate_up_proj"],
                                         module.projection_shape("gate_up_proj"))
                    parts = {"gate_proj": gate_up[:inter], "up_proj": gate_up[inter:]}
                else:
                    parts = {proj: dequantize(module.schemes[proj], module.raw[e, proj], module.projection_shape(proj))
                             for proj in ("gate_proj", "up_proj")}
                parts["down_proj"] = dequantize(module.schemes["down_proj"], module.raw[e, "down_proj"],
                                                module.projection_shape("down_proj"))
                out.update({f"{name}.{e}.{proj}.weight": w for proj, w in parts.items()})
    return out


def _twin_weights(model, names) -> dict[str, torch.Tensor]:
    """The float twin's weights under the same names (its experts are stacked: [E, 2I, H] and [E, H, I])."""
    params, out = dict(model.named_parameters()), {}
    for name in names:
        expert = name.split(".")
        if len(expert) > 3 and expert[-4] == "experts":
            prefix, e, proj = ".".join(expert[:-3]), int(expert[-3]), expert[-2]
            stacked = params[f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"][e]
            inter = stacked.shape[0] // 2
            out[name] = {"gate_proj": stacked[:inter], "up_proj": stacked[inter:], "down_proj": stacked}[proj]
        else:
            out[name] = params[name]
    return out


def _put_back(full: torch.Tensor, shard: torch.Tensor, name: str, cfg, parallel, covered: torch.Tensor) -> None:
    """Compare a rank's shard with the positions of `full` it came from (rank_ranges of `name`), marking them."""
    ranges = rank_ranges(name, list(full.shape), cfg, parallel)
    dim, spans = ranges if ranges is not None else (0, [(0, full.shape[0])])
    at = 0
    for start, length in spans:
        assert torch.equal(shard.narrow(dim, at, length), full.narrow(dim, start, length)), (name, parallel.tp_rank)
        covered.narrow(dim, start, length).fill_(True)
        at += length
    assert at == shard.shape[dim], name


@pytest.mark.parametrize("case", sorted(CASES))
def test_rank_shards_are_exact_slices_of_the_dequantized_weights(pairs, case):
    pair = pairs[case]
    cfg = ModelConfig.from_pretrained(pair.path)
    full = _dequantized_weights(load_rank(pair.path, SINGLE))
    covered = {name: torch.zeros_like(w, dtype=torch.bool) for name, w in full.items()}
    for rank in range(TP):
        parallel = ParallelContext(tp_rank=rank, tp_size=TP)
        shards = _dequantized_weights(load_rank(pair.path, parallel))
        assert shards.keys() == full.keys()
        twin = _twin_weights(load_rank(pair.reference, parallel, quantized=False), shards)
        for name, shard in shards.items():
            assert torch.equal(shard, twin[name]), (case, rank, name)
            _put_back(full[name], shard, name, cfg, parallel, covered[name])
    assert all(bool(mask.all()) for mask in covered.values())
    assert len(full) >= len(pair.quantized)  # every quantized projection (fused gate_up counted as gate and up)


# ------------------------------------------------------------------------------------ refusals


def test_a_shard_that_splits_a_group_is_refused(tmp_path):
    # groups of 128 over QUANT_SHAPES: GDN out_proj and MLP down_proj take 64 columns a rank
    source = _source(tmp_path, "qwen3_5", 32)
    for family in ("ct", "awq", "gptq"):
        pair = quantize_checkpoint(source, tmp_path / family, family, group_size=128, act_order=None)
        with pytest.raises(WeightLoadError, match=r"'model\.layers\.\d+\.\S+' \[\d+(, \d+)?\]: this rank's columns "
                           r"\[64, 128\) of K are not whole int4 groups of 128 columns\b.*--tensor-parallel-size 2"):
            load_rank(pair.path, ParallelContext(tp_rank=1, tp_size=TP))


def test_act_order_across_the_ranks_columns_is_refused(tmp_path):
    source = _source(tmp_path, "qwen3_5", 32)
    pair = quantize_checkpoint(source, tmp_path / "gptq", "gptq", group_size=32, act_order=1)  # over the whole K
    with pytest.raises(WeightLoadError, match=r"g_idx' \[\d+\]: act-order groups \(g_idx, group size 32\) of this "
                       r"rank's columns .* --tensor-parallel-size 2"):
        load_rank(pair.path, ParallelContext(tp_rank=0, tp_size=TP))


# ------------------------------------------------------------------------------------ end to end (gloo)


@pytest.fixture(scope="module")
def served(pairs, tmp_path_factory):
    """name -> ((tp 2 logits, tokens), (tp 1 logits, tokens), ModelConfig), from one spawn."""
    root = tmp_path_factory.mktemp("tp-int4-run")
    checkpoints = {name: str(pair.path) for name, pair in pairs.items()}
    return serve_sharded_and_single(root, checkpoints, PREFILL, DECODE_STEPS)


@pytest.mark.parametrize("case", sorted(CASES))
def test_tp2_serves_the_tp1_tokens_and_logits(served, case):
    (sharded, sharded_tokens), (single, single_tokens), cfg = served[case]
    assert sharded_tokens == single_tokens
    n_max = max(cfg.hidden_size, cfg.intermediate_size, cfg.moe_intermediate_size or 0)
    assert_within_reordered_sums(sharded, single, cfg.num_layers, n_max, case)
