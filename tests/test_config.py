"""ModelConfig.from_hf / from_pretrained: the published configs parse to the facts of the architecture
reference (../shared/reference/qwen3_5-architecture.md, section 1.4; the configs ship in
deltaserve/model_configs), derived fields follow the
transformers rules, and every bad config fails with a ConfigError naming the field and its value.
"""

import dataclasses
import json
import logging
import re
from pathlib import Path

import pytest

from deltaserve.config import ConfigError, ModelConfig
from deltaserve.demo import PAD_TOKEN_ID, TINY_CONFIGS
from deltaserve.model_configs import CONFIGS_DIR

# ---------------------------------------------------------------- ModelConfig

# Facts common to every published model (reference 1.4: "All: ..."): rotary dim = 256 * 0.25 = 64.
COMMON_FACTS = dict(head_dim=256, rotary_dim=64, gdn_k_dim=128, gdn_v_dim=128, conv_kernel=4,
                    rms_norm_eps=1e-6, max_position_embeddings=262144)
QWEN3_5 = dict(vocab_size=248320, rope_theta=1e7, eos_token_ids=(248044,), gdn_num_k_heads=16)
QWEN3_5_MOE = dict(QWEN3_5, family="qwen3_5_moe", intermediate_size=0, tie_word_embeddings=False,
                   norm_topk_prob=True)

# Hand-copied from the reference table (section 1.4), one row per bf16 config in deltaserve/model_configs.
EXPECTED = {
    "qwen3.5-0.8b": dict(QWEN3_5, family="qwen3_5", hidden_size=1024, num_layers=24, num_heads=8, num_kv_heads=2,
                         gdn_num_v_heads=16, intermediate_size=3584, tie_word_embeddings=True),
    "qwen3.5-4b": dict(QWEN3_5, family="qwen3_5", hidden_size=2560, num_layers=32, num_heads=16, num_kv_heads=4,
                       gdn_num_v_heads=32, intermediate_size=9216, tie_word_embeddings=True),
    "qwen3.5-9b": dict(QWEN3_5, family="qwen3_5", hidden_size=4096, num_layers=32, num_heads=16, num_kv_heads=4,
                       gdn_num_v_heads=32, intermediate_size=12288, tie_word_embeddings=False),
    "qwen3.5-27b": dict(QWEN3_5, family="qwen3_5", hidden_size=5120, num_layers=64, num_heads=24, num_kv_heads=4,
                        gdn_num_v_heads=48, intermediate_size=17408, tie_word_embeddings=False),
    "qwen3.5-35b-a3b": dict(QWEN3_5_MOE, hidden_size=2048, num_layers=40, num_heads=16, num_kv_heads=2,
                            gdn_num_v_heads=32, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                            shared_expert_intermediate_size=512),
    "qwen3.5-122b-a10b": dict(QWEN3_5_MOE, hidden_size=3072, num_layers=48, num_heads=32, num_kv_heads=2,
                              gdn_num_v_heads=64, num_experts=256, num_experts_per_tok=8,
                              moe_intermediate_size=1024, shared_expert_intermediate_size=1024),
    "qwen3.5-397b-a17b": dict(QWEN3_5_MOE, hidden_size=4096, num_layers=60, num_heads=32, num_kv_heads=2,
                              gdn_num_v_heads=64, num_experts=512, num_experts_per_tok=10,
                              moe_intermediate_size=1024, shared_expert_intermediate_size=1024),
    # Flat config with legacy top-level rope keys; intermediate_size 5120 is read but no layer uses it.
    "qwen3-next-80b-a3b": dict(family="qwen3_next", vocab_size=151936, rope_theta=5e6, eos_token_ids=(151645,),
                               hidden_size=2048, num_layers=48, num_heads=16, num_kv_heads=2, gdn_num_k_heads=16,
                               gdn_num_v_heads=32, intermediate_size=0, tie_word_embeddings=False,
                               num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                               shared_expert_intermediate_size=512, norm_topk_prob=True),
}

# transformers' model_type for each tiny arch of deltaserve.demo (what save_pretrained writes).
TINY_MODEL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_tied": "qwen3_5_text",
                    "qwen3_5_moe": "qwen3_5_moe_text", "qwen3_next": "qwen3_next"}


def shipped_config(name: str) -> Path:
    return CONFIGS_DIR / name / "config.json"


_DROP = object()  # an override value for `tiny` that removes the key


def tiny(arch: str = "qwen3_5", **overrides) -> dict:
    """A valid config.json dict of a tiny demo arch (as transformers writes it), with `overrides` applied."""
    raw = dict(TINY_CONFIGS[arch], model_type=TINY_MODEL_TYPES[arch])
    raw.update(overrides)
    return {k: v for k, v in raw.items() if v is not _DROP}


def multimodal(text: dict, model_type: str = "qwen3_5", **top) -> dict:
    """Wrap a text config the way Qwen3.5 releases do: a vision-language config with `text_config`."""
    return dict(model_type=model_type, architectures=["Qwen3_5ForConditionalGeneration"], text_config=text, **top)


def test_every_shipped_config_parses_and_has_reference_facts():
    names = sorted(p.parent.name for p in CONFIGS_DIR.glob("*/config.json"))
    assert names, f"no */config.json under {CONFIGS_DIR}"
    for name in names:
        ModelConfig.from_pretrained(CONFIGS_DIR / name)
    quantized = {name: re.sub(r"-(fp8|awq|nvfp4)$", "", name) for name in names}
    assert set(quantized.values()) <= set(EXPECTED), "add the new config's facts from the reference table to EXPECTED"
    for name, base in quantized.items():  # a quantized release has its base model's shapes
        if name != base:
            assert ModelConfig.from_pretrained(CONFIGS_DIR / name) == ModelConfig.from_pretrained(CONFIGS_DIR / base)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_published_config_matches_reference_table(name):
    cfg = ModelConfig.from_pretrained(shipped_config(name).parent)
    got = {field: getattr(cfg, field) for field in {**COMMON_FACTS, **EXPECTED[name]}}
    assert got == {**COMMON_FACTS, **EXPECTED[name]}
    # Full attention every 4th layer (3, 7, 11, ...), Gated DeltaNet elsewhere.
    assert cfg.full_attention_layers == tuple(range(3, cfg.num_layers, 4))
    assert len(cfg.linear_attention_layers) == cfg.num_layers * 3 // 4
    # conv channels [q | k | v] = 2 * HK * dk + HV * dv
    assert cfg.conv_dim == (2 * 16 + cfg.gdn_num_v_heads) * 128
    assert cfg.moe_layers == (cfg.family != "qwen3_5",) * cfg.num_layers
    assert cfg.gdn_fused_inproj == (cfg.family == "qwen3_next")


def test_qwen3_5_27b_in_detail():
    cfg = ModelConfig.from_pretrained(shipped_config("qwen3.5-27b"))  # the json file itself, not its folder
    assert cfg.full_attention_layers == (3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47, 51, 55, 59, 63)
    assert cfg.conv_dim == 10240
    assert (cfg.gdn_key_dim, cfg.gdn_value_dim) == (2048, 6144)
    assert not any(cfg.moe_layers) and cfg.num_experts == 0
    assert cfg.mamba_ssm_dtype == "float32" and cfg.torch_dtype == "bfloat16"


def test_vision_config_is_ignored_with_a_log_line(caplog):
    text = tiny()
    with caplog.at_level(logging.INFO, logger="deltaserve.config"):
        cfg = ModelConfig.from_hf(multimodal(text, vision_config={"depth": 27, "hidden_size": 1152}))
    assert any("vision_config" in record.getMessage() for record in caplog.records)
    assert cfg == ModelConfig.from_hf(text)


def test_top_level_tie_word_embeddings_reaches_the_text_model():
    text = tiny(tie_word_embeddings=_DROP)
    assert ModelConfig.from_hf(multimodal(text, tie_word_embeddings=True)).tie_word_embeddings
    assert not ModelConfig.from_hf(multimodal(text, tie_word_embeddings=False)).tie_word_embeddings


def _without(raw: dict, key: str) -> dict:
    return {k: v for k, v in raw.items() if k != key}


@pytest.mark.parametrize(
    "raw, expected",
    [
        (dict(tiny(), model_type="llama"), ["model_type", "'llama'"]),
        ({"model_type": "qwen3_5", "vision_config": {}}, ["text_config", "'qwen3_5'"]),
        (multimodal(None), ["text_config", "None"]),
        (_without(tiny(), "hidden_size"), ["'hidden_size'", "missing"]),
        (tiny(hidden_size=-48), ["'hidden_size'", "-48"]),
        (tiny(num_hidden_layers="6"), ["'num_hidden_layers'", "'6'"]),
        (tiny(num_attention_heads=6, num_key_value_heads=4), ["num_attention_heads=6", "num_key_value_heads=4"]),
        (tiny(linear_num_value_heads=3), ["linear_num_value_heads=3", "linear_num_key_heads=2"]),
        (tiny(layer_types=["linear_attention"] * 5), ["'layer_types'", "5 entries", "num_hidden_layers=6"]),
        (tiny(layer_types=["linear_attention", "full_attention", "mamba"] * 2), ["layer_types[2]", "'mamba'"]),
        (tiny(layer_types=_DROP, full_attention_interval=0), ["'full_attention_interval'", "0"]),
        (tiny(hidden_act="gelu"), ["'hidden_act'", "'gelu'"]),
        (tiny(attn_output_gate=False), ["'attn_output_gate'", "False"]),
        (tiny(rope_parameters=dict(TINY_CONFIGS["qwen3_5"]["rope_parameters"], rope_type="yarn")),
         ["rope_type", "'yarn'"]),
        # Legacy flat configs (Qwen3-Next) write rope_scaling with the older key "type" (YaRN recipes).
        (tiny("qwen3_next", rope_parameters=_DROP, rope_scaling={"type": "yarn", "factor": 4.0}),
         ["rope_type", "'yarn'"]),
        (tiny(rope_parameters=dict(TINY_CONFIGS["qwen3_5"]["rope_parameters"], partial_rotary_factor=0.1)),
         ["partial_rotary_factor=0.1", "head_dim=16"]),
        (tiny("qwen3_5_moe", num_experts_per_tok=7), ["num_experts_per_tok=7", "num_experts=6"]),
        (_without(tiny("qwen3_5_moe"), "moe_intermediate_size"), ["'moe_intermediate_size'", "missing"]),
        (_without(tiny("qwen3_next"), "intermediate_size") | {"mlp_only_layers": [0]},
         ["'intermediate_size'", "missing"]),
        ([1, 2], ["JSON object", "list"]),
    ],
    ids=["model_type", "no_text_config", "text_config_null", "no_hidden_size", "negative_hidden_size",
         "string_num_layers", "heads_vs_kv_heads", "linear_value_vs_key_heads", "layer_types_length",
         "layer_types_entry", "full_attention_interval", "hidden_act", "attn_output_gate", "rope_type",
         "legacy_rope_scaling_type", "rotary_dim", "top_k_over_experts", "no_moe_intermediate",
         "dense_layer_without_intermediate", "not_an_object"],
)
def test_bad_config_error_names_field_and_value(raw, expected):
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_hf(raw, source="bad/config.json")
    message = str(info.value)
    assert "bad/config.json" in message
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


def test_config_json_that_is_not_json(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_5",')
    with pytest.raises(ConfigError, match="cannot read") as info:
        ModelConfig.from_pretrained(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)


def test_missing_config_json(tmp_path):
    with pytest.raises(ConfigError, match="no config.json") as info:
        ModelConfig.from_pretrained(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in str(info.value)


@pytest.mark.parametrize(
    "num_layers, interval, full",
    [(8, None, (3, 7)), (8, 4, (3, 7)), (6, 2, (1, 3, 5)), (5, 1, (0, 1, 2, 3, 4)), (3, 4, ())],
)
def test_layer_types_built_from_full_attention_interval(num_layers, interval, full):
    raw = tiny(layer_types=_DROP, num_hidden_layers=num_layers,
               full_attention_interval=_DROP if interval is None else interval)
    cfg = ModelConfig.from_hf(raw)
    assert cfg.full_attention_layers == full
    assert cfg.linear_attention_layers == tuple(i for i in range(num_layers) if i not in full)


@pytest.mark.parametrize(
    "step, mlp_only, experts, moe",
    [
        (1, [], 5, (True,) * 6),
        (2, [], 5, (False, True, False, True, False, True)),
        (2, [3], 5, (False, True, False, False, False, True)),
        (1, [0, 4], 5, (False, True, True, True, False, True)),
        (1, [], 0, (False,) * 6),  # no experts: every layer dense
    ],
)
def test_qwen3_next_moe_layers(step, mlp_only, experts, moe):
    cfg = ModelConfig.from_hf(tiny("qwen3_next", decoder_sparse_step=step, mlp_only_layers=mlp_only,
                                   num_experts=experts))
    assert cfg.moe_layers == moe
    assert cfg.intermediate_size == (0 if all(moe) else 72)  # the dense width only where a layer is dense


def test_qwen3_next_norm_topk_prob_and_legacy_rope_keys():
    raw = tiny("qwen3_next", rope_parameters=_DROP, rope_theta=5e6, partial_rotary_factor=0.5,
               rope_scaling=None, norm_topk_prob=False)
    cfg = ModelConfig.from_hf(raw)
    assert (cfg.rope_theta, cfg.rotary_dim) == (5e6, 8)
    assert cfg.norm_topk_prob is False  # Qwen3-Next honours the flag ...
    # ... Qwen3.5-MoE always renormalises, whatever a transcription says.
    assert ModelConfig.from_hf(tiny("qwen3_5_moe", norm_topk_prob=False)).norm_topk_prob is True


def test_qwen3_5_moe_is_moe_everywhere():
    cfg = ModelConfig.from_hf(multimodal(tiny("qwen3_5_moe"), model_type="qwen3_5_moe"))
    assert cfg.family == "qwen3_5_moe" and cfg.moe_layers == (True,) * 6
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
            cfg.shared_expert_intermediate_size, cfg.intermediate_size) == (6, 2, 24, 32, 0)


def _write(folder: Path, config: dict, generation: dict | None = None) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def test_eos_ids_are_the_union_of_config_and_generation_config(tmp_path):
    folder = _write(tmp_path / "a", tiny(eos_token_id=None), {"eos_token_id": [1021, 1015]})
    assert ModelConfig.from_pretrained(folder).eos_token_ids == (1021, 1015)
    folder = _write(tmp_path / "b", tiny(eos_token_id=None), {"eos_token_id": 7})
    assert ModelConfig.from_pretrained(folder).eos_token_ids == (7,)
    # config.json's eos first, then the extra stop ids of generation_config.json (as instruct releases list them)
    folder = _write(tmp_path / "c", tiny(eos_token_id=1017), {"eos_token_id": [1021, 1015, 1017]})
    assert ModelConfig.from_pretrained(folder).eos_token_ids == (1017, 1021, 1015)
    folder = _write(tmp_path / "d", tiny(eos_token_id=None))
    assert ModelConfig.from_pretrained(folder).eos_token_ids == ()


def test_unreadable_generation_config_names_the_file(tmp_path):
    folder = _write(tmp_path, tiny(eos_token_id=None))
    (folder / "generation_config.json").write_text("not json")
    with pytest.raises(ConfigError, match="generation_config.json"):
        ModelConfig.from_pretrained(folder)


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_tiny_checkpoint_config_as_transformers_saves_it(arch, make_checkpoint):
    cfg = ModelConfig.from_pretrained(make_checkpoint(arch))
    expected = dataclasses.replace(ModelConfig.from_hf(tiny(arch)), torch_dtype="float32")
    # the demo's generation_config.json adds <|endoftext|> as a second stop id
    assert cfg == dataclasses.replace(expected, eos_token_ids=expected.eos_token_ids + (PAD_TOKEN_ID,))
