"""Typed configuration: the model (parsed from a Hugging Face config.json) and the engine (vLLM flag names).

All validation lives here. Every error names the offending field or flag and its value, so a user who
pastes a config or a command line learns exactly what to change.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# model_type -> architecture family. The `*_text` types are what transformers' *ForCausalLM classes save.
_FAMILIES = {
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_next": "qwen3_next",
}
_LAYER_TYPES = ("linear_attention", "full_attention")


class ConfigError(ValueError):
    """A model config field or an engine flag has an invalid value."""


def _require(cfg: dict, name: str, source: str) -> Any:
    if name not in cfg or cfg[name] is None:
        raise ConfigError(f"{source}: required field '{name}' is missing")
    return cfg[name]


def _positive_int(cfg: dict, name: str, source: str) -> int:
    value = _require(cfg, name, source)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{source}: field '{name}' must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class ModelConfig:
    """The text model of a Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoint, in one typed shape."""

    family: str  # "qwen3_5" | "qwen3_5_moe" | "qwen3_next"
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    # gated full attention
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    # Gated DeltaNet
    conv_kernel: int
    gdn_num_k_heads: int
    gdn_num_v_heads: int
    gdn_k_dim: int
    gdn_v_dim: int
    # MLP: dense width (0 if no dense layer) and MoE shape (num_experts 0 if dense)
    intermediate_size: int
    moe_layers: tuple[bool, ...]
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"
    mamba_ssm_dtype: str | None = None

    @property
    def gdn_fused_inproj(self) -> bool:
        """Qwen3-Next stores in_proj_qkvz / in_proj_ba fused and interleaved per key head."""
        return self.family == "qwen3_next"

    @cached_property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @cached_property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def gdn_key_dim(self) -> int:
        return self.gdn_num_k_heads * self.gdn_k_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.gdn_num_v_heads * self.gdn_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN causal conv: [q | k | v]."""
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "ModelConfig":
        """Read `config.json` from a checkpoint directory (or a path to the json file itself)."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(f"no config.json found at '{path}'")
        try:
            raw = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read '{file}': {exc}") from exc
        cfg = cls.from_hf(raw, source=str(file))
        gen_file = file.parent / "generation_config.json"
        if gen_file.is_file():  # instruct releases list extra stop ids there (e.g. <|endoftext|>)
            try:
                gen = json.loads(gen_file.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise ConfigError(f"cannot read '{gen_file}': {exc}") from exc
            extra = [t for t in _as_id_tuple(gen.get("eos_token_id")) if t not in cfg.eos_token_ids]
            cfg = dataclasses.replace(cfg, eos_token_ids=cfg.eos_token_ids + tuple(extra))
        return cfg

    @classmethod
    def from_hf(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        """Parse a Hugging Face config dict of any supported model_type into one ModelConfig."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type not in _FAMILIES:
            raise ConfigError(
                f"{source}: unsupported model_type {model_type!r} "
                f"(architectures={raw.get('architectures')}); supported: {sorted(_FAMILIES)}"
            )
        family = _FAMILIES[model_type]
        cfg = raw
        if "text_config" in raw:
            if not isinstance(raw["text_config"], dict):
                raise ConfigError(f"{source}: field 'text_config' must be an object, got {raw['text_config']!r}")
            if "vision_config" in raw:
                logger.info("%s: vision_config ignored; serving the language model only", source)
            cfg = dict(raw["text_config"])
            # tie_word_embeddings may sit at the top level of multimodal configs
            cfg.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
            source = f"{source} text_config"
        elif model_type in ("qwen3_5", "qwen3_5_moe"):
            raise ConfigError(f"{source}: model_type {model_type!r} needs a 'text_config' object")

        hidden_act = cfg.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ConfigError(f"{source}: field 'hidden_act' must be 'silu', got {hidden_act!r}")
        if cfg.get("attn_output_gate", True) is not True:
            raise ConfigError(f"{source}: field 'attn_output_gate' = {cfg['attn_output_gate']!r} is not supported")

        num_layers = _positive_int(cfg, "num_hidden_layers", source)
        layer_types = cfg.get("layer_types")
        if layer_types is None:
            interval = cfg.get("full_attention_interval", 4)
            if not isinstance(interval, int) or interval <= 0:
                raise ConfigError(f"{source}: field 'full_attention_interval' must be a positive int, got {interval!r}")
            layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            n = len(layer_types) if isinstance(layer_types, list) else layer_types
            raise ConfigError(f"{source}: field 'layer_types' has {n} entries, expected num_hidden_layers={num_layers}")
        for i, t in enumerate(layer_types):
            if t not in _LAYER_TYPES:
                raise ConfigError(f"{source}: layer_types[{i}] = {t!r}; expected one of {_LAYER_TYPES}")

        hidden = _positive_int(cfg, "hidden_size", source)
        num_heads = _positive_int(cfg, "num_attention_heads", source)
        num_kv_heads = _positive_int(cfg, "num_key_value_heads", source)
        if num_heads % num_kv_heads:
            raise ConfigError(
                f"{source}: num_attention_heads={num_heads} is not divisible by num_key_value_heads={num_kv_heads}"
            )
        head_dim = cfg.get("head_dim") or hidden // num_heads
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or {}  # legacy configs spell its kind "type" (e.g. YaRN recipes)
        rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
        if rope_type != "default":
            raise ConfigError(f"{source}: rope_type {rope_type!r} is not supported (only 'default')")
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
        rotary_dim = int(head_dim * partial)
        if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
            raise ConfigError(
                f"{source}: partial_rotary_factor={partial} gives rotary dim {rotary_dim} for head_dim={head_dim}; "
                "it must be even and in (0, head_dim]"
            )

        k_heads = _positive_int(cfg, "linear_num_key_heads", source)
        v_heads = _positive_int(cfg, "linear_num_value_heads", source)
        if v_heads % k_heads:
            raise ConfigError(
                f"{source}: linear_num_value_heads={v_heads} is not divisible by linear_num_key_heads={k_heads}"
            )

        num_experts = cfg.get("num_experts", 0) or 0
        if family == "qwen3_5":
            moe_layers = (False,) * num_layers
        elif family == "qwen3_5_moe":
            moe_layers = (True,) * num_layers
        else:
            step = cfg.get("decoder_sparse_step", 1) or 1
            mlp_only = set(cfg.get("mlp_only_layers") or [])
            moe_layers = tuple(i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
        moe_kwargs: dict[str, Any] = {}
        if any(moe_layers):
            moe_kwargs = dict(
                num_experts=_positive_int(cfg, "num_experts", source),
                num_experts_per_tok=_positive_int(cfg, "num_experts_per_tok", source),
                moe_intermediate_size=_positive_int(cfg, "moe_intermediate_size", source),
                shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0) or 0,
                # qwen3_5_moe always renormalises; qwen3_next honours the flag
                norm_topk_prob=True if family == "qwen3_5_moe" else bool(cfg.get("norm_topk_prob", True)),
            )
            if moe_kwargs["num_experts_per_tok"] > moe_kwargs["num_experts"]:
                raise ConfigError(
                    f"{source}: num_experts_per_tok={moe_kwargs['num_experts_per_tok']} exceeds "
                    f"num_experts={moe_kwargs['num_experts']}"
                )
        intermediate = _positive_int(cfg, "intermediate_size", source) if not all(moe_layers) else 0

        return cls(
            family=family,
            vocab_size=_positive_int(cfg, "vocab_size", source),
            hidden_size=hidden,
            num_layers=num_layers,
            layer_types=tuple(layer_types),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            rope_theta=float(theta),
            conv_kernel=_positive_int({"linear_conv_kernel_dim": cfg.get("linear_conv_kernel_dim", 4)},
                                      "linear_conv_kernel_dim", source),
            gdn_num_k_heads=k_heads,
            gdn_num_v_heads=v_heads,
            gdn_k_dim=_positive_int(cfg, "linear_key_head_dim", source),
            gdn_v_dim=_positive_int(cfg, "linear_value_head_dim", source),
            intermediate_size=intermediate,
            moe_layers=moe_layers,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 262144)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=_as_id_tuple(cfg.get("eos_token_id")),
            torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
            mamba_ssm_dtype=cfg.get("mamba_ssm_dtype"),
            **moe_kwargs,
        )


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


DTYPES = ("auto", "float32", "bfloat16", "float16")
# fp8 and fp8_e4m3 both store float8_e4m3fn with per-tensor scales (vLLM's names); e5m2 is not built
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3")
SSM_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
# --quantization (vLLM's names) -> the checkpoint quant_method it names (layers/quant/detect.py); "fp8" on a bf16
# checkpoint quantizes it at load
QUANTIZATION_FLAGS = {"fp8": "fp8", "compressed-tensors": "compressed-tensors", "awq": "awq", "gptq": "gptq",
                      "modelopt": "modelopt", "modelopt_fp4": "modelopt"}
PERFORMANCE_MODES = ("balanced", "interactivity", "throughput")


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings. Field names are vLLM's flag names in snake_case (`--max-num-seqs` -> max_num_seqs).

    `model` None means the built-in tiny demo model. Sizes the user left unset stay None here and are
    resolved by the engine once the model and device are known.
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    load_format: str = "auto"
    quantization: str | None = None  # None: as the checkpoint's config says (layers/quant/detect.py)
    device: str = "auto"
    max_model_len: int | None = None  # None (or "auto", stored as None): the longest the model and the cache allow
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: by performance_mode (8192; 16384 for "throughput")
    block_size: int = 16
    tensor_parallel_size: int = 1  # ranks sharding each layer
    pipeline_parallel_size: int = 1  # pipeline stages, each a contiguous run of layers
    distributed_executor_backend: str = "mp"  # one worker process per rank (worker/executor.py)
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    kv_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    enforce_eager: bool = False
    # vLLM's presets, applied to what the user left unset: "interactivity" captures a CUDA graph for every
    # decode batch size up to 32 (no padding of small batches); "throughput" takes 16384 batched tokens a step
    performance_mode: str = "balanced"
    # launch step k+1 before reading back step k's samples (the device never waits on the host between steps)
    async_scheduling: bool = True
    enable_prefix_caching: bool = True
    # GDN state checkpoints the prefix cache may hold (each one working slot's size); None: sized by the engine
    prefix_cache_state_slots: int | None = None
    skip_tokenizer_init: bool = False
    generation_config: str = "auto"  # "auto" (from the checkpoint), "vllm" (ignore it) or a directory
    override_generation_config: dict = field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.max_model_len, str) and self.max_model_len.strip().lower() == "auto":
            object.__setattr__(self, "max_model_len", None)  # frozen dataclass: normalise before validating

        def positive(name: str, flag: str | None = None):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ConfigError(f"--{(flag or name).replace('_', '-')} must be a positive integer, got {value!r}")

        def choice(name: str, options):
            value = getattr(self, name)
            if value not in options:
                raise ConfigError(f"--{name.replace('_', '-')} {value!r} is not supported; choose one of {options}")

        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                     "kv_cache_memory_bytes", "num_gpu_blocks_override", "tensor_parallel_size",
                     "pipeline_parallel_size"):
            positive(name)
        choice("distributed_executor_backend", ("mp",))
        choice("dtype", DTYPES)
        choice("kv_cache_dtype", KV_CACHE_DTYPES)
        choice("mamba_ssm_cache_dtype", SSM_CACHE_DTYPES)
        choice("device", DEVICES)
        choice("performance_mode", PERFORMANCE_MODES)
        if self.quantization is not None:
            choice("quantization", tuple(QUANTIZATION_FLAGS))
        if self.max_num_batched_tokens is None:
            object.__setattr__(self, "max_num_batched_tokens", 16384 if self.performance_mode == "throughput" else 8192)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"--seed must be an integer, got {self.seed!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        slots = self.prefix_cache_state_slots
        if slots is not None and (not isinstance(slots, int) or isinstance(slots, bool) or slots < 0):
            raise ConfigError(f"--prefix-cache-state-slots must be a non-negative integer, got {slots!r}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ConfigError(f"--num-gpu-blocks-override must be >= 2 (block 0 is reserved), "
                              f"got {self.num_gpu_blocks_override}")
