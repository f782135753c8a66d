"""Where a rank stands in the tensor x pipeline grid, as plain numbers: its pipeline stage's layers and its share
of each sharded size. Torch-free, so that the memory planner (cache/) can plan one rank; the worker's
ParallelContext (worker/distributed.py) adds the process group and the collectives.

Ranks are laid out tensor-parallel fastest: global rank = pp_rank * tp_size + tp_rank, so one stage's TP ranks
are neighbours (one host, NVLink) and stage s talks to stage s + 1 rank for rank.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankLayout:
    """A rank's place in the tensor x pipeline grid and the slices that follow from it (no process group)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_layers(self, num_layers: int) -> range:
        """The contiguous layers of this pipeline stage; the first num_layers % pp_size stages take one more
        (64 layers over 3 stages: 22, 21, 21)."""
        return stage_layers(num_layers, self.pp_size, self.pp_rank)

    def shard(self, size: int, name: str) -> tuple[int, int]:
        """(start, length) of this TP rank's equal slice of `size` items; `name` says what in the error when
        size does not divide."""
        if size % self.tp_size:
            raise ValueError(f"{name} = {size} does not divide over --tensor-parallel-size {self.tp_size}")
        length = size // self.tp_size
        return self.tp_rank * length, length

    def kv_head_shard(self, num_kv_heads: int) -> tuple[int, int]:
        """(first, count) of the KV heads this rank's query heads read. With more ranks than KV heads each rank
        holds one, replicated over tp_size / num_kv_heads ranks (rank r's query heads all read head r // that)."""
        if self.tp_size <= num_kv_heads:
            return self.shard(num_kv_heads, "num_key_value_heads")
        if self.tp_size % num_kv_heads:
            raise ValueError(f"num_key_value_heads = {num_kv_heads} does not divide --tensor-parallel-size "
                             f"{self.tp_size} (each KV head is replicated over a whole number of ranks)")
        return self.tp_rank // (self.tp_size // num_kv_heads), 1


ONE_RANK = RankLayout()  # the whole model on one device


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    if num_layers < pp_size:
        raise ValueError(f"--pipeline-parallel-size {pp_size} exceeds the model's {num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))
