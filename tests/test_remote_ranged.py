"""The cache tier's ranged reads (store/remote/ranged.py, issue 50), against the real SeaweedFS of
test_remote_store.py: a cold chunk's layers come by ranged GETs of a few layers each, its first layer served as soon
as it has arrived, every value checked, and the local tier left holding the same bytes a whole fetch keeps.

Ordering, never timing: a gate holds the ranged GETs after a chunk's first one, so "layer 0 was served while the
later layers were still outstanding" is a fact of the order in which things happened."""

from __future__ import annotations

import threading
import time

import numpy as np
import obstore
import pytest

from kvrag.store.codec import CorruptValue
from kvrag.store.env import StoreEnv
from kvrag.store.kv import LocalKVTable
from kvrag.store.remote.cached_kv import CachedKVTable, stored_bytes
from kvrag.store.remote.layout import HEAD_SIZE
from kvrag.store.remote.object_store import ObjectStore
from kvrag.store.remote.remote_kv import DamagedObject, RemoteKVTable
from kvrag.tests import test_remote_store as remote_tests
from kvrag.tests.test_remote_store import CountingObjectStore, _flip, assert_same_layer
from kvrag.tests.test_store_kv import layers_for, tokens_for

# that module's fixtures: its SeaweedFS (started once for this module too), a prefix per test, a local store
s3, objects, local_env = remote_tests.s3, remote_tests.objects, remote_tests.local_env

MODEL = "model-a"
N_LAYERS = 8
N_TOKENS, HEADS, DIM = 256, 4, 64  # ~200 KB a layer in fp16: a chunk larger than any first GET (FIRST_MIN)
VARIANT = "window:keep=0.5:sinks=4"


def kv_layers(seed: int, n_tokens: int):
    return layers_for(seed, n_tokens, N_LAYERS, HEADS, DIM)


class GatedObjectStore:
    """The real ObjectStore, whose ranged GETs (`get_range`: every GET after a chunk's first) wait while the gate is
    shut; `started` lists them as they were asked for. The first GET of a chunk (`fetch`) always passes."""

    def __init__(self, inner: ObjectStore):
        self.inner = inner
        self.gate = threading.Event()
        self.gate.set()
        self.started: list[tuple[str, int, int]] = []
        self._cond = threading.Condition()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def get_range(self, key: str, start: int, end: int, if_match: str | None = None):
        with self._cond:
            self.started.append((key, start, end))
            self._cond.notify_all()
        if not self.gate.wait(30):
            raise TimeoutError("the gate stayed shut")
        return self.inner.get_range(key, start, end, if_match)

    def wait_started(self, n: int) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.started) >= n, 30), self.started


def gets(objects: ObjectStore) -> tuple[int, int]:
    """(GET requests answered, bytes received) so far."""
    snap = objects.counts.snapshot()
    return snap["requests"].get("GET", 0), snap["bytes_in"]


def object_size(table: LocalKVTable, chunk_id: str) -> int:
    return HEAD_SIZE + stored_bytes(table.record(chunk_id))


def put_chunks(objects: ObjectStore, reference: LocalKVTable, n: int, codec: str = "fp16", variant: str = "",
               n_tokens: int = N_TOKENS, first_seed: int = 0) -> list[list[int]]:
    """Chunks c0..c{n-1} in the object store and in `reference`; their token ids."""
    remote = RemoteKVTable(objects, MODEL, codec, variant=variant)
    ids = []
    for i in range(n):
        seed = first_seed + i
        ids.append(tokens_for(seed, n_tokens))
        layers, positions = kv_layers(seed, n_tokens), None
        if variant:  # a reduced chunk: half its tokens, its positions per layer
            rng = np.random.default_rng(seed)
            positions = [np.sort(rng.choice(n_tokens, size=n_tokens // 2, replace=False)) for _ in range(N_LAYERS)]
            layers = [(k[:n_tokens // 2], v[:n_tokens // 2]) for k, v in layers]
        assert reference.put_chunk(f"c{i}", ids[-1], layers, positions)
        assert remote.put_chunk(f"c{i}", ids[-1], layers, positions)
    return ids


@pytest.fixture
def cache_over(tmp_path):
    """cache_over(objects, name, codec, variant, warm, **options): a cache tier over `objects` in a local store of
    its own; `warm`: a chunk of the same shape already local, from which the tier predicts how far a first GET
    must reach. The tiers, then the stores, close when the test ends."""
    envs, caches = [], []

    def make(objects, name: str, codec: str = "fp16", variant: str = "", warm: bool = False,
             **options) -> tuple[CachedKVTable, LocalKVTable]:
        envs.append(StoreEnv.open(tmp_path / name, create=True))
        local = LocalKVTable(envs[-1], MODEL, codec, variant=variant)
        if warm:
            local.put_chunk("warm", tokens_for(99, N_TOKENS), kv_layers(99, N_TOKENS))
        remote = RemoteKVTable(objects, MODEL, codec, variant=variant)
        caches.append(CachedKVTable(remote, local, 1 << 30, **options))
        return caches[-1], local

    yield make
    for cache in caches:  # a chunk a read left completing in the background is written before its store closes
        cache.close()
    for env in envs:
        env.close()


def wait_until(done, what: str) -> None:
    """Until `done()` (an order of events: the requests it waits for are answered), 30 s at most."""
    deadline = time.monotonic() + 30
    while not done():
        assert time.monotonic() < deadline, f"still not {what}"
        time.sleep(0.01)


def raw_bytes(table: LocalKVTable, chunk_id: str) -> tuple[bytes, list[bytes]]:
    """The record's and every value's bytes, as LMDB holds them."""
    key = table.key(chunk_id)
    record = table.env.read(lambda txn: bytes(txn.get(key.to_bytes(), db=table.db)))
    n = LocalKVTable.record(table, chunk_id).n_layers
    return record, [table.env.read(lambda txn, i=i: bytes(txn.get(key.layer(i).to_bytes(), db=table.db)))
                    for i in range(n)]


# --- the first layer first ---------------------------------------------------------------------


def test_layer_zero_is_served_while_the_later_layers_are_outstanding(objects, local_env, cache_over):
    reference = LocalKVTable(local_env, MODEL)
    (ids,) = put_chunks(objects, reference, 1)
    gated = GatedObjectStore(objects)
    cache, local = cache_over(gated, "cache", warm=True, layers_per_request=2)
    size, before = object_size(reference, "c0"), gets(objects)
    gated.gate.clear()
    try:
        assert_same_layer(cache.get_layer_raw("c0", 0, ids), reference.get_layer_raw("c0", 0))
        requests, received = (a - b for a, b in zip(gets(objects), before, strict=True))
        assert requests == 1  # no index probe: one GET held the index and layer 0 (and more)
        assert 0 < received < size / 4
        gated.wait_started(1)  # the later layers' GETs were asked for, and wait at the gate
        assert cache.ranged.busy("c0") and not local.has("c0")  # not kept before every layer is in
    finally:
        gated.gate.set()
    for layer in range(N_LAYERS):
        assert_same_layer(cache.get_layer_raw("c0", layer, ids), reference.get_layer_raw("c0", layer))
    requests, received = (a - b for a, b in zip(gets(objects), before, strict=True))
    assert received == size  # no byte read twice: the GET after the first starts where it stopped
    assert requests == 1 + len(gated.started) >= 3  # the first GET, then the later layers two a GET
    assert local.has("c0") and not cache.ranged.busy("c0")
    assert cache.counters.fills == 1 and cache.counters.fetched_bytes == stored_bytes(reference.record("c0"))


def test_a_cold_tier_fetches_a_small_chunk_in_one_get(objects, local_env, cache_over):
    """Nothing local predicts the size: the generous first range holds the whole (small) object."""
    reference = LocalKVTable(local_env, MODEL)
    ids = put_chunks(objects, reference, 1, n_tokens=20)
    counting = CountingObjectStore(objects)
    cache, local = cache_over(counting, "cache")
    for layer in range(N_LAYERS):
        assert_same_layer(cache.get_layer_raw("c0", layer, ids[0]), reference.get_layer_raw("c0", layer))
    assert counting.requests == {"fetch": 1} and local.has("c0")


def test_a_record_past_the_first_get_is_read_on(objects, local_env, cache_over, monkeypatch):
    """A first GET that ends inside the record (here 20 bytes): the next GET takes the rest of the index with the
    first layer, If-Match the first one's ETag."""
    from kvrag.store.remote import layout

    monkeypatch.setattr(layout, "FIRST_RANGE", 20)
    reference = LocalKVTable(local_env, MODEL)
    (ids,) = put_chunks(objects, reference, 1)
    cache, local = cache_over(objects, "cache", layers_per_request=3)
    before = gets(objects)
    for layer in range(N_LAYERS):
        assert_same_layer(cache.get_layer_raw("c0", layer, ids), reference.get_layer_raw("c0", layer))
    assert gets(objects)[1] - before[1] == object_size(reference, "c0")
    assert raw_bytes(local, "c0") == raw_bytes(reference, "c0")


# --- the same bytes as a whole fetch, for every codec ----------------------------------------------


@pytest.mark.parametrize(("codec", "variant"), [("fp16", ""), ("bf16", ""), ("int8", ""), ("int8", VARIANT)])
@pytest.mark.parametrize("per_request", [1, 3])
def test_ranged_reads_equal_a_whole_fetch(objects, local_env, cache_over, codec, variant, per_request):
    reference = LocalKVTable(local_env, MODEL, codec, variant=variant)
    ids = put_chunks(objects, reference, 3, codec, variant)
    ranged, ranged_local = cache_over(objects, "ranged", codec, variant, warm=not variant,
                                      layers_per_request=per_request)
    whole, whole_local = cache_over(objects, "whole", codec, variant, layers_per_request=0)
    chunk_ids = ["c0", "c1", "c2"]
    for layer in range(N_LAYERS):  # as the loader reads: layer by layer, chunk after chunk
        for i, chunk_id in enumerate(chunk_ids):
            got = ranged.get_layer_raw(chunk_id, layer, ids[i])
            assert_same_layer(got, reference.get_layer_raw(chunk_id, layer))
            assert got.value == whole.get_layer_raw(chunk_id, layer, ids[i]).value
        with ranged.layer_views(list(zip(chunk_ids, ids, strict=True)), layer) as got:
            assert [raw.value for raw in got] == [reference.get_layer_raw(c, layer).value for c in chunk_ids]
    for chunk_id in chunk_ids:  # the local tier: byte for byte what a whole fetch keeps
        assert raw_bytes(ranged_local, chunk_id) == raw_bytes(whole_local, chunk_id) == raw_bytes(reference, chunk_id)
    assert ranged.counters.fills == whole.counters.fills == 3


def test_missing_announces_and_the_first_read_starts_them_all(objects, local_env, cache_over):
    """The loader reads one chunk after another: the first read of one that `missing` found remote only starts
    the others' fetches, each from its first layer (its index, read by `missing`, is not read again)."""
    reference = LocalKVTable(local_env, MODEL)
    ids = put_chunks(objects, reference, 3)
    counting = CountingObjectStore(objects)
    cache, local = cache_over(counting, "cache", layers_per_request=4)
    assert cache.missing(["c0", "c1", "absent", "c2"]) == ["absent"]
    assert counting.requests == {"fetch": 4}  # the index probes `missing` always made
    before = gets(objects)
    assert_same_layer(cache.get_layer_raw("c1", 0, ids[1]), reference.get_layer_raw("c1", 0))
    assert all(cache.ranged.busy(c) or local.has(c) for c in ("c0", "c2"))  # started with c1, not waited on
    for layer in range(N_LAYERS):
        for i in range(3):
            assert_same_layer(cache.get_layer_raw(f"c{i}", layer, ids[i]), reference.get_layer_raw(f"c{i}", layer))
    assert counting.requests["fetch"] == 4 and counting.requests["get_range"] == 3 * 3  # layers 0, 1-4, 5-7
    values = sum(reference.record(f"c{i}").total_bytes for i in range(3))
    assert gets(objects)[1] - before[1] == values  # only the values: no index byte read again


def test_partly_fetched_chunks_stay_within_their_budget(objects, local_env, cache_over):
    reference = LocalKVTable(local_env, MODEL)
    ids = put_chunks(objects, reference, 3)
    budget = max(object_size(reference, f"c{i}") for i in range(3)) + 1  # one chunk at a time
    gated = GatedObjectStore(objects)
    cache, _ = cache_over(gated, "cache", layers_per_request=2, partial_bytes=budget)
    cache.missing(["c0", "c1", "c2"])
    gated.gate.clear()
    try:
        cache.ranged.open("c0", ids[0], 2)  # a read's own chunk, not waited on: the announced others with it
        assert cache.ranged.busy("c0") and not cache.ranged.busy("c1") and not cache.ranged.busy("c2")
        assert cache.ranged.held_bytes <= budget  # the announced others did not fit: not started
        cache.ranged.open("c1", ids[1], 2)  # a read's own chunk: c0 (no read waiting on it) makes room
        assert cache.ranged.busy("c1") and not cache.ranged.busy("c0") and cache.ranged.held_bytes <= budget
    finally:
        gated.gate.set()
    for i in range(3):  # c0 starts again when read
        assert_same_layer(cache.get_layer_raw(f"c{i}", 5, ids[i]), reference.get_layer_raw(f"c{i}", 5))


# --- damage and replacement ------------------------------------------------------------------------


def test_a_corrupted_value_is_detected_and_never_served(objects, local_env, cache_over):
    reference = LocalKVTable(local_env, MODEL)
    (ids,) = put_chunks(objects, reference, 1)
    writer = RemoteKVTable(objects, MODEL)
    start, end = writer._index("c0").layer_range(5)
    _flip(objects, writer.key("c0"), (start + end) // 2)
    cache, local = cache_over(objects, "cache", warm=True, layers_per_request=2)
    served = []
    for layer in range(N_LAYERS):
        try:
            got = cache.get_layer_raw("c0", layer, ids)
        except DamagedObject as exc:  # the damage, found at layer 5 or read from the remote table's record of it
            assert "layer 5: checksum mismatch" in str(exc)
            continue
        assert_same_layer(got, reference.get_layer_raw("c0", layer))  # whatever is served is whole
        served.append(layer)
    assert 0 in served and 5 not in served and "checksum" in cache.remote.damaged["c0"]
    assert not local.has("c0") and cache.missing(["c0"]) == ["c0"]  # counts as missing until it is put again
    layers = kv_layers(0, N_TOKENS)
    assert cache.put_chunk("c0", ids, layers) is True  # the repair replaces the object, and is kept locally
    assert_same_layer(cache.get_layer_raw("c0", 5, ids), reference.get_layer_raw("c0", 5))


def test_an_object_replaced_mid_read_is_read_anew_never_mixed(s3, objects, local_env, cache_over, tmp_path):
    """The object is replaced (the same chunk, stored uncompressed: other offsets, another ETag) after layer 0 was
    served: the held GETs fail their If-Match, the chunk is read again from the new object, and the local tier keeps
    the new object's bytes only."""
    reference = LocalKVTable(local_env, MODEL)
    (ids,) = put_chunks(objects, reference, 1)
    with StoreEnv.open(tmp_path / "raw", create=True) as raw_env:
        uncompressed = LocalKVTable(raw_env, MODEL, compress=False)
        layers = kv_layers(0, N_TOKENS)
        uncompressed.put_chunk("c0", ids, layers)
        gated = GatedObjectStore(objects)
        cache, local = cache_over(gated, "cache", warm=True, layers_per_request=2)
        gated.gate.clear()
        try:
            assert cache.get_layer_raw("c0", 0, ids).value == reference.get_layer_raw("c0", 0).value
            gated.wait_started(1)
            other = ObjectStore.from_url(objects.url, s3.env)  # another machine's client
            replacer = RemoteKVTable(other, MODEL, compress=False)
            obstore.delete(objects.client, replacer.key("c0"))
            assert replacer.put_chunk("c0", ids, layers)
            other.close()
        finally:
            gated.gate.set()
        wait_until(lambda: not cache.ranged.busy("c0"), "failed")  # the held GETs answered: If-Match failed
        fetches = objects.counts.snapshot()["requests"].get("GET", 0)
        for layer in range(N_LAYERS):
            got = cache.get_layer_raw("c0", layer, ids).value
            assert got == uncompressed.get_layer_raw("c0", layer).value  # the new object's, never the old one's
        assert objects.counts.snapshot()["requests"]["GET"] > fetches  # read again
        assert raw_bytes(local, "c0") == raw_bytes(uncompressed, "c0")
        assert not cache.remote.damaged


def test_other_token_ids_and_absent_layers_are_refused(objects, local_env, cache_over):
    reference = LocalKVTable(local_env, MODEL)
    put_chunks(objects, reference, 1)
    cache, _ = cache_over(objects, "cache", layers_per_request=2)
    with pytest.raises(CorruptValue, match="token ids differ"):
        cache.get_layer_raw("c0", 0, tokens_for(7, N_TOKENS))
    with pytest.raises(CorruptValue, match="layer 9"):
        cache.get_layer_raw("c0", 9)
