"""benchmarks/tokenize_probe: times one call against pieces and refuses pieces whose ids differ."""

from __future__ import annotations

import pytest

from benchmarks import tokenize_probe
from deltaserve.engine import tokenize


def test_the_probe_times_both_and_checks_the_ids(monkeypatch, capsys):
    monkeypatch.setattr(tokenize, "MAX_PIECES", 4)
    monkeypatch.setattr(tokenize, "MIN_PIECE_CHARS", 512)
    assert tokenize_probe.main(["--tokens", "1000", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "up to 4 pieces of >= 512 chars"
    assert [line.split()[0] for line in lines[1:]] == ["words", "code"]
    assert all("4 pieces" in line for line in lines[1:]), lines
    assert tokenize.MAX_PIECES == 4  # restored after the one-call timing


def test_pieces_that_change_the_ids_stop_the_probe(monkeypatch):
    monkeypatch.setattr(tokenize, "MAX_PIECES", 4)
    monkeypatch.setattr(tokenize, "MIN_PIECE_CHARS", 512)
    monkeypatch.setattr(tokenize, "cut_after", lambda backend: " \r\n")  # a space does not end a BPE pre-token
    with pytest.raises(SystemExit, match="code at 1000 words"):
        tokenize_probe.main(["--tokens", "1000", "--repeats", "1"])
