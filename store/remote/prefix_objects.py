"""The prefix table of a store on object storage (issue 72): the blocks a replica spills are found by every replica
on the bucket, on any machine, as chunks are.

The mirror's own table (store/prefix_table.py, in its LMDB) stays in front, bounded and evicted by value as before:
a block is looked up there first and makes no request when it is there. Each block written there is also PUT, on the
write-back worker, as one object `prefix/<scope>/<key>` holding the same value (magic, checksum, rows): a PUT is
whole or absent, so a kill never leaves a torn block, and one that fails its checksum is never served. A head's
blocks missing locally are fetched (the first alone, then the rest side by side), and those that came whole, in order,
are kept in the mirror's table.

The bucket's share keeps the same bound: a writer, every tenth of the bound it has written, lists `prefix/` and
deletes the oldest blocks (by the time they were written: an object store keeps no reads) down to 90 % of the bound.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvrag.store.prefix_table import EVICT_TO, PrefixTable, rows_of, stored
from kvrag.store.remote.object_store import ObjectStore

FOLDER = "prefix/"
CHECK_EVERY = 0.1  # of the bound: how much a writer puts between two listings of the bucket's share


class SharedPrefixTable:
    """`local` (the mirror's PrefixTable) in front of the bucket `objects`, with the same calls."""

    def __init__(self, local: PrefixTable, objects: ObjectStore):
        self.local, self.objects = local, objects
        self.bound = local.bound
        self._since_check = 0  # bytes put since the bucket's share was last listed

    def _name(self, key: str) -> str:
        return f"{FOLDER}{self.local.scope}/{key}"

    def leading(self, keys: Sequence[str]) -> list[bytes]:
        """The rows of keys[0], keys[1], ... while each is whole, in the mirror's table or else in the bucket: the
        first missing one asked alone (most heads are in neither: one request), the rest side by side."""
        found = self.local.leading(keys)
        rest = keys[len(found):]
        if not rest:
            return found
        first = self._rows(rest[0])
        if first is None:
            return found
        fetched = [(rest[0], first)]
        for key, rows in zip(rest[1:], self.objects.map(self._rows, rest[1:]), strict=True):
            if rows is None:
                break
            fetched.append((key, rows))
        self.local.put(fetched)  # the next read of them makes no request
        return found + [rows for _, rows in fetched]

    def _rows(self, key: str) -> bytes | None:
        value = self.objects.get(self._name(key))
        return None if value is None else rows_of(value)

    def has(self, key: str) -> bool:
        return self.local.has(key) or self.objects.head(self._name(key)) is not None

    def put(self, blocks: Iterable[tuple[str, bytes]]) -> int:
        """Into the mirror's table and the bucket (the bucket's copy of a block already there is left as it is)."""
        blocks = list(blocks)
        new = self.local.put(blocks)
        self.objects.map(lambda block: self.objects.put(self._name(block[0]), stored(block[1]), create=True), blocks)
        self._since_check += sum(len(rows) for _, rows in blocks)
        if self.bound and self._since_check >= CHECK_EVERY * self.bound:
            self._since_check = 0
            self.trim()
        return new

    def used(self, keys: Iterable[str]) -> None:
        self.local.used(keys)

    def trim(self) -> int:
        """Delete the bucket's oldest blocks while its share is over the bound (down to 90 % of it); how many."""
        listed = sorted(self.objects.list(FOLDER), key=lambda info: (info.modified or 0.0, info.key))
        total = sum(info.size for info in listed)
        if total <= self.bound:
            return 0
        victims = []
        for info in listed:
            if total <= self.bound * EVICT_TO:
                break
            victims.append(info.key)
            total -= info.size
        self.objects.map(self.objects.delete, victims)
        return len(victims)
