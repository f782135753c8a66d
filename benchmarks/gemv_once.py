"""One quantized product of one Qwen3.5-27B projection at one config, run a few times: something small for Nsight
Compute to profile (the tuned table's kernel unless --config names another).

    ncu --section WarpStateStats --section SpeedOfLight -k regex:int4 \\
        python -m benchmarks.gemv_once --format int4 --projection gate_up --config '{"kind": "gemv", ...}'
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.quant_gemm_probe import make_weight, projections
from deltaserve.config import ModelConfig
from deltaserve.model_configs import shipped_config
from deltaserve.ops import quant_gemm
from deltaserve.ops.quant_gemm import cuda_gemv


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--format", default="int4", choices=["fp8", "int4", "nvfp4"])
    parser.add_argument("--projection", default="gate_up", help="a name of quant_gemm_probe.projections")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--config", default=None, help="a cuda_gemv table entry as JSON (default: the table's)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    shapes = {name: (n, k) for name, n, k in projections(ModelConfig.from_pretrained(
        str(shipped_config("Qwen/Qwen3.5-27B"))))}
    n, k = shapes[args.projection]
    w = make_weight(args.format, n, k)
    x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16)
    product = {"fp8": quant_gemm.fp8_block_linear, "int4": quant_gemm.int4_linear, "nvfp4": quant_gemm.nvfp4_linear}
    for _ in range(args.repeat):
        y = cuda_gemv.gemv(x, w, json.loads(args.config)) if args.config else product[args.format](x, w)
    torch.cuda.synchronize()
    print(f"{args.format} {args.projection} N={n} K={k} rows={args.rows}: |y| max {y.abs().max().item():.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
