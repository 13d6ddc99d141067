"""A read-through cache tier: the local LMDB KVTable in front of a RemoteKVTable, bounded in bytes.

Reads try the local table first and make no request when it has the chunk. A miss fetches the chunk whole from
the remote (one GET, every value checked), keeps it locally as it came (the same record and value bytes, so
nothing is encoded again) and serves from it. When the chunks kept locally pass `max_bytes`, the lowest-priority
ones go, by the memory tiers' replacement policy (store/tiers/policies.py; PGDSF by default, a miss's fetch time
per token standing for its cost, with the tiers' GreedyDual clock); the chunk just fetched is never its own
victim, and one larger than the whole bound is served without being kept. Writes go to both tables.

The bookkeeping (sizes, access statistics) is this object's: it starts from the local table's records with no
history, and counts this process's reads (every layer read is an access).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from kvrag.store.codec import DecodedKV
from kvrag.store.kv import KVTable, Layers, MissingChunk, Positions, RawLayer, Shard, encode_chunk
from kvrag.store.record import KVRecord, TokenIds
from kvrag.store.remote.remote_kv import RemoteChunk, RemoteKVTable
from kvrag.store.tiers.policies import AccessStats, Policy, make_policy


@dataclass
class CacheCounters:
    hits: int = 0  # layer reads served by the local table
    fills: int = 0  # chunks fetched whole from the remote
    fetched_bytes: int = 0
    evictions: int = 0
    not_kept: int = 0  # fetched chunks larger than the whole bound


class CachedKVTable:
    put_preamble, has_preamble, get_preamble_layer = KVTable.put_preamble, KVTable.has_preamble, KVTable.get_preamble_layer

    def __init__(self, remote: RemoteKVTable, local: KVTable, max_bytes: int, policy: str | Policy = "pgdsf"):
        if (remote.model_fp, remote.codec, remote.variant) != (local.model_fp, local.codec, local.variant):
            raise ValueError("the local and remote tables hold different models, codecs or variants")
        self.remote, self.local, self.max_bytes = remote, local, max_bytes
        self.model_fp, self.codec, self.variant, self.compress = remote.model_fp, remote.codec, remote.variant, remote.compress
        self.policy = make_policy(policy)
        self.counters = CacheCounters()
        self._sizes: dict[str, int] = {}  # chunk id -> bytes kept locally (record + values)
        self._stats: dict[str, AccessStats] = {}
        self._priority: dict[str, float] = {}
        self._clock = 0.0  # GreedyDual aging: rises to the priority of each chunk evicted
        self._tick = 0
        self._lock = threading.RLock()
        for chunk_id, record in local.iter_chunks(include_preamble=True):
            self._track(chunk_id, record, cost_s=0.0)
        with self._lock:
            self._evict(keep=None)

    @property
    def local_bytes(self) -> int:
        return sum(self._sizes.values())

    # --- reading ---------------------------------------------------------------------------------

    def has(self, chunk_id: str) -> bool:
        return self.local.has(chunk_id) or self.remote.has(chunk_id)

    def missing(self, chunk_ids: Iterable[str], shard: Shard | None = None) -> list[str]:
        return self.remote.missing(self.local.missing(chunk_ids, shard))

    def record(self, chunk_id: str) -> KVRecord | None:
        return self.local.record(chunk_id) or self.remote.record(chunk_id)

    def get_layer_raw(self, chunk_id: str, layer: int, expect_token_ids: TokenIds | None = None) -> RawLayer:
        return self.get_layers([chunk_id], layer, [expect_token_ids])[0]

    def get_layer(self, chunk_id: str, layer: int, expect_token_ids: TokenIds | None = None,
                  dtype: type | None = None) -> DecodedKV:
        return self.get_layer_raw(chunk_id, layer, expect_token_ids).decode(dtype)

    def get_layers(self, chunk_ids: Sequence[str], layer: int,
                   expect_token_ids: Sequence[TokenIds | None] | None = None) -> list[RawLayer]:
        """One layer of several chunks: local ones read here, the others fetched whole at once and kept."""
        expect = list(expect_token_ids) if expect_token_ids is not None else [None] * len(chunk_ids)
        found: list[RawLayer | None] = []
        for chunk_id, ids in zip(chunk_ids, expect, strict=True):
            try:
                found.append(self.local.get_layer_raw(chunk_id, layer, ids))
                self._access(chunk_id, hit=True)
            except MissingChunk:  # not here (or evicted meanwhile)
                found.append(None)
        misses = [i for i, raw in enumerate(found) if raw is None]
        fetched = self.remote.objects.map(lambda i: self._fill(chunk_ids[i], expect[i]), misses)
        for i, chunk in zip(misses, fetched, strict=True):
            found[i] = chunk.raw_layer(layer, self.codec)
        return found

    def iter_chunks(self, *, include_preamble: bool = False) -> Iterator[tuple[str, KVRecord]]:
        return self.remote.iter_chunks(include_preamble=include_preamble)

    # --- writing ---------------------------------------------------------------------------------

    def put_chunk(self, chunk_id: str, token_ids: TokenIds, layers: Layers, positions: Positions = None) -> bool:
        """Encode once, store in the remote (False when it was there) and keep locally."""
        if self.remote.has(chunk_id):
            return False
        record, values = encode_chunk(token_ids, layers, positions, self.codec, self.compress)
        stored = self.remote.put_encoded(chunk_id, record, values)
        self._admit(chunk_id, RemoteChunk(KVRecord.from_bytes(record), record, values), cost_s=0.0)
        return stored

    def delete_chunk(self, chunk_id: str) -> int:
        with self._lock:
            self._untrack(chunk_id)
        self.local.delete_chunk(chunk_id)
        return self.remote.delete_chunk(chunk_id)

    def claim(self, chunk_ids: Iterable[str], **kwargs) -> list[str]:
        """Those missing remotely, claimed in the local store (processes on one host split them; see KVTable)."""
        return self.local.claim(self.remote.missing(chunk_ids), **kwargs)

    def release(self, chunk_ids: Iterable[str], **kwargs) -> None:
        self.local.release(chunk_ids, **kwargs)

    # --- the tier --------------------------------------------------------------------------------

    def _fill(self, chunk_id: str, expect_token_ids: TokenIds | None) -> RemoteChunk:
        start = time.perf_counter()
        chunk = self.remote.get_chunk(chunk_id, expect_token_ids)
        self._admit(chunk_id, chunk, cost_s=time.perf_counter() - start)
        self._access(chunk_id, hit=False)
        with self._lock:
            self.counters.fills += 1
            self.counters.fetched_bytes += stored_bytes(chunk.record)
        return chunk

    def _admit(self, chunk_id: str, chunk: RemoteChunk, cost_s: float) -> None:
        """Keep a chunk locally (unless it alone outgrows the bound), then evict others down to the bound."""
        with self._lock:
            if stored_bytes(chunk.record) > self.max_bytes:
                self.counters.not_kept += 1
                return
            self.local.put_encoded(chunk_id, chunk.record_bytes, chunk.values)
            self._track(chunk_id, chunk.record, cost_s)
            self._evict(keep=chunk_id)

    def _track(self, chunk_id: str, record: KVRecord, cost_s: float) -> None:
        with self._lock:
            self._sizes[chunk_id] = stored_bytes(record)
            stats = self._stats.setdefault(chunk_id, AccessStats(size=max(record.n_tokens, 1)))
            if cost_s:
                stats.record_compute(cost_s / stats.size)  # a miss costs a fetch: seconds per token
            self._priority[chunk_id] = self.policy.priority(stats, self._clock)

    def _untrack(self, chunk_id: str) -> None:
        for table in (self._sizes, self._stats, self._priority):
            table.pop(chunk_id, None)

    def _access(self, chunk_id: str, hit: bool) -> None:
        with self._lock:
            self.counters.hits += hit
            if chunk_id not in self._sizes:  # stored by another process sharing the local store
                record = self.local.record(chunk_id)
                if record is None:
                    return
                self._track(chunk_id, record, cost_s=0.0)
            self._tick += 1
            stats = self._stats[chunk_id]
            stats.record_access(self._tick)
            self._priority[chunk_id] = self.policy.priority(stats, self._clock)

    def _evict(self, keep: str | None) -> None:
        """Delete the lowest-priority local chunks (ties: least recently used) until the bound holds."""
        while self.local_bytes > self.max_bytes:
            candidates = [(p, self._stats[c].last_access, c) for c, p in self._priority.items() if c != keep]
            if not candidates:
                return
            priority, _, victim = min(candidates)
            self._clock = max(self._clock, priority)
            self.local.delete_chunk(victim)
            self._untrack(victim)
            self.counters.evictions += 1


def stored_bytes(record: KVRecord) -> int:
    """What a chunk takes in a store: its record and its values."""
    return len(record.to_bytes()) + record.total_bytes
