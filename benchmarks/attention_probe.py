"""Long-prefill attention: our Triton paged kernel beside PyTorch's SDPA backends, on the GPU; and (with
--decode-sweep) the decode kernel's tiles over bf16 and fp8 caches, (with --prefill-split-sweep) the paged
prefill kernel's split count for short chunks over long prefixes, or (with --chunk-over-prefix) the cuDNN path
of a long chunk after its prefix beside its cuDNN calls alone.

    python -m benchmarks.attention_probe [--decode-sweep | --prefill-split-sweep | --chunk-over-prefix]

Times one 27B attention layer (24 query / 4 KV heads, head_dim 256, bf16) for an 8,192-token chunk after
0, 24,576 and 122,880 cached tokens (the last chunk of W3's 32K prompt and of W2's 131K prompt), causal with
the queries at the end. SDPA runs on contiguous K/V (a paged cache would need a gather first, timed too)
with each backend that accepts the shapes; TFLOP/s count the causal half only. Decides whether the
prefill path should call SDPA instead of our kernel.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from deltaserve.ops.attention import cuda_decode, paged_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 24, 4, 256, 16


def timed(fn, repeats: int = 5) -> float:
    """Median milliseconds of fn() on the GPU."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def timed_in_graph(fn, calls: int = 10, repeats: int = 5) -> float:
    """Median milliseconds of one fn() replayed in a CUDA graph of `calls` calls: no host launch time, as the
    decode graphs run it."""
    fn()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return timed(graph.replay, repeats) / calls


def main() -> None:
    device = torch.device("cuda")
    q_len = 8192
    for prefix in (0, 24576, 122880):
        kv_len = prefix + q_len
        flops = 4 * HEAD_DIM * HEADS * (q_len * prefix + q_len * q_len / 2)
        q = torch.randn(q_len, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
        blocks = kv_len // BLOCK
        k_cache = torch.randn(blocks + 1, BLOCK, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        table = torch.randperm(blocks, device=device, dtype=torch.int32)[None] + 1  # [1, blocks], shuffled
        cu = torch.tensor([0, q_len], device=device)
        seq_lens = torch.tensor([kv_len], device=device)
        scale = HEAD_DIM ** -0.5
        ours = timed(lambda: paged_attention(q, k_cache, v_cache, table, cu, seq_lens, scale, q_len))
        print(f"prefix {prefix:>6} + {q_len}: triton paged {ours:7.2f} ms  {flops / ours / 1e9:6.0f} TFLOP/s",
              flush=True)

        def gather():  # paged -> contiguous [1, KV, L, D]
            k = k_cache[table[0].long()].reshape(kv_len, KV_HEADS, HEAD_DIM).transpose(0, 1)[None]
            v = v_cache[table[0].long()].reshape(kv_len, KV_HEADS, HEAD_DIM).transpose(0, 1)[None]
            return k.contiguous(), v.contiguous()

        k, v = gather()
        print(f"    gather of the paged K/V: {timed(gather):.2f} ms", flush=True)
        q4 = q.transpose(0, 1)[None]  # [1, H, Lq, D]
        mask = causal_lower_right(q_len, kv_len)
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            try:
                with sdpa_kernel(backend):
                    ms = timed(lambda: F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, enable_gqa=True))
                    # and without GQA support: K/V repeated per query head
                    k_rep = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
                    v_rep = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
                    ms_rep = timed(lambda: F.scaled_dot_product_attention(q4, k_rep, v_rep, attn_mask=mask))
                print(f"    {backend.name:20s} {ms:7.2f} ms  {flops / ms / 1e9:6.0f} TFLOP/s   (repeated K/V: "
                      f"{ms_rep:7.2f} ms, {flops / ms_rep / 1e9:6.0f} TFLOP/s)", flush=True)
            except Exception as exc:  # a backend that refuses these shapes says why
                print(f"    {backend.name:20s} unavailable: {str(exc).splitlines()[0][:150]}", flush=True)
        if prefix == 0:  # plain causal (top-left == bottom-right when there is no prefix)
            for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
                try:
                    with sdpa_kernel(backend):
                        ms = timed(lambda: F.scaled_dot_product_attention(q4, k, v, is_causal=True, enable_gqa=True))
                    print(f"    {backend.name:20s} is_causal {ms:7.2f} ms  {flops / ms / 1e9:6.0f} TFLOP/s", flush=True)
                except Exception as exc:
                    print(f"    {backend.name:20s} is_causal unavailable: {str(exc).splitlines()[0][:150]}",
                          flush=True)


def decode_sweep(dtypes: tuple[str, ...] = ("bf16", "fp8", "fp8 q-fp16")) -> None:
    """The split-KV decode kernel at W2's context (1 x 131,072) and W6's batch (64 x 1,536) for each cache
    dtype and tile: (KV positions per step, warps, pipeline stages, resident programs per SM: the splits
    follow it), GB/s of KV read. An fp8 cache also runs with float16 queries (its upcast to the dot's dtype is
    then the hardware's e4m3 -> f16)."""
    device = torch.device("cuda")
    table_width = 262144 // BLOCK  # serving's block_tables width (max_model_len 262,144): sets the planned splits
    tiles = list(itertools.product((64, 128), (4, 8), (2, 3, 4), (2, 3, 4)))
    for num_seqs, context in ((1, 131072), (64, 1536)):
        blocks = num_seqs * context // BLOCK
        table = torch.zeros(num_seqs, table_width, dtype=torch.int32, device=device)
        table[:, :context // BLOCK] = torch.randperm(blocks, device=device, dtype=torch.int32).view(num_seqs, -1) + 1
        cu = torch.arange(num_seqs + 1, device=device)
        seq_lens = torch.full((num_seqs,), context, device=device)
        q_bf16 = torch.randn(num_seqs, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
        k_bf16 = torch.randn(blocks + 1, BLOCK, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
        v_bf16 = torch.randn_like(k_bf16)
        cases = [("bf16", q_bf16, k_bf16, v_bf16)]
        k_fp8, v_fp8 = k_bf16.to(torch.float8_e4m3fn), v_bf16.to(torch.float8_e4m3fn)
        cases += [("fp8", q_bf16, k_fp8, v_fp8), ("fp8 q-fp16", q_bf16.half(), k_fp8, v_fp8)]
        for name, q, k_cache, v_cache in (case for case in cases if case[0] in dtypes):
            size = k_cache.element_size()
            defaults = tuple(cuda_decode.DECODE_TILES[size])
            kv_bytes = 2 * num_seqs * context * KV_HEADS * HEAD_DIM * size
            results = []
            for tile in tiles:
                cuda_decode.DECODE_TILES[size] = cuda_decode.DecodeTile(*tile)
                try:
                    ms = timed_in_graph(lambda: paged_attention(q, k_cache, v_cache, table, cu, seq_lens,
                                                                HEAD_DIM ** -0.5, 1))
                except Exception as exc:  # a tile that does not fit says so
                    print(f"  {num_seqs} x {context} {name} {tile}: failed: {str(exc).splitlines()[0][:120]}")
                    continue
                results.append((ms, tile))
            cuda_decode.DECODE_TILES[size] = cuda_decode.DecodeTile(*defaults)
            results.sort()
            default_ms = next((ms for ms, tile in results if tile == defaults), float("nan"))
            best = ", ".join(f"{tile} {1e3 * ms:.1f} us {kv_bytes / ms / 1e6:.0f} GB/s" for ms, tile in results[:4])
            print(f"decode {num_seqs} x {context} {name}: default {defaults} {1e3 * default_ms:.1f} us "
                  f"({kv_bytes / default_ms / 1e6:.0f} GB/s); best: {best}", flush=True)


PREFILL_SPLIT_CASES = ((16, 36864), (64, 36864), (256, 36864), (16, 131072), (512, 8192))
PREFILL_SPLIT_COUNTS = (1, 2, 3, 4, 5, 6, 8, 9, 12, 13, 16, 17, 22, 24, 32, 33, 44, 48, 64, 66, 88, 96, 128)


def prefill_split_sweep(dtypes: tuple[str, ...] = ("bf16", "fp8"), table_width: int = 140000 // BLOCK) -> None:
    """The paged prefill kernel over a cached prefix (W4's 16-token hit after 36,864 tokens, W5-like turns, a
    short chunk at W2's context) at each split count, in CUDA graphs as the chunk graphs run it: the count
    `prefill_num_splits` plans for serving's block-table width (max_model_len 140,000, the benchmarks') beside the
    fastest. (The thirteenth session's sweep replaced a rule that rounded up past whole waves: docs/performance.md.)"""
    from deltaserve.ops.attention import cuda as attention_cuda, cuda_prefill

    device = torch.device("cuda")
    for q_len, prefix in PREFILL_SPLIT_CASES:
        kv_len = prefix + q_len
        blocks = -(-kv_len // BLOCK)
        table = torch.zeros(1, table_width, dtype=torch.int32, device=device)
        table[0, :blocks] = torch.randperm(blocks, device=device, dtype=torch.int32) + 1
        cu = torch.tensor([0, q_len], device=device)
        seq_lens = torch.tensor([kv_len], device=device)
        q = torch.randn(q_len, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
        k_bf16 = torch.randn(blocks + 1, BLOCK, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
        v_bf16 = torch.randn_like(k_bf16)
        caches = {"bf16": (k_bf16, v_bf16),
                  "fp8": (k_bf16.to(torch.float8_e4m3fn), v_bf16.to(torch.float8_e4m3fn))}
        group = HEADS // KV_HEADS
        tiles = cuda_prefill.prefill_tiles(HEAD_DIM, group)
        programs = KV_HEADS * cuda_prefill.prefill_query_blocks(q_len, 1, group, tiles)  # the unsplit grid
        planned = cuda_prefill.prefill_num_splits(programs, table_width * BLOCK, device)
        for name in dtypes:
            k_cache, v_cache = caches[name]
            kv_bytes = 2 * kv_len * KV_HEADS * HEAD_DIM * k_cache.element_size()
            results = {}
            for splits in sorted(set(PREFILL_SPLIT_COUNTS) | {planned}):
                if splits > cuda_prefill.PREFILL_MAX_SPLITS:
                    continue
                results[splits] = timed_in_graph(lambda: attention_cuda.paged_attention(
                    q, k_cache, v_cache, table, cu, seq_lens, HEAD_DIM ** -0.5, q_len, num_splits=splits))
            best = sorted(results, key=results.get)[:4]
            listed = ", ".join(f"{s} {1e3 * results[s]:.1f} us" for s in best)
            print(f"prefill {q_len} after {prefix} {name}: {programs} programs unsplit; planned {planned} splits "
                  f"{1e3 * results[planned]:.1f} us ({kv_bytes / results[planned] / 1e6:.0f} GB/s); best: {listed}",
                  flush=True)


def chunk_over_prefix_probe(prefixes: tuple[int, ...] = (8192, 32768, 65536, 122880), q_len: int = 8192) -> None:
    """The cuDNN path of a long chunk after its cached prefix (`chunk_over_prefix_attention`, gated, as W2's and
    W3's later chunks run it) beside its cuDNN calls alone on the same operands: what the gathers, the merges
    and the gate add (bf16 cache, 27B heads, shuffled blocks)."""
    from deltaserve.ops.attention import cuda_sdpa

    device = torch.device("cuda")
    group = HEADS // KV_HEADS
    scale = HEAD_DIM ** -0.5
    for prefix in prefixes:
        blocks = prefix // BLOCK
        k_cache = torch.randn(blocks + 1, BLOCK, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        table = torch.randperm(blocks, device=device, dtype=torch.int32) + 1
        q, gate = torch.randn(2, q_len, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
        k, v = torch.randn(2, q_len, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
        flops = 4 * HEAD_DIM * HEADS * (q_len * prefix + q_len * q_len / 2)
        whole = timed(lambda: cuda_sdpa.chunk_over_prefix_attention(q, k, v, k_cache, v_cache, table, prefix, scale,
                                                                   gate=gate))
        # the same cuDNN calls on operands prepared outside the timing
        q_folded = q.view(q_len, KV_HEADS, group, HEAD_DIM).permute(1, 2, 0, 3).reshape(1, KV_HEADS, group * q_len,
                                                                                      HEAD_DIM)
        piece = cuda_sdpa.PREFIX_PIECE_TOKENS
        pieces = [(k_cache[table[i // BLOCK:(i + piece) // BLOCK].long()].flatten(0, 1).permute(1, 0, 2)[None],
                   v_cache[table[i // BLOCK:(i + piece) // BLOCK].long()].flatten(0, 1).permute(1, 0, 2)[None])
                  for i in range(0, prefix, piece)]
        q_heads, k_heads, v_heads = (x.transpose(0, 1)[None] for x in (q, k, v))

        def cudnn_alone():
            for k_piece, v_piece in pieces:
                cuda_sdpa._cudnn_attention(q_folded, k_piece, v_piece, scale, causal=False)
            cuda_sdpa._cudnn_attention(q_heads, k_heads, v_heads, scale, causal=True)

        alone = timed(cudnn_alone)
        print(f"chunk {q_len} after {prefix}: whole path {whole:7.2f} ms ({flops / whole / 1e9:4.0f} TFLOP/s), "
              f"cuDNN calls alone {alone:7.2f} ms ({flops / alone / 1e9:4.0f} TFLOP/s, {len(pieces)} pieces + "
              f"the chunk): the rest {whole - alone:5.2f} ms", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode-sweep", action="store_true", help="sweep the decode kernel's tiles instead")
    parser.add_argument("--decode-dtypes", default="bf16,fp8,fp8 q-fp16",
                        help="with --decode-sweep, the cases to sweep (comma-separated: bf16, fp8, fp8 q-fp16)")
    parser.add_argument("--prefill-split-sweep", action="store_true",
                        help="time the paged prefill kernel at each split count over long prefixes instead")
    parser.add_argument("--chunk-over-prefix", action="store_true",
                        help="time the cuDNN path of a long chunk after its prefix beside its cuDNN calls alone")
    args = parser.parse_args()
    if args.chunk_over_prefix:
        chunk_over_prefix_probe()
    elif args.prefill_split_sweep:
        prefill_split_sweep()
    elif args.decode_sweep:
        decode_sweep(tuple(name.strip() for name in args.decode_dtypes.split(",")))
    else:
        main()
