"""benchmarks/offline.py's bookkeeping, without a GPU: where a run's wall time went, by the kind of step."""

from types import SimpleNamespace

from benchmarks.offline import StepTimes


def scheduled(*query_lens):
    """A stand-in SchedulerOutput: one row per sequence with that many tokens to compute; rows of one token
    sample (decodes), longer ones do not (prompt chunks short of their end)."""
    rows = [SimpleNamespace(token_ids=[0] * n, sample=n == 1) for n in query_lens]
    return SimpleNamespace(sequences=rows, is_empty=not rows)


def test_step_times_charge_each_interval_to_the_step_launched_before_it():
    steps = StepTimes()
    steps.add(scheduled(100, 1), 0.0)  # a prompt chunk beside a decode: runs until the next call
    steps.add(scheduled(1, 1), 0.5)
    steps.add(scheduled(1, 1), 0.52)
    steps.add(scheduled(), 0.56)  # nothing launched: the next interval belongs to no step
    steps.add(scheduled(1), 1.0)
    assert steps.summary() == {"prefill_tokens": 100, "decode_steps": 2, "decode_s": 0.06, "decode_median_ms": 30.0,
                               "prefill_steps": 1, "prefill_s": 0.5, "prefill_median_ms": 500.0,
                               "samples_per_step": 1.7,  # (1 + 2 + 2) / 3: the last launch is not timed
                               "slowest": ["500 ms (100 prompt tokens, 2 rows)", "40 ms (0 prompt tokens, 2 rows)",
                                           "20 ms (0 prompt tokens, 2 rows)"]}


def test_step_tails_and_records():
    """From ten timed steps of a kind on: its p90, max and time above its median; every step's record."""
    steps = StepTimes()
    times = [0.02 * i for i in range(11)] + [0.4]  # ten 20 ms steps, then one of 200 ms
    for t in times:
        steps.add(scheduled(1, 1), t)
    summary = steps.summary()
    assert summary["decode_steps"] == 11 and summary["decode_median_ms"] == 20.0
    assert summary["decode_p90_ms"] == 20.0 and summary["decode_max_ms"] == 200.0
    assert summary["decode_above_median_s"] == 0.18
    assert steps.records[-1] == ("decode", 200.0, 0, 2) and len(steps.records) == 11


def test_gc_pauses_count_full_collections_only():
    import gc

    from benchmarks.offline import GcPauses

    with GcPauses() as pauses:
        gc.collect(0)
        gc.collect(2)
    summary = pauses.summary()
    assert summary["gc_full_collections"] == 1 and summary["gc_full_ms"] >= 0
    assert pauses._callback not in gc.callbacks


def test_a_concurrency_no_workload_runs_at_is_refused_by_name(capsys):
    import pytest

    from benchmarks.offline import main

    with pytest.raises(SystemExit):
        main(["config-dir", "--workloads", "W6", "--concurrency", "65"])
    assert "--concurrency 65: no entry of W6 runs at [65] (they run at [64, 256])" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a list: each must be offered
        main(["config-dir", "--workloads", "W1,W6", "--concurrency", "1,65"])
    assert "--concurrency 1,65: no entry of W1,W6 runs at [65] (they run at [1, 64, 256])" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["config-dir", "--workloads", "W6", "--concurrency", "64;256"])
    assert "--concurrency must be comma-separated integers, got '64;256'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["config-dir", "--workloads", "W6", "--concurrency", ","])
    assert "--concurrency names no concurrency: ','" in capsys.readouterr().err


def test_compile_log_counts_variants_and_keeps_their_signatures_until_taken():
    from benchmarks.offline import CompileLog

    log = CompileLog()
    # as Triton 3.6 calls the hook: the signature by argument name, the specializations by argument index
    for name, signature, configs in (("_decode", {"stride_table": "i32"}, [{(3,): [["tt.divisibility", 16]]}]),
                                     ("_decode", {"stride_table": "i32"}, [{}]),
                                     ("_prefill", {"num_seqs": "i32"}, [{}])):
        compile = {"signature": signature, "configs": configs}
        assert log._hook(fn=SimpleNamespace(name=name), compile=compile, repr="ignored") is False  # compiles
    assert log.signatures == ["_decode: {'stride_table': 'i32'} [{(3,): [['tt.divisibility', 16]]}]",
                              "_decode: {'stride_table': 'i32'} [{}]", "_prefill: {'num_seqs': 'i32'} [{}]"]
    assert log.take() == "_decode x2, _prefill x1"
    assert log.signatures == [] and log.take() == ""


def test_collector_load_counts_tracked_objects_and_names_their_modules():
    import re

    from benchmarks.offline import collector_load

    namespace = {"__name__": "made_after_the_freeze"}
    exec("def f():\n    pass\ng = [f]", namespace)  # a function of a module of its own, kept alive
    report = collector_load(top=10_000)
    assert re.match(r"[\d,]+ objects tracked \([\d,]+ frozen\); functions by module: ", report), report
    assert "made_after_the_freeze 1" in report.split(": ", 1)[1].split(", "), report


def test_a_tokenizer_that_is_not_a_directory_is_refused_by_name(capsys):
    import pytest

    from benchmarks.offline import main

    with pytest.raises(SystemExit):
        main(["config-dir", "--tokenizer", "/nonexistent/tok"])
    assert "--tokenizer '/nonexistent/tok' is not a directory" in capsys.readouterr().err


def test_a_state_dtype_the_engine_does_not_take_is_refused_by_name(capsys):
    import pytest

    from benchmarks.offline import main

    with pytest.raises(SystemExit):
        main(["config-dir", "--mamba-ssm-cache-dtype", "fp8"])
    err = capsys.readouterr().err
    assert "--mamba-ssm-cache-dtype" in err and "'fp8'" in err
