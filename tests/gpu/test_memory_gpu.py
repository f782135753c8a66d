"""The memory plan against the memory really in use: Qwen3.5-27B on the H200 at --gpu-memory-utilization 0.95.

Run on an H200 by tests/gpu/run.sh; `python -m tests.gpu.test_memory_gpu CONFIG_DIR OUT.json` runs the
measurement alone. The engine (dummy weights, bf16, CUDA graphs and prefix caching on, max_model_len auto:
the model's 262,144 when the plan holds it) runs in a fresh process, so that memory cached by earlier tests
cannot blur the figures, and every byte is returned when it exits, even after running out of memory.

Asserted, each within TOLERANCE (2%):
- the KV pool, the GDN state pool and the weights the plan counts = the bytes of the tensors allocated;
- after startup: device memory in use (total - free from torch.cuda.mem_get_info: the CUDA context, cuBLAS
  workspaces and CUDA graphs included) within the budget (0.95 x device memory), and below it by no more than
  the activation headroom the plan holds back (the profile step's peak, estimated offline at 2.9 GiB, mostly
  top-p sampling of 256 rows of a 248K vocabulary), which is free between steps. Not an equality: the blocks
  torch keeps reserved but free after startup cannot be told apart into activation memory already held and
  blocks the plan counted in its measured runtime overhead (docs/memory.md, 'Measured on the H200');
- after one request of max_model_len - 16 random prompt tokens and 16 greedy tokens: memory in use = the budget.
Also asserted: the request finishes with 16 tokens and no out-of-memory error, and its activation peak
stays within the profiled one. Every figure is printed and, when DELTASERVE_GPU_OUT is set, written to
$DELTASERVE_GPU_OUT/memory_plan.json. Device time: about 2-3 minutes, most of it the 262K-token prefill.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from deltaserve.model_configs import CONFIGS_DIR

ROOT = Path(__file__).resolve().parents[2]
UTILIZATION = 0.95
OUTPUT_TOKENS = 16
TOLERANCE = 0.02
CHILD_TIMEOUT_S = 290  # within run.sh's 300 s per test

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one storage count once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def device_memory() -> dict[str, int]:
    """Device memory in use (total - free: everything, torch's or not) and torch's own figures."""
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"in_use": total - free, "torch_reserved": torch.cuda.memory_reserved(),
            "torch_allocated": torch.cuda.memory_allocated()}


def measure(config_dir: str) -> dict:
    """Start the engine, record the plan and the memory allocated, then serve one full-length request."""
    from deltaserve import LLM, SamplingParams
    from deltaserve.cache.plan_cli import describe_plan

    started = time.perf_counter()
    llm = LLM(config_dir, load_format="dummy", dtype="bfloat16", gpu_memory_utilization=UTILIZATION,
              enforce_eager=False, enable_prefix_caching=True, skip_tokenizer_init=True)
    engine, plan = llm.engine, llm.engine.memory_plan
    model = engine.runner.model
    figures = {
        "startup_s": time.perf_counter() - started,
        "device": plan.device_name,
        "cuda_graph_sizes": sorted(engine.runner.graphs.graphs),
        "plan_text": describe_plan(plan),
        "plan": dataclasses.asdict(plan) | {
            "budget_bytes": plan.budget_bytes, "weight_bytes": plan.weight_bytes,
            "kv_pool_bytes": plan.num_blocks * plan.kv_bytes_per_block,
            "state_pool_bytes": plan.num_state_slots * plan.state_bytes_per_slot, "pool_tokens": plan.pool_tokens},
        "allocated": {
            "weights": tensor_bytes(model.parameters()),
            "kv_pool": tensor_bytes(t for a in model.attention_layers for t in (a.k_cache, a.v_cache)),
            "state_pool": tensor_bytes(t for g in model.gdn_layers for t in (g.conv_state, g.ssm_state))},
        "after_startup": device_memory(),
    }

    prompt_len = plan.max_model_len - OUTPUT_TOKENS
    prompt = torch.randint(0, engine.model_config.vocab_size, (prompt_len,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    torch.cuda.reset_peak_memory_stats()
    allocated_before = torch.cuda.memory_allocated()
    request = {"prompt_tokens": prompt_len, "output_tokens": 0, "finish_reason": None, "prefill_s": None}
    started = time.perf_counter()
    engine.add_request("full-length", prompt, SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True))
    try:
        while engine.has_unfinished():
            for output in engine.step():
                if request["prefill_s"] is None:  # the first token comes with the end of the prefill
                    request["prefill_s"] = time.perf_counter() - started
                request["output_tokens"] = len(output.outputs[0].token_ids)
                request["finish_reason"] = output.outputs[0].finish_reason
    except torch.cuda.OutOfMemoryError as exc:
        request["error"] = f"out of memory: {exc}"
    request["total_s"] = time.perf_counter() - started
    request["activation_peak"] = torch.cuda.max_memory_allocated() - allocated_before
    figures["request"] = request
    figures["after_request"] = device_memory()
    return figures


def checks(figures: dict) -> list[dict]:
    """The comparisons the test asserts: planned vs measured bytes, and the difference allowed."""
    plan, allocated = figures["plan"], figures["allocated"]
    budget = plan["budget_bytes"]
    # (what, planned, measured, scale of the tolerance, bytes it may also fall short by)
    rows = [
        ("KV pool: planned vs allocated", plan["kv_pool_bytes"], allocated["kv_pool"], plan["kv_pool_bytes"], 0),
        ("GDN state pool: planned vs allocated", plan["state_pool_bytes"], allocated["state_pool"],
         plan["state_pool_bytes"], 0),
        ("weights: planned vs allocated", plan["weight_bytes"], allocated["weights"], plan["weight_bytes"], 0),
        ("budget vs in use after startup (short by at most the activation headroom)", budget,
         figures["after_startup"]["in_use"], budget, plan["activation_bytes"]),
        ("budget vs in use after the request", budget, figures["after_request"]["in_use"], budget, 0),
    ]
    return [dict(what=what, planned=planned, measured=measured, below=int(TOLERANCE * scale) + short,
                 above=int(TOLERANCE * scale), ok=-(TOLERANCE * scale + short) <= measured - planned <= TOLERANCE * scale)
            for what, planned, measured, scale, short in rows]


def size(value) -> str:
    """Byte counts with GiB beside them; other values as they are."""
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, bool) or not isinstance(value, int):
        return str(value)
    return f"{value:,} ({value / 2**30:.2f} GiB)" if value >= 2**20 else f"{value:,}"


def report(figures: dict) -> str:
    """The plan as the engine logs it, every measured figure, and each check."""
    plan = figures["plan"]
    lines = [figures["plan_text"],
             f"device {figures['device']}; startup {figures['startup_s']:.1f} s; CUDA graphs for "
             f"{len(figures['cuda_graph_sizes'])} batch sizes; max_model_len {plan['max_model_len']:,} "
             f"(the model's own: {plan['model_max_len']:,})"]
    for group in ("allocated", "after_startup", "request", "after_request"):
        lines += [f"  {group}.{name}: {size(value)}" for name, value in figures[group].items()]
    for check in figures["checks"]:
        change = (check["measured"] - check["planned"]) / check["planned"]
        lines.append(f"  {check['what']}: {check['planned']:,} vs {check['measured']:,} ({change:+.2%}, allowed "
                     f"-{size(check['below'])} / +{size(check['above'])}){'' if check['ok'] else '  FAILS'}")
    in_use = figures["after_startup"]["in_use"] / plan["budget_bytes"]
    lines.append(f"  in use after startup alone: {in_use:.2%} of the budget")
    return "\n".join(lines)


def config_dir() -> Path:
    """The published Qwen3.5-27B config, shipped in the package."""
    return CONFIGS_DIR / "qwen3.5-27b"


def test_plan_matches_memory_in_use_and_serves_a_full_length_request(tmp_path, capsys):
    config, out = config_dir(), tmp_path / "memory_plan.json"
    gc.collect()
    torch.cuda.empty_cache()  # what earlier tests left cached in this process is the engine's to use
    # the engine's log goes to this test's captured output, shown if the test fails
    child = subprocess.run([sys.executable, "-m", "tests.gpu.test_memory_gpu", str(config), str(out)], cwd=ROOT,
                           timeout=CHILD_TIMEOUT_S)
    assert child.returncode == 0, "the engine's process failed: see its log in the captured output"
    figures = json.loads(out.read_text())
    figures["checks"] = checks(figures)
    if os.environ.get("DELTASERVE_GPU_OUT"):
        Path(os.environ["DELTASERVE_GPU_OUT"], "memory_plan.json").write_text(json.dumps(figures, indent=1))
    with capsys.disabled():
        print(f"\n[memory plan gpu]\n{report(figures)}")

    request = figures["request"]
    assert "error" not in request, request.get("error")
    assert request["output_tokens"] == OUTPUT_TOKENS and request["finish_reason"] == "length"
    for check in figures["checks"]:
        assert check["ok"], f"{check['what']}: {check['planned']:,} vs {check['measured']:,}"
    assert request["activation_peak"] <= figures["plan"]["activation_bytes"], "a step used more than the profiled peak"


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    Path(sys.argv[2]).write_text(json.dumps(measure(sys.argv[1]), indent=1))
