"""LocalKVTable: per-(chunk, layer) KV of one model and codec in a store directory's `kv` database.

A chunk is written whole in one transaction — every layer, then its record (the "complete" mark) —
so a reader, a crash or a concurrent writer can never see half a chunk. Writing is idempotent: a chunk
that is already complete is left as it is, so concurrent or resumed precomputes never store it twice.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import lmdb

from kvrag.store.codec import CorruptValue
from kvrag.store.env import StoreEnv
from kvrag.store.keys import ChunkKey, chunk_of, is_preamble_id, model_prefix, parse_key
from kvrag.store.record import KVRecord, TokenIds
from kvrag.store.table import KVTable, LayerRead, MissingChunk, RawLayer, Shard, check_request

CLAIM_TTL_S = 900.0  # a claim older than this is free again even if its owner looks alive
SCAN_BATCH = 256  # records read per read transaction when iterating (no transaction spans a yield)


class LocalKVTable(KVTable):
    """The KVTable of a store directory: LMDB's `kv` database, a key range per (model, codec, variant) (keys.py)."""

    def __init__(self, env: StoreEnv, model_fp: str, codec: str = "fp16", compress: bool = True, variant: str = ""):
        model_prefix(model_fp, codec, variant)  # validates the fingerprint, codec and variant
        self.env, self.db = env, env.db("kv")
        self.model_fp, self.codec, self.variant, self.compress = model_fp, codec, variant, compress

    def key(self, chunk_id: str) -> ChunkKey:
        return ChunkKey(self.model_fp, self.codec, chunk_id, self.variant)

    # --- reading ---------------------------------------------------------------------------------

    def has(self, chunk_id: str) -> bool:
        key = self.key(chunk_id).to_bytes()
        return self.env.read(lambda txn: txn.get(key, db=self.db) is not None)

    def missing(self, chunk_ids: Iterable[str], shard: Shard | None = None) -> list[str]:
        ids = [c for c in chunk_ids if shard is None or shard.owns(c)]
        keys = [self.key(c).to_bytes() for c in ids]

        def absent(txn: lmdb.Transaction) -> list[str]:
            return [c for c, k in zip(ids, keys, strict=True) if txn.get(k, db=self.db) is None]

        return self.env.read(absent)

    def record(self, chunk_id: str) -> KVRecord | None:
        raw = self.env.read(lambda txn: txn.get(self.key(chunk_id).to_bytes(), db=self.db))
        return None if raw is None else KVRecord.from_bytes(raw)

    def get_layer_raw(self, chunk_id: str, layer: int, expect_token_ids: TokenIds | None = None) -> RawLayer:
        """Record and value read in one snapshot."""
        key = self.key(chunk_id)
        rec_raw, value = self.env.read(
            lambda txn: (txn.get(key.to_bytes(), db=self.db), txn.get(key.layer(layer).to_bytes(), db=self.db))
        )
        return self._layer(chunk_id, layer, self._record(chunk_id, expect_token_ids, rec_raw), value)

    @contextmanager
    def layer_views(self, chunks: Sequence[tuple[str, TokenIds | None]], layer: int,
                    records: dict[str, KVRecord] | None = None) -> Iterator[list[LayerRead]]:
        """One read transaction, each value a view of LMDB's map: the staging copies the values straight from the
        map, with no Python copy between. `records` kept from the load's first layer (read and checked then; a
        value that no longer fits its record's size fails as damaged)."""
        records = {} if records is None else records
        with self.env.reader(buffers=True) as txn:
            out: list[LayerRead] = []
            for chunk_id, ids in chunks:
                key = self.key(chunk_id)
                try:
                    if chunk_id not in records:
                        rec_raw = txn.get(key.to_bytes(), db=self.db)
                        records[chunk_id] = self._record(chunk_id, ids, None if rec_raw is None else bytes(rec_raw))
                    out.append(self._layer(chunk_id, layer, records[chunk_id],
                                           txn.get(key.layer(layer).to_bytes(), db=self.db)))
                except (MissingChunk, CorruptValue) as exc:
                    out.append(exc)
            yield out

    def _record(self, chunk_id: str, expect_token_ids: TokenIds | None, rec_raw) -> KVRecord:
        """A chunk's record, checked against the token ids it must hold (a hash collision must never hand out another
        chunk's KV); MissingChunk without one."""
        if rec_raw is None:
            variant = f", {self.variant}" if self.variant else ""
            raise MissingChunk(f"no KV for chunk {chunk_id} (model {self.model_fp}, codec {self.codec}{variant})")
        rec = KVRecord.from_bytes(rec_raw)
        check_request(chunk_id, rec, 0, expect_token_ids)
        return rec

    def _layer(self, chunk_id: str, layer: int, rec: KVRecord, value) -> RawLayer:
        """One layer's value, once it has the size its record says."""
        check_request(chunk_id, rec, layer, None)
        if value is None:
            raise CorruptValue(f"chunk {chunk_id}: layer {layer} value is missing")
        if len(value) != rec.value_sizes[layer]:
            raise CorruptValue(f"chunk {chunk_id} layer {layer}: {len(value)} bytes, record says {rec.value_sizes[layer]}")
        return RawLayer(value, self.codec, rec.layer_shape(layer))

    def iter_chunks(self, *, include_preamble: bool = False) -> Iterator[tuple[str, KVRecord]]:
        """(chunk id, record) of every complete chunk, in key order; damaged records are skipped."""
        for key, raw in scan_records(self.env, model_prefix(self.model_fp, self.codec, self.variant)):
            if include_preamble or not is_preamble_id(key.chunk_id):
                try:
                    yield key.chunk_id, KVRecord.from_bytes(raw)
                except CorruptValue:
                    continue  # `verify` reports it; iteration serves the healthy chunks

    # --- writing ---------------------------------------------------------------------------------

    def put_encoded(self, chunk_id: str, record: bytes, values: Sequence[bytes]) -> bool:
        """In ONE transaction, the record last as the "complete" mark."""
        key = self.key(chunk_id)
        claim = key.claim_key()

        def write(txn: lmdb.Transaction) -> bool:
            if txn.get(key.to_bytes(), db=self.db) is not None:
                return False
            for layer, value in enumerate(values):
                txn.put(key.layer(layer).to_bytes(), value, db=self.db)
            txn.put(key.to_bytes(), record, db=self.db)
            txn.delete(claim, db=self.db)
            return True

        return self.env.write(write)

    def delete_chunk(self, chunk_id: str) -> int:
        """Delete every entry of the chunk (layers, record, claim) in one transaction; returns the count."""
        prefix = self.key(chunk_id).prefix
        return self.env.write(lambda txn: delete_prefix(txn, self.db, prefix))

    # --- cooperation between precompute processes --------------------------------------------------

    def claim(self, chunk_ids: Iterable[str], *, owner: str | None = None) -> list[str]:
        """Claim, in one transaction, those ids that are neither complete nor claimed by a live owner.

        Several `precompute` processes on one store then split the work without computing a chunk
        twice. A claim is free again when it expires, when its owner process (on this host) is dead
        (so a run killed with -9 and restarted resumes at once), or when the chunk is stored.
        """
        owner = owner or default_owner()
        ids = list(chunk_ids)
        now = time.time()
        stamp = json.dumps({"owner": owner, "expires": now + CLAIM_TTL_S}).encode()

        def take(txn: lmdb.Transaction) -> list[str]:
            won = []
            for chunk_id in ids:
                key = self.key(chunk_id)
                if txn.get(key.to_bytes(), db=self.db) is not None:
                    continue
                held = txn.get(key.claim_key(), db=self.db)
                if held is not None and claim_alive(held, owner, now):
                    continue
                txn.put(key.claim_key(), stamp, db=self.db)
                won.append(chunk_id)
            return won

        return self.env.write(take)

    def release(self, chunk_ids: Iterable[str], *, owner: str | None = None) -> None:
        owner = owner or default_owner()
        keys = [self.key(c).claim_key() for c in chunk_ids]

        def drop(txn: lmdb.Transaction) -> None:
            for key in keys:
                held = txn.get(key, db=self.db)
                if held is not None and json.loads(held).get("owner") == owner:
                    txn.delete(key, db=self.db)

        self.env.write(drop)


def default_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def claim_alive(raw: bytes, me: str, now: float) -> bool:
    """Whether a stored claim still binds `me` (a claim of mine, or an expired or orphaned one, does not)."""
    try:
        held = json.loads(raw)
        holder, expires = str(held["owner"]), float(held["expires"])
    except (ValueError, KeyError, TypeError):
        return False  # unreadable claim: treat as free
    if holder == me or expires < now:
        return False
    host, _, pid = holder.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return True  # another machine's claim: trust it until it expires
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's
    return True


def delete_prefix(txn: lmdb.Transaction, db, prefix: bytes) -> int:
    """Delete every key that starts with `prefix`; returns how many."""
    cursor = txn.cursor(db=db)
    count = 0
    if cursor.set_range(prefix):
        while cursor.key().startswith(prefix):
            count += 1
            if not cursor.delete():  # moves to the next key; False at the end
                break
    return count


def scan_records(env: StoreEnv, prefix: bytes, batch: int = SCAN_BATCH) -> Iterator[tuple[ChunkKey, bytes]]:
    """(key, raw record) of every chunk record under `prefix`, a batch per read transaction.

    Jumps from a chunk's first key straight to its record, so layers are never read. No transaction is
    open while the caller runs (it may write, and a map resize needs no open transactions).
    """
    start = prefix
    while True:
        with env.reader() as txn:
            cursor = txn.cursor(db=env.db("kv"))
            found: list[tuple[ChunkKey, bytes]] = []
            ok = cursor.set_range(start)
            while ok and len(found) < batch and cursor.key().startswith(prefix):
                try:
                    record = chunk_of(parse_key(cursor.key())).to_bytes()
                except ValueError:  # a damaged key: step over it
                    ok = cursor.next()
                    continue
                ok = cursor.set_range(record)
                if ok and cursor.key() == record:
                    found.append((ChunkKey.from_bytes(record), cursor.value()))
                    ok = cursor.next()
                # else: a chunk without a record (only a claim); the cursor already is past it
            start = cursor.key() if ok and cursor.key().startswith(prefix) else None
        yield from found
        if start is None:
            return
