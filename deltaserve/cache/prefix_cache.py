"""The prefix index of the hybrid cache: chain hashes of full KV blocks, GDN state checkpoints, the hit lookup.

KV blocks are indexed per FULL block by a chain hash, so that one hash names a whole prefix:

    h_0 = seed(model, dtypes, block size)        h_{i+1} = H(h_i, token ids of block i)

h_{i+1} stands for the tokens [0, (i+1)*bs). The BlockPool maps chain hashes to the blocks holding their KV.
KV alone cannot resume a request, because a GDN layer's state folds in every earlier token. So the cache
also holds checkpoints: copies of a request's conv + recurrent state after exactly L tokens (L a multiple
of bs), keyed by h_{L/bs}, in checkpoint slots of the state pool, in an LRU of their own.

Invariants (numbered as in DESIGN.md section 3; 3 to 5 are kept by the CacheManager and the pools):
1. A checkpoint at L is used only if every KV block of [0, L) is cached. `find_hit` walks the chain from
   its start and only looks at checkpoints on the walked part. Evicting a block does not drop the
   checkpoints past it: they are unreachable until the blocks are computed and cached again (same tokens,
   same hash, same state), and age out of the LRU otherwise. Choosing the walk over eager dropping keeps
   eviction O(1) and costs no more than the walk the lookup does anyway.
2. A hit is the longest L with cached KV blocks and a checkpoint at exactly L, capped by the caller at
   prompt_len - 1 (one token must run to give logits). Checkpoints are never mutated: a slot is written
   only by the save that creates it (`reserve`, the runner copies after the forward, `commit_pending`),
   hits only copy out of it, and it is freed before it is reused.

Each running request may own one "decode checkpoint" (its latest block boundary, replaced as it passes the
next one). At most half the checkpoint budget is owned at once, so that decoding requests cannot push every
prompt checkpoint out of the LRU. When the owner stops running, its checkpoint becomes an ordinary one.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from deltaserve.cache.block_pool import BlockPool
from deltaserve.cache.state_pool import StatePool

_DIGEST_BYTES = 16  # 128-bit blake2b: a collision (two prefixes sharing a cache entry) is out of reach


def hash_seed(identity: str) -> bytes:
    """h_0: the model and cache dtype identity, so that entries can never be shared across them."""
    return hashlib.blake2b(identity.encode(), digest_size=_DIGEST_BYTES).digest()


def extend_block_hashes(hashes: list[bytes], token_ids: list[int], block_size: int, seed: bytes) -> None:
    """Append to `hashes` the chain hashes of the full blocks of `token_ids` it does not cover yet."""
    first, end = len(hashes), len(token_ids) // block_size
    if end <= first:
        return
    data = array("q", token_ids[first * block_size:end * block_size]).tobytes()  # int64 per token
    width = 8 * block_size
    parent = hashes[-1] if hashes else seed
    for i in range(end - first):
        parent = hashlib.blake2b(parent + data[i * width:(i + 1) * width], digest_size=_DIGEST_BYTES).digest()
        hashes.append(parent)


@dataclass
class PrefixHit:
    """What a request about to start can reuse."""

    num_tokens: int = 0  # L: prompt tokens served from the cache (a multiple of the block size)
    block_ids: list[int] = field(default_factory=list)  # the cached KV blocks of [0, L)
    checkpoint_slot: int | None = None  # the state slot to restore into the working slot (None if L == 0)
    checkpoint_key: bytes | None = None
    num_chain_tokens: int = 0  # M >= L: length of the walked chain of cached KV blocks


@dataclass
class _Checkpoint:
    slot: int
    owner: str | None = None  # the running request whose decode checkpoint this is, if any


class PrefixCache:
    def __init__(self, block_pool: BlockPool, state_pool: StatePool, identity: str):
        self.block_pool = block_pool
        self.state_pool = state_pool
        self.block_size = block_pool.block_size
        self.seed = hash_seed(identity)
        # Invariant 2: indexed checkpoints are never written; least recently used first.
        self._checkpoints: OrderedDict[bytes, _Checkpoint] = OrderedDict()
        self._pending: dict[bytes, _Checkpoint] = {}  # saves scheduled this step, not run yet: not hittable
        # saves whose key is not known yet (a token of the block is a pending sample): key computed at commit
        self._pending_deferred: list[tuple[Callable[[], bytes | None], _Checkpoint]] = []
        self._decode_owners: dict[str, bytes | None] = {}  # request id -> its committed decode checkpoint
        self.max_decode_owners = state_pool.num_checkpoint_slots // 2
        self.queries = 0  # prompt tokens looked up, counted once per request (vllm:prefix_cache_queries)
        self.hits = 0  # of those, tokens served from the cache (vllm:prefix_cache_hits)
        self.num_evictions = 0  # checkpoints evicted to make room for a new one

    @property
    def num_checkpoints(self) -> int:
        return len(self._checkpoints)

    def has_checkpoint(self, key: bytes) -> bool:
        """A checkpoint is indexed or being saved under `key`."""
        return key in self._checkpoints or key in self._pending

    def find_hit(self, block_hashes: list[bytes], max_blocks: int) -> PrefixHit:
        """Walk the cached KV chain of `block_hashes` (at most max_blocks blocks); the hit is the longest
        checkpoint on the walked part (invariants 1 and 2). Changes nothing: `use` commits to a hit."""
        blocks: list[int] = []
        hit_blocks, key = 0, None
        for block_hash in block_hashes[:max_blocks]:
            block = self.block_pool.cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
            if block_hash in self._checkpoints:
                hit_blocks, key = len(blocks), block_hash
        bs = self.block_size
        slot = self._checkpoints[key].slot if key is not None else None
        return PrefixHit(hit_blocks * bs, blocks[:hit_blocks], slot, key, len(blocks) * bs)

    def use(self, hit: PrefixHit, num_prompt_tokens: int | None) -> None:
        """A request starts at `hit`: mark its checkpoint recently used; count it (first start only)."""
        if hit.checkpoint_key is not None:
            self._checkpoints.move_to_end(hit.checkpoint_key)
        if num_prompt_tokens is not None:
            self.queries += num_prompt_tokens
            self.hits += hit.num_tokens

    def reserve(self, key: bytes | Callable[[], bytes | None], owner: str | None = None) -> int | None:
        """A checkpoint slot for a save under `key` (evicting the least recently used checkpoint if none is
        free), or None: `key` is saved already, no slot is left, or `owner` would exceed the decode-checkpoint
        share of the budget. `key` may be a function giving it at commit time (None: drop the save), for a
        block whose last token is still being sampled."""
        deferred = callable(key)
        if not deferred and self.has_checkpoint(key):
            return None
        new_owner = owner is not None and owner not in self._decode_owners
        if new_owner and len(self._decode_owners) >= self.max_decode_owners:
            return None
        if self.state_pool.num_free_checkpoint_slots == 0:
            if not self._checkpoints:
                return None  # every slot is being saved this step
            _, evicted = self._checkpoints.popitem(last=False)
            self.state_pool.free_checkpoint(evicted.slot)
            self.num_evictions += 1
        slot = self.state_pool.allocate_checkpoint()
        if deferred:
            self._pending_deferred.append((key, _Checkpoint(slot, owner)))
        else:
            self._pending[key] = _Checkpoint(slot, owner)
        if new_owner:
            self._decode_owners[owner] = None
        return slot

    def commit_pending(self) -> None:
        """The scheduled saves have run: index them (most recently used). A request's new decode checkpoint
        replaces its previous one. A deferred save whose key turns out to be saved already (or unknowable:
        its request was aborted before the sample came back) frees its slot."""
        for key_of, checkpoint in self._pending_deferred:
            key = key_of()
            if key is None or key in self._pending or key in self._checkpoints:
                self.state_pool.free_checkpoint(checkpoint.slot)
            else:
                self._pending[key] = checkpoint
        self._pending_deferred.clear()
        for key, checkpoint in self._pending.items():
            self._checkpoints[key] = checkpoint
            owner = checkpoint.owner  # set only while its request runs (see release_owner)
            if owner is not None:
                previous = self._decode_owners[owner]
                if previous is not None and self._owned_by(previous, owner):
                    self.drop(previous)
                self._decode_owners[owner] = key
        self._pending.clear()

    def release_owner(self, request_id: str) -> None:
        """The request stopped running (finished, aborted or preempted): its decode checkpoint stays cached
        as an ordinary one; the next turn of a conversation continues from there."""
        key = self._decode_owners.pop(request_id, None)
        if key is not None and self._owned_by(key, request_id):
            self._checkpoints[key].owner = None
        for checkpoint in [*self._pending.values(), *(c for _, c in self._pending_deferred)]:
            if checkpoint.owner == request_id:
                checkpoint.owner = None

    def clear(self) -> None:
        """Drop every checkpoint and zero the counters (nothing may be running: no pending saves, no owners)."""
        if self._pending or self._pending_deferred or self._decode_owners:
            raise RuntimeError("the prefix cache can only be cleared while no request runs")
        for checkpoint in self._checkpoints.values():
            self.state_pool.free_checkpoint(checkpoint.slot)
        self._checkpoints.clear()
        self.queries = self.hits = self.num_evictions = 0

    def drop(self, key: bytes) -> None:
        self.state_pool.free_checkpoint(self._checkpoints.pop(key).slot)

    def _owned_by(self, key: bytes, owner: str) -> bool:
        checkpoint = self._checkpoints.get(key)
        return checkpoint is not None and checkpoint.owner == owner
