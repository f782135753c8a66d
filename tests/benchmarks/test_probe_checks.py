"""The probes' output check (benchmarks/timing.check_output): a candidate that computes something else than the
reference is reported and never chosen for a table, whatever its time."""

import pytest
import torch

from benchmarks import timing
from benchmarks.timing import BROKEN_SHARE, BrokenOutput, check_output


def test_outputs_within_the_share_of_the_reference_pass():
    want = torch.tensor([[1.0, -4.0], [0.5, 2.0]])
    check_output(want + BROKEN_SHARE * 4.0 * 0.99, want)  # |reference| <= 4
    check_output((want.bfloat16(), None, want), (want, None, want))  # tuples, None entries skipped, any dtype


@pytest.mark.parametrize("actual, match", [
    (torch.tensor([[1.0, -4.0], [0.5, 2.0 + BROKEN_SHARE * 4.0 * 1.01]]), "max error"),
    (torch.tensor([[1.0, -4.0], [0.5, float("nan")]]), "max error"),
    (torch.zeros(2, 3), "shape"),
    ((torch.zeros(2, 2), torch.zeros(2, 2)), "2 outputs"),
])
def test_a_broken_output_is_named(actual, match):
    with pytest.raises(BrokenOutput, match=match):
        check_output(actual, torch.tensor([[1.0, -4.0], [0.5, 2.0]]))


def test_the_skinny_probe_never_picks_a_wrong_tile(monkeypatch):
    """Of three tiles the fastest computes garbage and one fails to build: the probe picks the correct one."""
    pytest.importorskip("triton")
    from benchmarks import batch_probe

    want = torch.arange(6.0).reshape(2, 3)
    outputs = {"fast-wrong": want.flip(1), "slow-right": want.clone(), "unbuildable": None}
    times = {"fast-wrong": 1.0, "slow-right": 5.0, "unbuildable": 0.5}

    def calls_for(tile):
        def call():
            if outputs[tile] is None:
                raise RuntimeError("out of shared memory")
            return outputs[tile]
        call.tile = tile
        return [call]

    monkeypatch.setattr(timing, "graph_time_us", lambda calls: times[calls[0].tile])
    best_time, best, top = batch_probe.best_tile(calls_for, want, sweep=list(outputs))
    assert (best_time, best) == (5.0, "slow-right") and top == [(5.0, "slow-right")]
    outputs["slow-right"] = want + 1.0
    with pytest.raises(RuntimeError, match="no tile"):
        batch_probe.best_tile(calls_for, want, sweep=list(outputs))
