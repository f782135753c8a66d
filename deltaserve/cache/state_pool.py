"""GDN state slots: one working slot per running request. Pure CPU bookkeeping.

    slot ids:  0 | 1 2 ... num_slots-1
               ^ dummy slot: padding rows of a batch (CUDA-graph padding) read and write here; never handed out
"""


class StatePool:
    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise ValueError(f"num_slots must be >= 2 (slot 0 is the dummy), got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, 0, -1))  # pop() hands out the lowest slot first
        self._used: set[int] = set()

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free GDN state slot")
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise RuntimeError(f"GDN state slot {slot} is not in use")
        self._used.remove(slot)
        self._free.append(slot)
