"""EngineSetup: everything the engine resolves once at start-up.

Device and dtypes, the model and its weights, the tokenizer and EOS ids, the context limit, and the size of
the two cache pools (KV blocks and GDN state slots).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from deltaserve.cache.block_pool import BlockPool
from deltaserve.cache.kv_manager import CacheManager
from deltaserve.cache.state_pool import StatePool
from deltaserve.config import ConfigError, EngineConfig, ModelConfig
from deltaserve.model.loader import load_model
from deltaserve.worker.kv_cache import CacheShape, kv_bytes_per_block, state_bytes_per_slot
from deltaserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_CACHE_BYTES = 1 << 30  # default KV budget on the CPU when no size flag is given
GPU_ACTIVATION_RESERVE = 4 << 30  # held back for activations until the memory planner measures them


class EngineSetup:
    def __init__(self, config: EngineConfig):
        if config.model is None:
            from deltaserve.demo import demo_model_path
            model_path = demo_model_path()
            logger.info("no model given: serving the built-in tiny demo model at %s (random weights)", model_path)
        else:
            model_path = Path(config.model)
        self.model_path = model_path
        self.model_config = ModelConfig.from_pretrained(model_path)
        self.device = self._device(config.device)
        self.dtype = self._dtype(config.dtype, self.model_config, self.device)
        self.tokenizer = None if config.skip_tokenizer_init else self._tokenizer(config.tokenizer or model_path)
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if not self.eos_token_ids and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids = {self.tokenizer.eos_token_id}
        if config.seed is not None:
            torch.manual_seed(config.seed)
        model = load_model(model_path, self.model_config, self.dtype, self.device, config.load_format, config.seed)

        self.max_num_seqs = config.max_num_seqs
        shape = self._cache_shape(config, model)
        self.max_model_len = self._max_model_len(config, shape)
        self.cache_manager = CacheManager(BlockPool(shape.num_blocks, shape.block_size), StatePool(shape.num_state_slots))
        self.runner = ModelRunner(model, shape, self.device, self.max_num_seqs, self.max_model_len,
                                  config.enforce_eager)
        logger.info("KV cache: %d blocks of %d tokens (%d tokens); %d GDN state slots; max_model_len %d",
                    shape.num_blocks - 1, shape.block_size, (shape.num_blocks - 1) * shape.block_size,
                    shape.num_state_slots - 1, self.max_model_len)

    @staticmethod
    def _device(name: str) -> torch.device:
        if name == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if name == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda was asked for, but no CUDA device is available")
        return torch.device(name)

    @staticmethod
    def _dtype(name: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
        if name != "auto":
            return _DTYPES[name]
        if device.type == "cpu":
            return torch.float32  # bf16 matmuls are slow on most CPUs and float32 is the reference
        return _DTYPES.get(cfg.torch_dtype, torch.bfloat16) if cfg.torch_dtype != "float32" else torch.bfloat16

    @staticmethod
    def _tokenizer(path):
        import transformers
        try:
            return transformers.AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as exc:
            logger.warning("no tokenizer at %s (%s): only token-id prompts are accepted", path, exc)
            return None

    def _cache_shape(self, config: EngineConfig, model) -> CacheShape:
        kv_dtype = self.dtype if config.kv_cache_dtype == "auto" else _DTYPES[config.kv_cache_dtype]
        ssm_name = config.mamba_ssm_cache_dtype
        if ssm_name == "auto":
            ssm_name = self.model_config.mamba_ssm_dtype or "float32"
        ssm_dtype = _DTYPES[ssm_name]
        slots = config.max_num_seqs + 1  # + the dummy slot
        per_block = kv_bytes_per_block(model, config.block_size, kv_dtype)
        if config.num_gpu_blocks_override is not None:
            num_blocks = config.num_gpu_blocks_override
        else:
            if config.kv_cache_memory_bytes is not None:
                budget = config.kv_cache_memory_bytes
            elif self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                state = slots * state_bytes_per_slot(model, self.dtype, ssm_dtype)
                budget = int(total * config.gpu_memory_utilization) - (total - free) - state - GPU_ACTIVATION_RESERVE
            else:
                wanted = config.max_num_seqs * (config.max_model_len or self.model_config.max_position_embeddings)
                budget = min(CPU_KV_CACHE_BYTES, -(-wanted // config.block_size) * per_block)
            num_blocks = budget // per_block + 1  # + the null block
            if num_blocks < 2:
                raise ConfigError(f"no memory left for the KV cache (budget {budget} bytes, one block needs "
                                  f"{per_block}); lower --max-num-seqs or raise --gpu-memory-utilization")
        return CacheShape(num_blocks, config.block_size, slots, kv_dtype, ssm_dtype)

    def _max_model_len(self, config: EngineConfig, shape: CacheShape) -> int:
        pool_tokens = (shape.num_blocks - 1) * shape.block_size
        model_limit = self.model_config.max_position_embeddings
        if config.max_model_len is not None:
            if config.max_model_len > model_limit:
                raise ConfigError(f"--max-model-len {config.max_model_len} exceeds the model's "
                                  f"max_position_embeddings {model_limit}")
            if config.max_model_len > pool_tokens:
                raise ConfigError(f"--max-model-len {config.max_model_len} needs {config.max_model_len} tokens of KV "
                                  f"cache; the pool holds {pool_tokens}. Lower --max-model-len to {pool_tokens} "
                                  "or give the KV cache more memory")
            return config.max_model_len
        if model_limit > pool_tokens:
            logger.info("max_model_len lowered from %d to %d to fit the KV cache", model_limit, pool_tokens)
        return min(model_limit, pool_tokens)
