"""The fused MoE experts (ops/moe/cuda.fused_experts) against the grouped-matmul reference, the align kernel's
grouping, per-pair determinism, the tile table, and the SparseMoE block on the fused path (the Triton interpreter on
the CPU in float32; tests/gpu/test_moe_gpu.py runs bf16 at the real shapes)."""

import json

import pytest
import torch
from torch import nn

triton = pytest.importorskip("triton")

from deltaserve.layers.mlp import JOIN_ROW_MULTIPLE, SparseMoE  # noqa: E402
from deltaserve.ops import moe  # noqa: E402
from deltaserve.ops.moe import configs  # noqa: E402
from deltaserve.ops.moe import cuda as moe_cuda  # noqa: E402
from deltaserve.ops.moe import reference  # noqa: E402
from deltaserve.ops.moe.configs import MoeTiles, Tile  # noqa: E402
from tests.ops.interpreter import patch_interpreter_index  # noqa: E402
from tests.ops.moe_oracle import (combine_exact, experts_bound, experts_magnitude, route_bound,  # noqa: E402
                                  shared_bound)
from tests.tolerance import assert_within, gamma  # noqa: E402

patch_interpreter_index()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# small tiles keep the interpreter quick: one block holds 16 pairs, so T > 16 puts a popular expert in two blocks
SMALL = MoeTiles(16, Tile(16, 16, 4, 1), Tile(16, 16, 4, 1))
ROWS = MoeTiles(16, Tile(8, 32, 4, 1), Tile(8, 32, 4, 1), gemv=True)  # one token on the GEMV kernels


def random_routing(tokens: int, experts: int, top_k: int, gen: torch.Generator):
    """topk_ids [T, k] (distinct experts per token) and positive weights [T, k] float32."""
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    return ids.to(DEVICE), (weights / weights.sum(-1, keepdim=True)).to(DEVICE)


def expert_weights(experts: int, hidden: int, inter: int, gen: torch.Generator, dtype=torch.float32):
    gate_up = (0.2 * torch.randn(experts, 2 * inter, hidden, generator=gen)).to(DEVICE, dtype)
    down = (0.2 * torch.randn(experts, hidden, inter, generator=gen)).to(DEVICE, dtype)
    return gate_up, down


# (experts, top_k, hidden, intermediate): odd expert counts, k = 1 and 8, sizes the tiles do not divide, and one
# that they do (the unmasked loads)
SHAPES = [(7, 1, 40, 24), (7, 3, 40, 24), (11, 8, 40, 24), (9, 2, 32, 48)]


@pytest.mark.parametrize("experts,top_k,hidden,inter", SHAPES)
@pytest.mark.parametrize("tokens", [1, 2, 5, 16, 33])
def test_fused_experts_match_grouped_matmul(experts, top_k, hidden, inter, tokens):
    gen = torch.Generator().manual_seed(1000 * tokens + experts + top_k)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    gate_up, down = expert_weights(experts, hidden, inter, gen)
    ids, weights = random_routing(tokens, experts, top_k, gen)
    got = moe_cuda.fused_experts(x, ids, weights, gate_up, down, SMALL)
    want = reference.grouped_experts(x, ids, weights, gate_up, down)
    assert_within(got, want, experts_bound(x, ids, weights, gate_up, down), "fused experts")


@pytest.mark.parametrize("experts,top_k,hidden,inter", SHAPES)
@pytest.mark.parametrize("split_k", [2, 3])
def test_one_token_kernel_a_split_over_k_matches_grouped_matmul(experts, top_k, hidden, inter, split_k):
    """One token with kernel A's K blocks split (hidden 40 in 16-column blocks: 2 + 1, or 1 + 1 + 1; 32: 1 + 1
    either way, the splits capped at its blocks): the grouped matmul's output within the experts' bound (the split
    sums add in another order)."""
    gen = torch.Generator().manual_seed(experts + top_k + hidden + split_k)
    x = torch.randn(1, hidden, generator=gen).to(DEVICE)
    gate_up, down = expert_weights(experts, hidden, inter, gen)
    ids, weights = random_routing(1, experts, top_k, gen)
    got = moe_cuda.fused_experts(x, ids, weights, gate_up, down, SMALL._replace(split_k=split_k))
    want = reference.grouped_experts(x, ids, weights, gate_up, down)
    assert_within(got, want, experts_bound(x, ids, weights, gate_up, down), "fused experts, kernel A split")


@pytest.mark.parametrize("experts,top_k,hidden,inter", SHAPES)
def test_one_token_gemv_kernels_match_grouped_matmul(experts, top_k, hidden, inter):
    """One token on the GEMV kernels, with a gated shared output summed by the combine."""
    gen = torch.Generator().manual_seed(experts + top_k + hidden)
    x = torch.randn(1, hidden, generator=gen).to(DEVICE)
    gate_up, down = expert_weights(experts, hidden, inter, gen)
    ids, weights = random_routing(1, experts, top_k, gen)
    shared, gate = torch.randn(1, hidden, generator=gen).to(DEVICE), torch.randn(1, 1, generator=gen).to(DEVICE)
    got = moe_cuda.fused_experts(x, ids, weights, gate_up, down, ROWS, (shared, gate))
    want = reference.grouped_experts(x, ids, weights, gate_up, down, shared=(shared, gate))
    bound = experts_bound(x, ids, weights, gate_up, down) + shared_bound(shared, gate, torch.float32)
    assert_within(got, want, bound, "fused experts, GEMV kernels")


def test_fused_experts_beyond_decode_sizes_default_tiles():
    """70 tokens with the default tiles: BLOCK_M 64 < T, so popular experts span several blocks."""
    gen = torch.Generator().manual_seed(70)
    x = torch.randn(70, 40, generator=gen).to(DEVICE)
    gate_up, down = expert_weights(11, 40, 24, gen)
    ids, weights = random_routing(70, 11, 8, gen)
    tiles = configs.default_tiles(70)
    assert tiles.block_m == 64 and moe_cuda.num_blocks(11, 70, 8, 64) > 11
    got = moe_cuda.fused_experts(x, ids, weights, gate_up, down, tiles)
    want = reference.grouped_experts(x, ids, weights, gate_up, down)
    assert_within(got, want, experts_bound(x, ids, weights, gate_up, down), "fused experts, 70 tokens")


def combine_operands(tokens: int, top_k: int, hidden: int, with_shared: bool, dtype: torch.dtype, seed: int):
    """Grouped-matmul outputs y [T*k, H] in a random order, their pair_rows, routing weights and a shared output."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(tokens * top_k, hidden, generator=gen).to(DEVICE, dtype)
    pair_rows = torch.randperm(tokens * top_k, generator=gen).to(DEVICE)
    weights = torch.rand(tokens, top_k, generator=gen).to(DEVICE)
    shared = ((torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype),
               torch.randn(tokens, 1, generator=gen).to(DEVICE, dtype)) if with_shared else None)
    return y, pair_rows, weights, shared


# bf16 on the GPU only: the interpreter's float32 -> bf16 conversion truncates instead of rounding
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("with_shared", [False, True])
@pytest.mark.parametrize("tokens,top_k,hidden", [(5, 1, 40), (70, 8, 1100), (3, 3, 1024)])
def test_combine_sums_each_tokens_pairs(tokens, top_k, hidden, with_shared, dtype):
    """The prefill path's sum of the grouped matmul's outputs (cuda.combine: each pair's row found through
    pair_rows, weighted, summed with the gated shared expert in float32, rounded once) and reference.combine,
    each against the exact sum; hidden 1100 is two column blocks, the second partial."""
    y, pair_rows, weights, shared = combine_operands(tokens, top_k, hidden, with_shared, dtype, tokens + hidden)
    exact, bound = combine_exact(y, pair_rows, weights, shared)
    assert_within(moe_cuda.combine(y, pair_rows, weights, shared), exact, bound, "cuda.combine")
    assert_within(reference.combine(y, pair_rows, weights, shared), exact, bound, "reference.combine")


def test_combine_rejects_a_strided_output_or_short_pair_rows():
    y, pair_rows, weights, _ = combine_operands(4, 2, 16, False, torch.float32, 0)
    with pytest.raises(ValueError, match="contiguous y and pair_rows"):
        moe_cuda.combine(y.t().contiguous().t(), pair_rows, weights)
    with pytest.raises(ValueError, match=r"pair_rows \[8\]"):
        moe_cuda.combine(y, pair_rows[:7], weights)


@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 7, 1), (33, 11, 8), (20, 5, 5), (40, 64, 8), (300, 37, 6)])
def test_align_groups_pairs_by_expert(tokens, experts, top_k, block_m):
    """sorted_pairs is the permutation sorted by (expert, pair); the blocks cover each expert's pairs in order,
    <= BLOCK_M each, and the rest of the table has 0 rows. (33, 11, 8): 9 programs of pairs; (40, 64, 8): several
    programs of blocks too (84 at BLOCK_M 16); (300, 37, 6): 1,800 pairs, 57 chunks of 32."""
    gen = torch.Generator().manual_seed(tokens + experts)
    ids, _ = random_routing(tokens, experts, top_k, gen)
    flat = ids.reshape(-1)
    pairs = flat.numel()
    sorted_pairs, table = moe_cuda.align(ids, experts, block_m)
    # the kernel's shape (align_probe's sweep) changes nothing: counted 64 or 128 pairs at a time (at least a pair a
    # thread) across program starts that the count does not divide, and programs placing several chunks each, the
    # last one short
    for chunk, warps, count, programs in ((16, 2, 1024, 64), (64, 8, 1024, 64), (16, 2, 64, 3), (32, 4, 128, 2)):
        other = moe_cuda.align(ids, experts, block_m, chunk=chunk, num_warps=warps, count=count,
                               pair_programs=programs)
        assert torch.equal(other[0], sorted_pairs) and torch.equal(other[1], table), (chunk, count, programs)
    assert table.shape == (3, moe_cuda.num_blocks(experts, tokens, top_k, block_m))
    want = sorted(range(pairs), key=lambda p: (int(flat[p]), p))
    assert sorted_pairs.tolist() == want
    covered = []
    for expert, first, rows in table.T.tolist():
        assert 0 <= rows <= block_m
        if rows:
            chunk = want[first:first + rows]
            assert all(int(flat[p]) == expert for p in chunk)
            covered += chunk
    assert covered == want  # in order, each pair once
    used = int((table[2] > 0).sum())
    assert table[2, used:].eq(0).all() and table[2, :used].gt(0).all()


def test_a_pair_does_not_depend_on_the_batch(monkeypatch):
    """Token 0 alone and inside a batch of 29 whose other tokens share its experts: bitwise the same output (the
    same tiles; its sum over k in its own order, by the combine kernel or, alone without a shared output, by kernel
    B's last slot; nothing depends on the other pairs of its expert's block)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(29, 40, generator=gen).to(DEVICE)
    gate_up, down = expert_weights(7, 40, 24, gen)
    ids, weights = random_routing(29, 7, 3, gen)
    ids[1:4] = ids[0]  # its experts, in the same and other slots, with other weights
    ids[4] = ids[0].flip(0)
    shared = (torch.randn(29, 40, generator=gen).to(DEVICE), torch.randn(29, 1, generator=gen).to(DEVICE))
    batch = moe_cuda.fused_experts(x, ids, weights, gate_up, down, SMALL, shared)
    alone = moe_cuda.fused_experts(x[:1], ids[:1], weights[:1], gate_up, down, SMALL, (shared[0][:1], shared[1][:1]))
    assert torch.equal(batch[:1], alone)
    # without a shared output, kernel B sums a lone token's slots itself (no combine launch): the same bits
    batch = moe_cuda.fused_experts(x, ids, weights, gate_up, down, SMALL)
    combines = []
    real_combine = moe_cuda._combine_kernel

    class CountedCombine:
        def __getitem__(self, grid):
            combines.append(grid)
            return real_combine[grid]

    monkeypatch.setattr(moe_cuda, "_combine_kernel", CountedCombine())
    assert torch.equal(batch[:1], moe_cuda.fused_experts(x[:1], ids[:1], weights[:1], gate_up, down, SMALL))
    assert combines == []
    # or, where the tiles say so, by the combine kernel after kernel B: the same bits again
    apart = moe_cuda.fused_experts(x[:1], ids[:1], weights[:1], gate_up, down, SMALL._replace(combine=False))
    assert len(combines) == 1 and torch.equal(batch[:1], apart)
    logits = torch.randn(29, 7, generator=gen).to(DEVICE)
    assert all(torch.equal(a[:1], b) for a, b in zip(moe_cuda.route(logits, 3, True), moe_cuda.route(logits[:1], 3, True)))


def test_fused_experts_reject_mismatched_shapes():
    x = torch.zeros(2, 40, device=DEVICE)
    gate_up, down = torch.zeros(7, 48, 40, device=DEVICE), torch.zeros(7, 40, 20, device=DEVICE)
    ids, weights = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE), torch.zeros(2, 2, device=DEVICE)
    with pytest.raises(ValueError, match="do not fit"):
        moe_cuda.fused_experts(x, ids, weights, gate_up, down, SMALL)


def test_tile_table_is_valid_and_checked(tmp_path, monkeypatch):
    shipped = json.loads(configs.CONFIGS_FILE.read_text())
    for key, entry in shipped.items():
        configs.check_entry("shipped", key, entry)
    for shape in ("256:8:2048:512", "256:8:3072:1024", "512:10:2048:512"):  # 35B-A3B, 122B-A10B, Qwen3-Next
        assert all(f"{shape}:{bucket}" in shipped for bucket in configs.ROW_BUCKETS), shape
    assert configs.tiles_for(7, 3, 40, 24, 5) == configs.default_tiles(5)
    assert [configs.row_bucket(r) for r in (64, 65, 512, 513, 8192, 20000)] == [64, 128, 512, 2048, 8192, 8192]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"7:3:40:24:3": configs.tiles_entry(SMALL)}))  # 3 is not a bucket
    monkeypatch.setenv(configs.ENV_VAR, str(bad))
    configs.tuned_table.cache_clear()
    try:
        with pytest.raises(ValueError, match="rows one of"):
            configs.tuned_table()
        bad.write_text(json.dumps({"7:3:40:24:4": {"block_m": 24, "gate_up": [16, 16, 4, 1], "down": [16, 16, 4, 1]}}))
        configs.tuned_table.cache_clear()
        with pytest.raises(ValueError, match="power of two"):
            configs.tuned_table()
        rows = {**configs.tiles_entry(ROWS)}
        fp8_rows = {**rows, "gate_up": [8, 128, 4, 1], "down": [8, 128, 4, 1]}  # whole FP8 scale blocks
        assert rows["gemv"] == 1 and "gemv" not in configs.tiles_entry(SMALL)
        for key, entry, message in (("7:3:40:24:2", rows, "only at rows 1"),  # the GEMV is one token's
                                    ("7:3:40:24:1", {**rows, "gemv": True}, "gemv must be 0 or 1"),
                                    ("fp8:7:3:40:24:1", {**fp8_rows, "down": [48, 128, 4, 1]}, "powers of two"),
                                    ("fp8:7:3:40:24:1", {**fp8_rows, "down": [256, 128, 4, 1]}, "divide the 128-row"),
                                    ("fp8:7:3:40:24:1", {**fp8_rows, "down": [8, 64, 4, 1]}, "whole 128-column"),
                                    ("7:3:40:24:1", {**rows, "gemv": 0}, "BLOCK_N >= 16"),  # tl.dot's least side
                                    # torch's grouped matmul: prompt chunks only; quantized formats' eager ones
                                    ("7:3:40:24:64", {**configs.tiles_entry(SMALL), "grouped": 1}, "grouped must"),
                                    ("int4:7:3:40:24:64", {**configs.tiles_entry(SMALL), "grouped": 1}, "grouped must"),
                                    ("int4:7:3:40:24:512", {**configs.tiles_entry(SMALL), "grouped": 1}, "grouped must"),
                                    ("int4:7:3:40:24:8192", {**configs.tiles_entry(SMALL), "grouped": 2},
                                     "grouped must"),
                                    # kernel A's K splits: one token on the tensor-core tiles only
                                    ("7:3:40:24:2", {**configs.tiles_entry(SMALL), "split_k": 2}, "split_k must"),
                                    ("7:3:40:24:1", {**rows, "split_k": 2}, "split_k must"),
                                    ("7:3:40:24:1", {**configs.tiles_entry(SMALL), "split_k": 0}, "split_k must"),
                                    # one token's launch choices: the tiles' bucket 1; quant_x FP8's only
                                    ("fp8:7:3:40:24:2", {**configs.tiles_entry(SMALL), "quant_x": 0}, "quant_x must"),
                                    ("7:3:40:24:1", {**configs.tiles_entry(SMALL), "quant_x": 0}, "quant_x must"),
                                    ("fp8:7:3:40:24:1", {**fp8_rows, "quant_x": 0}, "quant_x must"),
                                    ("fp8:7:3:40:24:1", {**configs.tiles_entry(SMALL), "quant_x": False},
                                     "quant_x must"),
                                    ("7:3:40:24:2", {**configs.tiles_entry(SMALL), "combine": 0}, "combine must"),
                                    ("7:3:40:24:1", {**rows, "combine": 0}, "combine must"),
                                    ("7:3:40:24:1", {**configs.tiles_entry(SMALL), "combine": 2}, "combine must")):
            bad.write_text(json.dumps({key: entry}))
            configs.tuned_table.cache_clear()
            with pytest.raises(ValueError, match=message):
                configs.tuned_table()
        grouped = SMALL._replace(grouped=True)
        assert configs.tiles_entry(grouped)["grouped"] == 1 and "grouped" not in configs.tiles_entry(SMALL)
        split = SMALL._replace(split_k=4)
        assert configs.tiles_entry(split)["split_k"] == 4 and "split_k" not in configs.tiles_entry(SMALL)
        launches = split._replace(quant_x=False, combine=False)
        assert configs.tiles_entry(launches) == {**configs.tiles_entry(split), "quant_x": 0, "combine": 0}
        assert not {"quant_x", "combine"} & set(configs.tiles_entry(SMALL))  # both on: the default, unwritten
        bad.write_text(json.dumps({"7:3:40:24:1": rows, "int4:7:3:40:24:8192": configs.tiles_entry(grouped),
                                   "fp8:7:3:40:24:1": configs.tiles_entry(launches),
                                   "7:3:40:24:512": configs.tiles_entry(SMALL),
                                   "7:3:40:24:8192": configs.tiles_entry(grouped)}))
        configs.tuned_table.cache_clear()
        # plain experts' prompt chunks take the tiles of a bucket the table names without "grouped"
        assert configs.prompt_tiles_tabled(7, 3, 40, 24, 300) and configs.tiles_for(7, 3, 40, 24, 300) == SMALL
        assert not configs.prompt_tiles_tabled(7, 3, 40, 24, 100)  # bucket 128: not named
        assert not configs.prompt_tiles_tabled(7, 3, 40, 24, 9000)  # bucket 8,192: torch's grouped matmul
        assert not configs.prompt_tiles_tabled(7, 2, 40, 24, 300)  # another shape
        assert configs.tiles_for(7, 3, 40, 24, 1) == ROWS and configs.tiles_for(7, 3, 40, 24, 1, "fp8") == launches
        assert configs.tiles_for(7, 3, 40, 24, 30000, "int4") == grouped  # the last bucket takes larger chunks
        assert not configs.tiles_for(7, 3, 40, 24, 2048, "int4").grouped
        # chunks up to the largest chunk graph (1,024 tokens) are captured: their buckets never take the groups
        assert configs.GROUPED_BUCKETS == (8192,)
    finally:
        configs.tuned_table.cache_clear()


def sparse_moe(shared_size: int, renormalize: bool, seed: int) -> SparseMoE:
    """A SparseMoE of odd sizes (hidden 40, 7 experts, top-3, intermediate 24) with random weights."""
    gen = torch.Generator().manual_seed(seed)
    block = SparseMoE(40, 7, 3, 24, shared_size, renormalize)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(0.3 * torch.randn(param.shape, generator=gen))
    block.to(DEVICE)  # before fuse(), as the loader does: the fused weights are plain attributes .to() does not move
    if block.shared_expert is not None:
        block.shared_expert.fuse()
    return block


@pytest.mark.parametrize("shared_size", [0, 20])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens", [1, 6, 17])
def test_sparse_moe_fused_path_matches_torch_path(monkeypatch, shared_size, renormalize, tokens):
    """The whole block, routing kernel and fused experts (forced on for the CPU's float32) against the torch
    path: the experts' bound, plus the routing weights' difference carried through M, plus the shared sum's."""
    block = sparse_moe(shared_size, renormalize, seed=tokens)
    x = torch.randn(tokens, 40, generator=torch.Generator().manual_seed(tokens + 1)).to(DEVICE)
    with torch.no_grad():
        want = block(x)
        logits = block.gate(x)
        ids, weights = reference.route(logits, 3, renormalize)
        monkeypatch.setattr(moe, "_route_on_gpu", lambda logits: True)
        monkeypatch.setattr(moe, "fused_serves", lambda *args: True)
        monkeypatch.setattr(moe, "tiles_for", lambda *shape: SMALL)
        got = block(x)
    assert torch.equal(moe_cuda.route(logits, 3, renormalize)[0].long(), ids)  # no near-ties in this data
    experts = block.experts
    magnitude, _ = experts_magnitude(x, ids, weights, experts.gate_up_proj, experts.down_proj)
    relative_w = (route_bound(logits, weights, 3, renormalize) / weights.double()).max().item()
    bound = experts_bound(x, ids, weights, experts.gate_up_proj, experts.down_proj) + relative_w * magnitude
    if shared_size:
        with torch.no_grad():
            bound = bound + shared_bound(block.shared_expert(x), block.shared_expert_gate(x), torch.float32)
        bound = bound + 2 * gamma(1, torch.float32) * (magnitude + want.double().abs())  # the final sum's rounding
    assert_within(got, want, bound, "SparseMoE fused vs torch")


def dyadic_block(seed: int, stand_in_shared: bool = False, shared_size: int = 20) -> SparseMoE:
    """sparse_moe's block with weights on a coarse dyadic grid (eighths), fused as the loader fuses it; with
    stand_in_shared, its shared gate_proj a subclass of nn.Linear, not plain to SparseMoE.fuse (as QuantLinear)."""
    class StandIn(nn.Linear):
        """Not a plain nn.Linear to SparseMoE.fuse."""

    block = sparse_moe(shared_size, True, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randint(-8, 9, param.shape, generator=gen) / 8)
    if stand_in_shared:
        block.shared_expert.gate_proj.__class__ = StandIn
    block.shared_expert.gate_up_weight = None
    block.fuse()
    block.shared_expert.fuse()
    return block


def joined_and_apart(block: SparseMoE, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's output on the fused path over x in halves (every product and sum exact in float32, so any
    blocking gives the same projections) with its joined weights, then with them unset (each linear apart)."""
    x = (torch.randint(-2, 3, (6, 40), generator=torch.Generator().manual_seed(0)) / 2).to(DEVICE)
    monkeypatch.setattr(moe, "_route_on_gpu", lambda logits: True)
    monkeypatch.setattr(moe, "fused_serves", lambda *args: True)
    monkeypatch.setattr(moe, "tiles_for", lambda *shape: SMALL)
    with torch.no_grad():
        joined = block(x)
        block.in_weight = block.router_weight = None
        return joined, block(x)


def test_fused_in_projection_equals_separate_projections(monkeypatch):
    """SparseMoE.fuse joins the router, the shared gate and the shared gate/up into one weight (the parameters its
    views), which every step multiplies once: the router block padded with zero rows to a multiple of
    JOIN_ROW_MULTIPLE (7 experts + the gate: 8 rows, then 8 zeros), the shared gate/up (40 rows, 8 zeros) after it;
    on the dyadic grid the block's output with it equals, bitwise, its output with the three separate ones."""
    block = dyadic_block(9)
    assert JOIN_ROW_MULTIPLE == 16 and block.router_weight.shape == (16, 40) and block.in_weight.shape == (64, 40)
    assert block.shared_expert.gate_up_weight.data_ptr() == block.in_weight[16:].data_ptr()  # a view, no copy
    assert block.gate.weight.data_ptr() == block.in_weight.data_ptr()
    assert block.shared_expert_gate.weight.data_ptr() == block.in_weight[7:].data_ptr()
    assert not block.in_weight[8:16].any() and not block.in_weight[56:].any()
    joined, apart = joined_and_apart(block, monkeypatch)
    assert torch.equal(joined, apart)


def test_router_and_shared_gate_join_beside_a_quantized_shared_expert(monkeypatch):
    """With a shared expert whose gate/up are not plain linears (a quantized checkpoint's), fuse joins only the
    router and the shared gate, into one weight of which both are views, padded with zero rows to
    JOIN_ROW_MULTIPLE; the output equals, bitwise, the output with the two apart."""
    block = dyadic_block(12, stand_in_shared=True)
    assert block.in_weight is None and block.router_weight.shape == (16, 40)
    assert block.gate.weight.data_ptr() == block.router_weight.data_ptr()  # views, no copy
    assert block.shared_expert_gate.weight.data_ptr() == block.router_weight[7:].data_ptr()
    assert not block.router_weight[8:].any()
    joined, apart = joined_and_apart(block, monkeypatch)
    assert torch.equal(joined, apart)


@pytest.mark.parametrize("stand_in_shared,slot", [(False, False), (True, False), (False, True)])
def test_the_norm_before_the_block_may_multiply_its_input_weight(monkeypatch, stand_in_shared, slot):
    """SparseMoE.input_weight is what forward multiplies x by first (router_weight where the shared expert runs as
    a slot (shared_slot) or is quantized, else in_weight), and forward given that product and the slot decision
    (`projected`, as the decoder layer's norm computes it in its own launch: ops.linear.rms_norm_and_linear) returns
    what it returns deciding and computing them itself, bitwise; a block without a joined weight has none."""
    from deltaserve.ops import linear as ops_linear

    # a shared expert runs as a slot at the routed experts' intermediate size (24)
    block = dyadic_block(13, stand_in_shared=stand_in_shared, shared_size=24 if slot else 20)
    x = (torch.randint(-2, 3, (1, 40), generator=torch.Generator().manual_seed(1)) / 2).to(DEVICE)
    monkeypatch.setattr(moe, "_route_on_gpu", lambda logits: True)
    monkeypatch.setattr(moe, "fused_serves", lambda *args: True)
    monkeypatch.setattr(moe, "tiles_for", lambda *shape: SMALL)
    monkeypatch.setattr(moe, "shared_slot_serves", lambda *args: slot)
    assert block.shared_slot(x) is slot
    weight = block.input_weight(slot)
    assert weight is (block.router_weight if slot or stand_in_shared else block.in_weight)
    with torch.no_grad():
        assert torch.equal(block(x, ops_linear.linear(x, weight), slot), block(x))
    plain = sparse_moe(0, True, seed=1)
    assert not plain.shared_slot(x) and plain.input_weight(False) is None


def test_warm_up_runs_every_bucket_where_the_fused_path_serves(monkeypatch):
    block = sparse_moe(20, True, seed=11)
    rows = []
    monkeypatch.setattr(moe, "experts", lambda x, *args: rows.append(x.shape[0]) or torch.zeros_like(x))
    block.warm_up_fused(8192)
    assert rows == []  # the CPU: the fused path does not serve, nothing runs
    monkeypatch.setattr(moe, "fused_serves", lambda *args: True)
    block.warm_up_fused(16384)  # the last bucket's tiles serve every larger chunk
    assert rows == [*configs.ROW_BUCKETS, 127, 128, 511, 512, 2047, 2048, 8191, 8192]  # chunks at an odd size too
    rows.clear()
    block.warm_up_fused(1000)  # up to the step's token budget: bucket 2048's tiles at its largest chunk
    assert rows == [*configs.ROW_BUCKETS, 127, 128, 511, 512, 1000]
    rows.clear()
    monkeypatch.setattr(moe, "fused_serves", lambda x, *args: x.shape[0] <= configs.FUSED_MAX_TOKENS)
    block.warm_up_fused(8192)  # plain experts: the decode buckets only
    assert rows == list(configs.ROW_BUCKETS)
    rows.clear()
    monkeypatch.setattr(moe, "fused_serves", lambda x, *args: x.shape[0] <= configs.FUSED_MAX_TOKENS or x.shape[0] > 2048)
    block.warm_up_fused(8192)  # plain experts with bucket 8,192 tabled: the decode buckets and that one
    assert rows == [*configs.ROW_BUCKETS, 8191, 8192]
