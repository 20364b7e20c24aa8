"""BlockPool and KVCacheManager: allocation, ref counts, prefix caching, LRU eviction."""

from __future__ import annotations

from inlinelm.sched.block_pool import ROOT_HASH, BlockPool, hash_block
from inlinelm.sched.kv_cache_manager import KVCacheManager
from inlinelm.sched.request import Request
from tests.sched.helpers import make_request

BLOCK = 4


def admit(manager: KVCacheManager, request: Request) -> int:
    """Admit ``request`` with its whole uncached prompt; returns the cached token count."""
    computed = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - computed.num_tokens, computed)
    return computed.num_tokens


def compute_all(manager: KVCacheManager, request: Request) -> None:
    request.num_computed_tokens = request.num_tokens
    manager.cache_full_blocks(request)


def test_allocate_and_free_count_blocks() -> None:
    pool = BlockPool(8)
    assert (pool.num_blocks, pool.num_free_blocks, pool.num_used_blocks) == (8, 8, 0)
    ids = pool.allocate(3)
    assert len(set(ids)) == 3
    assert (pool.num_free_blocks, pool.num_used_blocks) == (5, 3)
    assert all(pool.ref_count(b) == 1 for b in ids)
    pool.free(ids)
    assert pool.num_free_blocks == 8
    assert all(pool.ref_count(b) == 0 for b in ids)


def test_touch_shares_and_free_releases_last_holder() -> None:
    pool = BlockPool(4)
    [block] = pool.allocate(1)
    pool.touch([block])
    assert pool.ref_count(block) == 2
    pool.free([block])
    assert pool.num_used_blocks == 1
    pool.free([block])
    assert pool.num_used_blocks == 0


def test_touch_takes_an_idle_cached_block_off_the_free_queue() -> None:
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.cache(block, hash_block(ROOT_HASH, [1, 2]), [1, 2])
    pool.free([block])
    assert pool.num_free_blocks == 2
    pool.touch([block])
    assert pool.num_free_blocks == 1
    assert pool.allocate(1) != [block]


def test_lookup_checks_tokens_not_just_hash() -> None:
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    key = hash_block(ROOT_HASH, [1, 2])
    pool.cache(block, key, [1, 2])
    assert pool.lookup(key, [1, 2]) == block
    assert pool.lookup(key, [1, 3]) is None


def test_freed_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for i, block in enumerate(blocks):
        pool.cache(block, hash_block(ROOT_HASH, [i]), [i])
    pool.free([blocks[1]])
    pool.free([blocks[0]])
    pool.free([blocks[2]])
    assert pool.num_cached_blocks == 3
    assert pool.allocate(1) == [blocks[1]]
    assert pool.lookup(hash_block(ROOT_HASH, [1]), [1]) is None
    assert pool.lookup(hash_block(ROOT_HASH, [0]), [0]) == blocks[0]
    assert pool.num_cached_blocks == 2


def test_duplicate_content_keeps_the_first_block_indexed() -> None:
    pool = BlockPool(2)
    first, second = pool.allocate(2)
    key = hash_block(ROOT_HASH, [7])
    pool.cache(first, key, [7])
    pool.cache(second, key, [7])
    assert pool.lookup(key, [7]) == first
    pool.free([first, second])
    assert pool.num_free_blocks == 2


def test_caching_disabled_never_indexes() -> None:
    pool = BlockPool(2, enable_caching=False)
    [block] = pool.allocate(1)
    pool.cache(block, hash_block(ROOT_HASH, [1]), [1])
    assert pool.num_cached_blocks == 0


def test_reset_prefix_cache_forgets_everything() -> None:
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    key = hash_block(ROOT_HASH, [1])
    pool.cache(block, key, [1])
    pool.reset_prefix_cache()
    assert pool.lookup(key, [1]) is None


def test_allocate_slots_rounds_up_to_blocks() -> None:
    manager = KVCacheManager(10, BLOCK)
    request = make_request("a", list(range(10, 19)))  # 9 tokens -> 3 blocks
    admit(manager, request)
    assert len(request.block_ids) == 3
    request.num_computed_tokens = 9
    assert manager.allocate_slots(request, 3)  # up to 12 tokens: still 3 blocks
    assert len(request.block_ids) == 3
    assert manager.allocate_slots(request, 4)  # 13 tokens: 4 blocks
    assert len(request.block_ids) == 4


def test_allocate_slots_refuses_without_side_effects() -> None:
    manager = KVCacheManager(2, BLOCK)
    request = make_request("a", list(range(10, 22)))  # 12 tokens -> 3 blocks
    computed = manager.get_computed_blocks(request)
    assert not manager.allocate_slots(request, 12, computed)
    assert request.block_ids == []
    assert manager.num_free_blocks == 2
    assert manager.stats.num_queried_tokens == 0


def test_second_request_with_same_prefix_hits_the_cache() -> None:
    manager = KVCacheManager(16, BLOCK)
    prefix = list(range(100, 110))  # 2 full blocks + 2 tokens
    first = make_request("a", [*prefix, 1, 2, 3])
    assert admit(manager, first) == 0
    compute_all(manager, first)
    second = make_request("b", [*prefix, 4, 5])
    assert admit(manager, second) == 8
    assert second.num_computed_tokens == 8
    assert second.block_ids[:2] == first.block_ids[:2]
    assert manager.block_pool.ref_count(first.block_ids[0]) == 2
    assert manager.stats.num_queried_tokens == 13 + 12
    assert manager.stats.num_hit_tokens == 8


def test_whole_prompt_cached_still_leaves_the_last_token() -> None:
    manager = KVCacheManager(16, BLOCK)
    prompt = list(range(100, 108))  # exactly 2 full blocks
    first = make_request("a", prompt)
    admit(manager, first)
    compute_all(manager, first)
    second = make_request("b", list(prompt))
    assert admit(manager, second) == 4
    assert second.num_uncomputed_tokens == 4


def test_freed_prefix_is_reused_until_evicted() -> None:
    manager = KVCacheManager(4, BLOCK)
    prompt = list(range(100, 109))
    first = make_request("a", prompt)
    admit(manager, first)
    compute_all(manager, first)
    manager.free(first)
    assert manager.num_free_blocks == 4
    second = make_request("b", list(prompt))
    assert admit(manager, second) == 8
    manager.free(second)
    # A request needing every block evicts the cached prefix.
    third = make_request("c", list(range(200, 216)))
    assert admit(manager, third) == 0
    manager.free(third)
    assert manager.get_computed_blocks(make_request("d", list(prompt))).num_tokens == 0


def test_idle_cached_hits_count_against_free_blocks() -> None:
    manager = KVCacheManager(3, BLOCK)
    prompt = list(range(100, 108))
    first = make_request("a", prompt)
    admit(manager, first)
    compute_all(manager, first)
    manager.free(first)
    # Hits one idle cached block and needs 2 new ones: 3 taken from the free queue.
    second = make_request("b", [*prompt[:4], *range(300, 308)])
    assert admit(manager, second) == 4
    assert manager.num_free_blocks == 0
    manager.free(second)
    assert manager.num_free_blocks == 3
