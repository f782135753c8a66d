"""What one token, one sequence and one model cost in memory, from the config alone.

Exact sizes (KV bytes per token, GDN state bytes per slot, parameters as HybridForCausalLM builds them,
weight bytes) and offline upper estimates of what the GPU measures at startup (activation peak, CUDA-graph
memory). Pure arithmetic: no tensors, no CUDA. The memory plan (planner.py) adds them up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from deltaserve.config import ConfigError, ModelConfig
from deltaserve.graph_sizes import PADDED_CHUNK_MIN_ROWS, chunk_graph_sizes, cuda_graph_count, graph_capture_sizes

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")  # both mean torch.float8_e4m3fn with per-tensor scales
# At the sampling peak a row of logits lives as: the lm_head output (model dtype), the float32 logits, the
# sampler's float32 working copies (private copy, temperature-scaled, gathered, sorted, softmax, cumsum,
# masked) and int64 sort indices when top-p runs without top-k: about 48 bytes per logit.
_SAMPLER_BYTES_PER_LOGIT = 48
_GDN_CHUNK = 64  # tokens per chunk of the chunked gated delta rule (fla-core's default)
_GRAPH_FIXED_BYTES = 1 << 20  # per captured graph, besides its activations and output


@dataclass(frozen=True)
class RankShare:
    """What of the vocabulary-sized tensors one rank holds (cache/rank_share.py builds it with the rank's view of
    the config): tp_size splits the embedding and lm_head rows; only the first pipeline stage embeds and only the
    last holds lm_head (with tied embeddings a last stage that is not the first holds its own copy).
    first_layer: the checkpoint index of the rank's first layer (the config's layers are the stage's)."""

    tp_size: int = 1
    first_stage: bool = True
    last_stage: bool = True
    first_layer: int = 0


WHOLE = RankShare()


# ---------------------------------------------------------------------------------------------- dtypes

def model_dtype(flag: str, cfg: ModelConfig, on_gpu: bool) -> str:
    """--dtype: auto is the checkpoint's dtype on the GPU (bfloat16 for float32 checkpoints), float32 on CPU."""
    if flag != "auto":
        return flag
    if not on_gpu:
        return "float32"  # bf16 matmuls are slow on most CPUs and float32 is the reference
    return cfg.torch_dtype if cfg.torch_dtype in ("bfloat16", "float16") else "bfloat16"


def kv_cache_dtype(flag: str, model_dtype_name: str) -> str:
    """--kv-cache-dtype: auto follows the model; fp8 / fp8_e4m3 store float8_e4m3fn."""
    if flag == "auto":
        return model_dtype_name
    return "float8_e4m3fn" if flag in FP8_KV_CACHE_DTYPES else flag


def ssm_cache_dtype(flag: str, cfg: ModelConfig, model_dtype_name: str) -> str:
    """--mamba-ssm-cache-dtype: auto follows the config's mamba_ssm_dtype, else the model dtype (as vLLM)."""
    if flag != "auto":
        return flag
    name = cfg.mamba_ssm_dtype or model_dtype_name
    if name not in DTYPE_BYTES:
        raise ConfigError(f"config field 'mamba_ssm_dtype' = {name!r} is not one of {sorted(DTYPE_BYTES)}")
    return name


# ------------------------------------------------------------------------------------ per-unit sizes

def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str) -> int:
    """K and V of one token in every full-attention layer."""
    return len(cfg.full_attention_layers) * 2 * cfg.num_kv_heads * cfg.head_dim * DTYPE_BYTES[kv_dtype]


def state_bytes_per_slot(cfg: ModelConfig, conv_dtype: str, ssm_dtype: str) -> tuple[int, int]:
    """(conv, recurrent) bytes of one state slot over all GDN layers: [conv_dim, W-1] and [HV, K, V]."""
    layers = len(cfg.linear_attention_layers)
    conv = layers * cfg.conv_dim * (cfg.conv_kernel - 1) * DTYPE_BYTES[conv_dtype]
    ssm = layers * cfg.gdn_num_v_heads * cfg.gdn_k_dim * cfg.gdn_v_dim * DTYPE_BYTES[ssm_dtype]
    return conv, ssm


def count_parameters(cfg: ModelConfig, share: RankShare = WHOLE) -> dict[str, int]:
    """Parameters by part, exactly as HybridForCausalLM builds them (the MTP head and vision tower are not
    loaded); of one rank with a rank's config and share. "linear": the decoder's projection matrices (what weight quantization compresses); "other":
    norms, conv taps, dt_bias, MoE router gates; "A_log": the decay rates, kept in float32."""
    H, HV = cfg.hidden_size, cfg.gdn_num_v_heads
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    num_attention, num_gdn = len(cfg.full_attention_layers), len(cfg.linear_attention_layers)
    attention = H * 2 * q_dim + 2 * H * kv_dim + q_dim * H  # q_proj (query + gate), k_proj, v_proj, o_proj
    gdn = H * (cfg.conv_dim + cfg.gdn_value_dim + 2 * HV) + cfg.gdn_value_dim * H  # in_proj (qkv z b a), out
    linear = num_attention * attention + num_gdn * gdn
    final_norm = H if share.last_stage else 0  # the last pipeline stage's
    other = final_norm + 2 * H * cfg.num_layers + num_attention * 2 * cfg.head_dim  # final, layer, q/k norms
    other += num_gdn * (cfg.conv_dim * cfg.conv_kernel + HV + cfg.gdn_v_dim)  # conv1d, dt_bias, gated norm
    for is_moe in cfg.moe_layers:
        if is_moe:
            shared = cfg.shared_expert_intermediate_size
            linear += 3 * H * (cfg.num_experts * cfg.moe_intermediate_size + shared)
            other += cfg.num_experts * H + (H if shared else 0)  # router gate, shared-expert gate
        else:
            linear += 3 * H * cfg.intermediate_size
    vocab_rows = cfg.vocab_size // share.tp_size * H
    own_lm_head = share.last_stage and not (cfg.tie_word_embeddings and share.first_stage)
    return {"embed_tokens": vocab_rows if share.first_stage else 0, "lm_head": vocab_rows if own_lm_head else 0,
            "linear": linear, "other": other, "A_log": num_gdn * HV}


def projection_shapes(cfg: ModelConfig, first_layer: int = 0) -> list[tuple[str, int, int, int]]:
    """(name, N, K, count) of every projection matrix count_parameters counts as "linear", named as our modules
    are (a block's experts as its expert 0, `count` times): what a quantized checkpoint may store quantized."""
    H, HV = cfg.hidden_size, cfg.gdn_num_v_heads
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = []
    for i, kind in enumerate(cfg.layer_types):
        layer = f"model.layers.{first_layer + i}"
        if kind == "full_attention":
            shapes += [(f"{layer}.self_attn.q_proj", 2 * q_dim, H, 1), (f"{layer}.self_attn.k_proj", kv_dim, H, 1),
                       (f"{layer}.self_attn.v_proj", kv_dim, H, 1), (f"{layer}.self_attn.o_proj", H, q_dim, 1)]
        elif cfg.gdn_fused_inproj:
            shapes += [(f"{layer}.linear_attn.in_proj_qkvz", cfg.conv_dim + cfg.gdn_value_dim, H, 1),
                       (f"{layer}.linear_attn.in_proj_ba", 2 * HV, H, 1)]
        else:
            shapes += [(f"{layer}.linear_attn.in_proj_qkv", cfg.conv_dim, H, 1),
                       (f"{layer}.linear_attn.in_proj_z", cfg.gdn_value_dim, H, 1),
                       (f"{layer}.linear_attn.in_proj_b", HV, H, 1), (f"{layer}.linear_attn.in_proj_a", HV, H, 1)]
        if kind == "linear_attention":
            shapes.append((f"{layer}.linear_attn.out_proj", H, cfg.gdn_value_dim, 1))
        mlps = [(f"{layer}.mlp", cfg.intermediate_size, 1)]
        if cfg.moe_layers[i]:
            mlps = [(f"{layer}.mlp.experts.0", cfg.moe_intermediate_size, cfg.num_experts)]
            if cfg.shared_expert_intermediate_size:
                mlps.append((f"{layer}.mlp.shared_expert", cfg.shared_expert_intermediate_size, 1))
        for mlp, inter, count in mlps:
            shapes += [(f"{mlp}.gate_proj", inter, H, count), (f"{mlp}.up_proj", inter, H, count),
                       (f"{mlp}.down_proj", H, inter, count)]
    return shapes


def weight_bytes(cfg: ModelConfig, dtype: str, weight_format=None, share: RankShare = WHOLE) -> dict[str, int]:
    """Weight bytes by storage format: the model dtype, float32 (A_log), and with a quantized `weight_format`
    (a layers/quant WeightFormat) each part of its projections (packed values, scales, zero points) as the
    prepared weights hold them, the projections it keeps unquantized in the model dtype."""
    params = count_parameters(cfg, share)
    by_format = {dtype: (params["embed_tokens"] + params["lm_head"] + params["other"]) * DTYPE_BYTES[dtype]}
    if weight_format is None:
        by_format[dtype] += params["linear"] * DTYPE_BYTES[dtype]
    else:
        for name, n, k, count in projection_shapes(cfg, share.first_layer):
            scheme = weight_format.scheme_for(name)
            parts = {dtype: n * k * DTYPE_BYTES[dtype]} if scheme is None else scheme.matrix_bytes(n, k)
            for part, nbytes in parts.items():
                by_format[part] = by_format.get(part, 0) + count * nbytes
    by_format["float32"] = by_format.get("float32", 0) + params["A_log"] * 4
    return by_format


# Projections that read their own input (the others of a module share one and are joined along N at load)
_OWN_INPUT = ("o_proj", "out_proj", "down_proj")


def quant_scratch_bytes(cfg: ModelConfig, dtype: str, weight_format=None, first_layer: int = 0) -> int:
    """Bytes of the scratch buffer the int4 / NVFP4 prefill dequantizes into (ops/quant_gemm warm_up): a `dtype`
    copy of the largest such prepared matrix, the projections of one module that share an input joined as
    the loader joins them (an upper bound where a joint does not line up); 0 where no projection uses it."""
    if weight_format is None:
        return 0
    joined: dict[tuple[str, str], int] = {}  # (module or projection, scheme) -> N * K of the joined matrix
    for name, n, k, _ in projection_shapes(cfg, first_layer):
        scheme = weight_format.scheme_for(name)
        if scheme is None or not scheme.uses_scratch:
            continue
        module, projection = name.rsplit(".", 1)
        key = (name if projection in _OWN_INPUT else module, type(scheme).__name__)
        joined[key] = joined.get(key, 0) + n * k
    return max(joined.values(), default=0) * DTYPE_BYTES[dtype]


# --------------------------------------------------------------------------------------- estimates

def _forward_bytes(cfg: ModelConfig, dtype: str, num_tokens: int, decode: bool) -> int:
    """Upper estimate of one forward pass's transient memory: the hidden stream (h, residual) plus the
    largest layer's intermediates, each tensor counted as if alive at once."""
    b, T, H = DTYPE_BYTES[dtype], num_tokens, cfg.hidden_size
    q_dim, kv_dim, HV = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.gdn_num_v_heads
    # fused projection [q|gate|k|v], normed and rotated q and k, attention output, gate and gated output
    attention = T * b * (7 * q_dim + 4 * kv_dim + H)
    # fused in_proj, conv output, l2-normed q and k, the kernel's u / w / new v / output, norm output
    gdn = T * b * (2 * cfg.conv_dim + 6 * cfg.gdn_value_dim + 2 * HV + 2 * cfg.gdn_key_dim + H)
    if not decode:  # chunked rule: float32 gates and intra-chunk matrix, one [HV, K, V] state per chunk
        gdn += T * HV * (3 + _GDN_CHUNK) * 4
        gdn += math.ceil(T / _GDN_CHUNK) * HV * cfg.gdn_k_dim * cfg.gdn_v_dim * b
    mlp = 0
    if not all(cfg.moe_layers):  # [gate|up], silu(gate), product, output
        mlp = T * b * (4 * cfg.intermediate_size + H)
    if any(cfg.moe_layers):  # router logits (+ float32 softmax), per-assignment rows, shared expert
        k, inter, shared = cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        moe = T * cfg.num_experts * (b + 4) + T * k * b * (2 * H + 3 * inter) + T * b * (4 * shared + 2 * H)
        mlp = max(mlp, moe)
    return 2 * T * H * b + max(attention, gdn, mlp)


def estimate_activation_bytes(cfg: ModelConfig, dtype: str, num_tokens: int, num_sampled_rows: int) -> int:
    """Peak transient bytes of one step: the forward of `num_tokens` tokens, or the sampling of
    `num_sampled_rows` rows (with the final hidden states still alive), whichever is larger."""
    sampling = num_tokens * cfg.hidden_size * DTYPE_BYTES[dtype]
    sampling += num_sampled_rows * cfg.vocab_size * _SAMPLER_BYTES_PER_LOGIT
    return max(_forward_bytes(cfg, dtype, num_tokens, decode=False), sampling)


def estimate_cuda_graph_bytes(cfg: ModelConfig, dtype: str, max_num_seqs: int, performance_mode: str = "balanced") -> int:
    """Memory of the decode and single-chunk graphs: the largest graph's intermediates (smaller ones reuse its
    pool), plus the one static float32 logits output [max_num_seqs, V] that every graph writes."""
    sizes = graph_capture_sizes(max_num_seqs, performance_mode)
    forward = _forward_bytes(cfg, dtype, sizes[-1], decode=True)
    chunk_rows = max(chunk_graph_sizes(), default=0)
    if chunk_rows:  # the largest single-chunk graph; from PADDED_CHUNK_MIN_ROWS rows it runs the chunked rule
        forward = max(forward, _forward_bytes(cfg, dtype, chunk_rows, decode=chunk_rows < PADDED_CHUNK_MIN_ROWS))
    logit_rows = sizes[-1]
    largest = forward + logit_rows * cfg.vocab_size * DTYPE_BYTES[dtype]
    fixed = cuda_graph_count(max_num_seqs, performance_mode) * _GRAPH_FIXED_BYTES
    return largest + logit_rows * cfg.vocab_size * 4 + fixed
