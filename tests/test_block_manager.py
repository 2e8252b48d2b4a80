"""Block manager: allocation, reference counts, prefix caching. Plain Python, no tensors."""

from __future__ import annotations

import pytest

from kvpush.engine.block_manager import BlockManager
from kvpush.engine.request import Request
from kvpush.engine.sampling_params import SamplingParams


def req(rid: str, n: int, base: int = 0) -> Request:
    return Request(rid, list(range(base, base + n)), SamplingParams())


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = req("a", 10), req("b", 5)
    assert bm.allocate(a, 10) and len(a.block_table) == 3
    assert bm.allocate(b, 5) and len(b.block_table) == 2
    assert not set(a.block_table) & set(b.block_table)
    assert bm.num_free_blocks == 3
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_allocation_failure_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = req("a", 12)
    assert not bm.allocate(a, 12)
    assert a.block_table == [] and bm.num_free_blocks == 2


def test_prefix_cache_hit_shares_blocks_and_keeps_one_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = req("a", 8)
    assert bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    b = req("b", 8)  # identical prompt: a full hit drops its last block
    hits = bm.find_cached_prefix(b)
    assert hits == a.block_table[:1]
    c = req("c", 10)  # longer prompt with the same first 8 tokens
    hits = bm.find_cached_prefix(c)
    assert hits == a.block_table
    assert bm.allocate(c, 2, hits)
    assert c.block_table[:2] == a.block_table
    assert bm.blocks[a.block_table[0]].ref_cnt == 2
    bm.free(a)
    bm.free(c)
    assert bm.num_free_blocks == 16
    bm.check_invariants()


def test_freed_cached_blocks_are_reused_then_forgotten():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = req("a", 4)
    assert bm.allocate(a, 4)
    a.num_computed_tokens = 4
    bm.cache_full_blocks(a)
    bm.free(a)
    assert len(bm.cached) == 2
    b = req("b", 6, base=100)  # needs all three blocks: evicts the cached ones
    assert bm.allocate(b, 6)
    assert bm.cached == {}
    bm.check_invariants()


def test_prefix_caching_disabled_finds_nothing():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = req("a", 8)
    assert bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    assert bm.find_cached_prefix(req("b", 9)) == []


def test_double_free_is_detected():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = req("a", 4)
    assert bm.allocate(a, 4)
    blocks = list(a.block_table)
    bm.free(a)
    with pytest.raises(AssertionError):
        bm.free_blocks(blocks)


def test_a_prefix_cache_reset_forgets_every_blocks_hash_and_a_running_request_registers_again():
    bm = BlockManager(num_blocks=16, block_size=4)
    a, b = req("a", 8), req("b", 8, base=100)
    for r in (a, b):
        assert bm.allocate(r, 8)
        r.num_computed_tokens = 8
        bm.cache_full_blocks(r)
    bm.free(a)  # a's blocks are free but findable; b still holds its own
    assert len(bm.find_cached_prefix(req("a2", 9))) == 2
    assert bm.reset_prefix_cache() == 4
    assert bm.find_cached_prefix(req("a2", 9)) == []  # free: forgotten
    assert bm.find_cached_prefix(req("b2", 9, base=100)) == []  # held (a lease, a running request): too
    assert bm.reset_prefix_cache() == 0
    bm.cache_full_blocks(b)  # b computes on: its full blocks are findable again
    assert bm.find_cached_prefix(req("b2", 9, base=100)) == b.block_table
    bm.free(b)
    bm.check_invariants()
