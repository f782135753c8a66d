"""Allocates the two cache pools and binds them to the model's layers.

    attention layers (one pair each)      k, v: [num_blocks, block_size, n_kv, head_dim]   (kv dtype)
    GDN layers (one pair each)            conv: [num_slots, conv_dim, W-1]                  (model dtype)
                                          ssm:  [num_slots, HV, K, V]                       (ssm dtype)

Block 0 and state slot 0 are the null block / dummy slot: padding rows of a batch point at them, and the
pools never hand them to a request.
"""

from dataclasses import dataclass

import torch

from deltaserve.model.qwen3_5 import HybridForCausalLM


@dataclass
class CacheShape:
    num_blocks: int
    block_size: int
    num_state_slots: int
    kv_dtype: torch.dtype
    ssm_dtype: torch.dtype


def kv_bytes_per_block(model: HybridForCausalLM, block_size: int, kv_dtype: torch.dtype) -> int:
    cfg = model.config
    per_token = 2 * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=kv_dtype).element_size()
    return per_token * block_size * len(cfg.full_attention_layers)


def state_bytes_per_slot(model: HybridForCausalLM, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> int:
    cfg = model.config
    conv = cfg.conv_dim * (cfg.conv_kernel - 1) * torch.empty((), dtype=conv_dtype).element_size()
    ssm = cfg.gdn_num_v_heads * cfg.gdn_k_dim * cfg.gdn_v_dim * torch.empty((), dtype=ssm_dtype).element_size()
    return (conv + ssm) * len(cfg.linear_attention_layers)


def bind_caches(model: HybridForCausalLM, shape: CacheShape, device: torch.device | str) -> None:
    """Allocate zeroed pools of `shape` on `device` and attach them to each layer."""
    cfg = model.config
    conv_dtype = model.model.embed_tokens.weight.dtype
    for attn in model.attention_layers:
        kv_shape = (shape.num_blocks, shape.block_size, cfg.num_kv_heads, cfg.head_dim)
        attn.k_cache = torch.zeros(kv_shape, dtype=shape.kv_dtype, device=device)
        attn.v_cache = torch.zeros(kv_shape, dtype=shape.kv_dtype, device=device)
    for gdn in model.gdn_layers:
        gdn.conv_state = torch.zeros(shape.num_state_slots, cfg.conv_dim, cfg.conv_kernel - 1,
                                     dtype=conv_dtype, device=device)
        gdn.ssm_state = torch.zeros(shape.num_state_slots, cfg.gdn_num_v_heads, cfg.gdn_k_dim, cfg.gdn_v_dim,
                                    dtype=shape.ssm_dtype, device=device)
