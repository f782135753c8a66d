"""The fused MoE kernels on stacked quantized experts (ops/moe/quantized.py: FP8 block-scaled W8A8, int4 W4A16
with and without zero points, NVFP4 weight-only) against the float64 value of their semantics
(tests/ops/moe_oracle.py), in Triton's CPU interpreter: float32 and bf16 activations, one token, several, and more than a block holds; a partial FP8 K
block; the stacking and its fallbacks; QuantExperts on the CPU (the dequantized reference); the prompt chunks' grouped
matmul on dequantized groups of experts (dequantized.py). The compiled kernels:
tests/gpu/test_moe_gpu.py."""

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("compiled kernels are tested by tests/gpu/test_moe_gpu.py", allow_module_level=True)
pytest.importorskip("triton")

from deltaserve.ops.moe import cuda as moe_cuda  # noqa: E402
from deltaserve.ops.moe import dequantized  # noqa: E402
from deltaserve.ops.moe import quantized  # noqa: E402
from deltaserve.ops.moe.configs import MoeTiles, Tile  # noqa: E402
from deltaserve.ops.quant_gemm import reference as ref  # noqa: E402
from deltaserve.ops.split_k import tile_counters  # noqa: E402
from tests.ops.interpreter import (patch_interpreter_bf16_dot, patch_interpreter_float_rounding,  # noqa: E402
                                   patch_interpreter_index)
from tests.ops.moe_oracle import quantized_experts_exact, shared_bound  # noqa: E402
from tests.ops.test_triton_quant_gemm import int4_weight, nvfp4_weight  # noqa: E402

patch_interpreter_index()
patch_interpreter_float_rounding()
patch_interpreter_bf16_dot()

SMALL = MoeTiles(16, Tile(16, 16, 4, 1), Tile(16, 16, 4, 1))
SPLIT = SMALL._replace(split_k=2)  # one token: kernel A's K blocks in 2 splits (FP8's 2, int4's 2, NVFP4's 3: 2 + 1)
# the one-token GEMV kernels: 8-row blocks (inside FP8's 128-row scale block), K steps of up to 128 (whole FP8
# blocks, whole int4 groups)
ROWS = MoeTiles(16, Tile(8, 128, 4, 1), Tile(8, 128, 4, 1), gemv=True)
# NVFP4's 48 = 3 x 16: the K step is the tile's 16 on both projections; with BLOCK_K 32 it would take 16 on H = 48
FORMATS = [("fp8", 200, 128), ("int4", 128, 64), ("int4-sym", 128, 96), ("nvfp4", 48, 80)]


def fp8_weight(n, k, gen):
    w = torch.randn(n, k, generator=gen) * torch.logspace(-1, 0, n)[:, None] / k**0.5
    return ref.prepare_fp8_block(*ref.fp8_block_quantize(w, (128, 128)), (128, 128))


def experts(fmt, E, H, inter, gen):
    if fmt == "fp8":
        return [fp8_weight(2 * inter, H, gen) for _ in range(E)], [fp8_weight(H, inter, gen) for _ in range(E)]
    if fmt == "nvfp4":  # scale_2 one per row: gate and up of a checkpoint carry their own
        return ([nvfp4_weight(2 * inter, H, True, gen) for _ in range(E)],
                [nvfp4_weight(H, inter, True, gen) for _ in range(E)])
    symmetric = fmt == "int4-sym"
    return ([int4_weight(2 * inter, H, 64, symmetric, False, gen) for _ in range(E)],
            [int4_weight(H, inter, 32, symmetric, False, gen) for _ in range(E)])


def assert_fused_experts_within_bound(gate_up, down, dtype, tokens: int, top_k: int, tiles: MoeTiles, gen, label: str):
    """fused_experts over the stacks on random activations (of growing scale along H) and routing, within the
    oracle's bound of its float64 value; returns (that value, the bound)."""
    E, _, H = gate_up.shape
    x = (torch.randn(tokens, H, generator=gen) * torch.logspace(-1, 0.5, H)).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    got = moe_cuda.fused_experts(x, ids, weights, gate_up, down, tiles)
    want, bound = quantized_experts_exact(x, ids, weights, gate_up, down, dtype)
    err = (got.double() - want).abs()
    assert (err <= bound).all(), f"{label}: error {(err / bound).max():.3g} x its bound"
    return want, bound


@pytest.mark.parametrize("fmt,H,inter", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,top_k", [(1, 3), (5, 1), (20, 2)])
def test_fused_quantized_experts_match_their_semantics(fmt, H, inter, dtype, tokens, top_k):
    """FP8: H = 200 is one full and one partial 128-column block; 20 tokens put a popular expert in two blocks; NVFP4:
    I = 80 rows against 16-wide tiles of N, and an odd number of scale groups."""
    gen = torch.Generator().manual_seed(tokens * 31 + top_k + H)
    gate_up, down = (quantized.stack(part) for part in experts(fmt, 5, H, inter, gen))
    want, bound = assert_fused_experts_within_bound(gate_up, down, dtype, tokens, top_k, SMALL, gen, fmt)
    # a bound below most values: a wrong scale, zero point or expert (an error of the value's size) breaks it
    assert (bound < 0.5 * want.abs()).double().mean() > 0.5


@pytest.mark.parametrize("fmt,H,inter", FORMATS)
def test_one_token_kernel_a_split_over_k_matches_their_semantics(fmt, H, inter):
    """One token on the tiles with kernel A's K blocks split in 2 (the tile's last split adds the float32 sums, then
    SiLU and the product): within the semantics' bound, a second call the same bits, every counter back at 0."""
    gen = torch.Generator().manual_seed(H + 3)
    gate_up, down = (quantized.stack(part) for part in experts(fmt, 5, H, inter, gen))
    x = (torch.randn(1, H, generator=gen) * torch.logspace(-1, 0.5, H)).to(torch.bfloat16)
    ids, weights = torch.randperm(5, generator=gen)[:3][None], torch.rand(1, 3, generator=gen) + 0.1
    got = moe_cuda.fused_experts(x, ids, weights, gate_up, down, SPLIT)
    want, bound = quantized_experts_exact(x, ids, weights, gate_up, down, torch.bfloat16)
    err = (got.double() - want).abs()
    assert (err <= bound).all(), f"{fmt} split: error {(err / bound).max():.3g} x its bound"
    assert torch.equal(moe_cuda.fused_experts(x, ids, weights, gate_up, down, SPLIT), got)
    assert not tile_counters(x.device, 1).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quant_x", [True, False])
def test_fp8_one_token_quantizes_in_the_tile_kernels_with_the_launches_bits(dtype, quant_x, monkeypatch):
    """FP8 experts at one token on the tile kernels quantize the token and the activation inside every program
    (no cuda_fp8.quantize launch; in two launches where the tiles' quant_x is off) and give the bits of the same
    token in a batch, which the quantize launches feed (a pair depends only on its token, its expert and the
    tiles): H = 200, a partial K block."""
    from deltaserve.ops.quant_gemm import cuda_fp8

    gen = torch.Generator().manual_seed(3)
    gate_up, down = (quantized.stack(part) for part in experts("fp8", 5, 200, 128, gen))
    x = (torch.randn(4, 200, generator=gen) * torch.logspace(-1, 0.5, 200)).to(dtype)
    ids = torch.stack([torch.randperm(5, generator=gen)[:3] for _ in range(4)])
    ids[1] = ids[0].flip(0)  # token 0's experts shared by another token, in other slots
    weights = torch.rand(4, 3, generator=gen) + 0.1
    quantizations = []
    real_quantize = cuda_fp8.quantize
    monkeypatch.setattr(cuda_fp8, "quantize", lambda *a: quantizations.append(a[0].shape) or real_quantize(*a))
    alone = moe_cuda.fused_experts(x[:1], ids[:1], weights[:1], gate_up, down, SMALL._replace(quant_x=quant_x))
    assert len(quantizations) == (0 if quant_x else 2)
    quantizations.clear()
    batch = moe_cuda.fused_experts(x, ids, weights, gate_up, down, SMALL)
    assert len(quantizations) == 2  # the token rows, then the activation's
    assert torch.equal(batch[:1], alone)


@pytest.mark.parametrize("fmt,H,inter", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_gemv_kernels_match_their_semantics(fmt, H, inter, dtype):
    """One token on the GEMV kernels (ROWS): FP8's partial 128-column block masked (and quantized in the kernels,
    W8A8 as the tiles), int4's K steps of whole groups (64 of down's I = 64, 32 of int4-sym's I = 96), NVFP4's of 16
    (48 and 80)."""
    gen = torch.Generator().manual_seed(H + inter)
    gate_up, down = (quantized.stack(part) for part in experts(fmt, 5, H, inter, gen))
    ops = moe_cuda._operands(gate_up, dtype), moe_cuda._operands(down, dtype)
    want_steps = {"fp8": (128, 128), "int4": (128, 64), "int4-sym": (128, 32), "nvfp4": (16, 16)}[fmt]
    assert moe_cuda._row_block_ks(ROWS, *ops, H, inter) == want_steps  # the GEMV kernels take it
    want, bound = assert_fused_experts_within_bound(gate_up, down, dtype, 1, 3, ROWS, gen, f"{fmt} GEMV")
    assert (bound < 0.5 * want.abs()).double().mean() > 0.5


@pytest.mark.parametrize("fmt,H,inter", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,tiles", [(1, SMALL), (5, SMALL), (1, ROWS), (1, SPLIT)])
def test_quantized_shared_slot_matches_its_semantics(fmt, H, inter, dtype, tokens, tiles):
    """fused_moe with stacked quantized experts and the shared expert's prepared weights as its slot: the k routed
    experts the kernels chose plus the shared one as expert E of k + 1, weighted sigmoid(gate), within the experts'
    bound and the float32 sigmoid's (one side of shared_bound)."""
    gen = torch.Generator().manual_seed(tokens * 7 + H)
    E, top_k = 5, 2
    gate_up, down = experts(fmt, E + 1, H, inter, gen)  # the last one is the shared expert
    x = (torch.randn(tokens, H, generator=gen) * torch.logspace(-1, 0.5, H)).to(dtype)
    logits = torch.randn(tokens, E, generator=gen).to(dtype)
    shared_gate = torch.randn(tokens, 1, generator=gen).to(dtype)
    got, ids, weights = moe_cuda.fused_moe(x, logits, top_k, True, quantized.stack(gate_up[:E]),
                                           quantized.stack(down[:E]), gate_up[E], down[E], shared_gate, tiles)
    slot_ids = torch.cat([ids.long(), torch.full((tokens, 1), E)], 1)
    slot_weights = torch.cat([weights.double(), torch.sigmoid(shared_gate.double())], 1)
    every_gate_up, every_down = quantized.stack(gate_up), quantized.stack(down)
    want, bound = quantized_experts_exact(x, slot_ids, slot_weights, every_gate_up, every_down, dtype)
    shared, _ = quantized_experts_exact(x, slot_ids[:, -1:], torch.ones(tokens, 1), every_gate_up, every_down, dtype)
    bound = bound + shared_bound(shared, shared_gate, torch.float32) / 2
    err = (got.double() - want).abs()
    assert (err <= bound).all(), f"{fmt}: error {(err / bound).max():.3g} x its bound"
    assert (bound < 0.5 * want.abs()).double().mean() > 0.5


def test_shared_slot_takes_only_a_weight_of_the_experts_layout():
    gen = torch.Generator().manual_seed(2)
    fp8 = quantized.stack([fp8_weight(256, 128, gen) for _ in range(2)])
    assert quantized.slot_fits(fp8, fp8_weight(256, 128, gen))
    assert not quantized.slot_fits(fp8, fp8_weight(384, 128, gen))  # another shape
    assert not quantized.slot_fits(fp8, torch.zeros(256, 128))  # a plain tensor
    int4 = quantized.stack([int4_weight(32, 128, 64, False, False, gen) for _ in range(2)])
    assert quantized.slot_fits(int4, int4_weight(32, 128, 64, False, False, gen))
    assert not quantized.slot_fits(int4, int4_weight(32, 128, 32, False, False, gen))  # another group
    assert not quantized.slot_fits(int4, int4_weight(32, 128, 64, True, False, gen))  # no zero point
    assert not quantized.slot_fits(int4, int4_weight(32, 128, 64, False, True, gen))  # act order
    assert not quantized.slot_fits(fp8, int4_weight(256, 128, 64, False, False, gen))  # another format
    plain = torch.zeros(2, 8, 4)
    assert quantized.slot_fits(plain, torch.zeros(8, 4))
    assert not quantized.slot_fits(plain, torch.zeros(4, 8).t())  # the experts' strides, not its own
    assert not quantized.slot_fits(plain, torch.zeros(8, 4, dtype=torch.bfloat16))
    x, logits, gate = torch.zeros(1, 128), torch.zeros(1, 2), torch.zeros(1, 1)
    with pytest.raises(ValueError, match="shared gate_up Fp8BlockWeight"):
        moe_cuda.fused_moe(x, logits, 1, True, fp8, quantized.stack([fp8_weight(128, 128, gen)] * 2),
                           fp8_weight(384, 128, gen), fp8_weight(128, 128, gen), gate, SMALL)


def test_stack_takes_one_layout_and_gives_views():
    gen = torch.Generator().manual_seed(0)
    fp8 = [fp8_weight(256, 128, gen) for _ in range(3)]
    stacked = quantized.stack(fp8)
    assert isinstance(stacked, quantized.Fp8Experts) and stacked.shape == (3, 256, 128)
    assert stacked.expert(1).weight.data_ptr() == stacked.weight[1].data_ptr()
    assert torch.equal(stacked.expert(2).dequantize(torch.float32), fp8[2].dequantize(torch.float32))
    int4 = [int4_weight(32, 128, 64, False, False, gen) for _ in range(3)]
    assert torch.equal(quantized.stack(int4).expert(0).dequantize(torch.float32), int4[0].dequantize(torch.float32))
    # what the kernels cannot take stays per expert: act order, mixed formats, another FP8 block
    assert quantized.stack([int4_weight(32, 128, 64, False, True, gen)]) is None
    assert quantized.stack([fp8[0], int4[0]]) is None
    other = ref.prepare_fp8_block(*ref.fp8_block_quantize(torch.randn(32, 64, generator=gen), (16, 32)), (16, 32))
    assert quantized.stack([other]) is None
    nvfp4 = [nvfp4_weight(32, 64, per_row, gen) for per_row in (True, False, True)]  # a scalar scale_2 expands
    stacked = quantized.stack(nvfp4)
    assert isinstance(stacked, quantized.Nvfp4Experts) and stacked.shape == (3, 32, 64)
    assert torch.equal(stacked.expert(1).dequantize(torch.float32), nvfp4[1].dequantize(torch.float32))
    assert quantized.stack([nvfp4[0], int4[0]]) is None
    assert quantized.slot_fits(stacked, nvfp4_weight(32, 64, False, gen))
    assert not quantized.slot_fits(stacked, nvfp4_weight(32, 96, True, gen))  # another K


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_experts_step_k_by_a_divisor_of_each_projection(dtype):
    """BLOCK_K 32 tiles over H = 96 (three steps of 32) and I = 48 (which 32 does not divide: three of 16); the
    kernels never mask K, so a step that overran I would read the next row's codes and scales."""
    gen = torch.Generator().manual_seed(5)
    H, inter, tokens, top_k = 96, 48, 5, 2
    tiles = MoeTiles(16, Tile(16, 32, 4, 1), Tile(16, 32, 4, 1))
    gate_up, down = (quantized.stack(part) for part in experts("nvfp4", 4, H, inter, gen))
    ops = moe_cuda._operands(gate_up, dtype)
    assert moe_cuda._block_k(ops, 32, H) == 32 and moe_cuda._block_k(ops, 32, inter) == 16
    assert_fused_experts_within_bound(gate_up, down, dtype, tokens, top_k, tiles, gen, "nvfp4, BLOCK_K 32")


def test_fp8_gate_and_up_must_not_share_a_scale_block():
    gen = torch.Generator().manual_seed(1)
    gate_up = quantized.stack([fp8_weight(2 * 64, 128, gen)])
    down = quantized.stack([fp8_weight(128, 64, gen)])
    assert not quantized.fused_layout(gate_up, down)
    with pytest.raises(ValueError, match="128-row scale block"):
        moe_cuda.fused_experts(torch.zeros(1, 128), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1), gate_up,
                               down, SMALL)


@pytest.mark.parametrize("fmt,H,inter", FORMATS)
def test_grouped_experts_match_their_semantics_in_any_grouping(fmt, H, inter):
    """A prompt chunk's path (dequantized.grouped_experts): experts dequantized a group at a time into the grouped
    matmul, float32 activations, within the fused kernels' bound of the format's value (FP8's activations rounded
    as the kernels quantize them); one expert a group and all in one give the same bits (the groups cut the sorted
    pairs, never a pair's sum). FP8's down projection (N = H = 200) has a partial scale block: dequantized per expert."""
    gen = torch.Generator().manual_seed(H * 3 + inter)
    gate_up, down = (quantized.stack(part) for part in experts(fmt, 5, H, inter, gen))
    x = (torch.randn(20, H, generator=gen) * torch.logspace(-1, 0.5, H)).float()
    ids = torch.stack([torch.randperm(5, generator=gen)[:2] for _ in range(20)])
    weights = torch.rand(20, 2, generator=gen) + 0.1
    one_each = dequantized.grouped_experts(x, ids, weights, gate_up, down, scratch_bytes=1)
    all_at_once = dequantized.grouped_experts(x, ids, weights, gate_up, down, scratch_bytes=1 << 30)
    assert torch.equal(one_each, all_at_once)
    want, bound = quantized_experts_exact(x, ids, weights, gate_up, down, torch.float32)
    err = (one_each.double() - want).abs()
    assert (err <= bound).all(), f"{fmt}: error {(err / bound).max():.3g} x its bound"
    assert (bound < 0.5 * want.abs()).double().mean() > 0.5


@pytest.mark.parametrize("fmt,H,inter", FORMATS)
def test_dequantized_groups_are_the_reference_weights(fmt, H, inter):
    """A group's one dequantize launch (FP8: cuda_fp8.dequantize, a scale block a program) gives each expert's
    reference dequantization: bitwise, except NVFP4 in float32, whose kernel multiplies code, scale and scale_2 in
    another order (two float32 roundings apart: 2 x 2^-24 of the value)."""
    gen = torch.Generator().manual_seed(H + 2 * inter)
    for stack in (quantized.stack(part) for part in experts(fmt, 4, H, inter, gen)):
        for dtype in (torch.bfloat16, torch.float32):
            got = dequantized._dequantized(stack, 1, 4, dtype)
            want = torch.stack([stack.expert(e).dequantize(dtype) for e in range(1, 4)])
            if fmt == "nvfp4" and dtype == torch.float32:
                assert ((got - want).abs() <= 2 * 2.0**-24 * want.abs()).all()
            else:
                assert torch.equal(got, want), (fmt, tuple(stack.shape), dtype)


def test_the_table_sends_a_grouped_bucket_to_the_dequantized_experts(monkeypatch):
    """ops.moe.experts on stacked experts: a bucket whose entry says "grouped" takes dequantized.grouped_experts, the
    others the fused kernels."""
    from deltaserve.ops import moe

    gen = torch.Generator().manual_seed(9)
    gate_up, down = (quantized.stack(part) for part in experts("int4", 5, 128, 64, gen))
    x = torch.randn(7, 128, generator=gen)
    ids = torch.stack([torch.randperm(5, generator=gen)[:2] for _ in range(7)])
    weights = torch.rand(7, 2, generator=gen)
    calls = []
    monkeypatch.setattr(moe, "fused_serves", lambda *args: True)  # the CPU: as on a GPU
    monkeypatch.setattr(dequantized, "grouped_experts", lambda *args: calls.append("grouped") or x)
    monkeypatch.setattr(moe_cuda, "fused_experts", lambda *args: calls.append("fused") or x)
    for grouped in (True, False):
        monkeypatch.setattr(moe, "tiles_for", lambda *args, grouped=grouped: SMALL._replace(grouped=grouped))
        moe.experts(x, ids, weights, gate_up, down)
    assert calls == ["grouped", "fused"]
