"""GDN state slot copies for the prefix cache: restore checkpoints before the forward, save them after.

Working slots and checkpoint slots are rows of the same pools (see cache/state_pool.py), and every GDN layer's
pools are views of two stacked tensors (worker/kv_cache.py): conv [L, S, conv_dim, W-1] and recurrent
[L, S, HV, K, V]. So all pairs of a step, for all layers, go in one index_select + index_copy_ along the slot
dimension per tensor. Within one list the destinations are distinct and never a source (restores write
working slots from checkpoint slots, saves write fresh checkpoint slots from working slots), so the order of
the pairs does not matter.
"""

from __future__ import annotations

import torch

from deltaserve.device import to_device
from deltaserve.model.qwen3_5 import HybridForCausalLM
from deltaserve.sched_output import SchedulerOutput


def copy_state_slots(pools: list[torch.Tensor], pairs: list[tuple[int, int]], dim: int = 0) -> None:
    """pool[dst] = pool[src] along `dim` (the slot dimension) for every (src, dst) pair, in every pool tensor."""
    if not pairs or not pools:
        return
    device = pools[0].device
    src = to_device([s for s, _ in pairs], device, torch.int64)  # [P]
    dst = to_device([d for _, d in pairs], device, torch.int64)  # [P]
    for pool in pools:
        pool.index_copy_(dim, dst, pool.index_select(dim, src))  # the gather is a copy: safe for any overlap


def gdn_state_pools(model: HybridForCausalLM) -> list[torch.Tensor]:
    """The stacked conv and recurrent state tensors of all GDN layers (slot dimension 1)."""
    return [model.conv_states, model.ssm_states]


def restore_checkpoints(model: HybridForCausalLM, scheduled: SchedulerOutput) -> None:
    """Before the forward: copy each prefix hit's checkpoint into its request's working slot."""
    copy_state_slots(gdn_state_pools(model), scheduled.state_restores, dim=1)


def save_checkpoints(model: HybridForCausalLM, scheduled: SchedulerOutput) -> None:
    """After the forward: copy the working slots whose chunk ended at a checkpoint into their new slots."""
    copy_state_slots(gdn_state_pools(model), scheduled.state_saves, dim=1)
