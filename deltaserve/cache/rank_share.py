"""One rank's view of the model for the memory plan: the config as that rank builds it (its pipeline stage's
layers; its tensor-parallel share of the heads, KV heads and intermediate sizes), so that the footprint
arithmetic (cache/footprint.py) gives that rank's weights, KV bytes per token and GDN state per slot unchanged.

The vocabulary stays whole in the view: the logits are gathered on every rank (the sampler sees all of them);
`RankShare` says which part of the embedding and lm_head the rank holds.
"""

from __future__ import annotations

from dataclasses import replace

from deltaserve.cache.footprint import RankShare
from deltaserve.config import ModelConfig
from deltaserve.parallel_layout import RankLayout


def rank_config(cfg: ModelConfig, parallel: RankLayout) -> ModelConfig:
    """cfg as rank `parallel` builds it; a size that does not divide is a ValueError naming its config field."""
    layers = parallel.stage_layers(cfg.num_layers)
    moe = cfg.moe_layers[layers.start:layers.stop]

    def share(size: int, field: str, used: bool) -> int:
        return parallel.shard(size, field)[1] if used and size else size

    parallel.shard(cfg.vocab_size, "vocab_size")
    return replace(
        cfg, num_layers=len(layers), layer_types=cfg.layer_types[layers.start:layers.stop], moe_layers=moe,
        num_heads=parallel.shard(cfg.num_heads, "num_attention_heads")[1],
        num_kv_heads=parallel.kv_head_shard(cfg.num_kv_heads)[1],
        gdn_num_k_heads=parallel.shard(cfg.gdn_num_k_heads, "linear_num_key_heads")[1],
        gdn_num_v_heads=parallel.shard(cfg.gdn_num_v_heads, "linear_num_value_heads")[1],
        intermediate_size=share(cfg.intermediate_size, "intermediate_size", not all(moe)),
        moe_intermediate_size=share(cfg.moe_intermediate_size, "moe_intermediate_size", any(moe)),
        shared_expert_intermediate_size=share(cfg.shared_expert_intermediate_size, "shared_expert_intermediate_size",
                                              any(moe)))


def rank_share(cfg: ModelConfig, parallel: RankLayout) -> RankShare:
    return RankShare(tp_size=parallel.tp_size, first_stage=parallel.is_first_stage, last_stage=parallel.is_last_stage,
                     first_layer=parallel.stage_layers(cfg.num_layers).start)
