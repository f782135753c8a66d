"""benchmarks/bars.py on the CPU: the bench's result blocks read back, each figure judged against its bar, starts
skipped where the card or the time left cannot take them."""

from types import SimpleNamespace

import pytest

from benchmarks import bars


def result_table(ttft: float, tpot: float) -> str:
    """A result block as `deltaserve bench serve` prints it (its own formatter), with these medians."""
    from deltaserve.bench.metrics import METRIC_NAMES, BenchmarkMetrics, MetricStats
    from deltaserve.bench.report import format_table

    medians = {"ttft": ttft, "tpot": tpot}
    metrics = BenchmarkMetrics(5, 0, 5120, 2560, 0.17, 0.0, 84.59, 253.76, 86.0, 1,
                               {name: MetricStats(1.0, medians.get(name, 1.0), 0.0, [(99.0, 2.0)])
                                for name in METRIC_NAMES})
    return format_table(metrics, 30.26, METRIC_NAMES, 1, float("inf"), False) + "\n"


def test_result_blocks_are_read_in_order():
    log = "progress 5/5\n" + result_table(ttft=70.0, tpot=11.63) + result_table(ttft=501.05, tpot=0.0)
    blocks = bars.results(log)
    assert [b["Median TPOT (ms)"] for b in blocks] == [11.63, 0.0]
    assert blocks[1]["Median TTFT (ms)"] == 501.05 and blocks[0]["Total Token throughput (tok/s)"] == 253.76
    for server in bars.SERVERS:  # every bar names a line the bench prints
        assert all(bar is None or bar.metric in blocks[0] for bar in server.bars), server.name
    server = next(s for s in bars.SERVERS if s.name == "27b-fp8")
    (w1, tpot), (w3, ttft) = bars.figures(server, log)
    assert (tpot, ttft) == (11.63, 501.05)
    assert (w1.verdict(tpot), w3.verdict(ttft), w1.verdict(6.9)) == ("bar <= 7: not met", "bar <= 450: not met",
                                                                    "bar <= 7: met")
    assert bars.Bar("W8 80B", "Median TPOT (ms)", None).verdict(3.1) == "reported"
    assert bars.figures(server, result_table(ttft=70.0, tpot=11.63))[1][1] is None  # the second run left no block


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
        (outdir / server.name / "serve_bench.log").write_text(result_table(ttft=50, tpot=tpot))
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


def test_a_start_past_its_time_is_stopped_with_the_server_it_started(tmp_path, monkeypatch):
    """run.sh starts the server in the background: stopping only run.sh would leave the server holding the card."""
    import time
    from pathlib import Path

    script = tmp_path / "tests" / "gpu" / "run.sh"
    script.parent.mkdir(parents=True)
    script.write_text('sleep 60 &\necho $! > "$1.child"\nwait\n')  # a "server" in the background, then wait for it
    monkeypatch.setattr(bars, "REPO", tmp_path)
    server = bars.SERVERS[0]
    began = time.monotonic()
    assert bars.run_server(server, tmp_path, timeout_s=1.0) == 124
    assert time.monotonic() - began < 30
    child = int((tmp_path / f"{server.name}.child").read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # gone, or a zombie waiting for its reaper
        stat = Path(f"/proc/{child}/stat")
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the background process {child} outlived its start's timeout")
