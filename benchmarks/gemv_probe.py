"""Small-batch projections: the fused Triton GEMV (ops/linear) beside the unfused prologue op + cuBLAS.

    python -m benchmarks.gemv_probe [CONFIG_DIR] [--out configs.json]

For every projection of a decode step of the model in CONFIG_DIR (default: the published Qwen3.5-27B shape),
at batch 1, times the unfused path (the prologue kernel, then F.linear) and the fused kernel over a sweep of
tiles, inside a CUDA graph as decode runs them, each call on another copy of the weight so that none is
served from L2; each tile's output is checked against the unfused path's first (benchmarks/timing.check_output:
a broken tile is reported and never chosen). Prints each with its bandwidth and writes the table that
ops/linear/cuda.py reads: the best tile per shape, or null where the unfused path won.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from pathlib import Path

import torch

from benchmarks.timing import BrokenOutput, checked_time_us, graph_time_us
from deltaserve.config import ModelConfig
from deltaserve.model_configs import CONFIGS_DIR
from deltaserve.ops.linear import cuda as linear_cuda
from deltaserve.ops.linear import reference

# (BLOCK_N, BLOCK_K, num_warps, num_stages) tried for every shape: 16 to 64 weight elements per thread
# (the gated norm's BLOCK_K holds whole groups). num_stages does not change this loop (no dot to pipeline).
SWEEP = [(bn, bk, warps, 1) for bn, bk, warps in itertools.product((4, 8, 16, 32), (256, 512, 1024, 2048), (4, 8))
         if 16 <= bn * bk // (32 * warps) <= 64]
GATED_SWEEP = [(bn, bk, warps, 1) for bn, bk, warps in itertools.product((4, 8, 16, 32), (128, 256, 512, 1024), (4, 8))
               if 16 <= bn * bk // (32 * warps) <= 64]
COPIES_BYTES = 400e6  # cycle through this many bytes of weight copies, far beyond the 50 MB L2


def decode_projections(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """(prologue, N, K) of each distinct projection of a Qwen3.5 decode step: the dense MLP's where there is one;
    a MoE model's joined router rows (layers.mlp.SparseMoE.fuse: the router and the shared gate, padded to
    JOIN_ROW_MULTIPLE) as "rms_norm_and", the norm's launch writing its normed row too (rms_norm_and_linear),
    which the table keeps under the "rms_norm" prologue."""
    from deltaserve.layers.mlp import join_padded

    H, inter = cfg.hidden_size, cfg.intermediate_size
    gdn_in = cfg.conv_dim + cfg.gdn_value_dim + 2 * cfg.gdn_num_v_heads
    qkv = 2 * cfg.num_heads * cfg.head_dim + 2 * cfg.num_kv_heads * cfg.head_dim
    shapes = [("rms_norm", gdn_in, H), ("rms_norm", qkv, H), ("gated_norm", H, cfg.gdn_value_dim),
              ("none", H, cfg.num_heads * cfg.head_dim)]
    if inter:
        shapes += [("rms_norm", 2 * inter, H), ("silu_mul", H, inter)]
    if cfg.num_experts:
        shapes.append(("rms_norm_and", join_padded(cfg.num_experts + 1), H))
    return shapes


def batch_projections(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """decode_projections' shapes, and those a MoE model's bf16 shared expert runs above one token, where it is not
    a slot of the fused experts (ops.moe.SHARED_SLOT_MAX_TOKENS): the whole joined weight [router | shared gate | 0 |
    shared gate/up | 0] after the norm (SparseMoE.fuse; the product of "rms_norm_and" is the plain one from two
    rows on) and the shared down-projection after SiLU-and-mul."""
    from deltaserve.layers.mlp import join_padded

    shapes = decode_projections(cfg)
    shared = cfg.shared_expert_intermediate_size if cfg.num_experts else 0
    if shared:
        shapes += [("rms_norm", join_padded(cfg.num_experts + 1) + join_padded(2 * shared), cfg.hidden_size),
                   ("silu_mul", cfg.hidden_size, shared)]
    return shapes


def inputs(prologue: str, n: int, k: int, head_dim: int, device, rows: int = 1):
    """Weight copies and the call arguments of one shape at `rows` rows (batch 1 by default)."""
    dtype = torch.bfloat16
    copies = max(2, int(COPIES_BYTES // (2 * n * k)))
    weights = [0.02 * torch.randn(n, k, device=device, dtype=dtype) for _ in range(copies)]
    if prologue in ("rms_norm", "rms_norm_and"):
        x, res, w = (torch.randn(rows, k, device=device, dtype=dtype) for _ in range(3))
        return weights, (lambda fn, weight, **kw: fn(x, w, 1e-6, weight, res, **kw))
    if prologue == "silu_mul":
        x = torch.randn(rows, 2 * k, device=device, dtype=dtype)
        return weights, (lambda fn, weight, **kw: fn(x, weight, **kw))
    if prologue == "gated_norm":
        x, z = (torch.randn(rows, k // head_dim, head_dim, device=device, dtype=dtype) for _ in range(2))
        w = torch.ones(head_dim, device=device, dtype=dtype)
        return weights, (lambda fn, weight, **kw: fn(x, z, w, 1e-6, weight, **kw))
    x = torch.randn(rows, k, device=device, dtype=dtype)
    return weights, (lambda fn, weight, **kw: fn(x, weight, **kw))


def probe_parser(module: str, doc: str, default_out: str, package_table: str) -> argparse.ArgumentParser:
    """The arguments every probe takes: the model's config directory and the table to merge results into."""
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{module}", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=str(CONFIGS_DIR / "qwen3.5-27b"),
                        help="config.json directory (default: the shipped Qwen3.5-27B config)")
    parser.add_argument("--out", default=default_out,
                        help=f"merge the tuned shapes into this table (deltaserve/ops/linear/{package_table} to "
                             "keep them)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = probe_parser("gemv_probe", __doc__, "gemv_configs.json", "configs.json")
    parser.add_argument("--only", help="probe only this prologue (rms_norm, rms_norm_and, silu_mul, gated_norm, none)")
    args = parser.parse_args(argv)
    cfg = ModelConfig.from_pretrained(args.model)
    device = torch.device("cuda")
    fused_fns = {"rms_norm": linear_cuda.rms_norm_linear, "rms_norm_and": linear_cuda.rms_norm_and_linear,
                 "silu_mul": linear_cuda.silu_mul_linear, "gated_norm": linear_cuda.gated_norm_linear,
                 "none": linear_cuda.linear}
    unfused_fns = {"rms_norm": reference.rms_norm_linear, "rms_norm_and": reference.rms_norm_and_linear,
                   "silu_mul": reference.silu_mul_linear, "gated_norm": reference.gated_norm_linear,
                   "none": torch.nn.functional.linear}
    table = {}
    for prologue, n, k in decode_projections(cfg):
        if args.only and prologue != args.only:
            continue
        weights, call = inputs(prologue, n, k, cfg.gdn_v_dim, device)
        megabytes = 2 * n * k / 1e6
        unfused_fn, fused_fn = unfused_fns[prologue], fused_fns[prologue]
        unfused = graph_time_us([functools.partial(call, unfused_fn, w) for w in weights])
        expected = call(unfused_fn, weights[0])
        results = []
        for config in GATED_SWEEP if prologue == "gated_norm" else SWEEP:
            try:
                t = checked_time_us([functools.partial(call, fused_fn, w, config=config) for w in weights], expected)
            except BrokenOutput as exc:
                print(f"  {config}: WRONG ({exc})", flush=True)
                continue
            except Exception as exc:  # a tile Triton cannot build (registers, shared memory): skip it
                print(f"  {config}: failed ({type(exc).__name__})", flush=True)
                continue
            results.append((t, config))
        if not results:
            raise RuntimeError(f"{prologue} N={n} K={k}: no tile ran correctly")
        best_time, best = min(results)
        table[f"{prologue.removesuffix('_and')}:{n}:{k}"] = list(best) if best_time < 0.99 * unfused else None
        print(f"{prologue:>10} N={n:>6} K={k:>6} ({megabytes:.0f} MB): unfused {unfused:.1f} us "
              f"({megabytes / unfused:.2f} TB/s); fused best {best_time:.1f} us ({megabytes / best_time:.2f} TB/s) "
              f"{best}; top 4: " + ", ".join(f"{t:.1f} {c}" for t, c in sorted(results)[:4]), flush=True)
    write_table(args.out, table)
    print(json.dumps(table))
    return 0


def write_table(path: str, measured: dict) -> None:
    """Merge `measured` into the table at `path` (other models' shapes are kept), one entry a line."""
    table = json.loads(Path(path).read_text()) if Path(path).exists() else {}
    table.update(measured)
    Path(path).write_text("{\n" + ",\n".join(f" {json.dumps(key)}: {json.dumps(value)}"
                                              for key, value in sorted(table.items())) + "\n}\n")


if __name__ == "__main__":
    raise SystemExit(main())
