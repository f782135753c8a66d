"""benchmarks/host_probe.py on the CPU: a few steps of a few sequences, and its argument checks."""

import pytest

from benchmarks.host_probe import main


def test_reports_host_work_a_step(capsys):
    assert main(["--rows", "4", "--prompt-len", "8", "--output-len", "12", "--steps", "5"]) == 0
    assert "4 sequences, delta outputs:" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--rows", "0"], "--rows must be at least 1, got 0"),
    (["--steps", "600"], "--steps 600 must be below --output-len 512"),
    (["--server", "--clients", "0"], "--clients must be at least 1, got 0"),
    (["--server", "--rows", "2", "--clients", "3"], "--clients 3 is more than --rows 2"),
    (["--clients", "2"], "--clients goes with --server"),
    (["--loop", "uvloop"], "--loop goes with --server"),
    (["--stream-interval", "4"], "--stream-interval goes with --server"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


def test_reports_host_work_a_step_through_the_server(capsys):
    assert main(["--rows", "4", "--prompt-len", "8", "--output-len", "12", "--steps", "5", "--server"]) == 0
    out = capsys.readouterr().out
    assert "4 streams through the server:" in out and "ms of host work a step" in out


def test_streams_split_among_client_processes(capsys):
    assert main(["--rows", "5", "--prompt-len", "8", "--output-len", "12", "--steps", "5", "--server",
                 "--clients", "2", "--stream-interval", "3"]) == 0
    out = capsys.readouterr().out
    assert "5 streams through the server:" in out and "clients" in out
