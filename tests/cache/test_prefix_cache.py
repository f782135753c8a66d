"""The prefix index without a model: block hash chain, LRU eviction of KV blocks and checkpoints, hit lookup."""

import pytest

from deltaserve.cache.block_pool import BlockPool
from deltaserve.cache.prefix_cache import PrefixCache, extend_block_hashes, hash_seed
from deltaserve.cache.state_pool import StatePool

BS = 4


def chain(tokens, seed=b"seed", block_size=BS):
    hashes = []
    extend_block_hashes(hashes, tokens, block_size, seed)
    return hashes


def make_cache(num_blocks=9, working=3, checkpoints=4):
    blocks, states = BlockPool(num_blocks, BS), StatePool(working, checkpoints)
    return PrefixCache(blocks, states, "model|float32"), blocks, states


def index_prompt(cache, tokens):
    """A request computed `tokens`: its full blocks are indexed, then released (cached-free)."""
    hashes = chain(tokens, cache.seed)
    blocks = cache.block_pool.allocate(len(hashes))
    for block, h, parent in zip(blocks, hashes, [cache.seed] + hashes[:-1]):
        assert cache.block_pool.cache_block(block, h, parent)
    cache.block_pool.free(blocks)
    return hashes, blocks


def save(cache, key, owner=None):
    slot = cache.reserve(key, owner)
    cache.commit_pending()
    return slot


def test_hash_chain_names_the_whole_prefix():
    tokens = list(range(10))
    hashes = chain(tokens)
    assert len(hashes) == 2  # the partial third block is not hashed
    assert chain(tokens[:8]) == hashes and chain(tokens + [5, 6]) == hashes + chain(tokens + [5, 6])[2:]
    # a different first token changes every later hash, though the later blocks' tokens are equal
    other = chain([99] + tokens[1:])
    assert other[0] != hashes[0] and other[1] != hashes[1]
    assert chain(tokens, seed=b"other model")[0] != hashes[0]
    assert len(hashes[0]) == 16 and hash_seed("a") != hash_seed("b")
    # incremental extension equals hashing all at once
    grown = chain(tokens[:5])
    extend_block_hashes(grown, tokens + [1, 2, 3, 4], BS, b"seed")
    assert grown == chain(tokens + [1, 2, 3, 4])


def test_block_pool_reuses_cached_blocks_and_evicts_least_recently_used_tail_first():
    pool = BlockPool(7, BS)  # 6 usable
    a = pool.allocate(3)
    for i, b in enumerate(a):
        pool.cache_block(b, bytes([i]), bytes([i - 1]) if i else b"seed")
    pool.free(a)  # all three cached-free; freed last block first, so a[2] is the least recently used
    assert pool.num_free_blocks == 6 and pool.num_cached_blocks == 3 and pool.usage == 0.0
    assert pool.cached_block(bytes([1])) == a[1]
    assert pool.num_unheld([a[0], a[1]]) == 2
    pool.touch([a[0], a[1]])  # a prefix hit holds the first two
    assert pool.ref_counts[a[0]] == 1 and pool.num_free_blocks == 4
    fresh = pool.allocate(4)  # three truly free blocks first, then the LRU cached-free block a[2]
    assert a[2] in fresh and pool.cached_block(bytes([2])) is None and pool.num_evictions == 1
    assert pool.cached_block(bytes([0])) == a[0]  # held blocks are never evicted
    with pytest.raises(RuntimeError, match="asked for 1 KV blocks, 0 free"):
        pool.allocate(1)
    pool.free([a[0], a[1]])
    pool.free(fresh)
    assert pool.num_free_blocks == 6 and pool.num_cached_blocks == 2


def test_block_pool_rejects_bad_caching():
    pool = BlockPool(4, BS)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, b"h", b"seed")
    assert not pool.cache_block(b, b"h", b"seed")  # a duplicate stays private and is freed to the free list
    pool.free([a, b])
    assert pool.num_cached_blocks == 1 and pool.num_free_blocks == 3
    with pytest.raises(RuntimeError, match="not held"):
        pool.cache_block(b, b"other", b"seed")
    with pytest.raises(RuntimeError, match="not cached"):
        pool.touch([b])
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        BlockPool(4, 0)


def test_block_pool_knows_which_prefixes_an_indexed_block_continues():
    """A branch point is a prefix that an indexed prompt block continues: counted per parent hash, dropped with
    the last such block's eviction. A duplicate is not indexed, an output block (no prompt parent) not counted."""
    pool = BlockPool(6, BS)  # 5 usable
    a, b, c, d, e = pool.allocate(5)
    assert pool.cache_block(a, b"h1", b"seed") and pool.cache_block(b, b"h2", b"h1")
    assert pool.cache_block(c, b"h2'", b"h1") and not pool.cache_block(d, b"h2", b"h1")
    assert pool.cache_block(e, b"h3", None)  # continues h2 with output tokens
    assert pool.has_prompt_child(b"seed") and pool.has_prompt_child(b"h1") and not pool.has_prompt_child(b"h2")
    pool.free([a, b, c, d, e])  # LRU: e, c, b, then a; d goes to the free list
    taken = pool.allocate(3)  # d, then evicts e and c: b still continues h1
    assert pool.cached_block(b"h2'") is None and pool.has_prompt_child(b"h1")
    taken += pool.allocate(1)  # evicts b
    assert not pool.has_prompt_child(b"h1") and pool.has_prompt_child(b"seed")
    pool.free(taken)
    pool.forget_cached()  # a, the last indexed block
    assert not pool.has_prompt_child(b"seed")


def test_state_pool_keeps_working_and_checkpoint_slots_apart():
    pool = StatePool(3, 2)  # slot 0 dummy, 1-2 working, 3-4 checkpoints
    assert pool.total_slots == 5
    assert {pool.allocate(), pool.allocate()} == {1, 2}
    assert [pool.allocate_checkpoint(), pool.allocate_checkpoint()] == [3, 4]
    with pytest.raises(RuntimeError, match="no free GDN checkpoint slot"):
        pool.allocate_checkpoint()
    with pytest.raises(RuntimeError, match="checkpoint slot 1 is not in use"):
        pool.free_checkpoint(1)
    pool.free_checkpoint(4)
    assert pool.num_free_checkpoint_slots == 1 and pool.num_free_slots == 0
    with pytest.raises(ValueError, match="num_checkpoint_slots must be >= 0"):
        StatePool(3, -1)


def test_hit_is_the_longest_checkpoint_on_the_cached_chain():
    cache, pool, _ = make_cache()
    tokens = list(range(100, 114))  # 3 full blocks + 2 tokens
    hashes, blocks = index_prompt(cache, tokens)
    assert cache.find_hit(hashes, 3).num_tokens == 0  # KV without a state checkpoint is no hit
    slot4 = save(cache, hashes[0])
    slot8 = save(cache, hashes[1])
    hit = cache.find_hit(hashes, 3)
    assert (hit.num_tokens, hit.block_ids, hit.checkpoint_slot, hit.num_chain_tokens) == (8, blocks[:2], slot8, 12)
    assert cache.find_hit(hashes, 1).num_tokens == 4  # the caller's cap (prompt_len - 1) wins
    assert cache.find_hit(hashes, 1).checkpoint_slot == slot4
    # a prompt that diverges inside the second block reuses the first only
    other = chain(tokens[:6] + [7, 7, 7, 7, 7, 7], cache.seed)
    hit = cache.find_hit(other, 3)
    assert (hit.num_tokens, hit.num_chain_tokens) == (4, 4)
    # invariant 1: evicting the first block makes every later checkpoint unreachable ...
    pool.touch(blocks[1:3])
    pool.allocate(pool.num_free_blocks)  # takes the free blocks, then evicts blocks[0]
    assert pool.cached_block(hashes[0]) is None
    assert cache.find_hit(hashes, 3).num_tokens == 0
    assert cache.num_checkpoints == 2  # ... but they stay in their LRU until evicted


def test_checkpoint_lru_eviction_one_save_per_key_and_pending_saves_are_not_hits():
    cache, _, states = make_cache(checkpoints=2)
    hashes, _ = index_prompt(cache, list(range(13)))
    s0, s1 = save(cache, hashes[0]), save(cache, hashes[1])
    cache.use(cache.find_hit(hashes, 1), None)  # a hit at 4 tokens: hashes[0] becomes the most recently used
    s2 = cache.reserve(hashes[2])  # evicts the least recently used checkpoint, hashes[1]
    assert s2 == s1 != s0 and cache.num_evictions == 1
    assert not cache.has_checkpoint(hashes[1]) and cache.has_checkpoint(hashes[2])
    assert cache.reserve(hashes[2]) is None  # one save per key
    assert cache.find_hit(hashes, 3).num_tokens == 4  # the pending save is not written yet
    cache.commit_pending()
    hit = cache.find_hit(hashes, 3)
    assert (hit.num_tokens, hit.checkpoint_slot) == (12, s2)
    assert {cache.reserve(b"x" * 16), cache.reserve(b"y" * 16)} == {s0, s2}
    assert cache.reserve(b"z" * 16) is None  # every slot is being saved this step
    cache.commit_pending()
    assert cache.num_checkpoints == 2 and states.num_free_checkpoint_slots == 0


def test_decode_checkpoints_replace_each_other_and_are_capped_at_half_the_budget():
    cache, _, states = make_cache(checkpoints=4)  # at most 2 owners
    keys = chain(list(range(40)), cache.seed)
    save(cache, keys[0], owner="a")
    save(cache, keys[1], owner="a")  # replaces a's previous one
    assert not cache.has_checkpoint(keys[0]) and cache.has_checkpoint(keys[1])
    save(cache, keys[2], owner="b")
    assert cache.reserve(keys[3], owner="c") is None  # a third owner would pass half the budget
    cache.release_owner("a")  # a finished: its last decode checkpoint becomes an ordinary one
    save(cache, keys[4], owner="c")
    save(cache, keys[5], owner="c")
    assert cache.has_checkpoint(keys[1]) and not cache.has_checkpoint(keys[4])
    assert cache.num_checkpoints == 3 and states.num_free_checkpoint_slots == 1
    cache.release_owner("b")
    cache.release_owner("c")
    save(cache, keys[6])  # ordinary ones are evicted in LRU order only
    save(cache, keys[7])
    assert not cache.has_checkpoint(keys[1]) and cache.num_checkpoints == 4
