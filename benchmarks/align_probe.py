"""The fused MoE path's grouping launch (ops/moe/cuda.align) by its shape: pairs placed at once (CHUNK), warps,
pairs counted at once (COUNT) and the most programs placing pairs.

    python -m benchmarks.align_probe [CONFIG_DIR] [--tokens 2,4,8,16,32,64] [--chunks 16,32,64,128]
        [--warps 1,2,4,8,16] [--counts 1024] [--pair-programs 64]

For the MoE shape of the model in CONFIG_DIR (default Qwen3.5-35B-A3B), at each token count: the align kernel
grouping given ids ("ids", as fused_experts after the routing kernel) and with the routing kernel before it from
the router's logits ("routed", as fused_moe), each CHUNK x warps x COUNT x pair programs, inside CUDA graphs
(benchmarks/timing.py); the routing kernel alone beside them. When the kernel was one program it took 20-22 us at
16 tokens and 51-64 us at 64 on an H100, ~0.8 and ~2.5 ms of a 35B-A3B decode step (docs/performance.md): this
times it and finds its shape. Prompt chunks (512-8,192 tokens) group on it too where the experts are quantized or
the table names the bucket.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch

from benchmarks.timing import graph_time_us
from deltaserve.config import ModelConfig
from deltaserve.model_configs import CONFIGS_DIR
from deltaserve.ops.moe import configs
from deltaserve.ops.moe import cuda as moe_cuda

CALLS = 16  # calls per graph, each on its own logits


def time_token_count(num_experts: int, top_k: int, hidden: int, intermediate: int, tokens: int,
                     chunks: list[int], warps: list[int], counts: list[int], pair_programs: list[int]) -> list[str]:
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    logits = [torch.randn(tokens, num_experts, device="cuda", generator=gen) for _ in range(CALLS)]
    routed = [moe_cuda.route(x, top_k, True) for x in logits]
    block_m = configs.tiles_for(num_experts, top_k, hidden, intermediate, tokens).block_m
    route_us = graph_time_us([functools.partial(moe_cuda.route, x, top_k, True) for x in logits])
    lines = [f"tokens {tokens} ({tokens * top_k} pairs, BLOCK_M {block_m}): routing kernel {route_us:.1f} us"]
    for chunk, num_warps, count, programs in itertools.product(chunks, warps, counts, pair_programs):
        shape = dict(chunk=chunk, num_warps=num_warps, count=count, pair_programs=programs)
        ids_us = graph_time_us([functools.partial(moe_cuda.align, ids, num_experts, block_m, **shape)
                                for ids, _ in routed])
        routed_us = graph_time_us([functools.partial(moe_cuda.align, ids, num_experts, block_m, (x, weights, True),
                                                     **shape) for x, (ids, weights) in zip(logits, routed)])
        lines.append(f"  chunk {chunk:4d} warps {num_warps:2d} count {count:5d} pair programs {programs:4d}: "
                     f"ids {ids_us:7.1f} us, routed {routed_us:7.1f} us")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=str(CONFIGS_DIR / "qwen3.5-35b-a3b"))
    parser.add_argument("--tokens", default="2,4,8,16,32,64")
    parser.add_argument("--chunks", default="16,32,64,128")
    parser.add_argument("--warps", default="1,2,4,8,16")
    parser.add_argument("--counts", default=str(moe_cuda.ALIGN_COUNT), help="pairs counted at once (powers of two)")
    parser.add_argument("--pair-programs", default=str(moe_cuda.ALIGN_PAIR_PROGRAMS),
                        help="the most programs placing pairs")
    args = parser.parse_args(argv)
    cfg = ModelConfig.from_pretrained(args.model)
    chunks, warps, counts, pair_programs = ([int(v) for v in arg.split(",")]
                                            for arg in (args.chunks, args.warps, args.counts, args.pair_programs))
    print(f"{torch.cuda.get_device_name()}; E {cfg.num_experts}, k {cfg.num_experts_per_tok}")
    for tokens in (int(t) for t in args.tokens.split(",")):
        print("\n".join(time_token_count(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                                         cfg.moe_intermediate_size, tokens, chunks, warps, counts, pair_programs)),
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
