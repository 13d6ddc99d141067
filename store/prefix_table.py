"""The prefix cache's blocks in the store (issue 72): a server's conversations outlive it, and every replica on the
store finds them.

A block is one pool block's rows, every layer's K (rotated to its positions) and V, exact ones only (computed as a full
prefill computes them), in the pool's own dtype (no codec rounding: a restored head is the head that was computed).
It is found by the chained hash of every id up to its end and the tenant's salt (kvcache/prefix_cache.block_keys)
within a scope: the model's fingerprint, dtype, device, weights form, kernels and block size. Another model or weights
form has another scope, so it never hits. The `prefix` database holds, per block:

    b/<scope>/<key>  MAGIC, the rows' 8-byte xxh3, the rows     (one put: a kill leaves it whole or absent)
    u/<scope>/<key>  priority (float64), uses (uint32), bytes (uint32)  (PGDSF: the tiers' eviction by value)

and `t` the table's bytes. Past its bound the lowest-priority blocks go (priority = the clock when last used + uses;
the clock rises to each evicted block's priority, GDSF's aging; a block's cost is proportional to its size, so the
cost over size of PGDSF is the same for every block).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence

import lmdb
import xxhash

from kvrag.store.env import StoreEnv

MAGIC = b"KVP1"
_USE = struct.Struct("<dII")  # priority, uses, bytes
_TOTAL, _CLOCK = b"t", b"c"
EVICT_TO = 0.9  # an eviction frees down to this share of the bound, so that the next writes do not each evict


def scope_of(model_fp: str, *parts: object) -> str:
    """A scope's name from what makes a block's bits: the model's fingerprint (first, so that `store gc` can tell a
    model's blocks), then a hash of the rest (dtype, device, weights form, ...)."""
    return model_fp + "." + hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=8).hexdigest()


def model_of(name: bytes) -> str:
    """The model fingerprint of a stored block's or use record's key (b/<scope>/<key> or u/...)."""
    return name.split(b"/")[1].split(b".")[0].decode()


def _digest(rows: bytes) -> bytes:
    return xxhash.xxh3_64_digest(rows)  # the store codec's checksum: GB/s, where a 4.5k-token head is 130 MB


def stored(rows: bytes) -> bytes:
    """A block's value: the magic, the rows' checksum, the rows."""
    return MAGIC + _digest(rows) + rows


def rows_of(value: bytes) -> bytes | None:
    """A stored value's rows; None when it is not whole (a bad magic or checksum)."""
    if len(value) < 12 or value[:4] != MAGIC or _digest(value[12:]) != value[4:12]:
        return None
    return value[12:]


class PrefixTable:
    """One scope's blocks in a store, at most `bound` bytes of rows in the whole table (0: no bound)."""

    def __init__(self, env: StoreEnv, scope: str, bound: int = 0):
        self.env, self.db, self.scope, self.bound = env, env.db("prefix"), scope, bound

    def _key(self, tag: bytes, key: str) -> bytes:
        return tag + b"/" + self.scope.encode() + b"/" + key.encode()

    def leading(self, keys: Sequence[str]) -> list[bytes]:
        """The rows of keys[0], keys[1], ... while each is stored and whole (the blocks a head can take in order)."""
        def read(txn: lmdb.Transaction) -> list[bytes]:
            found = []
            for key in keys:
                value = txn.get(self._key(b"b", key), db=self.db)
                rows = None if value is None else rows_of(bytes(value))
                if rows is None:
                    break
                found.append(rows)
            return found

        return self.env.read(read)

    def has(self, key: str) -> bool:
        return self.env.read(lambda txn: txn.get(self._key(b"b", key), db=self.db) is not None)

    def put(self, blocks: Iterable[tuple[str, bytes]]) -> int:
        """Store the blocks not stored yet, in one transaction, then evict past the bound; how many were new."""
        blocks = list(blocks)

        def write(txn: lmdb.Transaction) -> int:
            (total, clock), new = _totals(txn, self.db), 0
            for key, rows in blocks:
                if txn.get(self._key(b"b", key), db=self.db) is not None:
                    continue
                txn.put(self._key(b"b", key), stored(rows), db=self.db)
                txn.put(self._key(b"u", key), _USE.pack(clock + 1, 1, len(rows)), db=self.db)
                total, new = total + len(rows), new + 1
            if self.bound and total > self.bound:
                total, clock = _evict(txn, self.db, total, clock, int(self.bound * EVICT_TO))
            txn.put(_TOTAL, struct.pack("<Q", total), db=self.db)
            txn.put(_CLOCK, struct.pack("<d", clock), db=self.db)
            return new

        return self.env.write(write)

    def used(self, keys: Iterable[str]) -> None:
        """A head read these blocks: each is used once more, at the clock's present."""
        keys = list(keys)

        def write(txn: lmdb.Transaction) -> None:
            _, clock = _totals(txn, self.db)
            for key in keys:
                raw = txn.get(self._key(b"u", key), db=self.db)
                if raw is not None:
                    _, uses, size = _USE.unpack(raw)
                    txn.put(self._key(b"u", key), _USE.pack(clock + uses + 1, uses + 1, size), db=self.db)

        self.env.write(write)


def _totals(txn: lmdb.Transaction, db) -> tuple[int, float]:
    """The table's bytes of rows, and its clock."""
    total, clock = txn.get(_TOTAL, db=db), txn.get(_CLOCK, db=db)
    return (struct.unpack("<Q", total)[0] if total else 0), (struct.unpack("<d", clock)[0] if clock else 0.0)


def _evict(txn: lmdb.Transaction, db, total: int, clock: float, target: int) -> tuple[int, float]:
    """Delete the lowest-priority blocks (every scope's) until `total` is at most `target`; the new total and clock."""
    entries = []
    for key, raw in txn.cursor(db=db).iternext():
        if key.startswith(b"u/"):
            priority, _, size = _USE.unpack(raw)
            entries.append((priority, size, bytes(key[2:])))
    entries.sort()
    for priority, size, name in entries:
        if total <= target:
            break
        txn.delete(b"b/" + name, db=db)
        txn.delete(b"u/" + name, db=db)
        total, clock = total - size, max(clock, priority)
    return total, clock


def table_stats(env: StoreEnv) -> dict:
    """{blocks, bytes, bad}: the whole table's blocks (every scope), their rows' bytes, and those not whole."""
    if not env.has_db("prefix"):
        return {"blocks": 0, "bytes": 0, "bad": 0}
    blocks = size = bad = 0
    with env.reader() as txn:
        for key, value in txn.cursor(db=env.db("prefix")).iternext():
            if key.startswith(b"b/"):
                rows = rows_of(bytes(value))
                blocks, bad, size = blocks + 1, bad + (rows is None), size + (len(rows) if rows else 0)
    return {"blocks": blocks, "bytes": size, "bad": bad}


def bad_blocks(env: StoreEnv) -> list[bytes]:
    """The keys of the blocks that are not whole (a bad magic or checksum)."""
    if not env.has_db("prefix"):
        return []
    with env.reader() as txn:
        return [bytes(k) for k, v in txn.cursor(db=env.db("prefix")).iternext()
                if k.startswith(b"b/") and rows_of(bytes(v)) is None]


def drop_models(env: StoreEnv, doomed) -> int:
    """Delete the blocks of the models `doomed(fingerprint)` condemns (`store gc`); how many."""
    if not env.has_db("prefix"):
        return 0
    with env.reader() as txn:
        names = [bytes(k) for k in txn.cursor(db=env.db("prefix")).iternext(values=False)
                 if k.startswith(b"b/") and doomed(model_of(bytes(k)))]
    return drop(env, names)


def drop(env: StoreEnv, bad: list[bytes]) -> int:
    """Delete these blocks (b/... keys) and their use records, the table's bytes kept right; how many."""

    def write(txn: lmdb.Transaction) -> int:
        db = env.db("prefix")
        total, _ = _totals(txn, db)
        for key in bad:
            use = txn.get(b"u/" + key[2:], db=db)
            total -= _USE.unpack(use)[2] if use else 0
            txn.delete(key, db=db)
            txn.delete(b"u/" + key[2:], db=db)
        txn.put(_TOTAL, struct.pack("<Q", max(0, total)), db=db)
        return len(bad)

    return env.write(write) if bad else 0
