"""Quantized checkpoints under tensor parallelism (FP8 block-scaled, NVFP4): each rank's loaded codes and sliced
scales dequantize to that rank's slice of the dequantized twin (which loads through the plain-weight slicing that
test_tensor_parallel checks end to end); fused (stacked) FP8 experts load each rank's slice as per-expert ones do;
a rank's rows that split a scale block are refused. (int4: test_tensor_parallel_int4.)

Bound: the twin multiplies codes and scales in float32 in its own order; the same two or three factors in another
order differ by at most 2 ulps (rtol 2 eps). A scale taken from another rank's block is off by its ratio."""

import pytest
import torch

from deltaserve.demo import build_checkpoint
from deltaserve.layers.linear import QuantLinear
from deltaserve.layers.mlp import QuantExperts
from deltaserve.model.errors import WeightLoadError
from deltaserve.worker.distributed import ParallelContext
from tests.model.quant_checkpoints import quantize_checkpoint, tiny_source
from tests.model.tp_harness import dequantize, load_rank

# Every rank's rows and columns whole 128-blocks at tp_size 2: q 2 x 2 x 128 rows, k and v one 128-row head,
# GDN q and k one 128-row key head each, v and z two 64-row value heads, MLP widths 128 a rank.
TP_SHAPES = dict(hidden_size=256, head_dim=128, num_attention_heads=4, num_key_value_heads=2,
                 linear_num_key_heads=2, linear_key_head_dim=128, linear_num_value_heads=4, linear_value_head_dim=64,
                 intermediate_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=256)


EPS32 = torch.finfo(torch.float32).eps


def _assert_match(ours: torch.Tensor, twin: torch.Tensor, what) -> None:
    torch.testing.assert_close(ours, twin, rtol=2 * EPS32, atol=0, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("family", ["fp8", "nvfp4"])
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_each_rank_dequantizes_to_its_slice_of_the_twin(tmp_path, arch, family):
    source = build_checkpoint(tmp_path / "src", arch, matrix_gain=0.5, config_overrides=TP_SHAPES)
    pair = quantize_checkpoint(source, tmp_path, family)

    for rank in range(2):
        parallel = ParallelContext(tp_rank=rank, tp_size=2)
        ours, twin = load_rank(pair.path, parallel, True), load_rank(pair.reference, parallel, False)
        twin_params = dict(twin.named_parameters())
        checked = 0
        for name, module in ours.named_modules():
            if isinstance(module, QuantLinear):
                shape = (module.out_features, module.in_features)
                _assert_match(dequantize(module.scheme, module.raw, shape), twin_params[f"{name}.weight"], name)
                checked += 1
            elif isinstance(module, QuantExperts):
                gate_up, down = twin_params[f"{name}.gate_up_proj"], twin_params[f"{name}.down_proj"]
                inter = module.intermediate_size
                twins = {"gate_proj": lambda e: gate_up[e, :inter], "up_proj": lambda e: gate_up[e, inter:],
                         "down_proj": lambda e: down[e]}
                for e in range(module.num_experts):
                    for proj, twin_of in twins.items():
                        ours_e = dequantize(module.schemes[proj], module.raw[e, proj], module.projection_shape(proj))
                        _assert_match(ours_e, twin_of(e), (name, e, proj))
                        checked += 1
        assert checked == len(pair.quantized)  # every quantized projection, this rank's slice of it


def test_a_scale_block_split_between_ranks_is_refused(tmp_path):
    source = tiny_source(tmp_path / "src", "qwen3_5", matrix_gain=0.5)  # GDN key heads of 32 rows
    pair = quantize_checkpoint(source, tmp_path, "fp8")
    with pytest.raises(WeightLoadError, match=r"weight_scale_inv' \[\d+, \d+\]: this rank's rows \[32, 64\) of N are not "
                       r"whole FP8 128x128 blocks of 128 rows .*--tensor-parallel-size 2"):
        load_rank(pair.path, ParallelContext(tp_rank=1, tp_size=2), True)


def test_fused_quantized_experts_load_each_ranks_slice_as_per_expert_ones(tmp_path):
    """transformers' fused layout (experts.gate_up_proj [E, 2I, H] e4m3, gate_up_proj_scale_inv [E, 2I/128, H/128]):
    each rank's experts are the per-expert checkpoint's, bit for bit."""
    source = build_checkpoint(tmp_path / "src", "qwen3_5_moe", matrix_gain=0.5, config_overrides=TP_SHAPES)
    per_expert = quantize_checkpoint(source, tmp_path / "a", "fp8")
    fused = quantize_checkpoint(source, tmp_path / "b", "fp8", fused_experts=True)
    for rank in range(2):
        parallel = ParallelContext(tp_rank=rank, tp_size=2)
        ours = dict(load_rank(fused.path, parallel, True).named_modules())
        checked = 0
        for name, module in load_rank(per_expert.path, parallel, True).named_modules():
            if not isinstance(module, QuantExperts):
                continue
            joined = ours[name]
            for e in range(module.num_experts):
                gate_up = torch.cat([dequantize(module.schemes[p], module.raw[e, p], module.projection_shape(p))
                                     for p in ("gate_proj", "up_proj")])
                fused_gate_up = dequantize(joined.schemes["gate_up_proj"], joined.raw[e, "gate_up_proj"],
                                           joined.projection_shape("gate_up_proj"))
                assert torch.equal(fused_gate_up, gate_up), (rank, name, e)
                down = [dequantize(m.schemes["down_proj"], m.raw[e, "down_proj"], m.projection_shape("down_proj"))
                        for m in (module, joined)]
                assert torch.equal(*down), (rank, name, e)
                checked += 1
        assert checked > 0
