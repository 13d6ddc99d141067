"""Automatic prefix caching inside the paged pool (vLLM's): a prompt's whole blocks, found again by chained hash.

A block is cached under the hash of every id up to its end (and the tenant's salt), so equal hashes mean equal
prefixes. The cache holds one reference on each block it lists: while a sequence also holds it, the block is in use;
once only the cache does, it is evictable, and the pool's allocator takes the least recently used such blocks when
its free list runs out. A hit is a reference taken and a block id put in the new sequence's table: no row is copied
into a second store. Each entry says whether its rows are exact (computed as a full prefill would, no blended row
among or before them); a request that asks for exact KV stops at the first that is not.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvrag.kvcache.allocator import BlockAllocator


def block_keys(ids: Sequence[int], block_size: int, salt: str = "") -> list[str]:
    """One key per whole block of ids, each hashing the salt and every id up to its block's end (vLLM's chained
    block hashes): equal keys mean equal prefixes."""
    salted = salt.encode()
    # the salt's length first: else a salt's last bytes and a prompt's first ids could pass for each other
    digest = hashlib.blake2b(len(salted).to_bytes(4, "little") + salted, digest_size=16, person=b"kvrag-prefix")
    whole = len(ids) // block_size * block_size
    data = np.asarray(ids[:whole], dtype="<u4").tobytes()  # each id as 4 little-endian bytes, in one pass
    keys = []
    for end in range(block_size, whole + 1, block_size):
        digest.update(data[4 * (end - block_size):4 * end])
        keys.append(digest.copy().hexdigest())
    return keys


@dataclass(frozen=True)
class Entry:
    block: int  # the pool block holding the rows
    exact: bool  # every row up to the block's end computed as a full prefill would


class PrefixCache:
    """The cached blocks of one pool (`allocator`'s), at most `max_blocks` of them (0: caching off). `match` and
    `cached_rows` may run on any thread; the rest on the engine's, which alone changes reference counts."""

    def __init__(self, allocator: BlockAllocator, block_size: int, max_blocks: int):
        self.allocator, self.block_size, self.max_blocks = allocator, block_size, max_blocks
        self._entries: OrderedDict[str, Entry] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def cached_rows(self, ids: Sequence[int], salt: str) -> int:
        """How many leading rows of `ids` the cache holds now (whole blocks), exact or not."""
        with self._lock:
            keys = block_keys(ids, self.block_size, salt)
            return next((i for i, key in enumerate(keys) if key not in self._entries), len(keys)) * self.block_size

    def held_blocks(self, ids: Sequence[int], salt: str, exact: bool) -> int:
        """How many of the blocks `match` would return now a sequence holds too (the rest only the cache holds)."""
        with self._lock:
            held = 0
            for key in block_keys(ids, self.block_size, salt):
                entry = self._entries.get(key)
                if entry is None or (exact and not entry.exact):
                    break
                held += self.allocator.refcount(entry.block) > 1
            return held

    def match(self, ids: Sequence[int], salt: str, exact: bool) -> tuple[list[int], int]:
        """The blocks of the longest cached run of `ids`' leading whole blocks (exact ones alone, where `exact`), each
        with a reference taken for the caller (it frees them, or hands them to a block table), and how many of their
        rows are exact."""
        with self._lock:
            found: list = []
            for key in block_keys(ids, self.block_size, salt):
                entry = self._entries.get(key)
                if entry is None or (exact and not entry.exact):
                    break
                found.append((key, entry))
            for key, _ in reversed(found):  # the first block last: a prefix's tail goes before its head
                self._entries.move_to_end(key)
            found = [entry for _, entry in found]
            self.allocator.incref(e.block for e in found)
        n_exact = next((i for i, e in enumerate(found) if not e.exact), len(found))
        return [e.block for e in found], n_exact * self.block_size

    def insert(self, ids: Sequence[int], blocks: Sequence[int], salt: str, exact_rows: int) -> None:
        """Cache the whole blocks of a sequence whose rows 0.. are `ids`, held in `blocks` (its table's, in order), the
        first `exact_rows` rows exact. A key cached already keeps its block, unless that one is blended and this one
        exact."""
        if not self.max_blocks:
            return
        keys = block_keys(ids, self.block_size, salt)[:len(blocks)]
        with self._lock:
            for i in reversed(range(len(keys))):  # the tail first: the head ends the most recent, the last to go
                exact = (i + 1) * self.block_size <= exact_rows
                held = self._entries.get(keys[i])
                if held is not None and (held.exact or not exact):
                    self._entries.move_to_end(keys[i])
                    continue
                if self.allocator.is_cached(blocks[i]) and (held is None or held.block != blocks[i]):
                    continue  # cached under another key already: one entry a block
                if held is not None:
                    self._drop(held)
                self.allocator.incref([blocks[i]])
                self.allocator.mark_cached(blocks[i], True)
                self._entries[keys[i]] = Entry(blocks[i], exact)
                self._entries.move_to_end(keys[i])
            self._trim()

    def evictable(self) -> int:
        """Cached blocks no sequence holds: what the allocator may take back (a count the allocator keeps)."""
        return self.allocator.cached_alone

    def evict(self, n: int) -> int:
        """Give back up to `n` evictable blocks to the free list, least recently used first; how many it freed."""
        with self._lock:
            victims = []  # found in one pass that stops at the n-th (the index is not copied), then dropped
            for key, entry in self._entries.items():
                if len(victims) >= n:
                    break
                if self.allocator.refcount(entry.block) == 1:
                    victims.append(key)
            for key in victims:
                self._drop(self._entries.pop(key))
        return len(victims)

    def _trim(self) -> None:
        """Past max_blocks, drop the least recently used entries (their blocks free once no sequence holds them)."""
        while len(self._entries) > self.max_blocks:
            _, entry = self._entries.popitem(last=False)
            self._drop(entry)

    def _drop(self, entry: Entry) -> None:
        """Give back the cache's reference on an entry's block (taken out of the index by the caller)."""
        self.allocator.mark_cached(entry.block, False)
        self.allocator.decref([entry.block])
