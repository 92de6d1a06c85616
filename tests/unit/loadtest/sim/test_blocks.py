"""The block pool: chain hashes name full blocks; free cached blocks are evicted oldest first."""

import pytest

from loadtest.sim.blocks import ROOT_HASH, BlockPool, hash_blocks
from loadtest.sim.kv_events import EventLog


def test_a_block_hash_covers_its_parent_so_equal_tokens_after_another_prefix_differ() -> None:
    a = [0, 1, 2, 3, 7, 7, 7, 7]
    b = [9, 9, 9, 9, 7, 7, 7, 7]
    ha, hb = hash_blocks(a, 4), hash_blocks(b, 4)
    assert ha[0] == hash((ROOT_HASH, (0, 1, 2, 3)))
    assert ha[1] == hash((ha[0], (7, 7, 7, 7)))
    assert ha[1] != hb[1]  # same ids in the second block, different parents
    assert hash_blocks([*a, 1, 2, 3], 4) == ha  # a partial last block has no hash


def test_a_prompt_shorter_than_a_block_has_no_hash() -> None:
    assert hash_blocks([1, 2, 3], 4) == []


def test_a_hit_shares_a_block_held_by_another_sequence_without_taking_a_free_one() -> None:
    pool = BlockPool(4)
    held = pool.allocate(2)
    pool.cache(held, [11, 12])
    assert pool.cached_prefix([11, 12, 13]) == held
    assert pool.cached_prefix([12]) == held[1:]
    assert pool.cached_prefix([99, 12]) == []  # a run must start at the first block
    assert pool.free_among(held) == 0
    pool.touch(held)
    assert pool.num_free == 2
    pool.release(held)  # one holder left: nothing goes back to the free queue
    assert pool.num_free == 2
    pool.release(held)
    assert pool.num_free == 4 and pool.num_cached == 2


def test_free_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    pool = BlockPool(4)
    first, second = pool.allocate(2), pool.allocate(2)
    pool.cache(first, [1, 2])
    pool.cache(second, [3, 4])
    pool.release(second)
    pool.release(first)
    # free queue: second's blocks (last first), then first's
    assert pool.allocate(1) == [second[1]]
    assert not pool.is_cached(4) and pool.is_cached(3)
    assert pool.allocate(2) == [second[0], first[1]]
    assert [pool.is_cached(h) for h in (1, 2, 3)] == [True, False, False]
    assert pool.cached_prefix([1, 2]) == first[:1]


def test_a_hit_takes_its_block_out_of_the_free_queue_so_it_is_not_evicted() -> None:
    pool = BlockPool(3)
    old = pool.allocate(3)
    pool.cache(old, [1, 2, 3])
    pool.release(old)  # free queue: old[2], old[1], old[0]
    assert pool.free_among(old[:1]) == 1
    pool.touch(old[:1])  # a new prompt hits the first block
    assert pool.num_free == 2
    assert pool.allocate(2) == [old[2], old[1]]
    assert pool.cached_prefix([1, 2, 3]) == old[:1]
    with pytest.raises(ValueError, match="1 blocks asked for, 0 free"):
        pool.allocate(1)


def test_a_hash_already_cached_keeps_its_block_and_the_copy_stays_unnamed() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(1), pool.allocate(1)
    pool.cache(a, [5])
    pool.cache(b, [5])
    assert pool.cached_prefix([5]) == a and pool.num_cached == 1


def test_blocks_cached_in_a_row_are_one_stored_event_and_evictions_one_a_block() -> None:
    # vLLM's cache_full_blocks tells one BlockStored for the blocks a step names; its
    # evictions are one BlockRemoved a block. The gateway's decoding cost follows the count.
    log = EventLog(block_size=2)
    pool = BlockPool(4, events=log)
    first = pool.allocate(2)
    pool.cache(first, [11, 12], token_ids=[1, 2, 3, 4], block_size=2)
    second = pool.allocate(2)
    # 11 is cached already: the copy stays unnamed and the run after it starts at 13
    pool.cache(second, [11, 13], parent=None, token_ids=[1, 2, 5, 6], block_size=2)
    stored = [e for e in log.pending if e["type"] == "BlockStored"]
    assert [(e["block_hashes"], e["parent_block_hash"], e["token_ids"]) for e in stored] == [
        ([11, 12], None, [1, 2, 3, 4]),
        ([13], 11, [5, 6]),
    ]
    assert all(len(e["extra_keys"]) == len(e["block_hashes"]) for e in stored)
    log.pending.clear()
    pool.release(first)
    pool.release(second)
    pool.allocate(4)  # every cached block evicted
    assert sorted(e["block_hashes"][0] for e in log.pending) == [11, 12, 13]
    assert all(e["type"] == "BlockRemoved" and len(e["block_hashes"]) == 1 for e in log.pending)
