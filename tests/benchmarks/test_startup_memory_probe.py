"""startup_memory_probe on the CPU: its stage hooks report around the wrapped call, and without a GPU it refuses
by name (it measures GPU memory)."""

import pytest
import torch

from benchmarks import startup_memory_probe


def test_hooks_report_before_and_after_the_wrapped_call(monkeypatch):
    events = []
    monkeypatch.setattr(startup_memory_probe, "report", lambda stage: events.append(stage))

    class Stage:
        def run(self, value):
            events.append("run")
            return value * 2

    startup_memory_probe.around(Stage, "run", "before", "after")
    assert Stage().run(21) == 42
    assert events == ["before", "run", "after"]
    startup_memory_probe.around(Stage, "run", None, "again")  # no report before
    events.clear()
    Stage().run(1)
    assert events == ["before", "run", "after", "again"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_without_a_gpu_it_refuses_by_name(capsys):
    with pytest.raises(SystemExit):
        startup_memory_probe.main(["deltaserve/model_configs/qwen3.5-0.8b"])
    assert "no CUDA device here" in capsys.readouterr().err
