"""Gated full attention (Qwen3.5 / Qwen3-Next), over the paged KV cache.

q_proj produces per head [query | gate] (interleaved per head, not split in halves); q and k get a
zero-centred RMSNorm per head, then partial RoPE; the attention output is multiplied by sigmoid(gate)
before o_proj. See the architecture reference, section 3.

Under tensor parallelism a rank holds num_heads / tp_size query heads and the KV heads they read
(`ParallelContext.kv_head_shard`: replicated when tp_size exceeds the KV heads); o_proj is row-parallel and
its partial sums are all-reduced by the decoder layer.
"""

import torch
from torch import nn

from deltaserve.layers.batch import ForwardBatch
from deltaserve.layers.linear import fuse_linears
from deltaserve.layers.norm import RMSNorm
from deltaserve.layers.rotary import PartialRotary
from deltaserve.ops.attention import chunk_over_prefix_attention, fresh_causal_attention, paged_attention
from deltaserve.ops.linear import linear, matmul, product_inputs
from deltaserve.ops.rotary import qk_norm_rope_write_kv
from deltaserve.worker.distributed import SINGLE, ParallelContext

# Chunks shorter than this keep the paged kernel: cuDNN's launches would cost more than they save.
SDPA_MIN_TOKENS = 512
# cuDNN serves a chunk after a cached prefix only when the prefix is a multiple of this (a long prompt's
# chunks, with --max-num-batched-tokens a multiple of it): every new prefix length would make cuDNN build a new
# plan (tens of milliseconds), so prefix-cache hits of any length keep the paged kernel.
SDPA_PREFIX_ALIGN = 8192


class GatedAttention(nn.Module):
    PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")  # the linears a quantized checkpoint may store quantized

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rotary: PartialRotary, eps: float, parallel: ParallelContext = SINGLE):
        super().__init__()
        num_heads = parallel.shard(num_heads, "num_attention_heads")[1]  # this rank's
        num_kv_heads = parallel.kv_head_shard(num_kv_heads)[1]
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim * 2, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)
        self.rotary = rotary
        self.scale = head_dim ** -0.5
        self.qkv_weight: torch.Tensor | None = None  # [q | k | v] rows, set by fuse()
        # Per-tensor scales of an fp8 KV cache (it stores K / k_scale, V / v_scale): the checkpoint's when it
        # has them (model/loader.py), else 1.0; a cache of any other dtype ignores them, as in vLLM.
        self.k_scale = self.v_scale = 1.0
        self.kv_scales_from_checkpoint = False
        # Paged KV cache, bound by the runner: [num_blocks, block_size, num_kv_heads, head_dim] each.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def fuse(self) -> None:
        """After loading: q, k and v projections become one matmul."""
        self.qkv_weight = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def _sdpa_path(self, q: torch.Tensor, batch: ForwardBatch) -> bool:
        """Long chunks (prompts without a cached prefix, or one prompt's chunk after its prefix) run on cuDNN's
        attention, twice as fast as our paged kernel there (docs/performance.md), with a cache of q's dtype or
        fp8."""
        return (q.is_cuda and batch.max_query_len >= SDPA_MIN_TOKENS and q.dtype in (torch.bfloat16, torch.float16)
                and self.k_cache.dtype in (q.dtype, torch.float8_e4m3fn))

    def warm_up_one_split_decode(self) -> None:
        """Run the decode kernel once over a one-block table, so that start-up compiles its one-split variant
        (the kernel writes its output itself, see `cuda_decode`): eager steps whose longest sequence is short
        launch it, and graphs may never plan it (on 27B only from 34 sequences)."""
        device, dtype = self.k_cache.device, self.q_norm.weight.dtype
        q = torch.zeros(1, self.num_heads, self.head_dim, dtype=dtype, device=device)  # also the gate
        one_block = torch.zeros(1, 1, dtype=torch.int32, device=device)  # [1 sequence, 1 block]
        paged_attention(q, self.k_cache, self.v_cache, one_block, torch.tensor([0, 1], device=device),
                        torch.ones(1, dtype=torch.int64, device=device), self.scale, 1, k_scale=self.k_scale,
                        v_scale=self.v_scale, gate=q)

    @property
    def in_weight(self) -> torch.Tensor:
        """The input projection [q | k | v] rows, applied by the decoder layer together with its norm."""
        return self.qkv_weight

    def _attend(self, q, k, v, gate, batch: ForwardBatch, k_scale: float, v_scale: float):
        """q, gate: [T, nH, hd]; k, v: [T, nKV, hd], already in the cache -> o * sigmoid(gate): [T, nH, hd], or at
        decode what o_proj's product reads of it where the attention kernels wrote that (paged_attention)."""
        # cuDNN takes prompts with nothing cached, and one long chunk after its cached prefix (long prompts,
        # chunk after chunk)
        fresh = batch.prefix_free
        if self._sdpa_path(q, batch) and (fresh or (batch.num_seqs == 1
                                                    and batch.num_computed_cpu[0] % SDPA_PREFIX_ALIGN == 0)):
            if self.k_cache.dtype != q.dtype:
                # fp8: attend what the cache holds, as the paged kernel does (K / k_scale and V / v_scale, cast
                # exactly to q's dtype; k_scale goes into the softmax scale, v_scale onto the output)
                k, v = (cache.flatten(0, 1)[batch.slot_mapping].to(q.dtype) for cache in (self.k_cache, self.v_cache))
            if fresh:  # nothing cached to read: attend the new K/V directly
                return fresh_causal_attention(q, k, v.contiguous(), batch.cu_seqlens_cpu, self.scale * k_scale,
                                              gate=gate, v_scale=v_scale)
            o = chunk_over_prefix_attention(q, k, v, self.k_cache, self.v_cache, batch.block_tables[0],
                                            batch.num_computed_cpu[0], self.scale * k_scale, gate=gate,
                                            v_scale=v_scale)
            if o is not None:
                return o
        quant_block, dp4a = product_inputs(q, self.o_proj.weight) if batch.max_query_len == 1 else (0, None)
        return paged_attention(q, self.k_cache, self.v_cache, batch.block_tables, batch.cu_seqlens_q, batch.seq_lens,
                               self.scale, batch.max_query_len, k_scale=k_scale, v_scale=v_scale, gate=gate,
                               quant_block=quant_block, dp4a=dp4a)  # [T, nH, hd], already times sigmoid(gate)

    def _last_tokens_attend(self, q, gate, batch: ForwardBatch, sample_seqs, k_scale: float, v_scale: float):
        """q, gate: [T, nH, hd], the step's K/V already in the cache -> [S, hidden]: the output of the last
        token of each sequence in sample_seqs [S], each a one-query (decode) attention over its whole KV."""
        num_rows = sample_seqs.shape[0]
        if num_rows == 0:
            return q.new_empty(0, self.o_proj.weight.shape[0])
        rows = batch.logits_indices[sample_seqs]  # [S]
        one_each = torch.arange(num_rows + 1, device=q.device)  # [S+1] cu_seqlens_q
        o = paged_attention(q[rows], self.k_cache, self.v_cache, batch.block_tables[sample_seqs], one_each,
                            batch.seq_lens[sample_seqs], self.scale, 1, k_scale=k_scale, v_scale=v_scale,
                            gate=gate[rows])  # [S, nH, hd]
        return linear(o.reshape(num_rows, self.num_heads * self.head_dim), self.o_proj.weight)

    def forward(self, qkv: torch.Tensor, batch: ForwardBatch,
                sample_seqs: torch.Tensor | None = None) -> torch.Tensor:
        """qkv: [T, 2 nH hd + 2 nKV hd], the input projection's output -> [T, hidden]. Writes this step's K/V
        into the cache, then attends over it. With sample_seqs ([S] int64 sequence indices): only the last
        token of each of those sequences attends -> [S, hidden] (every token's K/V is still written)."""
        T = qkv.shape[0]
        kv_dim = self.num_kv_heads * self.head_dim
        qg, k, v = qkv.split([2 * self.num_heads * self.head_dim, kv_dim, kv_dim], -1)
        qg = qg.view(T, self.num_heads, 2 * self.head_dim)
        q, gate = qg[..., : self.head_dim], qg[..., self.head_dim:]  # [T, nH, hd] each
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        rot = self.rotary
        k_scale, v_scale = (self.k_scale, self.v_scale) if self.k_cache.dtype == torch.float8_e4m3fn else (1.0, 1.0)
        # one launch: q/k norm, partial RoPE, and this step's K/V written into the cache
        q, k = qk_norm_rope_write_kv(q, k, v, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, rot.cos,
                                     rot.sin, batch.positions, rot.rotary_dim, self.k_cache, self.v_cache,
                                     batch.slot_mapping, k_scale=k_scale, v_scale=v_scale)
        if sample_seqs is not None:
            return self._last_tokens_attend(q, gate, batch, sample_seqs, k_scale, v_scale)
        o = self._attend(q, k, v, gate, batch, k_scale, v_scale)
        if not isinstance(o, torch.Tensor):  # o_proj's input, quantized or with its parts, as its product reads it
            return matmul(o, self.o_proj.weight)
        return linear(o.reshape(T, self.num_heads * self.head_dim), self.o_proj.weight)
