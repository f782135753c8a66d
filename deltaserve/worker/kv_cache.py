"""Allocates the two cache pools and binds them to the model's layers.

    attention layers (one pair each)      k, v: [num_blocks, block_size, n_kv, head_dim]   (kv dtype)
    GDN layers (one pair each)            conv: [num_state_slots, conv_dim, W-1]            (model dtype)
                                          ssm:  [num_state_slots, HV, K, V]                 (ssm dtype)
                                          (views of model.conv_states / model.ssm_states, [layers, ...])

Block 0 and state slot 0 are the null block / dummy slot: padding rows of a batch point at them, and the
pools never hand them to a request. State rows after the working slots are the prefix cache's checkpoint
slots (cache/state_pool.py). Under tensor parallelism n_kv, conv_dim and HV are this rank's (the layers'). An fp8 (float8_e4m3fn) KV cache holds K / k_scale and V / v_scale, with the
per-tensor scales kept on each attention layer. The sizes come from the memory plan (cache/planner.py).
"""

from dataclasses import dataclass

import torch

from deltaserve.cache.planner import MemoryPlan
from deltaserve.model.qwen3_5 import HybridForCausalLM

# The planner's dtype names -> torch dtypes.
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "float8_e4m3fn": torch.float8_e4m3fn}


@dataclass
class CacheShape:
    num_blocks: int  # KV blocks, the null block included
    block_size: int
    num_state_slots: int  # rows of the state tensors: the dummy, working and checkpoint slots
    kv_dtype: torch.dtype
    ssm_dtype: torch.dtype

    @classmethod
    def from_plan(cls, plan: MemoryPlan) -> "CacheShape":
        return cls(plan.num_blocks, plan.block_size, plan.num_state_slots, TORCH_DTYPES[plan.kv_cache_dtype],
                   TORCH_DTYPES[plan.ssm_state_dtype])


def bind_caches(model: HybridForCausalLM, shape: CacheShape, device: torch.device | str) -> None:
    """Allocate zeroed pools of `shape` on `device` and attach them to each layer."""
    cfg = model.config
    conv_dtype = model.dtype
    for attn in model.attention_layers:
        kv_shape = (shape.num_blocks, shape.block_size, attn.num_kv_heads, cfg.head_dim)
        attn.k_cache = torch.zeros(kv_shape, dtype=shape.kv_dtype, device=device)
        attn.v_cache = torch.zeros(kv_shape, dtype=shape.kv_dtype, device=device)
    # One tensor per state kind for all GDN layers, each layer's pool a contiguous view of it: a prefix-cache
    # slot copy is then one gather and one scatter per kind (state_copy.py), not two per layer.
    layers = model.gdn_layers
    conv_dim, num_v_heads = (layers[0].conv_dim, layers[0].num_v_heads) if layers else (0, 0)  # this rank's
    model.conv_states = torch.zeros(len(layers), shape.num_state_slots, conv_dim, cfg.conv_kernel - 1,
                                    dtype=conv_dtype, device=device)  # [L, S, conv_dim, W-1]
    model.ssm_states = torch.zeros(len(layers), shape.num_state_slots, num_v_heads, cfg.gdn_k_dim,
                                   cfg.gdn_v_dim, dtype=shape.ssm_dtype, device=device)  # [L, S, HV, K, V]
    for i, gdn in enumerate(layers):
        gdn.conv_state = model.conv_states[i]
        gdn.ssm_state = model.ssm_states[i]


def release_caches(model: HybridForCausalLM) -> None:
    """Drop every layer's pools (so that their memory can be freed before others are bound)."""
    for attn in model.attention_layers:
        attn.k_cache = attn.v_cache = None
    for gdn in model.gdn_layers:
        gdn.conv_state = gdn.ssm_state = None
    model.conv_states = model.ssm_states = None
