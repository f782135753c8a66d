"""Quantized checkpoints on the GPU: every family's tiny checkpoint against the CPU reference, CUDA graphs against
eager, the published quantized configs starting with dummy weights, and the users' 32 GB-card configuration.

Run on an H200 by tests/gpu/run.sh (`TESTS=tests/gpu/test_quant_engine_gpu.py tests/gpu/run.sh OUT tests`).
- GPU bf16 vs CPU float32 on tame tiny checkpoints (tests/model/quant_checkpoints.py, matrix gain 0.5), with the
  criteria of tests/gpu/test_engine_gpu.py for bf16: teacher-forced top-1 agreement >= 0.9 and mean |diff| <=
  5% of the mean |logit|. Both sides multiply the same quantized weights (the CPU by ops.quant_gemm's reference,
  the GPU by its kernels); what differs is bf16 activations and rounding, as in the bf16 comparison.
- Graphs == eager, token for token, per family (both run the same padded batches).
- Every published -fp8/-awq/-nvfp4 config of a model that fits the H200 starts with dummy weights and decodes.
- ../shared/COMMAND_LINES.md 1: 27B NVFP4 on a 32 GB card (RTX 5090, 33,672,921,088 bytes as its driver reports)
  at 0.94 of it, fp8 KV, 200,000 tokens, 128 sequences asked, prefix caching, CUDA graphs. On the H200 the card is
  simulated by --gpu-memory-utilization = 0.94 x 32 GB / the H200's memory; a 199,984-token prompt is served with
  16 greedy tokens, in a fresh process (as test_memory_gpu), and the device memory in use stays within 2% of the
  32 GB card's budget.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.gpu.logits import chunked_logits, prompt

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_CONFIGS = ROOT / "deltaserve" / "model_configs"  # the published shapes the benchmarks serve
RTX_5090_BYTES = 33_672_921_088  # total memory as the CUDA driver reports it (cache/plan_cli.py GPUS)
USERS_UTILIZATION = 0.94
LONG_PROMPT = 200_000 - 16
TOLERANCE = 0.02
CHILD_TIMEOUT_S = 290  # within run.sh's 300 s per test

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

FAMILIES = [("fp8", {}), ("ct", dict(group_size=128)), ("ct", dict(group_size=32, symmetric=True)),
            ("awq", dict(group_size=128)), ("gptq", dict(group_size=128)), ("nvfp4", {})]


def family_id(value) -> str:
    return value if isinstance(value, str) else "-".join(f"{k}{v}" for k, v in value.items()) or "default"


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    from tests.model.quant_checkpoints import tiny_source

    root = tmp_path_factory.mktemp("quant-gpu")
    return {arch: tiny_source(root / arch, arch, matrix_gain=0.5) for arch in ("qwen3_5", "qwen3_5_moe")}


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("family, options", FAMILIES, ids=family_id)
def test_quantized_gpu_model_matches_cpu_reference(family, options, arch, sources, tmp_path, capsys):
    from tests.model.quant_checkpoints import quantize_checkpoint

    path = quantize_checkpoint(sources[arch], tmp_path, family, **options).path
    assert_gpu_matches_cpu_reference(path, f"{family} {options} {arch}", capsys)


def assert_gpu_matches_cpu_reference(path, label: str, capsys) -> None:
    """The checkpoint's logits in bf16 on the GPU against float32 on the CPU, a prompt in chunks then decode steps:
    top-1 agreement >= 0.9 and mean |diff| <= 5% of the mean |logit|."""
    ids = prompt(300, 1)
    chunks = [1, 100, 137, 40]  # crosses GDN chunks (64) and KV blocks (16); then 22 decode steps
    ref = chunked_logits(path, torch.float32, "cpu", ids, chunks)
    bf16 = chunked_logits(path, torch.bfloat16, "cuda", ids, chunks)
    agreement = (ref.argmax(-1) == bf16.argmax(-1)).float().mean().item()
    rel = ((ref - bf16).abs().mean() / ref.abs().mean()).item()
    with capsys.disabled():
        print(f"\n[quant gpu parity] {label}: bf16 top-1 agreement {agreement:.4f}, mean|diff|/mean|logit| {rel:.4f}")
    assert agreement >= 0.9 and rel <= 0.05


# GPTQ's tiny checkpoint has act order, which the stacks do not take (its experts run the dequantized reference)
@pytest.mark.parametrize("family, options", [f for f in FAMILIES if f[0] != "gptq"], ids=family_id)
def test_prompt_chunks_on_dequantized_expert_groups_match_cpu_reference(family, options, sources, tmp_path,
                                                                        monkeypatch, capsys):
    """The MoE checkpoint with every prompt chunk's experts on the dequantized groups' grouped matmul (ops/moe/
    dequantized.py, which the tile table gives only to chunks above 2,048 tokens: forced here for the 100- and
    137-token chunks, and one expert a group), against the CPU reference by the parity criteria above."""
    from deltaserve.ops import moe
    from deltaserve.ops.moe import dequantized
    from tests.model.quant_checkpoints import quantize_checkpoint

    shipped = moe.tiles_for
    monkeypatch.setattr(moe, "tiles_for", lambda *shape: shipped(*shape)._replace(grouped=shape[4] > 64))
    monkeypatch.setattr(dequantized, "SCRATCH_BYTES", 1)
    calls = []
    grouped = dequantized.grouped_experts
    monkeypatch.setattr(dequantized, "grouped_experts", lambda *args: calls.append(1) or grouped(*args))
    path = quantize_checkpoint(sources["qwen3_5_moe"], tmp_path, family, **options).path
    assert_gpu_matches_cpu_reference(path, f"{family} {options} qwen3_5_moe, dequantized groups", capsys)
    assert calls  # the chunks took the groups


@pytest.mark.parametrize("family, options", FAMILIES, ids=family_id)
def test_quantized_cuda_graphs_equal_eager_token_for_token(family, options, sources, tmp_path):
    from deltaserve import LLM, SamplingParams
    from tests.model.quant_checkpoints import quantize_checkpoint

    path = str(quantize_checkpoint(sources["qwen3_5_moe"], tmp_path, family, **options).path)
    prompts = [prompt(n, 10 + n) for n in (5, 77, 1, 300, 33)]  # 5 sequences: padded to the size-8 graph
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    graphs = LLM(path, dtype="bfloat16", max_num_seqs=16, enforce_eager=False, skip_tokenizer_init=True)
    eager = LLM(path, dtype="bfloat16", max_num_seqs=16, enforce_eager=True, skip_tokenizer_init=True)
    assert graphs.engine.runner.graphs.graphs and not eager.engine.runner.graphs.graphs
    a = [o.outputs[0].token_ids for o in graphs.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert a == b


def published(name: str) -> Path:
    """A shipped config: missing is a failure, never a skip."""
    found = SHIPPED_CONFIGS / name
    assert (found / "config.json").is_file(), f"no shipped config {found}"
    return found


@pytest.mark.parametrize("name", ["qwen3.5-27b-fp8", "qwen3.5-27b-awq", "qwen3.5-27b-nvfp4", "qwen3.5-35b-a3b-fp8",
                                  "qwen3.5-35b-a3b-awq", "qwen3.5-35b-a3b-nvfp4"])
def test_published_quantized_configs_start_with_dummy_weights(name, capsys):
    """The benchmarks' configs: each starts (CUDA graphs captured) and decodes; the weights it holds are the plan's."""
    from deltaserve import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(str(published(name)), load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=4,
              skip_tokenizer_init=True)
    out = llm.generate([prompt(64, 0, llm.engine.model_config.vocab_size)],
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    plan = llm.engine.memory_plan
    with capsys.disabled():
        print(f"\n[quant dummy] {name}: started and decoded in {time.perf_counter() - started:.1f} s; weights "
              f"{plan.weight_bytes / 2**30:.2f} GiB planned ({plan.weight_format})")


def serve_long_prompt(config: str) -> dict:
    """In a fresh process: the users' 32 GB-card configuration, one LONG_PROMPT-token request, its figures."""
    from deltaserve import LLM, SamplingParams
    from deltaserve.cache.plan_cli import describe_plan

    total = torch.cuda.mem_get_info()[1]
    utilization = USERS_UTILIZATION * RTX_5090_BYTES / total
    started = time.perf_counter()
    llm = LLM(config, load_format="dummy", dtype="bfloat16", gpu_memory_utilization=utilization,
              max_model_len=200_000, kv_cache_dtype="fp8", max_num_seqs=128, enable_prefix_caching=True,
              enforce_eager=False, skip_tokenizer_init=True)
    engine, plan = llm.engine, llm.engine.memory_plan
    figures = {"utilization": utilization, "budget": plan.budget_bytes, "plan_text": describe_plan(plan),
               "startup_s": time.perf_counter() - started, "max_num_seqs": plan.max_num_seqs}
    free, total = torch.cuda.mem_get_info()
    figures |= {"in_use_started": total - free, "reserved_started": torch.cuda.memory_reserved()}
    ids = prompt(LONG_PROMPT, 0, engine.model_config.vocab_size)
    started = time.perf_counter()
    try:
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        figures["output_tokens"] = len(out[0].outputs[0].token_ids)
    except torch.cuda.OutOfMemoryError as exc:
        figures["error"] = f"out of memory: {exc}"
    figures["request_s"] = time.perf_counter() - started
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    # in_use is what the card would see; the rest says which part grew: torch's pool or memory outside it
    figures |= {"in_use": total - free, "reserved": torch.cuda.memory_reserved(),
                "max_reserved": torch.cuda.max_memory_reserved(), "max_allocated": torch.cuda.max_memory_allocated(),
                "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0)}
    return figures


def test_27b_nvfp4_on_a_32gb_card_serves_a_200k_prompt(tmp_path, capsys):
    config, out = published("qwen3.5-27b-nvfp4"), tmp_path / "figures.json"
    torch.cuda.empty_cache()
    child = subprocess.run([sys.executable, "-m", "tests.gpu.test_quant_engine_gpu", str(config), str(out)],
                           cwd=ROOT, timeout=CHILD_TIMEOUT_S)
    assert child.returncode == 0, "the engine's process failed: see its log in the captured output"
    figures = json.loads(out.read_text())
    with capsys.disabled():
        print(f"\n[32 GB card, 27B NVFP4]\n{figures.pop('plan_text')}\n{json.dumps(figures, indent=1)}")
    assert "error" not in figures, figures["error"]
    assert figures["output_tokens"] == 16
    budget = USERS_UTILIZATION * RTX_5090_BYTES
    assert figures["in_use"] <= budget * (1 + TOLERANCE), f"{figures['in_use']:,} B in use > the card's {budget:,.0f}"


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    Path(sys.argv[2]).write_text(json.dumps(serve_long_prompt(sys.argv[1]), indent=1))
