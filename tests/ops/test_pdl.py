"""ops/pdl.py on the CPU: where programmatic dependent launch applies and how it is switched (the launches
themselves: tests/gpu/test_pdl_gpu.py)."""

import pytest
import torch

from deltaserve.ops import pdl


@pytest.fixture(autouse=True)
def _fresh_environment_reading():
    """pdl reads DELTASERVE_PDL once a process; each test here sets its own value."""
    pdl._env_allows.cache_clear()
    yield
    pdl._env_allows.cache_clear()


def test_cpu_tensors_launch_without_pdl(monkeypatch):
    monkeypatch.delenv(pdl.ENV_VAR, raising=False)
    assert not pdl.enabled(torch.device("cpu"))
    assert pdl.launch_args(torch.device("cpu")) == {"PDL": False}  # no launch_pdl for the interpreter


def test_a_wrong_switch_value_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(pdl.ENV_VAR, "yes")
    with pytest.raises(ValueError, match=r"DELTASERVE_PDL must be 0 or 1, got 'yes'"):
        pdl.enabled(torch.device("cpu"))


def test_set_enabled_overrides_the_environment_until_reset(monkeypatch):
    monkeypatch.setenv(pdl.ENV_VAR, "yes")  # not read while overridden
    try:
        pdl.set_enabled(False)
        assert not pdl.enabled(torch.device("cpu"))
    finally:
        pdl.set_enabled(None)
    with pytest.raises(ValueError):
        pdl.enabled(torch.device("cpu"))


def test_a_failed_start_up_check_turns_pdl_off_with_a_warning(monkeypatch, caplog):
    """A driver that cannot capture programmatic launches in a graph must not stop the engine: the check fails,
    PDL goes off for the process, and the log says why."""
    monkeypatch.setattr(pdl, "enabled", lambda device: pdl._override is not False)

    def no_pdl_in_graphs(device):
        raise RuntimeError("operation not supported when stream is capturing")

    monkeypatch.setattr(pdl, "_launch_eagerly_and_in_a_graph", no_pdl_in_graphs)
    try:
        with caplog.at_level("WARNING", logger="deltaserve.ops.pdl"):
            assert pdl.verify(torch.device("cuda")) is False
        assert pdl._override is False
        assert "failed its start-up check (RuntimeError: operation not supported" in caplog.text
    finally:
        pdl.set_enabled(None)


def test_a_passing_start_up_check_keeps_pdl_on(monkeypatch):
    monkeypatch.setattr(pdl, "enabled", lambda device: True)
    monkeypatch.setattr(pdl, "_launch_eagerly_and_in_a_graph", lambda device: None)
    assert pdl.verify(torch.device("cuda")) is True
    assert pdl._override is None
