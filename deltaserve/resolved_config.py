"""ResolvedConfig: what start-up decides once from the flags, the model's config, the device, the memory plan and
the environment, each in one form. worker/setup.py builds it beside the MemoryPlan (cache/planner.py); the
engine and the runner read those two instead of deriving the figures again. No torch: dtypes are names here,
worker/kv_cache.TORCH_DTYPES maps them.
"""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.cache.footprint import kv_cache_dtype, model_dtype, ssm_cache_dtype
from deltaserve.cache.planner import MemoryPlan
from deltaserve.config import EngineConfig, ModelConfig
from deltaserve.graph_sizes import chunk_graph_sizes, graph_capture_sizes


def resolve_dtypes(config: EngineConfig, model_config: ModelConfig, on_gpu: bool) -> tuple[str, str, str]:
    """(model, KV cache, GDN recurrent state) dtype names from the flags: what the plan resolves too, needed
    before it (to load the weights and run the profile step)."""
    model = model_dtype(config.dtype, model_config, on_gpu)
    return model, kv_cache_dtype(config.kv_cache_dtype, model), ssm_cache_dtype(config.mamba_ssm_cache_dtype,
                                                                                 model_config, model)


@dataclass(frozen=True)
class ResolvedConfig:
    model_dtype: str  # the weights' and activations' ("bfloat16", "float16", "float32")
    kv_cache_dtype: str  # "float8_e4m3fn" for an fp8 cache
    conv_state_dtype: str
    ssm_state_dtype: str
    max_num_seqs: int  # as the memory plan clamped it
    max_model_len: int
    max_num_batched_tokens: int
    use_cuda_graphs: bool  # on the GPU unless --enforce-eager (the runner may still refuse them for a model)
    decode_graph_sizes: tuple[int, ...]  # graph_sizes.graph_capture_sizes of the clamped max_num_seqs
    chunk_graph_sizes: tuple[int, ...]  # () with DELTASERVE_CHUNK_GRAPHS=0 (the environment, read here once)

    @classmethod
    def resolve(cls, config: EngineConfig, plan: MemoryPlan, on_gpu: bool) -> ResolvedConfig:
        return cls(
            model_dtype=plan.model_dtype, kv_cache_dtype=plan.kv_cache_dtype,
            conv_state_dtype=plan.conv_state_dtype, ssm_state_dtype=plan.ssm_state_dtype,
            max_num_seqs=plan.max_num_seqs, max_model_len=plan.max_model_len,
            max_num_batched_tokens=config.max_num_batched_tokens,
            use_cuda_graphs=on_gpu and not config.enforce_eager,
            decode_graph_sizes=tuple(graph_capture_sizes(plan.max_num_seqs, config.performance_mode)),
            chunk_graph_sizes=tuple(chunk_graph_sizes()),
        )
