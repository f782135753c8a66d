"""Paged KV blocks: a free list and reference counts. Pure CPU bookkeeping (no tensors).

    block ids:  0 | 1 2 3 ... num_blocks-1
                ^ null block: padding rows of a block table point here; never handed out

A block returns to the free list when its reference count drops to zero.
"""

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (0.0 .. 1.0)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (reference count 1 each). Raises if fewer are free: check first."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks nobody holds go back to the free list."""
        for b in block_ids:
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"KV block {b} freed more often than allocated")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)
