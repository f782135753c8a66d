"""Which part of each checkpoint tensor a tensor-parallel rank loads, read straight from the file
(safetensors' get_slice: only this rank's bytes leave the file).

A rule gives ranges (start, length) along one dimension, concatenated in order: column-parallel weights keep
their rank's output rows (heads, intermediate rows, vocab rows), row-parallel ones their input columns; a
tensor no rule names (norms, routers, the shared-expert gate, KV scales) is replicated. The ranges match how
the layers split themselves (layers/attention.py, gdn.py, mlp.py, embedding.py).

Quantized checkpoints: a quantized module's tensors (QuantTensors.placement: its Scheme, the tensor's suffix and
the projection it belongs to) take the projection's ranges of rows (N) or columns (K), mapped into the tensor by
the scheme's `tp_axes` (which of its dims holds N and K, and how many rows or columns one index there covers):
    FP8 block        weight [N, K]; weight_scale_inv one per 128 x 128 block
    online FP8       the bf16 weight, quantized per rank after slicing
    NVFP4            weight [N, K/2] (two values a byte); weight_scale one per 16 columns; the per-tensor
                     weight_scale_2 and input_scale replicated
    compressed-tensors int4   weight_packed [N, K/8]; weight_scale [N, K/g]; weight_zero_point [N/8, K/g];
                     weight_g_idx [K]; weight_shape rewritten to the rank's [N, K]
    AutoAWQ          qweight [K, N/8]; qzeros [K/g, N/8]; scales [K/g, N]
    GPTQ             qweight [K/8, N]; qzeros [K/g, N/8]; scales [K/g, N]; g_idx [K]
A rank's ranges must be whole units there (packed words, groups, blocks; or end the tensor where the last unit
is partial): otherwise a unit straddles two ranks and loading stops with an error naming the tensor, its shape,
the unit and the tensor-parallel size. Act-order groups (g_idx) of a row-parallel projection are renumbered to the
rank's own group scales; act order that mixes groups across the ranks' columns is refused (layers/quant/int4.py).
Routed experts, per expert or fused ([E, ...], gate rows first), are sliced by moe_intermediate_size as the bf16
ones: gate_up column-parallel, down row-parallel.
"""

from __future__ import annotations

import re

import torch

from deltaserve.config import ModelConfig
from deltaserve.layers.quant.scheme import Scheme
from deltaserve.model.errors import WeightLoadError
from deltaserve.worker.distributed import ParallelContext

Ranges = tuple[int, list[tuple[int, int]]]  # (dim, [(start, length), ...])

_ATTN = re.compile(r"\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight$")
_GDN = re.compile(r"\.linear_attn\.(in_proj_qkv|conv1d|in_proj_z|in_proj_b|in_proj_a|in_proj_qkvz|in_proj_ba|"
                  r"out_proj)\.weight$|\.linear_attn\.(dt_bias|A_log)$")
_MLP = re.compile(r"\.mlp\.(shared_expert\.|experts\.\d+\.)?(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")


def _scaled(shard: tuple[int, int], unit: int) -> tuple[int, int]:
    return shard[0] * unit, shard[1] * unit


def rank_ranges(name: str, shape: list[int], cfg: ModelConfig, parallel: ParallelContext) -> Ranges | None:
    """The ranges of checkpoint tensor `name` (ours, of `shape`) this rank holds; None: the whole tensor."""
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


def _quantized_ranges(name: str, shape: list[int], placement: tuple[Scheme, str, str], cfg: ModelConfig,
                      parallel: ParallelContext) -> tuple[Ranges, Ranges] | None:
    """(the projection's ranges along its matrix [N, K] (dim 0 N, 1 K), the tensor's ranges) of quantized
    checkpoint tensor `name` (of `shape`); None: the projection is replicated. A fused expert tensor has the
    experts first, then one expert's layout."""
    scheme, suffix, projection = placement
    fused = _FUSED_EXPERTS.search(projection)
    if fused:
        start, length = parallel.shard(cfg.moe_intermediate_size, "moe_intermediate_size")
        matrix = ((0, [(start, length), (cfg.moe_intermediate_size + start, length)]) if fused.group(1) == "gate_up_proj"
                  else (1, [(start, length)]))
    else:
        matrix = rank_ranges(projection, shape, cfg, parallel)
    if matrix is None:
        return None
    axes = scheme.tp_axes(suffix)
    along = axes.n if matrix[0] == 0 else axes.k
    if along is None:
        return matrix, None
    dim = along.dim + (1 if fused else 0)
    units = []
    for start, length in matrix[1]:
        whole = length % along.per == 0 or -(-(start + length) // along.per) == shape[dim]
        if start % along.per or not whole:
            what = "rows" if matrix[0] == 0 else "columns"
            raise WeightLoadError(f"'{name}' {shape}: this rank's {what} [{start}, {start + length}) of "
                                  f"{'N' if matrix[0] == 0 else 'K'} are not whole {along.unit}s of {along.per} "
                                  f"{what} (dim {dim} of the tensor), so it cannot be split over "
                                  f"--tensor-parallel-size {parallel.tp_size}")
        units.append((start // along.per, -(-length // along.per)))
    return matrix, (dim, units)


def _read(handle, raw_name: str, ranges: Ranges | None) -> torch.Tensor:
    if ranges is None:
        return handle.get_tensor(raw_name)
    piece = handle.get_slice(raw_name)
    dim, spans = ranges
    lead = (slice(None),) * dim
    parts = [piece[lead + (slice(start, start + length),)] for start, length in spans]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def read_rank_slice(handle, raw_name: str, name: str, cfg: ModelConfig, parallel: ParallelContext,
                    placement: tuple[Scheme, str, str] | None = None) -> torch.Tensor:
    """This rank's part of checkpoint tensor `raw_name` (ours `name`) from the open safetensors `handle`;
    `placement`: (scheme, suffix, projection) where it is a quantized module's tensor."""
    shape = handle.get_slice(raw_name).get_shape()
    if placement is None:
        return _read(handle, raw_name, rank_ranges(name, shape, cfg, parallel))
    ranges = _quantized_ranges(raw_name, shape, placement, cfg, parallel)
    if ranges is None:
        return handle.get_tensor(raw_name)
    (matrix_dim, matrix_spans), tensor_ranges = ranges
    scheme, suffix, _ = placement
    prefix = raw_name[: len(raw_name) - len(raw_name.rsplit(".", 1)[-1]) - 1]
    return scheme.rank_values(prefix, suffix, _read(handle, raw_name, tensor_ranges), matrix_dim, matrix_spans,
                              shape, parallel.tp_size)
