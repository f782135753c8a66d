"""The log-sum-exp merge that joins attention computed over separate parts of the keys (GPU long-chunk path).
The merge kernels are Triton's: on the GPU when there is one, else in Triton's CPU interpreter."""

import math

import torch

from deltaserve.ops.attention import cuda_sdpa as cuda_attention
from deltaserve.ops.attention.cuda import attention_output_gate
from deltaserve.ops.attention.cuda_sdpa import merge_attention_output, merge_attention_part
from tests.ops.interpreter import use_math_cudnn
from tests.tolerance import assert_within, attention_bound, both_sides, gamma, unit_roundoff

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MERGE_ROUNDINGS = 6  # per part: the lse difference, exp, the weighted add, the final divide


def merge_bound(values: torch.Tensor, lse: torch.Tensor, parts: int) -> float:
    """Bound of the float32 merge of `parts` float32-rounded partial attentions: each part's output rounded
    (u max |v|); its log-sum-exp rounded, and the exp argument lse_i - lse rounded again (a GPU's exp2 of it
    times log2 e), each an absolute u 2 max |lse| that becomes a relative error of the part's weight: 4 u max
    |lse| in l1 over weights summing to 1; and the merge's own roundings."""
    u = unit_roundoff(torch.float32)
    return values.double().abs().max().item() * (u + 4 * u * lse.double().abs().max().item()
                                                  + gamma(parts * MERGE_ROUNDINGS, torch.float32))


def paths_bound(q, k, v, scale, kv_len, parts, half=None):
    """A path (parts merged; in `half`, a matmul storing scores, probabilities and the output in it) against
    the float32 oracle on the same values."""
    oracle_side = attention_bound(q, k, v, scale, kv_len, torch.float32)
    # on the GPU cuBLAS may also reduce split-K partials in bf16: one more rounding of scores and outputs,
    # covered as roundings of the operands
    operands = half if DEVICE == "cuda" else None
    path_side = attention_bound(q, k, v, scale, kv_len, torch.float32, operands, probabilities=half, scores=half)
    path_side += merge_bound(v, scale * (q.double().abs().sum(-1).max() * k.double().abs().max())
                             + math.log(kv_len), parts)
    if half is not None:
        path_side += unit_roundoff(half) * v.double().abs().max().item()
    return both_sides(oracle_side, path_side)


def part(q, k, v):
    """softmax(q k^T) v over these keys alone, and its natural log-sum-exp: [L, H, D], [L, H]."""
    scores = torch.einsum("lhd,shd->lhs", q, k)
    return torch.einsum("lhs,shd->lhd", scores.softmax(-1), v), scores.logsumexp(-1)


def test_merging_parts_equals_attention_over_all_keys():
    """Three parts of the keys folded by the merge kernels (Triton's interpreter on the CPU) give attention over
    all of them: uneven parts, one of a single key, a part with strides like cuDNN's causal output, v_scale, the
    gate, and padding rows dropped."""
    gen = torch.Generator().manual_seed(0)
    length, real_length, heads, dim = 5, 4, 3, 8
    q = torch.randn(length, heads, dim, generator=gen, dtype=torch.float64).to(DEVICE)
    k = 2 * torch.randn(23, heads, dim, generator=gen, dtype=torch.float64).to(DEVICE)  # peaky scores
    v = torch.randn(23, heads, dim, generator=gen, dtype=torch.float64).to(DEVICE)
    gate = torch.randn(length, heads, dim, generator=gen).to(DEVICE)
    acc = torch.empty(heads, length, dim, device=DEVICE)
    lse_acc = torch.empty(heads, length, device=DEVICE)
    for start, end in ((0, 9), (9, 10)):
        out, lse = part(q, k[start:end], v[start:end])  # [L, H, D], [L, H]
        merge_attention_part(acc, lse_acc, out.transpose(0, 1).contiguous().float(), lse.t().contiguous().float(),
                             first=start == 0)
    out, lse = part(q, k[10:], v[10:])
    last = out.float().transpose(0, 1)  # [H, L, D] with token-major strides
    expected, _ = part(q, k, v)
    merged = merge_attention_output(acc, lse_acc, last, lse.t().float(), length, torch.float32)
    lse_all = torch.stack([part(q, k[a:b], v[a:b])[1] for a, b in ((0, 9), (9, 10), (10, 23))])
    assert_within(merged, expected, merge_bound(v, lse_all, 3), "merged")
    gated = merge_attention_output(acc, lse_acc, last, lse.t().float(), real_length, torch.bfloat16, v_scale=2.0,
                                   gate=gate.bfloat16())
    # rounded as the other paths' gate rounds (attention_output_gate), bit for bit
    assert gated.shape == (real_length, heads, dim) and gated.dtype == torch.bfloat16
    assert torch.equal(gated, attention_output_gate(2.0 * merged[:real_length], gate[:real_length].bfloat16()))


def oracle(q, k_cache, v_cache, table, prefix, length, scale):
    """float32 reference attention of `length` queries after `prefix` cached tokens (all in the paged cache)."""
    from deltaserve.ops.attention import reference

    return reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), table, torch.tensor([0, length]),
                                     torch.tensor([prefix + length]), scale)


def paged_sequence(total, block_size, gen):
    """K/V of one sequence in a shuffled paged cache (block 0 unused): caches, [1, blocks] table, keys, values."""
    num_blocks = -(-total // block_size)
    table = (torch.randperm(num_blocks, generator=gen) + 1).to(torch.int32)[None]
    keys, values = torch.randn(2, total, 2, 16, generator=gen)
    k_cache = torch.full((num_blocks + 1, block_size, 2, 16), float("nan"))
    v_cache = k_cache.clone()
    positions = torch.arange(total)
    blocks = table[0, positions // block_size].long()
    k_cache[blocks, positions % block_size], v_cache[blocks, positions % block_size] = keys, values
    return k_cache, v_cache, table, keys, values


def test_fresh_prompts_padded_to_buckets_match_reference(monkeypatch):
    """The fresh-prompt path pads each prompt to the bucket; on the CPU PyTorch's math backend stands in."""
    from torch.nn.attention import SDPBackend

    monkeypatch.setattr(cuda_attention, "_SDPA_BACKENDS", [SDPBackend.MATH])
    monkeypatch.setattr(cuda_attention, "SDPA_BUCKET", 16)
    gen = torch.Generator().manual_seed(1)
    lengths = [37, 1, 16, 5]
    q = torch.randn(sum(lengths), 6, 16, generator=gen)  # 6 query heads over 2 KV heads
    kv = torch.randn(2, sum(lengths), 2, 16, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    out = cuda_attention.fresh_causal_attention(q.bfloat16(), kv[0].bfloat16(), kv[1].bfloat16(), cu, 0.25)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        length = end - start
        k_cache, v_cache = kv[0][start:end, None], kv[1][start:end, None]  # one token per block
        table = torch.arange(length, dtype=torch.int32)[None]
        expected = oracle(q[start:end].bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), table, 0, length, 0.25)
        bound = paths_bound(q[start:end].bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), 0.25, length, 1,
                            torch.bfloat16)
        assert_within(out[start:end], expected, bound, f"bf16 prompt of {length}")


def test_chunk_over_prefix_in_pieces_matches_reference(monkeypatch):
    """Gathered prefix pieces, GQA folding, bucket padding and the merge, with a float64 stand-in for cuDNN."""
    use_math_cudnn(monkeypatch, cuda_attention)
    monkeypatch.setattr(cuda_attention, "PREFIX_PIECE_TOKENS", 40)  # several pieces, the last one partial
    monkeypatch.setattr(cuda_attention, "SDPA_BUCKET", 16)
    gen = torch.Generator().manual_seed(2)
    for prefix, length, block_size in ((100, 21, 16), (37, 16, 5), (16, 1, 16), (0, 21, 16)):  # 0: no prefix part
        k_cache, v_cache, table, keys, values = paged_sequence(prefix + length, block_size, gen)
        q = torch.randn(length, 6, 16, generator=gen)
        on_device = (x.to(DEVICE) for x in (q, keys[prefix:], values[prefix:], k_cache, v_cache, table[0]))
        out = cuda_attention.chunk_over_prefix_attention(*on_device, prefix, 0.25)
        expected = oracle(q, k_cache, v_cache, table, prefix, length, 0.25)
        pieces = -(-prefix // 40) + 1
        bound = paths_bound(q, keys[: prefix + length], values[: prefix + length], 0.25, prefix + length, pieces)
        assert_within(out.cpu(), expected, bound, f"prefix {prefix} + {length}")


def test_fp8_cache_is_attended_as_the_paged_kernel_reads_it(monkeypatch):
    """An fp8 cache holds K / k_scale and V / v_scale: the cuDNN paths get its values cast to q's dtype, the softmax
    scale times k_scale and v_scale for the output, and compute the paged reference over the dequantized cache."""
    from torch.nn.attention import SDPBackend

    use_math_cudnn(monkeypatch, cuda_attention)
    monkeypatch.setattr(cuda_attention, "_SDPA_BACKENDS", [SDPBackend.MATH])
    monkeypatch.setattr(cuda_attention, "PREFIX_PIECE_TOKENS", 40)
    monkeypatch.setattr(cuda_attention, "SDPA_BUCKET", 16)
    gen = torch.Generator().manual_seed(4)
    k_scale, v_scale, prefix, length = 0.5, 2.0, 50, 21
    k_cache, v_cache, table, _, _ = paged_sequence(prefix + length, 16, gen)
    k_fp8, v_fp8 = (k_cache / k_scale).to(torch.float8_e4m3fn), (v_cache / v_scale).to(torch.float8_e4m3fn)
    k_held, v_held = k_fp8.float() * k_scale, v_fp8.float() * v_scale  # what attention should see
    positions = torch.arange(prefix + length)
    blocks, offsets = table[0, positions // 16].long(), positions % 16
    new_k, new_v = (c[blocks, offsets][prefix:] for c in (k_fp8, v_fp8))  # the chunk's K/V as the cache has them
    q = torch.randn(length, 6, 16, generator=gen)
    on_device = (x.to(DEVICE) for x in (q, new_k.float(), new_v.float(), k_fp8, v_fp8, table[0]))
    out = cuda_attention.chunk_over_prefix_attention(*on_device, prefix, 0.25 * k_scale, v_scale=v_scale)
    held = [torch.nan_to_num(c, nan=0.0) for c in (k_held, v_held)]
    assert_within(out.cpu(), oracle(q, k_held, v_held, table, prefix, length, 0.25),
                  paths_bound(q, *held, 0.25, prefix + length, 3), "fp8 chunk over prefix")
    # a fresh prompt: the whole sequence is the chunk
    fresh_k, fresh_v = (c[blocks, offsets] for c in (k_fp8, v_fp8))
    q = torch.randn(prefix + length, 6, 16, generator=gen)
    out = cuda_attention.fresh_causal_attention(q.bfloat16(), fresh_k.bfloat16(), fresh_v.bfloat16(),
                                                torch.tensor([0, prefix + length]), 0.25 * k_scale, v_scale=v_scale)
    # the oracle on q as the path has it (bf16); the fp8 values are bf16-exact
    assert_within(out, oracle(q.bfloat16(), k_held, v_held, table, 0, prefix + length, 0.25),
                  paths_bound(q.bfloat16(), *held, 0.25, prefix + length, 1, torch.bfloat16), "fp8 fresh prompt")


def test_cudnn_refusal_falls_back_to_the_paged_kernel(monkeypatch):
    """A shape cuDNN refuses makes the long-chunk path answer None (the layer then runs the paged kernel)."""
    def refuse(*args, **kwargs):
        raise RuntimeError("cuDNN Frontend error: no valid execution plan")

    monkeypatch.setattr(cuda_attention, "_cudnn_lse_base", lambda *args: "natural")
    monkeypatch.setattr(cuda_attention, "_cudnn_attention", refuse)
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache, table, keys, values = paged_sequence(40, 16, gen)
    q = torch.randn(8, 6, 16, generator=gen)
    assert cuda_attention.chunk_over_prefix_attention(q, keys[32:], values[32:], k_cache, v_cache, table[0], 32,
                                                      0.25) is None


def test_warm_up_compiles_every_merge_variant(monkeypatch):
    """Start-up launches each merge kernel variant that a chunk after its prefix can (the first part and a later
    one; the output gated and not), so that none compiles while serving."""
    launched = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **constexprs: launched.append(
                (self.name, constexprs.get("FIRST", constexprs.get("GATED"))))

    monkeypatch.setattr(cuda_attention, "_merge_part_kernel", Recorder("part"))
    monkeypatch.setattr(cuda_attention, "_merge_output_kernel", Recorder("output"))
    cuda_attention.warm_up_merges(6, 16, torch.bfloat16, "cpu")
    assert set(launched) == {("part", True), ("part", False), ("output", True), ("output", False)}


def test_merge_operands_of_the_wrong_shape_are_refused_by_name():
    import pytest

    acc, lse = torch.zeros(3, 8, 16), torch.zeros(3, 8)
    with pytest.raises(ValueError, match="part must have acc's shape"):
        merge_attention_part(acc, lse, torch.zeros(3, 8, 8), lse, first=True)
    with pytest.raises(ValueError, match="lse_acc"):
        merge_attention_part(acc, torch.zeros(8, 3), acc, lse, first=False)
    with pytest.raises(ValueError, match="acc must be a contiguous float32"):
        merge_attention_part(acc.bfloat16(), lse, acc, lse, first=True)
    with pytest.raises(ValueError, match="real_length must be in"):
        merge_attention_output(acc, lse, acc, lse, 9, torch.float32)
    with pytest.raises(ValueError, match="gate must be"):
        merge_attention_output(acc, lse, acc, lse, 8, torch.float32, gate=torch.zeros(8, 3, 8))
