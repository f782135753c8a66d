"""The quantized GEMMs (deltaserve/ops/quant_gemm) on the GPU at a model's projection shapes: every kernel and tile
candidate side by side, printed against the physical limits, and the table of the fastest per shape.

    python benchmarks/quant_gemm_probe.py [CONFIG_DIR] [--out quant_gemm_configs.json] [--formats fp8,int4,nvfp4]
                                          [--rows 1,8,16,32,64,512,8192]

CONFIG_DIR defaults to the Qwen3.5-27B config shipped in deltaserve/model_configs. Decode row counts
(<= 64) are timed inside CUDA graphs over copies of the weight (400 MB of them, so that no call finds its weight in
the 50 MB L2), and reported as the bytes of weights and scales read over the time (TB/s, beside the ~4.2 TB/s copy
rate of an H200); prefill row counts by triton.testing.do_bench (the L2 flushed before each call) as TFLOP/s,
beside ~1,580 dense FP8 and ~790 bf16. Candidates run in a shuffled order per shape; each one's output is checked
against the plain-torch reference first (a broken tile is reported and never chosen). bf16 cuBLAS on the same
shape is printed for scale. The table (keys "format:N:K:rows-bucket", see ops/quant_gemm/configs.py) is merged into
--out; copy it to deltaserve/ops/quant_gemm/configs.json to ship it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import BrokenOutput, check_output, graph_time_us  # noqa: E402
from deltaserve.config import ModelConfig  # noqa: E402
from deltaserve.model_configs import shipped_config  # noqa: E402
from deltaserve.ops.quant_gemm import configs, cuda_fp8, cuda_gemv, cuda_weight_only  # noqa: E402
from deltaserve.ops.quant_gemm import reference as ref  # noqa: E402

COPY_TBS, BF16_TFLOPS = 4.2, 790.0  # an H200's (FP8: twice bf16); the probe prints this GPU's measured ones
COPIES_BYTES = 400e6
ROWS = (1, 8, 16, 32, 64, 512, 8192)
# GEMV tiles (cuda_gemv): rows, columns per K step, warps, stages. FP8 (one row) holds a block_n x block_k float32
# product tile (~64 registers a thread at 8 x 1024 and 4 warps), the 4-bit formats one float per word and row of x;
# int4's one-row kernel block_n * block_k / (8 * 32 * warps) words a thread (its registers, so the programs an SM
# holds, follow), K split ("auto": ~2 programs per SM, configs.gemv_split_k; "auto*4" four times that). At one
# row int4's and FP8's weight loads stream through shared memory stages - 1 steps ahead (stages 1: loaded where
# used; NVFP4's kernel measured no gain from it); int4's dp4a kernel takes x as 16-bit fixed point
# (_int4_dp4a_row_kernel). The dp4a kernels (int4's and NVFP4's) take block_k >= 1024 x warps, where a thread
# holds 4 words of every row and x's parts serve them all: their loops compile to 1.2-1.4 (int4) and 2.6 (NVFP4)
# instructions a weight with no layout conversion through shared memory (`sass_probe --kernel
# int4-dp4a|nvfp4-dp4a`; narrower steps: 1.5-1.8 and 2.9-3.5 with 12-18 barriers a step); 32 rows take all 255
# registers.
GEMV_SWEEP = {("fp8", 1): [dict(block_n=8, block_k=1024, warps=4, stages=1),
                           dict(block_n=4, block_k=1024, warps=4, stages=1),
                           dict(block_n=8, block_k=512, warps=2, stages=1),
                           dict(block_n=16, block_k=512, warps=4, stages=1),
                           dict(block_n=16, block_k=1024, warps=8, stages=1),
                           # the weight tiles streamed through shared memory 1-2 steps ahead
                           dict(block_n=8, block_k=1024, warps=4, stages=2),
                           dict(block_n=8, block_k=512, warps=4, stages=3),
                           dict(block_n=4, block_k=1024, warps=4, stages=3)],
              ("int4", 1): [dict(block_n=bn, block_k=bk, split_k="auto", warps=w, stages=stages)
                            for bn, bk, w, stages in ((32, 128, 2, 4), (128, 128, 8, 3), (32, 256, 2, 4),
                                                      (16, 512, 2, 4), (32, 512, 4, 3))]
                           + [dict(block_n=bn, block_k=bk, split_k=split, warps=w, stages=stages, dp4a=1)
                              for bn, bk, w, stages in ((16, 512, 2, 3), (4, 1024, 1, 1), (8, 1024, 1, 1),
                                                        (16, 1024, 1, 1), (4, 1024, 1, 2), (8, 1024, 1, 2),
                                                        (8, 2048, 2, 1), (16, 2048, 2, 1))
                              for split in ("auto", "auto*4")],
              ("nvfp4", 1): [dict(block_n=bn, block_k=bk, warps=w, stages=1)
                             for bn, bk, w in ((16, 1024, 4), (32, 1024, 4), (16, 2048, 4), (8, 4096, 4),
                                               (8, 2048, 4), (32, 1024, 8))]
                            + [dict(block_n=bn, block_k=bk, split_k=split, warps=w, stages=stages, dp4a=1)
                               for bn, bk, w, stages in ((8, 1024, 2, 1), (4, 1024, 1, 1), (8, 1024, 1, 1),
                                                         (16, 1024, 1, 1), (8, 1024, 1, 2), (8, 2048, 2, 1))
                               for split in ("auto", "auto*4")],
              ("weight_only", 8): [dict(block_n=8, block_k=512, warps=4, stages=1),
                                   dict(block_n=16, block_k=256, warps=4, stages=1),
                                   dict(block_n=4, block_k=1024, warps=4, stages=1)]}
# Skinny tiles: column block, K splits ("auto": ~2 programs per SM, configs.auto_split_k), warps, stages. FP8
# quantizes the activation by its own kernel (quant_x 0; in every program it measured 4-8x slower).
# Fixed splits too: "auto" leaves K whole once the column blocks alone fill the SMs (35B-A3B's 2,048-wide K), where
# a split may still even out the waves.
DECODE_SWEEP = {"fp8": [dict(block_n=64, split_k="auto", warps=4, stages=4, quant_x=0),
                        dict(block_n=128, split_k="auto", warps=8, stages=4, quant_x=0),
                        dict(block_n=32, split_k="auto", warps=4, stages=4, quant_x=0),
                        dict(block_n=64, split_k=2, warps=4, stages=4, quant_x=0),
                        dict(block_n=64, split_k=4, warps=4, stages=4, quant_x=0),
                        # tiles copied by TMA; wider column blocks re-read the activation from L2 less often
                        dict(block_n=64, split_k="auto", warps=4, stages=4, quant_x=0, tma=1),
                        dict(block_n=128, split_k="auto", warps=8, stages=4, quant_x=0, tma=1),
                        dict(block_n=128, split_k="auto", warps=8, stages=3, quant_x=0, tma=1),
                        dict(block_n=128, split_k="auto", warps=4, stages=3, quant_x=0, tma=1),
                        dict(block_n=256, split_k="auto", warps=8, stages=3, quant_x=0, tma=1),
                        dict(block_n=32, split_k="auto", warps=4, stages=6, quant_x=0, tma=1),
                        dict(block_n=64, split_k=2, warps=4, stages=4, quant_x=0, tma=1)],
                "weight_only": [dict(block_n=64, split_k="auto", warps=4, stages=4),
                                dict(block_n=64, split_k=1, warps=4, stages=6)]}
# Prefill: the Triton GEMMs' best tile of the first run beside torch's F.scaled_mm (FP8) / dequantize + cuBLAS.
PREFILL_SWEEP = {
    "fp8": [dict(block_m=128, block_n=128, block_k=128, group_m=8, warps=8, stages=3)],
    "weight_only": [dict(block_m=128, block_n=128, block_k=64, group_m=8, warps=8, stages=3)],
}


def projections(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """(name, N, K) of the quantized dense projections of a Qwen3.5 layer, fused as the bf16 path fuses them (a MoE
    model has no dense MLP: its gate_up and down are left out)."""
    h, attn = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    shapes = [("gate_up", 2 * cfg.intermediate_size, h), ("down", h, cfg.intermediate_size),
              ("gdn_in_qkvz", cfg.conv_dim + cfg.gdn_value_dim, h), ("gdn_out", h, cfg.gdn_value_dim),
              ("attn_qkv", 2 * attn + 2 * cfg.num_kv_heads * cfg.head_dim, h), ("attn_o", h, attn)]
    return [(name, n, k) for name, n, k in shapes if n and k]


def make_weight(fmt: str, n: int, k: int):
    """A random prepared weight of `fmt` (int4: group 128, asymmetric; NVFP4: one scale_2)."""
    dev = "cuda"
    if fmt == "fp8":
        return ref.prepare_fp8_block(*ref.fp8_block_quantize(torch.randn(n, k, device=dev) * 0.02), (128, 128))
    if fmt == "int4":
        packed = torch.randint(-2**31, 2**31 - 1, (n, k // 8), device=dev, dtype=torch.int32)
        zero = torch.randint(-2**31, 2**31 - 1, (-(-n // 8), k // 128), device=dev, dtype=torch.int32)
        scale = (torch.rand(n, k // 128, device=dev) * 2e-3 + 1e-4).to(torch.bfloat16)
        return ref.prepare_int4(packed, scale, zero, 128, None, (n, k))
    packed = torch.randint(0, 256, (n, k // 2), device=dev, dtype=torch.uint8)
    return ref.prepare_nvfp4(packed, (torch.rand(n, k // 16, device=dev) * 400 + 1).to(torch.float8_e4m3fn), 1e-5)


def copies_of(w) -> list:
    """The weight and clones of its tensors, COPIES_BYTES in all (at least two)."""
    fields = [f.name for f in dataclasses.fields(w) if isinstance(getattr(w, f.name), torch.Tensor)]
    count = max(2, int(COPIES_BYTES // w.nbytes))
    return [w] + [dataclasses.replace(w, **{f: getattr(w, f).clone() for f in fields}) for _ in range(count - 1)]


def bench_us(fn) -> float:
    return 1e3 * triton.testing.do_bench(fn, warmup=10, rep=60)


def reference(fmt, x, w):
    return {"fp8": ref.fp8_block_linear, "int4": ref.int4_linear, "nvfp4": ref.nvfp4_linear}[fmt](x, w).float()


def tinygemm(w):
    """(x, int4 weight -> y) by torch's int4 decode kernel (aten._weight_int4pack_mm) on a copy of the weight in its
    layout (made at the first call per weight), or None where torch lacks it. Its dequantization is (q - 8) * scale
    + zero_f per group, so zero_f = (8 - z) * scale, rounded to bf16 (relative 2^-9: not our semantics exactly).
    For timing beside ours, not dispatched."""
    aten = torch.ops.aten
    has_ops = hasattr(aten, "_weight_int4pack_mm") and hasattr(aten, "_convert_weight_to_int4pack")
    if not has_ops or w.perm is not None:
        return None
    converted = {}

    def convert(w):
        q = ref.unpack_int4(w.packed, w.shape[1])  # [N, K] uint8
        packed = aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).contiguous(), 8)  # even k high
        scale = w.scale.float()  # [N, G]
        zero = 8.0 if w.zero is None else w.zero.float()
        scale_zero = torch.stack((scale, (8.0 - zero) * scale), dim=2).transpose(0, 1).contiguous()
        return packed, scale_zero.to(torch.bfloat16)  # [K/g, N, 2]

    def run(x, w):
        if id(w) not in converted:
            converted[id(w)] = convert(w)
        packed, scale_zero = converted[id(w)]
        return aten._weight_int4pack_mm(x, packed, w.group_size, scale_zero)

    return run


def candidates(fmt: str, n: int, k: int, rows: int, w) -> list[tuple[dict, object]]:
    """(table entry, function x, w -> y) of every way to run the product at `rows` rows; entries of kind
    "tinygemm" are timed only."""
    out = []
    weight_only = "fp8" if fmt == "fp8" else "weight_only"
    bucket = configs.row_bucket(rows)
    for tile in GEMV_SWEEP.get((fmt, bucket), GEMV_SWEEP.get((weight_only, bucket), [])):
        if str(tile.get("split_k")).startswith("auto"):  # "auto*f": f times as many splits
            factor = int(tile["split_k"].partition("*")[2] or 1)
            tile = dict(tile, split_k=min(16, factor * configs.gemv_split_k(n, k, tile["block_n"])))
        entry = dict(kind="gemv", **tile)
        if not cuda_gemv.supports(w, entry, rows):
            continue
        if rows == 1 and "split_k" in entry:  # the split the kernel runs (at most its K steps): no tile twice
            entry["split_k"] = cuda_gemv._row_steps(k, getattr(w, "group_size", cuda_gemv.NVFP4_GROUP), entry)[1]
        if all(entry != seen for seen, _ in out):
            out.append((entry, lambda x, w, e=entry: cuda_gemv.gemv(x, w, e)))
    if rows <= configs.SKINNY_MAX_ROWS:
        kernel = cuda_fp8.skinny if fmt == "fp8" else cuda_weight_only.skinny
        for tile in DECODE_SWEEP[weight_only]:
            split = configs.auto_split_k(n, k, tile["block_n"]) if tile["split_k"] == "auto" else tile["split_k"]
            entry = dict(kind="skinny", block_k=128, **dict(tile, split_k=split))
            if all(entry != seen for seen, _ in out):
                out.append((entry, lambda x, w, e=entry: kernel(x, w, e)))
        if fmt == "int4" and (fn := tinygemm(w)) is not None:
            out.append(({"kind": "tinygemm"}, fn))
    else:
        gemm = cuda_fp8.gemm if fmt == "fp8" else cuda_weight_only.gemm
        for tile in PREFILL_SWEEP[weight_only]:
            entry = dict(kind="gemm", **tile)
            out.append((entry, lambda x, w, e=entry: gemm(x, w, e)))
        if fmt != "fp8":
            out.append(({"kind": "cublas"}, cuda_weight_only.cublas))
    if fmt == "fp8" and rows >= 16 and hasattr(torch.nn.functional, "scaled_mm"):
        out.append(({"kind": "torch"}, cuda_fp8.torch_scaled_mm))
    return out


def probe_shape(fmt, name, n, k, rows, rng, copy_tbs=COPY_TBS, bf16_tflops=BF16_TFLOPS) -> tuple[str, dict | None]:
    """Time every candidate at one shape and row count; print them; return (table key, the fastest entry)."""
    w = make_weight(fmt, n, k)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    want = reference(fmt, x, w)
    decode = rows <= configs.SKINNY_MAX_ROWS
    weights = copies_of(w) if decode else [w]
    results, order = [], candidates(fmt, n, k, rows, w)
    rng.shuffle(order)
    for entry, fn in order:
        label = entry["kind"] if len(entry) == 1 else json.dumps(entry)
        label += " (torch's int4 kernel, timed only)" if entry["kind"] == "tinygemm" else ""
        try:
            check_output(fn(x, w).float(), want)
            t = graph_time_us([lambda fn=fn, c=c: fn(x, c) for c in weights]) if decode else bench_us(lambda: fn(x, w))
        except BrokenOutput as exc:
            print(f"    {label}: WRONG ({exc})", flush=True)
            continue
        except Exception as exc:  # a tile Triton cannot build (shared memory, registers), torch without the op
            print(f"    {label}: failed ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})", flush=True)
            continue
        results.append((t, label, entry))
    dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    bf16 = bench_us(lambda dense=dense: torch.nn.functional.linear(x, dense))
    del dense
    head = f"{fmt:>5} {name:>12} N={n:>6} K={k:>6} rows={rows:>5}"
    if not results:
        print(f"{head}: no candidate ran", flush=True)
        return "", None
    results.sort(key=lambda r: r[0])
    chosen = next((r for r in results if r[2]["kind"] != "tinygemm"), None)
    flops = 2.0 * rows * n * k
    for t, label, _ in results:
        speed = (f"{w.nbytes / t / 1e6:.2f} TB/s of {copy_tbs:.2f}" if decode else
                 f"{flops / t / 1e6:.0f} TFLOP/s of {bf16_tflops * (2 if fmt == 'fp8' else 1):.0f}")
        print(f"{head}: {t:9.1f} us  {speed}  {label}", flush=True)
    bf16_speed = (f"{2 * n * k / bf16 / 1e6:.2f} TB/s" if decode else f"{flops / bf16 / 1e6:.0f} TFLOP/s")
    print(f"{head}: bf16 cuBLAS {bf16:.1f} us ({bf16_speed}, {2 * n * k / 1e6:.0f} MB of weights; "
          f"{fmt} {w.nbytes / 1e6:.0f} MB)", flush=True)
    return f"{fmt}:{n}:{k}:{configs.row_bucket(rows)}", chosen[2] if chosen else None


def write_table(path: str, measured: dict) -> None:
    """Merge `measured` into the table at `path` (other shapes kept), one entry a line."""
    table = json.loads(Path(path).read_text()) if Path(path).exists() else {}
    table.update(measured)
    Path(path).write_text("{\n" + ",\n".join(f" {json.dumps(key)}: {json.dumps(value)}"
                                              for key, value in sorted(table.items())) + "\n}\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=str(shipped_config("Qwen/Qwen3.5-27B")),
                        help="config.json directory (default: the Qwen3.5-27B config shipped in the package)")
    parser.add_argument("--out", default="quant_gemm_configs.json", help="merge the fastest entries into this table")
    parser.add_argument("--formats", default="fp8,int4,nvfp4")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--only", default="", help="comma-separated projection names (default: all)")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="start no new shape after this many seconds (what was measured is kept)")
    args = parser.parse_args(argv)
    cfg = ModelConfig.from_pretrained(args.model)
    rng = random.Random(0)
    from benchmarks.offline import measure_device

    bandwidth, flops = measure_device()  # the limits each time is set beside: copy TB/s, bf16 (FP8: twice) TFLOP/s
    copy_tbs, bf16_tflops = bandwidth / 1e12, flops / 1e12
    print(f"device {torch.cuda.get_device_name()} (copy {copy_tbs:.2f} TB/s, bf16 matmul {bf16_tflops:.0f} TFLOP/s), "
          f"torch {torch.__version__}, triton {triton.__version__}; "
          f"F.scaled_mm {'present' if hasattr(torch.nn.functional, 'scaled_mm') else 'absent'}", flush=True)
    seen, entries, start = set(), 0, time.monotonic()
    for name, n, k in projections(cfg):  # every format's shape in turn: a budget cut drops the last shapes
        for fmt in args.formats.split(","):
            if (args.only and name not in args.only.split(",")) or (fmt, n, k) in seen:
                continue
            if time.monotonic() - start > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent: {fmt} {name} ({n} x {k}) not probed", flush=True)
                continue
            seen.add((fmt, n, k))
            table = {}
            for rows in sorted(int(r) for r in args.rows.split(",")):
                key, best = probe_shape(fmt, name, n, k, rows, rng, copy_tbs, bf16_tflops)
                if best is not None:  # a bucket takes its largest row count (its decode graph's size)
                    configs.check_entry("probe", key, best)
                    table[key] = best
            write_table(args.out, table)  # after every shape: a run cut short keeps what it measured
            entries += len(table)
            torch.cuda.empty_cache()
    print(f"wrote {entries} entries to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
