"""Tiles of the fused MoE kernels: the tuned table (configs.json, measured by `python -m benchmarks.moe_probe` on an
H200; its prompt-chunk buckets on an H100) and the default for shapes and buckets it does not name.

Keys are "E:k:H:I:rows": experts, top-k, hidden size, (this rank's) expert intermediate size, and the bucket of the
batch's token count (ROW_BUCKETS, decode; PREFILL_BUCKETS, the prompt chunks that quantized experts also run on these
kernels); quantized experts' keys lead with their format ("fp8:E:k:H:I:rows", "int4:...", "nvfp4:...").
Values are dicts:
  {"block_m": pairs of one expert a program takes (a power of two >= 16),
   "gate_up": [BLOCK_N, BLOCK_K, warps, stages],   kernel A over an expert's [2I, H] gate/up rows
   "down": [BLOCK_N, BLOCK_K, warps, stages],      kernel B over its [H, I] down rows
   "gemv": 0 or 1,                                 optional, rows bucket 1 only: 1 runs the one-token GEMV
                                                   kernels with these tiles instead of the tensor-core ones
                                                   (FP8: BLOCK_N divides 128, BLOCK_K a multiple of 128)
   "split_k": S,                                   optional, rows bucket 1 on the tensor-core tiles only: kernel A
                                                   splits H over S programs a tile (the tile's last one to finish
                                                   adds their sums, then SiLU and the product)
   "quant_x": 0 or 1,                              optional, FP8 rows bucket 1 on the tensor-core tiles only: 1
                                                   (the default) quantizes the token and the activation inside
                                                   kernels A and B, 0 in quantize launches before them
   "combine": 0 or 1,                              optional, rows bucket 1 on the tensor-core tiles only: 1 (the
                                                   default) has kernel B sum the token's slots, 0 the combine
                                                   kernel after it (the same bits either way)
   "grouped": 0 or 1}                              optional, prompt-chunk buckets only: 1 runs torch's grouped
                                                   matmul instead of these tiles (quantized formats: their
                                                   GROUPED_BUCKETS only, the experts dequantized a group at a time,
                                                   dequantized.py)
Plain (16-bit) experts take the tiles of a prompt-chunk bucket only where the table names it without "grouped"
(`prompt_tiles_tabled`); every other prompt chunk of theirs runs torch's grouped matmul.
(The tile kernels: FP8 and int4 take their own BLOCK_K, the scale block or the group, whatever the entry says;
NVFP4 the largest power of two <= the entry's that divides the K it steps over. The GEMV kernels: int4 and NVFP4
the largest power of two <= the entry's that divides K and holds whole groups.)
DELTASERVE_MOE_CONFIGS names another file.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import NamedTuple

from deltaserve.graph_sizes import CHUNK_GRAPH_TOKENS
from deltaserve.ops.tuned_table import read_tuned_table

CONFIGS_FILE = Path(__file__).with_name("configs.json")
ENV_VAR = "DELTASERVE_MOE_CONFIGS"
# Token-count buckets of the table; plain experts run the fused path up to the last one (decode), larger batches on
# the grouped matmul unless the table names their bucket. Quantized experts run it at every size: PREFILL_BUCKETS
# too, the last one taking any larger.
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
FUSED_MAX_TOKENS = ROW_BUCKETS[-1]
PREFILL_BUCKETS = (128, 512, 2048, 8192)
ALL_BUCKETS = ROW_BUCKETS + PREFILL_BUCKETS
# The buckets whose every chunk runs eagerly, above the largest single-chunk CUDA graph: the only ones that may take
# the dequantized groups (dequantized.py), which read their row ranges on the host (no graph can hold that).
GROUPED_BUCKETS = tuple(bucket for smaller, bucket in zip(ALL_BUCKETS, ALL_BUCKETS[1:])
                        if bucket in PREFILL_BUCKETS and smaller >= CHUNK_GRAPH_TOKENS[-1])


class Tile(NamedTuple):
    """One kernel's launch: a program's [BLOCK_N, BLOCK_K] weight tile, its warps and pipeline stages."""

    block_n: int
    block_k: int
    warps: int
    stages: int


class MoeTiles(NamedTuple):
    block_m: int
    gate_up: Tile
    down: Tile
    gemv: bool = False  # one token: kernels A and B as GEMVs on the CUDA cores (rows bucket 1 only)
    grouped: bool = False  # a prompt chunk on quantized experts: dequantized groups and the grouped matmul
    split_k: int = 1  # one token on the tiles: kernel A's programs a [BLOCK_N] tile of gate/up rows, each a part of H
    quant_x: bool = True  # FP8, one token on the tiles: kernels A and B quantize their rows (no quantize launches)
    combine: bool = True  # one token on the tiles: kernel B sums the token's slots (no combine launch)


def row_bucket(rows: int) -> int:
    """The table's bucket of a batch of rows >= 1 tokens (the last bucket takes every larger batch)."""
    return next((bucket for bucket in ALL_BUCKETS if rows <= bucket), ALL_BUCKETS[-1])


WEIGHT_FORMATS = ("bf16", "fp8", "int4", "nvfp4")  # bf16: plain 16-bit weights, keys without a prefix


def table_key(num_experts: int, top_k: int, hidden: int, intermediate: int, rows: int, fmt: str = "bf16") -> str:
    prefix = "" if fmt == "bf16" else f"{fmt}:"
    return f"{prefix}{num_experts}:{top_k}:{hidden}:{intermediate}:{row_bucket(rows)}"


def check_entry(where: str, key: str, entry) -> None:
    """Raise ValueError naming the entry unless it is a valid tile set under a valid key."""
    parts = key.split(":")
    if parts and parts[0] in WEIGHT_FORMATS[1:]:
        parts = parts[1:]
    if len(parts) != 5 or not all(p.isdigit() for p in parts) or int(parts[4]) not in ALL_BUCKETS:
        raise ValueError(f"{where}: key {key!r} is not \"[fp8:|int4:|nvfp4:]E:k:H:I:rows\" with rows one of "
                         f"{ALL_BUCKETS}")
    block_m = entry.get("block_m") if isinstance(entry, dict) else None
    if not (isinstance(block_m, int) and block_m >= 16 and block_m & (block_m - 1) == 0):
        raise ValueError(f"{where}: entry {key!r}: block_m must be a power of two >= 16, got {block_m!r}")
    gemv = entry.get("gemv", 0)
    if gemv not in (0, 1) or isinstance(gemv, bool) or (gemv and int(parts[4]) != 1):
        raise ValueError(f"{where}: entry {key!r}: gemv must be 0 or 1, and 1 only at rows 1, got {gemv!r}")
    grouped = entry.get("grouped", 0)
    quantized = key.split(":")[0] in WEIGHT_FORMATS[1:]
    grouped_buckets = GROUPED_BUCKETS if quantized else PREFILL_BUCKETS  # torch's grouped matmul needs no host sync
    if grouped not in (0, 1) or isinstance(grouped, bool) or (grouped and int(parts[4]) not in grouped_buckets):
        raise ValueError(f"{where}: entry {key!r}: grouped must be 0 or 1, and 1 only at the prompt-chunk buckets "
                         f"{grouped_buckets} ({'a quantized format' if quantized else 'plain experts'}), got "
                         f"{grouped!r}")
    split_k = entry.get("split_k", 1)
    if not isinstance(split_k, int) or isinstance(split_k, bool) or split_k < 1 or (
            split_k > 1 and (gemv or int(parts[4]) != 1)):
        raise ValueError(f"{where}: entry {key!r}: split_k must be a positive int, above 1 only at rows 1 on the "
                         f"tensor-core tiles, got {split_k!r}")
    for field in ("quant_x", "combine"):  # one token's launch choices on the tiles; quant_x FP8's only
        value = entry.get(field, 1)
        if value not in (0, 1) or isinstance(value, bool) or (value == 0 and (
                gemv or int(parts[4]) != 1 or (field == "quant_x" and not key.startswith("fp8:")))):
            raise ValueError(f"{where}: entry {key!r}: {field} must be 0 or 1, and 0 only at rows 1 on the "
                             f"tensor-core tiles{' of FP8 experts' if field == 'quant_x' else ''}, got {value!r}")
    least_n = 1 if gemv else 16  # tl.dot's least side; the GEMV takes any power of two
    for kernel in ("gate_up", "down"):
        tile = entry.get(kernel)
        if not (isinstance(tile, list) and len(tile) == 4 and all(isinstance(v, int) and v > 0 for v in tile)
                and tile[0] >= least_n and tile[1] >= 16 and all(v & (v - 1) == 0 for v in tile[:2])):
            raise ValueError(f"{where}: entry {key!r}: {kernel} must be [BLOCK_N >= {least_n}, BLOCK_K >= 16 (powers "
                             f"of two), warps, stages], got {tile!r}")
        if gemv and key.startswith("fp8:") and (128 % tile[0] or tile[1] % 128):
            raise ValueError(f"{where}: entry {key!r}: the FP8 GEMV's {kernel} BLOCK_N must divide the 128-row "
                             f"scale block and its BLOCK_K hold whole 128-column blocks, got {tile[:2]}")

@functools.cache
def tuned_table() -> dict:
    """The table, checked (a file named by DELTASERVE_MOE_CONFIGS must exist)."""
    return read_tuned_table(ENV_VAR, CONFIGS_FILE, check_entry)


def default_tiles(rows: int) -> MoeTiles:
    """Tiles that build for any shape: BLOCK_M covers the most pairs one expert can get (a token picks an expert at
    most once, so at most `rows`), so each selected expert's weights are read by one row of programs. At one
    token of 35B-A3B: kernel A 8 experts x I / 32 = 128 programs, each two [32, H] tiles (gate and up), kernel B
    8 x H / 64 = 256 programs.
    Above FUSED_MAX_TOKENS (quantized experts' prompt chunks; plain experts take the grouped matmul there) BLOCK_M
    stays 64 and a popular expert takes several blocks."""
    block_m = min(64, max(16, 1 << (max(rows, 1) - 1).bit_length()))
    return MoeTiles(block_m, Tile(32, 128, 4, 4), Tile(64, 128, 4, 4))


def tiles_for(num_experts: int, top_k: int, hidden: int, intermediate: int, rows: int,
              fmt: str = "bf16") -> MoeTiles:
    """The tuned tiles of this shape and weight format (WEIGHT_FORMATS) at `rows` tokens, else the default."""
    entry = tuned_table().get(table_key(num_experts, top_k, hidden, intermediate, rows, fmt))
    if entry is None:
        return default_tiles(rows)
    return MoeTiles(entry["block_m"], Tile(*entry["gate_up"]), Tile(*entry["down"]), bool(entry.get("gemv", 0)),
                    bool(entry.get("grouped", 0)), entry.get("split_k", 1), bool(entry.get("quant_x", 1)),
                    bool(entry.get("combine", 1)))


def prompt_tiles_tabled(num_experts: int, top_k: int, hidden: int, intermediate: int, rows: int) -> bool:
    """Whether a prompt chunk of `rows` > FUSED_MAX_TOKENS tokens on plain experts takes the fused tiles: the table
    names its bucket for this shape without "grouped" (`benchmarks.moe_probe --sweep` tables plain prompt buckets,
    "grouped" where torch's grouped matmul measured faster)."""
    entry = tuned_table().get(table_key(num_experts, top_k, hidden, intermediate, rows))
    return entry is not None and not entry.get("grouped", 0)


def tiles_entry(tiles: MoeTiles) -> dict:
    """The table's JSON entry of `tiles`."""
    entry = {"block_m": tiles.block_m, "gate_up": list(tiles.gate_up), "down": list(tiles.down)}
    return {**entry, **({"gemv": 1} if tiles.gemv else {}), **({"grouped": 1} if tiles.grouped else {}),
            **({"split_k": tiles.split_k} if tiles.split_k > 1 else {}),
            **({} if tiles.quant_x else {"quant_x": 0}), **({} if tiles.combine else {"combine": 0})}
