"""Decode projections on the skinny Triton GEMM (ops/linear/cuda_skinny.py) beside what they run otherwise, and
the GDN decode kernel's tiles at a batch of many sequences, and the GDN recurrent prefill's tiles on one chunk.

    python -m benchmarks.batch_probe [CONFIG_DIR] [--out deltaserve/ops/linear/skinny_configs.json]

For every projection of a decode step of the model in CONFIG_DIR (default: the published Qwen3.5-27B shape), inside
CUDA graphs as decode runs them, each call on another copy of the weight so that none is served from L2: at one row,
the prologue op and then the skinny kernel against the best of the fused GEMV (ops/linear/configs.json) and the
prologue op + cuBLAS; at 16, 32 and 64 rows, the prologue op + the skinny kernel against the prologue op + cuBLAS
(`--only N:K` for one shape; above one row also the shared expert's products of a bf16 MoE layer). Each tile's
output is checked against the unfused op's first (benchmarks/timing.check_output: a broken tile is reported and never
chosen). Writes the table cuda_skinny.py reads (the best tile where it won by 2%, else null) and prints each result
with its bandwidth; then times the GDN decode step over (block_v, num_warps), and the
recurrent prefill of one sequence of 16 and 128 tokens (CHUNK_TILE in ops/gdn/cuda.py). `--rows "" --gdn-batches ""
--gdn-chunks "" --compare-specialization 64` times the tuned skinny tiles at 64 rows with and without Triton's
specialisation on the row count, and nothing else; `--diagnose 16,64` (with the same empty lists) splits the skinny
GEMM's time at those row counts into weight streaming, dots and activation loads; `--prefill-rows 8192` times the
projections of a prefill chunk on cuBLAS and on cuBLASLt; `--small` adds the small bf16 products that the quantized
checkpoints keep (GDN's [b|a], the MoE router joined with the shared gate) of every shipped config, at one row.
"""

from __future__ import annotations

import functools
import itertools
import json

import torch
import triton
import triton.language as tl

from benchmarks.gemv_probe import (COPIES_BYTES, batch_projections, decode_projections, inputs, probe_parser,
                                  write_table)
from benchmarks.timing import BrokenOutput, checked_time_us, graph_time_us
from deltaserve.config import ModelConfig
from deltaserve.layers.mlp import join_padded
from deltaserve.model_configs import CONFIGS_DIR
from deltaserve.ops.gdn import cuda as gdn_cuda
from deltaserve.ops.linear import cuda as gemv_cuda
from deltaserve.ops.linear import cuda_skinny, reference

# (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages[, TMA]): the pointer-load tiles that won somewhere in wider
# sweeps on an H200 (sixth to eighth sessions), then TMA copies of the same and of wider column blocks, whose
# activation tile serves more weight rows (each column block re-reads the whole activation from L2), then
# narrower ones (27B's gate/up at 64 rows runs 544 column blocks of 64 on 132 SMs, one program each at a time: 4.1
# waves, the last one with 16 programs; 1,088 of 32 leave a smaller tail). Stream-K tiles (an equal share of the
# weight per SM) won nowhere in the tenth session's sweep and were removed.
SWEEP = [(128, 128, 1, 4, 4), (128, 128, 1, 8, 4), (64, 128, 1, 4, 3), (64, 128, 1, 4, 6), (64, 256, 1, 4, 4),
         (128, 128, 2, 4, 4), (64, 64, 4, 4, 4),
         (64, 128, 1, 4, 4, 1), (64, 128, 1, 4, 6, 1), (64, 256, 1, 4, 3, 1), (128, 128, 1, 4, 4, 1),
         (128, 128, 1, 8, 4, 1), (128, 64, 1, 4, 6, 1), (128, 64, 1, 8, 6, 1), (256, 64, 1, 8, 4, 1),
         (128, 128, 2, 4, 4, 1), (64, 128, 2, 4, 6, 1),
         (32, 128, 1, 4, 4, 1), (32, 128, 1, 4, 6, 1), (32, 256, 1, 4, 3, 1)]
GDN_SWEEP = [(bv, warps) for bv, warps in itertools.product((16, 32, 64, 128), (1, 2, 4, 8))
             if 8 <= 128 * bv // (32 * warps) <= 128]
# The small bf16 products of the quantized checkpoints (GDN's [b|a], a MoE layer's joined router and shared gate:
# 64-528 rows): narrow column blocks, K split so that enough programs stream them
SMALL_SWEEP = [(block_n, block_k, split, 4, 3) for block_n in (16, 32) for block_k in (128, 256)
               for split in (1, 2, 4, 8)]
# 1% of noise between two graph timings of the same kernel; a tile must win by more than this
MIN_GAIN = 0.98


def best_tile(calls_for, expected, sweep=SWEEP) -> tuple[float, tuple, list]:
    """(microseconds, tile, top 3) of the fastest tile of `sweep`; calls_for(tile) -> the graph's calls, the first
    of which must return `expected` (the unfused reference's output of the same inputs) as timing.check_output
    judges it."""
    results = []
    for tile in sweep:
        try:
            results.append((checked_time_us(calls_for(tile), expected), tile))
        except BrokenOutput as exc:
            print(f"  {tile}: WRONG ({exc})", flush=True)
        except Exception as exc:  # a tile Triton cannot build (shared memory): skip it
            print(f"  {tile}: failed ({type(exc).__name__})", flush=True)
    if not results:
        raise RuntimeError(f"no tile of {sweep} ran correctly")
    best_time, best = min(results)
    return best_time, best, [(round(t, 1), tile) for t, tile in sorted(results)[:3]]


def _plain(x, weight, matmul=torch.nn.functional.linear):
    """The "none" prologue in the unfused ops' call shape."""
    return matmul(x, weight)


def probe_one_row(cfg: ModelConfig, device) -> dict:
    """Bucket 1: the prologue op + the skinny GEMM against the fused GEMV and the prologue op + cuBLAS. A
    weight shape shared by two projections gets a tile only where it wins for both."""
    unfused_fns = {"rms_norm": reference.rms_norm_linear, "rms_norm_and": reference.rms_norm_and_linear,
                   "silu_mul": reference.silu_mul_linear, "gated_norm": reference.gated_norm_linear, "none": _plain}
    gemv_fns = {"rms_norm": gemv_cuda.rms_norm_linear, "rms_norm_and": gemv_cuda.rms_norm_and_linear,
                "silu_mul": gemv_cuda.silu_mul_linear, "gated_norm": gemv_cuda.gated_norm_linear,
                "none": gemv_cuda.linear}
    table = {}
    for prologue, n, k in decode_projections(cfg):
        weights, call = inputs(prologue, n, k, cfg.gdn_v_dim, device)
        megabytes = 2 * n * k / 1e6
        unfused = unfused_fns[prologue]
        baseline = graph_time_us([functools.partial(call, unfused, w) for w in weights])
        if gemv_cuda.config_for(prologue.removesuffix("_and"), n, k) is not None:  # the table's "rms_norm" keys
            baseline = min(baseline, graph_time_us([functools.partial(call, gemv_fns[prologue], w) for w in weights]))
        best_time, best, top = best_tile(lambda tile: [
            functools.partial(call, unfused, w, matmul=functools.partial(cuda_skinny.linear, config=tile))
            for w in weights], call(unfused, weights[0]))
        key = f"{n}:{k}:1"
        wins = best_time < MIN_GAIN * baseline
        table[key] = list(best) if wins and table.get(key, list(best)) is not None else None
        print(f"rows 1 {prologue:>10} N={n:>6} K={k:>6} ({megabytes:.0f} MB): fused GEMV or unfused "
              f"{baseline:.1f} us ({megabytes / baseline:.2f} TB/s); op + skinny {best_time:.1f} us "
              f"({megabytes / best_time:.2f} TB/s) {best}; top: {top}", flush=True)
    return table


def small_products() -> list[tuple[int, int]]:
    """(N, K) of the bf16 products that quantized checkpoints keep and decode runs apart, over every shipped
    config: GDN's in-projection [b|a] (beside the quantized [q|k|v|z]) and a MoE layer's router joined with the
    shared-expert gate (layers/mlp.py pads it to JOIN_ROW_MULTIPLE rows)."""
    shapes = set()
    for path in sorted(CONFIGS_DIR.iterdir()):
        if not (path / "config.json").is_file():
            continue
        cfg = ModelConfig.from_pretrained(path)
        shapes.add((2 * cfg.gdn_num_v_heads, cfg.hidden_size))
        if cfg.num_experts:
            shapes.add((join_padded(cfg.num_experts + 1), cfg.hidden_size))
    return sorted(shapes)


def probe_small_products(device) -> dict:
    """Bucket 1 of small_products(): the skinny GEMM over SMALL_SWEEP against cuBLAS (the fused GEMV's table
    names none of these shapes)."""
    table = {}
    for n, k in small_products():
        weights, call = inputs("none", n, k, 0, device)
        megabytes = 2 * n * k / 1e6
        cublas = graph_time_us([functools.partial(call, _plain, w) for w in weights])
        best_time, best, top = best_tile(lambda tile: [
            functools.partial(call, _plain, w, matmul=functools.partial(cuda_skinny.linear, config=tile))
            for w in weights], call(_plain, weights[0]), SMALL_SWEEP)
        table[f"{n}:{k}:1"] = list(best) if best_time < MIN_GAIN * cublas else None
        print(f"rows 1 small N={n:>4} K={k:>5} ({megabytes:.2f} MB): cuBLAS {cublas:.1f} us ({megabytes / cublas:.2f} "
              f"TB/s); skinny {best_time:.1f} us ({megabytes / best_time:.2f} TB/s) {best}; top: {top}", flush=True)
    return table


def _swapped_linear(x, weight):
    """x @ weight^T as cuBLAS computes (weight @ x^T)^T, made contiguous: a tall product instead of a skinny
    one, for which cuBLAS may choose other kernels."""
    return torch.mm(weight, x.t()).t().contiguous()


def probe_rows(cfg: ModelConfig, rows: int, device, only: str = "") -> dict:
    """Buckets 16-64 (at their largest batch): each product after its prologue op (the norm, silu-mul or gated
    norm the engine runs before it), skinny against cuBLAS (and, printed only, cuBLAS on the transposed product).
    Products timed back to back flattered cuBLAS: the 27B GDN out-proj at 64 rows took 18.6 us so, but 22.3 us
    inside a decode step, and 22.0 us with its gated norm (~3 us alone) before it (ninth session); with the op
    between them, both kernels start as they do in the engine. The attention o_proj shares the GDN out-proj's
    shape, whose entry the out-proj (48 of 64 layers on 27B) decides."""
    unfused_fns = {"rms_norm": reference.rms_norm_linear, "silu_mul": reference.silu_mul_linear,
                   "gated_norm": reference.gated_norm_linear}
    table = {}
    for prologue, n, k in batch_projections(cfg):
        if prologue not in unfused_fns or (only and only != f"{n}:{k}"):
            continue
        weights, call = inputs(prologue, n, k, cfg.gdn_v_dim, device, rows)
        unfused = unfused_fns[prologue]
        megabytes = 2 * n * k / 1e6
        cublas = graph_time_us([functools.partial(call, unfused, w) for w in weights])
        swapped = graph_time_us([functools.partial(call, unfused, w, matmul=_swapped_linear) for w in weights])
        best_time, best, top = best_tile(lambda tile: [
            functools.partial(call, unfused, w, matmul=functools.partial(cuda_skinny.linear, config=tile))
            for w in weights], call(unfused, weights[0]))
        table[f"{n}:{k}:{cuda_skinny.row_bucket(rows)}"] = list(best) if best_time < MIN_GAIN * cublas else None
        print(f"rows {rows:>2} {prologue:>10} N={n:>6} K={k:>6} ({megabytes:.0f} MB): op + cuBLAS {cublas:.1f} us "
              f"({megabytes / cublas:.2f} TB/s), on W x^T {swapped:.1f} us; op + skinny {best_time:.1f} us "
              f"({megabytes / best_time:.2f} TB/s) {best}; top: {top}", flush=True)
    return table


def probe_row_specialization(cfg: ModelConfig, rows: int, device) -> None:
    """The skinny GEMM at its tuned tiles as the engine runs it (specialised by Triton on the row count: M == 1,
    M % 16 == 0) beside the same kernel not specialised on it (one variant per tile, fewer compiles at startup)."""
    unspecialised = triton.jit(cuda_skinny._skinny_kernel.fn, do_not_specialize=["M"])
    for n, k in sorted({(n, k) for _, n, k in decode_projections(cfg)}):
        tile = cuda_skinny.config_for(n, k, rows)
        if tile is None:
            continue
        copies = max(2, int(COPIES_BYTES // (2 * n * k)))
        weights = [0.02 * torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        times = {}
        for label, kernel in (("as run", cuda_skinny._skinny_kernel), ("not specialised", unspecialised)):
            original, cuda_skinny._skinny_kernel = cuda_skinny._skinny_kernel, kernel
            try:
                times[label] = graph_time_us([functools.partial(cuda_skinny.linear, x, w, tile) for w in weights])
            finally:
                cuda_skinny._skinny_kernel = original
        megabytes = 2 * n * k / 1e6
        print(f"rows {rows:>2} N={n:>6} K={k:>6} {tuple(tile)}: " + ", ".join(
            f"{label} {t:.1f} us ({megabytes / t:.2f} TB/s)" for label, t in times.items()), flush=True)


@triton.jit
def _diagnostic_kernel(x, weight, out, K, stride_w_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, MODE: tl.constexpr):
    """The skinny GEMM's loop (one K split, N and K multiples of the tile) with parts taken out, for
    `diagnose_rows`. MODE 0: stream the weight tiles only (their sum, no dot); 1: the dots, against one x tile
    loaded before the loop (no per-step activation load from L2); 2: as the engine runs it (x tile per step).
    out [BLOCK_N * cdiv(N, BLOCK_N), BLOCK_M] float32 receives the accumulator (its values mean nothing for
    modes 0 and 1)."""
    pid_n = tl.program_id(0)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    ms = tl.arange(0, BLOCK_M)  # [BM]
    w_rows = weight + ns[:, None].to(tl.int64) * stride_w_n  # [BN, 1]
    x_cols = x + ms[None, :] * K  # [1, BM]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    x_once = tl.load(x_cols + tl.arange(0, BLOCK_K)[:, None])  # [BK, BM]
    for i in range(0, K // BLOCK_K):
        ks = i * BLOCK_K + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + ks[None, :])  # [BN, BK]
        if MODE == 0:
            acc += tl.sum(w.to(tl.float32), axis=1)[:, None]
        elif MODE == 1:
            acc = tl.dot(w, x_once, acc)
        else:
            acc = tl.dot(w, tl.load(x_cols + ks[:, None]), acc)
    tl.store(out + ns[:, None] * BLOCK_M + ms[None, :], acc)


DIAGNOSTIC_MODES = ("weights only", "dots, x loaded once", "as run")


def _diagnostic(x, weight, out, tile, mode: int) -> None:
    block_n, block_k, _, num_warps, num_stages = tile[:5]
    _diagnostic_kernel[(triton.cdiv(weight.shape[0], block_n),)](
        x, weight, out, weight.shape[1], weight.stride(0), BLOCK_M=x.shape[0], BLOCK_N=block_n,
        BLOCK_K=block_k, MODE=mode, num_warps=num_warps, num_stages=num_stages)


def diagnose_rows(cfg: ModelConfig, rows: int, device) -> None:
    """Where the skinny GEMM's time goes at `rows` rows (a power of two, 16 or more), at each projection's tuned
    tile (or the sweep's first that divides it): weight streaming alone (a mode that times its own reduction more
    than the stream: ninth session), then the dots with no per-step activation load, then the kernel as run. At
    64 rows re-reading the activation cost the down projection ~7% (50.0 against 46.5 us) and the others nothing
    measurable (ninth session)."""
    for n, k in sorted({(n, k) for _, n, k in decode_projections(cfg)}):
        tuned = cuda_skinny.config_for(n, k, rows)
        # the kernel has no masks: the tuned tile, else the first of the sweep, that divides the shape
        tile = next(t for t in ([tuned] if tuned else []) + SWEEP + [(32, 32, 1, 4, 3)]
                    if n % t[0] == 0 and k % t[1] == 0)
        copies = max(2, int(COPIES_BYTES // (2 * n * k)))
        weights = [0.02 * torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        out = torch.empty(n, rows, device=device, dtype=torch.float32)
        megabytes = 2 * n * k / 1e6
        times = [graph_time_us([functools.partial(_diagnostic, x, w, out, tile, mode) for w in weights])
                 for mode in range(len(DIAGNOSTIC_MODES))]
        print(f"rows {rows:>2} N={n:>6} K={k:>6} {tuple(tile)}: " + ", ".join(
            f"{label} {t:.1f} us ({megabytes / t:.2f} TB/s)" for label, t in zip(DIAGNOSTIC_MODES, times)),
            flush=True)


def probe_prefill_gemms(cfg: ModelConfig, rows: int, device) -> None:
    """Each projection of a prefill chunk of `rows` tokens on cuBLAS and on cuBLASLt (torch's two BLAS
    back-ends), in TFLOP/s, and the time of one layer mix (64 MLPs, 48 GDN in/out, 16 attention in/out on 27B)."""
    gdn_layers, attn_layers = len(cfg.linear_attention_layers), len(cfg.full_attention_layers)
    layers = gdn_layers + attn_layers
    counts = [layers, gdn_layers, attn_layers, layers, gdn_layers, attn_layers]  # decode_projections' order
    layer_counts = {}  # (N, K) -> layers that run it (GDN out-proj and o_proj share a shape)
    for (_, n, k), count in zip(decode_projections(cfg), counts):
        layer_counts[(n, k)] = layer_counts.get((n, k), 0) + count
    original = torch.backends.cuda.preferred_blas_library()
    totals = {}
    try:
        for library in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(library)
            total = 0.0
            for (n, k), count in sorted(layer_counts.items()):
                weights = [0.02 * torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(2)]
                x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
                t = graph_time_us([functools.partial(torch.nn.functional.linear, x, w) for w in weights])
                total += count * t
                print(f"prefill {rows} rows N={n:>6} K={k:>6} {library}: {t:.0f} us "
                      f"({2 * rows * n * k / t / 1e6:.0f} TFLOP/s)", flush=True)
            totals[library] = total
    finally:
        torch.backends.cuda.preferred_blas_library(original)
    print(f"prefill {rows} rows, all projections of the model: " + ", ".join(
        f"{library} {t / 1e3:.1f} ms" for library, t in totals.items()), flush=True)


def _gdn_inputs(cfg: ModelConfig, tokens: int, device):
    """Random bf16 q, k [tokens, HK, K], v [tokens, HV, V], raw gates a, b [tokens, HV]; zero A_log, dt_bias."""
    hk, hv, kd, vd = cfg.gdn_num_k_heads, cfg.gdn_num_v_heads, cfg.gdn_k_dim, cfg.gdn_v_dim
    q, k = (torch.randn(tokens, hk, kd, device=device, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(tokens, hv, vd, device=device, dtype=torch.bfloat16)
    a, b = (torch.randn(tokens, hv, device=device, dtype=torch.bfloat16) for _ in range(2))
    return q, k, v, a, b, torch.zeros(hv, device=device), torch.zeros(hv, device=device)


def _time_tiles(sweep, step, pools) -> list[tuple[float, int, int]]:
    """(microseconds, block_v, num_warps) of step(pool, block_v, num_warps) for each tile of the sweep, fastest
    first; each graph runs the step once on every pool (copies, so that none stays in L2)."""
    results = []
    for bv, warps in sweep:
        try:
            results.append((graph_time_us([functools.partial(step, p, bv, warps) for p in pools]), bv, warps))
        except Exception as exc:  # a tile Triton cannot build
            print(f"  bv {bv} warps {warps}: failed ({type(exc).__name__})", flush=True)
    return sorted(results)


def probe_gdn_decode(cfg: ModelConfig, rows: int, device) -> None:
    hv, kd, vd = cfg.gdn_num_v_heads, cfg.gdn_k_dim, cfg.gdn_v_dim
    pools = [torch.zeros(rows + 1, hv, kd, vd, device=device, dtype=torch.float32) for _ in range(3)]
    slots = torch.arange(1, rows + 1, device=device)
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(cfg, rows, device)
    megabytes = 2 * rows * hv * kd * vd * 4 / 1e6

    def step(pool, bv, warps):
        out = torch.empty_like(v)
        gdn_cuda._launch_recurrent(q, k, v, a, b, out, pool, slots, None, None, bv, A_log, dt_bias,
                                   num_warps=warps)

    default = graph_time_us([functools.partial(gdn_cuda.gdn_decode, q, k, v, a, b, p, slots, A_log=A_log,
                                               dt_bias=dt_bias) for p in pools])
    results = _time_tiles(GDN_SWEEP, step, pools)
    print(f"GDN decode batch {rows} ({megabytes:.0f} MB of state read + written): default {default:.1f} us "
          f"({megabytes / default:.2f} TB/s); " + ", ".join(f"bv {bv} w {w}: {t:.1f} us ({megabytes / t:.2f})"
                                                             for t, bv, w in results), flush=True)


def probe_gdn_layer_tail(cfg: ModelConfig, rows: int, device) -> None:
    """A GDN layer's decode tail at `rows` rows as the engine runs it, in one graph: the recurrent step (state
    pool copies), then the gated norm + out-proj (weight copies); beside the two parts timed alone. In a W6
    decode step the out-proj took 22.3 us where, alone, it takes ~19: if the tail's sum exceeds the parts', the
    state written back from L2 while the out-proj reads is the likely cause (ninth session's question)."""
    from deltaserve.ops.linear import gated_norm_linear
    hv, kd, vd = cfg.gdn_num_v_heads, cfg.gdn_k_dim, cfg.gdn_v_dim
    pools = [torch.zeros(rows + 1, hv, kd, vd, device=device, dtype=torch.float32) for _ in range(3)]
    slots = torch.arange(1, rows + 1, device=device)
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(cfg, rows, device)
    gate = torch.randn_like(v)
    norm_w = torch.ones(vd, device=device, dtype=torch.bfloat16)
    n, width = cfg.hidden_size, hv * vd
    weights = [0.02 * torch.randn(n, width, device=device, dtype=torch.bfloat16) for _ in range(6)]
    o = torch.randn_like(v)  # the out-proj's input when it runs alone

    def recurrent(pool):
        return gdn_cuda.gdn_decode(q, k, v, a, b, pool, slots, A_log=A_log, dt_bias=dt_bias)  # [rows, HV, V]

    def out_proj(x, weight):
        gated_norm_linear(x, gate, norm_w, 1e-6, weight)

    def both(pool, weight):
        out_proj(recurrent(pool), weight)

    alone_gdn = graph_time_us([functools.partial(recurrent, pools[i % 3]) for i in range(6)])
    alone_proj = graph_time_us([functools.partial(out_proj, o, w) for w in weights])
    together = graph_time_us([functools.partial(both, pools[i % 3], w) for i, w in enumerate(weights)])
    print(f"GDN layer tail at {rows} rows: recurrent step {alone_gdn:.1f} us, gated norm + out-proj "
          f"{alone_proj:.1f} us, one after the other {together:.1f} us (parts' sum {alone_gdn + alone_proj:.1f})",
          flush=True)


CHUNK_SWEEP = [(bv, warps) for bv, warps in itertools.product((8, 16, 32, 64), (1, 2, 4))
               if 128 * bv // (32 * warps) <= 128]


def probe_gdn_chunk(cfg: ModelConfig, length: int, device) -> None:
    """The recurrent prefill of one sequence of `length` tokens (a prefix-cache hit's chunk, a single-chunk graph's)
    over (block_v, num_warps): its time is `length` steps of latency."""
    hv, kd, vd = cfg.gdn_num_v_heads, cfg.gdn_k_dim, cfg.gdn_v_dim
    pools = [torch.zeros(2, hv, kd, vd, device=device, dtype=torch.float32) for _ in range(3)]
    slots, has_initial = torch.tensor([1], device=device), torch.tensor([True], device=device)
    cu = torch.tensor([0, length], device=device)
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(cfg, length, device)

    def step(pool, bv, warps):
        out = torch.empty_like(v)
        gdn_cuda._launch_recurrent(q, k, v, a, b, out, pool, slots, has_initial, cu, bv, A_log, dt_bias,
                                   num_warps=warps)

    results = _time_tiles(CHUNK_SWEEP, step, pools)
    default = next(t for t, bv, w in results if (bv, w) == gdn_cuda.CHUNK_TILE)
    print(f"GDN recurrent prefill 1 x {length} tokens: CHUNK_TILE {gdn_cuda.CHUNK_TILE} {default:.1f} us "
          f"({default / length * 1e3:.0f} ns a token); " + ", ".join(f"bv {bv} w {w}: {t:.1f} us"
                                                                    for t, bv, w in results), flush=True)


def _positive_ints(parser, flag: str, text: str) -> list[int]:
    """A comma-separated list of positive counts ("" for none), or a parser error naming the flag and value."""
    try:
        values = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        values = [0]
    if any(value < 1 for value in values):
        parser.error(f"{flag}: expected comma-separated positive whole numbers, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = probe_parser("batch_probe", __doc__, "skinny_configs.json", "skinny_configs.json")
    parser.add_argument("--rows", default="1,16,32,64", help="comma-separated row buckets to probe")
    parser.add_argument("--only", default="", help="probe only this weight shape, N:K (rows 16-64)")
    parser.add_argument("--gdn-batches", default="64,16", help="comma-separated batch sizes for the GDN sweep")
    parser.add_argument("--gdn-chunks", default="16,128",
                        help="comma-separated chunk lengths for the GDN recurrent-prefill sweep")
    parser.add_argument("--compare-specialization", default="",
                        help="comma-separated row counts: time the tuned skinny tiles with and without Triton's "
                             "specialisation on the row count")
    parser.add_argument("--gdn-tail", default="",
                        help="comma-separated batch sizes: a GDN layer's recurrent step and out-proj together and "
                             "apart")
    parser.add_argument("--prefill-rows", default="",
                        help="comma-separated chunk sizes: the prefill projections on cuBLAS and cuBLASLt")
    parser.add_argument("--small", action="store_true",
                        help="also the small bf16 products of the quantized checkpoints (GDN's [b|a], the MoE "
                             "router and shared gate) of every shipped config, at one row")
    parser.add_argument("--diagnose", default="",
                        help="comma-separated row counts: split the skinny GEMM's time into weight streaming, dots "
                             "and activation loads")
    args = parser.parse_args(argv)
    counts = {flag: _positive_ints(parser, flag, getattr(args, flag[2:].replace("-", "_")))
              for flag in ("--rows", "--gdn-batches", "--gdn-chunks", "--compare-specialization", "--diagnose",
                           "--gdn-tail", "--prefill-rows")}
    if any(rows > cuda_skinny.SKINNY_MAX_ROWS for rows in counts["--rows"]):
        parser.error(f"--rows: the skinny GEMM serves 1 to {cuda_skinny.SKINNY_MAX_ROWS} rows, got {args.rows!r}")
    for rows in counts["--diagnose"]:
        if rows < 16 or rows & (rows - 1):
            parser.error(f"--diagnose: row counts are powers of two from 16 (one dot tile), got {rows}")
    cfg = ModelConfig.from_pretrained(args.model)
    shapes = {f"{n}:{k}" for _, n, k in batch_projections(cfg)}
    if args.only and args.only not in shapes:
        parser.error(f"--only: {args.only!r} is not a weight shape of this model ({', '.join(sorted(shapes))})")
    device = torch.device("cuda")
    for rows in counts["--rows"]:  # --rows "" probes the GDN kernels alone
        table = probe_one_row(cfg, device) if rows == 1 else probe_rows(cfg, rows, device, args.only)
        write_table(args.out, table)  # after each bucket: a run cut short keeps what it measured
        print(json.dumps(table), flush=True)
    if args.small:
        table = probe_small_products(device)
        write_table(args.out, table)
        print(json.dumps(table), flush=True)
    probes = (("--gdn-batches", probe_gdn_decode), ("--gdn-chunks", probe_gdn_chunk),
              ("--compare-specialization", probe_row_specialization), ("--diagnose", diagnose_rows),
              ("--gdn-tail", probe_gdn_layer_tail), ("--prefill-rows", probe_prefill_gemms))
    for flag, probe in probes:
        for count in counts[flag]:
            probe(cfg, count, device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
