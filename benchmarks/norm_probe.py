"""The RMS norms of a prompt step at each launch width: microseconds and the share of copy bandwidth.

    python -m benchmarks.norm_probe [--rows 64,1024,8192] [--dim 5120] [--warps 4,8,16,32] [--chunks 512,1024,2048]

Times ops/norm/cuda.py's `rms_norm` (the residual added, the output written quantized for an FP8 product of
128-column blocks, with and without the unquantized row kept beside it, and plain bf16) and `gated_rms_norm`
(GDN's 48 heads of 128, FP8 out) on `rows` tokens, each launch in a CUDA graph, at every warp count (the FP8 norms
also at every PROMPT_OUT_CHUNK, the columns written at a time after the sum; the gated norm at several rows a
program), against the bytes it must move at the measured copy rate. Every variant's output is checked against the
shipped launch's: its FP8 codes within one e4m3 step (another warp count lays the row out otherwise, so its sum of
squares, and with it a code now and then, may round otherwise), the rest within benchmarks/timing's share.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.offline import measure_device
from benchmarks.timing import BrokenOutput, check_output, graph_time_us
from deltaserve.ops.norm import cuda as norm


def _outputs(result) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """(an activation's FP8 codes as float or None, the other tensors a norm call wrote: scales, kept row, a plain
    tensor, a residual)."""
    codes, out = None, []
    for item in result if isinstance(result, tuple) else (result,):
        if isinstance(item, torch.Tensor):
            out.append(item.float())
        else:  # an Fp8Activation
            codes = item.xq.float()
            out += [item.sx] + ([item.unquantized.float()] if item.unquantized is not None else [])
    return codes, out


def _check(got, expected) -> None:
    """Raise BrokenOutput unless the codes lie within one e4m3 step (1/8 of a value, at least the smallest
    subnormal, 2^-9) of the expected ones and the other tensors pass timing.check_output."""
    (codes, rest), (want_codes, want_rest) = got, expected
    check_output(rest, want_rest)
    if codes is not None and not bool(((codes - want_codes).abs() <= want_codes.abs() / 8 + 2 ** -9).all()):
        raise BrokenOutput("FP8 codes more than one e4m3 step from the shipped launch's")


def _time(call, expected) -> float:
    """Microseconds a call (8 in one graph), after its outputs are checked against `expected`."""
    _check(_outputs(call()), expected)
    return graph_time_us([call] * 8)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="64,1024,8192")
    parser.add_argument("--dim", type=int, default=5120)
    parser.add_argument("--warps", default="4,8,16,32")
    parser.add_argument("--chunks", default="512,1024,2048", help="PROMPT_OUT_CHUNK values (multiples of 128)")
    args = parser.parse_args(argv)
    chunks = [int(c) for c in args.chunks.split(",")]
    copy_bps, _ = measure_device()
    print(f"device: {torch.cuda.get_device_name()}  copy {copy_bps / 1e12:.2f} TB/s")
    warps = [int(w) for w in args.warps.split(",")]
    shipped_warps, shipped_tile, shipped_chunk = norm._warps, norm._GATED_TILE, norm.PROMPT_OUT_CHUNK
    d = args.dim
    w = torch.randn(d, device="cuda", dtype=torch.bfloat16) * 0.1
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16)
        res = torch.randn_like(x)
        cases = {  # name: (call, bytes moved)
            "fp8 + residual": (lambda: norm.rms_norm(x, w, 1e-6, res, quant_block=128), rows * d * (2 + 2 + 2 + 1)),
            "fp8 + residual + kept": (lambda: norm.rms_norm(x, w, 1e-6, res, quant_block=128, keep_unquantized=True),
                                      rows * d * (2 + 2 + 2 + 1 + 2)),
            "bf16 + residual": (lambda: norm.rms_norm(x, w, 1e-6, res), rows * d * 8),
        }
        for name, (call, nbytes) in cases.items():
            norm._warps = shipped_warps
            expected = _outputs(call())
            line = []
            for chunk in chunks if name.startswith("fp8") else (shipped_chunk,):
                for n in warps:
                    norm._warps, norm.PROMPT_OUT_CHUNK = (lambda block, n=n: n), chunk
                    us = _time(call, expected)
                    line.append(f"{f'chunk {chunk} ' if name.startswith('fp8') else ''}{n} warps {us:8.1f} us "
                                f"({nbytes / us / 1e-6 / copy_bps:4.0%})")
            norm._warps, norm.PROMPT_OUT_CHUNK = shipped_warps, shipped_chunk
            us = _time(call, expected)
            print(f"rms_norm {name:22s} rows {rows:5d}: shipped {us:8.1f} us ({nbytes / us / 1e-6 / copy_bps:4.0%}) | "
                  + " | ".join(line))
        heads, hd = 48, 128
        xg = torch.randn(rows, heads, hd, device="cuda", dtype=torch.bfloat16)
        g = torch.randn_like(xg)
        wg = torch.randn(hd, device="cuda", dtype=torch.bfloat16) * 0.1
        nbytes = rows * heads * hd * (2 + 2 + 1)
        call = lambda: norm.gated_rms_norm(xg, g, wg, 1e-6, quant_block=hd)  # noqa: E731
        expected = _outputs(call())
        line = []
        for tile in (2048, 4096, 8192):
            for n in (4, 8):
                norm._GATED_TILE, norm._warps = tile, (lambda block, n=n: n)
                us = _time(call, expected)
                line.append(f"tile {tile} {n}w {us:7.1f} ({nbytes / us / 1e-6 / copy_bps:4.0%})")
        norm._GATED_TILE, norm._warps = shipped_tile, shipped_warps
        us = _time(call, expected)
        print(f"gated_rms_norm fp8 rows {rows:5d}: shipped {us:7.1f} us ({nbytes / us / 1e-6 / copy_bps:4.0%}) | "
              + " | ".join(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
