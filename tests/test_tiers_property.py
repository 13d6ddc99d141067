"""Random request streams (hypothesis): the tiers never exceed their budgets, never evict a node in use,
and always hand back the right chunk's KV for its path."""

from __future__ import annotations

import random
import zlib

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvrag.kvcache.allocator import BlockLayout
from kvrag.store.tiers.cache import TieredKVCache
from kvrag.store.tiers.config import POLICIES
from kvrag.store.tiers.lease import CacheStats
from kvrag.tests.tier_invariants import check_invariants

LAYOUT = BlockLayout(2, 1, 2, "float32", 4)
BLOCK = LAYOUT.bytes_per_block
LENGTHS = {"a": 3, "b": 4, "c": 5, "d": 9, "e": 2, "f": 13}


def content(path: tuple[str, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A path's KV: distinct integers per path and token (exact in float32). Below depth 1, about two
    tokens in three keep the chunk's stored values, as after blending, so some blocks equal the stored
    KV's and get shared with it."""
    n = LENGTHS[path[-1]]
    own = zlib.crc32("/".join(path).encode()) % 5000 + 1
    stored = zlib.crc32(path[-1].encode()) % 5000 + 5001
    keep = [len(path) > 1 and (own + t // 2) % 3 != 0 for t in range(n)]
    tag = torch.tensor([stored if keep[t] else own for t in range(n)], dtype=torch.float32)  # [T]
    if len(path) == 1:
        tag.fill_(stored)
    t = torch.arange(n, dtype=torch.float32)
    layers = []
    for layer in range(LAYOUT.n_layers):
        k = (tag * 100 + t + layer * 50)[:, None, None] + torch.tensor([0.0, 0.5])  # [T, 1, 2]
        layers.append((k, -k))
    return layers


def expected(paths: list[tuple[str, ...]]) -> torch.Tensor:
    parts = [torch.stack([torch.stack([k, v]) for k, v in content(p)]) for p in paths]  # [L, 2, T, H, D] each
    return torch.cat(parts, dim=2)


chunk = st.sampled_from("aaabbbccddef")  # skewed, so paths repeat
ask_op = st.tuples(st.just("ask"), st.lists(chunk, min_size=1, max_size=4),
                   st.integers(0, 4), st.booleans(), st.integers(0, 6), st.booleans())
release_op = st.tuples(st.just("release"))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(POLICIES), gpu_blocks=st.integers(0, 8), host_blocks=st.integers(1, 16),
       slack=st.integers(0, BLOCK - 1),
       ops=st.lists(st.one_of(ask_op, ask_op, ask_op, release_op), min_size=4, max_size=40))
def test_random_streams_keep_budgets_pins_and_contents(policy, gpu_blocks, host_blocks, slack, ops):
    stats = run_stream(policy, gpu_blocks, host_blocks, slack, ops)
    for name, value in (("evicted", sum(stats.evictions.values())), ("swapped out", stats.swap_outs),
                        ("swapped in", stats.swap_ins), ("shared a block", stats.shared_blocks),
                        ("refused an insert", stats.not_inserted), ("hit a prefix", stats.prefix_hits)):
        event(f"{name}: {'yes' if value else 'no'}")


def test_long_random_streams():
    """Longer streams than hypothesis likes to draw, so swap-ins, sharing and refusals all happen."""
    totals = CacheStats()
    for seed in range(16):
        rng = random.Random(seed)
        ops = []
        for _ in range(150):
            if rng.random() < 0.2:
                ops.append(("release",))
            else:
                ids = [rng.choice("aaabbbccddef") for _ in range(rng.randint(1, 4))]
                ops.append(("ask", ids, rng.randint(0, 4), rng.random() < 0.5, rng.randint(0, 6), rng.random() < 0.7))
        stats = run_stream(POLICIES[seed % 4], rng.randint(0, 8), rng.randint(4, 16), rng.randrange(BLOCK), ops)
        totals.swap_ins += stats.swap_ins
        totals.swap_outs += stats.swap_outs
        totals.shared_blocks += stats.shared_blocks
        totals.not_inserted += stats.not_inserted
    assert min(totals.swap_ins, totals.swap_outs, totals.shared_blocks, totals.not_inserted) > 0


def run_stream(policy: str, gpu_blocks: int, host_blocks: int, slack: int, ops: list) -> CacheStats:
    budgets = {"host": host_blocks * BLOCK + slack, "gpu": gpu_blocks * BLOCK + slack if gpu_blocks else 0}
    cache = TieredKVCache(LAYOUT, budgets["host"], budgets["gpu"], policy, gpu_device="cpu")
    open_leases = []
    for op in ops:
        if op[0] == "release":
            if open_leases:
                cache.release(open_leases.pop(0))
        else:
            _, ids, n_insert, hold, suffix, use_base = op
            lease = cache.acquire(ids, [LENGTHS[c] for c in ids], suffix, use_base=use_base)
            paths = [tuple(ids[: i + 1]) for i in range(lease.matched)]
            if paths:
                assert torch.equal(cache.gather(lease.prefix), expected(paths))
            for i in range(lease.matched, len(ids)):
                node = lease.memory_node(i)
                assert (node is not None) == (lease.tiers[i] != "store")
                if node is not None:
                    assert node.path == (ids[i],)
                    assert torch.equal(cache.gather([node]), expected([(ids[i],)]))
            rest = range(lease.matched, min(len(ids), lease.matched + n_insert))
            inserted = cache.insert(lease, [content(tuple(ids[: i + 1])) for i in rest])
            for i, node in enumerate(inserted, start=lease.matched):
                assert node.path == tuple(ids[: i + 1])
                assert torch.equal(cache.gather([node]), expected([node.path]))
            if use_base:  # keep what came from the store in memory too
                for i in range(lease.matched, len(ids)):
                    if lease.tiers[i] == "store":
                        node = cache.put_stored(ids[i], content((ids[i],)))
                        assert node is None or torch.equal(cache.gather([node]), expected([(ids[i],)]))
            open_leases.append(lease)
            if not hold or len(open_leases) > 3:
                cache.release(open_leases.pop(0))
        check_invariants(cache)
        for tier, pool in cache.pools.items():
            assert pool.used_bytes <= pool.capacity_bytes <= budgets[tier]
        for lease in open_leases:  # nothing in use was evicted, and it still holds the right KV
            for node in lease.pinned:
                assert node.alive and node.tables and node.pins > 0
                assert torch.equal(cache.gather([node]), expected([node.path]))
    for lease in open_leases:
        cache.release(lease)
    for node in cache.tree.nodes():
        assert node.pins == 0
        for tier in node.tables:  # every copy in every tier is right, not only the fastest one
            got = cache.pools[tier].gather([node.tables[tier]])
            assert torch.equal(got, expected([node.path]))
    return cache.stats
