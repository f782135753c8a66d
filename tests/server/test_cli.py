"""`deltaserve serve` flags: the issue's vLLM command lines, --help, refusals and their exit codes."""

import logging
import shlex

import pytest

from deltaserve import cli
from deltaserve.server.api_server import warn_if_open
from deltaserve.server.settings import ServerSettings

# The command lines of issue 5 (MODEL and FILE are filled in), with the flags each must refuse while their
# features are not built, and fields of the configuration left once those flags are dropped.
ISSUE_LINES = [
    (("--max-num-seqs 128 --enable-prefix-caching --max-model-len 200000 --kv-cache-dtype fp8 "
      "--gpu-memory-utilization 0.94 --served-model-name my_model"),
     set(),
     dict(max_num_seqs=128, max_model_len=200000, gpu_memory_utilization=0.94, enable_prefix_caching=True,
          kv_cache_dtype="fp8"),
     dict(served_model_names=("my_model",))),
    (("--host 0.0.0.0 --port 8888 --served-model-name qwen3.8-27b --max-model-len 262144 --kv-cache-dtype fp8 "
      "--kv-cache-memory-bytes 9150000000 --max-num-seqs 3 --max-num-batched-tokens 512 "
      "--gpu-memory-utilization 0.92 --enable-prefix-caching --enable-auto-tool-choice --tool-call-parser "
      "qwen3_xml --reasoning-parser qwen3 --mm-processor-kwargs '{\"max_pixels\": 4014080}' --chat-template FILE"),
     {"--mm-processor-kwargs"},
     dict(max_model_len=262144, kv_cache_dtype="fp8", kv_cache_memory_bytes=9150000000, max_num_seqs=3, max_num_batched_tokens=512,
          gpu_memory_utilization=0.92, enable_prefix_caching=True),
     dict(host="0.0.0.0", port=8888, served_model_names=("qwen3.8-27b",), enable_auto_tool_choice=True,
          tool_call_parser="qwen3_xml", reasoning_parser="qwen3", chat_template="{{ messages }}")),
    (("--async-scheduling --mamba-ssm-cache-dtype bfloat16 --language-model-only --max-num-batched-tokens "
      "16384 --stream-interval 100 --api-server-count 1"),
     set(),
     dict(mamba_ssm_cache_dtype="bfloat16", max_num_batched_tokens=16384, async_scheduling=True),
     dict(stream_interval=100)),
    (("--max-model-len 225000 --max-num-batched-tokens 8192 --kv-cache-dtype fp8_e4m3 --max-num-seqs 2 "
      "--tool-call-parser qwen3_coder --reasoning-parser qwen3 --enable-auto-tool-choice --optimization-level 3 "
      "--enable-prefix-caching --trust-remote-code --language-model-only --performance-mode interactivity "
      "--mamba-cache-mode align --mamba-block-size 8 --enable-chunked-prefill --async-scheduling "
      "--override-generation-config '{\"temperature\": 0.6, \"top_p\": 0.95, \"top_k\": 20, \"min_p\": 0.0, "
      "\"presence_penalty\": 0.0, \"repetition_penalty\": 1.0, \"max_tokens\": 16384}'"),
     set(),
     dict(performance_mode="interactivity", max_model_len=225000, kv_cache_dtype="fp8_e4m3", max_num_batched_tokens=8192, max_num_seqs=2, enable_prefix_caching=True,
          override_generation_config={"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
                                      "presence_penalty": 0.0, "repetition_penalty": 1.0, "max_tokens": 16384}),
     dict(tool_call_parser="qwen3_coder", reasoning_parser="qwen3", enable_auto_tool_choice=True)),
]


# Every flag issue 5 names, and those its command lines use.
ISSUE_FLAGS = [
    "--host", "--port", "--served-model-name", "--api-key", "--dtype", "--seed", "--load-format",
    "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--block-size", "--gpu-memory-utilization",
    "--kv-cache-memory-bytes", "--kv-cache-dtype", "--enable-prefix-caching", "--no-enable-prefix-caching",
    "--enable-chunked-prefill", "--enforce-eager", "--chat-template", "--enable-auto-tool-choice",
    "--tool-call-parser", "--reasoning-parser", "--generation-config", "--override-generation-config",
    "--default-chat-template-kwargs", "--language-model-only", "--trust-remote-code", "--mamba-cache-mode",
    "--mamba-block-size", "--mamba-ssm-cache-dtype", "--performance-mode", "--async-scheduling",
    "--stream-interval", "--tensor-parallel-size", "--pipeline-parallel-size", "--uvicorn-log-level",
    "--mm-processor-kwargs", "--api-server-count", "--optimization-level",
]


def parse(argv):
    return cli.build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize("line, refused, engine_fields, server_fields", ISSUE_LINES)
def test_issue_command_lines(ckpt_qwen3_5, tmp_path, line, refused, engine_fields, server_fields):
    template = tmp_path / "template.jinja"
    template.write_text("{{ messages }}")
    args = parse([str(ckpt_qwen3_5), *shlex.split(line.replace("FILE", str(template)))])
    if refused:
        with pytest.raises(cli.NotSupportedYet) as error:
            cli.configs_from_args(args)
        message = str(error.value)
        assert {part.split(" ", 1)[0] for part in message.split("; ")} == refused
        assert all("is not supported yet" in part for part in message.split("; "))

    # Everything else on the line is honoured: drop the refused flags and the configuration is valid.
    defaults = parse([])
    for row in cli.NOT_BUILT:
        if row.flag in refused:
            setattr(args, row.dest, getattr(defaults, row.dest))
    engine, settings = cli.configs_from_args(args)
    assert engine.model == str(ckpt_qwen3_5)
    for name, value in engine_fields.items():
        assert getattr(engine, name) == value, name
    for name, value in server_fields.items():
        assert getattr(settings, name) == value, name


def test_defaults_without_model():
    engine, settings = cli.configs_from_args(parse([]))
    assert engine.model is None and settings.served_model_names == ("demo",)
    assert engine.enable_prefix_caching == cli.EngineConfig().enable_prefix_caching  # the engine's default
    assert engine.async_scheduling is True
    assert (engine.performance_mode, engine.max_num_batched_tokens) == ("balanced", 8192)
    throughput = cli.configs_from_args(parse(["--performance-mode", "throughput"]))[0]
    assert throughput.max_num_batched_tokens == 16384  # the preset fills what is unset ...
    explicit = cli.configs_from_args(parse(["--performance-mode", "throughput", "--max-num-batched-tokens", "4096"]))
    assert explicit[0].max_num_batched_tokens == 4096  # ... and never overrides the user
    with pytest.raises(cli.ConfigError, match="--performance-mode 'fast' is not supported"):
        cli.EngineConfig(performance_mode="fast")  # the Python API's check (argparse has its own)
    assert cli.configs_from_args(parse(["--no-async-scheduling"]))[0].async_scheduling is False
    assert cli.configs_from_args(parse(["--no-enable-prefix-caching"]))[0].enable_prefix_caching is False
    assert (settings.host, settings.port) == ("127.0.0.1", 8000)
    assert (settings.max_num_seqs_per_request, settings.request_body_timeout, settings.disable_fastapi_docs) == \
        (None, 30.0, False)
    hardened = cli.configs_from_args(parse(["--max-num-seqs-per-request", "64", "--request-body-timeout", "5",
                                            "--disable-fastapi-docs"]))[1]
    assert (hardened.max_num_seqs_per_request, hardened.request_body_timeout, hardened.disable_fastapi_docs) == \
        (64, 5.0, True)
    assert (engine.max_num_seqs, engine.block_size, engine.kv_cache_dtype) == (256, 16, "auto")


def test_help_documents_every_issue_flag(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["serve", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for flag in ISSUE_FLAGS:
        assert f"  {flag}" in text or f", {flag}" in text, flag
    words = " ".join(text.split())  # undo the line wrapping
    assert "> 1: not supported yet (several API server processes)" in words
    assert "--mamba-block-size MAMBA_BLOCK_SIZE accepted, no effect" in words


def test_not_built_flag_exits_2_with_one_line(capsys):
    assert cli.main(["serve", "--api-server-count", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "--api-server-count 2 is not supported yet (several API server processes)" in err


def test_parallel_flags_reach_the_engine_config():
    engine = cli.configs_from_args(parse(["-tp", "2", "-pp", "3", "--distributed-executor-backend", "mp"]))[0]
    assert (engine.tensor_parallel_size, engine.pipeline_parallel_size) == (2, 3)
    assert engine.distributed_executor_backend == "mp"


@pytest.mark.parametrize("argv, fragment", [
    (["--max-num-seqs", "0"], "--max-num-seqs must be a positive integer, got 0"),
    (["/no/such/checkpoint"], "MODEL '/no/such/checkpoint': no such file or directory"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    (["--chat-template", "no-such-file.jinja"], "--chat-template 'no-such-file.jinja'"),
    (["--port", "70000"], "--port must be in [0, 65535]"),
    (["-pp", "0"], "--pipeline-parallel-size must be a positive integer, got 0"),
    (["-tp", "-1"], "--tensor-parallel-size must be a positive integer, got -1"),
    (["--distributed-executor-backend", "ray"], "--distributed-executor-backend 'ray' is not supported"),
    (["--max-num-seqs-per-request", "0"], "--max-num-seqs-per-request must be a positive integer, got 0"),
    (["--request-body-timeout", "-1"], "--request-body-timeout must be a positive number of seconds, got -1.0"),
    (["MODEL", "--override-generation-config", '{"temperature": -1}'], "temperature must be >= 0"),
])
def test_bad_values_exit_2_naming_the_flag(capsys, ckpt_qwen3_5, argv, fragment):
    argv = [str(ckpt_qwen3_5) if arg == "MODEL" else arg for arg in argv]
    assert cli.main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err


def test_argparse_rejects_malformed_values(capsys):
    for argv in (["--override-generation-config", "{oops"], ["--kv-cache-dtype", "int3"],
                 ["--max-model-len", "lots"]):
        with pytest.raises(SystemExit) as done:
            cli.main(["serve", *argv])
        assert done.value.code == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_human_readable_sizes():
    assert cli.human_int("32k") == 32000 and cli.human_int("32K") == 32768
    assert cli.human_int("8G") == 8 * 2**30 and cli.human_int("9150000000") == 9150000000
    assert cli.model_len("auto") is None and cli.model_len("-1") is None
    engine, _ = cli.configs_from_args(parse(["--max-model-len", "1k", "--kv-cache-memory-bytes", "2M"]))
    assert (engine.max_model_len, engine.kv_cache_memory_bytes) == (1000, 2 * 2**20)


def test_api_key_from_flag_or_environment(monkeypatch):
    monkeypatch.delenv("DELTASERVE_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm-env")
    assert cli.configs_from_args(parse([]))[1].api_key == "from-vllm-env"
    monkeypatch.setenv("DELTASERVE_API_KEY", "from-our-env")
    assert cli.configs_from_args(parse([]))[1].api_key == "from-our-env"
    assert cli.configs_from_args(parse(["--api-key", "flag"]))[1].api_key == "flag"


def test_open_host_without_key_warns(caplog):
    with caplog.at_level(logging.WARNING):
        assert warn_if_open(ServerSettings(host="0.0.0.0", served_model_names=("m",)))
    assert "open to the network" in caplog.text
    assert not warn_if_open(ServerSettings(host="0.0.0.0", served_model_names=("m",), api_key="k"))
    assert not warn_if_open(ServerSettings(host="127.0.0.1", served_model_names=("m",)))


@pytest.mark.parametrize("argv", [["bench", "serve", "--help"], ["plan", "--help"]])
def test_other_commands_are_wired(capsys, argv):
    with pytest.raises(SystemExit) as done:
        cli.main(argv)
    assert done.value.code == 0 and f"usage: deltaserve {' '.join(argv[:-1])}" in capsys.readouterr().out


def test_server_runs_on_asyncio_not_uvloop(monkeypatch):
    """uvicorn's default loop is uvloop where it is installed; the server asks for asyncio, measured ~2x faster at
    256 streams with the engine thread beside the loop (api_server.EVENT_LOOP)."""
    from deltaserve.config import EngineConfig
    from deltaserve.server import api_server

    started = []

    class RecordingServer:
        def __init__(self, config, engine, grace):
            started.append(config)

        def run(self):
            pass

    monkeypatch.setattr("deltaserve.engine.llm_engine.LLMEngine", lambda config: None)
    monkeypatch.setattr(api_server, "make_state", lambda *args, **kwargs: type("State", (), {"engine": None}))
    monkeypatch.setattr(api_server, "build_app", lambda state: "app")
    monkeypatch.setattr(api_server, "_GracefulServer", RecordingServer)
    monkeypatch.setattr(api_server.signal, "signal", lambda *args: None)  # leave the test process's handlers be
    api_server.run_server(EngineConfig(), ServerSettings(served_model_names=("demo",)))
    assert [config.loop for config in started] == ["asyncio"]
