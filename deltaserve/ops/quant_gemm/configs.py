"""Launch configurations of the quantized GEMMs: the tuned table (configs.json, measured on an H200 by
`python benchmarks/quant_gemm_probe.py`) and the defaults for shapes it does not name.

Keys are "format:N:K:rows", format one of fp8, int4, nvfp4 and rows the bucket of the batch's row count: 1, 8, 16,
32 or 64 (decode) or 512 / 8192 (prefill: up to 512 rows, more). Values are dicts:
  {"kind": "gemv", "block_n", "block_k", "warps", "stages"[, "split_k", "dp4a"]}   cuda_gemv: fp8 1 row, int4 /
                                            nvfp4 1..8 rows (split_k, dp4a 0 or 1: one row only,
                                            NVFP4's split_k with dp4a)
  {"kind": "skinny", "block_n", "block_k", "split_k", "warps", "stages"[, "quant_x", "tma"]}   1..64 rows only
  {"kind": "gemm", "block_m", "block_n", "block_k", "group_m", "warps", "stages"}       tiled, any rows
  {"kind": "torch"}    fp8 only: torch's block-scaled FP8 matmul (F.scaled_mm, 1x128 x 128x128 scales)
  {"kind": "cublas"}   int4 / nvfp4 only: dequantize the weight into a bf16 scratch buffer, then cuBLAS
For fp8, block_k is the checkpoint's scale block (128) whatever the entry says, quant_x 1 quantizes the
activation inside the skinny kernel (0, the default: a separate kernel first) and tma 1 (fp8's skinny kernel only)
copies its tiles by TMA. DELTASERVE_QUANT_GEMM_CONFIGS names another file.
"""

from __future__ import annotations

import functools
from pathlib import Path

from deltaserve.ops.tuned_table import read_tuned_table

CONFIGS_FILE = Path(__file__).with_name("configs.json")
ENV_VAR = "DELTASERVE_QUANT_GEMM_CONFIGS"
FORMATS = ("fp8", "int4", "nvfp4")
DECODE_BUCKETS = (1, 8, 16, 32, 64)
PREFILL_BUCKETS = (512, 8192)
SKINNY_MAX_ROWS = DECODE_BUCKETS[-1]

_FIELDS = {
    "gemv": ("block_n", "block_k", "warps", "stages"),
    "skinny": ("block_n", "block_k", "split_k", "warps", "stages"),
    "gemm": ("block_m", "block_n", "block_k", "group_m", "warps", "stages"),
    "torch": (),
    "cublas": (),
}
_KINDS_OF = {"fp8": ("gemv", "skinny", "gemm", "torch"), "int4": ("gemv", "skinny", "gemm", "cublas"),
             "nvfp4": ("gemv", "skinny", "gemm", "cublas")}


def row_bucket(rows: int) -> int:
    """The table's bucket of a batch of `rows` >= 1 rows."""
    for bucket in DECODE_BUCKETS + PREFILL_BUCKETS[:-1]:
        if rows <= bucket:
            return bucket
    return PREFILL_BUCKETS[-1]


def check_entry(where: str, key: str, entry) -> None:
    """Raise ValueError naming the entry unless it is a valid config for its key."""
    parts = key.split(":")
    ok_key = len(parts) == 4 and parts[0] in FORMATS and all(p.isdigit() for p in parts[1:])
    if not ok_key:
        raise ValueError(f"{where}: key {key!r} is not \"format:N:K:rows\" with format one of {FORMATS}")
    kind = entry.get("kind") if isinstance(entry, dict) else None
    if kind not in _KINDS_OF[parts[0]]:
        raise ValueError(f"{where}: entry {key!r}: {entry!r} needs a \"kind\" among {_KINDS_OF[parts[0]]}")
    bucket = int(parts[3])
    if (bucket not in DECODE_BUCKETS + PREFILL_BUCKETS or (kind == "skinny" and bucket not in DECODE_BUCKETS)
            or (kind == "gemv" and bucket > (1 if parts[0] == "fp8" else 8))):
        raise ValueError(f"{where}: entry {key!r}: kind {kind!r} does not serve the {bucket}-row bucket")
    one_row_4bit = kind == "gemv" and parts[0] in ("int4", "nvfp4") and bucket == 1
    optional = ("split_k",) if one_row_4bit else ()
    for field in _FIELDS[kind] + tuple(f for f in optional if f in entry):
        value = entry.get(field)
        if not (isinstance(value, int) and value > 0):
            raise ValueError(f"{where}: entry {key!r}: {field} must be a positive int, got {value!r}")
    if "dp4a" in entry and (not optional or entry["dp4a"] not in (0, 1) or isinstance(entry["dp4a"], bool)):
        raise ValueError(f"{where}: entry {key!r}: dp4a (int4 / NVFP4 one-row GEMV only) must be 0 or 1, got "
                         f"{entry['dp4a']!r}")
    if "tma" in entry and (kind != "skinny" or parts[0] != "fp8" or entry["tma"] not in (0, 1)
                           or isinstance(entry["tma"], bool)):
        raise ValueError(f"{where}: entry {key!r}: tma (FP8's skinny kernel only) must be 0 or 1, got "
                         f"{entry['tma']!r}")
    if one_row_4bit and parts[0] == "nvfp4" and "split_k" in entry and not entry.get("dp4a"):
        raise ValueError(f"{where}: entry {key!r}: split_k is the NVFP4 one-row GEMV's with dp4a only, got {entry!r}")


@functools.cache
def tuned_table() -> dict:
    """The table, checked (a file named by DELTASERVE_QUANT_GEMM_CONFIGS must exist)."""
    return read_tuned_table(ENV_VAR, CONFIGS_FILE, check_entry)


def default_config(fmt: str, n: int, k: int, rows: int) -> dict:
    """A config that builds on an H200 for any shape (the reasons: docs/quantization.md, ## Kernels): one row the
    CUDA-core GEMV (int4 / NVFP4 up to 8 rows; FP8 but on the wide gate/up, where its skinny kernel streams
    well); up to 64 rows the skinny kernels, K split on narrow weights so that ~2 programs run per SM, FP8's
    activation quantized by its own kernel first and its tiles copied by TMA; above, torch's block-scaled
    F.scaled_mm for FP8 and the dequantized weight through cuBLAS for int4 / NVFP4."""
    if rows == 1 and fmt != "fp8":  # the dp4a kernels, which won at every 27B shape (H100, 2026-12-06)
        return {"kind": "gemv", "block_n": 8, "block_k": 1024, "split_k": dp4a_split_k(n, k), "warps": 1,
                "stages": 1, "dp4a": 1}
    if rows == 1 and n <= 8192:  # fp8: [8, 1024] float32 products a program, as the bf16 GEMV
        return {"kind": "gemv", "block_n": 8, "block_k": 1024, "warps": 4, "stages": 1}
    if rows <= 8 and fmt != "fp8":  # [rows, 8, 64] float32 sums a program
        return {"kind": "gemv", "block_n": 8, "block_k": 512, "warps": 4, "stages": 1}
    if rows <= SKINNY_MAX_ROWS:
        return skinny_config(n, k, fmt)
    return {"kind": "torch"} if fmt == "fp8" else {"kind": "cublas"}


def auto_split_k(n: int, k: int, block_n: int, block_k: int = 128) -> int:
    """K splits of the skinny kernel that put ~2 programs on each of an H200's 132 SMs (at most 8, each split
    at least 4 K blocks long)."""
    return max(1, min(8, 264 // -(-n // block_n), k // (4 * block_k)))


def dp4a_split_k(n: int, k: int) -> int:
    """K splits of the default one-row dp4a GEMV (8 rows a one-warp program) that put ~8 programs on each of an
    H200's 132 SMs (at most 8, each split at least 1,024 columns long)."""
    return max(1, min(8, 8 * 132 // -(-n // 8), k // 1024))


def gemv_split_k(n: int, k: int, block_n: int) -> int:
    """K splits of the one-row int4 GEMV that put ~2 programs on each of an H200's 132 SMs (at most 8, each split
    at least 1,024 columns long)."""
    return max(1, min(8, 264 // -(-n // block_n), k // 1024))


def skinny_config(n: int, k: int, fmt: str = "fp8") -> dict:
    """The skinny kernel's default tile (fp8 and int4 take their scale block / group as block_k); FP8's copied by
    TMA, faster than pointer loads at every shape probed (docs/performance.md, 'FP8 skinny tiles by TMA')."""
    tile = {"kind": "skinny", "block_n": 64, "block_k": 128, "split_k": auto_split_k(n, k, 64), "warps": 4,
            "stages": 4, "quant_x": 0}
    return dict(tile, tma=1) if fmt == "fp8" else tile


def tiled_config(fmt: str) -> dict:
    """The Triton tiled GEMM's tile where another kind cannot run (FP8 blocks F.scaled_mm does not take)."""
    if fmt == "fp8":
        return {"kind": "gemm", "block_m": 128, "block_n": 128, "block_k": 128, "group_m": 8, "warps": 8, "stages": 3}
    return {"kind": "gemm", "block_m": 128, "block_n": 128, "block_k": 64, "group_m": 8, "warps": 8, "stages": 3}


def config_for(fmt: str, n: int, k: int, rows: int) -> dict:
    """The tuned config of a [n, k] weight of `fmt` at `rows` rows, else the default."""
    return tuned_table().get(f"{fmt}:{n}:{k}:{row_bucket(rows)}") or default_config(fmt, n, k, rows)
