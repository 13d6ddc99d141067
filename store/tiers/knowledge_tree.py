"""The knowledge tree (RAGCache): a prefix tree over chunk-id sequences, rooted at the preamble.

A node holds one chunk's KV as it stood after its path (preamble, then the chunks above it) in a
prompt that was blended or fully computed, as one block table per tier that holds a copy. A request
whose chunk sequence starts with a path reuses that path's KV exactly. Depth-1 nodes hold a chunk's
KV right after the preamble — what the store keeps — so they also serve that chunk anywhere below a
prompt's first miss, to be blended.

Placement invariants, kept by the cache: every node is in at least one tier; a node in the GPU tier
has its parent in the GPU tier (GPU nodes are parents of host nodes); a node that was swapped out of
the GPU once keeps its host copy while it is on the GPU again (so it is never copied out twice).

Statistics are kept per path, apart from the nodes, in a bounded table: a path evicted and computed
again keeps its frequency and costs (RAGCache averages Cost/Size over every request that computed it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvrag.kvcache.allocator import BlockTable
from kvrag.store.tiers.policies import AccessStats

GPU, HOST, STORE = "gpu", "host", "store"
MAX_PATH_STATS = 200_000  # remembered paths (~200 B each); the oldest are forgotten first


@dataclass(eq=False)
class Node:
    chunk_id: str | None  # None at the root (the preamble)
    parent: Node | None
    stats: AccessStats | None  # None at the root
    depth: int = 0
    children: dict[str, Node] = field(default_factory=dict)
    tables: dict[str, BlockTable] = field(default_factory=dict)  # tier -> this node's blocks there
    priority: dict[str, float] = field(default_factory=dict)  # tier -> priority set on the last access
    pins: int = 0  # requests using this node now: it is not evicted from any tier
    swapped_out: bool = False  # has left the GPU once
    alive: bool = True  # False once removed from the tree
    seq: int = 0  # creation order: the last tie-break, so eviction is deterministic

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def n_tokens(self) -> int:
        return 0 if self.stats is None else self.stats.size

    @property
    def path(self) -> tuple[str, ...]:
        out: list[str] = []
        node: Node | None = self
        while node is not None and node.chunk_id is not None:
            out.append(node.chunk_id)
            node = node.parent
        return tuple(reversed(out))

    def has_child_in(self, tier: str) -> bool:
        return any(tier in c.tables for c in self.children.values())

    def __repr__(self) -> str:
        return f"Node({'/'.join(self.path) or '<root>'}, tiers={sorted(self.tables)}, pins={self.pins})"


class KnowledgeTree:
    def __init__(self, max_path_stats: int = MAX_PATH_STATS):
        self.root = Node(None, None, None)
        self.max_path_stats = max_path_stats
        self._stats: OrderedDict[tuple[str, ...], AccessStats] = OrderedDict()
        self._count = 0
        self._next_seq = 0

    def __len__(self) -> int:
        """Nodes below the root."""
        return self._count

    def match(self, chunk_ids: Sequence[str]) -> list[Node]:
        """The nodes of the longest path that is a prefix of `chunk_ids`."""
        out, node = [], self.root
        for cid in chunk_ids:
            node = node.children.get(cid)
            if node is None:
                break
            out.append(node)
        return out

    def base(self, chunk_id: str) -> Node | None:
        """The node holding the chunk's KV right after the preamble, if cached."""
        return self.root.children.get(chunk_id)

    def stats_for(self, path: tuple[str, ...], size: int) -> AccessStats:
        """The statistics of a path, remembered across evictions (a new record when the size differs)."""
        stats = self._stats.get(path)
        if stats is None or stats.size != size:
            stats = AccessStats(size)
            self._stats[path] = stats
        self._stats.move_to_end(path)
        while len(self._stats) > self.max_path_stats:
            self._stats.popitem(last=False)  # a live node keeps its own reference
        return stats

    def add(self, parent: Node, chunk_id: str, size: int) -> Node:
        if not parent.alive:
            raise ValueError(f"{parent} was removed; cannot add a child to it")
        if chunk_id in parent.children:
            raise ValueError(f"{parent} already has a child {chunk_id}")
        path = parent.path + (chunk_id,)
        self._next_seq += 1
        node = Node(chunk_id, parent, self.stats_for(path, size), parent.depth + 1, seq=self._next_seq)
        parent.children[chunk_id] = node
        self._count += 1
        return node

    def remove(self, node: Node) -> None:
        """Take a leaf that holds no blocks and no pins out of the tree."""
        if node.is_root or node.children or node.tables or node.pins:
            raise ValueError(f"only an unpinned, empty leaf can be removed: {node}")
        assert node.parent is not None and node.chunk_id is not None
        del node.parent.children[node.chunk_id]
        node.alive = False
        self._count -= 1

    def nodes(self) -> Iterator[Node]:
        """Every node below the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def held(self, limit: int) -> list[str]:
        """The ids of the chunks some tier holds (at any depth), the most recently used first, at most `limit`: a
        router's view of this replica, cheap to send and bounded."""
        nodes = [node for node in self.nodes() if node.tables]
        nodes.sort(key=lambda node: node.stats.last_access if node.stats else 0, reverse=True)
        return list(dict.fromkeys(node.chunk_id for node in nodes))[:limit]
