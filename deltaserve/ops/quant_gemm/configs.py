"""Launch configurations of the quantized GEMMs: the tuned table (configs.json, measured on an H200 by
`python benchmarks/quant_gemm_probe.py`) and the defaults for shapes it does not name.

Keys are "format:N:K:rows", format one of fp8, int4, nvfp4 and rows the bucket of the batch's row count: 1, 16, 32
or 64 (decode: the skinny kernel) or 512 / 8192 (prefill: up to 512 rows, more). Values are dicts:
  {"kind": "skinny", "block_n", "block_k", "split_k", "warps", "stages"[, "quant_x"]}   1..64 rows only
  {"kind": "gemm", "block_m", "block_n", "block_k", "group_m", "warps", "stages"}       tiled, any rows
  {"kind": "torch"}    fp8 only: torch's block-scaled FP8 matmul (F.scaled_mm, 1x128 x 128x128 scales)
  {"kind": "cublas"}   int4 / nvfp4 only: dequantize the weight into a bf16 scratch buffer, then cuBLAS
For fp8, block_k is the checkpoint's scale block (128) whatever the entry says, and quant_x 1 quantizes the
activation inside the skinny kernel (0: a separate kernel first). DELTASERVE_QUANT_GEMM_CONFIGS names another file.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

CONFIGS_FILE = Path(__file__).with_name("configs.json")
ENV_VAR = "DELTASERVE_QUANT_GEMM_CONFIGS"
FORMATS = ("fp8", "int4", "nvfp4")
DECODE_BUCKETS = (1, 16, 32, 64)
PREFILL_BUCKETS = (512, 8192)
SKINNY_MAX_ROWS = DECODE_BUCKETS[-1]

_FIELDS = {
    "skinny": ("block_n", "block_k", "split_k", "warps", "stages"),
    "gemm": ("block_m", "block_n", "block_k", "group_m", "warps", "stages"),
    "torch": (),
    "cublas": (),
}
_KINDS_OF = {"fp8": ("skinny", "gemm", "torch"), "int4": ("skinny", "gemm", "cublas"),
             "nvfp4": ("skinny", "gemm", "cublas")}


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
    if bucket not in DECODE_BUCKETS + PREFILL_BUCKETS or (kind == "skinny" and bucket not in DECODE_BUCKETS):
        raise ValueError(f"{where}: entry {key!r}: kind {kind!r} does not serve the {bucket}-row bucket")
    for field in _FIELDS[kind]:
        value = entry.get(field)
        if not (isinstance(value, int) and value > 0):
            raise ValueError(f"{where}: entry {key!r}: {field} must be a positive int, got {value!r}")


@functools.cache
def tuned_table() -> dict:
    """The table, checked (a file named by DELTASERVE_QUANT_GEMM_CONFIGS must exist)."""
    named = os.environ.get(ENV_VAR)
    path = Path(named or CONFIGS_FILE)
    where = f"{ENV_VAR}={named!r}" if named else str(path)
    if not path.exists():
        if named:
            raise ValueError(f"{where}: no such file")
        return {}
    try:
        table = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc})") from None
    if not isinstance(table, dict):
        raise ValueError(f"{where}: the table must be a JSON object, got {type(table).__name__}")
    for key, entry in table.items():
        check_entry(where, key, entry)
    return table


def default_config(fmt: str, n: int, k: int, rows: int) -> dict:
    """A config that builds on an H200 for any shape: split K on narrow weights so that ~2 programs run per SM."""
    if rows <= SKINNY_MAX_ROWS:
        block_n = 64
        block_k = 128  # fp8 and int4 take their scale block / group whatever it says
        programs = -(-n // block_n)
        split_k = max(1, min(8, 264 // programs, k // (4 * block_k)))
        return {"kind": "skinny", "block_n": block_n, "block_k": block_k, "split_k": split_k, "warps": 4,
                "stages": 4, "quant_x": 1}
    if fmt == "fp8":
        return {"kind": "gemm", "block_m": 128, "block_n": 128, "block_k": 128, "group_m": 8, "warps": 8, "stages": 3}
    return {"kind": "gemm", "block_m": 128, "block_n": 128, "block_k": 64, "group_m": 8, "warps": 8, "stages": 3}


def config_for(fmt: str, n: int, k: int, rows: int) -> dict:
    """The tuned config of a [n, k] weight of `fmt` at `rows` rows, else the default."""
    return tuned_table().get(f"{fmt}:{n}:{k}:{row_bucket(rows)}") or default_config(fmt, n, k, rows)
