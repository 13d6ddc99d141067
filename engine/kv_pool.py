"""The running sequences' KV: one paged block pool under a byte budget (vLLM's PagedAttention layout).

    pool.kv: [n_layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim]  in the model's dtype

Keys are stored rotated to their positions (decode reads them as they are), unlike the memory tiers' pools,
which keep keys before rotary. The preamble's full blocks are computed once and shared by reference by every
sequence; the block holding the preamble's tail and the first prompt tokens is each sequence's own. A shared
block is copied before it is written (BlockPool.make_private), so a sequence never writes into another's KV.
The pool is also the prefix cache (kvcache/prefix_cache.py): whole blocks of earlier prompts stay in it under their
chained hash, evictable once no sequence holds them, and a later prompt's table starts with the ones it matches.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvrag.kernels.attention import RowTally
from kvrag.kvcache.allocator import BlockLayout, BlockTable
from kvrag.kvcache.block_pool import BlockPool
from kvrag.kvcache.prefix_cache import PrefixCache
from kvrag.model.cache import DecodeCache
from kvrag.model.prefill import PagedRows
from kvrag.model.transformer import Transformer


class SequenceKV:
    def __init__(self, model: Transformer, budget_bytes: int, block_size: int = 16, cache_bytes: int = 0):
        c = model.cfg
        layout = BlockLayout(c.n_layers, c.n_kv_heads, c.head_dim, str(model.dtype).removeprefix("torch."), block_size)
        self.pool = BlockPool.for_budget(layout, budget_bytes, model.device)
        if self.pool.num_blocks < 2:
            raise ValueError(f"a KV budget of {budget_bytes} bytes holds fewer than 2 blocks of {block_size} tokens")
        self.block_size = block_size
        self.shared: list[int] = []  # the preamble's full blocks, held once here and referenced by every table
        self.shared_tokens = 0
        # cached blocks, at most cache_bytes' worth (0: no prefix caching), within the same budget as running ones
        self.prefix = PrefixCache(self.pool.allocator, block_size, cache_bytes // layout.bytes_per_block)
        self.spill = None  # the prefix cache's blocks spilled to the store (engine/prefix_spill.py), where kept
        self.admitted_rows = 0  # prompt rows copied into the pool so far (a prefix hit's matched rows are not)
        self.read_out = RowTally()  # cached rows copied out of the pool since, per layer read (a gather or a pack)

    @property
    def copied_rows(self) -> int:
        """Rows copied into the pool and out of it: what a hit read wholly in place would leave at the tail's rows."""
        return self.admitted_rows + self.read_out.gathered + self.read_out.packed

    @property
    def num_free(self) -> int:
        """Blocks a sequence may take: free ones, and cached ones no sequence holds (evicted as they are taken)."""
        return self.pool.num_free + self.prefix.evictable()

    def _room(self, n: int) -> None:
        """At least n free blocks, evicting cached ones no sequence holds where the free list is short (OutOfBlocks
        from the allocation that follows, when even that is not enough)."""
        short = n - self.pool.num_free
        if short > 0:
            self.prefix.evict(short)

    def allocate(self, n: int) -> list[int]:
        """n blocks, a reference on each for the caller, evicting cached blocks no sequence holds where needed;
        OutOfBlocks when even that is not enough."""
        self._room(n)
        return self.pool.allocator.allocate(n)

    def cache_blocks(self, ids: Sequence[int], blocks: list[int], salt: str, exact_rows: int) -> None:
        """A sequence's whole blocks into the prefix cache (rows 0.. are `ids`, the first exact_rows exact), and its
        exact ones into the store's prefix table where the engine keeps one."""
        self.prefix.insert(ids, blocks, salt, exact_rows)
        if self.spill is not None:
            self.spill.save(ids, blocks, salt, exact_rows)

    def blocks_needed(self, n_tokens: int) -> int:
        """Fresh blocks a sequence of n_tokens takes at most (fewer when it shares the preamble's)."""
        return self.pool.layout.blocks_for(n_tokens)

    def share_prefix(self, cache: DecodeCache, n_tokens: int) -> None:
        """Keep the whole blocks of the first n_tokens of `cache` (the preamble) as every sequence's shared start."""
        n_blocks = n_tokens // self.block_size
        if n_blocks == 0 or self.shared:
            return
        table = self.pool.allocate(n_blocks * self.block_size)
        self._copy_rows(table, cache, 0, table.n_tokens)
        self.shared, self.shared_tokens = list(table.blocks), table.n_tokens

    def admit(self, cache: DecodeCache, n_tokens: int, hit: list[int] | None = None) -> BlockTable:
        """A table holding the first n_tokens of a prefilled cache: `hit`, the prefix cache's blocks its rows start
        with (their references handed over), else the shared blocks by reference where the cache starts with exactly
        their KV (a full prefill computes the preamble in its own pass, to other bits); the rest copied. OutOfBlocks
        (nothing taken, the hit's references still the caller's) when the pool lacks room."""
        if hit:
            shared, new_refs = hit, []
        else:
            shared = self.shared if n_tokens > self.shared_tokens and self._starts_shared(cache) else []
            new_refs = shared
        fresh = self.allocate(self.pool.layout.blocks_for(n_tokens) - len(shared))
        self.pool.share(new_refs)
        table = BlockTable(list(shared) + fresh, n_tokens, self.block_size)
        self._copy_rows(table, cache, len(shared) * self.block_size, n_tokens)
        self.admitted_rows += max(0, n_tokens - len(shared) * self.block_size)
        return table

    def release(self, blocks: list[int]) -> None:
        """Drop references taken on blocks (a prefix hit no table took)."""
        self.pool.allocator.decref(blocks)

    def paged_rows(self, blocks: list[int]) -> PagedRows:
        """The rows of whole blocks, in order, where the pool holds them (keys rotated): no copy. The caller holds
        references on the blocks while it reads them."""
        k, v = self.layer_views()  # [L, N * B, Hkv, hd] each
        return PagedRows(k, v, self.rows(BlockTable(list(blocks), len(blocks) * self.block_size, self.block_size)),
                         self.read_out)

    def _starts_shared(self, cache: DecodeCache) -> bool:
        if not self.shared:
            return False
        k, v = self.layer_views()
        slots = self.rows(BlockTable(self.shared, self.shared_tokens, self.block_size))  # [P]
        n = self.shared_tokens
        return all(torch.equal(k[layer, slots], cache.k[layer, :n]) and torch.equal(v[layer, slots], cache.v[layer, :n])
                   for layer in range(k.shape[0]))

    def grow(self, table: BlockTable) -> None:
        """Room for one more token at position table.n_tokens: a new block when the last one is full, a private
        copy of the last block when it is shared. OutOfBlocks when the pool has no block left."""
        if table.n_tokens % self.block_size == 0:
            table.blocks.extend(self.allocate(1))
        else:
            if self.pool.allocator.refcount(table.blocks[-1]) > 1:
                self._room(1)
            self.pool.make_private(table, [len(table.blocks) - 1])
        table.n_tokens += 1

    def keep_rows(self, table: BlockTable, rows: torch.Tensor) -> None:
        """Only a table's rows `rows` stay, moved to its first m slots, and the blocks past them go back to the
        pool: rows [m] (every layer and head alike) or [L, Hkv, m] (each layer and KV head its own, ascending). The
        slots below the first moved row stay where they are, so shared blocks (the preamble's, which a decode-time
        budget never drops) are never written."""
        k, v = self.layer_views()
        m = int(rows.shape[-1])
        rows = rows.expand(k.shape[0], k.shape[2], m)  # [L, Hkv, m]
        first_moved = _first_moved(rows)
        private = table.blocks_of(range(first_moved, m))
        self._room(sum(1 for j in private if self.pool.allocator.refcount(table.blocks[j]) > 1))
        self.pool.make_private(table, private)
        slots = self.rows(table)  # [T], after any private copy
        src, dst = slots[rows[..., first_moved:]], slots[first_moved:m]  # [L, Hkv, m'], [m']
        heads = torch.arange(k.shape[2], device=slots.device)
        for layer in range(k.shape[0]):  # each head's rows gathered first: a source may be another's destination
            k[layer].index_copy_(0, dst, k[layer][src[layer].T, heads])
            v[layer].index_copy_(0, dst, v[layer][src[layer].T, heads])
        n_blocks = self.pool.layout.blocks_for(m)
        self.pool.allocator.decref(table.blocks[n_blocks:])
        del table.blocks[n_blocks:]
        table.n_tokens = m

    def free(self, table: BlockTable) -> None:
        self.pool.free(table)

    def layer_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every layer as flat token slots: [L, num_blocks * block_size, Hkv, hd] each (views)."""
        flat = self.pool.kv.flatten(2, 3)  # [L, 2, N*B, Hkv, hd]
        return flat[:, 0], flat[:, 1]

    def rows(self, table: BlockTable) -> torch.Tensor:
        """The flat slots of a table's tokens [T]: where its K and V rows live in `layer_views`."""
        return self.pool.slot_index([table])

    def last_slots(self, tables: Sequence[BlockTable]) -> torch.Tensor:
        """Each table's newest row's flat slot [B] (where a decode step writes its K/V), from the tables' ints:
        `rows` would build every row's slot to read the last."""
        bs = self.block_size
        last = [t.blocks[(t.n_tokens - 1) // bs] * bs + (t.n_tokens - 1) % bs for t in tables]
        return torch.tensor(last, dtype=torch.long, device=self.pool.kv.device)

    def _copy_rows(self, table: BlockTable, cache: DecodeCache, start: int, stop: int) -> None:
        """Rows start..stop-1 of every layer of a contiguous cache into the table's slots for those positions."""
        if stop <= start:
            return
        k, v = self.layer_views()
        slots = self.rows(table)[start:stop]  # [R]
        for layer in range(k.shape[0]):  # a layer at a time: 50x faster than one index_copy_ over the strided view
            k[layer].index_copy_(0, slots, cache.k[layer, start:stop])  # [R, Hkv, hd]
            v[layer].index_copy_(0, slots, cache.v[layer, start:stop])


def _first_moved(rows: torch.Tensor) -> int:
    """The first slot whose row changes in some layer or head, of rows [L, Hkv, m] kept (m: none changes)."""
    m = rows.shape[-1]
    stays = (rows == torch.arange(m, device=rows.device)).all(dim=0).all(dim=0)  # [m]
    return m if bool(stays.all()) else int((~stays).nonzero()[0])

