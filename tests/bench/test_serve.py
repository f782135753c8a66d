"""End to end: `bench serve` against the scripted fake server (timings, totals, JSON, failures, errors)."""

import json
import socket

import numpy as np
import pytest

from deltaserve.bench import traffic
from deltaserve.bench.cli import build_parser, main
from deltaserve.bench.serve import run_serve
from deltaserve.bench.traffic import arrival_offsets


def _run(server, tokenizer_dir, *flags, ready_check=False):
    """run_serve's result; the ready check (an untimed first request) only where asked, so that the server's
    received requests are the timed ones."""
    argv = ["serve", "--base-url", server.base_url, "--tokenizer", tokenizer_dir, "--disable-tqdm",
            "--request-id-prefix", "bench-", *([] if ready_check else ["--ready-check-timeout-sec", "0"]), *flags]
    return run_serve(build_parser().parse_args(argv))


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False).input_ids


def test_random_completions_metrics_and_json(fake_server, tokenizer_dir, tokenizer, tmp_path, capsys):
    fake_server.first_delay, fake_server.gap = 0.1, 0.04
    result = _run(
        fake_server, tokenizer_dir, "--random-input-len", "32", "--random-output-len", "5", "--num-prompts", "6",
        "--max-concurrency", "2", "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99", "--save-result", "--save-detailed", "--result-dir", str(tmp_path),
        "--result-filename", "run.json", "--metadata", "run=unit",
    )
    headers = [h for h, _ in fake_server.received]
    bodies = [b for _, b in fake_server.received]
    assert sorted(h["x-request-id"] for h in headers) == [f"bench-{i}" for i in range(6)]
    for body in bodies:
        assert body["model"] == "fake-model"  # the first id of GET /v1/models
        assert (body["max_tokens"], body["ignore_eos"], body["temperature"], body["stream"]) == (5, True, 0.0, True)
        assert body["stream_options"] == {"include_usage": True}
        assert len(_ids(tokenizer, body["prompt"])) == 32
    assert fake_server.max_in_flight == 2

    assert (result["completed"], result["failed"], result["num_prompts"]) == (6, 0, 6)
    assert (result["model_id"], result["run"], result["max_concurrency"]) == ("fake-model", "unit", 2)
    # totals come from the server's usage: prompt_tokens = prompt characters, completion_tokens = 5
    assert result["total_input_tokens"] == sum(len(b["prompt"]) for b in bodies)
    assert result["total_output_tokens"] == 30
    assert result["input_lens"] and sorted(result["input_lens"]) == sorted(len(b["prompt"]) for b in bodies)
    assert result["output_lens"] == [5] * 6 and result["errors"] == [""] * 6

    # the scripted timing: first chunk after 100 ms, then one every 40 ms (slack for a busy 2-core box)
    assert 100 <= result["mean_ttft_ms"] < 170
    assert 35 <= result["median_itl_ms"] < 75
    assert 38 <= result["mean_tpot_ms"] < 75
    assert 260 <= result["mean_e2el_ms"] < 380
    assert 0.78 <= result["duration"] < 1.5  # three waves of two requests
    assert result["max_concurrent_requests"] == 2

    # the summary is exactly the arithmetic of the per-request details
    ttfts, latencies = np.array(result["ttfts"]), np.array(result["latencies"])
    itls = [gap for gaps in result["itls"] for gap in gaps]
    assert all(len(gaps) == 4 for gaps in result["itls"])
    assert result["mean_tpot_ms"] == pytest.approx(1000 * np.mean((latencies - ttfts) / 4))
    assert result["mean_itl_ms"] == pytest.approx(1000 * np.mean(itls))
    assert result["p99_itl_ms"] == pytest.approx(1000 * np.percentile(itls, 99))
    assert result["median_ttft_ms"] == pytest.approx(1000 * np.median(ttfts))
    assert result["std_e2el_ms"] == pytest.approx(1000 * np.std(latencies))
    assert result["p50_e2el_ms"] == pytest.approx(1000 * np.median(latencies))
    duration = result["duration"]
    assert result["request_throughput"] == pytest.approx(6 / duration)
    assert result["output_throughput"] == pytest.approx(30 / duration)
    assert result["total_token_throughput"] == pytest.approx((result["total_input_tokens"] + 30) / duration)
    assert result["request_goodput"] is None

    saved = json.loads((tmp_path / "run.json").read_text())
    assert saved == json.loads(json.dumps(result))
    printed = capsys.readouterr().out
    for line in ("Serving Benchmark Result", "End-to-end Latency", "P50 TTFT (ms):", "P99 ITL (ms):"):
        assert line in printed


def test_failures_are_counted_and_reported(fake_server, tokenizer_dir, tokenizer, capsys):
    fake_server.first_delay, fake_server.gap, fake_server.usage = 0.01, 0.005, False
    fake_server.fail_http = {"bench-1"}
    fake_server.fail_stream = {"bench-3"}
    result = _run(fake_server, tokenizer_dir, "--random-input-len", "20", "--random-output-len", "3",
                  "--num-prompts", "5", "--save-detailed", "--goodput", "ttft:10000")
    assert (result["completed"], result["failed"]) == (3, 2)
    assert "HTTP 500" in result["errors"][1] and "scripted failure for bench-1" in result["errors"][1]
    assert "scripted stream error" in result["errors"][3]
    assert [bool(e) for e in result["errors"]] == [False, True, False, True, False]
    # no usage from the server: the dataset's prompt count and the re-tokenized text are used
    assert result["total_input_tokens"] == 3 * 20
    assert result["total_output_tokens"] == 3 * len(_ids(tokenizer, " w0 w1 w2"))
    assert result["output_lens"][1] == result["output_lens"][3] == 0
    assert result["request_goodput"] == pytest.approx(3 / result["duration"])
    printed = capsys.readouterr().out
    assert "2 failed requests, 2 distinct errors:" in printed
    assert "scripted failure for bench-1" in printed and "scripted stream error" in printed


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_multi_turn_grows_prompts_and_reports_ttft_by_turn(fake_server, tokenizer_dir, tokenizer, backend):
    # 200 ms more a turn: far above the tens of ms a loaded CI machine (the suite on several processes) adds
    fake_server.first_delay, fake_server.gap, fake_server.delay_per_turn = 0.02, 0.005, 0.2
    result = _run(fake_server, tokenizer_dir, "--backend", backend, "--dataset-name", "multi_turn",
                  "--multi-turn-sessions", "2", "--multi-turn-num-turns", "3", "--multi-turn-new-tokens", "6",
                  "--random-input-len", "10", "--random-output-len", "3", "--max-concurrency", "2")
    assert (result["completed"], result["failed"], result["num_prompts"]) == (6, 0, 6)
    by_id = {h["x-request-id"]: b for h, b in fake_server.received}
    assert sorted(by_id) == [f"bench-s{s}-t{t}" for s in range(2) for t in range(3)]
    answer = " w0 w1 w2"
    for session in range(2):
        turns = [by_id[f"bench-s{session}-t{t}"] for t in range(3)]
        assert all(body["ignore_eos"] for body in turns)  # synthetic traffic runs to max_tokens, as in vLLM
        if backend == "openai":
            assert len(_ids(tokenizer, turns[0]["prompt"])) == 10
            for before, after in zip(turns, turns[1:]):
                grown = before["prompt"] + answer
                assert after["prompt"].startswith(grown)
                assert len(_ids(tokenizer, after["prompt"][len(grown):])) == 6
        else:
            for t, body in enumerate(turns):
                roles = [m["role"] for m in body["messages"]]
                assert roles == ["user", "assistant"] * t + ["user"]
                assert all(m["content"] == answer for m in body["messages"] if m["role"] == "assistant")
                assert len(_ids(tokenizer, body["messages"][-1]["content"])) == (10 if t == 0 else 6)
            assert turns[2]["messages"][:3] == turns[1]["messages"]
    # the server delays each turn's first chunk by 200 ms per earlier turn
    ttft = result["ttft_by_turn_ms"]
    assert len(ttft) == len(result["median_ttft_by_turn_ms"]) == 3
    assert ttft[0] < ttft[1] < ttft[2] and ttft[2] - ttft[0] > 300
    assert result["completed_by_turn"] == [2, 2, 2]
    inputs = result["mean_input_len_by_turn"]
    assert inputs[0] < inputs[1] < inputs[2]


def test_ready_check_sends_the_first_request_untimed_until_the_server_answers(fake_server, tokenizer_dir, tokenizer,
                                                                            monkeypatch, capsys):
    """By default (as vLLM) a request of the first one's lengths goes once before the timed run, again while the
    server answers 503 (a server still starting), and is left out of the figures. Its prompt is its own, so that a
    prefix cache holds nothing of a timed prompt (vLLM sends the first prompt itself)."""
    monkeypatch.setattr(traffic, "READY_CHECK_RETRY_S", 0.05)
    fake_server.first_delay, fake_server.gap, fake_server.unavailable = 0.01, 0.01, 2
    result = _run(fake_server, tokenizer_dir, "--random-input-len", "8", "--random-output-len", "2",
                  "--num-prompts", "3", "--save-detailed", ready_check=True)
    ids = [h["x-request-id"] for h, _ in fake_server.received]
    assert ids[:3] == ["bench-warmup-ready"] * 3 and sorted(ids[3:]) == ["bench-0", "bench-1", "bench-2"]
    prompts = [_ids(tokenizer, b["prompt"]) for _, b in fake_server.received]
    assert prompts[0] == prompts[1] == prompts[2] and len(prompts[0]) == 8
    assert all(p != prompts[0] for p in prompts[3:]), "a timed prompt is the ready check's"
    assert {b["max_tokens"] for _, b in fake_server.received} == {2}
    assert (result["completed"], result["failed"], len(result["ttfts"])) == (3, 0, 3)
    assert "Initial test run completed." in capsys.readouterr().out


def test_ready_check_gives_up_at_a_refusal_or_its_timeout(fake_server, tokenizer_dir, monkeypatch, capsys):
    """A 4xx to the test request ends the run at once; a server that never answers ends it after the timeout;
    both exit 2 naming the error, no timed request sent."""
    monkeypatch.setattr(traffic, "READY_CHECK_RETRY_S", 0.2)
    base = ["serve", "--base-url", fake_server.base_url, "--tokenizer", tokenizer_dir, "--disable-tqdm",
            "--request-id-prefix", "bench-", "--random-input-len", "8", "--num-prompts", "2"]
    fake_server.bad_request = {"bench-warmup-ready"}
    assert main(base + ["--ready-check-timeout-sec", "3"]) == 2  # refused at once, not after 3 s of retries
    err = _one_line_error(capsys)
    assert "initial test request" in err and "was refused: HTTP 400" in err and "scripted bad request" in err
    assert len(fake_server.received) == 1
    fake_server.bad_request, fake_server.unavailable = set(), 1000
    assert main(base + ["--ready-check-timeout-sec", "1"]) == 2
    assert "did not succeed within --ready-check-timeout-sec 1: HTTP 503" in _one_line_error(capsys)
    assert 1 + 4 <= len(fake_server.received) <= 1 + 7  # every 0.2 s for 1 s
    assert {h["x-request-id"] for h, _ in fake_server.received} == {"bench-warmup-ready"}


def test_warmups_rate_and_prefix_repetition(fake_server, tokenizer_dir, tokenizer):
    fake_server.first_delay, fake_server.gap = 0.01, 0.01
    result = _run(fake_server, tokenizer_dir, "--dataset-name", "prefix_repetition", "--num-prompts", "4",
                  "--prefix-repetition-prefix-len", "16", "--prefix-repetition-suffix-len", "4",
                  "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "2",
                  "--request-rate", "10", "--num-warmups", "2", "--save-detailed", "--seed", "3")
    ids = [h["x-request-id"] for h, _ in fake_server.received]
    assert sorted(ids[:2]) == ["bench-warmup-0", "bench-warmup-1"]
    assert sorted(ids[2:]) == [f"bench-{i}" for i in range(4)]
    assert result["completed"] == 4 and result["request_rate"] == 10.0
    prompts = [b["prompt"] for h, b in fake_server.received[2:]]
    assert all("ignore_eos" not in b for _, b in fake_server.received)
    prefixes = {tuple(_ids(tokenizer, p)[:16]) for p in prompts}
    assert len(prefixes) == 2 and all(len(_ids(tokenizer, p)) == 20 for p in prompts)
    starts = np.array(result["start_times"]) - result["start_times"][0]
    expected = np.array(arrival_offsets(4, 10.0, 1.0, seed=3))
    assert np.abs(starts - (expected - expected[0])).max() < 0.05


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    return err


def test_unreachable_server_exits_2(tokenizer_dir, capsys):
    port = _closed_port()
    assert main(["serve", "--port", str(port), "--tokenizer", tokenizer_dir]) == 2
    assert f"cannot reach the server at http://127.0.0.1:{port}/v1/models" in _one_line_error(capsys)


def test_model_and_tokenizer_errors_exit_2(fake_server, tokenizer_dir, capsys):
    base = ["serve", "--base-url", fake_server.base_url]
    assert main(base + ["--model", "other", "--tokenizer", tokenizer_dir]) == 2
    assert "model 'other' is not served at" in (err := _one_line_error(capsys)) and "it serves: fake-model" in err
    assert main(base) == 2
    assert "tokenizer missing: --model 'fake-model' is not a local directory" in _one_line_error(capsys)
    assert main(base + ["--tokenizer", "/nonexistent/tok"]) == 2
    assert "--tokenizer '/nonexistent/tok'" in _one_line_error(capsys)
    assert fake_server.received == []


def test_the_demo_models_name_takes_the_built_in_tokenizer(tmp_path, monkeypatch):
    """A server started without MODEL calls its model "demo": benchmarking it needs no --tokenizer."""
    from deltaserve.bench.serve import load_tokenizer
    from deltaserve.demo import demo_model_path

    monkeypatch.chdir(tmp_path)  # no ./demo directory to take instead
    tokenizer = load_tokenizer("demo", "--model")
    assert tokenizer.name_or_path == str(demo_model_path())


def test_api_key_from_flag_or_environment(fake_server, tokenizer_dir, monkeypatch, capsys):
    fake_server.first_delay, fake_server.gap = 0.01, 0.01
    fake_server.api_key = "sekret"
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    base = ["serve", "--base-url", fake_server.base_url, "--tokenizer", tokenizer_dir, "--disable-tqdm",
            "--num-prompts", "2", "--random-input-len", "4", "--random-output-len", "2", "--ready-check-timeout-sec",
            "0"]
    assert main(base) == 2
    assert "refused the request (HTTP 401); pass --api-key or set OPENAI_API_KEY" in _one_line_error(capsys)
    assert main(base + ["--api-key", "sekret"]) == 0
    monkeypatch.setenv("OPENAI_API_KEY", "sekret")
    assert main(base) == 0
    assert [h["authorization"] for h, _ in fake_server.received] == ["Bearer sekret"] * 4


@pytest.mark.parametrize("flags, message", [
    (["--random-range-ratio", "1.0"], "--random-range-ratio must be in [0, 1), got 1.0"),
    (["--random-range-ratio", "-0.1"], "--random-range-ratio must be in [0, 1), got -0.1"),
    (["--random-input-len", "-5"], "--random-input-len must be >= 0, got -5"),
    (["--dataset-name", "prefix_repetition", "--num-prompts", "2", "--prefix-repetition-num-prefixes", "3"],
     "--num-prompts 2 is smaller than --prefix-repetition-num-prefixes 3"),
    (["--goodput", "ttft=5"], "--goodput 'ttft=5': expected KEY:VALUE"),
    (["--percentile-metrics", "ttft,foo"], "--percentile-metrics: unknown metric 'foo'"),
    (["--dataset-name", "sharegpt"], "--dataset-name sharegpt needs --dataset-path"),
    (["--max-concurrency", "0"], "--max-concurrency must be >= 1, got 0"),
    (["--ready-check-timeout-sec", "-1"], "--ready-check-timeout-sec must be >= 0, got -1"),
])
def test_bad_flags_exit_2_before_contacting_the_server(flags, message, capsys):
    assert main(["serve", "--port", str(_closed_port()), *flags]) == 2
    assert message in _one_line_error(capsys)


@pytest.mark.parametrize("backend, chat", [("vllm", False), ("openai", False), ("vllm-chat", True),
                                           ("openai-chat", True)])
def test_vllm_backend_names(fake_server, tokenizer_dir, backend, chat):
    result = _run(fake_server, tokenizer_dir, "--backend", backend, "--random-input-len", "8",
                  "--random-output-len", "3", "--num-prompts", "2")
    bodies = [body for _, body in fake_server.received]
    assert len(bodies) == 2 and all(("messages" in body, "prompt" in body) == (chat, not chat) for body in bodies)
    assert (result["completed"], result["backend"]) == (2, backend)


def test_report_places_each_chunks_tokens_by_its_text(tokenizer):
    """The chunk texts reach the peak throughput: a role-only first chunk (chat), a chunk of several tokens,
    then one of a single token, each in a second of its own."""
    from deltaserve.bench.args import validate_args
    from deltaserve.bench.client import RequestInput, RequestOutput
    from deltaserve.bench.serve import report
    from deltaserve.bench.traffic import TimedRun

    args = build_parser().parse_args(["serve"])
    validate_args(args)
    texts = ["", " hello world, café", " done"]
    out = RequestOutput(success=True, prompt_len=3, output_tokens=12, start_time=0.0, ttft=0.5, itl=[1.0, 1.0],
                        latency=2.5, chunk_texts=texts)
    counts = [len(_ids(tokenizer, text)) for text in texts]
    result = report(args, TimedRun([RequestInput("p", 3, 12, "r0")], [out], [0], 3.0), tokenizer, "m", "t")
    assert counts[1] > counts[2] > counts[0] == 0
    assert result["max_output_tokens_per_s"] == pytest.approx(12 * counts[1] / sum(counts))
