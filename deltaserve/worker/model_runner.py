"""ModelRunner: SchedulerOutput -> flattened tensors -> forward -> sample -> ModelOutput.

`launch` queues a step on the device and returns at once; `collect` waits for its samples (`execute` does
both). Between the two the engine may schedule and launch the next step (async scheduling): a row whose last
input is a sample still on the device (`pending_input`) takes it from the previous launch's token ids. A step
with structured-output rows is launched with `defer_sample`: its forward is queued, and `sample` queues its
sampling once the engine has filled the grammar bitmask on the host (while the device runs the forward).

On CUDA, decode-only steps and steps of one sequence's chunk of up to 1,024 tokens (single-chunk steps) run on
static padded buffers (see cuda_graph.py), replayed as CUDA graphs unless enforce_eager; every other step, and
every step on the CPU, runs the model eagerly on its own tensors. Under pipeline parallelism each stage replays its
own decode graphs (the hidden states between stages sent and received outside them, cuda_graph.py); single-chunk
steps run eagerly there.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deltaserve.graph_sizes import PADDED_CHUNK_MIN_ROWS, PADDED_GRAPH_MAX_PAIRS
from deltaserve.device import to_device
from deltaserve.layers.batch import ForwardBatch
from deltaserve.layers.mlp import SparseMoE
from deltaserve.model.qwen3_5 import HybridForCausalLM
from deltaserve.resolved_config import ResolvedConfig
from deltaserve.worker.sampler import PendingSample, Sampler, make_generator
from deltaserve.sched_output import ModelOutput, ScheduledSequence, SchedulerOutput
from deltaserve.structured import bitmask as grammar_bitmask
from deltaserve.worker import warm_up
from deltaserve.worker.cuda_graph import StepGraphs
from deltaserve.worker.distributed import recv_from_previous_stage, send_to_next_stage
from deltaserve.worker.kv_cache import CacheShape, bind_caches
from deltaserve.worker.state_copy import restore_checkpoints, save_checkpoints

logger = logging.getLogger(__name__)

# the shortest time between two hand-backs of torch's cached blocks above the memory ceiling (each waits for its step)
MEMORY_TRIM_INTERVAL_S = 1.0


def graphs_supported(model: HybridForCausalLM) -> bool:
    """Whether a decode step can be captured: MoE experts run torch's grouped matmul, whose non-bfloat16
    path copies group offsets to the host."""
    has_moe = any(isinstance(module, SparseMoE) for module in model.modules())
    return not has_moe or next(model.parameters()).dtype == torch.bfloat16


@dataclass
class LaunchedStep:
    """A step queued on the device: the requests that sample, in the order of the sample's rows."""

    request_ids: list[str]
    sample: PendingSample | None
    # a step launched with defer_sample, until ModelRunner.sample: its sampling rows and their logits [S, V]
    deferred: tuple[list[ScheduledSequence], torch.Tensor] | None = None


class ModelRunner:
    def __init__(self, model: HybridForCausalLM, cache_shape: CacheShape, device: torch.device,
                 resolved: ResolvedConfig):
        self.model = model
        self.device = device
        self.block_size = cache_shape.block_size
        bind_caches(model, cache_shape, device)
        self.sampler = Sampler()
        # request id -> (its Request.serial, its seeded generator): made at the request's first seeded sample,
        # dropped when it finishes (SchedulerOutput.finished_request_ids)
        self._generators: dict[str, tuple[int, torch.Generator]] = {}
        self._bitmask: torch.Tensor | None = None  # host buffer for a step's grammar masks (grammar_bitmask)
        self._bitmask_copied: torch.cuda.Event | None = None  # its last copy to the device
        # the last launched step's samples: request id -> row, and the [S] token ids on the device
        self._last_samples: tuple[dict[str, int], torch.Tensor] = ({}, torch.empty(0, dtype=torch.int64))
        self.graphs: StepGraphs | None = None
        # the device memory in use that an eager step may leave behind (set after start-up from the plan's budget,
        # LLMEngine.warm_up): above it torch's allocator hands back the free blocks it caches (a long prompt's
        # chunks free activations and take them again at other sizes, each size mapping memory of its own)
        self.memory_ceiling: int | None = None
        self._last_trim = -MEMORY_TRIM_INTERVAL_S  # time.monotonic() of the last hand-back
        self.parallel = model.parallel
        if device.type == "cuda":
            from deltaserve.ops import pdl  # GPU only (Triton)

            logger.info("programmatic dependent launch of our kernels: %s", "on" if pdl.verify(device) else
                        f"off ({pdl.ENV_VAR}=0, a GPU before compute capability 9.0, or a failed check)")
            use_graphs = resolved.use_cuda_graphs
            if use_graphs and not graphs_supported(model):
                logger.warning("CUDA graphs are off: torch's grouped matmul for non-bfloat16 MoE experts loops "
                               "on the host")
                use_graphs = False
            if use_graphs and self.parallel.world_size > 1 and dist.get_backend() != "nccl":
                logger.warning("CUDA graphs are off: %s collectives cannot be captured", dist.get_backend())
                use_graphs = False
            # the graphs' block table is wide enough for the longest sequence; eager steps use their own width
            self.graphs = StepGraphs(model, resolved.decode_graph_sizes, resolved.chunk_graph_sizes,
                                     -(-resolved.max_model_len // self.block_size), device,
                                     use_graphs=use_graphs, block_size=self.block_size)
            warm_up.before_capture(model)
            self.graphs.capture()
            warm_up.after_capture(model, device, resolved.max_num_batched_tokens)

    def _prepare(self, scheduled: SchedulerOutput, mid_saves: bool = True) -> tuple[torch.Tensor, ForwardBatch]:
        """The step's input ids and batch; mid_saves False leaves out its checkpoints inside the step (a
        single-chunk graph takes them from the row instead)."""
        rows = scheduled.sequences
        batch = ForwardBatch.build(
            num_computed=[r.num_computed for r in rows],
            query_lens=[len(r.token_ids) for r in rows],
            block_ids=[r.block_ids for r in rows],
            state_slots=[r.state_slot for r in rows],
            block_size=self.block_size,
            device=self.device,
            mid_saves=[(i, *r.mid_save) for i, r in enumerate(rows) if r.mid_save] if mid_saves else (),
        )
        input_ids = to_device([t for r in rows for t in r.token_ids], self.device, torch.int64)
        pending = [i for i, r in enumerate(rows) if r.pending_input]
        if pending:  # async scheduling: those inputs are the previous step's samples, still on the device
            previous_rows, previous_tokens = self._last_samples
            try:
                sources = [previous_rows[rows[i].request_id] for i in pending]
            except KeyError as exc:
                raise RuntimeError(f"request {exc.args[0]!r} waits for a sample the previous step did not "
                                   "draw") from None
            if (len(pending) == len(rows) == input_ids.shape[0] == previous_tokens.shape[0]
                    and sources == list(range(len(rows)))):
                return previous_tokens, batch  # steady decode: the same rows as last step, in the same order
            last_token = batch.cu_seqlens_cpu[1:] - 1  # [N] row of each sequence's last new token
            input_ids.index_copy_(0, to_device(last_token[pending], self.device),
                                  previous_tokens.index_select(0, to_device(sources, self.device)))
        return input_ids, batch

    def _single_graph_serves(self, rows) -> bool:
        """Whether a single-chunk graph runs this step: one sequence computing 2 to 1,024 tokens (see
        worker/cuda_graph.py), in a padded graph only while its paged attention stays cheap (PADDED_GRAPH_MAX_PAIRS)."""
        if self.graphs is None or not self.graphs.chunk_sizes or len(rows) != 1:
            return False
        row = rows[0]
        size = self.graphs.single_size(len(row.token_ids), row.mid_save is not None)
        if size is None:
            return False
        return size < PADDED_CHUNK_MIN_ROWS or size * (row.num_computed + size) <= PADDED_GRAPH_MAX_PAIRS

    @torch.inference_mode()
    def execute(self, scheduled: SchedulerOutput) -> ModelOutput:
        """Run one step and wait for its samples."""
        return self.collect(self.launch(scheduled))

    @torch.inference_mode()
    def launch(self, scheduled: SchedulerOutput, defer_sample: bool = False) -> LaunchedStep:
        """Queue one step's forward pass and sampling on the device; `collect` waits for its samples. With
        `defer_sample` only the forward: `sample` queues the sampling."""
        for request_id in scheduled.finished_request_ids:
            self._generators.pop(request_id, None)
        rows = scheduled.sequences
        single = self._single_graph_serves(rows)
        input_ids, batch = self._prepare(scheduled, mid_saves=not single)
        sampling_rows = [i for i, r in enumerate(rows) if r.sample]
        restore_checkpoints(self.model, scheduled)  # prefix hits: checkpoint -> working slot
        if self.graphs is not None and batch.is_decode and self.graphs.padded_size(len(rows)) is not None:
            # [N, V]; in a decode batch every row samples
            logits = self._through_stage(input_ids, functools.partial(self.graphs.run, batch, input_ids))
            if logits is None:  # a pipeline stage before the last: its outputs went on to the next stage
                save_checkpoints(self.model, scheduled)
                return LaunchedStep([], None)
        elif single:  # one prompt chunk alone
            logits = self.graphs.run_single(batch, input_ids, rows[0].mid_save)  # [1, V], read if it samples
        else:
            # only the sampled sequences' last rows leave the last layer (its attention and MLP skip the rest)
            sample_seqs = to_device(sampling_rows, self.device, torch.int64) if self.parallel.is_last_stage else None
            hidden = self._through_stage(input_ids, functools.partial(self.model, input_ids, batch, sample_seqs))
            if hidden is None:  # a pipeline stage before the last: its outputs went on to the next stage
                save_checkpoints(self.model, scheduled)
                return LaunchedStep([], None)
            if sampling_rows:
                logits = self.model.compute_logits(hidden)  # [S, V] float32
            self._keep_memory_within_ceiling()
        save_checkpoints(self.model, scheduled)  # working slot -> new checkpoint (chunks ending at a boundary)
        if not sampling_rows:
            return LaunchedStep([], None)
        chosen = [rows[i] for i in sampling_rows]
        step = LaunchedStep([r.request_id for r in chosen], None, (chosen, logits))
        if not defer_sample:
            self.sample(step)
        return step

    def _keep_memory_within_ceiling(self) -> None:
        """After an eager step's forward (the steps whose activations come from torch's allocator, not a graph's
        pool): if the device holds more than memory_ceiling, hand back the allocator's free cached blocks. That
        waits for the step, and the next steps map again what they take: so at most once a
        MEMORY_TRIM_INTERVAL_S, which a long prompt's chunks (a second or more each at 200K) all get, and steps
        whose own working set crosses the ceiling pay rarely."""
        if self.memory_ceiling is None or time.monotonic() - self._last_trim < MEMORY_TRIM_INTERVAL_S:
            return
        free, total = torch.cuda.mem_get_info(self.device)
        if total - free > self.memory_ceiling:
            torch.cuda.empty_cache()
            self._last_trim = time.monotonic()

    def _through_stage(self, input_ids: torch.Tensor, forward) -> torch.Tensor | None:
        """This rank's pipeline stage: forward(intermediate), intermediate the previous stage's (h, residual)
        [T, H] each (None on the first stage); the last stage returns its result (hidden states or logits), a
        stage before it sends its (h, residual) to the next and returns None. Send and receive stay outside any
        graph forward replays."""
        parallel = self.parallel
        intermediate = None
        if not parallel.is_first_stage:
            shape = (input_ids.shape[0], self.model.config.hidden_size)
            intermediate = recv_from_previous_stage(parallel, [shape, shape], self.model.dtype, self.device)
        out = forward(intermediate)
        if parallel.is_last_stage:
            return out
        send_to_next_stage(parallel, out)
        return None

    def grammar_bitmask(self, num_rows: int, vocab_size: int) -> torch.Tensor:
        """A host buffer [num_rows, ceil(V/32)] int32 for a step's grammar masks (pinned on CUDA, reused: the
        previous step's copy of it to the device is waited for first)."""
        width = grammar_bitmask.bitmask_width(vocab_size)
        if self._bitmask is None or self._bitmask.shape[0] < num_rows or self._bitmask.shape[1] != width:
            rows = max(num_rows, self._bitmask.shape[0] if self._bitmask is not None else 0)
            self._bitmask = torch.empty(rows, width, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        elif self._bitmask_copied is not None:
            self._bitmask_copied.synchronize()
        return self._bitmask[:num_rows]

    @torch.inference_mode()
    def sample(self, step: LaunchedStep, bitmask: torch.Tensor | None = None, masked_rows: list[int] = ()) -> None:
        """Queue the sampling of a launched step; `bitmask` ([S, ceil(V/32)] on the host, from grammar_bitmask)
        constrains the sampling rows listed in `masked_rows`."""
        chosen, logits = step.deferred
        step.deferred = None
        mask = None
        if bitmask is not None and masked_rows:
            device_bitmask = bitmask.to(self.device, non_blocking=True)
            if self.device.type == "cuda":
                self._bitmask_copied = torch.cuda.Event()
                self._bitmask_copied.record()
            mask = grammar_bitmask.GrammarMask(device_bitmask, list(masked_rows))
        step.sample = self.sampler.sample(
            logits,
            params=[r.params for r in chosen],
            generators=[self._generator(r) for r in chosen],
            prompt_token_ids=[r.prompt_token_ids for r in chosen],
            output_token_ids=[r.output_token_ids for r in chosen],
            eos_token_ids=[r.eos_token_ids for r in chosen],
            grammar_mask=mask,
        )
        self._last_samples = ({rid: i for i, rid in enumerate(step.request_ids)}, step.sample.token_ids)

    def _generator(self, row: ScheduledSequence) -> torch.Generator | None:
        """The row's request's own generator (None without a seed), made at its first sample; a new request
        reusing a finished one's id (another serial) gets a fresh one."""
        if row.seed is None:
            return None
        held = self._generators.get(row.request_id)
        if held is None or held[0] != row.serial:
            held = self._generators[row.request_id] = (row.serial, make_generator(row.seed, self.device))
        return held[1]

    @staticmethod
    def collect(step: LaunchedStep) -> ModelOutput:
        """Wait for a launched step's samples."""
        if step.sample is None:
            return ModelOutput({}, {}, {})
        out = step.sample.result()
        ids = step.request_ids
        top = {rid: t for rid, t in zip(ids, out.top_logprobs) if t is not None}
        return ModelOutput(dict(zip(ids, out.token_ids)), dict(zip(ids, out.logprobs)), top)
