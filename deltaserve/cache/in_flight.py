"""The prompts that live requests are computing, as the prefix index sees them: the chain hashes of their full
prompt blocks (indexed in the BlockPool only once computed) and the keys of the checkpoints they are to save.

Requests that arrive together compute their shared prefix side by side, so none of them finds the others'
blocks in the cache. With this index a prompt finds where it branches off a prompt being computed beside it, as
it finds where it branches off cached blocks (cache/cache_manager.py), and leaves a checkpoint to the live request
that is to save it already: a burst of prompts on one prefix cuts one chunk at the branch point, not one each.
"""

from __future__ import annotations

from deltaserve.request import Request


class InFlightPrompts:
    def __init__(self, block_size: int, seed: bytes):
        self.block_size = block_size
        self.seed = seed  # h_0, the parent of a first block
        self._blocks: dict[bytes, int] = {}  # chain hash -> live requests computing that block
        self._children: dict[bytes, int] = {}  # chain hash -> blocks of live requests that continue it
        self._savers: dict[bytes, list[Request]] = {}  # checkpoint key -> live requests that are to save it
        # request serial -> what `add` indexed for it: (block hashes, their parents, checkpoint keys)
        self._added: dict[int, tuple[list[bytes], list[bytes], list[bytes]]] = {}

    def add(self, request: Request, first_block: int, checkpoint_keys: list[bytes]) -> None:
        """`request` starts computing at block `first_block` (its hit): index its full prompt blocks from there
        (hashed: block_hashes) and the keys of the checkpoints it is to save."""
        hashes, end = request.block_hashes, request.num_prompt_tokens // self.block_size
        blocks = hashes[first_block:end]
        parents = [hashes[i - 1] if i else self.seed for i in range(first_block, end)]
        for block, parent in zip(blocks, parents):
            self._blocks[block] = self._blocks.get(block, 0) + 1
            self._children[parent] = self._children.get(parent, 0) + 1
        for key in checkpoint_keys:
            self._savers.setdefault(key, []).append(request)
        self._added[request.serial] = (blocks, parents, checkpoint_keys)

    def remove(self, request: Request) -> None:
        """`request` stopped (finished, aborted or preempted); a request never added is ignored."""
        added = self._added.pop(request.serial, None)
        if added is None:
            return
        blocks, parents, checkpoint_keys = added
        for block, parent in zip(blocks, parents):
            _decrement(self._blocks, block)
            _decrement(self._children, parent)
        for key in checkpoint_keys:
            savers = self._savers[key]
            savers.remove(request)
            if not savers:
                del self._savers[key]

    def has_block(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def has_child(self, block_hash: bytes) -> bool:
        """A live request computes a block that continues the prefix `block_hash` names."""
        return block_hash in self._children

    def is_to_be_saved(self, key: bytes, length: int) -> bool:
        """A live request is to save the checkpoint `key` (after `length` tokens) and has not computed past it."""
        return any(request.num_computed_tokens < length for request in self._savers.get(key, ()))

    def __len__(self) -> int:
        """Live requests indexed."""
        return len(self._added)


def _decrement(counts: dict[bytes, int], key: bytes) -> None:
    if counts[key] == 1:
        del counts[key]
    else:
        counts[key] -= 1
