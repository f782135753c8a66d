"""ModelRunner's memory ceiling: after an eager step, torch's free cached blocks are handed back when the device
holds more than the budget, at most once a MEMORY_TRIM_INTERVAL_S (the GPU check: tests/gpu/
test_quant_engine_gpu.py's 200K prompt)."""

from types import SimpleNamespace

import torch

from deltaserve.worker import model_runner
from deltaserve.worker.model_runner import MEMORY_TRIM_INTERVAL_S, ModelRunner


def test_cached_blocks_are_handed_back_above_the_ceiling_at_most_once_an_interval(monkeypatch):
    in_use, now, emptied = [0], [100.0], []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (100 - in_use[0], 100))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(now[0]))
    monkeypatch.setattr(model_runner.time, "monotonic", lambda: now[0])
    runner = SimpleNamespace(memory_ceiling=80, device=torch.device("cuda"), _last_trim=-MEMORY_TRIM_INTERVAL_S)

    def step(used, at):
        in_use[0], now[0] = used, at
        ModelRunner._keep_memory_within_ceiling(runner)

    step(80, 100.0)
    assert emptied == []  # at the ceiling: nothing to hand back
    step(81, 100.1)
    assert emptied == [100.1]
    step(90, 100.1 + MEMORY_TRIM_INTERVAL_S / 2)
    assert emptied == [100.1]  # too soon after the last
    step(90, 100.1 + MEMORY_TRIM_INTERVAL_S)
    assert emptied == [100.1, 100.1 + MEMORY_TRIM_INTERVAL_S]
    runner.memory_ceiling = None  # no budget planned: never
    step(99, 200.0)
    assert len(emptied) == 2
