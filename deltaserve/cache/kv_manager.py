"""Hands each request the KV blocks and the GDN state slot its next step needs, and takes them back."""

from deltaserve.cache.block_pool import BlockPool
from deltaserve.cache.state_pool import StatePool
from deltaserve.request import Request


class CacheManager:
    def __init__(self, block_pool: BlockPool, state_pool: StatePool):
        self.block_pool = block_pool
        self.state_pool = state_pool
        self.block_size = block_pool.block_size

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Blocks to add so that the cache can hold num_computed_tokens + num_new_tokens tokens."""
        total = request.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(request.block_ids))

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        need_slot = request.state_slot is None
        if need_slot and self.state_pool.num_free_slots == 0:
            return False
        return self.blocks_needed(request, num_new_tokens) <= self.block_pool.num_free_blocks

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Give `request` room for `num_new_tokens` more tokens; False (and nothing taken) if it does not fit."""
        if not self.can_allocate(request, num_new_tokens):
            return False
        if request.state_slot is None:
            request.state_slot = self.state_pool.allocate()
        request.block_ids.extend(self.block_pool.allocate(self.blocks_needed(request, num_new_tokens)))
        return True

    def free(self, request: Request) -> None:
        """Release the request's blocks and slot (it keeps no cache state afterwards)."""
        self.block_pool.free(request.block_ids)
        request.block_ids = []
        if request.state_slot is not None:
            self.state_pool.free(request.state_slot)
            request.state_slot = None
