"""The host's work per step at many sequences, without the model's forward: what bounds small models' decode.

    python -m benchmarks.host_probe [--rows 256] [--prompt-len 128] [--output-len 512] [--steps 200]
        [--output-kind delta] [--profile] [--server [--clients 1] [--loop asyncio] [--stream-interval 1]]

The demo model's engine on the CPU, its forward replaced by zeros (the lm_head, the sampler, batch building,
scheduling, bookkeeping, detokenizing and outputs all run as served), decoding `rows` sequences at once:
milliseconds of host work a step, which a GPU step shorter than it cannot hide (Qwen3.5-0.8B at 256 sequences:
a step of ~5.6 ms on an H200, docs/performance.md). --profile prints the engine's functions by own time.
--server serves that engine over HTTP instead (the engine thread, the event loop, uvicorn) and streams `rows`
completions of `output-len` tokens at once from `deltaserve bench serve` in another process: the step time
then includes what serving adds (building and writing each stream's chunks, in the same process). --clients N
splits the streams among N client processes, so that one client's own work (parsing every chunk) does not bound
what is measured; the CPU time of the clients is reported beside the server's threads'.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from deltaserve.sampling import RequestOutputKind, SamplingParams
from deltaserve.server.api_server import EVENT_LOOP


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256, help="sequences decoding at once")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=200, help="decode steps timed (after the prompts' step)")
    parser.add_argument("--output-kind", default="delta", choices=[k.name.lower() for k in RequestOutputKind])
    parser.add_argument("--profile", action="store_true", help="print the top functions by own time")
    parser.add_argument("--server", action="store_true", help="through the HTTP server and a streaming client")
    parser.add_argument("--loop", default=EVENT_LOOP, choices=["asyncio", "uvloop", "auto"],
                        help=f"with --server: uvicorn's event loop ({EVENT_LOOP}, as `deltaserve serve` runs; auto: "
                             "uvloop where installed)")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="with --server: the server's --stream-interval (tokens a stream's chunks carry)")
    parser.add_argument("--clients", type=int, default=1, help="with --server: client processes sharing the streams")
    args = parser.parse_args(argv)
    for name in ("rows", "prompt_len", "output_len", "steps", "clients", "stream_interval"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.clients > args.rows:
        parser.error(f"--clients {args.clients} is more than --rows {args.rows} (each client streams at least one)")
    for name in ("clients", "loop", "stream_interval"):
        if getattr(args, name) != parser.get_default(name) and not args.server:
            parser.error(f"--{name.replace('_', '-')} goes with --server")
    if args.steps >= args.output_len:
        parser.error(f"--steps {args.steps} must be below --output-len {args.output_len} (all sequences decode)")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the host's one thread of work, as the engine thread has
    try:
        _run(args)
    finally:
        torch.set_num_threads(threads)
    return 0


def _run(args: argparse.Namespace) -> None:
    from deltaserve import LLM  # the engine and its model: imported once the arguments are good

    llm = LLM(max_model_len=args.prompt_len + args.output_len + 16, max_num_seqs=args.rows,
              max_num_batched_tokens=max(8192, args.rows * args.prompt_len))
    engine = llm.engine
    model = engine.runner.model
    hidden_size = model.config.hidden_size

    def no_forward(input_ids, batch, sampling_rows, intermediate=None):
        return torch.zeros(len(sampling_rows), hidden_size)  # [S, H]: the lm_head and the sampler still run

    model.forward = no_forward
    if args.server:
        _serve_and_stream(llm, args)
        return
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True,
                            output_kind=RequestOutputKind[args.output_kind.upper()])
    vocab = engine.model_config.vocab_size
    for i in range(args.rows):
        prompt = [(i * 7919 + j * 104729) % vocab for j in range(args.prompt_len)]
        engine.add_request(str(i), prompt, params)
    for _ in range(3):  # the prompts' step and the first decodes
        engine.step()
    profiler = cProfile.Profile() if args.profile else None
    if profiler:
        profiler.enable()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    seconds = time.perf_counter() - start
    if profiler:
        profiler.disable()
    print(f"{args.rows} sequences, {args.output_kind} outputs: {1e3 * seconds / args.steps:.2f} ms of host work a "
          f"step ({1e6 * seconds / args.steps / args.rows:.1f} us a sequence)" + (" (profiled)" if profiler else ""))
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def _thread_cpu_seconds(thread) -> float:
    """CPU time a running thread has used so far (Linux)."""
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def _serve_and_stream(llm, args: argparse.Namespace) -> None:
    """Serve llm's engine on a free port and stream rows x output_len tokens from args.clients client processes;
    print the host time a step that implies (every stream gets one token a step), and the CPU time the engine
    thread and the event-loop thread each used a step (the two take turns on the GIL) and the clients' (all
    together, their start-up included)."""
    import json
    import resource
    import socket
    import statistics
    import subprocess
    import sys
    import tempfile
    import threading

    import uvicorn

    from deltaserve.demo import demo_model_path
    from deltaserve.server.api_server import build_app, make_state
    from deltaserve.server.settings import ServerSettings

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    engine = llm.engine
    state = make_state(engine, engine.config, ServerSettings(port=port, served_model_names=("demo",),
                                                                     stream_interval=args.stream_interval,
                                                                     uvicorn_log_level="warning"))
    server = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=port, log_level="warning",
                                           loop=args.loop))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:  # the engine thread starts with the app
        if not thread.is_alive():
            raise RuntimeError("the server thread exited before it started serving (its log says why)")
        time.sleep(0.05)
    threads = {"engine thread": state.engine._thread, "event-loop thread": thread}
    cpu_before = {name: _thread_cpu_seconds(t) for name, t in threads.items()}
    with tempfile.TemporaryDirectory() as tmp:
        shares = [args.rows // args.clients + (i < args.rows % args.clients) for i in range(args.clients)]
        commands = [[sys.executable, "-m", "deltaserve", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
                     "--tokenizer", str(demo_model_path()), "--dataset-name", "random",
                     "--random-input-len", str(args.prompt_len), "--random-output-len", str(args.output_len),
                     "--num-prompts", str(share), "--max-concurrency", str(share), "--ignore-eos", "--seed", str(i),
                     "--temperature", "0", "--save-result", "--result-dir", tmp, "--result-filename", f"r{i}.json"]
                    for i, share in enumerate(shares)]
        children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        try:
            clients = [subprocess.Popen(command, stdout=subprocess.DEVNULL) for command in commands]
            failed = [command for client, command in zip(clients, commands) if client.wait() != 0]
            if failed:
                raise RuntimeError(f"{len(failed)} of {len(commands)} clients failed (their stderr is above)")
            cpu = {name: _thread_cpu_seconds(t) - cpu_before[name] for name, t in threads.items()}
            children = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu["clients"] = (children.ru_utime + children.ru_stime - children_before.ru_utime
                              - children_before.ru_stime)
            results = []
            for i in range(args.clients):
                with open(f"{tmp}/r{i}.json") as f:
                    results.append(json.load(f))
        finally:
            server.should_exit = True
            thread.join(timeout=30)
    # the clients ran at once: all their tokens over the longest one's duration
    rate = sum(r["total_output_tokens"] for r in results) / max(r["duration"] for r in results)
    tpot = statistics.median(r["median_tpot_ms"] for r in results)
    print(f"{args.rows} streams through the server: {rate:.0f} output tok/s, {1e3 * args.rows / rate:.2f} ms of host "
          f"work a step ({1e6 / rate:.1f} us a token), median TPOT {tpot:.2f} ms; CPU a step: "
          + ", ".join(f"{name} {1e3 * seconds / args.output_len:.2f} ms" for name, seconds in cpu.items()))


if __name__ == "__main__":
    raise SystemExit(main())
