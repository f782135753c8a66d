"""Split-K products that finish their own sums: the last program of a tile adds the tile's partials.

A decode product whose output is too small to fill the GPU splits K over a second grid axis. Each program writes its
float32 partial sums; then it counts itself in on its output tile's counter (one int32 per tile), and the program
that arrives last adds every split's partial in split order, writes the output and sets the counter back to zero for
the next launch. The sum is the same, bit for bit, as a second kernel adding them in order, and the step has one
launch fewer per product.

The order of memory: every thread's partial is stored before the barrier, after which one thread counts the
program in with release semantics at GPU scope; the last program's count acquires, so the other programs'
partials are visible to its reads (loaded through L2, `.cg`). This is the serial split-K of CUTLASS's semaphore.
Launches of one device share its counters: the engine runs its products on one stream, one after another.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_COUNTERS_MIN = 1 << 16  # tiles: more than any product's grid axis 0 at the shipped tiles
_counters: dict[torch.device, torch.Tensor] = {}


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The device's zeroed int32 tile counters, at least `tiles` of them (each back at zero after every launch
    that used it). Made before any graph is captured (the warm-up runs every shape first)."""
    held = _counters.get(device)
    if held is None or held.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"split-K counters for {tiles} tiles requested during CUDA graph capture on {device}")
        held = torch.zeros(max(_COUNTERS_MIN, triton.next_power_of_2(tiles)), dtype=torch.int32, device=device)
        _counters[device] = held
    return held


@triton.jit
def store_split(acc, out_ptrs, partial_ptrs, mask, split_stride, counters, tile):
    """Store this program's partial sums acc (float32) at partial_ptrs + split * split_stride (split: grid axis
    1); the last of the tile's splits to arrive (tile: the output tile's index, counters[tile] its counter) writes
    their sum in split order at out_ptrs (out's dtype) and resets the counter."""
    store_split_of(acc, out_ptrs, partial_ptrs, mask, split_stride, counters, tile, tl.program_id(1),
                   tl.num_programs(1))


@triton.jit
def store_split_of(acc, out_ptrs, partial_ptrs, mask, split_stride, counters, tile, split, splits):
    """store_split for split `split` of `splits` (the programs of a tile that are not grid axis 1: the MoE down
    kernel's expert slots, grid axis 0)."""
    tl.store(partial_ptrs + split * split_stride, acc, mask=mask)
    if arrives_last(counters, tile, splits):
        tl.store(out_ptrs, sum_partials(partial_ptrs, mask, split_stride, splits).to(out_ptrs.dtype.element_ty),
                 mask=mask)
        tl.store(counters + tile, 0)


@triton.jit
def arrives_last(counters, tile, splits):
    """Once this program has stored its partials: counts it in on counters[tile]; whether it is the tile's last
    split (which then adds the partials, `sum_partials`, and sets the counter back to 0)."""
    tl.debug_barrier()  # every thread's partial is stored before the program counts itself in
    return tl.atomic_add(counters + tile, 1, sem="acq_rel", scope="gpu") == splits - 1


@triton.jit
def sum_partials(partial_ptrs, mask, split_stride, splits):
    """The float32 sum of the `splits` partials at partial_ptrs + s * split_stride, in split order, read past L1."""
    total = tl.load(partial_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    for s in range(1, splits):
        total += tl.load(partial_ptrs + s * split_stride, mask=mask, other=0.0, cache_modifier=".cg")
    return total
