"""The memory tiers' invariants (store/tiers/cache.py), asserted by the tests after each step."""

from __future__ import annotations

from kvrag.store.tiers.cache import TieredKVCache
from kvrag.store.tiers.knowledge_tree import GPU, HOST


def check_invariants(cache: TieredKVCache) -> None:
    """Every node in a tier, GPU nodes under GPU nodes, block refcounts equal to the tables holding them, pools
    within their budgets."""
    with cache._lock:
        refs: dict[str, dict[int, int]] = {tier: {} for tier in cache.tiers}
        for node in cache.tree.nodes():
            assert node.tables, f"{node} is in no tier"
            assert node.pins >= 0
            if GPU in node.tables:
                assert node.parent.is_root or GPU in node.parent.tables, f"{node}: GPU node under a host node"
                assert not node.swapped_out or HOST in node.tables, f"{node}: swapped out but no host copy"
            for tier, table in node.tables.items():
                assert not table.freed and node in cache._members[tier]
                for b in table.blocks:
                    refs[tier][b] = refs[tier].get(b, 0) + 1
        for tier, pool in cache.pools.items():
            pool.allocator.check()
            assert all(n.alive and tier in n.tables for n in cache._members[tier])
            for b, count in refs[tier].items():
                assert pool.allocator.refcount(b) == count, f"{tier} block {b}: {count} tables"
            assert pool.allocator.num_used == len(refs[tier]), f"{tier}: a block is held by no table"
            assert pool.capacity_bytes <= cache.budgets[tier], f"{tier} pool is over its budget"
