"""Chunk/document records in LMDB, the index config, and the vector index files (no models needed)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvrag.corpus import vector_index
from kvrag.corpus.vector_index import FLAT_MAX, VectorIndex, choose_factory, writer_lock
from kvrag.errors import KvragError
from kvrag.store.chunks import (
    INDEX_CONFIG_KEY,
    ChunkRecord,
    ChunkTable,
    DocChunk,
    DocRecord,
    IndexConfig,
    chunk_id_for,
)
from kvrag.store.env import StoreEnv


def record(tokens: tuple[int, ...], doc_id: str = "/d.txt", text: str = "héllo wörld", fp: str = "fp") -> ChunkRecord:
    return ChunkRecord(chunk_id_for(tokens, fp), doc_id, "Títle", text, 3, 3 + len(text), tokens)


def doc_of(doc_id: str, *chunks: ChunkRecord) -> DocRecord:
    return DocRecord(doc_id, doc_id, "t", f"hash-{doc_id}",
                     tuple(DocChunk(c.chunk_id, c.char_start, c.char_end, len(c.token_ids)) for c in chunks))


@pytest.fixture
def table(tmp_path):
    with StoreEnv.open(tmp_path / "store", create=True) as env:
        yield ChunkTable(env)


def test_chunk_record_round_trips_through_bytes():
    rec = record((0, 1, 49151, 2**31 - 1, 7))
    raw = rec.to_bytes()
    assert ChunkRecord.from_bytes(rec.chunk_id, raw) == rec
    assert raw.endswith(np.array(rec.token_ids, dtype="<i4").tobytes())  # little-endian int32, as documented


def test_chunk_id_is_blake2b_of_little_endian_ids_under_the_fingerprint():
    import hashlib

    expected = hashlib.blake2b(b"fp\0" + np.array([5, 6], dtype="<i4").tobytes(), digest_size=16,
                               person=b"kvrag-chunk").hexdigest()
    assert chunk_id_for((5, 6), "fp") == expected


def test_table_put_get_iter_count_and_ids(table):
    a, b = record((1, 2, 3)), record((4, 5), text="other")
    assert table.put_docs([(doc_of("/d.txt", a, b), [a, b])]) == 2
    assert table.get(a.chunk_id) == a and table.get("00" * 16) is None
    assert table.get_many([b.chunk_id, a.chunk_id]) == [b, a]
    assert table.ids() == {a.chunk_id, b.chunk_id}
    assert table.count() == 2
    assert sorted(table.iter(), key=lambda r: r.chunk_id) == sorted([a, b], key=lambda r: r.chunk_id)
    assert table.docs() == {"/d.txt": doc_of("/d.txt", a, b)}
    for bad in ("ff" * 16, "not-hex", "abcd"):  # absent, a typo, too short: one clear error, no traceback
        assert table.get(bad) is None
        with pytest.raises(KvragError, match=f"chunk {bad} is not in the store at "):
            table.get_many([a.chunk_id, bad])


def test_an_existing_chunk_is_never_rewritten(table):
    first = record((9, 9), doc_id="/first.txt")
    again = record((9, 9), doc_id="/second.txt")
    assert first.chunk_id == again.chunk_id
    table.put_docs([(doc_of("/first.txt", first), [first])])
    assert table.put_docs([(doc_of("/second.txt", again), [again])]) == 0
    assert table.get(first.chunk_id).doc_id == "/first.txt"


def test_removing_an_owner_moves_shared_chunks_and_gc_keeps_them(table):
    shared = record((1, 1), doc_id="/a.txt")
    only_a = record((2, 2), doc_id="/a.txt")
    b_copy = ChunkRecord(shared.chunk_id, "/b.txt", shared.title, shared.text, 40, 40 + len(shared.text), shared.token_ids)
    doc_b = doc_of("/b.txt", b_copy)
    table.put_docs([(doc_of("/a.txt", shared, only_a), [shared, only_a]), (doc_b, [b_copy])])
    table.remove_docs(["/a.txt"], {shared.chunk_id: [doc_b], only_a.chunk_id: []})
    moved = table.get(shared.chunk_id)
    assert (moved.doc_id, moved.char_start) == ("/b.txt", 40)
    assert "/a.txt" not in table.docs()
    assert table.get(only_a.chunk_id) is not None  # deleted only by delete_unreferenced
    assert table.delete_unreferenced({shared.chunk_id}) == [only_a.chunk_id]
    assert table.ids() == {shared.chunk_id}


def test_index_config_lives_in_meta_as_json(table):
    config = IndexConfig("tok", "fmt", 512, 0, "emb", "", "Flat")
    table.write_config(config)
    raw = table.env.read(lambda txn: txn.get(INDEX_CONFIG_KEY, db=table.env.db("meta")))
    assert json.loads(raw)["chunk_tokens"] == 512
    assert table.read_config() == config
    other = IndexConfig("tok2", "fmt", 256, 0)
    assert other.chunking_differences(config) == ["tokenizer_fingerprint 'tok' -> 'tok2'", "chunk_tokens 512 -> 256"]
    assert other.chunking_hash() != config.chunking_hash()
    assert IndexConfig("tok", "fmt", 512, 0, "another", "IVF8,Flat", "x").chunking_hash() == config.chunking_hash()


# -- vector index ---------------------------------------------------------------------------------

def unit_vectors(n: int, dim: int = 16, seed: int = 0) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def test_factory_choice_flat_then_ivf_with_stable_list_counts():
    assert choose_factory(10) == "Flat" and choose_factory(FLAT_MAX) == "Flat"
    assert choose_factory(FLAT_MAX + 1) == "IVF1024,Flat"  # 4*sqrt(100k) = 1265 -> 1024
    assert choose_factory(150_000) == choose_factory(200_000)  # growth alone does not force retraining
    assert choose_factory(5, "HNSW32") == "HNSW32"


def test_flat_search_is_exact(tmp_path):
    vectors = unit_vectors(200)
    ids = [chunk_id_for((i,), "fp") for i in range(200)]
    index = VectorIndex.build(ids, vectors, "Flat", "emb")
    queries = unit_vectors(5, seed=1)
    expected = np.argsort(-(queries @ vectors.T), axis=1)[:, :3]
    for hits, rows in zip(index.search(queries, 3), expected, strict=True):
        assert [h for h, _ in hits] == [ids[r] for r in rows]


def test_save_load_and_generations(tmp_path):
    ids = [chunk_id_for((i,), "fp") for i in range(64)]
    VectorIndex.build(ids, unit_vectors(64), "Flat", "emb").save(tmp_path)
    VectorIndex.build(ids[:10], unit_vectors(10), "IVF2,Flat", "emb").save(tmp_path)
    loaded = VectorIndex.load(tmp_path)
    assert (loaded.ids, loaded.factory, loaded.embedder) == (ids[:10], "IVF2,Flat", "emb")
    names = sorted(p.name for p in (tmp_path / "index").iterdir())
    assert names == ["current.json", "g000002.faiss", "g000002.ids.npy", "g000002.vec.npy"]


def test_a_crash_while_saving_leaves_the_previous_generation_live(tmp_path, monkeypatch):
    ids = [chunk_id_for((i,), "fp") for i in range(8)]
    VectorIndex.build(ids, unit_vectors(8), "Flat", "emb").save(tmp_path)
    real = vector_index._atomic_write

    def crash_at_pointer(path, write):
        if path.name == "current.json":
            raise OSError(28, "No space left on device")
        real(path, write)

    monkeypatch.setattr(vector_index, "_atomic_write", crash_at_pointer)
    with pytest.raises(OSError):
        VectorIndex.build(ids[:3], unit_vectors(3), "Flat", "emb").save(tmp_path)
    monkeypatch.undo()
    assert VectorIndex.load(tmp_path).ids == ids  # the old generation, whole
    VectorIndex.build(ids[:3], unit_vectors(3), "Flat", "emb").save(tmp_path)  # and the next save cleans up
    assert sorted(p.name for p in (tmp_path / "index").iterdir()) == [
        "current.json", "g000002.faiss", "g000002.ids.npy", "g000002.vec.npy"]


def test_bad_factories_are_one_line_user_errors():
    ids = [chunk_id_for((i,), "fp") for i in range(4)]
    with pytest.raises(KvragError, match="cannot build index 'Nonsense' on 4 vectors: could not parse"):
        VectorIndex.build(ids, unit_vectors(4), "Nonsense", "emb")
    with pytest.raises(KvragError, match="Number of training points"):
        VectorIndex.build(ids, unit_vectors(4), "IVF64,Flat", "emb")


def test_one_writer_at_a_time(tmp_path):
    with writer_lock(tmp_path):
        with pytest.raises(KvragError, match="another `kvrag index`"):
            with writer_lock(tmp_path):
                pass
    with writer_lock(tmp_path):  # released
        pass
