"""The memory planner: exact sizes for every published config (hand-computed below), the fit rules
(clamping, auto max_model_len, errors that name the numbers and a fix that really fits), and `deltaserve plan`.
"""

import argparse
import math
import re

import pytest
import torch

from deltaserve.cache.footprint import (count_parameters, estimate_cuda_graph_bytes, kv_bytes_per_token,
                                        ssm_cache_dtype, state_bytes_per_slot, weight_bytes)
from deltaserve.cache.plan_cli import GPUS, describe_plan, main, parse_bytes
from deltaserve.cache.planner import CPU_CACHE_BYTES, PlanError, plan
from deltaserve.config import ConfigError, EngineConfig, ModelConfig
from deltaserve.graph_sizes import graph_capture_sizes
from deltaserve.demo import TINY_CONFIGS
from deltaserve.layers.quant import detect_weight_format
from deltaserve.model.loader import build_model
from deltaserve.model_configs import CONFIGS_DIR
GIB = 2**30

# Hand-computed from the reference table (shared/reference, section 1.4); head_dim 256, dk = dv = 128, W = 4.
#   KV/token = attention layers x 2 x kv heads x 256 x itemsize          (attention layers = layers / 4)
#   state/seq = GDN layers x (conv_dim x 3 x 2 B  +  HV x 128 x 128 x ssm itemsize),  conv_dim = 4096 + 128 HV
# name: (KV B/token bf16, fp8, state B/seq with a float32 recurrent state, with bf16, nominal size in B params)
EXPECTED = {
    "qwen3.5-0.8b": (6 * 2 * 2 * 256 * 2, 6 * 2 * 2 * 256,
                     18 * (6144 * 6 + 16 * 16384 * 4), 18 * (6144 * 6 + 16 * 16384 * 2), 0.8),
    "qwen3.5-4b": (8 * 2 * 4 * 256 * 2, 8 * 2 * 4 * 256,
                   24 * (8192 * 6 + 32 * 16384 * 4), 24 * (8192 * 6 + 32 * 16384 * 2), 4),
    "qwen3.5-9b": (8 * 2 * 4 * 256 * 2, 8 * 2 * 4 * 256,
                   24 * (8192 * 6 + 32 * 16384 * 4), 24 * (8192 * 6 + 32 * 16384 * 2), 9),
    "qwen3.5-27b": (16 * 2 * 4 * 256 * 2, 16 * 2 * 4 * 256,
                    48 * (10240 * 6 + 48 * 16384 * 4), 48 * (10240 * 6 + 48 * 16384 * 2), 27),
    "qwen3.5-35b-a3b": (10 * 2 * 2 * 256 * 2, 10 * 2 * 2 * 256,
                        30 * (8192 * 6 + 32 * 16384 * 4), 30 * (8192 * 6 + 32 * 16384 * 2), 35),
    "qwen3.5-122b-a10b": (12 * 2 * 2 * 256 * 2, 12 * 2 * 2 * 256,
                          36 * (12288 * 6 + 64 * 16384 * 4), 36 * (12288 * 6 + 64 * 16384 * 2), 122),
    "qwen3.5-397b-a17b": (15 * 2 * 2 * 256 * 2, 15 * 2 * 2 * 256,
                          45 * (12288 * 6 + 64 * 16384 * 4), 45 * (12288 * 6 + 64 * 16384 * 2), 397),
    "qwen3-next-80b-a3b": (12 * 2 * 2 * 256 * 2, 12 * 2 * 2 * 256,
                           36 * (8192 * 6 + 32 * 16384 * 4), 36 * (8192 * 6 + 32 * 16384 * 2), 80),
}
# The literal figures the docs quote, so that the formulas above cannot drift unnoticed.
assert EXPECTED["qwen3.5-27b"][:4] == (65536, 32768, 153_944_064, 78_446_592)


def shared_config(name: str) -> ModelConfig:
    return ModelConfig.from_pretrained(CONFIGS_DIR / name)


def tiny_config() -> ModelConfig:
    return ModelConfig.from_hf(dict(TINY_CONFIGS["qwen3_5"], model_type="qwen3_5_text"))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_sizes_of_every_published_config(name):
    cfg = shared_config(name)
    kv_bf16, kv_fp8, state_fp32, state_bf16, billions = EXPECTED[name]
    assert kv_bytes_per_token(cfg, "bfloat16") == kv_bf16
    assert kv_bytes_per_token(cfg, "float8_e4m3fn") == kv_fp8
    assert sum(state_bytes_per_slot(cfg, "bfloat16", "float32")) == state_fp32
    assert sum(state_bytes_per_slot(cfg, "bfloat16", "bfloat16")) == state_bf16
    # The plan reports the same sizes through the engine flags (auto = the config's mamba_ssm_dtype).
    engine = EngineConfig(kv_cache_dtype="fp8", mamba_ssm_cache_dtype="bfloat16", max_num_seqs=4)
    p = plan(cfg, engine, device_memory_bytes=2000 * GIB)
    assert (p.kv_bytes_per_token, p.state_bytes_per_slot) == (kv_fp8, state_bf16)
    # Parameters as our model builds them (no MTP head, no vision tower): within 10% of the name's size.
    params = sum(count_parameters(cfg).values())
    assert 0.9 * billions * 1e9 <= params <= 1.1 * billions * 1e9, params


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_weight_bytes_equal_the_model_we_build(name):
    cfg = shared_config(name)
    model = build_model(cfg, torch.bfloat16, "meta")  # shapes only: no memory
    built = {}
    for param in model.parameters():  # a tied lm_head is the embedding: parameters() lists it once
        key = str(param.dtype).removeprefix("torch.")
        built[key] = built.get(key, 0) + param.numel() * param.element_size()
    assert weight_bytes(cfg, "bfloat16") == built
    assert built["float32"] == 4 * len(cfg.linear_attention_layers) * cfg.gdn_num_v_heads  # A_log only


def test_ssm_cache_dtype_auto_follows_the_config_else_the_model_dtype():
    assert ssm_cache_dtype("auto", shared_config("qwen3.5-27b"), "bfloat16") == "float32"  # mamba_ssm_dtype
    assert ssm_cache_dtype("auto", shared_config("qwen3-next-80b-a3b"), "bfloat16") == "bfloat16"  # as vLLM
    assert ssm_cache_dtype("float32", shared_config("qwen3-next-80b-a3b"), "bfloat16") == "float32"


def test_graph_sizes():
    assert graph_capture_sizes(1) == [1]
    assert graph_capture_sizes(13) == [1, 2, 4, 8, 13]
    assert graph_capture_sizes(17) == [1, 2, 4, 8, 16, 17]
    assert graph_capture_sizes(256)[-3:] == [240, 248, 256] and len(graph_capture_sizes(256)) == 35
    # --performance-mode interactivity: every size up to 32, then every 8
    assert graph_capture_sizes(40, "interactivity") == list(range(1, 33)) + [40]
    assert graph_capture_sizes(13, "interactivity") == list(range(1, 14))
    assert len(graph_capture_sizes(256, "interactivity")) == 32 + 27 + 1


def test_27b_on_an_h200_adds_up():
    cfg = shared_config("qwen3.5-27b")
    device = 150 * 10**9
    p = plan(cfg, EngineConfig(), device_memory_bytes=device, activation_bytes=3 * GIB, overhead_bytes=GIB)
    assert p.error is None and p.activation_measured and p.overhead_measured
    budget = int(device * 0.9)
    cache = budget - p.weight_bytes - 3 * GIB - p.cuda_graph_bytes - GIB
    assert p.cache_memory_bytes == cache
    # 256 working slots would take more than their share of what the checkpoint slots leave: the most that fit it
    n, state, checkpoints = p.max_num_seqs, 153_944_064, p.num_checkpoint_slots * 153_944_064
    kv_target = 262144 * 65536  # a = (kL + s) / (2kL + s): 50.2% at 262,144 tokens
    assert (n + 1) * state * (2 * kv_target + state) <= (kv_target + state) * (cache - checkpoints)
    assert 180 < n < 256 and any(note.startswith(f"--max-num-seqs clamped from 256 to {n}") for note in p.notes)
    one_more = plan(cfg, EngineConfig(max_num_seqs=n + 1), device_memory_bytes=device, activation_bytes=3 * GIB,
                    overhead_bytes=GIB)
    assert one_more.max_num_seqs == n
    states = (n + 1 + p.num_checkpoint_slots) * state
    assert p.num_blocks == (cache - states) // (16 * 65536)  # every whole block that fits, null block included
    assert p.pool_tokens == (p.num_blocks - 1) * 16 and p.max_model_len == 262144
    assert p.full_length_requests == (p.num_blocks - 1) // (262144 // 16)
    assert p.max_context == 262144
    # default checkpoints: at most 64, and at most 10% of the cache memory one sequence would leave
    cache_with_one_seq = budget - p.weight_bytes - 3 * GIB - estimate_cuda_graph_bytes(cfg, "bfloat16", 1) - GIB
    assert p.num_checkpoint_slots == min(64, int(0.1 * cache_with_one_seq) // 153_944_064) == 49
    assert p.info_labels()["num_gpu_blocks"] == str(p.num_blocks)


def test_explicit_max_model_len_that_does_not_fit_names_the_numbers_and_a_fix_that_fits():
    cfg = shared_config("qwen3.5-27b")
    flags = dict(max_model_len=262144, kv_cache_memory_bytes=9_150_000_000, max_num_seqs=3,
                 enable_prefix_caching=False)
    p = plan(cfg, EngineConfig(**flags), device_memory_bytes=150 * 10**9)
    # 4 slots (3 + the dummy) x 153,944,064 B leave 8,534,223,744 B: 8,138 blocks of 16 x 64 KiB, one null.
    pool = (8_534_223_744 // 2**20 - 1) * 16
    assert pool == 130_192 and p.pool_tokens == pool
    needed = 4 * 153_944_064 + (262144 // 16 + 1) * 2**20
    assert needed == 17_796_694_016
    with pytest.raises(PlanError) as err:
        p.check()
    message = str(err.value)
    assert "needs 262,144 tokens of KV cache; the pool holds 130,192" in message
    assert f"Raise --kv-cache-memory-bytes to at least {needed:,}" in message
    assert "or lower --max-model-len to 130,192" in message
    assert "--kv-cache-dtype fp8" in message
    # Each suggested change fits, and the suggested size is the smallest that keeps --max-num-seqs 3.
    assert plan(cfg, EngineConfig(**dict(flags, kv_cache_memory_bytes=needed))).error is None
    tighter = plan(cfg, EngineConfig(**dict(flags, kv_cache_memory_bytes=needed - 1)))
    assert tighter.error is None and tighter.max_num_seqs == 2  # one byte less: a sequence is given up
    assert plan(cfg, EngineConfig(**dict(flags, max_model_len=130_192))).error is None
    longer = plan(cfg, EngineConfig(**dict(flags, max_model_len=130_193)))  # fits by giving up a sequence
    assert longer.error is None and longer.max_num_seqs == 2
    assert plan(cfg, EngineConfig(**dict(flags, max_num_seqs=1))).error is not None  # no sequence to give up


def test_utilization_hint_is_the_smallest_utilization_that_fits():
    cfg = shared_config("qwen3.5-27b")
    flags = dict(max_model_len=262144, max_num_seqs=2, enable_prefix_caching=False)
    device = 80 * GIB
    p = plan(cfg, EngineConfig(**flags, gpu_memory_utilization=0.7), device_memory_bytes=device)
    hint = p.error.split("Raise --gpu-memory-utilization to at least ")[1]
    utilization = float(hint.split()[0])
    assert plan(cfg, EngineConfig(**flags, gpu_memory_utilization=utilization), device_memory_bytes=device).error \
        is None
    below = plan(cfg, EngineConfig(**flags, gpu_memory_utilization=utilization - 0.002), device_memory_bytes=device)
    assert below.error is not None or below.max_num_seqs < 2


def test_auto_max_model_len_is_the_largest_that_fits_and_is_noted():
    cfg = shared_config("qwen3.5-27b")
    flags = dict(kv_cache_memory_bytes=9_150_000_000, max_num_seqs=3, enable_prefix_caching=False)
    for max_model_len in (None, "auto"):
        p = plan(cfg, EngineConfig(max_model_len=max_model_len, **flags))
        assert p.error is None and p.max_model_len == 130_192 and p.max_num_seqs == 3
        assert any("max_model_len 130,192: the largest the KV pool holds" in note for note in p.notes)


def test_pool_must_hold_max_model_len_rounded_up_to_whole_blocks():
    cfg = tiny_config()  # 2 attention layers x 2 (K, V) x 2 heads x 16 x 4 B = 512 B per token on the CPU
    per_block, state = 16 * 512, 4 * (192 * 3 * 4 + 4 * 16 * 32 * 4)
    exact = dict(kv_cache_memory_bytes=(1 + 1) * state + 101 * per_block, max_num_seqs=1,
                 enable_prefix_caching=False)  # 2 slots, then 100 usable blocks + the null block
    assert plan(cfg, EngineConfig(**exact), on_gpu=False).pool_tokens == 1600
    for length, fits in ((1590, True), (1600, True), (1601, False)):
        assert (plan(cfg, EngineConfig(max_model_len=length, **exact), on_gpu=False).error is None) == fits


def test_max_num_seqs_is_clamped_with_a_note_never_an_error():
    cfg = shared_config("qwen3.5-27b")
    device = GPUS["h100"].memory_bytes
    p = plan(cfg, EngineConfig(), device_memory_bytes=device)
    assert p.error is None and 1 < p.max_num_seqs < 256 and p.requested_max_num_seqs == 256
    assert p.pool_tokens >= 262144 and p.max_model_len == 262144
    assert any(note.startswith(f"--max-num-seqs clamped from 256 to {p.max_num_seqs}") for note in p.notes)
    # the largest count that still leaves room for one full-length request
    again = plan(cfg, EngineConfig(max_num_seqs=p.max_num_seqs + 1), device_memory_bytes=device)
    assert again.max_num_seqs == p.max_num_seqs
    assert plan(cfg, EngineConfig(max_num_seqs=p.max_num_seqs), device_memory_bytes=device).notes == ()
    huge = plan(cfg, EngineConfig(max_num_seqs=100_000), device_memory_bytes=device)
    assert huge.error is None and huge.max_num_seqs <= p.max_num_seqs


def _worst_ratio(num_seqs: int, pool_tokens: int, state: int, per_token: int, max_len: int) -> float:
    """The fewest requests a split runs at once against one shared pool of the same bytes, over lengths up to
    max_len: min over l of min(slots, tokens / l) / (memory / (state + l * per_token))."""
    memory = num_seqs * state + pool_tokens * per_token
    return min(min(num_seqs, pool_tokens / length) * (state + length * per_token) / memory
               for length in range(16, max_len + 1, 16))


def test_a_short_max_model_len_gets_the_split_with_the_best_worst_length():
    """Qwen3.5-27B FP8 on an H100 at --max-model-len 4096 (W6's flags): the working state slots once took all the
    cache but one request's KV (244 slots, 4,304 tokens), so 64 clients of 1,536 tokens ran 4 at a time. Now the
    split is the one whose worst request length (up to 4,096) runs the most requests against one shared pool."""
    cfg = shared_config("qwen3.5-27b-fp8")
    fmt = detect_weight_format(CONFIGS_DIR / "qwen3.5-27b-fp8")
    p = plan(cfg, EngineConfig(max_model_len=4096), device_memory_bytes=GPUS["h100"].memory_bytes, weight_format=fmt)
    assert p.error is None and p.max_num_seqs < 256
    assert p.max_num_seqs >= 64 and p.pool_tokens >= 64 * (1024 + 512)  # W6's c=64 runs all at once
    assert (f"requests at once: {p.max_num_seqs} of up to {p.pool_tokens // p.max_num_seqs:,} tokens each (the state "
            f"slots), {p.full_length_requests} of 4,096 (the KV pool)") in describe_plan(p)
    state, per_token = p.state_bytes_per_slot, p.kv_bytes_per_token
    memory = (p.max_num_seqs + 1) * state + p.num_blocks * p.block_size * per_token  # the dummy and null included
    best = _worst_ratio(p.max_num_seqs, p.pool_tokens, state, per_token, 4096)
    # 61%, within whole slots: the count rounds down, and the dummy slot is memory the ratio does not count
    assert best == pytest.approx((4096 * per_token + state) / (2 * 4096 * per_token + state), abs=2 / p.max_num_seqs)
    for other in (p.max_num_seqs // 2, p.max_num_seqs - 8, p.max_num_seqs + 8, 244):  # the same bytes split otherwise
        tokens = (memory - (other + 1) * state) // per_token - p.block_size
        assert _worst_ratio(other, tokens, state, per_token, 4096) < best


def test_num_gpu_blocks_override_chooses_the_split_and_is_refused_past_the_device():
    cfg, device = shared_config("qwen3.5-27b-fp8"), GPUS["h100"].memory_bytes
    fmt = detect_weight_format(CONFIGS_DIR / "qwen3.5-27b-fp8")
    chosen = plan(cfg, EngineConfig(max_model_len=4096, num_gpu_blocks_override=1000), device_memory_bytes=device,
                  weight_format=fmt)
    assert chosen.error is None and chosen.max_num_seqs == 256 and chosen.num_blocks == 1000  # as given, unclamped
    over = plan(cfg, EngineConfig(max_model_len=4096, num_gpu_blocks_override=10_000), device_memory_bytes=device,
                weight_format=fmt)
    total = over.fixed_bytes + (256 + 1 + over.num_checkpoint_slots) * over.state_bytes_per_slot + 10_000 * 2**20
    assert total > device and over.error.startswith("--num-gpu-blocks-override 10,000 does not fit on this device")


def test_when_not_even_one_full_length_request_fits_states_get_half_the_cache():
    cfg = shared_config("qwen3.5-27b-awq")
    p = plan(cfg, EngineConfig(enable_prefix_caching=False), device_memory_bytes=GPUS["rtx5090"].memory_bytes,
             weight_format=detect_weight_format(CONFIGS_DIR / "qwen3.5-27b-awq"))
    assert p.error is None and p.max_model_len == p.pool_tokens < 262144
    states = (p.max_num_seqs + 1) * p.state_bytes_per_slot
    assert 2 * states <= p.cache_memory_bytes < 2 * (states + p.state_bytes_per_slot)
    assert any("get at most 50% of the cache memory" in note for note in p.notes)


def test_weights_that_do_not_fit_say_so():
    p = plan(shared_config("qwen3.5-27b"), EngineConfig(), device_memory_bytes=GPUS["rtx5090"].memory_bytes)
    assert p.error.startswith("the budget is 28.22 GiB (0.9 x 31.36 GiB); weights take 50.10 GiB")
    assert p.max_num_seqs == 256  # nothing to clamp: no sequence count would help


def test_cpu_plan_caps_the_pool_at_what_the_sequences_can_use():
    cfg = tiny_config()
    p = plan(cfg, EngineConfig(max_num_seqs=8, enable_prefix_caching=False), on_gpu=False)
    assert p.cache_memory_bytes == CPU_CACHE_BYTES and p.activation_bytes == 0 and p.cuda_graph_bytes == 0
    assert p.num_blocks == math.ceil(8 * cfg.max_position_embeddings / 16) + 1
    assert p.model_dtype == p.kv_cache_dtype == p.ssm_state_dtype == "float32"
    override = plan(cfg, EngineConfig(num_gpu_blocks_override=20, block_size=4), on_gpu=False)
    assert override.num_blocks == 20 and override.max_model_len == 76


def test_engine_config_accepts_fp8_and_auto_and_rejects_e5m2():
    assert EngineConfig(kv_cache_dtype="fp8_e4m3", max_model_len="auto").max_model_len is None
    with pytest.raises(ConfigError, match="--kv-cache-dtype 'fp8_e5m2' is not supported"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")


def test_plan_cli_27b_on_a_32gb_card_at_262k_with_fp8(capsys):
    flags = ["Qwen/Qwen3.5-27B", "--gpu", "RTX 5090", "--max-model-len", "262144", "--kv-cache-dtype", "fp8"]
    assert main(flags) == 1  # bf16 weights alone (50.10 GiB) are larger than the card
    out = capsys.readouterr().out
    assert "Memory plan for Qwen3.5-27B on RTX 5090" in out
    assert "DOES NOT FIT: the budget is 28.22 GiB" in out and "weights take 50.10 GiB" in out
    assert "KV per token: 32,768 B = 16 attention layers x 2 (K, V) x 4 KV heads x 256 x 1 B" in out
    assert "GDN state per sequence: 153,944,064 B" in out
    h200 = next(line for line in out.splitlines() if line.strip().startswith("H200"))
    assert "yes" in h200 and "262,144" in h200

    awq = [str(CONFIGS_DIR / "qwen3.5-27b-awq")] + flags[1:]  # its int4 weights read from its config: it fits
    assert main(awq + ["--served-model-name", "x"]) == 0
    out = capsys.readouterr().out
    assert "ignored (they do not change the memory plan): --served-model-name x" in out
    assert "=> max_model_len 262,144" in out and "full-length requests at once: 1" in out
    running = re.search(r"KV pool ([\d,]+) tokens; max_num_seqs (\d+) \(asked 256\)", out)
    assert int(running[1].replace(",", "")) >= 262144 and 1 < int(running[2]) < 256


def test_plan_cli_refuses_unknown_gpus_and_bad_numbers(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["some/model", "--gpu", "RTX 9999"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown GPU 'RTX 9999'; known: RTX 3090, RTX 4090, RTX 5090" in err and "H200" in err
    with pytest.raises(SystemExit):
        main(["some/model", "--gpu-memory", "lots"])
    assert "expected a number of bytes such as" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main([str(CONFIGS_DIR / "nonexistent")])
    assert exit_info.value.code == 2 and "nonexistent': no such file or directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path)])  # a directory, but no config.json in it
    assert exit_info.value.code == 2 and "no config.json found" in capsys.readouterr().err


def test_parse_bytes():
    assert parse_bytes("34359738368") == 34359738368
    assert parse_bytes("9.15e9") == 9_150_000_000
    assert parse_bytes("32GiB") == parse_bytes("32G") == 32 * GIB
    assert parse_bytes("32GB") == parse_bytes("32g") == 32 * 10**9
    assert parse_bytes("256K") == 262144
    for bad in ("-5", "1.5", "12 parsecs", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="number of bytes"):
            parse_bytes(bad)


def test_engine_startup_uses_the_plan(make_checkpoint):
    from deltaserve import LLM

    path = str(make_checkpoint("qwen3_5"))
    # tiny model on the CPU: 512 B of KV per token, 41,984 B of state per slot; 2 slots leave 14 blocks
    small = dict(kv_cache_memory_bytes=200_000, enable_prefix_caching=False)
    with pytest.raises(PlanError, match="needs 4,096 tokens of KV cache; the pool holds 208 "):
        LLM(path, max_model_len=4096, max_num_seqs=1, **small)
    engine = LLM(path, max_num_seqs=64, **small).engine  # auto: the longest that fits; seqs clamped
    assert engine.max_model_len == 208 and engine.scheduler.max_num_seqs == 1
    assert engine.cache_manager.block_pool.num_blocks == 14
    assert engine.runner.model.attention_layers[0].k_cache.shape[0] == 14


def test_profile_step_runs_the_largest_step_with_scratch_caches(make_checkpoint):
    """The GPU measures activations around this step; on the CPU it must run just the same."""
    from deltaserve.worker.setup import EngineSetup

    path = str(make_checkpoint("qwen3_5"))
    setup = EngineSetup(EngineConfig(model=path, max_num_seqs=2, enable_prefix_caching=False))
    model = setup.runner.model
    # 5,000 tokens exceed the tiny model's 4,096 positions: two sequences (4,096 + 904), 256 + 57 blocks + null
    scratch = setup._profile_step(model, EngineConfig(model=path, max_num_batched_tokens=5000, max_num_seqs=300))
    kv = 2 * 2 * (256 + 57 + 1) * 16 * 2 * 16 * 4  # 2 layers x (K, V) x blocks x block x heads x dim x 4 B
    states = 4 * 3 * (192 * 3 * 4 + 4 * 16 * 32 * 4)  # 4 GDN layers x (2 sequences + dummy) x (conv + ssm)
    assert scratch == kv + states
    assert model.attention_layers[0].k_cache is None and model.gdn_layers[0].ssm_state is None  # released
