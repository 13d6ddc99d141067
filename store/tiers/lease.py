"""What a question holds of the memory tiers while it runs (Lease), what the tiers count (CacheStats), and the
view of gathered KV by layer (as_layers)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch

from kvrag.store.tiers.knowledge_tree import GPU, HOST, Node


class Releases(Protocol):
    """What a lease needs of its cache (store/tiers/cache.py's TieredKVCache): to be released."""

    def release(self, lease: Lease) -> None: ...


@dataclass
class CacheStats:
    requests: int = 0
    chunks: int = 0  # chunk slots asked for
    prefix_hits: int = 0  # chunks reused exactly (on the matched path)
    prefix_hit_tokens: int = 0
    memory_hits: dict[str, int] = field(default_factory=lambda: {GPU: 0, HOST: 0})  # any chunk read from a tier
    store_reads: int = 0  # chunks below the first miss with no copy in memory
    evictions: dict[str, int] = field(default_factory=lambda: {GPU: 0, HOST: 0})
    swap_outs: int = 0  # GPU -> host copies
    swap_ins: int = 0  # host -> GPU copies (promotions)
    inserted: int = 0
    not_inserted: int = 0  # no room
    shared_blocks: int = 0  # blocks an inserted chunk shares with its stored KV (identical content)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.chunks if self.chunks else 0.0

    @property
    def memory_hit_rate(self) -> float:
        return sum(self.memory_hits.values()) / self.chunks if self.chunks else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "prefix_hit_rate": self.prefix_hit_rate, "memory_hit_rate": self.memory_hit_rate}


@dataclass
class Lease:
    """One request's view of the cache, from `acquire` to `release`; its nodes stay pinned meanwhile."""

    chunk_ids: tuple[str, ...]
    lengths: tuple[int, ...]
    suffix_tokens: int
    preamble_tokens: int
    prefix: list[Node]  # the matched path: chunk i < matched is reused exactly from prefix[i]
    tiers: list[str]  # per chunk: where its KV comes from ("gpu", "host" or "store")
    base: list[Node | None]  # per chunk below the match: a node holding its stored KV, if in memory
    pinned: list[Node] = field(default_factory=list)
    inserted: list[Node] = field(default_factory=list)
    cache: Releases | None = field(default=None, repr=False)  # the TieredKVCache it came from
    released: bool = False
    insert_done: bool = False
    tick: int = 0  # the cache's logical time when acquired

    @property
    def matched(self) -> int:
        return len(self.prefix)

    @property
    def cached_tokens(self) -> int:
        """Tokens whose KV is reused exactly: the preamble and the matched chunks."""
        return self.preamble_tokens + sum(self.lengths[: self.matched])

    @property
    def new_tokens(self) -> int:
        """Tokens to compute (blended or fully): the chunks below the match and the suffix."""
        return sum(self.lengths[self.matched:]) + self.suffix_tokens

    def memory_node(self, i: int) -> Node | None:
        """The node to read chunk i's KV from: its path node when matched, else its stored KV in memory."""
        return self.prefix[i] if i < self.matched else self.base[i]

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc) -> None:
        if self.cache is not None:
            self.cache.release(self)


def as_layers(kv: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[L, 2, S, H, D] → per layer (K [S, H, D], V [S, H, D]), views of the same tensor."""
    return [(kv[layer, 0], kv[layer, 1]) for layer in range(kv.shape[0])]
