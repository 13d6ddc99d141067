"""A read-through cache tier: the LocalKVTable (LMDB) in front of a RemoteKVTable, bounded in bytes.

Reads try the local table first and make no request when it has the chunk. A miss fetches the chunk's layers in
the order the loader reads them (ranged.py): ranged GETs of `layers_per_request` layers each, the first one holding
the chunk's index too (no separate probe), the later ones queued at once on the store's pool; a read returns as
soon as its own layer has arrived and passed its checks, and `missing` announces the chunks it found remote only,
so the first read of one starts them all. With `layers_per_request=0` a miss fetches the chunk whole instead (one
GET, every value checked) before serving any of it. Either way the chunk, once every layer has arrived, is kept
locally as it came (the same record and value bytes, so nothing is encoded again, and the local tier holds the
same bytes whichever way it was fetched). When the chunks kept locally pass `max_bytes`, the lowest-priority
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
from contextlib import contextmanager
from dataclasses import dataclass

from kvrag.store.codec import CorruptValue
from kvrag.store.kv import LocalKVTable
from kvrag.store.record import KVRecord, TokenIds
from kvrag.store.remote.ranged import RangedReader
from kvrag.store.remote.remote_kv import RemoteChunk, RemoteKVTable
from kvrag.store.table import KVTable, LayerRead, MissingChunk, RawLayer, Shard, read_or_error
from kvrag.store.tiers.policies import AccessStats, Policy, make_policy

LAYERS_PER_REQUEST = 4  # a cold chunk's layers per ranged GET (0: the chunk whole, in one GET)
PARTIAL_BYTES = 512 << 20  # partly fetched chunks hold at most this much (beyond what reads wait on)


@dataclass
class CacheCounters:
    hits: int = 0  # layer reads served by the local table
    fills: int = 0  # chunks fetched from the remote (every layer, whole or ranged)
    fetched_bytes: int = 0
    evictions: int = 0


class CachedKVTable(KVTable):
    def __init__(self, remote: RemoteKVTable, local: LocalKVTable, max_bytes: int, policy: str | Policy = "pgdsf",
                 layers_per_request: int = LAYERS_PER_REQUEST, partial_bytes: int = PARTIAL_BYTES):
        if (remote.model_fp, remote.codec, remote.variant) != (local.model_fp, local.codec, local.variant):
            raise ValueError("the local and remote tables hold different models, codecs or variants")
        self.remote, self.local, self.max_bytes = remote, local, max_bytes
        self.objects = remote.objects  # the bucket (the prefix table shares it: store/remote/prefix_objects.py)
        self.model_fp, self.codec, self.variant, self.compress = remote.model_fp, remote.codec, remote.variant, remote.compress
        self.policy = make_policy(policy)
        self.counters = CacheCounters()
        self._sizes: dict[str, int] = {}  # chunk id -> bytes kept locally (record + values)
        self._stats: dict[str, AccessStats] = {}
        self._priority: dict[str, float] = {}
        self._clock = 0.0  # GreedyDual aging: rises to the priority of each chunk evicted
        self._tick = 0
        self._lock = threading.RLock()
        self.layers_per_request = layers_per_request  # may change between reads (a bench compares the two)
        self.ranged = RangedReader(remote, self._fetched, local.has, partial_bytes)
        for chunk_id, record in local.iter_chunks(include_preamble=True):
            self._track(chunk_id, record, cost_s=0.0)
            self.ranged.hint.observe(record)
        with self._lock:
            self._evict(keep=None)

    @property
    def local_bytes(self) -> int:
        return sum(self._sizes.values())

    # --- reading ---------------------------------------------------------------------------------

    def has(self, chunk_id: str) -> bool:
        return self.local.has(chunk_id) or self.remote.has(chunk_id)

    def missing(self, chunk_ids: Iterable[str], shard: Shard | None = None) -> list[str]:
        """Those in neither tier; those only remote are announced (module doc)."""
        not_local = self.local.missing(chunk_ids, shard)
        absent = self.remote.missing(not_local)
        if self.layers_per_request:
            gone = set(absent)
            self.ranged.announce([c for c in not_local if c not in gone])
        return absent

    def record(self, chunk_id: str) -> KVRecord | None:
        return self.local.record(chunk_id) or self.remote.record(chunk_id)

    def get_layer_raw(self, chunk_id: str, layer: int, expect_token_ids: TokenIds | None = None) -> RawLayer:
        with self.layer_views([(chunk_id, expect_token_ids)], layer) as (raw,):
            if isinstance(raw, RawLayer):
                return raw
            raise raw

    @contextmanager
    def layer_views(self, chunks: Sequence[tuple[str, TokenIds | None]], layer: int,
                    records: dict[str, KVRecord] | None = None) -> Iterator[list[LayerRead]]:
        """Local ones read here, the others fetched (all at once) and kept; read whole, not as views of the map
        (an eviction may delete a chunk while the block runs)."""
        chunks = list(chunks)
        found = [read_or_error(self._local_layer, chunk_id, layer, ids) for chunk_id, ids in chunks]
        misses = [i for i, raw in enumerate(found) if raw is None]
        if not self.layers_per_request:  # the chunks whole, one GET each, all in flight at once
            fetched = self.remote.objects.map(lambda i: read_or_error(self._remote_layer, chunks[i][0], layer,
                                                                      chunks[i][1]), misses)
        else:
            for i in misses:  # every fetch started before any is waited on
                try:
                    self.ranged.open(chunks[i][0], chunks[i][1], self.layers_per_request)
                except (MissingChunk, CorruptValue):
                    pass  # its read below answers the same
            fetched = [read_or_error(self._remote_layer, chunks[i][0], layer, chunks[i][1]) for i in misses]
        for i, raw in zip(misses, fetched, strict=True):
            found[i] = raw
        yield found

    def _remote_layer(self, chunk_id: str, layer: int, ids: TokenIds | None) -> RawLayer:
        """A layer not in the local tier: fetched (whole or ranged, module doc), the chunk kept."""
        if not self.layers_per_request:
            return self._fill(chunk_id, ids).raw_layer(layer, self.codec)
        raw = self.ranged.read(chunk_id, layer, ids, self.layers_per_request, self.codec)
        return raw if raw is not None else self.local.get_layer_raw(chunk_id, layer, ids)  # kept locally meanwhile

    def _local_layer(self, chunk_id: str, layer: int, ids: TokenIds | None) -> RawLayer | None:
        """The layer from the local tier; None when it is not there, or being fetched."""
        if self.ranged.busy(chunk_id):
            return None
        try:
            raw = self.local.get_layer_raw(chunk_id, layer, ids)
        except MissingChunk:  # not here (or evicted meanwhile)
            return None
        self._access(chunk_id, hit=True)
        return raw

    def iter_chunks(self, *, include_preamble: bool = False) -> Iterator[tuple[str, KVRecord]]:
        return self.remote.iter_chunks(include_preamble=include_preamble)

    # --- writing ---------------------------------------------------------------------------------

    def put_encoded(self, chunk_id: str, record: bytes, values: Sequence[bytes]) -> bool:
        """Stored in the remote (False when it was there) and kept locally."""
        stored = self.remote.put_encoded(chunk_id, record, values)
        self._admit(chunk_id, RemoteChunk(KVRecord.from_bytes(record), record, list(values)), cost_s=0.0)
        return stored

    def delete_chunk(self, chunk_id: str) -> int:
        self.ranged.drop(chunk_id)  # a fetch in progress must not keep it after
        with self._lock:
            self._untrack(chunk_id)
        self.local.delete_chunk(chunk_id)
        return self.remote.delete_chunk(chunk_id)

    def close(self) -> None:
        """Stop the fetches in progress; a chunk being kept locally is written first (before its store closes)."""
        self.ranged.close()

    def clear_local(self) -> None:
        """Delete every chunk kept locally (not the preamble) and forget what is known of the remote's objects:
        the next reads are cold, as in a fresh process on an empty mirror (a bench's cold start)."""
        self.ranged.clear()
        with self._lock:
            for chunk_id, _ in list(self.local.iter_chunks()):
                self.local.delete_chunk(chunk_id)
                self._untrack(chunk_id)
        self.remote.forget_all()

    def claim(self, chunk_ids: Iterable[str], *, owner: str | None = None) -> list[str]:
        """Those missing remotely, claimed in the local store (processes on one host split them; see LocalKVTable)."""
        return self.local.claim(self.remote.missing(chunk_ids), owner=owner)

    def release(self, chunk_ids: Iterable[str], *, owner: str | None = None) -> None:
        self.local.release(chunk_ids, owner=owner)

    # --- the tier --------------------------------------------------------------------------------

    def _fill(self, chunk_id: str, expect_token_ids: TokenIds | None) -> RemoteChunk:
        """The chunk whole (one GET), kept."""
        start = time.perf_counter()
        chunk = self.remote.get_chunk(chunk_id, expect_token_ids)
        self._fetched(chunk_id, chunk, time.perf_counter() - start)
        return chunk

    def _fetched(self, chunk_id: str, chunk: RemoteChunk, seconds: float) -> bool:
        """A chunk every layer of which has arrived and passed: kept (True when it was, not outgrowing the bound)."""
        self._admit(chunk_id, chunk, cost_s=seconds)
        self._access(chunk_id, hit=False)
        self.ranged.hint.observe(chunk.record)
        with self._lock:
            self.counters.fills += 1
            self.counters.fetched_bytes += stored_bytes(chunk.record)
            return chunk_id in self._sizes

    def _admit(self, chunk_id: str, chunk: RemoteChunk, cost_s: float) -> None:
        """Keep a chunk locally (unless it alone outgrows the bound), then evict others down to the bound."""
        with self._lock:
            if stored_bytes(chunk.record) > self.max_bytes:
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
