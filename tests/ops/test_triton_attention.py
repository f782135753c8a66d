"""Our Triton paged-attention kernels (`deltaserve.ops.attention.cuda`) against the reference ops, on CPU.

Triton's interpreter runs the kernels on CPU tensors with numpy, so CI checks their logic (block-table
gathers, causal offsets of cached prefixes, GQA grouping, split-KV merging in decode and prefill, the
per-sequence decode split count, the fused output gate, fp8 scales) on tiny odd shapes.
Speed and GPU races are for tests/gpu/test_attention_gpu.py.

The interpreter is chosen when a kernel is decorated, so TRITON_INTERPRET is set before the kernel modules
are imported; on a machine with CUDA this module is skipped rather than switching the whole test process to
the interpreter. The interpreter computes tl.dot on bf16 operands wrongly (numpy has no bf16) and truncates
float32 -> bf16 casts, so bf16 appears here only as a cache read in float32 dots, with bf16-exact values.
Its exp is numpy's, which differs from torch's CPU exp in the last float32 bit: the output gate is compared
bit for bit with torch in float16 (where those bits round away), and to float32 tolerances in float32.
"""

import math
import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("compiled kernels are tested by tests/gpu/test_attention_gpu.py", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

import triton
import triton.language as tl
from triton.runtime.errors import InterpreterError

from deltaserve.ops.attention import cuda as kernels
from deltaserve.ops.attention import cuda_decode, cuda_prefill, reference
from tests.ops.interpreter import patch_interpreter_index
from tests.tolerance import assert_within, attention_bound, both_sides, unit_roundoff

patch_interpreter_index()

NUM_HEADS, NUM_KV_HEADS = 6, 2  # GQA: 3 query heads per KV head
# (kv length, query length): full prefills, chunks over a cached prefix, decode rows, an empty query row.
MIXED = [(37, 37), (23, 5), (1, 1), (50, 1), (16, 16), (33, 1), (70, 4), (5, 0)]
DECODE = [(1, 1), (17, 1), (50, 1), (5, 0), (100, 1), (64, 1)]
# Short chunks over long cached prefixes (the split-KV prefill's target) beside a fresh prompt, a decode row
# and an empty query row.
LONG_PREFIX = [(300, 4), (9, 9), (170, 13), (77, 1), (5, 0), (260, 16)]
# Small tiles make the short test sequences span several query blocks, KV tiles and splits.
SMALL_TILES = cuda_prefill.TileConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)



SIGMOID_ROUNDINGS = 8  # the output gate: exp (within ~4 ulp), add, divide, the product; relative


def kernel_bound(batch, half: bool = False):
    """Kernel vs reference, both rounded: tests.tolerance.attention_bound per side, from the batch's q and cached
    K/V (the NaN outside the sequences left out). half: q and K are float16 already, the kernel rounds the
    probabilities to float16 for its dots (accumulated in float32) and its output is float16; the reference
    computes in float32 on the same values. A wrong mask,
    block or head shows up at 1e-2 or more."""
    k, v = (torch.nan_to_num(batch[name].float(), nan=0.0) for name in ("k_cache", "v_cache"))
    args = (batch["q"].float(), k, v, batch["scale"], int(batch["seq_lens"].max()), torch.float32)
    reference_side = attention_bound(*args)
    if not half:
        return both_sides(reference_side, reference_side)
    output_rounding = unit_roundoff(torch.float16) * v.abs().max().item()
    return both_sides(reference_side, attention_bound(*args, probabilities=torch.float16) + output_rounding)


@pytest.fixture
def small_tiles(monkeypatch):
    """16-row query tiles (5 tokens x 3 heads) and 16-position KV tiles, for every dot dtype; decode splits
    as short as one tile, so that the short test sequences use several."""
    monkeypatch.setattr(cuda_prefill, "PREFILL_TILES", {64: SMALL_TILES})
    monkeypatch.setattr(cuda_prefill, "PREFILL_TILES_FLOAT32", SMALL_TILES)
    small = cuda_decode.DecodeTile(16, 8, 2, 2)
    monkeypatch.setattr(cuda_decode, "DECODE_TILES", {2: small, 1: small})
    monkeypatch.setattr(cuda_decode, "DECODE_TILE_FLOAT32", small)
    monkeypatch.setattr(cuda_decode, "DECODE_MIN_TOKENS_PER_SPLIT", 16)


@triton.jit
def _cast_kernel(src, dst):
    offsets = tl.arange(0, 16)
    tl.store(dst + offsets, tl.load(src + offsets).to(dst.dtype.element_ty))


def interpreter_casts_to(dtype) -> bool:
    """Whether this Triton's interpreter can store `dtype` (older ones lack float8 casts)."""
    try:
        _cast_kernel[(1,)](torch.ones(16), torch.empty(16, dtype=dtype))
    except InterpreterError:
        return False
    return True


def make_batch(sequences, block_size, head_dim, cache_dtype=torch.float32, q_dtype=torch.float32, seed=0,
               num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS):
    """Random q and a paged cache holding each sequence's K/V in shuffled blocks; every slot outside the
    sequences stays NaN, so a kernel that reads one poisons its output. Returns the paged_attention args."""
    gen = torch.Generator().manual_seed(seed)
    kv_lens = [kv for kv, _ in sequences]
    q_lens = [ql for _, ql in sequences]
    blocks_per_seq = [-(-kv // block_size) for kv in kv_lens]
    num_blocks = sum(blocks_per_seq) + 2
    free = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(sequences), max(blocks_per_seq) + 1, dtype=torch.int32)
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan")).to(cache_dtype)
    v_cache = k_cache.clone()
    for seq, (kv_len, count) in enumerate(zip(kv_lens, blocks_per_seq)):
        block_tables[seq, :count] = torch.tensor([free.pop() for _ in range(count)], dtype=torch.int32)
        positions = torch.arange(kv_len)
        slots = block_tables[seq, positions // block_size].long() * block_size + positions % block_size
        keys, values = torch.randn(2, kv_len, num_kv_heads, head_dim, generator=gen)
        reference.write_kv_cache(keys, values, k_cache, v_cache, slots)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(q_dtype)
    cu_seqlens_q = torch.zeros(len(sequences) + 1, dtype=torch.int64)
    cu_seqlens_q[1:] = torch.tensor(q_lens).cumsum(0)
    return {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables, "cu_seqlens_q": cu_seqlens_q,
                "seq_lens": torch.tensor(kv_lens), "scale": head_dim**-0.5}


@pytest.mark.parametrize("head_dim,block_size,tiles", [
    (16, 16, "small"), (16, 1, "small"), (32, 32, "small"), (32, 16, "default"),
])
def test_prefill_kernel_matches_reference(request, head_dim, block_size, tiles):
    if tiles == "small":
        request.getfixturevalue("small_tiles")
    batch = make_batch(MIXED, block_size, head_dim, seed=head_dim + block_size)
    expected = reference.paged_attention(**batch)
    actual = kernels.paged_attention(**batch, max_query_len=37)
    assert_within(actual, expected, kernel_bound(batch))


@pytest.mark.parametrize("num_splits", [1, 3, 8, None])
def test_decode_kernel_matches_reference(small_tiles, num_splits):
    """Splits of 16-position tiles: 8 splits leave most of them empty for short sequences."""
    batch = make_batch(DECODE, block_size=16, head_dim=16, seed=num_splits or 0)
    expected = reference.paged_attention(**batch)
    actual = kernels.paged_attention(**batch, max_query_len=1, num_splits=num_splits)
    assert_within(actual, expected, kernel_bound(batch))


class NanEmpty:
    """Stands in for the torch module inside cuda_decode: empty() gives NaN-filled tensors and keeps them, so
    a test sees which partials the kernels wrote, and a merge that read an unwritten one would output NaN."""

    def __init__(self):
        self.made = []

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, *shape, **kwargs):
        if len(shape) == 1 and not isinstance(shape[0], int):  # empty(size) as well as empty(*sizes)
            shape = tuple(shape[0])
        self.made.append(torch.full(shape, float("nan"), **kwargs))
        return self.made[-1]


def active_splits(seq_len: int, num_splits: int, block_n: int) -> int:
    """The decode rule: shares of max(DECODE_ACTIVE_SPLIT_MIN_TOKENS, cdiv(seq_len, num_splits)) positions,
    rounded up to whole tiles; as many as seq_len needs."""
    share = max(cuda_decode.DECODE_ACTIVE_SPLIT_MIN_TOKENS, -(-seq_len // num_splits))
    share = -(-share // block_n) * block_n
    return -(-seq_len // share)


# Decode lengths around the minimum share (64 positions) and longer; (0, 1) is a query over an empty sequence (a padding
# row of a CUDA graph), which the reference refuses: it gets zeros. (5, 0) has no query.
DECODE_SPANS = [(1, 1), (17, 1), (63, 1), (64, 1), (65, 1), (700, 1), (1000, 1), (5, 0), (0, 1)]


@pytest.mark.parametrize("num_splits,active_at_1000", [(66, 16), (3, 3)])
def test_decode_splits_follow_each_sequence_length(monkeypatch, num_splits, active_at_1000):
    """num_splits as planned for a 140K-token table (66: 1,000 tokens take 16 shares of 64) or small (3: shares
    of 336 there) over short sequences: each sequence's active splits write partials, the others write
    nothing, and the merge reads only the active ones (unwritten partials are NaN here)."""
    fake_torch = NanEmpty()
    monkeypatch.setattr(cuda_decode, "torch", fake_torch)
    batch = make_batch(DECODE_SPANS, block_size=16, head_dim=16, seed=num_splits)
    actual = kernels.paged_attention(**batch, max_query_len=1, num_splits=num_splits)

    _, partial_lse = fake_torch.made  # [N, n_heads, num_splits]
    block_n = cuda_decode.DECODE_TILE_FLOAT32.block_n
    for seq, (kv_len, q_len) in enumerate(DECODE_SPANS):
        active = active_splits(kv_len, num_splits, block_n) if q_len else 0
        assert not partial_lse[seq, :, :active].isnan().any(), (seq, active)
        assert partial_lse[seq, :, active:].isnan().all(), (seq, active)
    assert active_splits(1000, num_splits, block_n) == active_at_1000
    assert torch.equal(actual[-1], torch.zeros_like(actual[-1]))  # the empty sequence's query
    # The reference without that query: the last sequence's q_len becomes 0.
    without_empty = dict(batch, q=batch["q"][:-1], cu_seqlens_q=batch["cu_seqlens_q"].clamp(max=actual.shape[0] - 1))
    assert_within(actual[:-1], reference.paged_attention(**without_empty), kernel_bound(batch))


# Sequences that one split of 64+ positions covers whole, so that any num_splits leaves them one active split.
ONE_SHARE = [(1, 1), (17, 1), (50, 1), (5, 0), (64, 1), (0, 1)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("gated", [False, True])
def test_one_split_writes_the_output_without_a_merge(monkeypatch, dtype, gated):
    """num_splits 1: the decode kernel writes the (gated) output itself, no partials are allocated (so no merge
    runs), and it equals bit for bit a grid of 2 splits whose second split is idle (one split, then the merge),
    the empty sequence's query included (zeros)."""
    batch = make_batch(ONE_SHARE, block_size=16, head_dim=16, cache_dtype=dtype, q_dtype=dtype, seed=5)
    gate = make_gate(batch["q"], seed=6) if gated else None
    merged = kernels.paged_attention(**batch, max_query_len=1, num_splits=2, gate=gate)
    decode_torch = NanEmpty()
    monkeypatch.setattr(cuda_decode, "torch", decode_torch)
    monkeypatch.setattr(kernels, "torch", NanEmpty())  # the output starts as NaN: every row must be written
    direct = kernels.paged_attention(**batch, max_query_len=1, num_splits=1, gate=gate)
    assert decode_torch.made == []
    assert torch.equal(direct, merged)
    assert torch.equal(direct[-1], torch.zeros_like(direct[-1]))
    without_empty = dict(batch, q=batch["q"][:-1], cu_seqlens_q=batch["cu_seqlens_q"].clamp(max=direct.shape[0] - 1))
    expected = reference.paged_attention(**without_empty, gate=None if gate is None else gate[:-1])
    bound = kernel_bound(batch, half=dtype == torch.float16)
    if gated:  # times sigmoid(gate) <= 1, with a few more roundings (exp, add, divide, product) per side
        bound += 2 * SIGMOID_ROUNDINGS * unit_roundoff(dtype) * expected.double().abs()
    assert_within(direct[:-1], expected, bound)


def test_attention_warm_up_launches_the_one_split_decode_kernel(monkeypatch):
    """`GatedAttention.warm_up_one_split_decode` (run at start-up, so that serving never compiles that variant)
    plans one split over a wide cache, launches no merge, and leaves the cache as it was."""
    from deltaserve.layers import attention as attention_layer
    from deltaserve.layers.attention import GatedAttention
    from deltaserve.layers.rotary import PartialRotary

    layer = GatedAttention(32, 4, 2, 16, PartialRotary(16, 8, 10000.0, 64), 1e-6)
    layer.fuse()
    layer.k_cache = torch.randn(64, 16, 2, 16)  # [blocks, block size, KV heads, hd]: a table of 64 could split
    layer.v_cache = torch.randn(64, 16, 2, 16)
    caches = layer.k_cache.clone(), layer.v_cache.clone()
    planned, launch = [], kernels.launch_decode
    monkeypatch.setattr(kernels, "launch_decode", lambda *args, **kwargs: planned.append(
        cuda_decode.decode_num_splits(args[4].shape[0], args[1].shape[2], args[4].shape[1] * args[1].shape[1],
                                      args[0].device, cuda_decode.DECODE_TILE_FLOAT32.resident_per_sm))
        or launch(*args, **kwargs))
    monkeypatch.setattr(cuda_decode, "merge_splits_kernel", None)  # launching a merge would raise
    monkeypatch.setattr(attention_layer, "paged_attention", kernels.paged_attention)  # the Triton path on the CPU
    layer.warm_up_one_split_decode()
    assert planned == [1]
    assert torch.equal(layer.k_cache, caches[0]) and torch.equal(layer.v_cache, caches[1])


def make_gate(q, seed):
    """A gate shaped like q, sliced as the layer slices it from the [T, n_heads, 2 * hd] q|gate projection."""
    num_tokens, num_heads, head_dim = q.shape
    gen = torch.Generator().manual_seed(seed)
    wide = (2 * torch.randn(num_tokens, num_heads, 2 * head_dim, generator=gen)).to(q.dtype)
    return wide[..., head_dim:]  # token stride 2 * n_heads * hd, head stride 2 * hd


# The gate's three epilogues: the decode merge, the split prefill merge and the unsplit prefill store.
GATE_PATHS = {
    "decode": (DECODE, {"max_query_len": 1, "num_splits": 3}),
    "split prefill": (LONG_PREFIX, {"max_query_len": 16, "num_splits": 3}),
    "prefill": (MIXED, {"max_query_len": 37, "num_splits": 1}),
}


@pytest.mark.parametrize("path", GATE_PATHS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_output_gate_in_every_epilogue(small_tiles, path, dtype):
    """gate= gives exactly torch's `o * torch.sigmoid(gate)` on the ungated output in float16 (o and the
    sigmoid each rounded to float16, then their product); float32 differs from torch only through numpy's
    exp (see the module docstring). Against the gated reference: the ungated tolerances."""
    sequences, options = GATE_PATHS[path]
    batch = make_batch(sequences, block_size=16, head_dim=16, cache_dtype=dtype, q_dtype=dtype, seed=11)
    gate = make_gate(batch["q"], seed=12)
    gated = kernels.paged_attention(**batch, **options, gate=gate)
    torch_gated = kernels.paged_attention(**batch, **options) * torch.sigmoid(gate)
    expected = reference.paged_attention(**batch, gate=gate)
    gate_rounding = 2 * SIGMOID_ROUNDINGS * unit_roundoff(dtype) * expected.double().abs()
    if dtype == torch.float16:
        assert torch.equal(gated, torch_gated)
    else:  # numpy's exp vs torch's: the sigmoid's roundings on both sides
        assert_within(gated, torch_gated, gate_rounding, "gate vs torch")
    assert_within(gated, expected, kernel_bound(batch, half=dtype == torch.float16) + gate_rounding, "gated")


@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("num_splits", [2, 3, 16])
def test_split_kv_prefill_matches_reference(small_tiles, block_size, num_splits):
    """Each query block's visible positions cut into num_splits shares of whole 16-position tiles: shares
    that end inside the causal tail, lie wholly above a row's position, or past the end (16 splits of a
    9-token prompt), merged per (token, head)."""
    batch = make_batch(LONG_PREFIX, block_size, head_dim=16, seed=num_splits + block_size)
    actual = kernels.paged_attention(**batch, max_query_len=16, num_splits=num_splits)
    assert_within(actual, reference.paged_attention(**batch), kernel_bound(batch))


@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(4, 4, 7), (8, 1, 16), (6, 2, 1)])
def test_split_kv_prefill_gqa_groups(small_tiles, num_heads, num_kv_heads, block_size):
    """Groups of 1, 8 and 3 query heads per KV head: 16, 2 and 5 tokens per 16-row query tile."""
    batch = make_batch([(130, 7), (40, 40), (66, 2)], block_size, head_dim=32, seed=num_heads,
                       num_heads=num_heads, num_kv_heads=num_kv_heads)
    actual = kernels.paged_attention(**batch, num_splits=4)
    assert_within(actual, reference.paged_attention(**batch), kernel_bound(batch))


def test_short_chunk_over_long_prefix_splits_by_default(monkeypatch):
    """A 3-token chunk after 597 cached tokens is one query block per KV head (2 programs, the CPU stand-in
    counts 4 SMs): the planner splits it over the 624-position block table, and the result is unchanged."""
    planned, programs = [], []
    plan = cuda_prefill.prefill_num_splits

    def recording_plan(*args):
        programs.append(args[0])
        planned.append(plan(*args))
        return planned[-1]

    monkeypatch.setattr(cuda_prefill, "prefill_num_splits", recording_plan)
    batch = make_batch([(600, 3)], block_size=16, head_dim=16, seed=2)
    actual = kernels.paged_attention(**batch, max_query_len=3)
    assert planned == [2]  # one wave of the 4 SMs; 624 positions would hold 3 shares of 256
    group = NUM_HEADS // NUM_KV_HEADS  # the unsplit grid as the probes count it (attention_probe's split sweep)
    tiles = cuda_prefill.prefill_tiles(16, group, float32_dots=True)
    assert programs == [NUM_KV_HEADS * cuda_prefill.prefill_query_blocks(3, 1, group, tiles)] == [2]
    assert_within(actual, reference.paged_attention(**batch), kernel_bound(batch))


def test_decode_rows_through_prefill_kernel(small_tiles):
    """max_query_len unknown (None): decode rows take the prefill kernel and give the same result."""
    batch = make_batch(DECODE, block_size=8, head_dim=16, seed=5)
    assert_within(kernels.paged_attention(**batch), reference.paged_attention(**batch), kernel_bound(batch))


@pytest.mark.parametrize("cache_dtype,q_dtype", [
    # bf16 cache, float32 q: the dots run in float32 on bf16-exact values, as precise as all-float32.
    (torch.bfloat16, torch.float32),
    # float16 throughout: q, K and the probabilities enter the dots in float16 (2^-11 relative each).
    (torch.float16, torch.float16),
])
@pytest.mark.parametrize("max_query_len", [1, None])
def test_half_precision_caches(small_tiles, cache_dtype, q_dtype, max_query_len):
    batch = make_batch(DECODE, block_size=16, head_dim=16, cache_dtype=cache_dtype, q_dtype=q_dtype, seed=9)
    actual = kernels.paged_attention(**batch, max_query_len=max_query_len, num_splits=2)
    assert actual.dtype == q_dtype
    assert_within(actual, reference.paged_attention(**batch), kernel_bound(batch, half=q_dtype == torch.float16))


def test_float16_with_default_tiles():
    """The half-precision tile table (BLOCK_M 128: 42 tokens x 3 heads per program) on the mixed batch."""
    batch = make_batch(MIXED, 16, 32, cache_dtype=torch.float16, q_dtype=torch.float16, seed=4)
    actual = kernels.paged_attention(**batch)
    assert_within(actual, reference.paged_attention(**batch), kernel_bound(batch, half=True))


def test_empty_batch_returns_empty_output():
    batch = make_batch([(4, 0)], block_size=16, head_dim=16)
    assert kernels.paged_attention(**batch).shape == (0, NUM_HEADS, 16)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_cache_matches_reference(cache_dtype):
    """Bit-identical caches; values are bf16-exact (the interpreter truncates where the GPU rounds). k is a
    strided view, as in the layer where it is sliced from a wider projection."""
    gen = torch.Generator().manual_seed(1)
    num_tokens, head_dim = 9, 16
    wide = torch.randn(num_tokens, NUM_KV_HEADS, 2 * head_dim, generator=gen).bfloat16().float()
    k = wide[..., :head_dim]  # [T, n_kv, hd], token stride 2 * n_kv * hd
    v = torch.randn(num_tokens, NUM_KV_HEADS, head_dim, generator=gen).bfloat16().float()
    slot_mapping = torch.tensor([5, 0, -1, 17, 31, 2, -1, 20, 9])  # -1: padding, must write nothing
    caches = [torch.full((4, 8, NUM_KV_HEADS, head_dim), float("nan")).to(cache_dtype) for _ in range(4)]
    reference.write_kv_cache(k, v, caches[0], caches[1], slot_mapping)
    kernels.write_kv_cache(k, v, caches[2], caches[3], slot_mapping)
    torch.testing.assert_close(caches[2], caches[0], atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(caches[3], caches[1], atol=0, rtol=0, equal_nan=True)


def test_fp8_cache_round_trip_with_scales():
    """An fp8 cache stores x / scale (saturating at 448) and attention multiplies the scales back in."""
    k_scale, v_scale = 0.5, 0.25  # powers of two: x / scale of an fp8-exact x is fp8-exact
    gen = torch.Generator().manual_seed(3)
    fp8 = torch.float8_e4m3fn
    num_tokens, head_dim = 40, 16
    k = torch.randn(num_tokens, NUM_KV_HEADS, head_dim, generator=gen).to(fp8).float() * k_scale
    v = torch.randn(num_tokens, NUM_KV_HEADS, head_dim, generator=gen).to(fp8).float() * v_scale
    k[0, 0, 0] = 1000.0  # 2000 after the scale: saturates to 448
    k_cache = torch.zeros(3, 16, NUM_KV_HEADS, head_dim, dtype=fp8)
    v_cache = torch.zeros_like(k_cache)
    if not interpreter_casts_to(fp8):
        pytest.skip("this Triton's interpreter has no float8 casts")
    kernels.write_kv_cache(k, v, k_cache, v_cache, torch.arange(num_tokens), k_scale=k_scale, v_scale=v_scale)
    assert k_cache[0, 0, 0, 0].float() == 448.0
    k[0, 0, 0] = 448.0 * k_scale
    assert torch.equal(k_cache.flatten(0, 1)[:num_tokens].float(), k / k_scale)
    assert torch.equal(v_cache.flatten(0, 1)[:num_tokens].float(), v / v_scale)

    q = torch.randn(2, NUM_HEADS, head_dim, generator=gen)
    args = {"q": q, "block_tables": torch.tensor([[0, 1, 2]], dtype=torch.int32),
                "cu_seqlens_q": torch.tensor([0, 2]), "seq_lens": torch.tensor([num_tokens]), "scale": 0.25}
    expected = reference.paged_attention(k_cache=k_cache.float() * k_scale, v_cache=v_cache.float() * v_scale,
                                         **args)
    for max_query_len, num_splits in ((2, None), (2, 3), (None, None)):
        actual = kernels.paged_attention(k_cache=k_cache, v_cache=v_cache, **args, max_query_len=max_query_len,
                                         k_scale=k_scale, v_scale=v_scale, num_splits=num_splits)
        assert_within(actual, expected, kernel_bound(dict(args, k_cache=k, v_cache=v)))
    decode_args = dict(args, q=q[:1], cu_seqlens_q=torch.tensor([0, 1]))
    expected = reference.paged_attention(k_cache=k_cache.float() * k_scale, v_cache=v_cache.float() * v_scale,
                                         **decode_args)
    actual = kernels.paged_attention(k_cache=k_cache, v_cache=v_cache, **decode_args, max_query_len=1,
                                     num_splits=2, k_scale=k_scale, v_scale=v_scale)
    assert_within(actual, expected, kernel_bound(dict(decode_args, k_cache=k, v_cache=v)))


def test_bf16_decode_over_fp8_cache_dots_in_float16_and_saturates_q(small_tiles):
    """bf16 queries over an fp8 cache decode with float16 dots (the cheaper upcast): the result matches the
    float32 reference within float16 rounding of q and of the probabilities, and a query beyond float16's
    range saturates instead of turning the output into NaN."""
    fp8 = torch.float8_e4m3fn
    if not interpreter_casts_to(fp8):
        pytest.skip("this Triton's interpreter has no float8 casts")
    batch = make_batch([(37, 1), (64, 1), (5, 1)], block_size=16, head_dim=16, cache_dtype=fp8,
                       q_dtype=torch.bfloat16, seed=5)
    expected = reference.paged_attention(**dict(batch, q=batch["q"].float(), k_cache=batch["k_cache"].float(),
                                                v_cache=batch["v_cache"].float()))
    actual = kernels.paged_attention(**batch, max_query_len=1, num_splits=2)
    assert actual.dtype == torch.bfloat16
    torch.testing.assert_close(actual.float(), expected, atol=1e-2, rtol=1e-2)
    huge = dict(batch, q=batch["q"].clone())
    huge["q"][0, 0, 0] = 1e6  # bf16 holds it, float16 does not
    assert torch.isfinite(kernels.paged_attention(**huge, max_query_len=1, num_splits=2).float()).all()


@pytest.mark.parametrize("v_scale", [0.0123, 0.25, 1.0, 300.0, 1e-9])
def test_v_scale_splits_into_an_exact_tile_power_of_two_and_the_output_rest(v_scale):
    tile, rest = cuda_prefill.split_v_scale(v_scale, eight_bit_cache=True)
    assert math.log2(tile).is_integer() and 2.0**-14 <= tile <= 1.0  # e4m3 x tile: exact in float16 and bf16
    assert tile * rest == v_scale
    assert cuda_prefill.split_v_scale(v_scale, eight_bit_cache=False) == (1.0, v_scale)


@pytest.mark.parametrize("max_query_len,num_splits", [(1, None), (1, 3), (3, None), (3, 3)])
@pytest.mark.parametrize("v_scale", [0.0123, 300.0])
def test_fp8_v_scale_with_float16_dots(small_tiles, max_query_len, num_splits, v_scale):
    """float16 dots over an fp8 cache multiply the V tiles by part of v_scale and the output by the rest, on
    every path (decode and prefill, split or not): the output is the reference's, with no scale lost, doubled
    or rounded (their least-squares ratio within float16 rounding), and a large scale does not overflow
    float16 (300 x 448 would)."""
    fp8 = torch.float8_e4m3fn
    if not interpreter_casts_to(fp8):
        pytest.skip("this Triton's interpreter has no float8 casts")
    batch = make_batch([(37, max_query_len), (64, max_query_len), (20, max_query_len)], block_size=16,
                       head_dim=16, cache_dtype=fp8, q_dtype=torch.float16, seed=6)
    expected = reference.paged_attention(**dict(batch, q=batch["q"].float(), k_cache=batch["k_cache"].float(),
                                                v_cache=batch["v_cache"].float() * v_scale))
    actual = kernels.paged_attention(**batch, max_query_len=max_query_len, v_scale=v_scale,
                                     num_splits=num_splits).float()
    torch.testing.assert_close(actual, expected, atol=1e-2 * v_scale, rtol=1e-2)
    ratio = (actual * expected).sum() / (expected * expected).sum()
    assert abs(ratio.item() - 1) < 1e-4, ratio.item()


def test_num_splits_fill_the_device_from_static_sizes(monkeypatch):
    monkeypatch.setattr(cuda_decode, "sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    # One sequence, 4 KV heads, 256K capacity: one wave of 2 (bf16 tile) or 3 (fp8) programs per SM.
    assert cuda_decode.decode_num_splits(1, 4, 262144, cpu, resident_per_sm=2) == 66
    assert cuda_decode.decode_num_splits(1, 4, 262144, cpu, resident_per_sm=3) == 99
    # Rounded down to stay within one wave: 32 x 4 programs a split, 264 slots -> 2 splits (3 would be 384).
    assert cuda_decode.decode_num_splits(32, 4, 262144, cpu, resident_per_sm=2) == 2
    # A short block table caps the splits at one per 256 positions; a full batch needs none.
    assert cuda_decode.decode_num_splits(1, 4, 1024, cpu, resident_per_sm=2) == 4
    assert cuda_decode.decode_num_splits(64, 4, 262144, cpu, resident_per_sm=2) == 1
    assert cuda_decode.decode_num_splits(256, 4, 262144, cpu, resident_per_sm=2) == 1


def test_step_sized_arguments_compile_no_new_variants():
    """Arguments that change from step to step (batch and block-table sizes, split counts) must not be
    specialized on (== 1, divisible by 16): each new class would compile a variant in the middle of serving.
    (The GPU test `test_serving_compiles_no_kernel_after_start_up` finds such arguments; this keeps them fixed.)"""
    from deltaserve.ops.conv1d import cuda as conv_cuda
    from deltaserve.ops.gdn import cuda as gdn_cuda
    from deltaserve.ops.norm import cuda as norm_cuda

    for kernel, names in ((cuda_decode._decode_split_kernel, {"num_splits", "stride_table"}),
                          (cuda_prefill._prefill_kernel, {"num_seqs", "num_splits", "stride_table"}),
                          (conv_cuda._conv_prefill_kernel, {"num_tokens", "num_seqs", "search_steps"}),
                          (norm_cuda._gated_rms_norm_kernel, {"num_rows"}),
                          (gdn_cuda._l2norm_kernel, {"num_rows"})):
        # a JITFunction lists its parameters; the interpreter's stand-in keeps the decorator's arguments
        unspecialized = ({param.name for param in kernel.params if param.do_not_specialize}
                         if hasattr(kernel, "params") else set(kernel.kwargs.get("do_not_specialize", ())))
        assert names <= unspecialized, kernel.fn.__name__


def test_prefill_splits_only_small_grids_over_wide_tables(monkeypatch):
    monkeypatch.setattr(cuda_prefill, "sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    # 16 tokens after 36,864 cached at 27B shapes: 1 query block x 4 KV heads, split into one full wave.
    assert cuda_prefill.prefill_num_splits(4, 36880, cpu) == 33
    assert cuda_prefill.prefill_num_splits(16, 36880, cpu) == 8
    # More programs: whole waves, not a barely begun last one (52 x 6 = 312 is 2.4 waves of 132).
    assert cuda_prefill.prefill_num_splits(52, 37120, cpu) == 5
    assert cuda_prefill.prefill_num_splits(100, 36880, cpu) == 9
    # A narrow table (a fresh short prompt) or a grid of a full wave is not split.
    assert cuda_prefill.prefill_num_splits(4, 256, cpu) == 1
    assert cuda_prefill.prefill_num_splits(132, 262144, cpu) == 1
    assert cuda_prefill.prefill_num_splits(1, 1 << 20, cpu) == cuda_prefill.PREFILL_MAX_SPLITS


@pytest.mark.parametrize("change,message", [
    ({"k_cache": torch.zeros(3, 16, NUM_KV_HEADS, 16, dtype=torch.int8)}, "k_cache"),
    ({"v_cache": torch.zeros(3, 16, NUM_KV_HEADS, 16, dtype=torch.float16)}, "v_cache"),
    ({"k_cache": torch.zeros(3, 16, NUM_KV_HEADS, 32)[..., ::2]}, "strides"),
    ({"cu_seqlens_q": torch.tensor([0, 2])}, "cu_seqlens_q"),
    ({"max_query_len": -1}, "max_query_len"),
    ({"num_splits": 0}, "num_splits"),
    ({"k_scale": 0.0}, "k_scale"),
    ({"q": torch.zeros(3, NUM_HEADS, 16, dtype=torch.float64)}, "q has dtype"),
    ({"gate": torch.zeros(3, NUM_HEADS, 8)}, "gate must be"),
    ({"gate": torch.zeros(3, NUM_HEADS, 16, dtype=torch.float16)}, "gate must have dtype"),
])
def test_bad_arguments_raise_value_error(change, message):
    batch = make_batch([(20, 2), (9, 1)], block_size=16, head_dim=16)
    # Keep 3 blocks, the size of the replacement caches above.
    batch["v_cache"] = batch["v_cache"][:3]
    batch["k_cache"] = batch["k_cache"][:3]
    with pytest.raises(ValueError, match=message):
        kernels.paged_attention(**{**batch, **change})


def test_write_kv_cache_rejects_float_slots():
    k = torch.zeros(2, NUM_KV_HEADS, 16)
    cache = torch.zeros(1, 16, NUM_KV_HEADS, 16)
    with pytest.raises(ValueError, match="slot_mapping"):
        kernels.write_kv_cache(k, k, cache, cache.clone(), torch.tensor([0.0, 1.0]))


@pytest.mark.parametrize("product", ["fp8", "int4", "nvfp4"])
def test_decode_merge_writes_the_output_projections_input(product):
    """Asked for what the output projection's product reads (quant_block: FP8's scale block; dp4a: an int4 /
    NVFP4 one-row GEMV's fixed-point parts), the decode merge writes it from the gated rows it would store: the
    codes and scales cuda_fp8.quantize makes of the plain output, or that output's row with the parts
    cuda_gemv.x_parts makes of it, bit for bit (head size 32: two FP8 blocks of 16 a head, one int4 group of 32,
    two NVFP4 groups of 16). One split (no merge) returns the plain output. float16: the quantizations read the
    16-bit rows."""
    from deltaserve.ops.quant_gemm import cuda_fp8, cuda_gemv
    from deltaserve.ops.quant_gemm.reference import Dp4aActivation, Fp8Activation

    dtype = torch.float16
    one_row = product != "fp8"  # the dp4a GEMVs take one row
    batch = make_batch([(50, 1)] if one_row else DECODE, block_size=16, head_dim=32, cache_dtype=dtype,
                       q_dtype=dtype, seed=len(product))
    gate = make_gate(batch["q"], seed=7)
    asked = {"fp8": dict(quant_block=16), "int4": dict(dp4a=(32, False)), "nvfp4": dict(dp4a=(16, True))}[product]
    plain = kernels.paged_attention(**batch, max_query_len=1, num_splits=3, gate=gate)
    rows = plain.reshape(plain.shape[0], -1)  # [T, n_heads * hd]
    got = kernels.paged_attention(**batch, max_query_len=1, num_splits=3, gate=gate, **asked)
    if product == "fp8":
        assert isinstance(got, Fp8Activation) and got.block_k == 16 and got.dtype == dtype
        xq, sx = cuda_fp8.quantize(rows, 16)
        assert torch.equal(got.xq.view(torch.uint8), xq.view(torch.uint8)) and torch.equal(got.sx, sx)
    else:
        group, low_high = asked["dp4a"]
        assert isinstance(got, Dp4aActivation) and (got.group, got.low_high) == (group, low_high)
        assert torch.equal(got.x, rows)
        for mine, theirs in zip((got.parts, got.x_scale, got.v_sum), cuda_gemv.x_parts(rows, group, low_high, {})):
            assert torch.equal(mine, theirs)
    direct = kernels.paged_attention(**batch, max_query_len=1, num_splits=1, gate=gate, **asked)
    assert isinstance(direct, torch.Tensor)
    assert torch.equal(direct, kernels.paged_attention(**batch, max_query_len=1, num_splits=1, gate=gate))
