"""ModelRunner's memory ceiling: after an eager step, torch's free cached blocks are handed back when (and only
when) the device holds more than the budget (the GPU check: tests/gpu/test_quant_engine_gpu.py's 200K prompt)."""

from types import SimpleNamespace

import torch

from deltaserve.worker.model_runner import ModelRunner


def _runner_after_a_step(monkeypatch, ceiling, in_use, total=100):
    emptied = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (total - in_use, total))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    ModelRunner._keep_memory_within_ceiling(SimpleNamespace(memory_ceiling=ceiling, device=torch.device("cuda")))
    return emptied


def test_cached_blocks_are_handed_back_only_above_the_ceiling(monkeypatch):
    assert _runner_after_a_step(monkeypatch, ceiling=80, in_use=81) == [True]
    assert _runner_after_a_step(monkeypatch, ceiling=80, in_use=80) == []
    assert _runner_after_a_step(monkeypatch, ceiling=None, in_use=99) == []  # no budget planned: never
