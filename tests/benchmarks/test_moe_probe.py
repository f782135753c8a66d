"""moe_probe on the CPU: its torch path is the SparseMoE block's, its byte count is the weights it names, and bad
arguments are refused by name."""

import pytest
import torch

from benchmarks import moe_probe
from deltaserve.layers.mlp import SparseMoE
from deltaserve.model_configs import CONFIGS_DIR
from deltaserve.ops.moe import quantized
from deltaserve.ops.quant_gemm.reference import fp8_block_quantize, prepare_fp8_block


def test_torch_path_is_the_blocks_and_bytes_count_the_selected_experts():
    torch.manual_seed(0)
    block = SparseMoE(24, 5, 2, 16, 8, norm_topk_prob=True)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_()
    block.shared_expert.fuse()
    x = torch.randn(3, 24)
    with torch.no_grad():
        assert torch.equal(moe_probe.torch_path(block, x), block(x))  # on the CPU the block runs the torch path
    ids = torch.tensor([[0, 1], [1, 2], [0, 2]])  # three distinct experts
    per_expert = 2 * (2 * 16 * 24 + 24 * 16)
    fixed = 2 * (5 * 24 + 3 * 8 * 24 + 24)  # router, shared gate/up/down, shared gate
    assert moe_probe.layer_bytes(block, [ids]) == (fixed + 3 * per_expert, 3 * per_expert)


def test_shared_apart_path_is_the_blocks_fused_path_before_the_slot():
    """On a dyadic grid (every product and sum exact in float32) the probe's shared-apart path, the joined
    projection and the shared expert's down, equals the block's output bitwise; the slot is for the GPU only."""
    gen = torch.Generator().manual_seed(1)
    block = SparseMoE(24, 5, 2, 16, 16, norm_topk_prob=True)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randint(-4, 5, param.shape, generator=gen) / 8)
    block.fuse()
    block.shared_expert.fuse()
    x = torch.randint(-2, 3, (3, 24), generator=gen) / 2
    with torch.no_grad():
        assert torch.equal(moe_probe.shared_apart_path(block, x), block(x))
    assert moe_probe.slot_operands(block) is None  # the CPU: no fused kernels


def test_quantized_sweep_keeps_the_formats_block_k_and_bytes_count_every_part():
    assert moe_probe.sweep_tiles("bf16") == moe_probe.TILE_SWEEP
    fp8_tiles = moe_probe.sweep_tiles("fp8")
    assert fp8_tiles and {t.block_k for t in fp8_tiles} == {moe_probe.QUANT_BLOCK_K}
    experts = quantized.stack([prepare_fp8_block(*fp8_block_quantize(torch.randn(256, 384))) for _ in range(3)])
    assert moe_probe.stack_bytes(experts) == 256 * 384 + 4 * 2 * 3  # fp8 weight, float32 [2, 3] block scales


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "1,x"], "--tokens takes comma-separated positive integers, got '1,x'"),
    (["--tokens", "0"], "--tokens takes comma-separated positive integers, got '0'"),
    ([str(CONFIGS_DIR / "qwen3.5-27b")], "is not an MoE model"),
    (["--format", "fp4"], "invalid choice: 'fp4'"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        moe_probe.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("shared_size", [16, 0])
def test_the_sweeps_reference_is_the_blocks_output(shared_size):
    """What the tile sweep checks each candidate against (reference_output) is the block's own output: with the
    shared slot, the whole layer from the router's projection; without a shared expert, the routed experts. On a
    dyadic grid the products and sums are exact, so the CPU compares bits."""
    from deltaserve.ops import moe
    from deltaserve.ops.linear import linear

    gen = torch.Generator().manual_seed(2)
    block = SparseMoE(24, 5, 2, 16, shared_size, norm_topk_prob=True)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randint(-4, 5, param.shape, generator=gen) / 8)
    block.fuse()
    x = torch.randint(-2, 3, (3, 24), generator=gen) / 2
    with torch.no_grad():
        want = block(x)
        if shared_size:
            block.shared_expert.fuse()
            experts = block.experts
            operands = (experts.gate_up_proj, experts.down_proj, block.shared_expert.gate_up_weight,
                        block.shared_expert.down_proj.weight)
            projection = block.split_projection(linear(x, block.router_weight))
            got = moe_probe.reference_output(block, x, None, projection, operands, None)
        else:
            routed = moe.route(block.gate(x), block.top_k, block.norm_topk_prob)
            got = moe_probe.reference_output(block, x, routed, None, None, None)
    assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("grouped_wins", [False, True])
def test_every_swept_bucket_is_tabled_as_the_engine_reads_it(fmt, grouped_wins, tmp_path, monkeypatch):
    """sweep: every bucket of --tokens is swept and written, prompt buckets too (plain experts' chunks take the
    tiles of the buckets the table names, configs.prompt_tiles_tabled), "grouped" where torch's grouped matmul won;
    the written table passes the engine's check."""
    import argparse
    import json

    from deltaserve.ops.moe import configs

    swept = []

    def sweep_bucket(block, bucket, stacks):
        swept.append(bucket)
        won = grouped_wins and bucket in (configs.GROUPED_BUCKETS if stacks is not None else configs.PREFILL_BUCKETS)
        return configs.default_tiles(bucket)._replace(grouped=won), 1.0, 2.0

    monkeypatch.setattr(moe_probe, "sweep_bucket", sweep_bucket)
    block = SparseMoE(24, 5, 2, 16, 0, norm_topk_prob=True)
    stacks = None if fmt == "bf16" else (block.experts.gate_up_proj, block.experts.down_proj)  # shapes only
    out = tmp_path / "table.json"
    args = argparse.Namespace(budget_s=60.0, out=str(out), format=fmt)
    moe_probe.sweep(args, block, [1, 16, 300, 8192], stacks)
    assert swept == [1, 16, 512, 8192]
    table = json.loads(out.read_text())
    prefix = "" if fmt == "bf16" else f"{fmt}:"
    assert sorted(table) == sorted(f"{prefix}5:2:24:16:{bucket}" for bucket in swept)
    for key, entry in table.items():
        configs.check_entry("written", key, entry)
    grouped = {int(key.split(":")[-1]) for key, entry in table.items() if entry.get("grouped")}
    assert grouped == (set() if not grouped_wins else {512, 8192} if fmt == "bf16" else {8192})
    monkeypatch.setenv(configs.ENV_VAR, str(out))
    configs.tuned_table.cache_clear()
    try:
        tabled = [configs.prompt_tiles_tabled(5, 2, 24, 16, rows) for rows in (300, 8192)]
        assert tabled == [fmt == "bf16" and not grouped_wins] * 2  # quantized chunks run fused whatever the table
    finally:
        configs.tuned_table.cache_clear()


def test_routing_times_name_each_warp_count_and_the_shipped_one(monkeypatch):
    monkeypatch.setattr(moe_probe.moe_cuda, "ROUTE_WARPS", 2)
    assert moe_probe.route_times({1: 1.94, 2: 2.51, 4: 3.06}) == "1.9 us (1 warp), 2.5 us (2 warps, shipped), 3.1 us (4 warps)"
