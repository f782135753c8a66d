"""One MoE layer (router + routed experts + gated shared expert) on the torch path and on the fused path (ops/moe),
beside the bytes-over-bandwidth limit.

    python -m benchmarks.moe_probe [CONFIG_DIR] [--format bf16|fp8|int4|nvfp4] [--tokens 1,2,4,...] [--sweep]
        [--out FILE]

For the MoE shape of the model in CONFIG_DIR (default Qwen3.5-35B-A3B), at each token count, inside CUDA graphs as
decode runs them, each call on other random inputs so that its experts are not the previous call's (one call
touches k of E experts; L2 holds about one call's): times the old path (the router, torch softmax + topk +
renormalise, sort + grouped_mm, the shared expert and its gate), the fused path with the shared expert apart (one
GEMM for the router, the shared gate and the shared gate/up; the shared SiLU + down; the routing kernel; the fused
experts with the shared sum), the fused experts alone (and their align kernel alone), the routing kernel alone
(at 1, 2 and 4 warps a token), and the limit: the bytes a layer must read (router, shared expert, and the
distinct selected experts' weights, counted from the calls' routing) over 4.8 TB/s (the H200's nominal HBM
bandwidth). Where the shared expert has the experts' intermediate size, a second line times the layer with the
shared expert a slot of the fused kernels and the routing inside them (the router + shared gate GEMM, then
cuda.fused_moe: SparseMoE's path up to moe.SHARED_SLOT_MAX_TOKENS tokens), and fused_moe alone. Each path's CUDA
kernels per layer call are counted (torch.profiler, eager).
`--sweep` then tunes the fused kernels' tiles per token bucket of --tokens (prompt-chunk buckets such as 512 and
8192 too, where torch's grouped matmul, on the dequantized experts for a quantized format, is timed beside the tiles
and the bf16 matmul rate's limit, and the table marks "grouped" where it wins: plain experts' prompt chunks take the
tiles only of the buckets the table names without it), on the path SparseMoE takes at it
(kernel A's over its candidates with kernel B's default, then kernel B's with A's best, then BLOCK_M; at one token
kernel A's tiles again with its K split 2, 4 or 8 ways, and the GEMV kernels' tiles alike, kept where they beat the
tensor-core ones; each candidate's output checked against the plain-torch layer's first, the dequantized experts' for
a quantized format, so that a broken tile is reported and never chosen), starting no bucket after --budget-s
seconds, and merges the winners into --out (copy to deltaserve/ops/moe/configs.json to ship them).
`--kernels` (quantized formats) adds each kernel's time on the table's tiles (torch.profiler over eager calls).
`--format fp8` / `int4` / `nvfp4` times and sweeps the fused experts alone on stacked quantized experts of the same
shapes (FP8 128 x 128 blocks, W8A8; int4 group 128 asymmetric, W4A16; NVFP4 weight-only) beside their bytes' limit,
under the table's "fp8:" / "int4:" / "nvfp4:" keys; FP8 and int4 take BLOCK_K from the format, so the sweep varies
BLOCK_N, warps, stages and BLOCK_M (at BLOCK_K 128, which NVFP4 takes as it is).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import time

import torch

from torch.profiler import ProfilerActivity, profile

from benchmarks.gemv_probe import write_table
from benchmarks.quant_gemm_probe import BF16_TFLOPS, make_weight
from benchmarks.timing import BrokenOutput, check_output, eager_time_us, graph_time_us
from deltaserve.config import ModelConfig
from deltaserve.layers.mlp import SparseMoE
from deltaserve.model_configs import CONFIGS_DIR
from deltaserve.ops import moe
from deltaserve.ops.activation import silu_and_mul
from deltaserve.ops.linear import linear
from deltaserve.ops.moe import configs, reference
from deltaserve.ops.moe import cuda as moe_cuda
from deltaserve.ops.moe import dequantized, quantized

HBM_BYTES_PER_S = 4.8e12  # H200 nominal
BF16_FLOPS_PER_S = BF16_TFLOPS * 1e12  # H200 dense bf16, as measured here (WORKLOADS.md)
CALLS = 16  # calls per graph, each on its own inputs
ROUTE_WARPS = (1, 2, 4)  # the routing kernel's program sizes timed (moe_cuda.ROUTE_WARPS ships one)
# kernel tiles tried by --sweep: [BLOCK_N, BLOCK_K, warps, stages]
TILE_SWEEP = [configs.Tile(bn, bk, warps, stages)
              for bn, bk, (warps, stages) in itertools.product((16, 32, 64, 128), (64, 128, 256), ((4, 3), (4, 4), (8, 4)))
              if bn * bk <= 16384]
QUANT_BLOCK_K = 128  # the FP8 scale block and the int4 group the quantized stacks are made with
# the one-token GEMV kernels' tiles tried at bucket 1 (stages do not apply: no tl.dot, nothing pipelined). Their K
# loop's loads are not pipelined, so a program has one K step's bytes in flight: K steps up to a whole 2,048-wide
# row too (fewer rows a program there, or its [BLOCK_N, BLOCK_K] float32 accumulators spill; the sweep skips
# tiles that fail to build)
GEMV_SWEEP = [configs.Tile(bn, bk, warps, 1)
              for bn, bk, warps in itertools.product((4, 8, 16), (128, 256, 512, 1024, 2048), (2, 4, 8))
              if bn * bk <= 16384]
GEMV_START = configs.Tile(8, 256, 4, 1)


def sweep_tiles(fmt: str) -> list[configs.Tile]:
    """The tiles --sweep tries for a weight format: quantized kernels take BLOCK_K from the format."""
    return TILE_SWEEP if fmt == "bf16" else [t for t in TILE_SWEEP if t.block_k == QUANT_BLOCK_K]


def quantized_stacks(block: SparseMoE, fmt: str) -> tuple:
    """(gate_up, down) of the block's expert shapes as stacked random `fmt` experts (ops.moe.quantized)."""
    E, two_i, H = block.experts.gate_up_proj.shape
    gate_up = quantized.stack([make_weight(fmt, two_i, H) for _ in range(E)])
    down = quantized.stack([make_weight(fmt, H, two_i // 2) for _ in range(E)])
    return gate_up, down


def stack_bytes(w) -> int:
    """Bytes of one expert's weights in a stack (its prepared weight's, scales and zero points included)."""
    return w.expert(0).nbytes


def build_block(cfg: ModelConfig) -> SparseMoE:
    """One MoE block of the model's shapes in bf16 on the GPU, weights std 1 / sqrt(fan_in)."""
    with torch.device("cuda"):
        block = SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                          cfg.shared_expert_intermediate_size, cfg.norm_topk_prob)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, param.shape[-1] ** -0.5)
    block = block.to(torch.bfloat16)
    block.fuse()  # as the loader does: the router, shared gate and shared gate/up joined into one weight
    if block.shared_expert is not None:
        block.shared_expert.fuse()
    return block


def torch_path(block: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """The layer as it ran before ops.moe's kernels: torch routing, sort + grouped_mm, the shared expert's sum."""
    ids, weights = reference.route(block.gate(x), block.top_k, block.norm_topk_prob)
    shared = None if block.shared_expert is None else (block.shared_expert(x), block.shared_expert_gate(x))
    return reference.grouped_experts(x, ids, weights, block.experts.gate_up_proj, block.experts.down_proj,
                                     shared=shared)


def shared_apart_path(block: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """The fused path with the shared expert apart (SparseMoE's before the shared slot, and still its path where
    the sizes differ): the joined router + shared gate + shared gate/up GEMM, the shared SiLU + down, the routing
    kernel, the fused experts summing the gated shared output."""
    logits, gate, shared_gate_up = block.split_projection(linear(x, block.in_weight))
    shared = (block.shared_expert.down(shared_gate_up), gate)
    ids, weights = moe.route(logits, block.top_k, block.norm_topk_prob)
    return moe.experts(x, ids, weights, block.experts.gate_up_proj, block.experts.down_proj, shared)


def served_grouped(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor) -> torch.Tensor:
    """Plain experts' prompt chunk as served where the fused tiles do not take it (moe.experts): torch's grouped
    matmul, then the combine kernel (reference.grouped_experts sums in torch, which no served path does)."""
    return moe_cuda.combine(*reference.expert_outputs(x, ids, gate_up, down), weights)


def slot_path(block: SparseMoE, operands: tuple, tiles: configs.MoeTiles, x: torch.Tensor) -> torch.Tensor:
    """The shared slot at any token count (SparseMoE takes it up to moe.SHARED_SLOT_MAX_TOKENS): the router + shared
    gate GEMM, then cuda.fused_moe."""
    logits, gate, _ = block.split_projection(linear(x, block.router_weight))
    return moe_cuda.fused_moe(x, logits, block.top_k, block.norm_topk_prob, *operands, gate, tiles)[0]


def reference_output(block: SparseMoE, x: torch.Tensor, routed: tuple, projection: tuple | None,
                     operands: tuple | None, stacks: tuple | None) -> torch.Tensor:
    """What the swept path must compute for x [T, H], in plain torch: with the shared slot (operands, and x's
    projection (logits, gate, _)) the whole layer, routed by moe.route (on CUDA the routing kernel, whose ties
    kernel A's folded routing shares); else the routed experts alone on `routed` (ids, weights), the quantized
    `stacks` dequantized."""
    if operands is not None:
        logits, gate, _ = projection
        gate_up, down, shared_gate_up, shared_down = operands
        shared = silu_and_mul(x @ shared_gate_up.T) @ shared_down.T  # [T, H]
        return reference.grouped_experts(x, *moe.route(logits, block.top_k, block.norm_topk_prob), gate_up, down,
                                         shared=(shared, gate))
    if stacks is not None:
        return dequantized.grouped_experts(x, *routed, *stacks)
    return reference.grouped_experts(x, *routed, block.experts.gate_up_proj, block.experts.down_proj)


def slot_operands(block: SparseMoE) -> tuple | None:
    """(gate_up, down, shared gate_up, shared down) where the block runs the shared expert as a slot, else None."""
    experts = block.experts
    if block.shared_expert is None or block.in_weight is None:
        return None
    operands = (experts.gate_up_proj, experts.down_proj, block.shared_expert.gate_up_weight,
                block.shared_expert.down_proj.weight)
    probe = torch.zeros(1, block.gate.in_features, dtype=experts.gate_up_proj.dtype, device=experts.gate_up_proj.device)
    return operands if moe.shared_slot_serves(probe, *operands, block.top_k) else None


def kernel_launches(call) -> int:
    """CUDA kernels one eager call launches (after a warm-up call)."""
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return sum(1 for event in prof.events() if event.device_type.name == "CUDA"
               and not event.name.startswith(("Memcpy", "Memset")))


def kernel_times(calls: list) -> list[tuple[str, float]]:
    """(CUDA kernel, mean us a call) of eager calls (each on its own inputs, as graph_time_us's), from torch.profiler:
    which kernel of a path takes the time (the graphs' launches and gaps are not in it)."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for call in calls:
            call()
        torch.cuda.synchronize()
    return [(event.key, event.device_time_total / len(calls)) for event in prof.key_averages()
            if event.device_time_total > 0 and not event.key.startswith(("Memcpy", "Memset"))]


def print_kernel_times(label: str, calls: list) -> None:
    for name, us in kernel_times(calls):
        print(f"      {label}: {us:7.1f} us  {name[:100]}", flush=True)


def layer_bytes(block: SparseMoE, routings: list[torch.Tensor]) -> tuple[float, float]:
    """(bytes a layer call must read, of them the routed experts'), averaged over the calls' routing [T, k]."""
    experts = block.experts
    per_expert = (experts.gate_up_proj[0].numel() + experts.down_proj[0].numel()) * 2
    routed = sum(ids.unique().numel() for ids in routings) / len(routings) * per_expert
    fixed = block.gate.weight.numel() * 2
    if block.shared_expert is not None:
        fixed += sum(p.numel() for p in block.shared_expert.parameters() if p.dim() == 2) * 2
        fixed += block.shared_expert_gate.weight.numel() * 2
    return fixed + routed, routed


def route_times(times: dict[int, float]) -> str:
    """The routing kernel's time a call at each warp count, the shipped count marked: '1.9 us (1 warp), ...'."""
    return ", ".join(f"{us:.1f} us ({warps} warp{'s' * (warps > 1)}{', shipped' * (warps == moe_cuda.ROUTE_WARPS)})"
                     for warps, us in times.items())


def time_layer(block: SparseMoE, tokens: int) -> dict:
    xs = [torch.randn(tokens, block.gate.in_features, device="cuda", dtype=torch.bfloat16) for _ in range(CALLS)]
    with torch.no_grad():
        routed = [moe.route(block.gate(x), block.top_k, block.norm_topk_prob) for x in xs]
        total, routed_bytes = layer_bytes(block, [ids for ids, _ in routed])
        experts = block.experts
        tiles = configs.tiles_for(experts.gate_up_proj.shape[0], block.top_k, experts.gate_up_proj.shape[2],
                                  experts.down_proj.shape[2], tokens)
        old = graph_time_us([functools.partial(torch_path, block, x) for x in xs])
        apart = (functools.partial(shared_apart_path, block) if block.in_weight is not None
                 else functools.partial(SparseMoE.forward, block))
        fused = graph_time_us([functools.partial(apart, x) for x in xs])
        alone = graph_time_us([functools.partial(moe_cuda.fused_experts, x, ids, w, experts.gate_up_proj,
                                                 experts.down_proj, tiles) for x, (ids, w) in zip(xs, routed)])
        align = graph_time_us([functools.partial(moe_cuda.align, ids, experts.gate_up_proj.shape[0], tiles.block_m)
                               for ids, _ in routed])
        route = {warps: graph_time_us([functools.partial(moe_cuda.route, block.gate(x), block.top_k,
                                                         block.norm_topk_prob, warps) for x in xs])
                 for warps in ROUTE_WARPS}
        result = {"old": old, "fused": fused, "experts": alone, "align": align, "route": route,
                  "limit": 1e6 * total / HBM_BYTES_PER_S, "experts_limit": 1e6 * routed_bytes / HBM_BYTES_PER_S,
                  "mb": total / 1e6, "old_launches": kernel_launches(functools.partial(torch_path, block, xs[0])),
                  "fused_launches": kernel_launches(functools.partial(apart, xs[0]))}
        operands = slot_operands(block)
        if operands is not None:
            projections = [block.split_projection(linear(x, block.router_weight)) for x in xs]
            result["slot"] = graph_time_us([functools.partial(slot_path, block, operands, tiles, x) for x in xs])
            result["slot_launches"] = kernel_launches(functools.partial(slot_path, block, operands, tiles, xs[0]))
            result["slot_kernels"] = graph_time_us([functools.partial(
                moe_cuda.fused_moe, x, logits, block.top_k, block.norm_topk_prob, *operands, gate, tiles)
                for x, (logits, gate, _) in zip(xs, projections)])
    return result


def time_quantized(block: SparseMoE, stacks: tuple, tokens: int, kernels: bool = False) -> dict:
    """The fused experts alone on quantized stacks at `tokens` tokens (default tiles and the table's), and the
    limit: the distinct selected experts' bytes over the bandwidth; `kernels`: the table's path kernel by kernel."""
    gate_up, down = stacks
    xs = [torch.randn(tokens, block.gate.in_features, device="cuda", dtype=torch.bfloat16) for _ in range(CALLS)]
    with torch.no_grad():
        routed = [moe.route(block.gate(x), block.top_k, block.norm_topk_prob) for x in xs]
        E, two_i, H = gate_up.shape
        per_expert = stack_bytes(gate_up) + stack_bytes(down)
        distinct = sum(ids.unique().numel() for ids, _ in routed) / len(routed)
        result = {"limit": 1e6 * distinct * per_expert / HBM_BYTES_PER_S}
        for name, tiles in (("default", configs.default_tiles(tokens)),
                            ("table", configs.tiles_for(E, block.top_k, H, two_i // 2, tokens,
                                                        quantized.format_name(gate_up)))):
            calls = [functools.partial(moe_cuda.fused_experts, x, ids, w, gate_up, down, tiles)
                     for x, (ids, w) in zip(xs, routed)]
            result[name] = graph_time_us(calls)
        if configs.row_bucket(tokens) in configs.GROUPED_BUCKETS:  # the dequantized groups' grouped matmul, eagerly
            result["grouped"] = eager_time_us([functools.partial(dequantized.grouped_experts, x, ids, w, gate_up, down)
                                               for x, (ids, w) in zip(xs, routed)])
        if kernels:
            print_kernel_times(f"T={tokens}, table's tiles", calls)
    return result


def sweep_bucket(block: SparseMoE, tokens: int, stacks: tuple | None = None
                 ) -> tuple[configs.MoeTiles, float, float]:
    """(the best tiles, their time, the default's time) of the fused experts at `tokens` tokens (with the shared
    slot and the routing where the block runs them so), on the block's bf16 experts or the quantized `stacks`."""
    experts = block.experts
    gate_up, down = stacks or (experts.gate_up_proj, experts.down_proj)
    xs = [torch.randn(tokens, block.gate.in_features, device="cuda", dtype=torch.bfloat16) for _ in range(CALLS)]
    operands = slot_operands(block) if tokens <= moe.SHARED_SLOT_MAX_TOKENS and stacks is None else None
    with torch.no_grad():
        routed = [moe.route(block.gate(x), block.top_k, block.norm_topk_prob) for x in xs]
        projections = ([block.split_projection(linear(x, block.router_weight)) for x in xs] if operands is not None
                       else [])

    def calls(tiles: configs.MoeTiles) -> list:
        """The calls of the path SparseMoE takes: fused_moe with the shared slot, else the fused experts."""
        if operands is not None:
            return [functools.partial(moe_cuda.fused_moe, x, logits, block.top_k, block.norm_topk_prob, *operands,
                                      gate, tiles) for x, (logits, gate, _) in zip(xs, projections)]
        return [functools.partial(moe_cuda.fused_experts, x, ids, w, gate_up, down, tiles)
                for x, (ids, w) in zip(xs, routed)]

    with torch.no_grad():
        expected = reference_output(block, xs[0], routed[0], projections[0] if operands else None, operands, stacks)

    def timed(tiles: configs.MoeTiles) -> float:
        """The tiles' time a call, after checking the first call's output (timing.check_output); inf where they
        fail to build or compute another output."""
        try:
            with torch.no_grad():
                out = calls(tiles)[0]()
                check_output(out[0] if operands is not None else out, expected)  # fused_moe: (out, ids, weights)
                return graph_time_us(calls(tiles))
        except BrokenOutput as exc:
            print(f"    {tiles}: WRONG ({exc})", flush=True)
        except Exception as exc:  # a tile Triton cannot build (registers, shared memory): skip it
            print(f"    {tiles}: failed ({type(exc).__name__})", flush=True)
        return float("inf")

    default = configs.default_tiles(tokens)
    default_time = timed(default)
    best_time, best = default_time, default
    tiles = sweep_tiles(quantized.format_name(gate_up))
    for tile in tiles:
        candidate = best._replace(gate_up=tile)
        t = timed(candidate)
        if t < best_time:
            best_time, best = t, candidate
    for tile in tiles:
        candidate = best._replace(down=tile)
        t = timed(candidate)
        if t < best_time:
            best_time, best = t, candidate
    # decode: BLOCK_M below the default (an expert has at most `tokens` pairs); prompt chunks: around it
    for block_m in (16, 32, 64) if tokens <= configs.FUSED_MAX_TOKENS else (32, 128):
        if block_m < best.block_m or tokens > configs.FUSED_MAX_TOKENS:
            candidate = best._replace(block_m=block_m)
            t = timed(candidate)
            if t < best_time:
                best_time, best = t, candidate
    if tokens == 1:  # kernel A's K split over more programs (its tile swept again: more programs suit larger ones)
        for split_k, tile in itertools.product((2, 4, 8), tiles):
            candidate = best._replace(gate_up=tile, split_k=split_k)
            t = timed(candidate)
            if t < best_time:
                best_time, best = t, candidate
    if tokens == 1:  # the launches one token may save: FP8's quantize launches and the combine, each kept or folded
        fp8 = quantized.format_name(gate_up) == "fp8"
        for quant_x, combine in itertools.product((False, True) if fp8 else (True,), (False, True)):
            candidate = best._replace(quant_x=quant_x, combine=combine)
            if candidate == best:
                continue
            t = timed(candidate)
            if t < best_time:
                best_time, best = t, candidate
    # or torch's grouped matmul: quantized experts' eager chunks on dequantized groups, plain experts' every chunk
    # (no host sync: timed in a graph as the tiles, since chunks up to 1,024 tokens are captured)
    if configs.row_bucket(tokens) in (configs.GROUPED_BUCKETS if stacks is not None else configs.PREFILL_BUCKETS):
        grouped = dequantized.grouped_experts if stacks is not None else served_grouped
        grouped_time = (eager_time_us if stacks is not None else graph_time_us)(
            [functools.partial(grouped, x, ids, w, gate_up, down) for x, (ids, w) in zip(xs, routed)])
        E, two_i, H = gate_up.shape
        flops = 2 * tokens * block.top_k * 3 * H * (two_i // 2)  # gate/up and down of every (token, expert) pair
        print(f"    {'dequantized groups' if stacks is not None else 'torch'}' grouped matmul {grouped_time:.1f} us, "
              f"tiles {best_time:.1f} us; the bf16 matmul rate's limit {1e6 * flops / BF16_FLOPS_PER_S:.1f} us",
              flush=True)
        if grouped_time < best_time:
            best_time, best = grouped_time, best._replace(grouped=True)
    if tokens == 1:  # the GEMV kernels: kernel A's tiles with B's start, then B's with A's best
        rows = configs.MoeTiles(16, GEMV_START, GEMV_START, gemv=True)
        rows_time = timed(rows)
        for kernel in ("gate_up", "down"):
            for tile in GEMV_SWEEP:
                candidate = rows._replace(**{kernel: tile})
                t = timed(candidate)
                if t < rows_time:
                    rows_time, rows = t, candidate
        print(f"    one token: GEMV kernels {rows_time:.1f} us {configs.tiles_entry(rows)}, tensor-core tiles "
              f"{best_time:.1f} us", flush=True)
        if rows_time < best_time:
            best_time, best = rows_time, rows
    return best, best_time, default_time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.moe_probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=str(CONFIGS_DIR / "qwen3.5-35b-a3b"),
                        help="config.json directory of an MoE model (default: the shipped Qwen3.5-35B-A3B config)")
    parser.add_argument("--format", default="bf16", choices=configs.WEIGHT_FORMATS,
                        help="the routed experts' weight format (fp8, int4, nvfp4: the fused experts alone, stacked)")
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64", help="token counts to time")
    parser.add_argument("--sweep", action="store_true",
                        help="tune the fused kernels' tiles per bucket of --tokens (at one token the GEMV kernels too)")
    parser.add_argument("--budget-s", type=float, default=90.0, help="start no sweep bucket after this many s")
    parser.add_argument("--kernels", action="store_true",
                        help="also each kernel's time of the table's path (torch.profiler, eager; quantized formats)")
    parser.add_argument("--out", default="moe_configs.json", help="merge the swept tiles into this table")
    args = parser.parse_args(argv)
    try:
        token_counts = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        token_counts = [0]
    if min(token_counts) < 1:
        parser.error(f"--tokens takes comma-separated positive integers, got {args.tokens!r}")
    cfg = ModelConfig.from_pretrained(args.model)
    if not cfg.num_experts:
        parser.error(f"{args.model} is not an MoE model")
    if not torch.cuda.is_available():
        parser.error("no CUDA device here: the probe times GPU kernels")
    block = build_block(cfg)
    E, k, H, inter = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    if args.format != "bf16":
        return quantized_main(args, block, token_counts)
    if block.shared_expert is not None and slot_operands(block) is None:
        print("the shared expert's intermediate size differs from the experts': no shared-slot path", flush=True)
    print(f"MoE layer of {args.model}: E={E} top-{k} H={H} I={inter} shared={cfg.shared_expert_intermediate_size}; "
          f"limit at {HBM_BYTES_PER_S / 1e12:.1f} TB/s", flush=True)
    for tokens in token_counts:
        r = time_layer(block, tokens)
        print(f"T={tokens:>3} ({r['mb']:.0f} MB): torch path {r['old']:7.1f} us | fused, shared apart {r['fused']:7.1f} us "
              f"({r['old'] / r['fused']:.2f}x) | limit {r['limit']:6.1f} us (fused at {r['limit'] / r['fused']:.0%}) "
              f"| experts alone {r['experts']:6.1f} us, limit {r['experts_limit']:6.1f} us "
              f"({r['experts_limit'] / r['experts']:.0%}; of it align {r['align']:.1f} us) | routing kernel "
              f"{route_times(r['route'])} | kernels: torch path {r['old_launches']}, fused {r['fused_launches']}",
              flush=True)
        if "slot" in r:
            print(f"      shared slot: layer {r['slot']:7.1f} us ({r['fused'] / r['slot']:.2f}x the fused path above, "
                  f"limit at {r['limit'] / r['slot']:.0%}) | fused_moe alone {r['slot_kernels']:6.1f} us | kernels "
                  f"{r['slot_launches']}", flush=True)
    return sweep(args, block, token_counts) if args.sweep else 0


def quantized_main(args, block: SparseMoE, token_counts: list[int]) -> int:
    """--format fp8 / int4: the fused experts alone on random stacked experts, then the sweep."""
    stacks = quantized_stacks(block, args.format)
    E, two_i, H = stacks[0].shape
    print(f"{args.format} experts of {args.model}: E={E} top-{block.top_k} H={H} I={two_i // 2}, "
          f"{(stack_bytes(stacks[0]) + stack_bytes(stacks[1])) / 1e6:.2f} MB an expert; limit at "
          f"{HBM_BYTES_PER_S / 1e12:.1f} TB/s", flush=True)
    for tokens in token_counts:
        r = time_quantized(block, stacks, tokens, args.kernels)
        grouped = f", dequantized groups' grouped matmul {r['grouped']:6.1f} us" if "grouped" in r else ""
        print(f"T={tokens:>3}: fused experts, default tiles {r['default']:6.1f} us, table's {r['table']:6.1f} us{grouped}"
              f" | limit {r['limit']:6.1f} us (table's at {r['limit'] / r['table']:.0%})", flush=True)
    return sweep(args, block, token_counts, stacks) if args.sweep else 0


def sweep(args, block: SparseMoE, token_counts: list[int], stacks: tuple | None = None) -> int:
    """Tune the tiles of each bucket of token_counts (sweep_bucket) and merge the winners into args.out after every
    bucket."""
    E, two_i, H = (stacks[0] if stacks else block.experts.gate_up_proj).shape
    start, table = time.monotonic(), {}
    buckets = sorted({configs.row_bucket(t) for t in token_counts})
    for bucket in buckets:
        if time.monotonic() - start > args.budget_s:
            print(f"budget of {args.budget_s:.0f} s spent: buckets from {bucket} not swept", flush=True)
            break
        best, best_time, default_time = sweep_bucket(block, bucket, stacks)
        table[configs.table_key(E, block.top_k, H, two_i // 2, bucket, args.format)] = configs.tiles_entry(best)
        write_table(args.out, table)  # after every bucket: a run killed later keeps what it measured
        print(f"bucket {bucket:>2}: best {best_time:6.1f} us {configs.tiles_entry(best)} (default {default_time:6.1f} "
              f"us) after {time.monotonic() - start:.0f} s", flush=True)
    print(f"wrote {len(table)} entries to {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
