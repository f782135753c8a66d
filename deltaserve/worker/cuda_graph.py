"""Decode steps, and steps of one prompt chunk, on static padded buffers; replayed as CUDA graphs unless
--enforce-eager.

Decode graphs: one per batch size in `graph_capture_sizes(max_num_seqs)` (1, 2, 4, 8, then every 8; every size
up to 32 with --performance-mode interactivity), captured largest first into one shared memory pool. Each graph
reads static input buffers sized for the largest batch; a step of n sequences is padded to the next captured
size, and its padding rows point at the dummy state slot 0, the null KV block 0 (context length 1) and KV slot
-1 (no cache write), so they change nothing a request owns.

Single-chunk graphs (`chunk_graph_sizes`; on unless DELTASERVE_CHUNK_GRAPHS=0): a step of one sequence computing
2 to 1,024 new tokens (a fresh prompt, a prefix-cache hit's new tokens), padded to the next of 16, 32, ..., 1,024
rows by a second sequence on the dummy slot (zero state, the null block, no cache writes); such a step is otherwise
bound by launching its kernels one by one. Up to 128 rows the GDN layers run the recurrent kernel, and a step with
a checkpoint inside it stays eager; from PADDED_CHUNK_MIN_ROWS rows they follow the step's
`PaddedChunk` (layers/batch.py): fla over all rows with the padding masked, any checkpoint inside the step taken,
every launch of a fixed shape (`_PaddedPlans` sets its buffers before each replay). A short step with a checkpoint
inside takes the smallest such graph.

Pipeline parallelism: each stage captures its own decode graphs, one per batch size, over its own layers. A stage
after the first reads the previous stage's (h, residual) from static input buffers `stage_input` ([n, H] each,
filled by `run` from what the runner received); a stage before the last writes its (h, residual) to static output
buffers `stage_output` instead of logits. The send/recv stays outside the graph (ModelRunner._through_stage); a TP
all-reduce inside a stage is captured with it (NCCL collectives are capturable; gloo's are not, so graphs stay off
there). Single-chunk graphs stay single-stage: under PP such a step runs eagerly.

One set of static buffers per rank serves every in-flight micro-batch: a rank runs its steps one after another on
one stream (the worker takes the next step only once this one's outputs are sent), so a step's replay is queued
after the previous step's send (NCCL: stream-ordered) or sampling has read the buffers, and its own input copy is
queued after that; no two steps' use of the buffers overlap, whatever the number of micro-batches.

With --enforce-eager the same padded batches run eagerly, so both modes compute exactly the same numbers (the
shapes decide which GEMM and attention-split kernels run, and so the rounding).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from deltaserve.graph_sizes import PADDED_CHUNK_MIN_ROWS
from deltaserve.layers.batch import ForwardBatch, PaddedChunk
from deltaserve.model.qwen3_5 import HybridForCausalLM

logger = logging.getLogger(__name__)


class _StaticBatch:
    """Input buffers of one kind of graph: `rows` token rows and `seqs` sequences, padding values where unset."""

    def __init__(self, rows: int, seqs: int, block_table_width: int, device):
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(rows, **i64)
        self.positions = torch.zeros(rows, **i64)
        self.slot_mapping = torch.full((rows,), -1, **i64)
        self.seq_lens = torch.ones(seqs, **i64)
        self.state_slots = torch.zeros(seqs, **i64)
        self.block_tables = torch.zeros(seqs, block_table_width, dtype=torch.int32, device=device)
        self.has_initial_state = torch.ones(seqs, dtype=torch.bool, device=device)
        self.cu_seqlens = torch.arange(seqs + 1, **i64)  # decode rows: one token each


class _PaddedPlans:
    """The PaddedChunk of each padded single-chunk graph size, over shared static buffers (`set` fills them for a
    step: its chunk length, where the GDN state stops, the checkpoint slot)."""

    def __init__(self, sizes: list[int], chunk_slot: torch.Tensor, conv_width: int, block_size: int, device):
        i64 = dict(dtype=torch.int64, device=device)
        self.conv_width, self.window = conv_width, block_size
        self.chunk_slot = chunk_slot  # [1] the chunk's state slot in the single graphs' buffers
        self.arange = torch.arange(max(sizes), **i64)
        self.keep = torch.zeros(max(sizes), dtype=torch.bool, device=device)
        self.checkpoint_slot = torch.zeros(1, **i64)
        self.conv_rows = torch.zeros(conv_width - 1, **i64)
        self.window_rows = torch.zeros(block_size, **i64)
        self.window_cu_seqlens = torch.zeros(4, **i64)
        self.window_slots = torch.zeros(3, **i64)
        self.window_redo = torch.zeros(block_size, dtype=torch.bool, device=device)
        window_has_initial_state = torch.tensor([False, True, False], device=device)
        self.plans: dict[int, PaddedChunk] = {}
        for size in sizes:
            fla_cu_seqlens_cpu = torch.tensor([0, size])
            self.plans[size] = PaddedChunk(
                keep=self.keep[:size], fla_cu_seqlens=fla_cu_seqlens_cpu.to(device),
                fla_cu_seqlens_cpu=fla_cu_seqlens_cpu, fla_chunk_indices=_fla_chunk_indices(size, device),
                checkpoint_slot=self.checkpoint_slot, conv_rows=self.conv_rows, window_rows=self.window_rows,
                window_cu_seqlens=self.window_cu_seqlens, window_slots=self.window_slots,
                window_has_initial_state=window_has_initial_state, window_redo=self.window_redo)

    def renew_offsets(self, size: int) -> None:
        """Before capturing the `size` graph: its plan's cu_seqlens as a tensor fla has not seen. fla derives
        tensors from cu_seqlens on the device (its chunk offsets) and caches them by the tensor's identity
        (fla.utils.tensor_cache, 4 entries): a capture that found the warm-up's there would replay reading memory
        freed once they are evicted (an illegal address on the H200); with a new tensor they are derived inside
        the graph, at every replay."""
        plan = self.plans[size]
        plan.fla_cu_seqlens = plan.fla_cu_seqlens.clone()

    def set(self, size: int, chunk_len: int, stop: int, checkpoint_slot: int) -> None:
        """A step of chunk_len tokens in `size` rows whose GDN state stops at `stop` (chunk_len, or a checkpoint's
        save point at least W-1 tokens in and within a block of the end), saved to checkpoint_slot (0: none)."""
        if not (1 <= stop <= chunk_len <= size and chunk_len - stop <= self.window):
            raise ValueError(f"a padded step of {chunk_len} tokens in {size} rows cannot stop its state at {stop}")
        torch.lt(self.arange[:size], stop, out=self.keep[:size])
        self.checkpoint_slot.fill_(checkpoint_slot)
        # (a save point is at least W-1 tokens in; without one the copy lands on the dummy slot, any rows will do)
        torch.add(self.arange[: self.conv_width - 1], max(stop - self.conv_width + 1, 0), out=self.conv_rows)
        start = min(stop, size - self.window)  # the window's first row
        torch.add(self.arange[: self.window], start, out=self.window_rows)
        for i, bound in enumerate((0, stop - start, chunk_len - start, self.window)):
            self.window_cu_seqlens[i].fill_(bound)
        self.window_slots[1].copy_(self.chunk_slot[0])
        window = self.arange[: self.window]
        torch.logical_and(window >= stop - start, window < chunk_len - start, out=self.window_redo)


def _fla_chunk_indices(size: int, device) -> torch.Tensor | None:
    """fla's chunk index of one sequence of `size` tokens on the GPU (None elsewhere: the reference needs none)."""
    if torch.device(device).type != "cuda":
        return None
    from deltaserve.ops.gdn.cuda import fla_chunk_indices  # GPU only

    return torch.from_numpy(fla_chunk_indices(np.asarray([0, size]))).to(device)


class StepGraphs:
    def __init__(self, model: HybridForCausalLM, sizes, chunk_sizes, block_table_width: int, device,
                 use_graphs: bool = True, block_size: int = 16):
        """sizes: the decode batch sizes (graph_sizes.graph_capture_sizes); chunk_sizes: the single-chunk token
        counts (graph_sizes.chunk_graph_sizes), both as ResolvedConfig holds them."""
        self.model = model
        self.parallel = model.parallel
        self.use_graphs = use_graphs
        self.sizes = list(sizes)
        # single-chunk graphs: their token counts (a padded graph's last block re-runs: one must fit in it); one
        # stage only
        self.chunk_sizes = [s for s in chunk_sizes if s < PADDED_CHUNK_MIN_ROWS or s >= block_size]
        if self.parallel.pp_size > 1:
            self.chunk_sizes = []
        n = self.sizes[-1]
        longest_chunk = max(self.chunk_sizes, default=0)
        block_table_width = max(block_table_width, -(-longest_chunk // block_size))  # a padding sequence reads it
        self.decode = _StaticBatch(n, n, block_table_width, device)
        self.padded: _PaddedPlans | None = None
        if self.chunk_sizes:
            # rows [0, size): the chunk's L tokens, then padding; sequences: the chunk and its padding
            self.single = _StaticBatch(self.chunk_sizes[-1], 2, block_table_width, device)
            self.single_cu_seqlens = torch.zeros(3, dtype=torch.int64, device=device)  # [0, L, size]
            padded_sizes = [s for s in self.chunk_sizes if s >= PADDED_CHUNK_MIN_ROWS]
            if padded_sizes:
                self.padded = _PaddedPlans(padded_sizes, self.single.state_slots[:1], model.config.conv_kernel,
                                           block_size, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.chunk_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # pipeline stages: the previous stage's (h, residual) in, this stage's out, [n, H] each (module docstring)
        hidden = dict(size=(n, model.config.hidden_size), dtype=model.dtype, device=device)
        self.stage_input = None if self.parallel.is_first_stage else (torch.zeros(**hidden), torch.zeros(**hidden))
        self.stage_output = None if self.parallel.is_last_stage else (torch.zeros(**hidden), torch.zeros(**hidden))
        # one static output shared by every graph (a per-graph output would hold [size, V] float32 each)
        self.logits = None
        if self.parallel.is_last_stage:
            self.logits = torch.empty(n, model.config.vocab_size, dtype=torch.float32, device=device)

    def _forward_decode(self, size: int) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits [size, V] on the last stage; (h, residual) [size, H] each on a stage before it."""
        intermediate = None if self.stage_input is None else tuple(b[:size] for b in self.stage_input)
        out = self.model(self.decode.input_ids[:size], _decode_part(self.decode, size), None, intermediate)
        return self.model.compute_logits(out) if self.parallel.is_last_stage else out

    def _forward_single(self, size: int) -> torch.Tensor:
        batch = _chunk_part(self.single, self.single_cu_seqlens, size)
        if self.padded is not None and size in self.padded.plans:
            batch.padded = self.padded.plans[size]
        hidden = self.model(self.single.input_ids[:size], batch)
        return self.model.compute_logits(hidden.index_select(0, batch.logits_indices))  # [1, V]

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.use_graphs:
            return
        pool = torch.cuda.graph_pool_handle()
        # largest first: smaller graphs reuse its pool memory
        kinds = [(self.graphs, self._forward_decode, s) for s in self.sizes]
        kinds += [(self.chunk_graphs, self._forward_single, s) for s in self.chunk_sizes]
        for graphs, forward, size in sorted(kinds, key=lambda kind: -kind[2]):
            if graphs is self.chunk_graphs:  # a fresh chunk of `size` tokens on the dummy slot and the null block
                self.single.block_tables[0].fill_(0)
                _set_chunk(self.single, self.single_cu_seqlens, size, size, size, 0, False)
                if self.padded is not None and size in self.padded.plans:
                    self.padded.set(size, size, size, 0)
            for _ in range(2):  # warm up: Triton compiles, cuBLAS picks its kernels
                forward(size)
            torch.cuda.synchronize()
            if graphs is self.chunk_graphs and self.padded is not None and size in self.padded.plans:
                self.padded.renew_offsets(size)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = forward(size)
                if isinstance(out, tuple):  # a stage before the last: its (h, residual)
                    for static, tensor in zip(self.stage_output, out):
                        static[:size].copy_(tensor)
                else:
                    self.logits[: out.shape[0]].copy_(out)
            graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)
        if self.chunk_sizes:
            logger.info("captured CUDA graphs for one prompt chunk of up to %s tokens", self.chunk_sizes)

    def padded_size(self, n: int) -> int | None:
        """The captured size to run n sequences at, or None if n is larger than every graph."""
        return next((s for s in self.sizes if s >= n), None)

    def single_size(self, chunk_len: int, saves_inside: bool = False) -> int | None:
        """The single-chunk graph's row count for a chunk of chunk_len tokens (2 or more), or None; with a
        checkpoint inside the step, only a padded graph's (PADDED_CHUNK_MIN_ROWS rows or more) will do."""
        if chunk_len < 2:
            return None
        least = PADDED_CHUNK_MIN_ROWS if saves_inside else chunk_len
        return next((s for s in self.chunk_sizes if s >= max(chunk_len, least)), None)

    def run_single(self, batch: ForwardBatch, input_ids: torch.Tensor,
                   mid_save: tuple[int, int] | None = None) -> torch.Tensor:
        """Replay the single-chunk graph for a batch of one sequence's chunk (built by ForwardBatch.build), with
        mid_save = (offset, checkpoint slot) of a GDN checkpoint inside the step, if any; returns the logits of
        its last token, [1, V]."""
        chunk_len = input_ids.shape[0]
        size = self.single_size(chunk_len, mid_save is not None)
        _load_chunk(self.single, self.single_cu_seqlens, size, batch, input_ids)
        if self.padded is not None and size in self.padded.plans:
            stop, checkpoint_slot = mid_save if mid_save is not None else (chunk_len, 0)
            self.padded.set(size, chunk_len, stop, checkpoint_slot)
        elif mid_save is not None:
            raise ValueError(f"a step of {chunk_len} tokens with a checkpoint inside it has no padded graph")
        if not self.use_graphs:
            return self._forward_single(size)
        self.chunk_graphs[size].replay()
        return self.logits[:1]

    def run(self, batch: ForwardBatch, input_ids: torch.Tensor,
            intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Replay the graph for this decode batch; returns logits [n, V] on the last stage, (h, residual) [n, H]
        each on a stage before it (views of the static outputs). A stage after the first takes the previous
        stage's (h, residual), [n, H] each, as `intermediate` (the padding rows keep what they held: their
        outputs are never read, and they write no cache)."""
        n = batch.num_seqs
        size = self.padded_size(n)
        _fill_decode_rows(self.decode, batch, input_ids, n, size)
        if self.stage_input is not None:
            for static, tensor in zip(self.stage_input, intermediate):
                static[:n].copy_(tensor)
        if not self.use_graphs:
            out = self._forward_decode(size)
        else:
            self.graphs[size].replay()
            out = self.logits if self.stage_output is None else self.stage_output
        return tuple(t[:n] for t in out) if isinstance(out, tuple) else out[:n]


def _fill_decode_rows(buffers: _StaticBatch, batch: ForwardBatch, input_ids: torch.Tensor, n: int, size: int):
    """Copy the batch's first n sequences (one token each) into the buffers' first rows; pad to `size`."""
    width = batch.block_tables.shape[1]
    buffers.input_ids[:n].copy_(input_ids[:n])
    buffers.positions[:n].copy_(batch.positions[:n])
    buffers.slot_mapping[:n].copy_(batch.slot_mapping[:n])
    buffers.seq_lens[:n].copy_(batch.seq_lens[:n])
    buffers.state_slots[:n].copy_(batch.state_slots[:n])
    buffers.block_tables[:n, :width].copy_(batch.block_tables[:n])
    if size > n:  # padding rows: dummy slot, null block, no cache write
        buffers.slot_mapping[n:size].fill_(-1)
        buffers.seq_lens[n:size].fill_(1)
        buffers.state_slots[n:size].fill_(0)
        buffers.block_tables[n:size].fill_(0)


def _decode_part(buffers: _StaticBatch, size: int) -> ForwardBatch:
    """The first `size` rows of a graph's buffers as decode rows: one token each, continuing its state."""
    return ForwardBatch(
        positions=buffers.positions[:size], cu_seqlens_q=buffers.cu_seqlens[: size + 1],
        seq_lens=buffers.seq_lens[:size], block_tables=buffers.block_tables[:size],
        slot_mapping=buffers.slot_mapping[:size], state_slots=buffers.state_slots[:size],
        has_initial_state=buffers.has_initial_state[:size], logits_indices=buffers.cu_seqlens[:size],
        max_query_len=1, cu_seqlens_cpu=None, is_decode=True)


def _chunk_part(buffers: _StaticBatch, cu_seqlens: torch.Tensor, rows: int) -> ForwardBatch:
    """A single-chunk graph's batch: `rows` rows and two sequences, the chunk then its padding; cu_seqlens
    [0, chunk length, rows]."""
    return ForwardBatch(
        positions=buffers.positions[:rows], cu_seqlens_q=cu_seqlens, seq_lens=buffers.seq_lens[:2],
        block_tables=buffers.block_tables[:2], slot_mapping=buffers.slot_mapping[:rows],
        state_slots=buffers.state_slots[:2], has_initial_state=buffers.has_initial_state[:2],
        logits_indices=cu_seqlens[1:2] - 1, max_query_len=rows, cu_seqlens_cpu=None, is_decode=False)


def _set_chunk(buffers: _StaticBatch, cu_seqlens: torch.Tensor, rows: int, chunk_len: int, seq_len, state_slot,
               has_initial) -> None:
    """The batch's two sequences (see `_chunk_part`): the chunk (chunk_len tokens, KV length seq_len after the
    step, its state slot and whether it continues a state) and its padding (the rest of the rows, maybe none,
    from zero state on the dummy slot, the null block and no cache writes)."""
    for buffer, value in ((buffers.seq_lens, seq_len), (buffers.state_slots, state_slot),
                          (buffers.has_initial_state, has_initial)):
        if isinstance(value, torch.Tensor):
            buffer[0].copy_(value)  # a device scalar: no sync
        else:
            buffer[0].fill_(value)
    buffers.seq_lens[1].fill_(rows - chunk_len)
    buffers.state_slots[1].fill_(0)
    buffers.has_initial_state[1].fill_(False)
    buffers.block_tables[1].fill_(0)
    buffers.slot_mapping[chunk_len:rows].fill_(-1)
    cu_seqlens[1].fill_(chunk_len)
    cu_seqlens[2].fill_(rows)


def _load_chunk(buffers: _StaticBatch, cu_seqlens: torch.Tensor, rows: int, batch: ForwardBatch,
                input_ids: torch.Tensor) -> None:
    """Copy the batch's one sequence into the buffers (see `_chunk_part`), padded to `rows` rows."""
    chunk_len = input_ids.shape[0]
    buffers.input_ids[:chunk_len].copy_(input_ids)
    buffers.positions[:chunk_len].copy_(batch.positions)
    buffers.slot_mapping[:chunk_len].copy_(batch.slot_mapping)
    width = batch.block_tables.shape[1]
    buffers.block_tables[0, :width].copy_(batch.block_tables[0])
    buffers.block_tables[0, width:].fill_(0)
    _set_chunk(buffers, cu_seqlens, rows, chunk_len, batch.seq_lens[0], batch.state_slots[0],
               batch.has_initial_state[0])
