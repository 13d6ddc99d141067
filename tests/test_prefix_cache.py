"""The prefix cache inside the paged pool (kvcache/prefix_cache.py), on hand-made block tables: chained keys, exact and
blended entries, the cache's own reference, eviction least recently used first, and the bound."""

from __future__ import annotations

import hashlib

from kvrag.kvcache.allocator import BlockAllocator
from kvrag.kvcache.prefix_cache import PrefixCache, block_keys

B = 4  # rows a block


def _cache(blocks: int = 8, max_blocks: int = 8) -> tuple[BlockAllocator, PrefixCache]:
    allocator = BlockAllocator(blocks)
    return allocator, PrefixCache(allocator, B, max_blocks)


def test_keys_chain_every_id_before_them_and_the_salt():
    ids = list(range(10))
    keys = block_keys(ids, B)
    assert len(keys) == 2  # whole blocks only
    assert block_keys(ids[:8], B) == keys  # a prefix's keys are the prompt's first ones
    assert block_keys([99, *ids[1:]], B)[1] != keys[1]  # a different first id changes every later key
    assert block_keys(ids, B, salt="alice") != keys
    # by hand: the salt's length (4 little-endian bytes) and the salt, then each block's ids as 4 little-endian
    # bytes, chained
    digest = hashlib.blake2b(bytes(4), digest_size=16, person=b"kvrag-prefix")
    digest.update(bytes([0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0]))
    assert keys[0] == digest.hexdigest()


def test_a_salt_never_passes_for_a_prompts_first_ids():
    """One tenant's salt "x" and prompt [A, B] against another's salt "x" + A's four bytes and prompt [B]: without
    the salt's length in the hash the second's first block key was the first's second, a hit on rows of another
    tenant's prompt at another position."""
    a, b = 0x00636261, 7  # A's little-endian bytes spell "abc\0"
    first = block_keys([a, b], 1, salt="x")
    assert block_keys([b], 1, salt="xabc\0")[0] not in first


def test_a_match_takes_a_reference_and_stops_at_the_first_missing_or_blended_block():
    allocator, cache = _cache()
    ids = list(range(13))
    table = allocator.allocate(4)  # a sequence's blocks: 3 whole blocks of ids and a partial one
    cache.insert(ids, table, "", exact_rows=6)  # rows 0-5 exact: block 0 exact, blocks 1-2 blended
    assert len(cache) == 3 and [allocator.refcount(b) for b in table] == [2, 2, 2, 1]
    blocks, exact_rows = cache.match(ids, "", exact=False)
    assert blocks == table[:3] and exact_rows == 4 and allocator.refcount(table[0]) == 3
    allocator.decref(blocks)
    blocks, exact_rows = cache.match(ids, "", exact=True)
    assert blocks == table[:1] and exact_rows == 4
    allocator.decref(blocks)
    assert cache.match([*ids[:4], 77, *ids[5:]], "", exact=False)[0] == table[:1]  # differs in block 1
    allocator.decref(table[:1])
    assert cache.match(ids, "bob", exact=False) == ([], 0)  # another tenant's
    assert cache.cached_rows(ids, "") == 12


def test_blocks_are_evictable_once_no_sequence_holds_them_and_go_least_recently_used_first():
    allocator, cache = _cache()
    a, b = allocator.allocate(2), allocator.allocate(2)
    cache.insert([1] * 8, a, "", 8)
    cache.insert([2] * 8, b, "", 8)
    assert cache.evictable() == 0  # both sequences still hold theirs
    allocator.decref(a + b)  # the sequences finish
    assert cache.evictable() == 4 and allocator.num_free == 4
    cache.match([1] * 8, "", exact=False)  # a is used again: b is now the least recent
    assert cache.evictable() == 2  # a's blocks are held again
    allocator.check()  # the count kept as references change agrees with a scan
    allocator.decref(a)
    assert cache.evict(2) == 2 and allocator.num_free == 6 and cache.evictable() == 2
    allocator.check()
    assert cache.cached_rows([2] * 8, "") == 0 and cache.cached_rows([1] * 8, "") == 8
    # within a prompt the tail goes before the head
    assert cache.evict(1) == 1 and cache.cached_rows([1] * 8, "") == 4


def test_an_exact_block_replaces_a_blended_one_and_the_bound_holds():
    allocator, cache = _cache(max_blocks=2)
    blended, exact = allocator.allocate(1), allocator.allocate(1)
    cache.insert([5] * 4, blended, "", 0)
    cache.insert([5] * 4, exact, "", 4)
    assert allocator.refcount(blended[0]) == 1 and allocator.refcount(exact[0]) == 2  # the cache moved its reference
    assert cache.match([5] * 4, "", exact=True)[0] == exact
    allocator.decref(exact)
    cache.insert([5] * 4, blended, "", 0)  # a blended one never replaces an exact one
    assert allocator.refcount(blended[0]) == 1
    more = allocator.allocate(3)
    cache.insert([6] * 12, more, "", 12)
    assert len(cache) == 2  # the bound: the least recent entries dropped
    allocator.check()
    assert PrefixCache(allocator, B, 0).insert([7] * 4, allocator.allocate(1), "", 4) is None  # 0: caching off


def test_a_block_is_cached_under_one_key():
    """A table inserted again under other ids (a turn kept with its answer, say) leaves a block already cached where
    it is: one entry, one reference of the cache's, so the count of evictable blocks stays right."""
    allocator, cache = _cache()
    table = allocator.allocate(2)
    cache.insert([1] * 8, table, "", 8)
    cache.insert([2] * 8, table, "", 8)
    assert len(cache) == 2 and [allocator.refcount(b) for b in table] == [2, 2]
    allocator.decref(table)
    assert cache.evictable() == 2 and cache.cached_rows([2] * 8, "") == 0
    allocator.check()
