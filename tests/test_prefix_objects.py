"""The prefix table of a store on object storage (store/remote/prefix_objects.py), against a real S3-compatible server
(SeaweedFS on 127.0.0.1, tests/test_remote_store.py's fixture): two mirrors of one bucket, as replicas on two
machines have, find each other's blocks through it; a damaged object is never served; the bucket's share keeps its
bound, oldest first. The engine's path through it (a replica's chat read by another) is tests/test_ray_serve.py's."""

from __future__ import annotations

import time

import pytest

from kvrag.store.env import StoreEnv
from kvrag.store.prefix_table import PrefixTable, table_stats
from kvrag.store.remote.object_store import ObjectStore
from kvrag.store.remote.prefix_objects import FOLDER, SharedPrefixTable
from kvrag.tests.test_remote_store import CountingObjectStore, s3  # noqa: F401  (the SeaweedFS, one per module)

SCOPE = "f" * 24 + ".s"


@pytest.fixture
def bucket(s3, request):  # noqa: F811
    store = ObjectStore.from_url(s3.url(f"p/{request.node.name}"), s3.env)
    yield store
    store.close()


def _mirror(path, bucket, bound: int = 0, scope: str = SCOPE):
    env = StoreEnv.open(path, create=True)
    return env, SharedPrefixTable(PrefixTable(env, scope, bound), bucket)


def test_two_mirrors_share_blocks_through_the_bucket(tmp_path, bucket):
    counted = CountingObjectStore(bucket)
    env_a, a = _mirror(tmp_path / "a", bucket)
    env_b, b = _mirror(tmp_path / "b", counted)
    rows = {f"k{i}": bytes([i]) * 100 for i in range(4)}
    assert a.put(rows.items()) == 4
    assert sorted(info.key.rsplit("/", 1)[1] for info in bucket.list(FOLDER)) == sorted(rows)
    assert b.leading(["k0", "k1", "k2", "nope", "k3"]) == [rows["k0"], rows["k1"], rows["k2"]]  # up to the gap
    assert table_stats(env_b) == {"blocks": 3, "bytes": 300, "bad": 0}  # kept in b's mirror
    counted.requests.clear()
    assert b.leading(["k0", "k1", "k2"]) == [rows["k0"], rows["k1"], rows["k2"]]
    assert counted.requests["get"] == 0  # from the mirror: no request
    assert b.leading(["x0", "x1", "x2"]) == [] and counted.requests["get"] == 1  # a head in neither: one request
    assert b.has("k3") and not b.has("nope")
    _, other = _mirror(tmp_path / "c", bucket, scope="0" * 24 + ".other")  # another model or weights form
    assert other.leading(["k0"]) == []
    # an object damaged in the bucket (a bad byte) is never served, and what follows it is not taken
    name = f"{FOLDER}{SCOPE}/k3"
    bucket.put(name, bucket.get(name)[:-1] + b"\xff")
    env_d, d = _mirror(tmp_path / "d", bucket)
    assert d.leading(["k2", "k3"]) == [rows["k2"]]
    for env in (env_a, env_b, env_d):
        env.close()


def test_the_buckets_share_keeps_its_bound_oldest_first(tmp_path, bucket):
    """A bound of 1,000 bytes; 112-byte objects (100 bytes of rows). Eight, then (a second later: a listing's times
    are whole seconds) six more: past the bound the oldest go, down to 90 % of it (eight objects)."""
    env, table = _mirror(tmp_path / "a", bucket, bound=1000)
    table.put((f"old{i}", bytes([i]) * 100) for i in range(8))
    assert sum(info.size for info in bucket.list(FOLDER)) == 8 * 112  # under the bound: nothing deleted
    time.sleep(1.1)
    for i in range(6):
        table.put([(f"new{i}", bytes([i]) * 100)])
    left = sorted(info.key.rsplit("/", 1)[1] for info in bucket.list(FOLDER))
    assert sum(info.size for info in bucket.list(FOLDER)) <= 1000
    assert {f"new{i}" for i in range(6)} <= set(left) and len(left) == 8, left
    env.close()
