"""stats, verify (+ repair) and gc over a store with several models, codecs and kinds of damage."""

from __future__ import annotations

import numpy as np
import pytest

from kvrag.errors import KvragError
from kvrag.store.chunks import ChunkRecord, ChunkTable, DocChunk, DocRecord, IndexConfig
from kvrag.store.codec import HEADER_SIZE, CorruptValue
from kvrag.store.env import StoreEnv
from kvrag.store.keys import preamble_chunk_id
from kvrag.store.kv import LocalKVTable
from kvrag.store.maintenance import gc, stats, verify
from kvrag.store.manifest import check_or_record, preamble_hash, read_manifests

PREAMBLE = "You will be asked a question.\nPassages:\n"


def layers_for(seed: int, n_tokens: int, n_layers: int = 4):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((n_tokens, 3, 16), dtype=np.float32),
             rng.standard_normal((n_tokens, 3, 16), dtype=np.float32)) for _ in range(n_layers)]


def tokens_for(seed: int, n_tokens: int) -> list[int]:
    return np.random.default_rng(seed + 10_000).integers(0, 49152, n_tokens).tolist()


@pytest.fixture
def env(tmp_path):
    with StoreEnv.open(tmp_path / "store", create=True) as env:
        yield env


def cid(i: int) -> str:
    return f"{i:032x}"  # hex, like the indexer's blake2b ids


def fill(env: StoreEnv, model: str = "model-a", codec: str = "fp16", n: int = 4, first: int = 0) -> LocalKVTable:
    table = LocalKVTable(env, model, codec)
    check_or_record(env, model, PREAMBLE, codec)
    for i in range(first, first + n):
        table.put_chunk(cid(i), tokens_for(i, 5 + i), layers_for(i, 5 + i))
    table.put_chunk(preamble_chunk_id(preamble_hash(PREAMBLE)), tokens_for(99, 9), layers_for(99, 9))
    return table


def kv_get(env, key: bytes) -> bytes:
    return env.read(lambda txn: txn.get(key, db=env.db("kv")))


def kv_put(env, key: bytes, value: bytes) -> None:
    env.write(lambda txn: txn.put(key, value, db=env.db("kv")))


def flip(raw: bytes, at: int) -> bytes:
    b = bytearray(raw)
    b[at] ^= 0x01
    return bytes(b)


def test_stats(env):
    fill(env, "model-a", "fp16", n=3)
    fill(env, "model-a", "int8", n=2)
    check_or_record(env, "model-c", PREAMBLE, "bf16")  # a manifest, no KV yet
    s = stats(env)
    assert s.models == ("model-a", "model-c") and s.schema_version == 1
    by = {(g.model_fp, g.codec): g for g in s.groups}
    a16, a8 = by["model-a", "fp16"], by["model-a", "int8"]
    assert (a16.chunks, a16.tokens, a16.preamble_tokens) == (3, 5 + 6 + 7, 9)
    assert (a8.chunks, a8.tokens) == (2, 11)
    t = LocalKVTable(env, "model-a", "fp16")
    sizes = [sum(len(kv_get(env, t.key(cid(i)).layer(layer).to_bytes())) for i in range(3)) for layer in range(4)]
    assert a16.layer_bytes == tuple(sizes) and a16.bytes == sum(sizes)
    assert a8.bytes_per_token < a16.bytes_per_token
    assert s.used_bytes > a16.bytes


def test_verify_finds_and_repair_removes_every_kind_of_damage(env):
    table = fill(env, n=6)
    key = table.key
    layer0 = kv_get(env, key(cid(0)).layer(0).to_bytes())
    kv_put(env, key(cid(0)).layer(0).to_bytes(), flip(layer0, HEADER_SIZE + 20))  # flipped payload byte
    layer1 = kv_get(env, key(cid(1)).layer(1).to_bytes())
    kv_put(env, key(cid(1)).layer(1).to_bytes(), layer1[:-5])  # truncated
    env.write(lambda txn: txn.delete(key(cid(2)).layer(3).to_bytes(), db=env.db("kv")))  # a layer gone
    rec = kv_get(env, key(cid(3)).to_bytes())
    kv_put(env, key(cid(3)).to_bytes(), flip(rec, len(rec) - 1))  # damaged record (token ids)
    kv_put(env, key(cid(9)).layer(0).to_bytes(), layer0)  # a layer without a record
    kv_put(env, b"\x03zzz", b"junk")  # a key that is not ours
    report = verify(env)
    assert not report.ok
    bad = {(p.chunk_id, p.layer) for p in report.problems}
    assert {(cid(0), 0), (cid(1), 1), (cid(2), 3), (cid(3), None), (cid(9), None), ("?", None)} <= bad
    assert report.chunks == 2 + 1  # cid 4, 5 and the preamble are whole
    # the loader sees the same damage and gets CorruptValue (so `ask` recomputes the chunk)
    with pytest.raises(CorruptValue):
        table.get_layer(cid(0), 0)
    with pytest.raises(CorruptValue):
        table.get_layer(cid(1), 1)
    with pytest.raises(CorruptValue):
        table.get_layer(cid(2), 3)
    with pytest.raises(CorruptValue):
        table.get_layer(cid(3), 0)
    repaired = verify(env, repair=True)
    assert repaired.repaired_chunks == 5
    assert verify(env).ok
    assert table.missing([cid(i) for i in range(6)]) == [cid(i) for i in range(4)]  # precompute redoes them
    assert kv_get(env, b"\x03zzz") is None


def test_a_flipped_byte_on_disk_is_caught(tmp_path):
    path = tmp_path / "store"
    with StoreEnv.open(path, create=True) as env:
        table = fill(env, n=2)
        value = kv_get(env, table.key(cid(1)).layer(2).to_bytes())
    data = bytearray((path / "data.mdb").read_bytes())
    at = data.find(value)
    assert at >= 0
    while at >= 0:  # copy-on-write leaves stale copies of the page in free pages: flip them all
        data[at + HEADER_SIZE + len(value) // 3] ^= 0x40
        at = data.find(value, at + 1)
    (path / "data.mdb").write_bytes(bytes(data))
    with StoreEnv.open(path) as env:
        table = LocalKVTable(env, "model-a", "fp16")
        with pytest.raises(CorruptValue, match="checksum"):
            table.get_layer(cid(1), 2)
        table.get_layer(cid(1), 1)  # its neighbours are fine
        report = verify(env)
        assert [(p.chunk_id, p.layer) for p in report.problems] == [(cid(1), 2)]


def _index(env: StoreEnv, ids: list[int]) -> None:
    table = ChunkTable(env)
    table.write_config(IndexConfig("tok-a", "pf1", 512, 0))
    chunks = [ChunkRecord(cid(i), "doc", "", f"text {i}", 0, 6, tuple(tokens_for(i, 5 + i))) for i in ids]
    doc = DocRecord("doc", "doc.txt", "", "h", tuple(DocChunk(c.chunk_id, 0, 6, len(c.token_ids)) for c in chunks))
    table.put_docs([(doc, chunks)])


def test_gc_drops_kv_of_chunks_no_longer_indexed(env):
    a = fill(env, n=5)
    b = fill(env, "model-b", "int8", n=3)
    _index(env, [0, 2, 4])
    dead = LocalKVTable(env, "model-a", "fp16")
    dead.claim([cid(7)], owner="somehost:1")  # another host's live claim stays
    env.write(lambda txn: txn.put(a.key(cid(8)).claim_key(), b'{"owner": "x:1", "expires": 0}', db=env.db("kv")))
    dry = gc(env, ChunkTable(env).ids(), dry_run=True)
    assert (dry.dropped_chunks, dry.kept_chunks) == (2 + 1, 3 + 2 + 2)  # 2 preambles kept
    assert a.missing([cid(1)]) == []  # a dry run deletes nothing
    report = gc(env, ChunkTable(env).ids())
    assert report.dropped_chunks == 3 and report.dropped_bytes > 0
    assert a.missing([cid(i) for i in range(5)]) == [cid(1), cid(3)]
    assert b.missing([cid(i) for i in range(3)]) == [cid(1)]
    assert a.has(preamble_chunk_id(preamble_hash(PREAMBLE)))
    assert kv_get(env, a.key(cid(7)).claim_key()) is not None
    assert kv_get(env, a.key(cid(8)).claim_key()) is None  # an expired claim goes
    assert verify(env).ok


def test_gc_adopts_new_chunking_so_precompute_can_go_on(env):
    _index(env, [0, 1])
    fill(env, n=2)
    ChunkTable(env).write_config(IndexConfig("tok-a", "pf1", 256, 0))  # re-indexed with other chunking
    with pytest.raises(KvragError, match="chunk_tokens"):
        check_or_record(env, "model-a", PREAMBLE, "fp16")
    gc(env, ChunkTable(env).ids())
    assert check_or_record(env, "model-a", PREAMBLE, "fp16").chunking["chunk_tokens"] == 256


def test_gc_by_model(env):
    fill(env, "model-a", n=2)
    fill(env, "model-b", n=2)
    fill(env, "model-b", "int8", n=1)
    fill(env, "model-c", n=1)
    report = gc(env, None, keep_model="model-b")
    assert report.dropped_models == ("model-a", "model-c") and report.kept_chunks == 2 + 1 + 2
    assert set(read_manifests(env)) == {"model-b"}
    assert stats(env).models == ("model-b",)
    gc(env, None, drop_model="model-b")
    assert stats(env).models == () and stats(env).groups == ()


def test_gc_drops_a_preamble_no_manifest_refers_to(env):
    table = fill(env, n=1)
    table.put_chunk(preamble_chunk_id(preamble_hash("an old preamble")), tokens_for(5, 4), layers_for(5, 4))
    gc(env, None)
    assert table.has(preamble_chunk_id(preamble_hash(PREAMBLE)))
    assert not table.has(preamble_chunk_id(preamble_hash("an old preamble")))


def test_empty_store_reports_nothing(env):
    assert stats(env).groups == () and verify(env).ok and gc(env, set()).dropped_chunks == 0
