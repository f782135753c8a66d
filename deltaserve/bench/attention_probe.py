"""Long-prefill attention: our Triton paged kernel beside PyTorch's SDPA backends, on the GPU.

    python -m deltaserve.bench.attention_probe

Times one 27B attention layer (24 query / 4 KV heads, head_dim 256, bf16) for an 8,192-token chunk after
0, 24,576 and 122,880 cached tokens (the last chunk of W3's 32K prompt and of W2's 131K prompt), causal with
the queries at the end. SDPA runs on contiguous K/V (a paged cache would need a gather first, timed too)
with each backend that accepts the shapes; TFLOP/s count the causal half only. Decides whether the
prefill path should call SDPA instead of our kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from deltaserve.ops.attention import paged_attention

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


if __name__ == "__main__":
    main()
