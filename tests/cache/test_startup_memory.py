"""Start-up's memory on the GPU, in the parts that run without one: the allocator choice and the report that
compares what start-up left in use with the budget (worker/setup.py, worker/warm_up.py)."""

import os
from types import SimpleNamespace

import pytest
import torch

from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.worker import setup, warm_up
from deltaserve.worker.warm_up import memory_report

GIB = 2**30


@pytest.fixture
def allocator_calls(monkeypatch):
    """The settings passed to torch's allocator; the environment restored afterwards."""
    for name in setup.ALLOCATOR_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
    yield calls
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # monkeypatch restores only what it removed


def test_expandable_segments_are_chosen_when_the_user_chose_nothing(allocator_calls):
    assert setup.prefer_expandable_segments()
    assert allocator_calls == ["expandable_segments:True"]
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"  # what spawned ranks inherit


def test_the_newer_setter_serves_where_torch_dropped_the_old_one(allocator_calls, monkeypatch):
    newer = []
    monkeypatch.delattr(torch.cuda.memory, "_set_allocator_settings")
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", newer.append, raising=False)
    assert setup.prefer_expandable_segments()
    assert newer == ["expandable_segments:True"] and allocator_calls == []


@pytest.mark.parametrize("name", setup.ALLOCATOR_ENV_VARS)
def test_a_users_allocator_setting_is_kept(allocator_calls, monkeypatch, name):
    monkeypatch.setenv(name, "expandable_segments:False")
    assert not setup.prefer_expandable_segments()
    assert allocator_calls == []
    assert os.environ[name] == "expandable_segments:False"


def test_memory_within_the_budget_is_reported_as_info():
    over, line = memory_report(29 * GIB, 30 * GIB, 32 * GIB, 0.9375)
    assert not over
    assert line == "device memory in use after start-up: 29.00 GiB of the 30.00 GiB budget (0.9375 x 32.00 GiB)"


def test_an_overshoot_names_the_utilization_that_keeps_the_bytes_asked_for():
    # 0.75 GiB over a 29.48 GiB budget of 31.36 GiB: the same start-up under a budget 0.75 GiB smaller would use
    # 29.48, so the utilization named is (29.48 - 0.75) / 31.36 = 0.9161..., rounded down
    total, utilization = int(31.36 * GIB), 0.94
    budget = int(total * utilization)
    over, line = memory_report(budget + int(0.75 * GIB), budget, total, utilization)
    assert over
    assert "0.75 GiB over" in line
    assert line.endswith(f"--gpu-memory-utilization 0.916 would keep it within {budget / GIB:.2f} GiB")


def test_the_steps_planned_activations_count_against_the_budget():
    """Start-up's steps hand their activations back before the report: in use and the activations the plan
    reserved for eager steps together are what serving takes, the utilization named keeping both in the budget."""
    over, line = memory_report(29 * GIB, 30 * GIB, 32 * GIB, 0.9375, activations=GIB // 2)
    assert not over
    assert line == ("device memory in use after start-up: 29.00 GiB + 0.50 GiB of the steps' planned activations of "
                    "the 30.00 GiB budget (0.9375 x 32.00 GiB)")
    over, line = memory_report(29 * GIB + GIB // 2, 30 * GIB, 32 * GIB, 0.9375, activations=GIB)
    assert over
    assert line.endswith("0.50 GiB over, which start-up's measured figures did not foresee; "
                         "--gpu-memory-utilization 0.921 would keep it within 30.00 GiB")  # (30 - 0.5) / 32 = 0.9218


def test_start_up_hands_back_the_warm_ups_cached_blocks_before_reporting(monkeypatch):
    """LLMEngine.warm_up: the steps, then the compile watch installed, then torch's cache emptied (what their
    one-off shapes left reserved), then the memory in use reported: the report sees what serving starts from; the
    runner's memory ceiling is then the budget, or what start-up left in use with the activations the plan
    reserved for eager steps where that is more (so that a step's planned working set is not handed back after
    every step). Under -tp / -pp the workers do all but the steps."""
    calls, in_use = [], [0]
    monkeypatch.setattr(warm_up, "engine_steps", lambda engine: calls.append("steps"))
    monkeypatch.setattr(warm_up, "watch_compiles", lambda: calls.append("watch_compiles"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(warm_up, "check_memory", lambda plan, device: calls.append("check_memory") or in_use[0])
    engine = LLMEngine.__new__(LLMEngine)
    engine.memory_plan = SimpleNamespace(budget_bytes=10 * GIB, activation_bytes=GIB // 2)
    for used, ceiling in ((9 * GIB, 10 * GIB), (9 * GIB + 3 * GIB // 4, 10 * GIB + GIB // 4),
                          (11 * GIB, 11 * GIB + GIB // 2)):
        calls.clear()
        in_use[0], engine.runner = used, SimpleNamespace(device="cuda:0", memory_ceiling=None)
        engine.warm_up()
        assert calls == ["steps", "watch_compiles", "empty_cache", "check_memory"]
        assert engine.runner.memory_ceiling == ceiling
    calls.clear()
    engine.runner = SimpleNamespace(device="cpu", workers_device_type="cuda",
                                    after_warm_up=lambda plan: calls.append(("after_warm_up", plan)))
    engine.warm_up()
    assert calls == ["steps", ("after_warm_up", engine.memory_plan)]


def test_a_kernel_compiled_after_start_up_is_logged_with_what_it_specialized_on(monkeypatch, caplog):
    """warm_up.watch_compiles: from then on, every Triton variant compiled is a warning naming the kernel and its
    signature and specializations (what the warm-up should have met), and it is still compiled; a hook installed
    before it (the offline bench's compile log) still sees every variant, and a second call adds no second watch."""
    import triton

    seen = []
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", lambda **kwargs: seen.append(kwargs["fn"].name)
                        or False)  # the earlier hook; the original is restored after the test
    warm_up.watch_compiles()
    warm_up.watch_compiles()
    hook = triton.knobs.runtime.jit_cache_hook
    with caplog.at_level("WARNING", logger=warm_up.__name__):
        compiled = {"signature": {"x_ptr": "*bf16", "rows": "i32"}, "configs": [{(1,): [["tt.divisibility", 16]]}]}
        skipped = hook(key="k", repr="r", fn=SimpleNamespace(name="_fused_moe_kernel_a"), compile=compiled,
                       is_manual_warmup=False, already_compiled=False)
    assert skipped is False
    assert seen == ["_fused_moe_kernel_a"]
    [record] = caplog.records
    assert record.levelname == "WARNING"
    assert "_fused_moe_kernel_a" in record.getMessage() and "'rows': 'i32'" in record.getMessage()
    assert "tt.divisibility" in record.getMessage()
