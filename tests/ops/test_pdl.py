"""ops/pdl.py on the CPU: where programmatic dependent launch applies and how it is switched (the launches
themselves: tests/gpu/test_pdl_gpu.py)."""

import pytest
import torch

from deltaserve.ops import pdl


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
