"""GDN state slots: working slots for running requests, checkpoint slots for the prefix cache.

Pure CPU bookkeeping. Both kinds are rows of the same conv / recurrent pool tensors (worker/kv_cache.py),
so saving or restoring a checkpoint is one slot-to-slot copy per layer (worker/state_copy.py).

    slot ids:  0 | 1 ... num_slots-1 | num_slots ... num_slots+num_checkpoint_slots-1
               ^   working slots       checkpoint slots
               dummy slot: padding rows of a batch (CUDA-graph padding) read and write here; never handed
               out (invariant 5)

A working slot is read and written by the forward pass of the one request that holds it. A checkpoint slot
holds a copy of some request's state at a block boundary; the prefix cache (cache/prefix_cache.py) owns
it, and it is written only by the save that creates it.
"""


class _SlotList:
    """A free list over a range of slot ids that hands out the lowest slot first and catches double frees."""

    def __init__(self, first: int, end: int, kind: str):
        self.kind = kind
        self._free = list(range(end - 1, first - 1, -1))  # pop() hands out the lowest slot first
        self._used: set[int] = set()

    def __len__(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(f"no free GDN {self.kind} slot")
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise RuntimeError(f"GDN {self.kind} slot {slot} is not in use")
        self._used.remove(slot)
        self._free.append(slot)


class StatePool:
    def __init__(self, num_slots: int, num_checkpoint_slots: int = 0):
        """num_slots: the dummy slot plus the working slots; num_checkpoint_slots: the prefix cache's budget."""
        if num_slots < 2:
            raise ValueError(f"num_slots must be >= 2 (slot 0 is the dummy), got {num_slots}")
        if num_checkpoint_slots < 0:
            raise ValueError(f"num_checkpoint_slots must be >= 0, got {num_checkpoint_slots}")
        self.num_slots = num_slots
        self.num_checkpoint_slots = num_checkpoint_slots
        self._working = _SlotList(1, num_slots, "state")
        self._checkpoints = _SlotList(num_slots, num_slots + num_checkpoint_slots, "checkpoint")

    @property
    def total_slots(self) -> int:
        """Rows of the pool tensors: dummy + working + checkpoint slots."""
        return self.num_slots + self.num_checkpoint_slots

    @property
    def num_free_slots(self) -> int:
        """Free working slots."""
        return len(self._working)

    @property
    def num_free_checkpoint_slots(self) -> int:
        return len(self._checkpoints)

    def allocate(self) -> int:
        """A working slot for a request."""
        return self._working.allocate()

    def free(self, slot: int) -> None:
        self._working.free(slot)

    def allocate_checkpoint(self) -> int:
        return self._checkpoints.allocate()

    def free_checkpoint(self, slot: int) -> None:
        self._checkpoints.free(slot)
