"""EngineSetup: everything the engine resolves once at start-up.

Device and dtypes, the model and its weights, the tokenizer and EOS ids, then the memory plan
(cache/planner.py), which sizes the two cache pools (KV blocks and GDN state slots), clamps max_num_seqs
and picks max_model_len. On the GPU the plan gets measured figures: the activation peak of the largest
step (a profile forward + sampling at startup) and the memory used outside torch's allocator.
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from pathlib import Path

import torch

from deltaserve.cache.block_pool import BlockPool
from deltaserve.cache.cache_manager import CacheManager
from deltaserve.cache.plan_cli import describe_plan, tightest_plan
from deltaserve.cache.planner import MemoryPlan, plan
from deltaserve.cache.prefix_cache import PrefixCache
from deltaserve.cache.state_pool import StatePool
from deltaserve.config import ConfigError, EngineConfig, ModelConfig
from deltaserve.layers.batch import ForwardBatch
from deltaserve.layers.quant import detect_weight_format
from deltaserve.model.loader import build_model, load_model
from deltaserve.model.qwen3_5 import HybridForCausalLM
from deltaserve.model_configs import is_shipped_config, resolve_model
from deltaserve.parallel_layout import RankLayout
from deltaserve.resolved_config import ResolvedConfig, resolve_dtypes
from deltaserve.sampling import SamplingParams
from deltaserve.worker.executor import MultiprocExecutor, WorkerSpec, free_port
from deltaserve.worker.kv_cache import TORCH_DTYPES, CacheShape, bind_caches, release_caches
from deltaserve.worker.model_runner import ModelRunner
from deltaserve.worker.sampler import Sampler

logger = logging.getLogger(__name__)

# torch reads either; a user who sets one has chosen the allocator's behaviour
ALLOCATOR_ENV_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def prefer_expandable_segments() -> bool:
    """Give torch's CUDA allocator expandable segments unless the user configured the allocator. Memory freed
    between start-up's steps is then mapped again where it is needed instead of stranded in fixed-size segments
    (docs/memory.md, 'The allocator'). The variable is set too, so that spawned ranks inherit it. Returns whether
    this call chose them."""
    if any(os.environ.get(name) for name in ALLOCATOR_ENV_VARS):
        return False
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE_SEGMENTS
    # torch may have read the variable already (at import): its setter applies to segments not yet allocated
    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is None:  # the name newer torch deprecates it for
        setter = torch._C._accelerator_setAllocatorSettings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        setter(EXPANDABLE_SEGMENTS)
    return True


class EngineSetup:
    def __init__(self, config: EngineConfig):
        if config.model is None:
            from deltaserve.demo import demo_model_path
            model_path = demo_model_path()
            logger.info("no model given: serving the built-in tiny demo model at %s (a toy trained on a few "
                        "dozen simple topics; pass a checkpoint for real use)", model_path)
        else:  # a local checkpoint, a cached hub snapshot, or (dummy weights) a hub id's shipped config
            model_path = resolve_model(config.model, need_weights=config.load_format != "dummy")
        self.model_path = model_path
        self.model_config = ModelConfig.from_pretrained(model_path)
        self.device = self._device(config.device)
        if self.device.type == "cuda" and prefer_expandable_segments():
            logger.info("torch's CUDA allocator: expandable segments (%s unset; set it to choose otherwise)",
                        " and ".join(ALLOCATOR_ENV_VARS))
        self.dtype = TORCH_DTYPES[resolve_dtypes(config, self.model_config, self.device.type == "cuda")[0]]
        self.tokenizer = None
        if not config.skip_tokenizer_init:
            tokenizer_path = model_path if config.tokenizer is None else resolve_model(
                config.tokenizer, need_weights=False, flag="--tokenizer")
            self.tokenizer = self._tokenizer(tokenizer_path, self.model_config)
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if not self.eos_token_ids and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids = {self.tokenizer.eos_token_id}
        if config.seed is not None:
            torch.manual_seed(config.seed)
        self.weight_format = detect_weight_format(model_path, config.quantization)
        if self.weight_format is not None:
            logger.info("quantized weights: %s", self.weight_format.description)
        world = config.tensor_parallel_size * config.pipeline_parallel_size
        allocated_before = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        if world > 1:  # the workers load the weights; here a shape-only model for the plan
            model = build_model(self.model_config, self.dtype, "meta", self.weight_format)
        else:
            model = load_model(model_path, self.model_config, self.dtype, self.device, config.load_format,
                               config.seed, self.weight_format)

        self.memory_plan = self._plan(config, model, allocated_before)
        # downstream reads these two: the plan's sizes and the figures resolved with it
        self.resolved = ResolvedConfig.resolve(config, self.memory_plan, self.device.type == "cuda")
        self.max_num_seqs = self.resolved.max_num_seqs
        self.max_model_len = self.resolved.max_model_len
        self.num_checkpoint_slots = self.memory_plan.num_checkpoint_slots
        shape = CacheShape.from_plan(self.memory_plan)
        block_pool = BlockPool(shape.num_blocks, shape.block_size)
        state_pool = StatePool(self.memory_plan.num_working_slots, self.num_checkpoint_slots)
        prefix_cache = None
        if config.enable_prefix_caching:
            # entries are only shared between requests of one model, cache layout and dtypes
            quantized = self.weight_format.description if self.weight_format else "unquantized"
            identity = (f"{model_path.resolve()}|{self.dtype}|{quantized}|{shape.kv_dtype}|{shape.ssm_dtype}|"
                        f"{shape.block_size}")
            prefix_cache = PrefixCache(block_pool, state_pool, identity)
        self.cache_manager = CacheManager(block_pool, state_pool, prefix_cache)
        if world == 1:
            self.runner = ModelRunner(model, shape, self.device, self.resolved)
        else:
            self.runner = MultiprocExecutor(WorkerSpec(
                model_path, self.model_config, self.dtype, self.device.type, config.load_format, config.seed,
                self.weight_format, shape, self.resolved, config.tensor_parallel_size, config.pipeline_parallel_size,
                free_port()))

    @staticmethod
    def _device(name: str) -> torch.device:
        if name == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if name == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda was asked for, but no CUDA device is available")
        return torch.device(name)

    @staticmethod
    def _tokenizer(path: Path, model_config: ModelConfig):
        import transformers
        if is_shipped_config(path):  # a published config has no tokenizer: one of its vocabulary's ids
            from deltaserve.bench.vocab_tokenizer import build
            logger.info("%s is a shipped config without a tokenizer: using a synthetic one of its %d ids "
                        "(token i is the word t{i}; `python -m deltaserve.bench.vocab_tokenizer` writes the same "
                        "for `deltaserve bench serve --tokenizer`)", path, model_config.vocab_size)
            eos = model_config.eos_token_ids[0] if model_config.eos_token_ids else None
            return build(model_config.vocab_size, eos)
        try:
            return transformers.AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as exc:
            logger.warning("no tokenizer at %s (%s): only token-id prompts are accepted", path, exc)
            return None

    def _plan(self, config: EngineConfig, model: HybridForCausalLM, allocated_before: int) -> MemoryPlan:
        """The memory plan, logged as one block; raises PlanError (naming the numbers) if it does not fit.
        allocated_before: the bytes torch had allocated before this engine loaded its weights (GPU)."""
        on_gpu = self.device.type == "cuda"
        device_memory = activation = overhead = device_name = None
        if on_gpu and next(model.parameters()).device.type == "meta":
            # several ranks: the workers hold the weights, so the activation peak is estimated, not measured
            free, device_memory = torch.cuda.mem_get_info(self.device)
            overhead, device_name = device_memory - free, torch.cuda.get_device_name(self.device)
        elif on_gpu:
            activation = self._measure_activation(model, config)
            torch.cuda.empty_cache()
            free, device_memory = torch.cuda.mem_get_info(self.device)
            # Device memory in use that is not this engine's live tensors (its weights): the CUDA context, library
            # workspaces, other processes and engines, and what torch's allocator holds but cannot give back (the
            # gaps that loading left between the weights)
            ours = torch.cuda.memory_allocated(self.device) - allocated_before
            overhead = max(0, device_memory - free - ours)
            device_name = torch.cuda.get_device_name(self.device)
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        # every rank gets the same pools: those of the rank with the least room (one rank per GPU, GPUs alike)
        memory_plan = tightest_plan([
            plan(self.model_config, config, device_memory_bytes=device_memory, on_gpu=on_gpu,
                 activation_bytes=activation, overhead_bytes=overhead, weight_format=self.weight_format,
                 model_name=self.model_path.name, device_name=device_name or "CPU",
                 parallel=RankLayout(tp_size=tp, pp_rank=stage, pp_size=pp))
            for stage in range(pp)])
        if memory_plan.error is not None:
            logger.error("%s", describe_plan(memory_plan))
            memory_plan.check()
        logger.info("%s", describe_plan(memory_plan))
        scaled = [layer.kv_scales_from_checkpoint for layer in model.attention_layers]
        if memory_plan.kv_cache_dtype == "float8_e4m3fn" and not all(scaled):
            logger.warning("fp8 KV cache with per-tensor scales k_scale = v_scale = 1.0 for %d of %d attention "
                           "layers (the checkpoint provides none for them): keys and values are stored as "
                           "float8_e4m3fn and saturate beyond +-448", scaled.count(False), len(scaled))
        elif memory_plan.kv_cache_dtype != "float8_e4m3fn" and any(scaled):
            logger.info("the checkpoint's KV-cache scales are unused: the KV cache is %s, not fp8",
                        memory_plan.kv_cache_dtype)
        return memory_plan

    def _profile_step(self, model: HybridForCausalLM, config: EngineConfig) -> int:
        """Run the costliest step: a forward of max_num_batched_tokens prompt tokens (split into sequences
        within the model's position limit), then top-p sampling of min(max_num_seqs, tokens) rows, the
        sampler's most memory-hungry path. Scratch caches just large enough are bound meanwhile, then
        released; returns their bytes."""
        tokens, block_size = config.max_num_batched_tokens, config.block_size
        limit = self.model_config.max_position_embeddings
        lengths = [min(limit, tokens - start) for start in range(0, tokens, limit)]
        block_ids, next_block = [], 1  # block 0 is the null block
        for length in lengths:
            count = math.ceil(length / block_size)
            block_ids.append(list(range(next_block, next_block + count)))
            next_block += count
        _, kv_name, ssm_name = resolve_dtypes(config, self.model_config, self.device.type == "cuda")
        kv_dtype, ssm_dtype = TORCH_DTYPES[kv_name], TORCH_DTYPES[ssm_name]
        bind_caches(model, CacheShape(next_block, block_size, len(lengths) + 1, kv_dtype, ssm_dtype), self.device)
        pools = [t for a in model.attention_layers for t in (a.k_cache, a.v_cache)]
        pools += [t for g in model.gdn_layers for t in (g.conv_state, g.ssm_state)]
        scratch = sum(t.numel() * t.element_size() for t in pools)
        del pools
        try:
            slots = list(range(1, len(lengths) + 1))  # slot 0 is the dummy
            batch = ForwardBatch.build([0] * len(lengths), lengths, block_ids, slots, block_size, self.device)
            with torch.inference_mode():
                hidden = model(torch.zeros(tokens, dtype=torch.int64, device=self.device), batch)  # [T, H]
                rows = min(config.max_num_seqs, tokens)
                logits = model.compute_logits(hidden[:rows])  # [rows, V] float32
                Sampler()(logits, [SamplingParams(top_p=0.9)] * rows, [None] * rows, [[]] * rows, [[]] * rows,
                          [set()] * rows)
        finally:
            release_caches(model)
        return scratch

    def _measure_activation(self, model: HybridForCausalLM, config: EngineConfig) -> int:
        """Peak bytes the profile step allocates on the GPU beyond the weights and its scratch caches."""
        torch.cuda.synchronize(self.device)
        weights = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        scratch = self._profile_step(model, config)
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - weights - scratch
