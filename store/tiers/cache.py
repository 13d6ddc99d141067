"""The memory tiers as one object: block pools per tier, the knowledge tree, a replacement policy.

Per question (see the package docstring for a full example):

    with cache.acquire(chunk_ids, lengths, suffix_tokens) as lease:   # match, pin, count, promote
        prefix = cache.gather(lease.prefix)                          # [L, 2, S, H, D], exact reuse
        for i in range(lease.matched, len(chunk_ids)):
            node = lease.memory_node(i)                              # chunk's stored KV in memory, or None
            kv = cache.gather([node]) if node else <read the store>  # then blend
        cache.insert(lease, per_chunk_kv)                            # the chunks lease.matched.. as blended
    # leaving the block unpins

Eviction (RAGCache, Algorithm 1): to make room in a tier, take the evictable leaf with the lowest
priority, raise the tier's clock to that priority, and let it go. A GPU leaf (no child on the GPU)
is copied to host the first time it leaves the GPU and only then (the host copy stays while the node
is on the GPU again), so later GPU evictions just free it. A host leaf (no children, not on the GPU)
leaves the tree: the store is the tier below. Pinned nodes are never evicted. Inserting is best
effort: a chunk that finds no room is not cached (and neither is anything below it).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from kvrag.errors import KvragError
from kvrag.kvcache.allocator import BlockLayout, BlockTable
from kvrag.kvcache.block_pool import BlockPool, Layers
from kvrag.store.tiers.config import CacheConfig
from kvrag.store.tiers.cost_profile import CostProfile
from kvrag.store.tiers.knowledge_tree import GPU, HOST, MAX_PATH_STATS, STORE, KnowledgeTree, Node
from kvrag.store.tiers.lease import CacheStats, Lease
from kvrag.store.tiers.policies import Policy, make_policy


class TieredKVCache:
    """GPU (optional) over host memory over the store, each a block pool sized by a byte budget."""

    def __init__(self, layout: BlockLayout, host_bytes: int, gpu_bytes: int = 0,
                 policy: str | Policy = "pgdsf", *, cost: CostProfile | None = None,
                 preamble_tokens: int = 0, gpu_device: str | torch.device | None = None,
                 materialize: bool = True, share_identical: bool = True, pin_host: bool = False,
                 remember_paths: int = MAX_PATH_STATS):
        self.layout = layout
        self.policy = make_policy(policy)
        self.cost = cost or CostProfile.linear()
        self.preamble_tokens = preamble_tokens
        self.share_identical = share_identical
        self.tree = KnowledgeTree(remember_paths)  # 0: statistics die with their node (in-cache counts)
        self.stats = CacheStats()
        self.pools: dict[str, BlockPool] = {}
        self.budgets = {HOST: host_bytes, GPU: gpu_bytes}
        if gpu_bytes > 0:
            device = torch.device(gpu_device or "cuda")
            if device.type == "cuda" and not torch.cuda.is_available():
                raise KvragError("--gpu-cache needs a CUDA device; none is available (use --gpu-cache 0)")
            self.pools[GPU] = BlockPool.for_budget(layout, gpu_bytes, device if materialize else None)
        self.pools[HOST] = BlockPool.for_budget(layout, host_bytes, "cpu" if materialize else None,
                                                pin_memory=pin_host)
        self.tiers = list(self.pools)  # fastest first
        self.clocks = {tier: 0.0 for tier in self.tiers}
        self._members: dict[str, set[Node]] = {tier: set() for tier in self.tiers}
        self._tick = 0
        self._lock = threading.RLock()  # a loader thread may gather while the main thread inserts

    @classmethod
    def from_config(cls, config: CacheConfig, layout: BlockLayout, *, cost: CostProfile | None = None,
                    preamble_tokens: int = 0, **kwargs) -> TieredKVCache:
        return cls(layout, config.host_bytes, config.gpu_bytes, config.policy, cost=cost,
                   preamble_tokens=preamble_tokens, **kwargs)

    # --- looking up ------------------------------------------------------------------------------

    def peek(self, chunk_ids: Sequence[str], lengths: Sequence[int], suffix_tokens: int = 0) -> tuple[int, int]:
        """(cached tokens, tokens to compute) if this request ran now; changes nothing."""
        with self._lock:
            matched = len(self.tree.match(chunk_ids))
            return (self.preamble_tokens + sum(lengths[:matched]),
                    sum(lengths[matched:]) + suffix_tokens)

    def acquire(self, chunk_ids: Sequence[str], lengths: Sequence[int], suffix_tokens: int = 0, *,
                use_base: bool = True, promote: bool = True) -> Lease:
        """Match the request's path, pin what it will read, count the accesses, bring the path to the GPU.

        `lengths` are the chunks' token counts. `use_base=False` ignores stored KV in memory below the
        first miss (RAGCache's model, where those chunks are computed from scratch).
        """
        chunk_ids, lengths = tuple(chunk_ids), tuple(lengths)
        if len(chunk_ids) != len(lengths):
            raise ValueError(f"{len(chunk_ids)} chunk ids, {len(lengths)} lengths")
        with self._lock:
            self._tick += 1
            prefix = self.tree.match(chunk_ids)
            base: list[Node | None] = [None] * len(chunk_ids)
            if use_base:
                for i in range(len(prefix), len(chunk_ids)):
                    base[i] = self.tree.base(chunk_ids[i])
            lease = Lease(chunk_ids, lengths, suffix_tokens, self.preamble_tokens, prefix, [], base, cache=self,
                          tick=self._tick)
            used = [n for n in prefix] + [n for n in base if n is not None]
            for node in used:
                node.pins += 1
                lease.pinned.append(node)
            for node in {id(n): n for n in used}.values():  # a node counts once per request
                node.stats.record_access(self._tick)
                self._refresh(node)
            if promote and GPU in self.pools:
                self._promote(prefix)
            lease.tiers = [self._best_tier(n) if n is not None else STORE
                           for n in (lease.memory_node(i) for i in range(len(chunk_ids)))]
            s = self.stats
            s.requests += 1
            s.chunks += len(chunk_ids)
            s.prefix_hits += len(prefix)
            s.prefix_hit_tokens += sum(lengths[: len(prefix)])
            for tier in lease.tiers:
                if tier == STORE:
                    s.store_reads += 1
                else:
                    s.memory_hits[tier] += 1
            return lease

    def release(self, lease: Lease) -> None:
        """Unpin the lease's nodes (idempotent)."""
        with self._lock:
            if lease.released:
                return
            for node in lease.pinned:
                node.pins -= 1
            lease.released = True

    # --- reading ---------------------------------------------------------------------------------

    def gather(self, nodes: Sequence[Node], device: torch.device | str | None = None) -> torch.Tensor:
        """The nodes' K and V concatenated in order, from the fastest tier holding each: a fresh
        [L, 2, S, H, D] tensor (`as_layers` gives per-layer (K, V) [S, H, D]). Keys are pre-rotary."""
        with self._lock:
            groups = self._groups(nodes)
            parts = [self.pools[tier].gather(tables, device) for tier, tables in groups]
            return parts[0] if len(parts) == 1 else torch.cat([p.to(device or "cpu") for p in parts], dim=2)

    def gather_layer(self, nodes: Sequence[Node], layer: int,
                     device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's (K, V) of the nodes, each [S, H, D] (for a layer-by-layer loader)."""
        with self._lock:
            parts = [self.pools[tier].gather_layer(tables, layer, device) for tier, tables in self._groups(nodes)]
            if len(parts) == 1:
                return parts[0]
            return (torch.cat([k.to(device or "cpu") for k, _ in parts]),
                    torch.cat([v.to(device or "cpu") for _, v in parts]))

    # --- inserting -------------------------------------------------------------------------------

    def insert(self, lease: Lease, kvs: Sequence[Layers] | None = None, *,
               cost_s: float | None = None) -> list[Node]:
        """Cache the chunks below the lease's match, in order, as they stood in this prompt.

        kvs[j] is chunk (lease.matched + j)'s per-layer (K pre-rotary, V), each [T, kv_heads, head_dim];
        fewer than the remaining chunks may be given. A cache made with materialize=False takes None and
        keeps the bookkeeping only. `cost_s`, the request's measured prefill time, replaces the profile's
        T(cached, new) in PGDSF's Cost/Size. Returns the nodes now on the path (new or found); they stay
        pinned until the lease is released.
        """
        with self._lock:
            if lease.released or lease.insert_done:
                raise ValueError("insert takes a lease once, before it is released")
            lease.insert_done = True
            first = lease.matched
            count = len(lease.chunk_ids) - first if kvs is None else len(kvs)
            if first + count > len(lease.chunk_ids):
                raise ValueError(f"{count} chunks given, only {len(lease.chunk_ids) - first} below the match")
            if kvs is None and self.pools[HOST].materialized:
                raise ValueError("this cache holds tensors: insert needs the chunks' KV")
            if cost_s is not None:
                per_token = cost_s / max(lease.new_tokens, 1)
            else:
                per_token = self.cost.per_token(lease.cached_tokens, lease.new_tokens)
            parent = lease.prefix[-1] if lease.prefix else self.tree.root
            out = []
            for j in range(count):
                i = first + j
                cid, n = lease.chunk_ids[i], lease.lengths[i]
                layers = None if kvs is None else kvs[j]
                if layers is not None:
                    self._check_layers(layers, n, cid)
                node = parent.children.get(cid)
                if node is None:
                    node = self._new_node(parent, cid, n, layers, lease.base[i], per_token)
                    if node is None:
                        self.stats.not_inserted += count - j
                        break
                    lease.inserted.append(node)
                elif node.stats.last_access < lease.tick:  # put here since this request was matched
                    node.stats.record_access(self._tick)
                    self._refresh(node)
                node.pins += 1
                lease.pinned.append(node)
                out.append(node)
                parent = node
            return out

    def put_stored(self, chunk_id: str, layers: Layers | None, n_tokens: int | None = None) -> Node | None:
        """Keep a chunk's stored KV (what precompute wrote: the chunk right after the preamble) as its
        depth-1 node, so a later question finds it in memory wherever the chunk stands in its prompt.

        For chunks a request read from the store; no-op (returns the node) when already cached, None
        when there is no room. Its Cost/Size is what computing it after the preamble costs.
        """
        n = n_tokens if layers is None else layers[0][0].shape[0]
        if n is None:
            raise ValueError("put_stored needs the KV or, without tensors, n_tokens")
        with self._lock:
            node = self.tree.base(chunk_id)
            if node is not None:
                return node
            if layers is not None:
                self._check_layers(layers, n, chunk_id)
            elif self.pools[HOST].materialized:
                raise ValueError("this cache holds tensors: put_stored needs the chunk's KV")
            return self._new_node(self.tree.root, chunk_id, n, layers, None,
                                  self.cost.per_token(self.preamble_tokens, n))

    # --- state -----------------------------------------------------------------------------------

    def used_bytes(self, tier: str = HOST) -> int:
        return self.pools[tier].used_bytes

    def capacity_bytes(self, tier: str = HOST) -> int:
        return self.pools[tier].capacity_bytes

    def _best_tier(self, node: Node) -> str:
        return next(t for t in self.tiers if t in node.tables)

    def _groups(self, nodes: Sequence[Node]) -> list[tuple[str, list[BlockTable]]]:
        """Consecutive nodes read from the same tier, so each run is one gather."""
        groups: list[tuple[str, list[BlockTable]]] = []
        for node in nodes:
            if not node.alive or not node.tables:
                raise ValueError(f"{node} holds no KV (was it released and evicted?)")
            tier = self._best_tier(node)
            if groups and groups[-1][0] == tier:
                groups[-1][1].append(node.tables[tier])
            else:
                groups.append((tier, [node.tables[tier]]))
        if not groups:
            raise ValueError("nothing to gather")
        return groups

    def _refresh(self, node: Node) -> None:
        for tier in node.tables:
            node.priority[tier] = self.policy.priority(node.stats, self.clocks[tier])

    def _check_layers(self, layers: Layers, n: int, cid: str) -> None:
        L, H, D = self.layout.n_layers, self.layout.kv_heads, self.layout.head_dim
        if len(layers) != L or any(k.shape != (n, H, D) or v.shape != (n, H, D) for k, v in layers):
            shape = tuple(layers[0][0].shape) if layers else None
            raise ValueError(f"chunk {cid}: expected {L} layers of [{n}, {H}, {D}], got {len(layers)} of {shape}")

    def _new_node(self, parent: Node, cid: str, n: int, layers: Layers | None, base: Node | None,
                  per_token: float) -> Node | None:
        tier = GPU if GPU in self.pools and (parent.is_root or GPU in parent.tables) else HOST
        table = self._place(tier, n, layers, base)
        if table is None and tier == GPU:
            tier = HOST
            table = self._place(tier, n, layers, base)
        if table is None:
            return None
        node = self.tree.add(parent, cid, n)
        node.tables[tier] = table
        self._members[tier].add(node)
        node.stats.record_access(self._tick)
        node.stats.record_compute(per_token)
        node.stats.solo_cost = self.cost.per_token(0, n)
        self._refresh(node)
        self.stats.inserted += 1
        return node

    def _place(self, tier: str, n: int, layers: Layers | None, base: Node | None) -> BlockTable | None:
        """A table in `tier` holding `layers`, sharing the blocks that equal the chunk's stored KV."""
        pool = self.pools[tier]
        n_blocks = self.layout.blocks_for(n)
        same = [False] * n_blocks
        base_table = base.tables.get(tier) if base is not None and base.alive else None
        if (self.share_identical and layers is not None and base_table is not None
                and base_table.n_tokens == n):
            same = pool.equal_blocks(base_table, layers)
            pool.share([b for b, s in zip(base_table.blocks, same, strict=True) if s])  # held while we evict
        shared = [base_table.blocks[j] for j in range(n_blocks) if same[j]] if any(same) else []
        if not self._make_room(tier, n_blocks - len(shared)):
            if shared:
                pool.allocator.decref(shared)
            return None
        fresh = pool.allocator.allocate(n_blocks - len(shared))
        blocks = [base_table.blocks[j] if same[j] else fresh.pop() for j in range(n_blocks)]
        table = BlockTable(blocks, n, self.layout.block_size)
        if layers is not None:
            B = self.layout.block_size
            rows = [t for t in range(n) if not same[t // B]]
            if rows:
                pool.write(table, layers, None if len(rows) == n else torch.tensor(rows))
        self.stats.shared_blocks += len(shared)
        return table

    def _make_room(self, tier: str, n_blocks: int) -> bool:
        pool = self.pools[tier]
        if n_blocks > pool.num_blocks:
            return False
        skip: set[Node] = set()
        while pool.num_free < n_blocks:
            victim = self._victim(tier, skip)
            if victim is None:
                return False
            if not self._evict(victim, tier):
                skip.add(victim)
        return True

    def _victim(self, tier: str, skip: set[Node]) -> Node | None:
        """The evictable leaf of the tier with the lowest (priority, last access, -depth, age)."""
        best, best_key = None, None
        for node in self._members[tier]:
            if node.pins or node in skip:
                continue
            if tier == GPU:
                if node.has_child_in(GPU):
                    continue
            elif node.children or GPU in node.tables:  # a host copy backs a GPU node: keep it
                continue
            key = (node.priority[tier], node.stats.last_access, -node.depth, node.seq)
            if best_key is None or key < best_key:
                best, best_key = node, key
        return best

    def _evict(self, node: Node, tier: str) -> bool:
        if tier == GPU and HOST not in node.tables:  # first time off the GPU: swap out
            if self._make_room(HOST, len(node.tables[GPU].blocks)):
                self._copy(node, GPU, HOST)
                self.stats.swap_outs += 1
            elif node.children:
                return False  # dropping it would orphan its host children
        self.clocks[tier] = max(self.clocks[tier], node.priority[tier])
        if tier == GPU:
            node.swapped_out = True
        self.pools[tier].free(node.tables.pop(tier))
        node.priority.pop(tier)
        self._members[tier].discard(node)
        self.stats.evictions[tier] += 1
        if not node.tables:
            self.tree.remove(node)
        return True

    def _copy(self, node: Node, src: str, dst: str) -> None:
        """Copy a node's blocks to another tier (room was made); the source copy stays."""
        node.tables[dst] = self.pools[dst].copy_from(self.pools[src], node.tables[src])
        node.priority[dst] = self.policy.priority(node.stats, self.clocks[dst])
        self._members[dst].add(node)

    def _promote(self, prefix: list[Node]) -> None:
        """Swap the matched path into the GPU, top down, as far as room allows (host copies stay)."""
        for node in prefix:
            if GPU in node.tables:
                continue
            if not self._make_room(GPU, len(node.tables[HOST].blocks)):
                return
            self._copy(node, HOST, GPU)
            self.stats.swap_ins += 1
