"""Which part of each checkpoint tensor a tensor-parallel rank loads, read straight from the file
(safetensors' get_slice: only this rank's bytes leave the file).

A rule gives ranges (start, length) along one dimension, concatenated in order: column-parallel weights keep
their rank's output rows (heads, intermediate rows, vocab rows), row-parallel ones their input columns; a
tensor no rule names (norms, routers, the shared-expert gate, KV scales) is replicated. The ranges match how
the layers split themselves (layers/attention.py, gdn.py, mlp.py, embedding.py).

FP8 block-scaled checkpoints (layers/quant/fp8.py): a projection's `weight_scale_inv` [ceil(N/128), ceil(K/128)]
takes the blocks of its weight's ranges, which must then be whole 128-blocks (or end the tensor); otherwise the
block straddles two ranks and loading stops with an error naming the tensor. Online FP8 slices the bf16 weight
and quantizes the rank's slice.

NVFP4 (layers/quant/nvfp4.py): the uint8 `weight` packs two values a byte along K and `weight_scale` holds one
scale per 16 columns, so a row-parallel slice takes half the byte columns and 1/16 of the scale columns (whole
groups); the per-tensor weight_scale_2 and input_scale are replicated.
"""

from __future__ import annotations

import re

import torch

from deltaserve.config import ModelConfig
from deltaserve.layers.quant.fp8 import BLOCK
from deltaserve.layers.quant.nvfp4 import GROUP as NVFP4_GROUP
from deltaserve.model.errors import WeightLoadError
from deltaserve.worker.distributed import ParallelContext

Ranges = tuple[int, list[tuple[int, int]]]  # (dim, [(start, length), ...])

_ATTN = re.compile(r"\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight$")
_GDN = re.compile(r"\.linear_attn\.(in_proj_qkv|conv1d|in_proj_z|in_proj_b|in_proj_a|in_proj_qkvz|in_proj_ba|"
                  r"out_proj)\.weight$|\.linear_attn\.(dt_bias|A_log)$")
_MLP = re.compile(r"\.mlp\.(shared_expert\.|experts\.\d+\.)?(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")
_FUSED_EXPERT_EXTRA = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)_\w+$")  # a quantized one's scales


def _scaled(shard: tuple[int, int], unit: int) -> tuple[int, int]:
    return shard[0] * unit, shard[1] * unit


def rank_ranges(name: str, shape: list[int], cfg: ModelConfig, parallel: ParallelContext) -> Ranges | None:
    """The ranges of checkpoint tensor `name` (ours, of `shape`) this rank holds; None: the whole tensor."""
    if name.endswith(".weight_scale_inv"):
        return _block_scale_ranges(name, shape, cfg, parallel)
    if name.endswith(".weight_scale"):
        return _packed_ranges(name, rank_ranges(name.removesuffix("_scale"), shape, cfg, parallel), NVFP4_GROUP,
                              parallel)
    if _FUSED_EXPERT_EXTRA.search(name):
        raise WeightLoadError(f"'{name}': the scales of fused (stacked) quantized experts are not sliced under "
                              f"--tensor-parallel-size {parallel.tp_size}; per-expert checkpoints are")
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return 0, [parallel.shard(cfg.vocab_size, "vocab_size")]
    if match := _ATTN.search(name):
        heads = parallel.shard(cfg.num_heads, "num_attention_heads")
        proj, hd = match.group(1), cfg.head_dim
        if proj == "q_proj":  # per head [query | gate]
            return 0, [_scaled(heads, 2 * hd)]
        if proj == "o_proj":
            return 1, [_scaled(heads, hd)]
        return 0, [_scaled(parallel.kv_head_shard(cfg.num_kv_heads), hd)]
    if match := _GDN.search(name):
        return _gdn_ranges(match.group(1) or match.group(2), cfg, parallel)
    if match := _MLP.search(name):
        which, proj = match.group(1) or "", match.group(2)
        size, field = ((cfg.shared_expert_intermediate_size, "shared_expert_intermediate_size") if which == "shared_expert."
                       else (cfg.moe_intermediate_size, "moe_intermediate_size") if which
                       else (cfg.intermediate_size, "intermediate_size"))
        return (1 if proj == "down_proj" else 0), [parallel.shard(size, field)]
    if match := _FUSED_EXPERTS.search(name):
        return _fused_expert_ranges(match.group(1), shape, cfg, parallel)
    return None


def _block_scale_ranges(name: str, shape: list[int], cfg: ModelConfig, parallel: ParallelContext) -> Ranges | None:
    """An FP8 weight's scale blocks [N / 128, K / 128]: those covering the rank's ranges of the weight."""
    weight = rank_ranges(name.removesuffix("_scale_inv"), [s * b for s, b in zip(shape, BLOCK)], cfg, parallel)
    if weight is None:
        return None
    dim, spans = weight
    block, blocks = [], BLOCK[dim]
    for start, length in spans:
        whole = length % blocks == 0 or -(-(start + length) // blocks) == shape[dim]
        if start % blocks or not whole:
            raise WeightLoadError(f"'{name}': FP8 128x128 block scales cannot be split over --tensor-parallel-size "
                                  f"{parallel.tp_size} (this rank's rows [{start}, {start + length}) along dim {dim} "
                                  "are not whole blocks)")
        block.append((start // blocks, -(-length // blocks)))
    return dim, block


def _packed_ranges(name: str, ranges: Ranges | None, per_column: int, parallel: ParallelContext) -> Ranges | None:
    """Ranges of a tensor holding one column per `per_column` of its weight's K (packed values, group scales):
    row ranges as they are, column ranges in its own columns (whole ones, else an error naming the tensor)."""
    if ranges is None or ranges[0] == 0:
        return ranges
    dim, spans = ranges
    if any(start % per_column or length % per_column for start, length in spans):
        raise WeightLoadError(f"'{name}': this rank's columns {spans} are not whole groups of {per_column}, so it "
                              f"cannot be split over --tensor-parallel-size {parallel.tp_size}")
    return dim, [(start // per_column, length // per_column) for start, length in spans]


def _gdn_ranges(part: str, cfg: ModelConfig, parallel: ParallelContext) -> Ranges:
    k_heads = parallel.shard(cfg.gdn_num_k_heads, "linear_num_key_heads")
    v_heads = parallel.shard(cfg.gdn_num_v_heads, "linear_num_value_heads")
    key_dim, kd, vd = cfg.gdn_key_dim, cfg.gdn_k_dim, cfg.gdn_v_dim
    if part in ("in_proj_qkv", "conv1d"):  # rows [q | k | v], each split by heads
        (qs, ql), (vs, vl) = _scaled(k_heads, kd), _scaled(v_heads, vd)
        return 0, [(qs, ql), (key_dim + qs, ql), (2 * key_dim + vs, vl)]
    if part == "in_proj_z":
        return 0, [_scaled(v_heads, vd)]
    if part in ("in_proj_b", "in_proj_a", "dt_bias", "A_log"):
        return 0, [v_heads]
    if part == "out_proj":
        return 1, [_scaled(v_heads, vd)]
    # Qwen3-Next: rows interleaved per key head, [q k v z] and [b a] of its value heads
    r = cfg.gdn_num_v_heads // cfg.gdn_num_k_heads
    per_head = 2 * kd + 2 * r * vd if part == "in_proj_qkvz" else 2 * r
    return 0, [_scaled(k_heads, per_head)]


def _fused_expert_ranges(proj: str, shape: list[int], cfg: ModelConfig, parallel: ParallelContext) -> Ranges:
    """Stacked experts, [E, 2I, H] / [E, H, I] or transposed ([E, H, 2I] / [E, I, H]): the rows or columns of
    the intermediate dimension (gate and up each split)."""
    inter = cfg.moe_intermediate_size
    start, length = parallel.shard(inter, "moe_intermediate_size")
    if proj == "gate_up_proj":
        return (1 if shape[1] == 2 * inter else 2), [(start, length), (inter + start, length)]
    return (2 if shape[2] == inter else 1), [(start, length)]


def read_rank_slice(handle, raw_name: str, name: str, cfg: ModelConfig, parallel: ParallelContext) -> torch.Tensor:
    """This rank's part of checkpoint tensor `raw_name` (ours `name`) from the open safetensors `handle`."""
    piece = handle.get_slice(raw_name)
    ranges = rank_ranges(name, piece.get_shape(), cfg, parallel)
    if piece.get_dtype() == "U8" and name.endswith(".weight"):  # NVFP4: two e2m1 values a byte along K
        ranges = _packed_ranges(raw_name, ranges, 2, parallel)
    if ranges is None:
        return handle.get_tensor(raw_name)
    dim, spans = ranges
    lead = (slice(None),) * dim
    parts = [piece[lead + (slice(start, start + length),)] for start, length in spans]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)
