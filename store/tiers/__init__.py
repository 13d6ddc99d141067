"""Memory tiers (RAGCache on a PagedAttention block pool): GPU over host memory over the store.

    (each tier is a paged block pool of kvcache/: block_pool.py over allocator.py, as the engine's KV pool is)
    knowledge_tree.py  prefix tree over chunk-id sequences, rooted at the preamble (plain Python)
    policies.py        PGDSF, GDSF, LRU, LFU priorities (plain Python)
    cost_profile.py    T(cached, new) grid, bilinear interpolation (plain Python; measured by bench/cost_profile.py)
    reorder.py         cache-aware reordering of queued questions with a starvation window
    lease.py           Lease, CacheStats, as_layers: what an acquire hands out (torch)
    cache.py           TieredKVCache: the facade a long-lived process uses (torch; the modules above import without it)
    (the workload, the replay simulator and the policy ablation are benchmarks: bench/replay.py, `kvrag bench tiers`)
    config.py          --host-cache / --gpu-cache / --cache-policy (resolved with their env vars in kvrag/config.py)

One question's flow: cache.py's docstring. Keys are pre-rotary in the pool as in the store; rotate copies at use
time (gather returns fresh tensors).
"""
