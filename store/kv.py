"""Per-(chunk, layer) KV of one model and codec in the `kv` database.

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
from dataclasses import dataclass

import lmdb
import numpy as np
import xxhash

from kvrag.errors import KvragError
from kvrag.store.codec import CorruptValue, DecodedKV, ValueHeader, checked_body, decode, encode
from kvrag.store.env import StoreEnv
from kvrag.store.keys import (
    ChunkKey,
    chunk_of,
    is_preamble_id,
    model_prefix,
    parse_key,
    preamble_chunk_id,
)
from kvrag.store.record import KVRecord, TokenIds

CLAIM_TTL_S = 900.0  # a claim older than this is free again even if its owner looks alive
SCAN_BATCH = 256  # records read per read transaction when iterating (no transaction spans a yield)

Layers = Sequence[tuple[np.ndarray, np.ndarray]]  # per layer: (K, V), each [T, kv_heads, head_dim]
Positions = np.ndarray | Sequence[np.ndarray] | None  # Keyformer subsets: one for all layers, or one per layer


class MissingChunk(KvragError):
    """The chunk has no complete KV in the store (never computed, or dropped by gc/repair)."""


@dataclass(frozen=True)
class Shard:
    """`--shard i/N`: this process computes the chunks whose id hashes to i modulo N (0 ≤ i < N)."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise KvragError(f"shard {self.index}/{self.count}: need 0 <= i < N")

    @classmethod
    def parse(cls, text: str) -> Shard:
        try:
            i, n = (int(part) for part in text.split("/"))
        except ValueError:
            raise KvragError(f"--shard takes i/N (e.g. 0/2), got {text!r}") from None
        return cls(i, n)

    def owns(self, chunk_id: str) -> bool:
        return xxhash.xxh3_64_intdigest(chunk_id.encode()) % self.count == self.index


@dataclass(frozen=True)
class RawLayer:
    """A stored value read but not yet decoded, with what the record says it must hold.

    Lets a loader thread do the LMDB read and hand decompression/dequantization to another step.
    """

    value: bytes
    codec: str
    shape: tuple[int, int, int]  # (kept tokens, kv_heads, head_dim)

    def decode(self, dtype: type | None = None, copy: bool = True) -> DecodedKV:
        """`copy=False`: an uncompressed value decodes to read-only views of `value`."""
        return decode(self.value, expect_codec=self.codec, expect_shape=self.shape, dtype=dtype, copy=copy)

    def body(self) -> tuple[ValueHeader, bytes | memoryview]:
        """The checked, decompressed payload and its header, not decoded (see codec.checked_body)."""
        return checked_body(self.value, expect_codec=self.codec, expect_shape=self.shape)


class KVTable:
    """The KV of one (model fingerprint, codec) in a store; with a `variant`, its reduced (Keyformer) chunks
    of that name instead of the full ones (keys.py: a key range of their own)."""

    def __init__(self, env: StoreEnv, model_fp: str, codec: str = "fp16", compress: bool = True, variant: str = ""):
        model_prefix(model_fp, codec, variant)  # validates the fingerprint, codec and variant
        self.env = env
        self.model_fp = model_fp
        self.codec = codec
        self.variant = variant
        self.compress = compress  # how new values are written (zstd or as they are); reads take either
        self.db = env.db("kv")

    def key(self, chunk_id: str) -> ChunkKey:
        return ChunkKey(self.model_fp, self.codec, chunk_id, self.variant)

    # --- reading ---------------------------------------------------------------------------------

    def has(self, chunk_id: str) -> bool:
        key = self.key(chunk_id).to_bytes()
        return self.env.read(lambda txn: txn.get(key, db=self.db) is not None)

    def missing(self, chunk_ids: Iterable[str], shard: Shard | None = None) -> list[str]:
        """The ids (in the given order, of this shard only) that have no complete KV yet."""
        ids = [c for c in chunk_ids if shard is None or shard.owns(c)]
        keys = [self.key(c).to_bytes() for c in ids]

        def absent(txn: lmdb.Transaction) -> list[str]:
            return [c for c, k in zip(ids, keys, strict=True) if txn.get(k, db=self.db) is None]

        return self.env.read(absent)

    def record(self, chunk_id: str) -> KVRecord | None:
        raw = self.env.read(lambda txn: txn.get(self.key(chunk_id).to_bytes(), db=self.db))
        return None if raw is None else KVRecord.from_bytes(raw)

    def get_layer_raw(self, chunk_id: str, layer: int, expect_token_ids: TokenIds | None = None) -> RawLayer:
        """Read one layer's value (record and value in one snapshot), checked against the record.

        Raises MissingChunk when the chunk is not complete, CorruptValue when the record is damaged,
        the layer is out of range, or the stored token ids differ from `expect_token_ids` (a hash
        collision must never hand out another chunk's KV).
        """
        key = self.key(chunk_id)
        rec_raw, value = self.env.read(
            lambda txn: (txn.get(key.to_bytes(), db=self.db), txn.get(key.layer(layer).to_bytes(), db=self.db))
        )
        return self._checked(chunk_id, layer, expect_token_ids, rec_raw, value)

    @contextmanager
    def layer_views(self, chunks: Sequence[tuple[str, TokenIds]], layer: int,
                    records: dict[str, KVRecord] | None = None) -> Iterator[list[RawLayer | KvragError]]:
        """One layer of these chunks in one read transaction, each checked against its record (MissingChunk or
        CorruptValue in its place when it fails), its value a view of LMDB's map that stays valid inside the block:
        the staging copies the values straight from the map, with no Python copy between. `records`: the chunks'
        records, kept from the load's first layer (read and checked then; a value that no longer fits its record's
        size fails as damaged)."""
        records = {} if records is None else records
        with self.env.reader(buffers=True) as txn:
            out: list[RawLayer | KvragError] = []
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

    def _checked(self, chunk_id: str, layer: int, expect_token_ids: TokenIds | None, rec_raw, value) -> RawLayer:
        """The value, once the chunk's record vouches for it; MissingChunk or CorruptValue otherwise."""
        return self._layer(chunk_id, layer, self._record(chunk_id, expect_token_ids, rec_raw), value)

    def _record(self, chunk_id: str, expect_token_ids: TokenIds | None, rec_raw) -> KVRecord:
        """A chunk's record, checked against the token ids it must hold (a hash collision must never hand out another
        chunk's KV); MissingChunk without one."""
        if rec_raw is None:
            variant = f", {self.variant}" if self.variant else ""
            raise MissingChunk(f"no KV for chunk {chunk_id} (model {self.model_fp}, codec {self.codec}{variant})")
        rec = KVRecord.from_bytes(rec_raw)
        if expect_token_ids is not None and not rec.matches(expect_token_ids):
            raise CorruptValue(f"chunk {chunk_id}: stored token ids differ from the expected ones")
        return rec

    def _layer(self, chunk_id: str, layer: int, rec: KVRecord, value) -> RawLayer:
        """One layer's value, once it has the size its record says."""
        if not 0 <= layer < rec.n_layers:
            raise CorruptValue(f"chunk {chunk_id} has {rec.n_layers} layers, layer {layer} asked")
        if value is None:
            raise CorruptValue(f"chunk {chunk_id}: layer {layer} value is missing")
        if len(value) != rec.value_sizes[layer]:
            raise CorruptValue(f"chunk {chunk_id} layer {layer}: {len(value)} bytes, record says {rec.value_sizes[layer]}")
        return RawLayer(value, self.codec, rec.layer_shape(layer))

    def get_layer(self, chunk_id: str, layer: int, expect_token_ids: TokenIds | None = None,
                  dtype: type | None = None) -> DecodedKV:
        """One layer's KV, checked; unpacks as `k, v` ([T, kv_heads, head_dim] each)."""
        return self.get_layer_raw(chunk_id, layer, expect_token_ids).decode(dtype)

    def iter_chunks(self, *, include_preamble: bool = False) -> Iterator[tuple[str, KVRecord]]:
        """(chunk id, record) of every complete chunk, in key order; damaged records are skipped."""
        for key, raw in scan_records(self.env, model_prefix(self.model_fp, self.codec, self.variant)):
            if include_preamble or not is_preamble_id(key.chunk_id):
                try:
                    yield key.chunk_id, KVRecord.from_bytes(raw)
                except CorruptValue:
                    continue  # `verify` reports it; iteration serves the healthy chunks

    # --- writing ---------------------------------------------------------------------------------

    def put_chunk(self, chunk_id: str, token_ids: TokenIds, layers: Layers, positions: Positions = None) -> bool:
        """Store every layer of a chunk and its record in ONE transaction; False if it was already there.

        `positions` (a Keyformer subset): None (all tokens), one int array for every layer, or one per
        layer; each is [T_kept] or [T_kept, kv_heads] original token positions.
        """
        if self.has(chunk_id):
            return False  # skip the encoding too
        record, values = encode_chunk(token_ids, layers, positions, self.codec, self.compress)
        return self.put_encoded(chunk_id, record, values)

    def put_encoded(self, chunk_id: str, record: bytes, values: Sequence[bytes]) -> bool:
        """Store an encoded chunk (its record bytes and per-layer values) in ONE transaction, the record last as
        the "complete" mark; False when it was there (another process finished it meanwhile)."""
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

    # --- the preamble ------------------------------------------------------------------------------

    def put_preamble(self, preamble_hash: str, token_ids: TokenIds, layers: Layers) -> bool:
        """Store the preamble's KV once, under a reserved chunk id derived from its hash."""
        return self.put_chunk(preamble_chunk_id(preamble_hash), token_ids, layers)

    def has_preamble(self, preamble_hash: str) -> bool:
        return self.has(preamble_chunk_id(preamble_hash))

    def get_preamble_layer(self, preamble_hash: str, layer: int, expect_token_ids: TokenIds | None = None,
                           dtype: type | None = None) -> DecodedKV:
        return self.get_layer(preamble_chunk_id(preamble_hash), layer, expect_token_ids, dtype)

    # --- cooperation between precompute processes --------------------------------------------------

    def claim(self, chunk_ids: Iterable[str], *, owner: str | None = None, ttl_s: float = CLAIM_TTL_S) -> list[str]:
        """Claim, in one transaction, those ids that are neither complete nor claimed by a live owner.

        Several `precompute` processes on one store then split the work without computing a chunk
        twice. A claim is free again when it expires, when its owner process (on this host) is dead
        (so a run killed with -9 and restarted resumes at once), or when the chunk is stored.
        """
        owner = owner or default_owner()
        ids = list(chunk_ids)
        now = time.time()
        stamp = json.dumps({"owner": owner, "expires": now + ttl_s}).encode()

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
        """Drop this owner's claims (e.g. on Ctrl-C, for chunks it will not finish)."""
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


def encode_chunk(token_ids: TokenIds, layers: Layers, positions: Positions, codec: str,
                 compress: bool) -> tuple[bytes, list[bytes]]:
    """A chunk's record bytes and per-layer values, checked: every layer one row per token (or per kept token, with
    positions: None, one array for every layer, or one per layer), one shape of heads."""
    if not layers:
        raise ValueError("a chunk needs at least one layer")
    n_tokens = len(token_ids)
    values, kept = [], []
    for i, ((k, v), pos) in enumerate(zip(layers, _positions_per_layer(positions, len(layers)), strict=True)):
        if pos is None and k.shape[0] != n_tokens:
            raise ValueError(f"layer {i}: K has {k.shape[0]} tokens, the chunk {n_tokens}")
        problem = None if pos is None else positions_problem(np.asarray(pos), n_tokens)
        if problem:
            raise ValueError(f"layer {i}: {problem}")
        if k.shape[1:] != layers[0][0].shape[1:]:
            raise ValueError(f"layer {i}: K shape {k.shape} differs from layer 0's {layers[0][0].shape}")
        values.append(encode(k, v, codec, pos, compress=compress))
        kept.append(k.shape[0])
    _, heads, dim = layers[0][0].shape
    return KVRecord.build(token_ids, heads, dim, kept, [len(v) for v in values]).to_bytes(), values


def positions_problem(positions: np.ndarray, n_tokens: int) -> str | None:
    """What is wrong with a reduced chunk's positions ([T_kept] or [T_kept, kv_heads] token indices), or None:
    they must rise strictly (per head) and lie in 0..n_tokens-1, so a loader can place each row at one spot."""
    if positions.size == 0:
        return None
    if positions.min() < 0 or positions.max() >= n_tokens:
        return f"positions outside 0..{n_tokens - 1}"
    if positions.shape[0] > 1 and not (np.diff(positions, axis=0) > 0).all():
        return "positions do not rise strictly"
    return None


def _positions_per_layer(positions: Positions, n_layers: int) -> list[np.ndarray | None]:
    if positions is None or isinstance(positions, np.ndarray):
        return [positions] * n_layers
    positions = list(positions)
    if len(positions) != n_layers:
        raise ValueError(f"{len(positions)} position arrays for {n_layers} layers")
    return positions


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
