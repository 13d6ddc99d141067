"""LocalKVTable: whole-chunk transactions, idempotent writes, checked reads, map growth, a full store, claims."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

import kvrag.store.env as envmod
from kvrag.errors import KvragError
from kvrag.store.codec import CorruptValue
from kvrag.store.env import StoreEnv
from kvrag.store.keys import TAG_RECORD, preamble_chunk_id
from kvrag.store.kv import LocalKVTable
from kvrag.store.maintenance import verify
from kvrag.store.table import MissingChunk, Shard

H, D = 3, 16


def layers_for(seed: int, n_tokens: int, n_layers: int = 4, heads: int = H, dim: int = D):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((n_tokens, heads, dim), dtype=np.float32),
             rng.standard_normal((n_tokens, heads, dim), dtype=np.float32)) for _ in range(n_layers)]


def tokens_for(seed: int, n_tokens: int) -> list[int]:
    return np.random.default_rng(seed + 10_000).integers(0, 49152, n_tokens).tolist()


@pytest.fixture
def env(tmp_path):
    with StoreEnv.open(tmp_path / "store", create=True) as env:
        yield env


def chunk_keys(env: StoreEnv, table: LocalKVTable, chunk_id: str) -> list[bytes]:
    prefix = table.key(chunk_id).prefix
    with env.reader() as txn:
        return [bytes(k) for k in txn.cursor(db=env.db("kv")).iternext(values=False) if bytes(k).startswith(prefix)]


def test_put_then_get_every_layer(env):
    table = LocalKVTable(env, "model-a", "fp16")
    layers, ids = layers_for(1, 13), tokens_for(1, 13)
    assert table.put_chunk("c1", ids, layers) is True
    assert table.has("c1") and not table.has("c2")
    for i, (k, v) in enumerate(layers):
        got_k, got_v = table.get_layer("c1", i, expect_token_ids=ids)
        np.testing.assert_array_equal(got_k, k.astype(np.float16))
        np.testing.assert_array_equal(got_v, v.astype(np.float16))
    rec = table.record("c1")
    assert (rec.n_tokens, rec.n_layers, rec.kv_heads, rec.head_dim) == (13, 4, H, D)
    assert rec.token_ids.tolist() == ids
    raw = table.get_layer_raw("c1", 2)  # a loader thread reads here, decodes elsewhere
    np.testing.assert_array_equal(raw.decode(np.float32).k, layers[2][0].astype(np.float16).astype(np.float32))


def test_put_is_idempotent(env):
    table = LocalKVTable(env, "model-a", "fp16")
    assert table.put_chunk("c1", tokens_for(1, 5), layers_for(1, 5))
    before = env.read(lambda txn: txn.get(table.key("c1").layer(0).to_bytes(), db=env.db("kv")))
    assert table.put_chunk("c1", tokens_for(1, 5), layers_for(2, 5)) is False  # not rewritten
    after = env.read(lambda txn: txn.get(table.key("c1").layer(0).to_bytes(), db=env.db("kv")))
    assert before == after


def test_other_tokens_under_the_same_id_are_refused(env):
    """A hash collision (same chunk id, other tokens) must never hand out the stored chunk's KV."""
    table = LocalKVTable(env, "model-a", "fp16")
    table.put_chunk("c1", tokens_for(1, 6), layers_for(1, 6))
    with pytest.raises(CorruptValue, match="token ids"):
        table.get_layer("c1", 0, expect_token_ids=tokens_for(2, 6))
    with pytest.raises(CorruptValue, match="token ids"):
        table.get_layer("c1", 0, expect_token_ids=tokens_for(1, 6)[:-1])
    with pytest.raises(CorruptValue, match="layers"):
        table.get_layer("c1", 4)
    with pytest.raises(MissingChunk):
        table.get_layer("nope", 0)


def test_models_and_codecs_do_not_mix(env):
    a16, a8, b16 = LocalKVTable(env, "model-a", "fp16"), LocalKVTable(env, "model-a", "int8"), LocalKVTable(env, "model-b", "fp16")
    a16.put_chunk("c1", tokens_for(1, 4), layers_for(1, 4))
    assert not a8.has("c1") and not b16.has("c1")
    a8.put_chunk("c1", tokens_for(1, 4), layers_for(1, 4))
    assert a8.get_layer("c1", 0).k.dtype == np.float32
    assert a16.get_layer("c1", 0).k.dtype == np.float16
    assert [c for c, _ in b16.iter_chunks()] == []


def test_missing_iter_and_delete(env):
    table = LocalKVTable(env, "model-a", "bf16")
    for i in range(5):
        table.put_chunk(f"c{i}", tokens_for(i, 3 + i), layers_for(i, 3 + i))
    assert table.missing(["c9", "c2", "c7", "c0"]) == ["c9", "c7"]
    table.put_chunk(preamble_chunk_id("p" * 32), tokens_for(99, 8), layers_for(99, 8))
    assert [c for c, _ in table.iter_chunks()] == [f"c{i}" for i in range(5)]
    assert len(list(table.iter_chunks(include_preamble=True))) == 6
    assert table.delete_chunk("c3") == 5  # 4 layers + record
    assert not table.has("c3") and chunk_keys(env, table, "c3") == []
    assert table.missing([f"c{i}" for i in range(5)]) == ["c3"]


def test_iteration_spans_many_read_batches(env, monkeypatch):
    import kvrag.store.kv as kvmod

    monkeypatch.setattr(kvmod, "SCAN_BATCH", 3)
    table = LocalKVTable(env, "model-a", "fp16")
    ids = [f"c{i:02d}" for i in range(10)]
    for i, c in enumerate(ids):
        table.put_chunk(c, tokens_for(i, 2), layers_for(i, 2, n_layers=2))
    table.claim(["zz"])  # a claim without a record is not a chunk
    assert [c for c, _ in table.iter_chunks()] == ids


def test_preamble_is_stored_once(env):
    table = LocalKVTable(env, "model-a", "fp16")
    ids = tokens_for(7, 20)
    assert table.put_chunk(preamble_chunk_id("ab" * 16), ids, layers_for(7, 20))
    assert not table.put_chunk(preamble_chunk_id("ab" * 16), ids, layers_for(7, 20))
    assert table.has(preamble_chunk_id("ab" * 16)) and not table.has(preamble_chunk_id("cd" * 16))
    k, _ = table.get_layer(preamble_chunk_id("ab" * 16), 3, expect_token_ids=ids)
    assert k.shape == (20, H, D)


def test_keyformer_subsets_keep_their_positions(env):
    table = LocalKVTable(env, "model-a", "int8")
    full = layers_for(3, 10)
    keep = [np.array([0, 2, 5, 9]), np.array([1, 2, 3, 4, 8])]  # one subset per layer
    table.put_chunk("c1", tokens_for(3, 10), [(k[p], v[p]) for (k, v), p in zip(full[:2], keep, strict=True)],
                    positions=keep)
    for layer, pos in enumerate(keep):
        out = table.get_layer("c1", layer)
        np.testing.assert_array_equal(out.positions, pos)
        assert out.k.shape == (len(pos), H, D)
    assert table.record("c1").kept == (4, 5)


class _FailingTxn:
    """Wraps a write transaction and fails after `ok` puts, recording the keys it wrote."""

    def __init__(self, txn, ok: int, log: list, exc: BaseException):
        self.txn, self.ok, self.log, self.exc = txn, ok, log, exc

    def put(self, key, value, **kw):
        if self.ok == 0:
            raise self.exc
        self.ok -= 1
        self.log.append(key)
        return self.txn.put(key, value, **kw)

    def __getattr__(self, name):
        return getattr(self.txn, name)


@pytest.mark.parametrize("exc", [RuntimeError("disk on fire"), KeyboardInterrupt()])
def test_a_failure_mid_put_leaves_nothing_of_the_chunk(env, monkeypatch, exc):
    table = LocalKVTable(env, "model-a", "fp16")
    table.put_chunk("c0", tokens_for(0, 4), layers_for(0, 4))
    real_write, log = env.write, []
    monkeypatch.setattr(env, "write", lambda fn: real_write(lambda txn: fn(_FailingTxn(txn, 3, log, exc))))
    with pytest.raises(type(exc)):
        table.put_chunk("c1", tokens_for(1, 4), layers_for(1, 4))
    assert len(log) == 3  # three layers were written inside the transaction ...
    assert not table.has("c1") and chunk_keys(env, table, "c1") == []  # ... and none of them is visible
    monkeypatch.undo()
    log.clear()
    monkeypatch.setattr(env, "write", lambda fn: real_write(lambda txn: fn(_FailingTxn(txn, 99, log, exc))))
    assert table.put_chunk("c1", tokens_for(1, 4), layers_for(1, 4))
    assert log[-1].endswith(TAG_RECORD) and len(log) == 5  # the record is the last write
    assert verify(env).ok and table.has("c0")


def test_the_map_grows_by_itself(tmp_path, monkeypatch):
    monkeypatch.setattr(envmod, "INITIAL_MAP_SIZE", 256 << 10)
    with StoreEnv.open(tmp_path / "s", create=True) as env:
        table = LocalKVTable(env, "model-a", "fp16")
        for i in range(12):  # ~200 KiB each, incompressible noise
            table.put_chunk(f"c{i}", tokens_for(i, 64), layers_for(i, 64, heads=3, dim=64))
        assert env.env.info()["map_size"] >= 2 << 20
        assert table.missing([f"c{i}" for i in range(12)]) == []
        assert verify(env).ok


def test_a_full_store_fails_clearly_and_keeps_what_it_had(tmp_path, monkeypatch):
    monkeypatch.setattr(envmod, "INITIAL_MAP_SIZE", 256 << 10)
    with StoreEnv.open(tmp_path / "s", create=True, max_map_size=1 << 20) as env:
        table = LocalKVTable(env, "model-a", "fp16")
        stored = []
        with pytest.raises(KvragError, match="full.*nothing stored was lost"):
            for i in range(20):
                table.put_chunk(f"c{i}", tokens_for(i, 64), layers_for(i, 64, heads=3, dim=64))
                stored.append(f"c{i}")
        assert 2 <= len(stored) < 20
        failed = f"c{len(stored)}"
        assert not table.has(failed) and chunk_keys(env, table, failed) == []
        for i, c in enumerate(stored):
            np.testing.assert_array_equal(table.get_layer(c, 3).v, layers_for(i, 64, heads=3, dim=64)[3][1].astype(np.float16))
        assert verify(env).ok
    with StoreEnv.open(tmp_path / "s") as env:  # and it reopens
        assert LocalKVTable(env, "model-a", "fp16").missing(stored) == []


def test_bad_layer_lists_are_refused(env):
    table = LocalKVTable(env, "model-a", "fp16")
    with pytest.raises(ValueError):
        table.put_chunk("c1", tokens_for(1, 5), layers_for(1, 4))  # 4 KV tokens, 5 token ids
    with pytest.raises(ValueError):
        table.put_chunk("c1", tokens_for(1, 5), [])
    with pytest.raises(ValueError):
        table.put_chunk("c1", tokens_for(1, 5), layers_for(1, 5)[:1] + layers_for(1, 5, heads=2)[:1])
    assert not table.has("c1")


def test_claims(env, monkeypatch):
    table = LocalKVTable(env, "model-a", "fp16")
    table.put_chunk("done", tokens_for(0, 2), layers_for(0, 2))
    assert table.claim(["done", "a", "b"], owner="host-x:1") == ["a", "b"]  # another machine's claim
    assert table.claim(["a", "b", "c"]) == ["c"]  # it binds us until it expires
    assert table.claim(["c"]) == ["c"]  # our own claim does not bind us
    table.put_chunk("c", tokens_for(1, 2), layers_for(1, 2))
    assert chunk_keys(env, table, "c")[0].endswith(b"L\x00\x00")  # storing the chunk dropped the claim
    monkeypatch.setattr(time, "time", lambda real=time.time: real() + 10_000)
    assert table.claim(["a"]) == ["a"]  # expired


def test_a_dead_process_claim_is_free_at_once(env):
    import socket
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    table = LocalKVTable(env, "model-a", "fp16")
    assert table.claim(["a"], owner=f"{socket.gethostname()}:{int(dead.stdout)}") == ["a"]
    assert table.claim(["a"]) == ["a"]  # e.g. a precompute killed with -9, run again
    raw = env.read(lambda txn: txn.get(table.key("a").claim_key(), db=env.db("kv")))
    assert json.loads(raw)["owner"].endswith(f":{__import__('os').getpid()}")
    table.release(["a"])
    assert chunk_keys(env, table, "a") == []


def test_shards_partition_the_ids():
    ids = [f"{i:032x}" for i in range(300)]
    shards = [Shard.parse(f"{i}/3") for i in range(3)]
    owned = [[c for c in ids if s.owns(c)] for s in shards]
    assert sorted(sum(owned, [])) == ids and all(60 < len(o) < 140 for o in owned)
    for bad in ("3/3", "1", "a/b", "-1/2"):
        with pytest.raises(KvragError):
            Shard.parse(bad)


_FULL_DISK = """
import resource, signal, sys
import numpy as np
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails like ENOSPC
resource.setrlimit(resource.RLIMIT_FSIZE, (3 << 20, 3 << 20))
import kvrag.store.env as envmod
envmod.INITIAL_MAP_SIZE = 1 << 20
from kvrag.errors import KvragError
from kvrag.store.env import StoreEnv
from kvrag.store.kv import LocalKVTable

table = LocalKVTable(StoreEnv.open(sys.argv[1], create=True), "model-a", "fp16")
stored = 0
try:
    for i in range(100):
        rng = np.random.default_rng(i)
        table.put_chunk(f"c{i}", list(range(64)), [(rng.standard_normal((64, 3, 64), dtype=np.float32),
                                                   rng.standard_normal((64, 3, 64), dtype=np.float32))] * 4)
        stored += 1
except KvragError as exc:
    print(stored)
    print(exc)
"""


def test_a_full_disk_fails_clearly_and_keeps_what_it_had(tmp_path):
    """A file-size limit stands in for a full disk: LMDB's commit fails as it would on ENOSPC."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _FULL_DISK, str(tmp_path / "s")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    stored, message = done.stdout.strip().split("\n")
    assert int(stored) >= 3 and "is the disk full?" in message and "nothing stored was lost" in message
    with StoreEnv.open(tmp_path / "s") as env:
        table = LocalKVTable(env, "model-a", "fp16")
        assert table.missing([f"c{i}" for i in range(int(stored) + 1)]) == [f"c{stored}"]
        assert verify(env).ok
