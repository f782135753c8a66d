"""gdn_host_probe's command line on the CPU: bad flags are refused by name and value; without CUDA it says so."""

import pytest

from benchmarks import gdn_host_probe


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "64,x"], "--tokens takes comma-separated positive integers, got '64,x'"),
    (["--tokens", "0"], "--tokens takes comma-separated positive integers, got '0'"),
    (["--profile", "-1"], "--profile must be 0 or more, got -1"),
])
def test_bad_flags_are_named(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gdn_host_probe.main([str(tmp_path), *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_without_cuda_it_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gdn_host_probe.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        gdn_host_probe.main([str(tmp_path), "--tokens", "64"])
    assert "no CUDA device here" in capsys.readouterr().err
