"""`bench sweep` against the scripted fake server: one run per value, the sweep JSON, the PNG, bad input."""

import json

import pytest

from deltaserve.bench.cli import build_parser, main
from deltaserve.bench.errors import BenchInputError
from deltaserve.bench.sweep import run_sweep

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _sweep_argv(server, tokenizer_dir, tmp_path, *flags):
    return ["sweep", "--base-url", server.base_url, "--tokenizer", tokenizer_dir, "--disable-tqdm",
            "--request-id-prefix", "bench-", "--random-input-len", "8", "--random-output-len", "3",
            "--num-prompts", "4", "--ready-check-timeout-sec", "0",
            "--sweep-output", str(tmp_path / "out" / "sweep.json"), *flags]


def test_concurrency_sweep_writes_json_and_png(fake_server, tokenizer_dir, tmp_path):
    fake_server.first_delay, fake_server.gap = 0.02, 0.01
    argv = _sweep_argv(fake_server, tokenizer_dir, tmp_path, "--max-concurrency-list", "1,2,4", "--num-gpus", "2",
                       "--temperature", "0")
    assert main(argv) == 0

    # every point sent all its prompts with the other flags passed through
    assert len(fake_server.received) == 12
    assert all(body["max_tokens"] == 3 and body["temperature"] == 0.0 for _, body in fake_server.received)

    sweep = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert (sweep["sweep_parameter"], sweep["sweep_values"], sweep["num_gpus"]) == ("max_concurrency", [1, 2, 4], 2)
    assert [r["max_concurrency"] for r in sweep["results"]] == [1, 2, 4]
    assert [p["max_concurrency"] for p in sweep["points"]] == [1, 2, 4]
    for point, result in zip(sweep["points"], sweep["results"]):
        assert (result["completed"], result["failed"], result["total_output_tokens"]) == (4, 0, 12)
        assert point["output_throughput_per_gpu"] == pytest.approx(result["output_throughput"] / 2)
        assert point["median_tpot_ms"] == result["median_tpot_ms"]
        assert point["median_ttft_ms"] == result["median_ttft_ms"]
    # more requests in flight finish the same work sooner on the (infinitely parallel) fake server
    durations = [r["duration"] for r in sweep["results"]]
    assert durations[0] > durations[2]

    png = (tmp_path / "out" / "sweep.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 10_000


def test_rate_sweep_records_inf_as_a_string(fake_server, tokenizer_dir, tmp_path):
    fake_server.first_delay, fake_server.gap = 0.01, 0.005
    args = build_parser().parse_args(_sweep_argv(fake_server, tokenizer_dir, tmp_path, "--request-rate-list",
                                                 "50,inf"))
    sweep = run_sweep(args)
    assert (sweep["sweep_parameter"], sweep["sweep_values"]) == ("request_rate", [50.0, "inf"])
    assert [r["request_rate"] for r in sweep["results"]] == [50.0, "inf"]
    assert args.request_rate == float("inf")  # the caller's namespace is left as parsed
    saved = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert saved["sweep_values"] == [50.0, "inf"]
    assert (tmp_path / "out" / "sweep.png").stat().st_size > 0


@pytest.mark.parametrize("flags, message", [
    ((), "needs --max-concurrency-list or --request-rate-list"),
    (("--max-concurrency-list", "1,0"), "--max-concurrency-list: every value must be >= 1, got '0'"),
    (("--max-concurrency-list", "1,x"), "--max-concurrency-list: 'x' is not a valid int"),
    (("--max-concurrency-list", " , "), "lists no value"),
    (("--request-rate-list", "2,-1"), "--request-rate-list: every value must be > 0"),
    (("--max-concurrency-list", "1,2", "--max-concurrency", "3"), "--max-concurrency 3 conflicts with"),
    (("--max-concurrency-list", "1", "--num-gpus", "0"), "--num-gpus must be >= 1, got 0"),
    (("--max-concurrency-list", "1", "--save-result", "--result-filename", "x.json"), "--result-filename 'x.json'"),
])
def test_bad_sweep_flags_fail_before_any_request(fake_server, tokenizer_dir, tmp_path, flags, message):
    args = build_parser().parse_args(_sweep_argv(fake_server, tokenizer_dir, tmp_path, *flags))
    with pytest.raises(BenchInputError, match=message.replace("(", r"\(")):
        run_sweep(args)
    assert fake_server.received == []


def test_both_lists_are_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["sweep", "--max-concurrency-list", "1", "--request-rate-list", "1"])
    assert "not allowed with argument" in capsys.readouterr().err
