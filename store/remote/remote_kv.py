"""The KV of one (model fingerprint, codec, variant) on object storage: one object per chunk (layout.py), under

    <prefix>/kv/<model_fp>/<codec>[/<variant>]/<chunk_id>

`RemoteKVTable` implements the KVTable protocol (store/table.py) whole: `layer_views` reads one layer of several
chunks as concurrent ranged GETs; beside it, `get_chunk` reads a chunk whole in one GET (the cache tier's fill).

Reads: a chunk's index (header + record) comes from one ranged GET of its first INDEX_PROBE bytes and is kept
(bounded); a layer is then one ranged GET, conditional on the index's ETag. Every value read is checked (length,
checksum, codec, shape) before it is handed out. The cache tier's ranged reads (ranged.py) go through the same
index and checks (`kept_index`, `index_from`, `check_layer`), with no probe of their own: their first GET holds the
index and the first layers. An object that fails a check is reported in `damaged` and
treated as missing: `has` says False, reads raise DamagedObject, and the next put replaces it.
Writes: one PUT of the whole object, only where none is (If-None-Match): a PUT is atomic, so no reader ever
sees part of an object, and two writers of one chunk leave one whole object (the same bytes, in practice).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from kvrag.store.codec import CorruptValue
from kvrag.store.keys import is_preamble_id, model_prefix
from kvrag.store.record import KVRecord, TokenIds
from kvrag.store.remote.layout import (
    INDEX_PROBE,
    ChunkIndex,
    check_value,
    index_length,
    pack_chunk,
    parse_index,
)
from kvrag.store.remote.object_store import ObjectChanged, ObjectStore
from kvrag.store.table import KVTable, LayerRead, MissingChunk, RawLayer, Shard, check_request, read_or_error

INDEX_CACHE = 4096  # chunk indexes kept (a record is ~2-3 KB for a 512-token chunk)
LIST_ABOVE = 64  # `missing` over more ids than this lists the folder instead of reading each index


class DamagedObject(CorruptValue):
    """A chunk object failed a check (size, header, record or a value): never served; recompute the chunk."""

    def __init__(self, chunk_id: str, where: str, reason: str):
        super().__init__(f"chunk {chunk_id}: object {where} is damaged ({reason}); it counts as missing")
        self.chunk_id = chunk_id


@dataclass(frozen=True)
class RemoteChunk:
    """A chunk read whole and checked: its record (and its bytes) and every layer's value."""

    record: KVRecord
    record_bytes: bytes
    values: list[bytes]

    def raw_layer(self, layer: int, codec: str) -> RawLayer:
        return RawLayer(self.values[layer], codec, self.record.layer_shape(layer))


class RemoteKVTable(KVTable):
    def __init__(self, objects: ObjectStore, model_fp: str, codec: str = "fp16", compress: bool = True,
                 variant: str = ""):
        model_prefix(model_fp, codec, variant)  # validates them as the local store does
        if any("/" in part for part in (model_fp, variant)):
            raise ValueError(f"a model fingerprint or variant with '/' cannot name an object: {model_fp!r} {variant!r}")
        self.objects = objects
        self.model_fp, self.codec, self.variant, self.compress = model_fp, codec, variant, compress
        self.folder = "/".join(["kv", model_fp, codec] + ([variant] if variant else []))
        self.damaged: dict[str, str] = {}  # chunk id -> what was wrong with its object, as last found
        self._indexes: OrderedDict[str, ChunkIndex] = OrderedDict()
        self._lock = threading.Lock()

    def key(self, chunk_id: str) -> str:
        if not chunk_id or "/" in chunk_id:
            raise ValueError(f"chunk id {chunk_id!r} cannot name an object")
        return f"{self.folder}/{chunk_id}"

    # --- reading ---------------------------------------------------------------------------------

    def has(self, chunk_id: str) -> bool:
        """Whether a whole, healthy-looking object is there (its index read and checked; values at read)."""
        try:
            self._index(chunk_id)
            return True
        except (MissingChunk, DamagedObject):
            return False

    def missing(self, chunk_ids: Iterable[str], shard: Shard | None = None) -> list[str]:
        """The ids (in order, of this shard only) with no healthy object. A few: each index read at once (and
        kept for the reads that follow); many: one LIST of the folder (existence only)."""
        ids = [c for c in chunk_ids if shard is None or shard.owns(c)]
        if len(ids) <= LIST_ABOVE:
            present = self.objects.map(self.has, ids)
            return [c for c, ok in zip(ids, present, strict=True) if not ok]
        stored = set(self.chunk_ids(include_preamble=True)) - set(self.damaged)
        return [c for c in ids if c not in stored]

    def record(self, chunk_id: str) -> KVRecord | None:
        try:
            return self._index(chunk_id).record
        except (MissingChunk, DamagedObject):
            return None

    def get_layer_raw(self, chunk_id: str, layer: int, expect_token_ids: TokenIds | None = None) -> RawLayer:
        """One layer's value (one ranged GET once the index is known), checked. MissingChunk when there is no
        object; DamagedObject when it fails a check; CorruptValue for other token ids or a layer out of range."""
        for attempt in range(2):
            index = self._index(chunk_id)
            try:
                check_request(chunk_id, index.record, layer, expect_token_ids)
                start, end = index.layer_range(layer)
                value = self.objects.get_range(self.key(chunk_id), start, end, if_match=index.etag)
            except (ObjectChanged, CorruptValue):  # a kept index may be stale (the object replaced): read it anew
                self.forget(chunk_id)
                if attempt:
                    raise
                continue
            if value is None:
                self.forget(chunk_id)
                raise self.missing_error(chunk_id)
            self.check_layer(chunk_id, layer, value, index.record)
            return RawLayer(value, self.codec, index.record.layer_shape(layer))
        raise AssertionError("unreachable")

    @contextmanager
    def layer_views(self, chunks: Sequence[tuple[str, TokenIds | None]], layer: int,
                    records: dict[str, KVRecord] | None = None) -> Iterator[list[LayerRead]]:
        """A ranged GET per chunk, all in flight at once (S3 reads one object, or one byte range of it, per
        request); the kept indexes stand for `records`."""
        yield self.objects.map(lambda pair: read_or_error(self.get_layer_raw, pair[0], layer, pair[1]), chunks)

    def get_chunk(self, chunk_id: str, expect_token_ids: TokenIds | None = None) -> RemoteChunk:
        """The chunk whole, in one GET, every value checked."""
        got = self.objects.fetch(self.key(chunk_id))
        if got is None:
            self.forget(chunk_id)
            raise self.missing_error(chunk_id)
        data, info = got
        index = self.index_from(chunk_id, data[:self.index_end(chunk_id, data)], info.size, info.etag)
        check_request(chunk_id, index.record, 0, expect_token_ids)
        values = []
        for layer in range(index.record.n_layers):
            start, end = index.layer_range(layer)
            values.append(data[start:end])
            self.check_layer(chunk_id, layer, values[-1], index.record)
        return RemoteChunk(index.record, index.record_bytes, values)

    def chunk_ids(self, *, include_preamble: bool = False) -> list[str]:
        """The ids of every object in the folder (one LIST; sub-folders of variants left out)."""
        ids = (info.key[len(self.folder) + 1:] for info in self.objects.list(self.folder))
        return [c for c in ids if "/" not in c and (include_preamble or not is_preamble_id(c))]

    def iter_chunks(self, *, include_preamble: bool = False) -> Iterator[tuple[str, KVRecord]]:
        """(chunk id, record) of every healthy chunk object: a LIST, then each index (a request per chunk)."""
        ids = self.chunk_ids(include_preamble=include_preamble)
        for i in range(0, len(ids), LIST_ABOVE):
            batch = ids[i:i + LIST_ABOVE]
            for chunk_id, record in zip(batch, self.objects.map(self.record, batch), strict=True):
                if record is not None:
                    yield chunk_id, record

    # --- writing ---------------------------------------------------------------------------------

    def put_encoded(self, chunk_id: str, record: bytes, values: Sequence[bytes]) -> bool:
        """One PUT, replacing the object only when it was found damaged; False when another writer's object was
        there first."""
        replace = chunk_id in self.damaged
        stored = self.objects.put(self.key(chunk_id), pack_chunk(record, values), create=not replace)
        self.forget(chunk_id)
        if stored:
            self.damaged.pop(chunk_id, None)
        return stored

    def delete_chunk(self, chunk_id: str) -> int:
        """Delete the chunk's object; 1 if there was one, else 0."""
        existed = self.objects.head(self.key(chunk_id)) is not None
        self.objects.delete(self.key(chunk_id))
        self.forget(chunk_id)
        return int(existed)

    def claim(self, chunk_ids: Iterable[str], *, owner: str | None = None) -> list[str]:
        """Those still missing. Object storage has no locks: machines split work with --shard, and a chunk two
        of them compute is stored once (a create-only PUT)."""
        return self.missing(chunk_ids)

    def release(self, chunk_ids: Iterable[str], *, owner: str | None = None) -> None:
        """Nothing to release (see `claim`)."""

    # --- the index -------------------------------------------------------------------------------

    def _index(self, chunk_id: str) -> ChunkIndex:
        """The chunk's index, kept or read (one ranged GET, two when the record outgrows the probe); a chunk
        found damaged stays so until it is put again."""
        kept = self.kept_index(chunk_id)
        if kept is not None:
            return kept
        key = self.key(chunk_id)
        got = self.objects.fetch(key, INDEX_PROBE)
        if got is None:
            raise self.missing_error(chunk_id)
        head, info = got
        end = self.index_end(chunk_id, head)
        if len(head) < end <= info.size:
            head += self.objects.get_range(key, len(head), end, if_match=info.etag) or b""
        return self.index_from(chunk_id, head, info.size, info.etag)

    def kept_index(self, chunk_id: str) -> ChunkIndex | None:
        """The chunk's index if kept (no request), else None; DamagedObject for a chunk found damaged."""
        if chunk_id in self.damaged:
            raise DamagedObject(chunk_id, f"{self.objects.url}/{self.key(chunk_id)}", self.damaged[chunk_id])
        with self._lock:
            index = self._indexes.get(chunk_id)
            if index is not None:
                self._indexes.move_to_end(chunk_id)
            return index

    def index_from(self, chunk_id: str, head: bytes, size: int, etag: str | None) -> ChunkIndex:
        try:
            index = parse_index(head, size, etag)
        except CorruptValue as exc:
            raise self.mark_damaged(chunk_id, str(exc)) from None
        with self._lock:
            self._indexes[chunk_id] = index
            while len(self._indexes) > INDEX_CACHE:
                self._indexes.popitem(last=False)
        return index

    def index_end(self, chunk_id: str, head: bytes) -> int:
        try:
            return index_length(head)
        except CorruptValue as exc:
            raise self.mark_damaged(chunk_id, str(exc)) from None

    def forget(self, chunk_id: str) -> None:
        with self._lock:
            self._indexes.pop(chunk_id, None)

    def forget_all(self) -> None:
        """Drop every kept index (a bench's cold start: the next read of each chunk reads its index anew)."""
        with self._lock:
            self._indexes.clear()

    def check_layer(self, chunk_id: str, layer: int, value: bytes, record: KVRecord) -> None:
        if len(value) != record.value_sizes[layer]:
            raise self.mark_damaged(chunk_id, f"layer {layer}: {len(value)} bytes, record says {record.value_sizes[layer]}")
        try:
            check_value(value, self.codec, record.layer_shape(layer))
        except CorruptValue as exc:
            raise self.mark_damaged(chunk_id, f"layer {layer}: {exc}") from None

    def mark_damaged(self, chunk_id: str, reason: str) -> DamagedObject:
        self.forget(chunk_id)
        self.damaged[chunk_id] = reason
        return DamagedObject(chunk_id, f"{self.objects.url}/{self.key(chunk_id)}", reason)

    def missing_error(self, chunk_id: str) -> MissingChunk:
        variant = f", {self.variant}" if self.variant else ""
        return MissingChunk(f"no KV for chunk {chunk_id} in {self.objects.url} (model {self.model_fp}, "
                            f"codec {self.codec}{variant})")


