"""Paged KV blocks: a free list, reference counts, and the prefix cache's index of full blocks.

Pure CPU bookkeeping (no tensors).

    block ids:  0 | 1 2 3 ... num_blocks-1
                ^ null block: padding rows of a block table point here; never handed out (invariant 5)

Every usable block is in exactly one of three states:

    held          ref count >= 1: in the block table of at least one request
    cached-free   ref count 0, holds the KV of a full block whose chain hash is indexed: waits in the LRU
                  `_evictable` (least recently used first); a prefix hit takes it back with `touch`
    free          ref count 0, no hash: in `_free`

`allocate` takes free blocks first, then evicts cached-free blocks in LRU order, dropping their hash.
A held block may be indexed too (a full, computed block of a running request): other requests then share
it through `touch`. Indexed blocks are never written again: a request only writes positions past its
last full block, and those sit in blocks of its own.

The index also counts, per chain hash, the indexed prompt blocks (blocks of a request's prompt tokens only) that
continue it: a prompt whose cached chain ends where another prompt's block goes on with other tokens has found a
branch point (cache/cache_manager.py checkpoints it).
"""

from collections import OrderedDict, deque


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached-free blocks, least recently used first
        self._block_of_hash: dict[bytes, int] = {}  # chain hash -> the block holding that KV
        self._hash_of_block: dict[int, bytes] = {}
        self._parent_of_block: dict[int, bytes] = {}  # indexed prompt block -> the chain hash before it
        self._num_prompt_children: dict[bytes, int] = {}  # chain hash -> indexed prompt blocks whose parent it is
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out: free ones plus cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of_hash)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (0.0 .. 1.0); cached-free blocks count as free."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks (reference count 1 each), evicting cached ones if needed. Raises if too few: check first."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} KV blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                self._unindex(block)
                self.num_evictions += 1
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block. A block nobody holds becomes free, or cached-free if indexed.

        The blocks of a request are released last first, so that the LRU evicts the tail of a chain before
        its head: the head is what other prompts share.
        """
        for b in reversed(block_ids):
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"KV block {b} freed more often than allocated")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if b in self._hash_of_block:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def forget_cached(self) -> None:
        """Empty the prefix index: every cached block becomes free. Only while no request holds a block."""
        if any(self.ref_counts):
            raise RuntimeError("the prefix index can only be emptied while no request holds a KV block")
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._block_of_hash.clear()
        self._hash_of_block.clear()
        self._parent_of_block.clear()
        self._num_prompt_children.clear()

    # -- the prefix index ----------------------------------------------------------------------------------

    def cached_block(self, block_hash: bytes) -> int | None:
        """The block holding the KV of the chain ending in `block_hash`, or None."""
        return self._block_of_hash.get(block_hash)

    def has_prompt_child(self, block_hash: bytes) -> bool:
        """An indexed prompt block continues the prefix that `block_hash` names (its parent is that hash)."""
        return block_hash in self._num_prompt_children

    def cache_block(self, block_id: int, block_hash: bytes, prompt_parent: bytes | None) -> bool:
        """Index a full, computed, held block under its chain hash. `prompt_parent`: for a block of prompt tokens
        only, the chain hash before it (the seed for a first block), counted for has_prompt_child; None for a
        block that holds output tokens. False (nothing changes) if another block already holds that hash: the
        duplicate stays private to its request and is freed normally."""
        if self.ref_counts[block_id] <= 0:
            raise RuntimeError(f"KV block {block_id} is not held: only a request's computed block can be cached")
        if block_hash in self._block_of_hash:
            return False
        if block_id in self._hash_of_block:
            raise RuntimeError(f"KV block {block_id} is already cached under another hash")
        self._block_of_hash[block_hash] = block_id
        self._hash_of_block[block_id] = block_hash
        if prompt_parent is not None:
            self._parent_of_block[block_id] = prompt_parent
            self._num_prompt_children[prompt_parent] = self._num_prompt_children.get(prompt_parent, 0) + 1
        return True

    def _unindex(self, block_id: int) -> None:
        """Drop an evicted block from the index."""
        del self._block_of_hash[self._hash_of_block.pop(block_id)]
        parent = self._parent_of_block.pop(block_id, None)
        if parent is None:
            return
        if self._num_prompt_children[parent] == 1:
            del self._num_prompt_children[parent]
        else:
            self._num_prompt_children[parent] -= 1

    def num_unheld(self, block_ids: list[int]) -> int:
        """How many of these (cached) blocks nobody holds: touching them takes them out of the free count."""
        return sum(1 for b in block_ids if self.ref_counts[b] == 0)

    def touch(self, block_ids: list[int]) -> None:
        """Take one reference to each cached block of a prefix hit (out of the LRU if nobody held it)."""
        for b in block_ids:
            if b not in self._hash_of_block:
                raise RuntimeError(f"KV block {b} is not cached: a prefix hit can only share cached blocks")
            if self.ref_counts[b] == 0:
                del self._evictable[b]
            self.ref_counts[b] += 1
