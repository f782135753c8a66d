"""The parallel context one rank's layers and runner see: its place in the tensor x pipeline grid and the few
collectives they use. Layers never touch torch.distributed directly; with tp_size == pp_size == 1 (the default
`SINGLE`) every collective is the identity and no process group exists.

Ranks are laid out tensor-parallel fastest: global rank = pp_rank * tp_size + tp_rank, so one stage's TP ranks
are neighbours (one host, NVLink) and stage s talks to stage s + 1 rank for rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelContext:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    # this rank's tensor-parallel group (its stage's TP ranks); None when tp_size == 1
    tp_group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)

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

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the TP group, in place; x unchanged when tp_size == 1."""
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every TP rank's x along dim, in rank order."""
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=dim)


SINGLE = ParallelContext()


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    if num_layers < pp_size:
        raise ValueError(f"--pipeline-parallel-size {pp_size} exceeds the model's {num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


def send_to_next_stage(parallel: ParallelContext, tensors: tuple[torch.Tensor, ...]) -> None:
    """Pipeline parallelism: send a stage's outputs (hidden states, residual) to the same TP rank of the next
    stage (every TP rank of a stage holds them whole)."""
    for tensor in tensors:
        dist.send(tensor.contiguous(), dst=parallel.rank + parallel.tp_size)


def recv_from_previous_stage(parallel: ParallelContext, shapes: list[tuple[int, ...]], dtype: torch.dtype,
                             device: torch.device) -> tuple[torch.Tensor, ...]:
    """The previous stage's outputs, in send order; every rank knows their shapes from the step's batch."""
    received = []
    for shape in shapes:
        tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(tensor, src=parallel.rank - parallel.tp_size)
        received.append(tensor)
    return tuple(received)
