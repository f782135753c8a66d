"""Decode steps on static, padded buffers; replayed as CUDA graphs unless --enforce-eager.

One graph per batch size in `graph_capture_sizes(max_num_seqs)` (1, 2, 4, 8, then every 8; every size up to 32
with --performance-mode interactivity), captured largest first
into one shared memory pool. Each graph reads static input buffers sized for the largest batch; a step of n
sequences is padded to the next captured size, and its padding rows point at the dummy state slot 0, the
null KV block 0 (context length 1) and KV slot -1 (no cache write), so they change nothing a request owns.
With --enforce-eager the same padded batch runs eagerly, so both modes compute exactly the same numbers
(the shapes decide which GEMM and attention-split kernels run, and so the rounding).
"""

from __future__ import annotations

import logging

import torch

from deltaserve.cache.footprint import graph_capture_sizes
from deltaserve.layers.batch import ForwardBatch
from deltaserve.model.qwen3_5 import HybridForCausalLM

logger = logging.getLogger(__name__)


class DecodeGraphs:
    def __init__(self, model: HybridForCausalLM, max_num_seqs: int, block_table_width: int, device,
                 use_graphs: bool = True, performance_mode: str = "balanced"):
        self.model = model
        self.use_graphs = use_graphs
        self.sizes = graph_capture_sizes(max_num_seqs, performance_mode)
        n = self.sizes[-1]
        i64 = dict(dtype=torch.int64, device=device)
        # static inputs, sized for the largest batch; rows beyond a step's batch hold padding values
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slot_mapping = torch.full((n,), -1, **i64)
        self.seq_lens = torch.ones(n, **i64)
        self.state_slots = torch.zeros(n, **i64)
        self.block_tables = torch.zeros(n, block_table_width, dtype=torch.int32, device=device)
        self.cu_seqlens = torch.arange(n + 1, **i64)
        self.has_initial_state = torch.ones(n, dtype=torch.bool, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # one static output shared by every graph (a per-graph output would hold [size, V] float32 each)
        self.logits = torch.empty(n, model.config.vocab_size, dtype=torch.float32, device=device)

    def _batch(self, size: int) -> ForwardBatch:
        return ForwardBatch(
            positions=self.positions[:size], cu_seqlens_q=self.cu_seqlens[: size + 1], seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size], slot_mapping=self.slot_mapping[:size],
            state_slots=self.state_slots[:size], has_initial_state=self.has_initial_state[:size],
            logits_indices=self.cu_seqlens[:size], max_query_len=1, cu_seqlens_cpu=None, is_decode=True)

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.use_graphs:
            return
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its pool memory
            batch = self._batch(size)
            for _ in range(2):  # warm up: Triton compiles, cuBLAS picks its kernels
                self.model.compute_logits(self.model(self.input_ids[:size], batch))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[:size].copy_(self.model.compute_logits(self.model(self.input_ids[:size], batch)))
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def padded_size(self, n: int) -> int | None:
        """The captured size to run n sequences at, or None if n is larger than every graph."""
        return next((s for s in self.sizes if s >= n), None)

    def run(self, batch: ForwardBatch, input_ids: torch.Tensor) -> torch.Tensor:
        """Replay the graph for this decode batch; returns logits [n, V] (a view of the static output)."""
        n = batch.num_seqs
        size = self.padded_size(n)
        width = batch.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.seq_lens[:n].copy_(batch.seq_lens)
        self.state_slots[:n].copy_(batch.state_slots)
        self.block_tables[:n, :width].copy_(batch.block_tables)
        if size > n:  # padding rows: dummy slot, null block, no cache write
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
            self.state_slots[n:size].fill_(0)
            self.block_tables[n:size].fill_(0)
        if not self.use_graphs:
            return self.model.compute_logits(self.model(self.input_ids[:size], self._batch(size)))[:n]
        self.graphs[size].replay()
        return self.logits[:n]
