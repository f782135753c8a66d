"""benchmarks/overlap_probe.py's arithmetic and checks, without a GPU."""

import pytest

from benchmarks.overlap_probe import main, mean_samples, overlap_saving


def test_nvidia_smi_samples_are_averaged_and_odd_lines_skipped():
    assert mean_samples("1410, 690.5\n1400, 700.5\n[N/A], 12\n\n1395") == {"sm_mhz": 1405.0, "power_w": 695.5}
    assert mean_samples("") == {}


def test_overlap_saving():
    assert overlap_saving(2.0, 1.0) == 0.5  # two equal parts, fully overlapped
    assert overlap_saving(2.0, 2.0) == 0.0


@pytest.mark.parametrize("argv, message", [(["--m", "0"], "--m must be at least 1, got 0"),
                                           (["--seconds", "0"], "--seconds must be positive, got 0.0")])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err
