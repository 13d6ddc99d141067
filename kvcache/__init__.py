"""The paged KV pool's parts, shared by the engine's pool (engine/kv_pool.py) and the memory tiers (store/tiers/):

    allocator.py     block layout, block tables, the free list, reference counts, cached blocks kept evictable
                     (plain Python)
    block_pool.py    one pool's preallocated KV tensor: gather and write through block tables, copy-on-write
    prefix_cache.py  the chained-hash index of cached blocks (salted), exact-or-blended marks, LRU eviction

The engine's SequenceKV (engine/kv_pool.py) puts them together under one budget, running and cached blocks alike; it
lives with the engine because it hands the model its rows (model/ is above this folder, which store/ imports).
"""
