"""Host time against GPU time of one GDN layer's chunked prefill (fla-core through ops/gdn/cuda.py).

    python -m benchmarks.gdn_host_probe [CONFIG_DIR] [--tokens 64,1024] [--profile 25]

For one sequence of each token count, with the GDN head shapes of the model in CONFIG_DIR (default: the
published Qwen3.5-27B shape), times `_chunked_prefill` three ways: the host's time to queue a call (a loop of
calls, host clock only: what an eager step pays per GDN layer), a call's wall time with the GPU kept busy by
the loop, and its GPU time (the call captured in a CUDA graph and replayed). It also says whether the graph's
output and final state are bit-identical to an eager call's. With --profile N, cProfile's N costliest functions
of the host loop are printed (where the host time goes: fla's wrappers, Triton's launcher and autotuner).

A prompt step is bound by its host when the host's time per layer exceeds the GPU's (the tenth session
measured ~1.3-1.5 ms of host against 55-132 us of GPU for 64-1,024 tokens: docs/performance.md).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from deltaserve.config import ModelConfig
from deltaserve.model_configs import CONFIGS_DIR

CALLS = 200


def _inputs(cfg: ModelConfig, tokens: int, device) -> tuple:
    """Random q/k/v/gates of one `tokens`-long sequence and a pool of 2 float32 state slots (slot 1 used)."""
    gen = torch.Generator(device=device).manual_seed(tokens)
    hk, hv, dk, dv = cfg.gdn_num_k_heads, cfg.gdn_num_v_heads, cfg.gdn_k_dim, cfg.gdn_v_dim

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    q, k, v = rand(tokens, hk, dk), rand(tokens, hk, dk), rand(tokens, hv, dv)
    g = -torch.rand(tokens, hv, generator=gen, device=device)  # log decay <= 0
    beta = torch.rand(tokens, hv, generator=gen, device=device).to(torch.bfloat16)
    pool = torch.zeros(2, hv, dk, dv, device=device)
    slots = torch.ones(1, dtype=torch.int64, device=device)
    has_initial = torch.ones(1, dtype=torch.bool, device=device)
    cu_seqlens = torch.tensor([0, tokens], device=device)
    return q, k, v, g, beta, pool, slots, has_initial, cu_seqlens, torch.tensor([0, tokens])


def probe(cfg: ModelConfig, tokens: int, profile_top: int = 0) -> str:
    """One line of host, wall and GPU microseconds a call for a sequence of `tokens` (and, with profile_top,
    cProfile's report of the host loop)."""
    from deltaserve.ops.gdn import cuda as gdn_cuda  # GPU only

    device = torch.device("cuda")
    args = _inputs(cfg, tokens, device)
    pool = args[5]

    def call() -> torch.Tensor:
        return gdn_cuda._chunked_prefill(*args)

    for _ in range(10):  # compile, pin fla's configs, build the step's chunk index
        call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        call()
    host = (time.perf_counter() - start) / CALLS
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / CALLS

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # a warm-up on a side stream, as graph capture wants
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = call()
    pool.zero_()
    eager_out = call().clone()
    eager_state = pool.clone()
    pool.zero_()
    graph.replay()
    torch.cuda.synchronize()
    identical = torch.equal(graph_out, eager_out) and torch.equal(pool, eager_state)
    start = time.perf_counter()
    for _ in range(CALLS):
        graph.replay()
    torch.cuda.synchronize()
    gpu = (time.perf_counter() - start) / CALLS
    line = (f"{tokens:6d} tokens: host {1e6 * host:7.0f} us a call, wall {1e6 * wall:7.0f} us, GPU (graph) "
            f"{1e6 * gpu:6.0f} us; graph output and state {'bit-identical' if identical else 'DIFFER'} to eager")
    if profile_top:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(CALLS):
            call()
        profiler.disable()
        torch.cuda.synchronize()
        report = io.StringIO()
        pstats.Stats(profiler, stream=report).sort_stats("tottime").print_stats(profile_top)
        line += "\n" + report.getvalue()
    return line


def _token_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens takes comma-separated positive integers, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--tokens takes comma-separated positive integers, got {text!r}")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gdn_host_probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=str(CONFIGS_DIR / "qwen3.5-27b"),
                        help="config.json directory (default: the shipped Qwen3.5-27B config)")
    parser.add_argument("--tokens", type=_token_counts, default=[64, 256, 1024, 4096],
                        help="comma-separated sequence lengths (default 64,256,1024,4096)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="print cProfile's N costliest host functions for each length")
    args = parser.parse_args(argv)
    if args.profile < 0:
        parser.error(f"--profile must be 0 or more, got {args.profile}")
    if not torch.cuda.is_available():
        parser.error("this probe times CUDA kernels: no CUDA device here")
    cfg = ModelConfig.from_pretrained(args.model)
    for tokens in args.tokens:
        print(probe(cfg, tokens, args.profile), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
