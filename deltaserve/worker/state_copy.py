"""GDN state slot copies for the prefix cache: restore checkpoints before the forward, save them after.

Working slots and checkpoint slots are rows of the same pool tensors (see cache/state_pool.py), so a copy is
a gather + scatter along dim 0 of each pool: per GDN layer one conv pool [S, conv_dim, W-1] and one
recurrent pool [S, HV, K, V]. All pairs of a step go in one index_copy_ per pool tensor. Within one list the
destinations are distinct and never a source (restores write working slots from checkpoint slots, saves
write fresh checkpoint slots from working slots), so the order of the pairs does not matter.
"""

from __future__ import annotations

import torch

from deltaserve.device import to_device
from deltaserve.model.qwen3_5 import HybridForCausalLM
from deltaserve.sched_output import SchedulerOutput


def copy_state_slots(pools: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
    """pool[dst] = pool[src] for every (src, dst) pair, in every pool tensor (all indexed by slot on dim 0)."""
    if not pairs or not pools:
        return
    device = pools[0].device
    src = to_device([s for s, _ in pairs], device, torch.int64)  # [P]
    dst = to_device([d for _, d in pairs], device, torch.int64)  # [P]
    for pool in pools:
        pool.index_copy_(0, dst, pool.index_select(0, src))  # the gather is a copy: safe for any overlap


def gdn_state_pools(model: HybridForCausalLM) -> list[torch.Tensor]:
    """The conv and recurrent state pools of every GDN layer."""
    return [pool for gdn in model.gdn_layers for pool in (gdn.conv_state, gdn.ssm_state)]


def restore_checkpoints(model: HybridForCausalLM, scheduled: SchedulerOutput) -> None:
    """Before the forward: copy each prefix hit's checkpoint into its request's working slot."""
    copy_state_slots(gdn_state_pools(model), scheduled.state_restores)


def save_checkpoints(model: HybridForCausalLM, scheduled: SchedulerOutput) -> None:
    """After the forward: copy the working slots whose chunk ended at a checkpoint into their new slots."""
    copy_state_slots(gdn_state_pools(model), scheduled.state_saves)
