"""BlockManager: allocation, reference counts, prefix caching and eviction. No model, no torch."""

from __future__ import annotations

import pytest

from tgserve.server.core.block_manager import BlockManager, hash_block
from tgserve.server.core.request import Request
from tgserve.server.protocol.params import SamplingParams

BS = 4


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(max_new_tokens=8))


def compute(bm: BlockManager, request: Request, num_new: int) -> list[int]:
    """Allocate and pretend the runner computed num_new tokens, as the scheduler and runner would."""
    blocks = bm.allocate_slots(request, num_new)
    assert blocks is not None
    request.num_computed_tokens += num_new
    bm.cache_full_blocks(request, request.num_computed_tokens)
    return blocks


def test_allocate_grows_only_across_block_boundaries_and_free_returns_all() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    req = make_request("a", list(range(6)))
    assert bm.allocate_slots(req, 6) == [0, 1]
    req.num_computed_tokens = 6
    assert bm.allocate_slots(req, 1) == []  # token 7 still fits in block 1
    req.num_computed_tokens = 8
    assert bm.allocate_slots(req, 1) == [2]
    assert bm.get_block_ids("a") == [0, 1, 2]
    assert bm.num_free_blocks == 5 and bm.usage == pytest.approx(3 / 8)
    bm.free(req)
    assert bm.num_free_blocks == 8 and bm.usage == 0.0 and bm.get_block_ids("a") == []
    bm.free(req)  # freeing twice is harmless
    assert bm.num_free_blocks == 8


def test_allocation_failure_changes_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    a, b = make_request("a", list(range(8))), make_request("b", list(range(100, 108)))
    assert bm.allocate_slots(a, 8) == [0, 1]
    assert bm.allocate_slots(b, 8) is None
    assert bm.num_free_blocks == 1 and bm.get_block_ids("b") == []
    assert bm.max_tokens_in_pool == 12


def test_block_zero_is_an_ordinary_block() -> None:
    bm = BlockManager(num_blocks=1, block_size=BS)
    assert bm.allocate_slots(make_request("a", [1, 2, 3]), 3) == [0]


def test_prefix_hit_after_free_and_stats() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = list(range(10))
    a = make_request("a", prompt)
    assert bm.get_computed_blocks(a) == ([], 0)
    bm.count_lookup(a, 0)
    compute(bm, a, 10)
    bm.free(a)
    b = make_request("b", prompt[:8] + [99, 98, 97])
    blocks, n = bm.get_computed_blocks(b)
    assert (blocks, n) == ([0, 1], 8)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (10, 0)  # a lookup alone counts nothing
    bm.count_lookup(b, n)  # admitted with its hit
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (10 + 11, 8)
    bm.count_lookup(b, n)  # counted once until it is freed
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (21, 8)


def test_at_least_one_token_is_left_to_compute() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(8)))
    compute(bm, a, 8)
    bm.free(a)
    # The whole prompt is cached, but the last token must still run to produce logits.
    blocks, n = bm.get_computed_blocks(make_request("b", list(range(8))))
    assert (blocks, n) == ([0], 4)
    blocks, n = bm.get_computed_blocks(make_request("c", list(range(9))))
    assert (blocks, n) == ([0, 1], 8)


def test_only_full_computed_blocks_are_cached() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(12)))
    assert bm.allocate_slots(a, 12) == [0, 1, 2]
    a.num_computed_tokens = 7  # block 1 is allocated but only partly computed
    bm.cache_full_blocks(a, 7)
    assert bm.get_computed_blocks(make_request("b", list(range(12)))) == ([0], 4)
    bm.cache_full_blocks(a, 12)
    assert bm.get_computed_blocks(make_request("c", list(range(13)))) == ([0, 1, 2], 12)


def test_hash_chains_on_the_parent_block() -> None:
    assert hash_block(None, (1, 2)) != hash_block(hash_block(None, (0, 0)), (1, 2))
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_request("a", [0, 0, 0, 0, 5, 6, 7, 8, 1])
    compute(bm, a, 9)
    # Same second block, different first block: no hit at all.
    assert bm.get_computed_blocks(make_request("b", [9, 9, 9, 9, 5, 6, 7, 8, 1])) == ([], 0)


def test_shared_blocks_are_reference_counted() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    prompt = list(range(9))
    a = make_request("a", prompt)
    compute(bm, a, 9)  # blocks 0, 1 full and cached; block 2 partial
    b = make_request("b", prompt)
    computed, n = bm.get_computed_blocks(b)
    assert (computed, n) == ([0, 1], 8)
    new = bm.allocate_slots(b, 1, computed)
    assert new == [0, 1, 3]  # shared prefix plus one private block
    assert bm.num_free_blocks == 2
    bm.free(a)
    assert bm.num_free_blocks == 3  # only a's private block came back
    assert bm.get_block_ids("b") == [0, 1, 3]
    bm.free(b)
    assert bm.num_free_blocks == 6
    assert bm.get_computed_blocks(make_request("c", prompt))[1] == 8  # still cached after both left


def test_touching_free_cached_blocks_counts_against_the_pool() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = make_request("a", list(range(9)))
    compute(bm, a, 9)
    bm.free(a)
    b = make_request("b", list(range(8)) + [50, 51, 52, 53, 54])
    computed, n = bm.get_computed_blocks(b)
    assert (computed, n) == ([0, 1], 8)
    # 13 tokens need 4 blocks: 2 revived from the cache plus 2 fresh, but only 3 exist.
    assert bm.allocate_slots(b, 5, computed) is None
    assert bm.num_free_blocks == 3 and bm.get_block_ids("b") == []
    assert bm.allocate_slots(b, 4, computed) == [0, 1, 2]


def test_eviction_reuses_least_recently_freed_and_drops_hash() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(8)))
    compute(bm, a, 8)
    bm.free(a)  # blocks 0, 1 free but cached; 2, 3 never used
    b = make_request("b", list(range(100, 112)))
    assert bm.allocate_slots(b, 12) == [2, 3, 1]  # never-used blocks first, then a's tail block
    assert bm.get_computed_blocks(make_request("c", list(range(9)))) == ([0], 4)
    assert bm.allocate_slots(make_request("d", [7]), 1) == [0]
    assert bm.get_computed_blocks(make_request("e", list(range(9)))) == ([], 0)


def test_uncached_blocks_are_reused_before_cached_ones() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    a, b = make_request("a", list(range(8))), make_request("b", [50, 51])
    compute(bm, a, 8)  # blocks 0, 1: both full and cached
    compute(bm, b, 2)  # block 2: partial, no hash
    bm.free(a)
    bm.free(b)
    # Block 2 was freed last but holds nothing reusable, so it goes out before a's cached blocks.
    assert bm.allocate_slots(make_request("c", [1]), 1) == [2]
    assert bm.get_computed_blocks(make_request("d", list(range(9)))) == ([0, 1], 8)


def test_duplicate_blocks_computed_concurrently_keep_the_first() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    a, b = make_request("a", list(range(5))), make_request("b", list(range(5)))
    compute(bm, a, 5)
    compute(bm, b, 5)  # computed the same block before a's was cached: b's copy stays private
    bm.free(a)
    assert bm.get_computed_blocks(make_request("c", list(range(5)))) == ([0], 4)
    bm.free(b)
    assert bm.num_free_blocks == 6


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    a = make_request("a", list(range(9)))
    compute(bm, a, 9)
    bm.free(a)
    assert bm.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (0, 0)


def test_computed_blocks_only_for_fresh_requests() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(5)))
    compute(bm, a, 5)
    with pytest.raises(ValueError):
        bm.allocate_slots(a, 1, [0])


def test_invalid_sizes() -> None:
    with pytest.raises(ValueError):
        BlockManager(0, 4)


def test_spill_moves_the_oldest_cold_blocks_to_host_and_frees_them_here():
    """The long-context tier: a request's full, computed blocks between its first and its last
    two go to host blocks held for it; its block list names them past the pool's blocks."""
    from tgserve.server.core.host_tier import HostTier

    bm = BlockManager(num_blocks=8, block_size=2, host_tier=HostTier(4), spill_keep=(1, 2))
    request = Request("long", list(range(16)), SamplingParams(max_new_tokens=4))
    bm.allocate_slots(request, 16)
    request.num_computed_tokens = 16
    blocks = bm.get_block_ids("long")
    assert bm.num_free_blocks == 0 and not bm.spill(request, 6)  # only blocks 1..5 are cold
    assert bm.spill(request, 2)
    moved = bm.take_moved("long")
    assert [i for i, _ in moved] == [1, 2] and [b for _, b in moved] == [8, 9]
    assert bm.get_block_ids("long") == [blocks[0], 8, 9, *blocks[3:]]
    assert bm.num_free_blocks == 2 and bm.take_moved("long") == []
    transfers = bm.take_kv_transfers()
    assert sorted(transfers.offloads) == sorted([(blocks[1], 0), (blocks[2], 1)])
    assert bm.max_tokens_in_pool == (8 + 4) * 2
    assert not bm.swap_out(request)  # a request with host blocks is recomputed, not swapped
    bm.free(request)
    bm.take_kv_transfers()  # the step after: its host blocks are free again
    assert bm.num_free_blocks == 8 and bm.host_tier.num_held_blocks == 0


def test_without_spill_keep_requests_never_spill():
    from tgserve.server.core.host_tier import HostTier

    bm = BlockManager(num_blocks=8, block_size=2, host_tier=HostTier(4))
    request = Request("long", list(range(16)), SamplingParams(max_new_tokens=4))
    bm.allocate_slots(request, 16)
    request.num_computed_tokens = 16
    assert not bm.spill(request, 1) and bm.max_tokens_in_pool == 16
