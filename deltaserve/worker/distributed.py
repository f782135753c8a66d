"""The parallel context one rank's layers and runner see: its place in the grid (deltaserve/parallel_layout.py)
and the few collectives they use. Layers never touch torch.distributed directly; with tp_size == pp_size == 1
(the default `SINGLE`) every collective is the identity and no process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from deltaserve.parallel_layout import RankLayout


@dataclass(frozen=True)
class ParallelContext(RankLayout):
    # this rank's tensor-parallel group (its stage's TP ranks); None when tp_size == 1
    tp_group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)

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
