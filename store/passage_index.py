"""Stored passages found inside any prompt: an index over stored chunks' token windows, probed over a prompt's ids.

Applications that retrieve for themselves send passages as prompt text, in templates of their own. A chunk is
content-addressed by its token ids, so wherever its text stands in a prompt, the same ids are there, less a few
where the passage meets its surroundings (the title kvrag put before it, a leading space the template merged), or
where the client cut it. So the index keeps the hash of every chunk's WINDOW-token windows at every STRIDE-th
start; a prompt hashes every window it has, and each hit is extended over its chunk, both ways, as far as the ids
agree. Any common run of WINDOW + STRIDE - 1 tokens is found; runs shorter than MIN_SPAN are not worth a blend.

Passages kept from clients' prompts (engine/kept_passages.py) carry that client's salt: a prompt sees the
corpus's chunks (salt "") and its own salt's, never another's.

Plain Python and numpy: no torch, no LMDB (the caller feeds it records).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

WINDOW = 16  # tokens a hash covers
STRIDE = 8  # a chunk's windows are indexed at every STRIDE-th start
MIN_SPAN = 32  # a shorter common run is computed, not reused
# fixed odd multipliers: a window's hash is sum(id_j * M_j) mod 2^64 (numpy's uint64 wraps)
_MULT = np.random.default_rng(0x6B7672).integers(1, 2**63, WINDOW, dtype=np.uint64) | np.uint64(1)
_MULT.setflags(write=False)


@dataclass(frozen=True)
class Span:
    """prompt[start:start+length] == the stored chunk's ids[offset:offset+length]."""

    start: int
    chunk_id: str
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


def window_hashes(ids: np.ndarray) -> np.ndarray:
    """[max(0, n - WINDOW + 1)] uint64: the hash of every window of ids [n]."""
    if ids.shape[0] < WINDOW:
        return np.zeros(0, dtype=np.uint64)
    windows = np.lib.stride_tricks.sliding_window_view(ids.astype(np.uint64), WINDOW)  # [n-W+1, W]
    return (windows * _MULT).sum(axis=1, dtype=np.uint64)


class PassageIndex:
    """Chunks' window hashes, sorted for a binary search; any thread may add or find."""

    def __init__(self):
        self._ids: list[np.ndarray] = []  # per entry: its token ids
        self._names: list[str] = []  # per entry: chunk id
        self._salts: list[str | None] = []  # per entry: "" for the corpus, else the client salt it was kept for (None:
        # removed)
        self._known: dict[tuple[str, str], int] = {}  # (chunk id, salt): its entry
        self._by_id: dict[str, np.ndarray] = {}  # chunk id: its token ids
        self._pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (hashes, entries, offsets) not sorted in
        self._hashes = np.zeros(0, dtype=np.uint64)  # sorted
        self._entry = np.zeros(0, dtype=np.int64)  # per hash: its entry
        self._offset = np.zeros(0, dtype=np.int64)  # per hash: its window's start in the chunk
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._names)

    def add(self, chunk_id: str, token_ids: Sequence[int], salt: str = "") -> None:
        """Index a stored chunk (once per chunk id and salt)."""
        self._add_batch([(chunk_id, np.asarray(token_ids, dtype=np.int64), salt)])

    def knows(self, chunk_id: str, salt: str = "") -> bool:
        with self._lock:
            return (chunk_id, salt) in self._known

    def remove(self, chunk_id: str, salt: str = "") -> None:
        """Stop finding a chunk (a kept passage evicted): its windows stay in the table, matching nothing. Its ids
        stay readable, for a plan made just before."""
        with self._lock:
            entry = self._known.pop((chunk_id, salt), None)
            if entry is not None:
                self._salts[entry] = None  # no request's salt: find() passes the entry over

    def token_ids(self, chunk_id: str) -> tuple[int, ...]:
        """An indexed chunk's whole ids."""
        with self._lock:
            return tuple(self._by_id[chunk_id].tolist())

    def add_many(self, records: Iterable[tuple[str, Sequence[int], str]], batch: int = 4096) -> None:
        """Index many stored chunks, (chunk id, token ids, salt) each, hashing a batch of them at once (a store's
        chunks at the first plain prompt: per-chunk numpy calls would cost a minute per 100k chunks)."""
        pending: list[tuple[str, np.ndarray, str]] = []
        for chunk_id, ids, salt in records:
            pending.append((chunk_id, np.asarray(ids, dtype=np.int64), salt))
            if len(pending) == batch:
                self._add_batch(pending)
                pending = []
        if pending:
            self._add_batch(pending)

    def _add_batch(self, records: list[tuple[str, np.ndarray, str]]) -> None:
        with self._lock:
            records = [r for r in records if (r[0], r[2]) not in self._known and r[1].shape[0] >= MIN_SPAN]
            if not records:
                return
            lengths = np.array([ids.shape[0] for _, ids, _ in records])
            first = np.concatenate([[0], np.cumsum(lengths)[:-1]])  # [B] where each chunk starts in `flat`
            flat = np.concatenate([ids for _, ids, _ in records]).astype(np.uint64)
            offsets = [np.arange(0, n - WINDOW + 1, STRIDE, dtype=np.int64) for n in lengths.tolist()]
            counts = np.array([o.shape[0] for o in offsets])
            offset = np.concatenate(offsets)  # [H] each window's start in its chunk
            entry = np.repeat(np.arange(len(self._names), len(self._names) + len(records)), counts)  # [H]
            start = offset + np.repeat(first, counts)  # [H] in `flat`
            hashes = np.zeros(start.shape[0], dtype=np.uint64)
            for j in range(WINDOW):  # sum(id_j * M_j), as window_hashes computes it
                hashes += flat[start + j] * _MULT[j]
            for chunk_id, ids, salt in records:
                self._known[(chunk_id, salt)] = len(self._names)
                self._by_id[chunk_id] = ids
                self._ids.append(ids)
                self._names.append(chunk_id)
                self._salts.append(salt)
            self._pending.append((hashes, entry, offset))

    def find(self, prompt_ids: Sequence[int], salt: str = "") -> list[Span]:
        """The stored spans of the prompt, left to right, not overlapping, each the longest at its place."""
        ids = np.asarray(prompt_ids, dtype=np.int64)
        hashes = window_hashes(ids)
        with self._lock:
            self._merge()
            table, entry, offset = self._hashes, self._entry, self._offset
            chunks, names, salts = list(self._ids), list(self._names), list(self._salts)
        if not hashes.shape[0] or not table.shape[0]:
            return []
        at = np.minimum(np.searchsorted(table, hashes), table.shape[0] - 1)  # [n-W+1]
        spans: list[Span] = []
        done = 0  # prompt positions before this are spoken for
        for p in np.flatnonzero(table[at] == hashes).tolist():
            if p < done:
                continue
            best = None
            for j in range(int(at[p]), table.shape[0]):  # every entry with this hash
                if table[j] != hashes[p]:
                    break
                e = int(entry[j])
                if salts[e] not in ("", salt):
                    continue
                span = _extend(ids, p, chunks[e], int(offset[j]), done, names[e])
                if span is not None and (best is None or span.length > best.length):
                    best = span
            if best is not None and best.length >= MIN_SPAN:
                spans.append(best)
                done = best.end
        return spans

    def _merge(self) -> None:
        """Sort the added windows in (under the lock)."""
        if not self._pending:
            return
        parts = list(zip(*self._pending, strict=True))
        hashes = np.concatenate([self._hashes, *parts[0]])
        entry = np.concatenate([self._entry, *parts[1]])
        offset = np.concatenate([self._offset, *parts[2]])
        order = np.argsort(hashes, kind="stable")
        self._hashes, self._entry, self._offset = hashes[order], entry[order], offset[order]
        self._pending.clear()


def _extend(prompt: np.ndarray, p: int, chunk: np.ndarray, o: int, floor: int, chunk_id: str) -> Span | None:
    """The run through prompt[p:] == chunk[o:] (a window's hash matched), grown back no further than `floor` and
    forward as far as both agree; None on a hash collision."""
    if not np.array_equal(prompt[p:p + WINDOW], chunk[o:o + WINDOW]):
        return None
    back = 0
    while p - back > floor and o - back > 0 and prompt[p - back - 1] == chunk[o - back - 1]:
        back += 1
    n = min(prompt.shape[0] - p, chunk.shape[0] - o)
    differ = np.flatnonzero(prompt[p:p + n] != chunk[o:o + n])
    forward = int(differ[0]) if differ.shape[0] else n
    return Span(p - back, chunk_id, o - back, back + forward)
