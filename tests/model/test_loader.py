"""The weight loader (deltaserve/model/loader.py) on tiny random checkpoints written by transformers.

Loaded parameters must equal the checkpoint's tensors exactly, whatever the layout (single file or sharded,
per-expert or fused 3-D experts, text-only or multimodal names); anything wrong with a checkpoint is a
WeightLoadError naming the tensor or file. Dummy weights build every published shape on the meta device
and give seeded, finite weights and logits on the CPU.
"""

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from deltaserve.config import ModelConfig
from deltaserve.layers.batch import ForwardBatch
from deltaserve.model.loader import WeightLoadError, init_dummy_weights, load_model
from deltaserve.model_configs import CONFIGS_DIR
from deltaserve.worker.kv_cache import CacheShape, bind_caches
from tests.tolerance import assert_within, both_sides, unit_roundoff

# Published config -> nominal size in billions of parameters (from the model's name).
NOMINAL_BILLIONS = {"qwen3.5-0.8b": 0.8, "qwen3.5-4b": 4, "qwen3.5-9b": 9, "qwen3.5-27b": 27,
                    "qwen3.5-35b-a3b": 35, "qwen3.5-122b-a10b": 122, "qwen3.5-397b-a17b": 397,
                    "qwen3-next-80b-a3b": 80}
PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def load(path: Path, dtype: torch.dtype = torch.float32):
    return load_model(path, ModelConfig.from_pretrained(path), dtype, "cpu")


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def write_checkpoint(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, folder / "model.safetensors")
    return folder


def config_of(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def assert_same_parameters(a, b) -> None:
    params_a, params_b = dict(a.named_parameters()), dict(b.named_parameters())
    assert params_a.keys() == params_b.keys()
    for name, param in params_a.items():
        assert param.dtype == params_b[name].dtype, name
        assert torch.equal(param, params_b[name]), name


# ---------------------------------------------------------------- loading real layouts


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_next"])
def test_sharded_checkpoint_loads_like_single_file(arch, make_checkpoint):
    sharded = make_checkpoint(arch, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 3
    assert_same_parameters(load(make_checkpoint(arch)), load(sharded))


def test_loaded_parameters_equal_checkpoint_tensors(tiny_checkpoint):
    model = load(tiny_checkpoint)
    params = dict(model.named_parameters())
    covered = set()
    with safe_open(str(tiny_checkpoint / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            expert = PER_EXPERT.match(key)
            if expert is None:
                assert torch.equal(params[key], f.get_tensor(key)), key
                covered.add(key)
                continue
            prefix, e = expert.group(1), int(expert.group(2))
            if expert.group(3) == "gate_proj":  # checked once per expert, with its up_proj
                # our fused [E, 2I, H]: gate rows first, then up rows
                gate_up = torch.cat([f.get_tensor(key), f.get_tensor(f"{prefix}.{e}.up_proj.weight")])
                assert torch.equal(params[f"{prefix}.gate_up_proj"][e], gate_up), key
            elif expert.group(3) == "down_proj":
                assert torch.equal(params[f"{prefix}.down_proj"][e], f.get_tensor(key)), key
            covered.update({f"{prefix}.gate_up_proj", f"{prefix}.down_proj"})
    assert covered == params.keys()  # every parameter came from the file (none left uninitialised)
    assert all(p.dtype == torch.float32 for p in params.values())


def test_bfloat16_load_keeps_decay_in_float32(make_checkpoint):
    path = make_checkpoint("qwen3_5", dtype=torch.bfloat16)
    model = load(path, torch.bfloat16)
    tensors = read_tensors(path)
    for name, param in model.named_parameters():
        assert param.dtype == (torch.float32 if name.endswith("A_log") else torch.bfloat16), name
        assert torch.equal(param, tensors[name]), name


def stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors -> fused `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I]."""
    fused = {k: v for k, v in tensors.items() if not PER_EXPERT.match(k)}
    prefixes = {m.group(1) for m in map(PER_EXPERT.match, tensors) if m}
    for prefix in prefixes:
        num_experts = 1 + max(int(PER_EXPERT.match(k).group(2)) for k in tensors if k.startswith(prefix + "."))
        fused[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([tensors[f"{prefix}.{e}.gate_proj.weight"], tensors[f"{prefix}.{e}.up_proj.weight"]])
             for e in range(num_experts)])
        fused[f"{prefix}.down_proj"] = torch.stack(
            [tensors[f"{prefix}.{e}.down_proj.weight"] for e in range(num_experts)])
    return fused


def test_fused_expert_layout_loads_like_per_expert(make_checkpoint, tmp_path):
    source = make_checkpoint("qwen3_5_moe")
    fused = stack_experts(read_tensors(source))
    assert fused["model.layers.0.mlp.experts.gate_up_proj"].shape == (6, 48, 48)  # [E, 2I, H]
    assert fused["model.layers.0.mlp.experts.down_proj"].shape == (6, 48, 24)  # [E, H, I]
    assert not any(PER_EXPERT.match(k) for k in fused)
    assert_same_parameters(load(write_checkpoint(tmp_path / "fused", config_of(source), fused)), load(source))


@pytest.mark.parametrize("arch, model_type", [("qwen3_5", "qwen3_5"), ("qwen3_5_moe", "qwen3_5_moe")])
def test_multimodal_checkpoint_loads_text_model_and_skips_vision_and_mtp(arch, model_type, make_checkpoint,
                                                                         tmp_path):
    source = make_checkpoint(arch)
    tensors = {re.sub(r"^model\.", "model.language_model.", k): v for k, v in read_tensors(source).items()}
    assert "lm_head.weight" in tensors and "model.language_model.norm.weight" in tensors
    tensors.update({
        "model.visual.blocks.0.attn.qkv.weight": torch.randn(12, 8),
        "visual.merger.mlp.0.weight": torch.randn(8, 8),
        "mtp.fc.weight": torch.randn(48, 96),
        "mtp.layers.0.self_attn.q_proj.weight": torch.randn(128, 48),
    })
    config = {"model_type": model_type, "architectures": ["Qwen3_5ForConditionalGeneration"],
              "text_config": config_of(source), "vision_config": {"depth": 2}, "tie_word_embeddings": False}
    assert_same_parameters(load(write_checkpoint(tmp_path / "vl", config, tensors)), load(source))


def test_tied_embeddings_share_the_embedding(make_checkpoint, tmp_path):
    source = make_checkpoint("qwen3_5_tied")
    tensors = read_tensors(source)
    assert "lm_head.weight" not in tensors
    model = load(source)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, tensors["model.embed_tokens.weight"])
    # A tied checkpoint that still carries an lm_head copy: the copy is skipped, the tie stays.
    tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"])
    model = load(write_checkpoint(tmp_path / "with_head", config_of(source), tensors))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, tensors["model.embed_tokens.weight"])
    untied = load(make_checkpoint("qwen3_5"))
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


# ---------------------------------------------------------------- broken checkpoints

EXPERT = "model.layers.1.mlp.experts"


def _drop(name):
    return lambda tensors: tensors.pop(name)


def _set(name, tensor):
    return lambda tensors: tensors.__setitem__(name, tensor)


@pytest.mark.parametrize(
    "arch, edit, expected",
    [
        ("qwen3_5", _drop("model.layers.2.mlp.up_proj.weight"), ["lacks 1", "model.layers.2.mlp.up_proj.weight"]),
        ("qwen3_5", _drop("lm_head.weight"), ["lacks 1", "lm_head.weight"]),
        ("qwen3_5", _set("model.layers.0.mlp.bogus.weight", torch.zeros(2)),
         ["unexpected", "model.layers.0.mlp.bogus.weight"]),
        ("qwen3_5", _set("model.layers.0.linear_attn.in_proj_z.weight", torch.zeros(127, 48)),
         ["model.layers.0.linear_attn.in_proj_z.weight", "[127, 48]", "[128, 48]"]),
        ("qwen3_5", _set("model.layers.0.mlp.experts.0.gate_proj.weight", torch.zeros(24, 48)),
         ["unexpected", "model.layers.0.mlp.experts.0.gate_proj.weight"]),
        ("qwen3_5_moe", _drop(f"{EXPERT}.3.up_proj.weight"), ["lacks 1", f"{EXPERT}.gate_up_proj"]),
        ("qwen3_5_moe", _drop(f"{EXPERT}.5.down_proj.weight"), ["lacks 1", f"{EXPERT}.down_proj"]),
        ("qwen3_5_moe", _set(f"{EXPERT}.6.gate_proj.weight", torch.zeros(24, 48)),
         [f"{EXPERT}.6.gate_proj.weight", "expert 6", "num_experts 6"]),
        ("qwen3_5_moe", _set(f"{EXPERT}.2.down_proj.weight", torch.zeros(48, 23)),
         [f"{EXPERT}.2.down_proj.weight", "[48, 23]", "[48, 24]"]),
        ("qwen3_next", _set("model.layers.0.linear_attn.in_proj_ba.weight", torch.zeros(4, 48)),
         ["model.layers.0.linear_attn.in_proj_ba.weight", "[4, 48]", "[8, 48]"]),
        ("qwen3_5", _set("model.layers.0.self_attn.k_scale", torch.tensor(0.5)),
         ["model.layers.0.self_attn.k_scale", "not an attention layer"]),
        ("qwen3_5", _set("model.layers.3.self_attn.v_scale", torch.tensor(0.0)),
         ["model.layers.3.self_attn.v_scale", "positive finite", "0.0"]),
        ("qwen3_5", _set("model.layers.3.self_attn.k_scale", torch.ones(2)),
         ["model.layers.3.self_attn.k_scale", "one per-tensor scale", "(2,)"]),
    ],
    ids=["missing", "missing_lm_head", "unexpected", "shape", "experts_in_dense_layer", "missing_gate_up_slice",
         "missing_down_slice", "expert_out_of_range", "expert_shape", "next_fused_inproj_shape",
         "kv_scale_on_a_gdn_layer", "kv_scale_zero", "kv_scale_not_scalar"],
)
def test_broken_checkpoint_error_names_the_tensor(arch, edit, expected, make_checkpoint, tmp_path):
    source = make_checkpoint(arch)
    tensors = read_tensors(source)
    edit(tensors)
    path = write_checkpoint(tmp_path / "broken", config_of(source), tensors)
    with pytest.raises(WeightLoadError) as info:
        load(path)
    for part in expected:
        assert part in str(info.value), f"{part!r} not in {str(info.value)!r}"


def test_repeated_expert_slice_does_not_stand_in_for_a_missing_one(make_checkpoint, tmp_path):
    source = make_checkpoint("qwen3_5_moe")
    tensors = read_tensors(source)
    repeated = {f"{EXPERT}.0.gate_proj.weight": tensors[f"{EXPERT}.0.gate_proj.weight"]}
    del tensors[f"{EXPERT}.3.gate_proj.weight"]  # the slice count still adds up, one slice is missing
    path = write_checkpoint(tmp_path / "dup", config_of(source), tensors)
    save_file(repeated, path / "extra.safetensors")
    with pytest.raises(WeightLoadError, match=f"{EXPERT}.gate_up_proj"):
        load(path)
    # A whole second copy of every tensor is harmless: each slice is simply written twice.
    (path / "extra.safetensors").unlink()
    save_file(read_tensors(source), path / "model.safetensors")
    shutil.copy(path / "model.safetensors", path / "copy.safetensors")
    assert_same_parameters(load(path), load(source))


def test_shard_listed_in_index_but_missing(make_checkpoint, tmp_path):
    path = shutil.copytree(make_checkpoint("qwen3_5", max_shard_size="20KB"), tmp_path / "ckpt")
    shard = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]["model.norm.weight"]
    (path / shard).unlink()
    with pytest.raises(WeightLoadError, match="missing") as info:
        load(path)
    assert shard in str(info.value)


def test_unreadable_index(make_checkpoint, tmp_path):
    path = shutil.copytree(make_checkpoint("qwen3_5", max_shard_size="20KB"), tmp_path / "ckpt")
    (path / "model.safetensors.index.json").write_text('{"metadata": {}}')  # no weight_map
    with pytest.raises(WeightLoadError, match="model.safetensors.index.json"):
        load(path)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_unreadable_safetensors_file(damage, make_checkpoint, tmp_path):
    source = make_checkpoint("qwen3_5")
    path = shutil.copytree(source, tmp_path / "ckpt")
    data = (source / "model.safetensors").read_bytes()
    torn = bytes(range(256)) * 64 if damage == "garbage" else data[: len(data) // 2]
    (path / "model.safetensors").write_bytes(torn)
    with pytest.raises(WeightLoadError, match="cannot read checkpoint file") as info:
        load(path)
    assert str(path / "model.safetensors") in str(info.value)


def test_no_safetensors_at_all(make_checkpoint, tmp_path):
    path = tmp_path / "empty"
    path.mkdir()
    shutil.copy(make_checkpoint("qwen3_5") / "config.json", path)
    with pytest.raises(WeightLoadError, match=r"no \*\.safetensors") as info:
        load(path)
    assert str(path) in str(info.value) and "--load-format dummy" in str(info.value)


def test_unknown_load_format(make_checkpoint):
    path = make_checkpoint("qwen3_5")
    with pytest.raises(ValueError, match="--load-format 'pt'"):
        load_model(path, ModelConfig.from_pretrained(path), torch.float32, "cpu", load_format="pt")


# ---------------------------------------------------------------- dummy weights


@pytest.mark.parametrize("name", sorted(NOMINAL_BILLIONS))
def test_dummy_load_builds_every_published_shape_on_meta(name):
    path = CONFIGS_DIR / name / "config.json"
    cfg = ModelConfig.from_pretrained(path)
    model = load_model(None, cfg, torch.bfloat16, "meta", load_format="dummy")
    params = dict(model.named_parameters())
    assert all(p.is_meta for p in params.values())
    billions = sum(p.numel() for p in params.values()) / 1e9  # text model only: no vision tower, no MTP
    assert abs(billions / NOMINAL_BILLIONS[name] - 1) < 0.1, f"{billions:.2f}B parameters"
    H, gdn, attn = cfg.hidden_size, model.model.layers[0], model.model.layers[3]
    assert params["model.embed_tokens.weight"].shape == (cfg.vocab_size, H)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == cfg.tie_word_embeddings
    assert attn.self_attn.q_proj.weight.shape == (2 * cfg.num_heads * cfg.head_dim, H)  # [query | gate]
    assert gdn.linear_attn.conv1d.weight.shape == (cfg.conv_dim, 1, 4)
    assert gdn.linear_attn.A_log.dtype == torch.float32 and gdn.linear_attn.out_proj.weight.dtype == torch.bfloat16
    if cfg.num_experts:
        E, I = cfg.num_experts, cfg.moe_intermediate_size
        assert gdn.mlp.experts.gate_up_proj.shape == (E, 2 * I, H)
        assert gdn.mlp.experts.down_proj.shape == (E, H, I)


def dummy(cfg: ModelConfig, seed: int):
    return load_model(None, cfg, torch.float32, "cpu", load_format="dummy", seed=seed)


def last_token_logits(model, ids: list[int]) -> torch.Tensor:
    """One prefill of `ids` as a single sequence: the logits of its last token, [V]."""
    block_size = 4
    blocks = list(range(1, 1 + math.ceil(len(ids) / block_size)))  # block 0 is the null block
    bind_caches(model, CacheShape(num_blocks=len(blocks) + 1, block_size=block_size, num_state_slots=2,
                                  kv_dtype=torch.float32, ssm_dtype=torch.float32), "cpu")
    batch = ForwardBatch.build([0], [len(ids)], [blocks], [1], block_size)
    with torch.no_grad():
        hidden = model(torch.tensor(ids), batch)
        return model.compute_logits(hidden[batch.logits_indices])[0]


def test_dummy_weights_are_seeded_finite_and_give_finite_logits(tiny_checkpoint):
    cfg = ModelConfig.from_pretrained(tiny_checkpoint)
    first, again, other = dummy(cfg, 0), dummy(cfg, 0), dummy(cfg, 1)
    assert_same_parameters(first, again)
    for name, param in first.named_parameters():
        assert torch.isfinite(param).all(), name
        if name.endswith("A_log"):  # decay rates log U(1, 16)
            assert 0 <= param.min() and param.max() <= math.log(16), name
        if param.dim() >= 2 or name.endswith("A_log"):  # the randomly drawn ones
            assert not torch.equal(param, dict(other.named_parameters())[name]), name
    ids = [5, 17, 900, 3, 3, 64, 1000, 2, 511]
    logits = last_token_logits(first, ids)
    assert logits.shape == (cfg.vocab_size,)
    assert torch.isfinite(logits).all() and logits.std() > 0
    assert torch.equal(logits, last_token_logits(again, ids))


@pytest.mark.parametrize("shape", [(256, 4096), (200, 130)])  # K a multiple of 4 (codes drawn as words) or not
def test_dummy_fp8_weights_are_finite_codes_of_row_mean_square_about_one_over_k(shape):
    from deltaserve.layers.quant.fp8 import DUMMY_CODES, Fp8BlockScheme

    tensors = Fp8BlockScheme().dummy(shape, torch.Generator().manual_seed(3), "cpu")
    assert tensors["weight"].shape == shape and tensors["weight"].dtype == torch.float8_e4m3fn
    assert tensors["weight_scale_inv"].shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    assert DUMMY_CODES.view(torch.float8_e4m3fn).float().isfinite().all()
    w = tensors["weight"].float() * tensors["weight_scale_inv"][0, 0]
    assert torch.isfinite(w).all() and w.unique().numel() > 64  # codes spread over the table's 100 values
    assert abs(w.mean().item()) < 0.05 / shape[1] ** 0.5  # symmetric about 0
    # each row's mean square is a mean of K iid squares of the table's codes: within 5 standard errors of 1/K
    squares = DUMMY_CODES.view(torch.float8_e4m3fn).float().pow(2)
    spread = (squares.std(unbiased=False) / squares.mean()).item()  # ~1.4 (a normal's square: sqrt(2))
    mean_square = w.pow(2).mean(1) * shape[1]
    assert ((mean_square - 1).abs() <= 5 * spread / shape[1] ** 0.5).all()


def test_dummy_weights_fill_norms_at_identity(make_checkpoint):
    model = dummy(ModelConfig.from_pretrained(make_checkpoint("qwen3_5")), 0)
    for name, param in model.named_parameters():
        if name.endswith("linear_attn.norm.weight") or name.endswith("dt_bias"):  # plain weights: ones
            assert torch.equal(param, torch.ones_like(param)), name
        elif "norm" in name:  # zero-centred: scale (1 + w) = 1
            assert torch.equal(param, torch.zeros_like(param)), name


def test_init_dummy_weights_reseeds_a_loaded_model(make_checkpoint):
    path = make_checkpoint("qwen3_5_moe")
    cfg = ModelConfig.from_pretrained(path)
    model = load(path)
    init_dummy_weights(model, seed=3)
    assert_same_parameters(model, dummy(cfg, 3))


def test_dummy_shrunken_qwen3_5_0_8b_gives_finite_logits():
    path = CONFIGS_DIR / "qwen3.5-0.8b" / "config.json"
    # The full 0.8B is ~3 GB in float32: keep its real widths, cut it to 4 layers and a 1024-token vocab.
    raw = json.loads(path.read_text())
    text = raw["text_config"]
    text.update(num_hidden_layers=4, layer_types=text["layer_types"][:4], vocab_size=1024)
    cfg = ModelConfig.from_hf(raw)
    model = dummy(cfg, 0)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.layers[3].self_attn.q_proj.weight.shape == (2 * 8 * 256, 1024)  # real widths kept
    logits = last_token_logits(model, [1, 2, 3, 1000, 7])
    assert logits.shape == (1024,) and torch.isfinite(logits).all() and logits.std() > 0


def test_fp8_kv_scales_are_read_and_applied(make_checkpoint, tmp_path):
    """vLLM-named per-tensor KV scales are loaded onto their attention layers, and an fp8 cache stores
    K / k_scale, V / v_scale: the attention output matches the unscaled cache's within fp8 rounding."""
    source = make_checkpoint("qwen3_5")
    tensors = read_tensors(source)
    tensors.update({"model.layers.3.self_attn.k_scale": torch.tensor(0.5),
                    "model.layers.3.self_attn.v_proj.v_scale": torch.tensor([0.25]),
                    "model.layers.5.self_attn.attn.k_scale": torch.tensor(2.0, dtype=torch.bfloat16),
                    "model.layers.5.self_attn.v_scale": torch.tensor(4.0)})
    scaled = load(write_checkpoint(tmp_path / "scaled", config_of(source), tensors))
    plain = load(source)
    layers = {i: scaled.model.layers[i].self_attn for i in (3, 5)}
    assert [(a.k_scale, a.v_scale, a.kv_scales_from_checkpoint) for a in layers.values()] == [
        (0.5, 0.25, True), (2.0, 4.0, True)]
    assert not plain.attention_layers[0].kv_scales_from_checkpoint

    ids = torch.randint(0, 1024, (37,), generator=torch.Generator().manual_seed(3))
    results = {}
    for name, model in (("plain", plain), ("scaled", scaled)):
        bind_caches(model, CacheShape(8, 16, 2, torch.float8_e4m3fn, torch.float32), "cpu")
        batch = ForwardBatch.build([0], [37], [[1, 2, 3]], [1], 16)
        with torch.no_grad():
            results[name] = (model.compute_logits(model(ids, batch)), model.model.layers[3].self_attn.k_cache)
    (plain_logits, plain_cache), (scaled_logits, scaled_cache) = results["plain"], results["scaled"]
    # the scaled cache holds twice the unscaled values (k_scale 0.5), each rounded to e4m3 (3 mantissa bits):
    # within u = 1/16 relative on each side, or half the subnormal spacing 2^-9 (the scaled one's halved)
    fp8_u, half_spacing = unit_roundoff(torch.float8_e4m3fn), 0.5 * 2.0**-9
    plain_k = plain_cache[1:4].double()
    bound = both_sides(fp8_u * plain_k.abs() + half_spacing, fp8_u * plain_k.abs() + 0.5 * half_spacing)
    assert_within(scaled_cache[1:4].double() * 0.5, plain_k, bound, "scaled fp8 cache")
    assert not torch.equal(scaled_cache[1:4].float(), plain_cache[1:4].float())
    torch.testing.assert_close(scaled_logits, plain_logits, atol=0.1, rtol=0.1)
