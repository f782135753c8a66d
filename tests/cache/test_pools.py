"""BlockPool and StatePool bookkeeping, without a model."""

import pytest

from deltaserve.cache.block_pool import BlockPool
from deltaserve.cache.state_pool import StatePool


def test_block_pool_never_hands_out_the_null_block_and_counts_references():
    pool = BlockPool(num_blocks=5, block_size=16)
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    blocks = pool.allocate(4)
    assert sorted(blocks) == [1, 2, 3, 4]
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    with pytest.raises(RuntimeError, match="asked for 1 KV blocks, 0 free"):
        pool.allocate(1)
    pool.ref_counts[blocks[0]] += 1  # a second holder of one block
    pool.free(blocks)
    assert pool.num_free_blocks == 3  # the shared block is still held once
    pool.free([blocks[0]])
    assert pool.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([blocks[0]])


def test_block_pool_rejects_a_pool_without_usable_blocks():
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        BlockPool(1, 16)


def test_state_pool_keeps_the_dummy_slot_and_catches_double_free():
    pool = StatePool(3)
    a, b = pool.allocate(), pool.allocate()
    assert {a, b} == {1, 2} and pool.num_free_slots == 0
    with pytest.raises(RuntimeError, match="no free GDN state slot"):
        pool.allocate()
    pool.free(a)
    assert pool.allocate() == a
    with pytest.raises(RuntimeError, match="not in use"):
        pool.free(0)
    with pytest.raises(ValueError, match="num_slots must be >= 2"):
        StatePool(1)
