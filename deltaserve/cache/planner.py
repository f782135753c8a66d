"""The memory plan: where every byte of the device goes, computed before anything is allocated.

    device memory x --gpu-memory-utilization = the budget
    +---------+-------------+-------------+---------+-------------------+-------------+-----------+--------+
    | weights | activations | CUDA graphs | runtime | GDN working slots | checkpoints | KV blocks | unused |
    +---------+-------------+-------------+---------+-------------------+-------------+-----------+--------+
                                                    |<------------------- cache memory ------------------->|

Weights are counted exactly from the config; activations and graphs are estimated offline and measured at
GPU startup (`activation_bytes`, `overhead_bytes`). The cache memory holds the GDN state slots first (one
per running sequence, the dummy slot, the prefix cache's checkpoint slots), then as many KV blocks as fit.
--kv-cache-memory-bytes sets the cache memory exactly, as in vLLM, whose hybrid models keep their Mamba
state in the same budget as their KV blocks.

Rules, in order (each one is a line in `notes` when it changes what the user asked for):
1. --max-num-seqs is clamped to the largest count whose working state slots take at most their share of the
   cache memory beside the checkpoints, (kL + s) / (2kL + s) (about half; see _clamp_num_seqs), and leave room
   for one request of the target length L (--max-model-len, or the model's own limit). If not even one sequence
   leaves that room, the share alone applies.
2. An explicit --max-model-len longer than the pool is an error naming the token counts and the smallest
   change that fits. Otherwise (auto) max_model_len is the model's limit or the pool, whichever is smaller.
   The pool must hold max_model_len tokens of one request, rounded up to whole blocks.
3. When no flag fixes the cache size, the KV pool never grows past what max_num_seqs requests of the
   target length can use (a tiny model on a big GPU).

Under tensor / pipeline parallelism the plan is one rank's (`parallel`): its share of the weights and of each
token's KV and each sequence's GDN state (cache/rank_share.py), against one device's memory.

Pure arithmetic on config numbers: no tensors, no CUDA, so `deltaserve plan` runs anywhere.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

from deltaserve.cache.footprint import (DTYPE_BYTES, count_parameters, estimate_activation_bytes,
                                        estimate_cuda_graph_bytes, kv_bytes_per_token, kv_cache_dtype, model_dtype,
                                        quant_scratch_bytes, ssm_cache_dtype, state_bytes_per_slot, weight_bytes)
from deltaserve.cache.rank_share import rank_config, rank_share
from deltaserve.config import ConfigError, EngineConfig, ModelConfig
from deltaserve.graph_sizes import cuda_graph_count
from deltaserve.parallel_layout import ONE_RANK, RankLayout

CPU_CACHE_BYTES = 1 << 30  # cache memory on the CPU when no flag sizes it
RUNTIME_OVERHEAD_ESTIMATE = 1 << 30  # CUDA context and library workspaces, until the GPU measures them
# Prefix-cache checkpoint slots when --prefix-cache-state-slots is unset: this many, but at most this share
# of the cache memory and half of what is spare beside one full-length request (a Qwen3.5-27B checkpoint
# is 147 MiB: 64 of them would crowd out a small GPU's KV). See _Budget._default_checkpoint_slots.
DEFAULT_CHECKPOINT_SLOTS = 64
DEFAULT_CHECKPOINT_SHARE = 0.1
_UTILIZATION = "--gpu-memory-utilization"  # the cache-memory sources
_KV_BYTES_FLAG = "--kv-cache-memory-bytes"
_CPU_DEFAULT = "CPU default"


class PlanError(ConfigError):
    """The configuration does not fit in memory; the message names the numbers and a change that fits."""


def gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"


@dataclass(frozen=True)
class MemoryPlan:
    """Every figure of the plan. Sizes in bytes; `num_blocks` counts the null block and `num_working_slots`
    the dummy slot."""

    model_name: str
    device_name: str | None
    device_memory_bytes: int | None  # None: not planned against a device
    gpu_memory_utilization: float
    model_dtype: str
    kv_cache_dtype: str
    conv_state_dtype: str
    ssm_state_dtype: str
    weight_format: str | None  # None: weights in the model dtype; else the quantized format's description
    num_parameters: int
    weight_bytes_by_format: dict[str, int]
    quant_scratch_bytes: int  # the int4 / NVFP4 prefill's dequantized copy of its largest matrix (GPU only)
    activation_bytes: int
    activation_measured: bool
    cuda_graph_bytes: int
    num_cuda_graphs: int
    overhead_bytes: int
    overhead_measured: bool
    cache_memory_bytes: int  # states + KV; negative when the fixed costs exceed the budget
    cache_memory_source: str  # "--gpu-memory-utilization" | "--kv-cache-memory-bytes" | "CPU default"
    conv_bytes_per_slot: int
    ssm_bytes_per_slot: int
    num_working_slots: int
    num_checkpoint_slots: int
    block_size: int
    kv_bytes_per_token: int
    num_blocks: int
    requested_max_num_seqs: int
    max_num_seqs: int
    model_max_len: int
    max_model_len: int
    max_num_batched_tokens: int
    kv_formula: str  # how kv_bytes_per_token and the state sizes come about, for the printout
    state_formula: str
    notes: tuple[str, ...] = ()
    error: str | None = None
    rank: str | None = None  # which rank's share this plan is, under tensor / pipeline parallelism

    @property
    def weight_bytes(self) -> int:
        return sum(self.weight_bytes_by_format.values())

    @property
    def state_bytes_per_slot(self) -> int:
        return self.conv_bytes_per_slot + self.ssm_bytes_per_slot

    @property
    def num_state_slots(self) -> int:
        """Rows of the state pool tensors: dummy + working + checkpoint slots."""
        return self.num_working_slots + self.num_checkpoint_slots

    @property
    def kv_bytes_per_block(self) -> int:
        return self.kv_bytes_per_token * self.block_size

    @property
    def pool_tokens(self) -> int:
        """Tokens the KV pool holds (the null block excluded)."""
        return max(self.num_blocks - 1, 0) * self.block_size

    @property
    def max_context(self) -> int:
        """The longest context one request could reach: the pool, capped by the model's limit."""
        return min(self.pool_tokens, self.model_max_len)

    @property
    def full_length_requests(self) -> int:
        """Requests of max_model_len tokens whose KV fits in the pool at once (at most max_num_seqs)."""
        blocks = math.ceil(self.max_model_len / self.block_size)
        return min(self.max_num_seqs, max(self.num_blocks - 1, 0) // blocks) if blocks else 0

    @property
    def budget_bytes(self) -> int | None:
        """device memory x utilization; None when a flag or the CPU default sizes the cache."""
        if self.cache_memory_source != _UTILIZATION:
            return None
        return int(self.device_memory_bytes * self.gpu_memory_utilization)

    @property
    def fixed_bytes(self) -> int:
        """Everything that is not cache: weights, their scratch, activations, CUDA graphs, runtime overhead."""
        return self.weight_bytes + self.quant_scratch_bytes + self.activation_bytes + self.cuda_graph_bytes + self.overhead_bytes

    def check(self) -> MemoryPlan:
        """Raise PlanError when the configuration does not fit; return the plan otherwise."""
        if self.error is not None:
            raise PlanError(self.error)
        return self

    def info_labels(self) -> dict[str, str]:
        """Labels for an info gauge in /metrics, shaped like vLLM's `cache_config_info` (its names first)."""
        figures = dict(block_size=self.block_size, cache_dtype=self.kv_cache_dtype,
                       gpu_memory_utilization=self.gpu_memory_utilization, num_gpu_blocks=self.num_blocks,
                       kv_cache_memory_bytes=self.cache_memory_bytes, mamba_cache_dtype=self.conv_state_dtype,
                       mamba_ssm_cache_dtype=self.ssm_state_dtype, max_model_len=self.max_model_len,
                       max_num_seqs=self.max_num_seqs, num_state_slots=self.num_state_slots,
                       num_checkpoint_slots=self.num_checkpoint_slots, kv_bytes_per_token=self.kv_bytes_per_token,
                       state_bytes_per_seq=self.state_bytes_per_slot, pool_tokens=self.pool_tokens,
                       full_length_requests=self.full_length_requests, weight_bytes=self.weight_bytes,
                       activation_bytes=self.activation_bytes, cuda_graph_bytes=self.cuda_graph_bytes)
        return {name: str(value) for name, value in figures.items()}


def _largest(low: int, high: int, ok: Callable[[int], bool]) -> int:
    """The largest n in [low, high] with ok(n), for ok true at low and monotone (true ... true, false ...)."""
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if ok(mid) else (low, mid - 1)
    return low


class _Budget:
    """What n running sequences cost and leave: fixed costs, cache memory, state slots, KV blocks."""

    def __init__(self, cfg: ModelConfig, engine: EngineConfig, dtype: str, weights: int, state_bytes: int,
                 block_bytes: int, need_blocks: int, on_gpu: bool, device_memory_bytes: int | None,
                 activation_bytes: int | None, overhead_bytes: int | None):
        self.cfg, self.engine, self.dtype, self.weights = cfg, engine, dtype, weights
        self.state_bytes, self.block_bytes = state_bytes, block_bytes
        self.on_gpu, self.device_memory_bytes = on_gpu, device_memory_bytes
        self.activation_bytes, self.overhead_bytes = activation_bytes, overhead_bytes
        # room: the memory for the cache, and on the GPU also for activations, graphs and the runtime
        if engine.kv_cache_memory_bytes is not None:
            self.source, self.room = _KV_BYTES_FLAG, engine.kv_cache_memory_bytes
        elif not on_gpu:
            self.source, self.room = _CPU_DEFAULT, CPU_CACHE_BYTES
        elif device_memory_bytes is None:
            raise ValueError("planning for a GPU needs its memory (device_memory_bytes) or --kv-cache-memory-bytes")
        else:
            self.source = _UTILIZATION
            self.room = int(device_memory_bytes * engine.gpu_memory_utilization) - weights
        self.checkpoint_slots = 0
        if engine.enable_prefix_caching:
            self.checkpoint_slots = engine.prefix_cache_state_slots
            if self.checkpoint_slots is None:
                self.checkpoint_slots = self._default_checkpoint_slots(need_blocks)

    def _default_checkpoint_slots(self, need_blocks: int) -> int:
        """DEFAULT_CHECKPOINT_SLOTS, at most DEFAULT_CHECKPOINT_SHARE of the cache memory, and at most half of
        the state slots that fit beside one target-length request and one sequence (the other half is left
        to working sequences). Measured with one sequence, so that it does not depend on --max-num-seqs."""
        cache = self.cache_memory(1)
        share = int(DEFAULT_CHECKPOINT_SHARE * cache) // self.state_bytes
        spare = (cache - need_blocks * self.block_bytes) // self.state_bytes - 2  # - the sequence and the dummy
        if spare >= 0:  # else the target does not fit anyway (auto shrinks it): the share alone applies
            share = min(share, spare // 2)
        return max(0, min(DEFAULT_CHECKPOINT_SLOTS, share))

    def fixed_costs(self, num_seqs: int) -> tuple[int, int, int]:
        """(activations, CUDA graphs, runtime overhead) with num_seqs sequences; nothing on the CPU."""
        if not self.on_gpu:
            return 0, 0, 0
        tokens = self.engine.max_num_batched_tokens
        activation = self.activation_bytes
        if activation is None:
            activation = estimate_activation_bytes(self.cfg, self.dtype, tokens, min(num_seqs, tokens))
        graphs = 0 if self.engine.enforce_eager else estimate_cuda_graph_bytes(self.cfg, self.dtype, num_seqs,
                                                                                self.engine.performance_mode)
        return activation, graphs, RUNTIME_OVERHEAD_ESTIMATE if self.overhead_bytes is None else self.overhead_bytes

    def cache_memory(self, num_seqs: int) -> int:
        """Memory for the state slots and KV blocks with num_seqs sequences."""
        if self.source != _UTILIZATION:
            return self.room
        return self.room - sum(self.fixed_costs(num_seqs))

    def states(self, num_seqs: int) -> int:
        """Bytes of the state slots: working + dummy + checkpoints."""
        return (num_seqs + 1 + self.checkpoint_slots) * self.state_bytes

    def blocks_left(self, num_seqs: int) -> int:
        """KV blocks (the null block included) that fit beside the state slots."""
        left = self.cache_memory(num_seqs) - self.states(num_seqs)
        if self.block_bytes == 0:  # a pipeline stage without attention layers: its blocks cost nothing
            return sys.maxsize if left >= 0 else -1
        return left // self.block_bytes


def plan(cfg: ModelConfig, engine: EngineConfig, *, device_memory_bytes: int | None = None, on_gpu: bool = True,
         activation_bytes: int | None = None, overhead_bytes: int | None = None,
         weight_format=None, model_name: str = "model", device_name: str | None = None,
         parallel: RankLayout = ONE_RANK) -> MemoryPlan:
    """Plan the memory of `cfg` served with `engine`'s flags.

    device_memory_bytes: the device's total memory (needed on the GPU unless --kv-cache-memory-bytes is set).
    on_gpu: False plans the CPU engine (cache memory from the flag, else CPU_CACHE_BYTES; nothing else counts).
    activation_bytes, overhead_bytes: measured at GPU startup; None estimates them.
    weight_format: the checkpoint's quantization (a layers/quant WeightFormat, from detect_weight_format), or None.
    parallel: the rank planned (its tp/pp place; ONE_RANK: the whole model on one device).
    A configuration that does not fit gives a plan whose `error` says why; `plan(...).check()` raises it.
    """
    rank = None
    share = rank_share(cfg, parallel)
    if parallel.world_size > 1:
        layers = parallel.stage_layers(cfg.num_layers)
        rank = (f"one rank of tensor-parallel size {parallel.tp_size} (its ranks alike), pipeline stage "
                f"{parallel.pp_rank} of {parallel.pp_size}: layers {layers.start}-{layers.stop - 1} of {cfg.num_layers}")
        cfg = rank_config(cfg, parallel)
    dtype = model_dtype(engine.dtype, cfg, on_gpu)
    kv_dtype = kv_cache_dtype(engine.kv_cache_dtype, dtype)
    ssm_dtype = ssm_cache_dtype(engine.mamba_ssm_cache_dtype, cfg, dtype)
    conv_bytes, ssm_bytes = state_bytes_per_slot(cfg, dtype, ssm_dtype)  # the conv state keeps the model dtype
    per_token = kv_bytes_per_token(cfg, kv_dtype)
    weights = weight_bytes(cfg, dtype, weight_format, share)
    scratch = quant_scratch_bytes(cfg, dtype, weight_format, share.first_layer) if on_gpu else 0
    bs, limit = engine.block_size, cfg.max_position_embeddings
    target_len = engine.max_model_len or limit
    need_blocks = math.ceil(target_len / bs) + 1  # + the null block
    budget = _Budget(cfg, engine, dtype, sum(weights.values()) + scratch, conv_bytes + ssm_bytes, per_token * bs,
                     need_blocks, on_gpu, device_memory_bytes, activation_bytes, overhead_bytes)
    checkpoint_slots = budget.checkpoint_slots
    notes: list[str] = []
    if weight_format is not None and parallel.tp_size > 1 and not weight_format.tensor_parallel:
        notes.append(f"deltaserve serve does not load {weight_format.method} checkpoints under --tensor-parallel-size "
                     f"{parallel.tp_size} yet: these figures are what it would take")

    requested = num_seqs = engine.max_num_seqs
    if engine.num_gpu_blocks_override is not None:
        num_blocks = engine.num_gpu_blocks_override
    else:
        num_seqs = _clamp_num_seqs(budget, requested, target_len, need_blocks, notes)
        num_blocks = budget.blocks_left(num_seqs)
        useful = math.ceil(num_seqs * target_len / bs) + 1
        # (a stage without attention layers has no byte bound at all, whatever sized the cache)
        if (budget.source != _KV_BYTES_FLAG or budget.block_bytes == 0) and num_blocks > useful:
            num_blocks = useful
            notes.append(f"KV pool capped at {useful - 1:,} blocks: {num_seqs} sequences of {target_len:,} tokens "
                         "use no more")
    pool_tokens = max(num_blocks - 1, 0) * bs
    activation, graphs, overhead = budget.fixed_costs(num_seqs)

    if engine.max_model_len is not None:
        max_model_len = engine.max_model_len
    else:
        max_model_len = min(limit, pool_tokens)
        if 0 < pool_tokens < limit:
            notes.append(f"max_model_len {pool_tokens:,}: the largest the KV pool holds (the model allows {limit:,})")
    error = _error(budget, num_seqs, num_blocks, need_blocks, kv_dtype, activation + graphs + overhead)

    num_attention, num_gdn = len(cfg.full_attention_layers), len(cfg.linear_attention_layers)
    return MemoryPlan(
        model_name=model_name, device_name=device_name, device_memory_bytes=device_memory_bytes,
        gpu_memory_utilization=engine.gpu_memory_utilization, model_dtype=dtype, kv_cache_dtype=kv_dtype,
        conv_state_dtype=dtype, ssm_state_dtype=ssm_dtype,
        weight_format=None if weight_format is None else weight_format.description,
        num_parameters=sum(count_parameters(cfg, share).values()), weight_bytes_by_format=weights,
        quant_scratch_bytes=scratch,
        activation_bytes=activation, activation_measured=on_gpu and activation_bytes is not None,
        cuda_graph_bytes=graphs, num_cuda_graphs=cuda_graph_count(num_seqs, engine.performance_mode) if graphs else 0,
        overhead_bytes=overhead, overhead_measured=on_gpu and overhead_bytes is not None,
        cache_memory_bytes=budget.cache_memory(num_seqs), cache_memory_source=budget.source,
        conv_bytes_per_slot=conv_bytes, ssm_bytes_per_slot=ssm_bytes, num_working_slots=num_seqs + 1,
        num_checkpoint_slots=checkpoint_slots, block_size=bs, kv_bytes_per_token=per_token,
        num_blocks=max(num_blocks, 0), requested_max_num_seqs=requested, max_num_seqs=num_seqs,
        model_max_len=limit, max_model_len=max_model_len, max_num_batched_tokens=engine.max_num_batched_tokens,
        kv_formula=(f"{per_token:,} B = {num_attention} attention layers x 2 (K, V) x {cfg.num_kv_heads} KV heads x "
                    f"{cfg.head_dim} x {DTYPE_BYTES[kv_dtype]} B ({kv_dtype})"),
        state_formula=(f"{conv_bytes + ssm_bytes:,} B = {num_gdn} GDN layers x (conv {cfg.conv_dim:,} x "
                       f"{cfg.conv_kernel - 1} x {DTYPE_BYTES[dtype]} B + recurrent {cfg.gdn_num_v_heads} x "
                       f"{cfg.gdn_k_dim} x {cfg.gdn_v_dim} x {DTYPE_BYTES[ssm_dtype]} B)"),
        notes=tuple(notes), error=error, rank=rank)


def _clamp_num_seqs(budget: _Budget, requested: int, target_len: int, need_blocks: int, notes: list[str]) -> int:
    """Rule 1: the most sequences (<= requested) whose working state slots take at most their share of the cache
    memory beside the checkpoint slots and leave room for one target-length request; if even one sequence does
    not, the most whose working slots take at most that share.

    The share: slots and KV blocks are two pools fixed at start-up, where one shared pool would run as many
    requests as their states and tokens fit. With a fraction a of the memory in slots, requests of length l run
    min(a (s + k l) / s, (1 - a)(s + k l) / (k l)) times as many as a shared pool would (s: a state's bytes, k: KV
    bytes a token); its worst over 0 < l <= L (the target length) is min(a, (1 - a)(1 + s / kL)), best at
    a = (kL + s) / (2kL + s): about half for a long L, more for a short one."""
    kv_target, state = (need_blocks - 1) * budget.block_bytes, budget.state_bytes
    share = (kv_target + state, 2 * kv_target + state)  # a as a fraction

    def holds_target(num_seqs: int) -> bool:
        return budget.blocks_left(num_seqs) >= need_blocks

    def within_share(num_seqs: int) -> bool:
        """The working slots take at most their share of what the checkpoint slots leave (a stage without
        attention layers has no KV blocks to share it with)."""
        working, checkpoints = (num_seqs + 1) * state, budget.checkpoint_slots * state
        return budget.block_bytes == 0 or working * share[1] <= share[0] * (budget.cache_memory(num_seqs) - checkpoints)

    def most_within_share(high: int) -> int:
        return _largest(1, high, within_share) if within_share(1) else 1

    if holds_target(requested) and within_share(requested):
        return requested
    if budget.cache_memory(1) < budget.states(1):
        return requested  # the fixed costs leave no cache memory at all: no count of sequences helps
    percent = f"{100 * share[0] / share[1]:.0f}%"
    if not holds_target(1):
        num_seqs = most_within_share(requested)
        if num_seqs < requested:
            notes.append(f"--max-num-seqs clamped from {requested} to {num_seqs}: not even one {target_len:,}-token "
                         f"request fits, so the working GDN state slots get at most {percent} of the cache memory "
                         "beside the checkpoint slots")
        return num_seqs
    if not holds_target(requested):
        num_seqs = _largest(1, requested, holds_target)
        reason = (f"{requested + 1 + budget.checkpoint_slots} GDN state slots of {mib(state)} would leave the KV pool "
                  f"less than one {target_len:,}-token request")
    else:
        num_seqs, reason = requested, ""
    if not within_share(num_seqs):
        num_seqs = most_within_share(num_seqs)
        reason = (f"{requested + 1} working GDN state slots of {mib(state)} would take more than {percent} of the "
                  "cache memory beside the checkpoint slots (the KV pool gets the rest: the split that runs the most "
                  f"requests at once at their worst length up to {target_len:,})")
    notes.append(f"--max-num-seqs clamped from {requested} to {num_seqs}: {reason}")
    return num_seqs


def _error(budget: _Budget, num_seqs: int, num_blocks: int, need_blocks: int, kv_dtype: str,
           fixed_without_weights: int) -> str | None:
    """Rule 2 and the plain "nothing fits" cases: the message naming the numbers, or None if all fits."""
    engine, bs = budget.engine, budget.engine.block_size
    asked, limit = engine.max_model_len, budget.cfg.max_position_embeddings
    pool_tokens = max(num_blocks - 1, 0) * bs
    fixed = budget.weights + fixed_without_weights
    slots = f"{num_seqs + 1 + budget.checkpoint_slots} GDN state slots of {mib(budget.state_bytes)}"
    if num_blocks < 2:
        cache, states = budget.cache_memory(num_seqs), budget.states(num_seqs)
        room = f"{slots} take {gib(states)} and one KV block needs {mib(budget.block_bytes)}"
        if budget.source == _KV_BYTES_FLAG:
            return f"no room for the KV cache: --kv-cache-memory-bytes {cache:,} is too small: {room}"
        if budget.source == _CPU_DEFAULT:
            return f"no room for the KV cache: the CPU default cache memory ({gib(cache)}) is too small: {room}"
        return (f"the budget is {gib(cache + fixed)} ({engine.gpu_memory_utilization} x "
                f"{gib(budget.device_memory_bytes)}); weights take {gib(budget.weights)} and activations, CUDA "
                f"graphs and runtime {gib(fixed_without_weights)}, which leaves {gib(cache)} for the cache, where "
                f"{room}")
    if asked is not None and asked > limit:
        return f"--max-model-len {asked:,} exceeds the model's max_position_embeddings {limit:,}"
    if asked is not None and asked > pool_tokens:
        cache_needed = budget.states(num_seqs) + need_blocks * budget.block_bytes
        message = (f"--max-model-len {asked:,} does not fit: it needs {asked:,} tokens of KV cache; the pool holds "
                   f"{pool_tokens:,} ({num_blocks - 1:,} blocks of {bs} tokens beside {slots}). "
                   f"{_bigger_cache_hint(budget, cache_needed, fixed, need_blocks)}, or lower --max-model-len to "
                   f"{pool_tokens:,}")
        if DTYPE_BYTES[kv_dtype] > 1 and engine.num_gpu_blocks_override is None:
            fp8_blocks = num_blocks * DTYPE_BYTES[kv_dtype]  # fp8 stores a block in 1/itemsize of the bytes
            message += f", or use --kv-cache-dtype fp8 (the pool would hold about {(fp8_blocks - 1) * bs:,} tokens)"
        return message
    if engine.num_gpu_blocks_override is not None and budget.source == _UTILIZATION:
        total = fixed + budget.states(num_seqs) + num_blocks * budget.block_bytes
        if total > budget.device_memory_bytes:
            return (f"--num-gpu-blocks-override {num_blocks:,} does not fit on this device: with the weights, "
                    f"activations, CUDA graphs, runtime and {slots} it needs {gib(total)} of "
                    f"{gib(budget.device_memory_bytes)}")
    if budget.source == _KV_BYTES_FLAG and budget.device_memory_bytes is not None:
        total = fixed + engine.kv_cache_memory_bytes
        if total > budget.device_memory_bytes:
            return (f"--kv-cache-memory-bytes {engine.kv_cache_memory_bytes:,} does not fit on this device: with "
                    f"the weights, activations, CUDA graphs and runtime it needs {gib(total)} of "
                    f"{gib(budget.device_memory_bytes)}")
    return None


def _bigger_cache_hint(budget: _Budget, cache_needed: int, fixed: int, need_blocks: int) -> str:
    """The smallest raise of the flag that sizes the cache, so that the pool holds the wanted length."""
    if budget.engine.num_gpu_blocks_override is not None:
        return f"Raise --num-gpu-blocks-override to at least {need_blocks:,}"
    if budget.source != _UTILIZATION:
        return f"Raise --kv-cache-memory-bytes to at least {cache_needed:,}"
    device = budget.device_memory_bytes
    utilization = math.ceil((fixed + cache_needed) / device * 1000) / 1000
    if utilization <= 1.0:
        return (f"Raise --gpu-memory-utilization to at least {utilization:.3f} (or set --kv-cache-memory-bytes "
                f"{cache_needed:,})")
    return f"It needs {gib(fixed + cache_needed)} in all, more than the device's {gib(device)}: use a larger GPU"
