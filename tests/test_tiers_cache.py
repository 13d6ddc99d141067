"""TieredKVCache by hand: priorities, clocks, leaf-only eviction, swap-out-only-once, pins, sharing."""

from __future__ import annotations

import pytest
import torch

from kvrag.errors import KvragError
from kvrag.kvcache.allocator import BlockLayout
from kvrag.store.tiers.cache import TieredKVCache
from kvrag.store.tiers.cost_profile import CostProfile
from kvrag.store.tiers.knowledge_tree import GPU, HOST, STORE
from kvrag.store.tiers.lease import as_layers
from kvrag.store.tiers.policies import GDSF, LFU, LRU, PGDSF, AccessStats, make_policy
from kvrag.tests.tier_invariants import check_invariants

LAYOUT = BlockLayout(1, 1, 2, "float32", 4)  # 16 B per token, 64 B per block
BLOCK = LAYOUT.bytes_per_block
# T(cached, new) = new/1000 * (1 + cached/1000) s exactly (bilinear): per token (1 + cached/1000) ms
PROFILE = CostProfile((0, 1000), (1000,), ((1.0,), (2.0,)))


def kv(n: int, seed: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    base = torch.arange(n * 2, dtype=torch.float32).view(n, 1, 2)
    return [(base + seed, -(base + seed))]


def ask(cache: TieredKVCache, ids: str, lengths: list[int], suffix: int = 0, release: bool = True, **kw):
    """One request: acquire, insert what is below the match (content keyed by path), release."""
    lease = cache.acquire(list(ids), lengths, suffix, **kw)
    kvs = [kv(lengths[i], 100.0 * len(ids[: i + 1]) + ord(ids[i])) for i in range(lease.matched, len(ids))]
    cache.insert(lease, kvs)
    if release:
        cache.release(lease)
    check_invariants(cache)
    return lease


def node(cache: TieredKVCache, path: str):
    nodes = cache.tree.match(list(path))
    assert len(nodes) == len(path), f"{path} is not cached"
    return nodes[-1]


def cached_paths(cache: TieredKVCache) -> set[str]:
    return {"".join(n.path) for n in cache.tree.nodes()}


def test_profile_is_the_hand_formula():
    assert PROFILE.per_token(0, 8) == pytest.approx(1e-3)
    assert PROFILE.per_token(8, 4) == pytest.approx(1.008e-3)


def test_pgdsf_priorities_clocks_and_leaf_only_eviction():
    cache = TieredKVCache(LAYOUT, 4 * BLOCK, policy="pgdsf", cost=PROFILE)
    ask(cache, "a", [8])  # a: F=1, Cost/Size = T(0, 8)/8 = 1e-3
    assert node(cache, "a").priority[HOST] == pytest.approx(1e-3)
    ask(cache, "ab", [8, 4])  # a hit: F=2; b computed behind 8 cached tokens: 1.008e-3 per token
    assert node(cache, "a").priority[HOST] == pytest.approx(2e-3)
    assert node(cache, "ab").priority[HOST] == pytest.approx(1.008e-3)
    assert cache.used_bytes() == 3 * BLOCK

    ask(cache, "c", [8])  # needs 2 blocks, 1 free: the only leaf, b, goes; the clock rises to its priority
    assert cached_paths(cache) == {"a", "c"}
    assert cache.clocks[HOST] == pytest.approx(1.008e-3)
    assert node(cache, "c").priority[HOST] == pytest.approx(1.008e-3 + 1e-3)

    ask(cache, "d", [4])  # a (2e-3) < c (2.008e-3): a goes
    assert cached_paths(cache) == {"c", "d"}
    assert cache.clocks[HOST] == pytest.approx(2e-3)
    assert node(cache, "d").priority[HOST] == pytest.approx(3e-3)
    assert cache.stats.evictions[HOST] == 2


@pytest.mark.parametrize("policy, left, clock", [
    ("lru", {"c", "d"}, 2.0),  # a last used at tick 2, c at 3
    ("lfu", {"a", "d"}, 1.0),  # a used twice, c once
    ("gdsf", {"c", "d"}, 2e-3),  # a: 0 + 2 x 1e-3; c: clock 1e-3 + 1e-3; the tie goes to the older (a)
])
def test_other_policies_same_stream(policy, left, clock):
    cache = TieredKVCache(LAYOUT, 4 * BLOCK, policy=policy, cost=PROFILE)
    for ids, lengths in (("a", [8]), ("ab", [8, 4]), ("c", [8]), ("d", [4])):
        ask(cache, ids, lengths)
    assert cached_paths(cache) == left
    assert cache.clocks[HOST] == pytest.approx(clock)


def test_policy_formulas():
    s = AccessStats(size=10, frequency=3, last_access=7, cost_sum=0.5, cost_count=2, solo_cost=0.1)
    assert PGDSF().priority(s, 1.0) == pytest.approx(1.0 + 3 * 0.25)
    assert GDSF().priority(s, 1.0) == pytest.approx(1.0 + 3 * 0.1)
    assert LRU().priority(s, 1.0) == 7
    assert LFU().priority(s, 1.0) == 3
    assert AccessStats(size=4, solo_cost=0.2).cost_per_token == 0.2  # never computed: the chunk's own cost
    assert make_policy("PGDSF").name == "pgdsf"
    with pytest.raises(KvragError, match="unknown cache policy"):
        make_policy("arc")


def test_pgdsf_averages_cost_per_uncached_token_over_computing_requests():
    # T(0, 4) = 0.4 s (0.1 per token); T(0, 12) extrapolates to 0.8 s (1/15 per token)
    profile = CostProfile((0, 100), (4, 8), ((0.4, 0.6), (0.4, 0.6)))
    cache = TieredKVCache(LAYOUT, 2 * BLOCK, policy="pgdsf", cost=profile)
    ask(cache, "a", [4])
    ask(cache, "x", [8])  # evicts a; its statistics stay with its path
    assert cached_paths(cache) == {"x"}
    ask(cache, "a", [4], suffix=8)  # computed again, now with 12 new tokens in the request
    a = node(cache, "a")
    assert (a.stats.frequency, a.stats.cost_count) == (2, 2)
    assert a.stats.cost_per_token == pytest.approx((0.1 + 0.8 / 12) / 2)
    assert a.priority[HOST] == pytest.approx(cache.clocks[HOST] + 2 * a.stats.cost_per_token)


def test_measured_cost_replaces_the_profile():
    cache = TieredKVCache(LAYOUT, 8 * BLOCK, cost=PROFILE)
    with cache.acquire(["a"], [8], 2) as lease:
        (a,) = cache.insert(lease, [kv(8, 0)], cost_s=0.5)
    assert a.stats.cost_per_token == pytest.approx(0.5 / 10)


def test_only_leaves_are_evicted_even_at_lowest_priority():
    cache = TieredKVCache(LAYOUT, 3 * BLOCK, policy="lru", cost=PROFILE)
    ask(cache, "ab", [4, 4])
    ask(cache, "c", [4])
    node(cache, "a").priority[HOST] = -100.0  # the parent is the least valuable, but has a child
    ask(cache, "d", [4])
    assert cached_paths(cache) == {"a", "c", "d"}  # b went, not a
    ask(cache, "e", [4])  # now a is a leaf
    assert "a" not in cached_paths(cache)


def test_pins_protect_and_insert_is_best_effort():
    cache = TieredKVCache(LAYOUT, 2 * BLOCK, cost=PROFILE)
    ask(cache, "a", [8])
    held = cache.acquire(["a"], [8])
    lease = ask(cache, "b", [4])
    assert lease.inserted == [] and cache.stats.not_inserted == 1  # no room: a is pinned
    assert "a" in cached_paths(cache)
    cache.release(held)
    cache.release(held)  # idempotent
    assert node(cache, "a").pins == 0
    ask(cache, "b", [4])
    assert cached_paths(cache) == {"b"}
    with pytest.raises(ValueError, match="once"):
        cache.insert(held, [kv(8, 0)])


def test_too_big_chunk_and_what_lies_below_it_are_not_cached():
    cache = TieredKVCache(LAYOUT, 2 * BLOCK, cost=PROFILE)
    lease = ask(cache, "abc", [4, 12, 4])
    assert [n.chunk_id for n in lease.inserted] == ["a"]
    assert cache.stats.not_inserted == 2


def test_swap_out_only_once_and_gpu_above_host():
    cache = TieredKVCache(LAYOUT, 8 * BLOCK, 2 * BLOCK, cost=PROFILE, gpu_device="cpu")
    ask(cache, "a", [8])
    assert set(node(cache, "a").tables) == {GPU}
    ask(cache, "b", [8])  # a leaves the GPU for the first time: copied to host
    a = node(cache, "a")
    assert set(a.tables) == {HOST} and a.swapped_out and cache.stats.swap_outs == 1
    host_table = a.tables[HOST]

    lease = ask(cache, "a", [8])  # a hit on host: promoted to the GPU (b swapped out), host copy kept
    assert lease.tiers == [GPU]
    assert set(a.tables) == {GPU, HOST} and cache.stats.swap_ins == 1 and cache.stats.swap_outs == 2

    ask(cache, "b", [8])  # a leaves the GPU again: just freed, never copied twice
    assert set(a.tables) == {HOST} and a.tables[HOST] is host_table
    assert cache.stats.swap_outs == 2 and cache.stats.evictions[GPU] == 3
    assert torch.equal(cache.gather([a])[0, 0], kv(8, 100.0 + ord("a"))[0][0])


def test_child_of_a_host_node_goes_to_host_and_gathers_across_tiers():
    cache = TieredKVCache(LAYOUT, 8 * BLOCK, 2 * BLOCK, cost=PROFILE, gpu_device="cpu")
    ask(cache, "a", [4])
    ask(cache, "b", [8])  # a swapped out
    lease = ask(cache, "ab", [4, 4], promote=False)
    assert set(node(cache, "ab").tables) == {HOST}
    assert lease.tiers == [HOST, GPU]  # b below the miss: its stored KV (depth 1) is on the GPU
    with cache.acquire(["a"], [4]):  # promoted to the GPU (b swapped out to make room)
        pass
    with cache.acquire(["a", "b", "z"], [4, 4, 4], promote=False) as lease:
        assert lease.tiers == [GPU, HOST, STORE]
        k = cache.gather(lease.prefix)[0, 0]  # [8, 1, 2]: a from the GPU, ab from host
        assert torch.equal(k, torch.cat([kv(4, 100.0 + ord("a"))[0][0], kv(4, 200.0 + ord("b"))[0][0]]))
        k0, _ = cache.gather_layer(lease.prefix, 0)
        assert torch.equal(k0, k)
    check_invariants(cache)


def test_peek_changes_nothing():
    cache = TieredKVCache(LAYOUT, 8 * BLOCK, cost=PROFILE)
    ask(cache, "ab", [4, 4])
    before = node(cache, "a").stats.frequency
    assert cache.peek(["a", "b", "c"], [4, 4, 6], 3) == (8, 9)
    assert node(cache, "a").stats.frequency == before


def test_identical_blocks_are_shared_with_the_stored_kv():
    cache = TieredKVCache(LAYOUT, 5 * BLOCK, cost=PROFILE)
    stored = kv(8, 1.0)
    with cache.acquire(["a"], [8]) as lease:
        cache.insert(lease, [stored])
    blended = [(stored[0][0].clone(), stored[0][1].clone())]
    blended[0][0][6] += 1  # one recomputed token, in block 1
    with cache.acquire(["b", "a"], [4, 8]) as lease:
        assert lease.tiers == [STORE, HOST] and lease.memory_node(1) is node(cache, "a")
        cache.insert(lease, [kv(4, 2.0), blended])
    a, ba = node(cache, "a"), node(cache, "ba")
    assert ba.tables[HOST].blocks[0] == a.tables[HOST].blocks[0] != a.tables[HOST].blocks[0] + 1
    assert ba.tables[HOST].blocks[1] != a.tables[HOST].blocks[1]
    assert cache.stats.shared_blocks == 1 and cache.used_bytes() == 4 * BLOCK
    check_invariants(cache)
    a.priority[HOST] = -1.0  # make the base the victim
    ask(cache, "c", [8])  # 1 block free, 2 needed: evicting a frees only its unshared block
    assert cached_paths(cache) == {"b", "ba", "c"} and cache.stats.evictions[HOST] == 1
    assert cache.pools[HOST].allocator.refcount(ba.tables[HOST].blocks[0]) == 1
    assert torch.equal(cache.gather([ba])[0, 0], blended[0][0])


def test_put_stored_serves_a_chunk_anywhere_below_the_first_miss():
    cache = TieredKVCache(LAYOUT, 8 * BLOCK, cost=PROFILE, preamble_tokens=10)
    with cache.acquire(["x", "c"], [4, 8]) as lease:
        assert lease.tiers == [STORE, STORE]
        cache.insert(lease, [kv(4, 1.0), kv(8, 2.0)])  # the path x/c, as blended
    c = cache.put_stored("c", kv(8, 5.0))  # c as the store holds it
    assert c is not None and c.path == ("c",) and cache.put_stored("c", kv(8, 6.0)) is c
    assert c.stats.cost_per_token == pytest.approx(PROFILE.per_token(10, 8))
    with cache.acquire(["y", "c"], [4, 8]) as lease:
        assert lease.tiers == [STORE, HOST] and lease.memory_node(1) is c
        assert torch.equal(cache.gather([lease.memory_node(1)])[0, 0], kv(8, 5.0)[0][0])
    with pytest.raises(ValueError, match="expected 1 layers"):
        cache.put_stored("d", [kv(4, 0)[0], kv(4, 0)[0]])
    check_invariants(cache)


def test_insert_checks_shapes_and_as_layers():
    cache = TieredKVCache(LAYOUT, 8 * BLOCK, cost=PROFILE)
    with cache.acquire(["a"], [4]) as lease:
        with pytest.raises(ValueError, match="expected 1 layers of \\[4, 1, 2\\]"):
            cache.insert(lease, [kv(5, 0)])
    with cache.acquire(["a"], [4]) as lease:
        cache.insert(lease, [kv(4, 3.0)])
        (k, v), = as_layers(cache.gather(lease.inserted))
        assert torch.equal(k, kv(4, 3.0)[0][0]) and torch.equal(v, kv(4, 3.0)[0][1])
    with pytest.raises(ValueError, match="lengths"):
        cache.acquire(["a", "b"], [4])


def test_gpu_budget_without_cuda_is_a_user_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA is here")
    with pytest.raises(KvragError, match="needs a CUDA device"):
        TieredKVCache(LAYOUT, BLOCK, BLOCK)
