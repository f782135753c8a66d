"""The engine's step trace (DELTASERVE_STEP_TRACE): one line per launched step with its rows and tokens, and
benchmarks/step_trace_summary.py's sums by kind of step."""

import pytest

from benchmarks import step_trace_summary
from deltaserve import LLM, SamplingParams
from deltaserve.worker import step_trace
from deltaserve.worker.model_runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_engine_writes_each_launched_steps_rows_and_tokens(ckpt_qwen3_5, tmp_path, monkeypatch):
    monkeypatch.setenv(step_trace.ENV_VAR, str(tmp_path))
    # start-up's warm-up steps as on a GPU (the multi-rank branch, its per-worker message a no-op): not traced
    monkeypatch.setattr(ModelRunner, "workers_device_type", "cuda", raising=False)
    monkeypatch.setattr(ModelRunner, "after_warm_up", lambda runner, plan: None, raising=False)
    llm = LLM(str(ckpt_qwen3_5), max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=False)
    prompts = [list(range(1, 1 + n)) for n in (50, 30, 7)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    steps = step_trace.read_engine(tmp_path)
    launched = [at for at, _, _ in steps]
    assert launched == sorted(launched)
    # every prompt token and every decode token is in exactly one step, and nothing else (no warm-up step): 87
    # prompt tokens, 4 more tokens each
    assert sum(tokens for _, _, tokens in steps) == 87 + 3 * 4
    assert all(tokens <= 64 for _, _, tokens in steps)  # the batched-token budget
    assert steps[-1][1:] == (steps[-1][2], steps[-1][2])  # the last steps decode: a token a row
    assert any(tokens > rows for _, rows, tokens in steps)
    # every launched step is read back once, after its launch
    collects = step_trace.read_collects(tmp_path)
    assert sorted(collects) == list(range(len(steps)))
    assert all(launched[i] <= began <= ended for i, (began, ended) in collects.items())
    # each launch's host time ends at its launch time and begins after the launch before it
    host = step_trace.read_launch_host_ns(tmp_path)
    assert len(host) == len(steps) and all(ns > 0 for ns in host)
    assert all(host[i] <= launched[i] - launched[i - 1] for i in range(1, len(steps)))


def test_the_summary_takes_each_steps_time_from_the_launches_after_it():
    ms = 1_000_000
    # (launched ns, rows, tokens): a prefill chunk, then decode steps of 16 and 3 rows, then an idle gap
    steps = [(0, 1, 8192), (10 * ms, 16, 16), (110 * ms, 16, 16), (120 * ms, 16, 16), (130 * ms, 3, 3),
             (136 * ms, 3, 3), (5000 * ms, 1, 1)]
    text = step_trace_summary.summarize(steps, idle_s=1.0)
    lines = text.splitlines()
    assert lines[0] == "7 steps, 0.13 s busy"
    # step 0 took 110 - 10 ms; steps 1-2 (16 rows) 10 ms each; step 3 6 ms; step 4's gap is idle
    assert "prefill chunk:      1 steps     0.10 s" in lines[1]
    assert "decode <= 16 rows:      3 steps     0.03 s" in text and "mean    8.67 ms,   16.0 rows" in text
    assert "mean  100.00 ms,    1.0 rows" in lines[1]
    assert "decode <= 4 rows" not in text
    assert "carried 8192 tokens" in lines[-1]
    assert "read-back" not in text


def test_with_read_backs_a_steps_time_runs_from_the_previous_read_back():
    ms = 1_000_000
    # a prefill chunk whose launch blocked the host (steps 2-3 launched late), then decode steps of 16 and 2 rows
    steps = [(0, 16, 16), (1 * ms, 1, 8192), (95 * ms, 16, 16), (96 * ms, 16, 16), (106 * ms, 2, 2),
             (110 * ms, 2, 2)]
    collects = [(2 * ms, 10 * ms), (11 * ms, 100 * ms), (100 * ms, 110 * ms), None, (115 * ms, 120 * ms),
                (120 * ms, 125 * ms)]
    text = step_trace_summary.summarize(steps, idle_s=1.0, collects=collects)
    # step 0 has no read-back before it; step 3 was not read back, so neither it nor step 4 (no previous) is timed
    assert text.splitlines()[0] == "6 steps, 0.10 s busy"
    assert "prefill chunk:      1 steps     0.09 s" in text and "mean   90.00 ms" in text  # 100 - 10 ms
    assert "read-back waited   89.00 ms" in text
    assert "decode <= 16 rows:      1 steps" in text and "mean   10.00 ms" in text
    assert "decode <= 2 rows:      1 steps" in text and "mean    5.00 ms,    2.0 rows, read-back waited    5.00" in text
    # step 0 began on an idle device: its own time runs from its launch to its read-back
    assert text.splitlines()[-1] == "  steps begun on an idle device, launch to read-back: 10.0 ms (16 tokens)"


def test_a_step_after_an_idle_gap_is_reported_from_its_launch():
    ms = 1_000_000
    # one request's prefill and a decode step, 3 s idle, then the next request's prefill and a decode step
    steps = [(0, 1, 1024), (1 * ms, 1, 1), (3200 * ms, 1, 1024), (3201 * ms, 1, 1)]
    collects = [(1 * ms, 250 * ms), (251 * ms, 258 * ms), (3201 * ms, 3320 * ms), (3321 * ms, 3328 * ms)]
    text = step_trace_summary.summarize(steps, idle_s=1.0, collects=collects)
    assert text.splitlines()[-1] == ("  steps begun on an idle device, launch to read-back: 250.0 ms (1024 tokens), "
                                     "120.0 ms (1024 tokens)")
    assert "decode <= 1 rows:      2 steps" in text  # the decode steps after them are timed as before
    assert "launched in" not in text
    # with the launches' host times: each kind's mean, and each idle-begun step's own
    text = step_trace_summary.summarize(steps, idle_s=1.0, collects=collects, launch_ns=[9 * ms, ms, 5 * ms, 3 * ms])
    assert "decode <= 1 rows:      2 steps" in text and "launched in   2.00 ms" in text
    assert text.splitlines()[-1].endswith("250.0 ms (1024 tokens, launched in 9.0 ms), "
                                          "120.0 ms (1024 tokens, launched in 5.0 ms)")


def test_a_malformed_window_is_refused_by_name(tmp_path, capsys):
    (tmp_path / "engine.tsv").write_text("0\t5\t1\t1\t2\n")
    with pytest.raises(SystemExit):
        step_trace_summary.main([str(tmp_path), "--window", "12:x"])
    assert "--window takes START_NS:END_NS (two integers), got '12:x'" in capsys.readouterr().err
    step_trace_summary.main([str(tmp_path), "--window", "0:10"])
    assert "window 0:10\n1 steps" in capsys.readouterr().out


def test_the_server_writes_each_requests_way_to_its_first_output(tokenizer, tmp_path, monkeypatch):
    from deltaserve.config import EngineConfig
    from deltaserve.server.api_server import make_state
    from deltaserve.server.settings import ServerSettings
    from tests.server.harness import ScriptedEngine, ServerThread

    monkeypatch.setenv(step_trace.ENV_VAR, str(tmp_path))
    state = make_state(ScriptedEngine(tokenizer), EngineConfig(), ServerSettings(served_model_names=("s",)))
    with ServerThread(state) as server:
        for stream in (False, True, False):
            body = {"prompt": "hi there", "max_tokens": 3, "stream": stream}
            assert server.post("/v1/completions", json=body).status_code == 200
    requests = step_trace.read_requests(tmp_path)
    assert len(requests) == 3  # one line a request, written once though its outputs come in several steps
    assert all(queued <= added <= token <= delivered for queued, added, token, delivered in requests)
    assert [r[0] for r in requests] == sorted(r[0] for r in requests)
    assert requests[0][3] <= requests[1][0]  # one after the other


def test_the_request_summary_shows_the_first_ones_then_medians():
    ms = 1_000_000
    requests = [(0, 1 * ms, 61 * ms, 111 * ms)] + [(i * 1000 * ms, i * 1000 * ms + ms // 2, i * 1000 * ms + 60 * ms,
                                                     i * 1000 * ms + 61 * ms) for i in range(1, 6)]
    text = step_trace_summary.summarize_requests(requests, first=1)
    assert text.splitlines() == ["  requests, queued -> added / -> first token / -> delivered (ms):",
                                 "    request 1: 1.0 / 60.0 / 50.0",
                                 "    median of the other 5: 0.5 / 59.5 / 1.0"]
