"""CacheManager: gives each request the KV blocks and GDN state slot its next step needs and takes them back;
with prefix caching on, it also finds hits, places checkpoints and indexes full blocks.

The scheduler calls, per step:
    find_hit(request)               a waiting request's longest reusable prefix (a PrefixHit; empty when off)
    cut_chunk(request, start, n)    shortens a prefill chunk so that it ends at a checkpoint target
    admit(request, n, hit)          starts a waiting request at its hit; allocate(request, n) grows a running one
    plan_saves(request, n)          the checkpoints this step takes: (working slot, checkpoint slot, offset)
and after the step has run:
    commit_checkpoints()            the step's saves are written: make them hittable
    cache_full_blocks(request)      index the request's newly computed full blocks

Where checkpoints go (each is a chunk end: invariant 3, "a prefill chunk must end at L to save at L", or,
when L is at most one block before the chunk's end and at least one block after its start, a save inside
the step: the GDN layers copy the state out after the chunk's first L - start tokens and go on; a 16-token
tail would otherwise cost a whole step, a pass over the weights):
    divergence   where a prompt branches off another prompt: at the end M of the prefix it shares with the
                 cached blocks and the prompts being computed beside it (cache/in_flight.py), when a block of
                 another prompt continues that prefix with other tokens (capped as below; unless another live
                 request is to save it already). Every later prompt that shares the prefix past M hits M.
                 Where the shared chain just ends or goes on only in an output (a conversation's next turn
                 resends the previous one, perhaps without its reasoning) no checkpoint goes, unless the cached
                 chain runs at least one decode-checkpoint interval past the hit (its checkpoints were evicted
                 or never saved): the chunk must end there, so each turn would pay a step of its own for a
                 checkpoint no later turn uses (the next turn hits this one's prompt end)
    prompt end   at floor((P-1)/bs)*bs, the longest hit a resend of the same P-token prompt can use
    decode       at the latest multiple of DECODE_CHECKPOINT_INTERVAL tokens (a whole number of blocks) a running
                 request has passed past its prompt end: one per request, replaced as it passes the next, so that
                 when it finishes the cache holds the state where the next turn of a conversation continues
                 (prompt + output), at most an interval before its end
"""

from __future__ import annotations

from deltaserve.cache.block_pool import BlockPool
from deltaserve.cache.in_flight import InFlightPrompts
from deltaserve.cache.prefix_cache import PrefixCache, PrefixHit, extend_block_hashes
from deltaserve.cache.state_pool import StatePool
from deltaserve.request import Request


# A checkpoint saved inside a step needs at least this many of the chunk's tokens before it: more than the conv
# window (W - 1 = 3 for every Qwen3.5 / Qwen3-Next config; the GDN layer checks).
MID_CHUNK_SAVE_MIN_HEAD = 4
# Tokens between a decoding request's checkpoints, rounded up to whole blocks. Each save copies a whole GDN state
# slot (147 MiB on Qwen3.5-27B), so a save at every block boundary would copy several slots a decode step; the
# next turn recomputes at most this many tokens more, in the same step as its new message.
DECODE_CHECKPOINT_INTERVAL = 64


class CacheManager:
    def __init__(self, block_pool: BlockPool, state_pool: StatePool, prefix_cache: PrefixCache | None = None,
                 decode_checkpoint_interval: int | None = None):
        """prefix_cache None turns prefix caching off: no hashing, no hits, no checkpoints.
        decode_checkpoint_interval: None for DECODE_CHECKPOINT_INTERVAL."""
        self.block_pool = block_pool
        self.state_pool = state_pool
        self.prefix_cache = prefix_cache
        self.block_size = block_pool.block_size
        self.in_flight = InFlightPrompts(self.block_size, prefix_cache.seed) if prefix_cache is not None else None
        interval = DECODE_CHECKPOINT_INTERVAL if decode_checkpoint_interval is None else decode_checkpoint_interval
        if interval < 1:
            raise ValueError(f"decode_checkpoint_interval must be a positive number of tokens, got {interval}")
        # decode checkpoints go at multiples of this many tokens (whole blocks)
        self.decode_checkpoint_stride = -(-interval // self.block_size) * self.block_size

    # -- blocks and slots ----------------------------------------------------------------------------------

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Blocks to add so that the cache can hold num_computed_tokens + num_new_tokens tokens."""
        total = request.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(request.block_ids))

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Give `request` room for `num_new_tokens` more tokens; False (and nothing taken) if it does not fit.
        (Once a step for every running sequence: a decode token that fits its last block takes nothing.)"""
        need_slot = request.state_slot is None
        num_blocks = self.blocks_needed(request, num_new_tokens)
        if (need_slot and self.state_pool.num_free_slots == 0) or num_blocks > self.block_pool.num_free_blocks:
            return False
        if need_slot:
            request.state_slot = self.state_pool.allocate()
        if num_blocks:
            request.block_ids.extend(self.block_pool.allocate(num_blocks))
        return True

    def admit(self, request: Request, num_new_tokens: int, hit: PrefixHit) -> bool:
        """Start a waiting request (new or preempted) at `hit`: share the hit's cached blocks, take a working
        slot and blocks for `num_new_tokens` tokens past the hit. False (and nothing taken) if it does not fit.

        The caller copies the hit's checkpoint into the working slot before the forward (state_restores).
        """
        if request.block_ids or request.state_slot is not None:
            raise RuntimeError(f"request {request.request_id!r} still holds cache: it cannot be admitted again")
        if self.state_pool.num_free_slots == 0:
            return False
        start = hit.num_tokens
        num_new_blocks = -(-(start + num_new_tokens) // self.block_size) - len(hit.block_ids)
        # hit blocks nobody holds sit in the free count: taking them leaves fewer for the new blocks
        if num_new_blocks + self.block_pool.num_unheld(hit.block_ids) > self.block_pool.num_free_blocks:
            return False
        self.block_pool.touch(hit.block_ids)  # first, so that allocate's evictions cannot take them
        request.block_ids = hit.block_ids + self.block_pool.allocate(num_new_blocks)
        request.state_slot = self.state_pool.allocate()
        request.num_computed_tokens = start
        request.num_indexed_blocks = len(hit.block_ids)
        if self.prefix_cache is not None:
            keys = [request.block_hashes[t // self.block_size - 1] for t in request.checkpoint_targets]
            self.in_flight.add(request, len(hit.block_ids), keys)
            first_start = request.num_preemptions == 0
            if first_start:
                request.num_cached_tokens = start
            self.prefix_cache.use(hit, request.num_prompt_tokens if first_start else None)
        return True

    def free(self, request: Request) -> None:
        """Release the request's blocks and slot; cached blocks and checkpoints stay in the cache (invariant 4)."""
        self.block_pool.free(request.block_ids)
        request.block_ids = []
        request.num_indexed_blocks = 0
        if request.state_slot is not None:
            self.state_pool.free(request.state_slot)
            request.state_slot = None
        if self.prefix_cache is not None:
            self.prefix_cache.release_owner(request.request_id)
            self.in_flight.remove(request)

    # -- prefix caching ------------------------------------------------------------------------------------

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up, once per request (vllm:prefix_cache_queries); 0 with caching off."""
        return self.prefix_cache.queries if self.prefix_cache is not None else 0

    @property
    def prefix_cache_hits(self) -> int:
        """Of those, tokens served from the cache (vllm:prefix_cache_hits)."""
        return self.prefix_cache.hits if self.prefix_cache is not None else 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached KV block and GDN checkpoint (no request may hold cache)."""
        if self.prefix_cache is not None:
            self.block_pool.forget_cached()
            self.prefix_cache.clear()

    def find_hit(self, request: Request) -> PrefixHit:
        """The longest prefix a waiting request can reuse, capped at num_tokens - 1 (invariant 2). Also sets
        the request's checkpoint targets for this run (divergence point and prompt end). Takes nothing."""
        if self.prefix_cache is None:
            return PrefixHit()
        self._hash_blocks(request)
        last_boundary = (request.num_tokens - 1) // self.block_size * self.block_size
        hit = self.prefix_cache.find_hit(request.block_hashes, last_boundary // self.block_size)
        request.last_prompt_boundary = last_boundary
        divergence = self._divergence_point(request, hit, last_boundary // self.block_size)
        request.checkpoint_targets = sorted({t for t in (divergence, last_boundary) if t > hit.num_tokens})
        return hit

    def _divergence_point(self, request: Request, hit: PrefixHit, max_blocks: int) -> int:
        """The divergence checkpoint target of a prompt about to start at `hit` (0: none; see the module): the
        end of its chain over cached blocks and blocks of prompts being computed, if another prompt's block goes
        on there with other tokens (a branch point), else the end of its cached chain if that lies an interval
        or more past the hit; none if another live request is to save it. (At the cap, max_blocks, the point
        is the prompt end, a target anyway.)"""
        bs, hashes = self.block_size, request.block_hashes
        end = hit.num_chain_tokens // bs
        while end < max_blocks and (self.in_flight.has_block(hashes[end])
                                    or self.block_pool.cached_block(hashes[end]) is not None):
            end += 1
        # another prompt's block continues hashes[end - 1]; this prompt's own next block is not known: they differ
        if end and (self.block_pool.has_prompt_child(hashes[end - 1]) or self.in_flight.has_child(hashes[end - 1])):
            point = end * bs
        elif hit.num_chain_tokens - hit.num_tokens >= self.decode_checkpoint_stride:
            point = hit.num_chain_tokens
        else:
            return 0
        return 0 if self.in_flight.is_to_be_saved(hashes[point // bs - 1], point) else point

    def cut_chunk(self, request: Request, start: int, num_new_tokens: int) -> int:
        """`num_new_tokens`, or fewer so that the chunk from `start` ends at the request's next checkpoint
        target that is not cached yet (invariant 3), unless that target can be saved inside the step."""
        target = self._uncached_target(request, start, start + num_new_tokens)
        if target is None or self._saves_mid_chunk(start, target, start + num_new_tokens):
            return num_new_tokens
        return target - start

    def _uncached_target(self, request: Request, start: int, end: int) -> int | None:
        """The first checkpoint target strictly inside (start, end) without a checkpoint yet."""
        for target in request.checkpoint_targets:
            if start < target < end and not self.prefix_cache.has_checkpoint(
                    request.block_hashes[target // self.block_size - 1]):
                return target
        return None

    def _saves_mid_chunk(self, start: int, target: int, end: int) -> bool:
        """Whether a target inside the chunk [start, end) is saved inside the step rather than cut at: it is
        within one block of the end (the prompt-end target always is) and at least one block, and
        MID_CHUNK_SAVE_MIN_HEAD tokens, after the start (the conv state there is then the chunk's own last W-1
        inputs before it)."""
        return end - target <= self.block_size and target - start >= max(self.block_size, MID_CHUNK_SAVE_MIN_HEAD)

    def plan_saves(self, request: Request, num_new_tokens: int) -> list[tuple[int, int, int]]:
        """The checkpoints of this step's chunk of `num_new_tokens` from num_computed_tokens, as (working slot,
        checkpoint slot, offset): the state after the chunk's first `offset` tokens goes to the checkpoint
        slot. offset == num_new_tokens: copied after the forward; smaller: inside it (see cut_chunk). Empty
        when the chunk holds no checkpoint or no slot is left."""
        if self.prefix_cache is None:
            return []
        start = request.num_computed_tokens
        end = start + num_new_tokens
        saves = []
        target = self._uncached_target(request, start, end)
        if target is not None and self._saves_mid_chunk(start, target, end):
            slot = self._reserve(request, target, owner=None)
            if slot is not None:
                saves.append((request.state_slot, slot, target - start))
        if end == 0 or end % self.block_size:
            return saves
        if end in request.checkpoint_targets:
            owner = None
        elif end > request.last_prompt_boundary and end % self.decode_checkpoint_stride == 0:
            owner = request.request_id  # a decode checkpoint: replaces the request's previous one
        else:
            return saves
        slot = self._reserve(request, end, owner)
        if slot is not None:
            saves.append((request.state_slot, slot, num_new_tokens))
        return saves

    def _reserve(self, request: Request, end: int, owner: str | None) -> int | None:
        """A checkpoint slot for the state after the request's first `end` tokens (a block boundary), keyed by
        the hash of the block ending there; None when no slot is left."""
        block = end // self.block_size - 1
        self._hash_blocks(request)
        if block < len(request.block_hashes):
            key = request.block_hashes[block]
        else:  # the block ends with a token still being sampled (async scheduling): key it at commit time
            def key():
                self._hash_blocks(request)
                return request.block_hashes[block] if block < len(request.block_hashes) else None
        return self.prefix_cache.reserve(key, owner)

    def commit_checkpoints(self) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.commit_pending()

    def cache_full_blocks(self, request: Request) -> None:
        """Index the request's full blocks whose tokens are all computed, so that other requests can share them."""
        if self.prefix_cache is None:
            return
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= request.num_indexed_blocks:
            return
        self._hash_blocks(request)
        hashes, num_prompt_blocks = request.block_hashes, request.num_prompt_tokens // self.block_size
        for i in range(request.num_indexed_blocks, num_full):
            parent = (hashes[i - 1] if i else self.prefix_cache.seed) if i < num_prompt_blocks else None
            self.block_pool.cache_block(request.block_ids[i], hashes[i], parent)
        request.num_indexed_blocks = num_full

    def _hash_blocks(self, request: Request) -> None:
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, self.prefix_cache.seed)
