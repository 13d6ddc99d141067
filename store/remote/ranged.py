"""Ranged, layer-ordered reads of cold chunks for the cache tier (cached_kv.py; issue 50).

The loader reads layer by layer. A chunk fetched whole (one GET) hands out its layer 0 only once every layer has
arrived; here a cold chunk's layers come by ranged GETs of a few layers each, in the order the loader wants them:

    first GET  the object's first bytes: header + record (the index) and layer 0, sized from the chunk's token
               count (the ids a read expects) and the value bytes per token of the records seen so far (SizeHint),
               FIRST_MIN at least (a small GET costs its round trip: a small chunk comes whole), or FIRST_RANGE
               when nothing predicts it. There is no separate index probe; a chunk whose index is kept (`missing`
               read it) starts with layer 0 (and the next layers within FIRST_MIN): no byte is read twice.
    then       the other layers, `group` per ranged GET, all queued at once; IN_FLIGHT of the ObjectStore's pool
               threads take the lowest layer first over every chunk being fetched: layer l of each chunk before
               layer l+1 of any, and no more requests at once than keep the first layers quick.

Every GET after the first asks If-Match the ETag the index came with, so a replaced object fails (ObjectChanged:
the read starts over on the new object) instead of mixing two objects' bytes. Each value is checked (length,
checksum, codec, shape) as it arrives; a damaged one fails the chunk (DamagedObject, recorded by the remote table)
and no layer of it is handed out after that. A read waits for its own layer only. When every layer has arrived and
passed, `on_complete` runs (the tier keeps the chunk: the same record and value bytes as a whole fetch) before the
last layers are handed out.

`missing` announces the chunks it found stored but not local; the first read of any of them starts the others'
fetches too (within one layer the loader reads one chunk after another: each would otherwise wait its own round
trip). Partly fetched chunks hold at most `budget` bytes: announced ones start only within it, and a chunk a read
opens pushes out the least recently used others that no read is waiting on.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvrag.errors import KvragError
from kvrag.store.codec import CorruptValue
from kvrag.store.record import TokenIds
from kvrag.store.remote.layout import FIRST_MIN, ChunkIndex, SizeHint
from kvrag.store.remote.object_store import ObjectChanged
from kvrag.store.remote.remote_kv import RemoteChunk, RemoteKVTable
from kvrag.store.table import MissingChunk, RawLayer, check_request

WAIT_S = 300.0  # a read waits this long at most (each request has its own, shorter, timeouts and retries)
IN_FLIGHT = 8  # ranged GETs at once: the early layers of every chunk are not slowed by the late ones
FIRST = -1  # the priority of a read's own first GET: before any queued layer


class Dropped(KvragError):
    """A partly fetched chunk pushed out of the budget (no read was waiting on it): a later read starts again."""


class RangedFetch:
    """One chunk's layers arriving by ranged GETs (module doc); reads wait on `raw_layer`."""

    def __init__(self, reader: RangedReader, chunk_id: str, seq: int, group: int, size: int):
        self.reader, self.chunk_id, self.seq, self.group = reader, chunk_id, seq, max(group, 1)
        self.remote = reader.remote
        self.key = self.remote.key(chunk_id)
        self.size = size  # the bytes it may hold: the first GET's, then the object's
        self.index: ChunkIndex | None = None
        self.values: list[bytes | None] = []  # handed out: checked, and the chunk kept when it was the last
        self.error: BaseException | None = None
        self.done = False
        self.waiters = 0  # reads waiting on it (under the reader's lock): never pushed out then
        self.started = time.perf_counter()
        self._have: list[bytes | None] = []  # arrived and checked, not all handed out yet
        self._starts: list[int] = []
        self._carry: tuple[int, bytes] | None = None  # (offset, bytes): a layer's head that the first GET cut
        self._completing = False
        self._cond = threading.Condition()

    # --- reads -----------------------------------------------------------------------------------

    def raw_layer(self, layer: int, expect_token_ids: TokenIds | None, codec: str) -> RawLayer:
        """The layer once it has arrived and passed its checks; the chunk's failure if it failed first."""
        with self._cond:
            self._wait(lambda: self.index is not None)
            index = self.index
            if not 0 <= layer < index.record.n_layers:
                raise CorruptValue(f"chunk {self.chunk_id} has {index.record.n_layers} layers, layer {layer} asked")
            self._wait(lambda: self.values[layer] is not None)
            value = self.values[layer]
        check_request(self.chunk_id, index.record, layer, expect_token_ids)  # after If-Match held for its bytes
        return RawLayer(value, codec, index.record.layer_shape(layer))

    def _wait(self, ready: Callable[[], bool]) -> None:
        if not self._cond.wait_for(lambda: self.error is not None or ready(), WAIT_S):
            raise KvragError(f"chunk {self.chunk_id}: no answer from {self.remote.objects.url} in {WAIT_S:.0f} s")
        if self.error is not None:
            raise self.error

    # --- requests (on the store's pool) ----------------------------------------------------------

    def start(self, index: ChunkIndex | None, first_len: int, priority: int) -> None:
        if index is None:
            self.reader.schedule((priority, self.seq), self, self._first, first_len)
        else:
            self._set_index(index)
            self._queue_layers()

    def _first(self, length: int) -> None:
        """The object's first bytes: its index (read and checked) and whatever layers they hold."""
        objects, remote = self.remote.objects, self.remote
        got = objects.fetch(self.key, length)
        if got is None:
            raise remote.missing_error(self.chunk_id)
        data, info = got
        end = remote.index_end(self.chunk_id, data)
        if len(data) < end <= info.size:  # a record past the guess: the rest of it, and the layers meant
            more = objects.get_range(self.key, len(data), end + length, if_match=info.etag)
            if more is None:
                raise remote.missing_error(self.chunk_id)
            data += more
        index = remote.index_from(self.chunk_id, data[:end], info.size, info.etag)
        self.reader.hint.observe(index.record)
        self._set_index(index)
        self._take(end, data[end:])
        self._queue_layers()

    def _set_index(self, index: ChunkIndex) -> None:
        with self._cond:
            self.index, self.size = index, index.size
            self._starts = index.layer_starts()
            self._have = [None] * index.record.n_layers
            self.values = [None] * index.record.n_layers
            self._cond.notify_all()

    def _queue_layers(self) -> None:
        """The layers not yet here, each GET queued by its first layer: layer 0 alone (the first a load needs,
        of every chunk: the sooner it is in) or with the next ones that fit in FIRST_MIN bytes, the others `group`
        per GET."""
        todo = [layer for layer, value in enumerate(self._have) if value is None]
        i = 0
        while i < len(todo):
            n = self.group
            if todo[i] == 0:
                n = 1
                while n < len(todo) and self._starts[todo[n] + 1] - self._starts[0] <= FIRST_MIN:
                    n += 1
            first, last = todo[i], todo[min(i + n, len(todo)) - 1]
            self.reader.schedule((first, self.seq), self, self._layers, first, last + 1)
            i += n

    def _layers(self, first: int, end: int) -> None:
        """Layers [first, end) in one ranged GET, If-Match the index's ETag (from the cut byte of a first GET's)."""
        start, carry = self._starts[first], self._carry
        if carry is not None and carry[0] == start:
            start += len(carry[1])
        data = self.remote.objects.get_range(self.key, start, self._starts[end], if_match=self.index.etag)
        if data is None:
            raise self.remote.missing_error(self.chunk_id)
        if len(data) != self._starts[end] - start:
            raise self.remote.mark_damaged(self.chunk_id, f"layers {first}-{end - 1}: {len(data)} bytes, "
                                                          f"record says {self._starts[end] - start}")
        self._take(start, data)

    def _take(self, offset: int, data: bytes) -> None:
        """The object's bytes from `offset`: each whole layer in them checked, then handed on."""
        carry = self._carry  # set by the first GET before any other is queued; taken by one GET only
        if carry is not None and carry[0] + len(carry[1]) == offset:
            offset, data = carry[0], carry[1] + data
            self._carry = None
        got, end = {}, offset + len(data)
        for layer in range(len(self._have)):
            start, stop = self._starts[layer], self._starts[layer + 1]
            if start < offset or start >= end or stop == start:
                continue
            if stop > end:  # only a first GET ends inside a layer: its head waits for the rest
                self._carry = (start, data[start - offset:])
                break
            got[layer] = data[start - offset:stop - offset]
            self.remote.check_layer(self.chunk_id, layer, got[layer], self.index.record)
        self._publish(got)

    def _publish(self, got: dict[int, bytes]) -> None:
        """Hand the layers out; the last ones only after the whole chunk is kept (its bytes as they came)."""
        with self._cond:
            if self.error is not None:
                return
            for layer, value in got.items():
                self._have[layer] = value
            complete = all(value is not None for value in self._have) and not self._completing
            if not complete:
                self._show(got)
                return
            self._completing = True  # one thread keeps the chunk
        record = self.index.record
        try:
            kept = self.reader.on_complete(self.chunk_id, RemoteChunk(record, self.index.record_bytes, self._have),
                                           time.perf_counter() - self.started)
        except BaseException:
            with self._cond:  # not kept: nothing for `settle` to wait for
                self._completing = False
                self._cond.notify_all()
            raise
        with self._cond:
            self.done = True
            self._show(dict(enumerate(self._have)))
        self.reader.completed(self, kept)

    def _show(self, got: dict[int, bytes]) -> None:
        for layer, value in got.items():
            self.values[layer] = value
        self._cond.notify_all()

    def settle(self) -> None:
        with self._cond:  # wait while another thread keeps the whole chunk locally
            while self._completing and not self.done:
                self._cond.wait()

    def fail(self, exc: BaseException) -> None:
        """No more of this chunk is handed out; reads waiting get `exc`."""
        with self._cond:
            if self.error is not None or self.done:
                return
            self.error = exc
            self._cond.notify_all()
        if isinstance(exc, ObjectChanged | MissingChunk):
            self.remote.forget(self.chunk_id)  # a kept index may be stale
        self.reader.discard(self)


class RangedReader:
    """The ranged fetches of one cache tier: open by chunk, bounded in bytes, their GETs queued by layer.
    `on_complete(chunk_id, chunk, seconds)` keeps a chunk whose layers have all arrived (True when kept locally);
    `is_local(chunk_id)` says whether the tier has it (then nothing is fetched)."""

    def __init__(self, remote: RemoteKVTable, on_complete: Callable[[str, RemoteChunk, float], bool],
                 is_local: Callable[[str], bool], budget: int, in_flight: int = IN_FLIGHT):
        self.remote, self.on_complete, self.is_local, self.budget = remote, on_complete, is_local, budget
        self.hint = SizeHint()
        self._fetches: OrderedDict[str, RangedFetch] = OrderedDict()  # least recently read first
        self._announced: list[str] = []
        self._queue: list[tuple] = []  # (priority, tick, fetch, fn, args): a heap
        self._workers = 0
        self.in_flight = in_flight  # requests at once: fewer than the pool's threads, so early layers go first
        self._seq, self._tick = itertools.count(), itertools.count()
        self._lock = threading.Lock()

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(f.size for f in self._fetches.values())

    def busy(self, chunk_id: str) -> bool:
        """Whether a fetch of the chunk is open (its reads go through it, not the local tier)."""
        return chunk_id in self._fetches

    def announce(self, chunk_ids: Sequence[str]) -> None:
        """Chunks stored remotely and not locally, about to be read: the first read of one starts them all."""
        with self._lock:
            self._announced = list(chunk_ids)

    def read(self, chunk_id: str, layer: int, expect_token_ids: TokenIds | None, group: int, codec: str) -> RawLayer | None:
        """The layer through the chunk's fetch (opened now if none is: None when the local tier has it meanwhile).
        A replaced object is read anew once."""
        for attempt in range(3):
            fetch = self._hold(chunk_id, expect_token_ids, group)
            if fetch is None:
                return None
            try:
                return fetch.raw_layer(layer, expect_token_ids, codec)
            except (ObjectChanged, Dropped):
                if attempt == 2:
                    raise
            finally:
                with self._lock:
                    fetch.waiters -= 1
        raise AssertionError("unreachable")

    def open(self, chunk_id: str, expect_token_ids: TokenIds | None, group: int) -> None:
        """Start the chunk's fetch (and the announced others') without waiting: reads of several chunks at once."""
        fetch = self._hold(chunk_id, expect_token_ids, group)
        if fetch is not None:
            with self._lock:
                fetch.waiters -= 1

    def _hold(self, chunk_id: str, expect_token_ids: TokenIds | None, group: int) -> RangedFetch | None:
        with self._lock:
            fetch = self._fetches.get(chunk_id)
            if fetch is not None and fetch.error is None:  # a failed one is being discarded: start anew
                self._fetches.move_to_end(chunk_id)
                fetch.waiters += 1
                return fetch
        if self.is_local(chunk_id):
            return None
        index = self.remote.kept_index(chunk_id)  # DamagedObject for one found damaged
        n_tokens = None if expect_token_ids is None else len(expect_token_ids)
        first_len = self.hint.first_range(n_tokens, 1)
        with self._lock:
            fetch = self._fetches.get(chunk_id)
            if fetch is not None and fetch.error is None:  # another read opened it meanwhile
                fetch.waiters += 1
                return fetch
            fetch, dropped = self._add(chunk_id, group, index, first_len)
            fetch.waiters += 1
            others = self._announced if chunk_id in self._announced else []
            if others:
                self._announced = []
        _drop(dropped)
        fetch.start(index, first_len, FIRST)
        for other in others:
            if other != chunk_id:
                self._open_other(other, group)
        return fetch

    def _open_other(self, chunk_id: str, group: int) -> None:
        """An announced chunk, fetched ahead of its reads while the budget allows."""
        if chunk_id in self._fetches or chunk_id in self.remote.damaged or self.is_local(chunk_id):
            return
        index = self.remote.kept_index(chunk_id)
        first_len = self.hint.first_range(None, group)
        with self._lock:
            size = index.size if index is not None else first_len
            if chunk_id in self._fetches or sum(f.size for f in self._fetches.values()) + size > self.budget:
                return
            fetch, _ = self._add(chunk_id, group, index, first_len)  # within the budget: nothing dropped
        fetch.start(index, first_len, 0)

    def _add(self, chunk_id: str, group: int, index: ChunkIndex | None,
             first_len: int) -> tuple[RangedFetch, list[RangedFetch]]:
        """A new fetch, and the ones that go to make room for it (under the lock; the caller fails them after):
        the least recently read that no read waits on."""
        size = index.size if index is not None else first_len
        held, dropped = sum(f.size for f in self._fetches.values()), []
        for other in [f for f in self._fetches.values() if f.waiters == 0]:
            if held + size <= self.budget:
                break
            del self._fetches[other.chunk_id]
            held -= other.size
            dropped.append(other)
        fetch = RangedFetch(self, chunk_id, next(self._seq), group, size)
        self._fetches[chunk_id] = fetch
        return fetch, dropped

    def completed(self, fetch: RangedFetch, kept: bool) -> None:
        """A chunk kept locally is read there from now on; one too large to keep stays here while room allows."""
        if kept:
            self.discard(fetch)

    def discard(self, fetch: RangedFetch) -> None:
        with self._lock:
            if self._fetches.get(fetch.chunk_id) is fetch:
                del self._fetches[fetch.chunk_id]

    def drop(self, chunk_id: str) -> None:
        """Stop the chunk's fetch, if one is open: it hands out and keeps nothing more."""
        with self._lock:
            fetch = self._fetches.pop(chunk_id, None)
        _drop([fetch] if fetch is not None else [])

    def clear(self) -> None:
        with self._lock:
            fetches, self._fetches, self._announced = list(self._fetches.values()), OrderedDict(), []
        _drop(fetches)

    def close(self) -> None:
        """Stop every fetch, and wait for a chunk being kept locally to be written: its store may close next."""
        with self._lock:
            fetches = list(self._fetches.values())
        self.clear()
        for fetch in fetches:
            fetch.settle()

    # --- the queue -------------------------------------------------------------------------------

    def schedule(self, priority: tuple[int, int], fetch: RangedFetch, fn: Callable, *args) -> None:
        """Queue a request; at most `in_flight` pool threads take the lowest queued first, until none is left."""
        with self._lock:
            heapq.heappush(self._queue, (priority, next(self._tick), fetch, fn, args))
            if self._workers >= self.in_flight:
                return
            self._workers += 1
        try:
            self.remote.objects.submit(self._work)
        except RuntimeError as exc:  # the store was closed
            with self._lock:
                self._workers -= 1
            fetch.fail(KvragError(f"chunk {fetch.chunk_id}: {exc}"))

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._workers -= 1
                    return
                _, _, fetch, fn, args = heapq.heappop(self._queue)
            if fetch.error is not None:
                continue  # the chunk failed or was dropped: nothing more to read
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001  (any failure is the chunk's, handed to its reads)
                fetch.fail(exc)


def _drop(fetches: list[RangedFetch]) -> None:
    for fetch in fetches:
        fetch.fail(Dropped(f"chunk {fetch.chunk_id}: pushed out of the fetches in progress"))
