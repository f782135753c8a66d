"""benchmarks/bars.py on the CPU: the bench's result blocks read back, each figure judged against its bar, starts
skipped where the card or the time left cannot take them."""

from types import SimpleNamespace

import pytest

from benchmarks import bars

RESULT = """============ Serving Benchmark Result ============
Successful requests:                     5
Benchmark duration (s):                  {duration}
Output token throughput (tok/s):         84.59
Total Token throughput (tok/s):          253.76
---------------Time to First Token----------------
Median TTFT (ms):                        {ttft}
-----Time per Output Token (excl. 1st token)------
Median TPOT (ms):                        {tpot}
==================================================
"""


def test_result_blocks_are_read_in_order():
    log = "progress 5/5\n" + RESULT.format(duration=30.26, ttft=70.0, tpot=11.63) + RESULT.format(
        duration=2.53, ttft=501.05, tpot=0.0)
    blocks = bars.results(log)
    assert [b["Median TPOT (ms)"] for b in blocks] == [11.63, 0.0]
    assert blocks[1]["Median TTFT (ms)"] == 501.05 and blocks[0]["Total Token throughput (tok/s)"] == 253.76
    server = next(s for s in bars.SERVERS if s.name == "27b-fp8")
    (w1, tpot), (w3, ttft) = bars.figures(server, log)
    assert (tpot, ttft) == (11.63, 501.05)
    assert (w1.verdict(tpot), w3.verdict(ttft), w1.verdict(6.9)) == ("bar <= 7: not met", "bar <= 450: not met",
                                                                    "bar <= 7: met")
    assert bars.Bar("W8 80B", "Median TPOT (ms)", None).verdict(3.1) == "reported"
    assert bars.figures(server, log.split("=====\n")[0])[1][1] is None  # the second run left no block


def test_every_start_names_a_shipped_config_and_a_bar_per_run():
    from deltaserve.model_configs import CONFIGS_DIR

    for server in bars.SERVERS:
        assert (CONFIGS_DIR / server.model / "config.json").is_file()
        assert len(server.bars) == len(server.runs) and all(len(run.split(":")) in (4, 5) for run in server.runs)


def test_starts_that_do_not_fit_are_skipped_and_the_rest_judged(tmp_path, monkeypatch):
    ran, clock = [], [0.0]

    def fake_run(server, outdir, timeout_s):
        ran.append(server.name)
        clock[0] += server.seconds  # it takes what the table expects
        (outdir / server.name).mkdir()
        tpot = {"w8-fp8": 2.41, "27b-awq": 5.0}[server.name]
        (outdir / server.name / "serve_bench.log").write_text(RESULT.format(duration=1, ttft=50, tpot=tpot))
        return 0

    monkeypatch.setattr(bars, "card_gib", lambda: 79.6)  # an H100: bf16 35B-A3B leaves W7 no KV pool
    monkeypatch.setattr(bars, "run_server", fake_run)
    monkeypatch.setattr(bars, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    assert bars.main([str(tmp_path), "--only", "w7,w8-fp8,27b-awq", "--budget-s", "150"]) == 0
    assert ran == ["w8-fp8"]  # after its ~110 s, 27b-awq's ~120 s no longer fit the 150 s
    text = (tmp_path / "bars.txt").read_text()
    assert "skipped w7: needs a card of 100 GiB" in text and "skipped 27b-awq: ~120 s, 40 s left" in text
    assert "W8 35B-A3B-FP8 TPOT ms" in text and "2.41   bar <= 2.5: met" in text


def test_unknown_starts_are_refused_by_name(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bars.main([str(tmp_path), "--only", "w9"])
    assert "unknown start(s) w9" in capsys.readouterr().err
