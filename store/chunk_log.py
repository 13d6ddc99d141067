"""The chunk table's change log: which chunks each write added or deleted, in order, so that a process holding an
index over the chunks (engine/prompt_reuse.py's passage index) reads only what changed since it last looked, whoever
changed it (another replica keeping or evicting a passage, `kvrag index` or `gc` in another process).

An entry is written in the same LMDB transaction as the change it records, so a reader's snapshot never sees a
change without its entry or an entry without its change. Keys live in the `meta` database:

    chunklog/head           u64: the last entry's number (0: none yet)
    chunklog/first          u64: the oldest entry kept (`trim` drops older ones)
    chunklog/<u64 number>   b"+" or b"-", then the 16-byte keys of the chunks added or deleted (at most ENTRY_IDS)

A reader whose last number is older than `first` has missed entries and reads the whole table again.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import lmdb

_HEAD, _FIRST, _PREFIX = b"chunklog/head", b"chunklog/first", b"chunklog/"
_U64 = struct.Struct(">Q")  # big-endian: entries sort by number under LMDB's byte order
ADDED, DELETED = b"+", b"-"
ENTRY_IDS = 512  # chunk keys an entry holds: a big write spreads over entries, so a reader can go a few at a time
KEEP_ENTRIES = 65536  # entries `trim` keeps (a reader further behind reads the whole table again)


@dataclass(frozen=True)
class Change:
    number: int
    added: bool
    chunk_ids: tuple[str, ...]


def _get_u64(txn: lmdb.Transaction, db, key: bytes) -> int:
    raw = txn.get(key, db=db)
    return 0 if raw is None else _U64.unpack(raw)[0]


def record(txn: lmdb.Transaction, meta_db, op: bytes, keys: Sequence[bytes]) -> None:
    """Log chunk keys added (ADDED) or deleted (DELETED) by the write transaction `txn`."""
    head = _get_u64(txn, meta_db, _HEAD)
    for at in range(0, len(keys), ENTRY_IDS):
        head += 1
        txn.put(_PREFIX + _U64.pack(head), op + b"".join(keys[at:at + ENTRY_IDS]), db=meta_db)
    if keys:
        txn.put(_HEAD, _U64.pack(head), db=meta_db)
        if txn.get(_FIRST, db=meta_db) is None:
            txn.put(_FIRST, _U64.pack(1), db=meta_db)


def head(txn: lmdb.Transaction, meta_db) -> int:
    """The last entry's number (0 for a store that has logged nothing)."""
    return _get_u64(txn, meta_db, _HEAD)


def since(txn: lmdb.Transaction, meta_db, number: int, limit: int | None = None) -> list[Change] | None:
    """The entries after `number` (at most `limit` of them), oldest first; None when some were trimmed away."""
    top = head(txn, meta_db)
    if number >= top:
        return []
    if number + 1 < _get_u64(txn, meta_db, _FIRST):
        return None
    out, cursor = [], txn.cursor(db=meta_db)
    if not cursor.set_key(_PREFIX + _U64.pack(number + 1)):
        return None
    for key, raw in cursor:
        if not key.startswith(_PREFIX) or len(key) != len(_PREFIX) + 8 or (limit is not None and len(out) >= limit):
            break
        raw = bytes(raw)
        ids = tuple(raw[i:i + 16].hex() for i in range(1, len(raw), 16))
        out.append(Change(_U64.unpack(key[len(_PREFIX):])[0], raw[:1] == ADDED, ids))
    return out


def trim(txn: lmdb.Transaction, meta_db, keep: int = KEEP_ENTRIES) -> int:
    """Drop all but the newest `keep` entries (store gc); returns how many went."""
    top, first = head(txn, meta_db), max(1, _get_u64(txn, meta_db, _FIRST))
    new_first = max(first, top - keep + 1)
    for number in range(first, new_first):
        txn.delete(_PREFIX + _U64.pack(number), db=meta_db)
    if new_first != first:
        txn.put(_FIRST, _U64.pack(new_first), db=meta_db)
    return new_first - first
