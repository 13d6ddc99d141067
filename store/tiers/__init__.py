"""Memory tiers (RAGCache on a PagedAttention block pool): GPU over host memory over the store.

    (each tier is a paged block pool of kvcache/: block_pool.py over allocator.py, as the engine's KV pool is)
    knowledge_tree.py  prefix tree over chunk-id sequences, rooted at the preamble (plain Python)
    policies.py        PGDSF, GDSF, LRU, LFU priorities (plain Python)
    cost_profile.py    T(cached, new) grid, bilinear interpolation, JSON cache (plain Python)
    reorder.py         cache-aware reordering of queued questions with a starvation window
    cache.py           TieredKVCache: the facade a long-lived process uses
    (the workload, the replay simulator and the policy ablation are benchmarks: bench/replay.py, `kvrag bench tiers`)
    config.py          --host-cache / --gpu-cache / --cache-policy (resolved with their env vars in kvrag/config.py)

One question's flow (`ask --questions`, `bench`):

    cache = TieredKVCache.from_config(CacheConfig.from_options(host_cache, gpu_cache, policy,
                                                               cuda_available=torch.cuda.is_available()),
                                      BlockLayout.for_codec(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, codec),
                                      cost=profile, preamble_tokens=len(prompt.preamble))
    with cache.acquire(chunk_ids, [len(p) for p in prompt.passages], len(prompt.suffix)) as lease:
        prefix = as_layers(cache.gather(lease.prefix, device))    # exact KV of chunks [0, matched)
        for i in range(lease.matched, len(chunk_ids)):           # below the first miss: blend
            node = lease.memory_node(i)                          # stored KV in memory, or None
            if node is None:
                kv_i = <KVTable.get_layer(...) per layer>        # a store read
                cache.put_stored(chunk_ids[i], kv_i)             # in memory next time, wherever it stands
            else:
                kv_i = as_layers(cache.gather([node], device))   # or cache.gather_layer(...) per layer
        ... blended prefill over preamble + prefix + kv_i + suffix ...
        cache.insert(lease, [chunk_kv(i) for i in range(lease.matched, len(chunk_ids))])  # as blended
    # the lease unpins on exit; decode from the prompt's KV as before

Keys are pre-rotary in the pool as in the store; rotate copies at use time (gather returns fresh tensors).
"""

from kvrag.kvcache.allocator import BlockAllocator, BlockLayout, BlockTable
from kvrag.store.tiers.config import CacheConfig, format_bytes, parse_bytes
from kvrag.store.tiers.cost_profile import CostProfile
from kvrag.store.tiers.knowledge_tree import GPU, HOST, STORE, KnowledgeTree, Node
from kvrag.store.tiers.policies import POLICY_CLASSES, make_policy
from kvrag.store.tiers.reorder import ReorderQueue, order_priority

_TORCH_NAMES = {"TieredKVCache"}  # from cache.py, which needs torch
_LEASE_NAMES = {"CacheStats", "Lease", "as_layers"}  # from lease.py, which needs torch too


def __getattr__(name: str):
    """Import the torch side on first use, so the bookkeeping modules import without torch."""
    if name in _TORCH_NAMES:
        from kvrag.store.tiers import cache

        return getattr(cache, name)
    if name in _LEASE_NAMES:
        from kvrag.store.tiers import lease

        return getattr(lease, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "GPU", "HOST", "POLICY_CLASSES", "STORE", "BlockAllocator", "BlockLayout", "BlockTable", "CacheConfig",
    "CacheStats", "CostProfile", "KnowledgeTree", "Lease", "Node", "ReorderQueue", "TieredKVCache",
    "as_layers", "format_bytes", "make_policy", "order_priority", "parse_bytes",
]
