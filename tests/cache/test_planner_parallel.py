"""The per-rank memory plan under tensor / pipeline parallelism: each rank's weights, KV bytes per token and GDN
state per slot equal what that rank's model builds and binds, and `deltaserve plan -tp N -pp M` prints them."""

import pytest
import torch

from deltaserve.cache.footprint import count_parameters, weight_bytes
from deltaserve.cache.plan_cli import main, tightest_plan
from deltaserve.cache.planner import plan
from deltaserve.cache.rank_share import rank_config, rank_share
from deltaserve.config import EngineConfig, ModelConfig
from deltaserve.model.loader import build_model
from deltaserve.model_configs import CONFIGS_DIR
from deltaserve.parallel_layout import RankLayout
from deltaserve.worker.distributed import ParallelContext

GIB = 2**30
# config -> tensor-parallel sizes to check (KV heads replicated where the size exceeds them)
CASES = [("qwen3.5-27b", 4), ("qwen3.5-122b-a10b", 2), ("qwen3.5-397b-a17b", 8), ("qwen3-next-80b-a3b", 4),
         ("qwen3.5-0.8b", 2)]


@pytest.mark.parametrize("name, tp", CASES)
def test_rank_plan_equals_the_rank_model_we_build(name, tp):
    cfg = ModelConfig.from_pretrained(CONFIGS_DIR / name)
    rank = ParallelContext(tp_rank=tp - 1, tp_size=tp)
    model = build_model(cfg, torch.bfloat16, "meta", parallel=rank)  # shapes only
    built = {}
    for param in model.parameters():
        key = str(param.dtype).removeprefix("torch.")
        built[key] = built.get(key, 0) + param.numel() * param.element_size()
    view, share = rank_config(cfg, rank), rank_share(cfg, rank)
    assert weight_bytes(view, "bfloat16", share=share) == built
    p = plan(cfg, EngineConfig(max_num_seqs=4, mamba_ssm_cache_dtype="float32"), device_memory_bytes=2000 * GIB,
             parallel=rank)
    kv = sum(2 * attn.num_kv_heads * cfg.head_dim * 2 for attn in model.attention_layers)
    gdn = model.gdn_layers
    state = sum(g.conv_dim * (cfg.conv_kernel - 1) * 2 + g.num_v_heads * g.k_dim * g.v_dim * 4 for g in gdn)
    assert (p.kv_bytes_per_token, p.state_bytes_per_slot) == (kv, state)
    assert p.weight_bytes == sum(built.values()) and f"tensor-parallel size {tp}" in p.rank


def test_pipeline_stages_split_the_layers_and_the_vocabulary_tensors():
    cfg = ModelConfig.from_pretrained(CONFIGS_DIR / "qwen3.5-27b")
    whole = count_parameters(cfg)
    stages = [ParallelContext(pp_rank=s, pp_size=3) for s in range(3)]
    parts = [count_parameters(rank_config(cfg, s), rank_share(cfg, s)) for s in stages]
    assert {key: sum(part[key] for part in parts) for key in whole} == whole
    assert parts[0]["lm_head"] == parts[1]["embed_tokens"] == parts[1]["lm_head"] == parts[2]["embed_tokens"] == 0
    assert [rank_config(cfg, s).num_layers for s in stages] == [22, 21, 21]  # 64 layers


def test_plan_cli_per_rank(capsys):
    assert main(["Qwen/Qwen3.5-122B-A10B", "--tensor-parallel-size", "2", "--gpu", "H200"]) == 0
    out = capsys.readouterr().out
    assert "per rank: one rank of tensor-parallel size 2" in out
    assert "x 1 KV heads x 256" in out  # 2 KV heads over 2 ranks
    assert main(["Qwen/Qwen3.5-27B", "-tp", "2", "-pp", "2", "--gpu", "H200"]) == 0
    out = capsys.readouterr().out
    assert "pipeline stage 0 of 2: layers 0-31 of 64" in out and "pipeline stage 1 of 2: layers 32-63 of 64" in out
    assert main(["cyankiwi/Qwen3.5-27B-AWQ-4bit", "-tp", "2", "--gpu", "H200"]) == 0  # int4 loads under TP now
    out = capsys.readouterr().out
    assert "per rank: one rank of tensor-parallel size 2" in out and "does not load" not in out


def test_plan_cli_names_a_size_that_does_not_divide(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["Qwen/Qwen3.5-27B", "--tensor-parallel-size", "5"])
    assert exit_info.value.code == 2
    assert "num_attention_heads = 24 does not divide over --tensor-parallel-size 5" in capsys.readouterr().err


def test_a_stage_without_attention_layers_plans_no_kv_bound():
    # Qwen3.5-0.8B's first three layers are GDN: over 8 stages stage 0 holds no attention layer
    cfg = ModelConfig.from_pretrained(CONFIGS_DIR / "qwen3.5-0.8b")
    stages = [plan(cfg, EngineConfig(max_num_seqs=4), device_memory_bytes=80 * GIB,
                   parallel=ParallelContext(pp_rank=stage, pp_size=8)) for stage in range(8)]
    assert stages[0].kv_bytes_per_token == 0 and stages[0].error is None
    assert stages[0].num_blocks >= max(p.num_blocks for p in stages[1:])  # only the sequences' need caps it
    assert tightest_plan(stages).num_blocks == min(p.num_blocks for p in stages)  # every rank's pool fits
    sized = plan(cfg, EngineConfig(max_num_seqs=4, kv_cache_memory_bytes=GIB), parallel=RankLayout(pp_size=8))
    assert sized.num_blocks < 2**31  # capped at what its sequences use, not the unbounded count
